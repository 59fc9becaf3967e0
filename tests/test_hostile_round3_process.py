"""Hostile inputs, round three (issue 29): the launcher's variable, output floods, steering of every session.

* The launcher's variable (``RIPRESA_LAUNCHER_PID``) is trusted only in the launcher's own child, removed
  from the environment at ``import ripresa``, and a rank that finds its launcher gone says so in one line
  (docs/ARCHITECTURE.md, "Signals through the launcher").
* Every list a command prints is capped (docs/INSPECT.md, "Long lists").
* ``ripresa verify`` steers every session of the verified process, not only the first (docs/VERIFY.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ripresa.session import torchrun as launcher

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONDONTWRITEBYTECODE="1")
    env.pop(launcher.LAUNCHER_ENV, None)
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        return b"zombie" not in Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return False


def _blocks(pid: int, signum: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_bytes().splitlines():
        if line.startswith(b"SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


# --- 1. the launcher's variable ------------------------------------------------------------------------

IMPORT = """
import os, subprocess, sys
import ripresa
print("alive", os.environ.get("RIPRESA_LAUNCHER_PID"), flush=True)
# what this process starts never sees the variable
out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('RIPRESA_LAUNCHER_PID'))"],
                     capture_output=True, text=True).stdout.strip()
print("child", out, flush=True)
"""


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no such process (until the pid is reused, which the start time also rules out)


@pytest.mark.parametrize("value", ["stale-dead", "stale-old-format", "reused-pid", "live-not-parent", "garbage",
                                   "parent-wrong-start"])
def test_import_ripresa_with_a_stale_or_forged_launcher_variable_survives(value):
    """On main: any process whose variable named a pid that had ended SIGKILLed itself at the import (137)."""
    dead = _dead_pid()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        raw = {
            "stale-dead": f"{dead}:{launcher._start_time(os.getpid())}",
            "stale-old-format": str(dead),
            "reused-pid": f"{os.getpid()}:1",  # a live pid, but not the process that was the launcher
            "live-not-parent": launcher.launcher_value(stranger.pid),  # a live process, not this one's parent
            "garbage": "12\u0663:\n-1",
            "parent-wrong-start": f"{os.getpid()}:{(launcher._start_time(os.getpid()) or 0) + 1}",
        }[value]
        res = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, timeout=60,
                             env=_env(RIPRESA_LAUNCHER_PID=raw))
    finally:
        stranger.kill()
        stranger.wait()
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.split() == ["alive", "None", "child", "None"], res.stdout  # stripped at the import
    assert res.stderr == "", res.stderr


RANK = """
import os, subprocess, sys, time
from pathlib import Path
mark = Path(sys.argv[1])
raw = os.environ["RIPRESA_LAUNCHER_PID"]
import ripresa  # bound to its launcher (this process's parent, pid and start time)
assert "RIPRESA_LAUNCHER_PID" not in os.environ
# a detached helper started with the variable put back (as one started before the import would have it)
subprocess.Popen([sys.executable, "-c", sys.argv[2], str(mark)], env=dict(os.environ, RIPRESA_LAUNCHER_PID=raw),
                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(mark / "helper.err", "w"))
(mark / "rank.ready").touch()
time.sleep(120)
"""

HELPER = """
import os, sys, time
from pathlib import Path
mark = Path(sys.argv[1])
(mark / "helper.pid").write_text(str(os.getpid()))
while not (mark / "go").exists():  # until its rank and the launcher are gone
    time.sleep(0.02)
