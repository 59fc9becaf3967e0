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
                                   "parent-wrong-start", "parent-bare-pid"])
def test_import_ripresa_with_a_stale_or_forged_launcher_variable_survives(value):
    """On main: any process whose variable named a pid that had ended SIGKILLed itself at the import (137)."""
    dead = _dead_pid()
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        raw = {
            "stale-dead": f"{dead}:{launcher.start_time(os.getpid())}",
            "stale-old-format": str(dead),
            "reused-pid": f"{os.getpid()}:1",  # a live pid, but not the process that was the launcher
            "live-not-parent": launcher.launcher_value(stranger.pid),  # a live process, not this one's parent
            "garbage": "12\u0663:\n-1",
            "parent-wrong-start": f"{os.getpid()}:{(launcher.start_time(os.getpid()) or 0) + 1}",
            "parent-bare-pid": str(os.getpid()),  # names its live parent: bound to it, harmless while it lives
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
(mark / "helper.pid.tmp").write_text(str(os.getpid()))
os.replace(mark / "helper.pid.tmp", mark / "helper.pid")  # whole or absent: the test reads it as soon as it exists
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


def _aliases(run: Path, n: int) -> Path:
    """A real generation whose companion lists ``n`` aliases (as a crafted one may); its tensor file."""
    import json

    comp = _generation(run)
    doc = json.loads(comp.read_text())
    doc["aliases"] = {f"model/a{i:07d}": "model/weight" for i in range(n)}
    comp.write_text(json.dumps(doc))
    return run / "step_000001.safetensors"


def test_inspect_a_companion_of_350k_aliases_prints_a_capped_list(tmp_path):
    """On main: one line per alias, 350k of them, still printing after 60 s."""
    res, took = _inspect(str(_aliases(tmp_path / "run", 350_000)))
    assert res.returncode == 1, res.stderr[-2000:]  # the companion no longer matches its marker
    alias_rows = [ln for ln in res.stdout.splitlines() if " -> model/weight" in ln]
    assert 0 < len(alias_rows) <= 64, len(alias_rows)
    assert f"... {350_000 - len(alias_rows):,} more aliases" in res.stdout
    assert len(res.stdout.splitlines()) < 400 and took < 30, (len(res.stdout.splitlines()), took)


@pytest.mark.slow
def test_inspect_json_keeps_every_alias_in_bounded_time(tmp_path):
    import json

    res, took = _inspect("--json", str(_aliases(tmp_path / "run", 350_000)))
    assert res.returncode == 1 and len(json.loads(res.stdout)["safetensors"]["aliases"]) == 350_000
    assert took < 30, took


def test_a_warning_repeated_per_damaged_generation_is_capped(tmp_path):
    """A run folder of 200 damaged generations above a valid one: 64 warnings, then one that counts the rest
    (on main: one warning per generation, 200 lines, each a few hundred characters)."""
    import shutil
    import warnings

    from ripresa.console import MAX_LISTED
    from ripresa.store.commit import CheckpointWarning
    from ripresa.store.kinds import latest_valid_of

    run = tmp_path / "run"
    _generation(run)
    for step in range(2, 202):  # a copy under another step's name: its marker and companion say step 1
        for suffix in ("", ".json", ".sha256"):
            shutil.copyfile(run / f"step_000001.safetensors{suffix}", run / f"step_{step:06d}.safetensors{suffix}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = latest_valid_of(run, ("general",), deep=False)
    assert gen is not None and gen.step == 1
    texts = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert len(texts) == MAX_LISTED + 1, len(texts)
    assert all(" not used: " in t for t in texts[:-1]) and "generation 201 not used" in texts[0]
    assert texts[-1] == f"... {200 - MAX_LISTED} more .safetensors generations not used (older ones were tried)"


@pytest.mark.slow
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


# --- 3. every session of a verified process is steered ----------------------------------------------------

TWO_PHASE = '''
import argparse
import torch
import ripresa

class RandintSampler:
    """Row ids from the global torch generator (so a resume without the random streams diverges)."""
    def __init__(self, n, batch):
        self.n, self.batch, self.batches = n, batch, 0
    def next_batch(self):
        self.batches += 1
        return torch.randint(0, self.n, (self.batch,))
    def state_dict(self):
        return {"batches": self.batches}
    def load_state_dict(self, state):
        self.batches = state["batches"]

ap = argparse.ArgumentParser()
ap.add_argument("--run", required=True)
ap.add_argument("--run2", required=True)
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--steps2", type=int, default=3)
args = ap.parse_args()

def phase(run, steps, seed):
    torch.manual_seed(seed)
    X = torch.randn(64, 4)
    Y = X.sum(1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = RandintSampler(len(X), 8)
    ckpt = ripresa.Checkpointer(run, ripresa.TrainingState(model=model, optimizer=opt, data=sampler), every=2)
    start = ckpt.resume()
    for step in range(start + 1, steps + 1):
        ids = sampler.next_batch()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X[ids]), Y[ids])
        loss.backward()
        opt.step()
        if ckpt.step_done(step, loss=loss.item()):
            break
    ckpt.close(final_save=True)

phase(args.run, args.steps, 0)    # pretraining
phase(args.run2, args.steps2, 1)  # then a second phase, in a second run folder, in the same process
'''


def _listing(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder``: kind, size, mtime_ns and the content's sha256 (files)."""
    import hashlib
    import stat

    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
        out[str(p.relative_to(folder))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def test_every_checkpointer_of_a_steered_process_is_steered(tmp_path, monkeypatch):
    """In one process: the first session records and stops; each later one gets its own folder, never the named one."""
    import torch

    import ripresa
    from ripresa.session.steer import ENV, Steering
    from ripresa.verify.trajectory import read_trajectory

    def state():
        return ripresa.TrainingState(model=torch.nn.Linear(2, 1))

    steer = Steering("continuous", tmp_path / "out" / "run", tmp_path / "out", stop_at=2)
    monkeypatch.setenv(ENV, steer.to_env()[ENV])
    first = ripresa.Checkpointer(tmp_path / "a", state(), every=0, handle_signals=False)
    assert first.resume() == 0 and not first.step_done(1, loss=1.0) and first.step_done(2, loss=0.5)
    first.close(final_save=True)
    runs = []
    for name in ("b", "a", "c"):  # a second phase, the first folder again, a third
        ckpt = ripresa.Checkpointer(tmp_path / name, state(), every=1, handle_signals=False)
        runs.append(ckpt.run_dir)
        assert ckpt.resume() == 0
        assert [ckpt.step_done(s, loss=0.0) for s in (1, 2, 3)] == [False] * 3  # no steered stop, no recording
        ckpt.close()
    assert runs == [tmp_path / "out" / f"session-{n}" for n in (2, 3, 4)]
    assert not any((tmp_path / name).exists() for name in "abc")  # the folders the script names: never created
    doc = read_trajectory(tmp_path / "out" / "summary.json")
    assert [s["loss"] for s in doc["steps"]] == [1.0, 0.5] and doc["final"]["progress"]["step"] == 2
    assert sorted(p.name for p in (tmp_path / "out" / "run").glob("step_*.*")) == [
        "step_000002.safetensors", "step_000002.safetensors.json", "step_000002.safetensors.sha256"]


@pytest.mark.slow
def test_ripresa_verify_of_a_two_phase_script_never_touches_its_run_folders(tmp_path):
    """On main the second Checkpointer of the script trained in the user's real second run folder (created
    there, with generations, history and retention) during each of the four paths."""
    import json

    script = tmp_path / "two_phase.py"
    script.write_text(TWO_PHASE)
    real_a, real_b = tmp_path / "real-a", tmp_path / "real-b"
    _generation(real_a)  # the user's real first run, with a generation
    before = _listing(real_a)
    assert any(k.startswith("step_") for k in before)
    out = tmp_path / "proof"
    res = subprocess.run([sys.executable, "-m", "ripresa", "verify", "--steps", "6", "--cut", "3", "--tolerance", "0",
                          "--output", str(out), "--", sys.executable, "-B", str(script), "--run", str(real_a),
                          "--run2", str(real_b), "--steps", "2000", "--steps2", "3"],
                         capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _listing(real_a) == before and not real_b.exists()  # the user's runs: untouched, not created
    r = json.loads((out / "verification.json").read_text())
    assert r["mode"] == "steered" and r["all_checks_passed"] and r["positive"] and r["negative_divergence_detected"]
    for path in ("continuous", "interrupted", "resume", "resume-without-rng"):
        assert list((out / path / "session-2").glob("step_000003.*")), path  # the second phase ran, steered
    resumed = json.loads((out / "resume" / "summary.json").read_text())
    assert [s["step"] for s in resumed["steps"]] == [4, 5, 6]  # the recording: the first session only
    assert resumed["resumed_from"].endswith("step_000003.safetensors")


LIGHTNING_TWO_FITS = '''
import os, sys
sys.path.insert(0, os.environ["EXAMPLE_DIR"])
import lightning.pytorch as pl
from torch.utils.data import DataLoader
from train import NoisyRegression, Regressor
from ripresa.integrations.lightning import ExactResume

run, scratch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
pl.seed_everything(0, workers=True)
model = Regressor()
loader = DataLoader(NoisyRegression(), batch_size=8, shuffle=True, num_workers=0)
for i, max_steps in enumerate((steps, steps + 4)):  # a second fit() of the same run, with the callback again
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, callbacks=[ExactResume(run, every=2)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=scratch)
    trainer.fit(model, loader)
'''


@pytest.mark.slow
def test_ripresa_verify_of_two_lightning_fits_never_touches_the_run_folder(tmp_path):
    """On main the second ``fit()`` (a new ExactResume Checkpointer) trained in the user's real run folder."""
    import json

    pytest.importorskip("lightning")
    script = tmp_path / "two_fits.py"
    script.write_text(LIGHTNING_TWO_FITS)
    real = tmp_path / "real-run"
    out = tmp_path / "proof"
    res = subprocess.run([sys.executable, "-m", "ripresa", "verify", "--steps", "8", "--cut", "3", "--tolerance", "0",
                          "--output", str(out), "--", sys.executable, "-B", str(script), str(real),
                          str(tmp_path / "scratch"), "2000"], capture_output=True, text=True, timeout=900,
                         env=_env(EXAMPLE_DIR=str(ROOT / "examples" / "lightning")), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not real.exists()
    r = json.loads((out / "verification.json").read_text())
    assert r["all_checks_passed"] and r["positive"] and r["negative_divergence_detected"], r["first_divergence"]
    for path in ("continuous", "interrupted", "resume", "resume-without-rng"):
        assert (out / path / "session-2").is_dir(), path  # the second fit, steered