import ripresa
(mark / "helper.imported").touch()
"""

FAKE_LAUNCHER = """
import os, subprocess, sys, time
from ripresa.session.torchrun import launcher_value
env = dict(os.environ, RIPRESA_LAUNCHER_PID=launcher_value())
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1], sys.argv[3]], env=env)
print(rank.pid, flush=True)
time.sleep(120)
"""


def test_a_helper_a_rank_started_survives_its_rank_and_launcher(tmp_path):
    """The launcher's variable in a process the rank started (detached, in a session of its own): on main it
    SIGKILLed itself at ``import ripresa`` once the launcher had ended; the variable proves nothing there."""
    mark = tmp_path / "marks"
    mark.mkdir()
    fake = subprocess.Popen([sys.executable, "-c", FAKE_LAUNCHER, str(mark), RANK, HELPER], stdout=subprocess.PIPE,
                            text=True, env=_env())
    helper = None
    try:
        rank = int(fake.stdout.readline())
        t0 = time.monotonic()
        while not (mark / "rank.ready").exists() or not (mark / "helper.pid").exists():
            assert fake.poll() is None and time.monotonic() - t0 < 60
            time.sleep(0.05)
        helper = int((mark / "helper.pid").read_text())
        fake.kill()  # the launcher's SIGKILL: its rank dies with it (PR_SET_PDEATHSIG)
        fake.wait()
        t1 = time.monotonic()
        while _alive(rank):
            assert time.monotonic() - t1 < 10, "a rank lives on after its launcher was killed"
            time.sleep(0.05)
        assert _alive(helper)  # the helper is no rank: it lives on
        (mark / "go").touch()
        t2 = time.monotonic()
        while _alive(helper):
            assert time.monotonic() - t2 < 60
            time.sleep(0.05)
        assert (mark / "helper.imported").exists(), (mark / "helper.err").read_text()[-2000:]
    finally:
        fake.kill()
        for pid in (helper,):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


STARTING_RANK = """
import os, sys, time
from pathlib import Path
mark = Path(sys.argv[1])
rank = os.environ["RANK"]
(mark / f"{rank}.started").touch()
time.sleep(float(sys.argv[2]))  # still starting when its launcher is killed
import ripresa  # finds its launcher gone: one line, exit 2
(mark / f"{rank}.imported").touch()
"""


def test_a_rank_whose_launcher_is_gone_says_so_in_one_line(tmp_path):
    """The genuine case: torchrun's rank whose launcher was SIGKILLed ends at ``import ripresa`` as before, now
    with a line that names the launcher (on main it SIGKILLed itself, silently)."""
    script = tmp_path / "rank.py"
    script.write_text(STARTING_RANK)
    mark = tmp_path / "marks"
    mark.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "ripresa.torchrun", "--standalone", "--nproc_per_node=2",
                             str(script), str(mark), "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=_env(), start_new_session=True)
    ranks: list[int] = []
    try:
        t0 = time.monotonic()
        while len(list(mark.glob("*.started"))) < 2:
            assert proc.poll() is None and time.monotonic() - t0 < 120
            time.sleep(0.05)
        ranks = launcher.children(proc.pid)
        assert len(ranks) == 2
        for r in ranks:  # forked bound to the launcher: its parent-death signal, blocked until the import
            assert _blocks(r, launcher.LAUNCHER_DEATH_SIGNAL)
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.stdout.read().decode(errors="replace")  # until every rank (a writer of the pipe) has ended
        proc.wait(timeout=30)
        while any(_alive(r) for r in ranks):  # ended; reaped by its new parent a moment later
            assert time.monotonic() - t0 < 60, out[-3000:]
            time.sleep(0.05)
        assert not list(mark.glob("*.imported"))
        lines = [ln for ln in out.splitlines() if "launcher of this rank" in ln]
        assert len(lines) == 2, out[-3000:]
        for ln in lines:
            assert ln.startswith("ripresa: error: ") and f"pid {proc.pid}" in ln and "exit 2" in ln, ln
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r, signal.SIGKILL)


# --- 2. output floods ------------------------------------------------------------------------------------

def _generation(run: Path) -> Path:
    """A real general generation (step 1) of a tiny model; its companion's path."""
    import torch

    import ripresa

    ckpt = ripresa.Checkpointer(run, ripresa.TrainingState(model=torch.nn.Linear(2, 2)), every=1,
                                handle_signals=False)
    ckpt.resume()
    ckpt.step_done(1)
    ckpt.close()
    return run / "step_000001.safetensors.json"


def _inspect(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ripresa", "inspect", *args], capture_output=True, text=True,
                         timeout=timeout, env=_env(COLUMNS="100", RIPRESA_PROGRESS="0"))
    return res, time.monotonic() - t0


def test_capped_counts_the_rest_without_keeping_it():
    from ripresa.console import MAX_LISTED, capped, capped_lines, joined

    shown, more = capped(iter(range(1_000_000)))  # an iterator: counted, never kept
    assert shown == list(range(MAX_LISTED)) and more == 1_000_000 - MAX_LISTED
    assert capped({i: i for i in range(70)}) == ([(i, i) for i in range(64)], 6)
    assert capped([1, 2]) == ([1, 2], 0)
    assert joined(range(10), limit=3, what="steps") == "0, 1, 2, ... 7 more steps"
    assert capped_lines(range(100), str)[-1] == f"... {100 - MAX_LISTED} more"


def test_inspect_a_companion_of_350k_aliases_prints_a_capped_list(tmp_path):
    """On main: one line per alias, 350k of them, still printing after 60 s."""
    import json

    comp = _generation(tmp_path / "run")
    doc = json.loads(comp.read_text())
    doc["aliases"] = {f"model/a{i:07d}": "model/weight" for i in range(350_000)}
    comp.write_text(json.dumps(doc))
    res, took = _inspect(str(tmp_path / "run" / "step_000001.safetensors"))
    assert res.returncode == 1, res.stderr[-2000:]  # the companion no longer matches its marker
    alias_rows = [ln for ln in res.stdout.splitlines() if " -> model/weight" in ln]
    assert 0 < len(alias_rows) <= 64, len(alias_rows)
    assert f"... {350_000 - len(alias_rows):,} more aliases" in res.stdout
    assert len(res.stdout.splitlines()) < 400 and took < 30, (len(res.stdout.splitlines()), took)
    res, took = _inspect("--json", str(tmp_path / "run" / "step_000001.safetensors"))  # --json: every alias
    assert len(json.loads(res.stdout)["safetensors"]["aliases"]) == 350_000 and took < 30


def test_inspect_a_run_folder_of_thousands_of_leftovers_prints_capped_lists(tmp_path):
    """Thousands of leftover temporaries: the table of them and the warning repeated for each, both capped."""
    _generation(tmp_path / "run")
    n = 5000
    for i in range(n):
        (tmp_path / "run" / f".step_000002.safetensors.tmp.{4_000_000 + i % 50}.{i:08x}").touch()
    res, took = _inspect(str(tmp_path / "run"))
    lines = res.stdout.splitlines()
    assert res.returncode in (0, 1), res.stderr[-2000:]
    assert len(lines) < 500, len(lines)
    assert any("more temporary files" in ln for ln in lines), res.stdout[-3000:]
    assert any("more warnings" in ln for ln in lines), res.stdout[-3000:]
    assert took < 30
