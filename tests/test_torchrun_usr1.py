"""SIGUSR1 never ends a run (docs/ARCHITECTURE.md, "Signals through the launcher").

SIGUSR1's default action ends a process. ``python -m ripresa.torchrun``
blocks it as its first act and starts every rank with it blocked, so a
SIGUSR1 stays pending in a rank until the rank's Checkpointer installs its
handler and unblocks it; a process that calls ``hold()`` first defers it;
after ``close()`` it is ignored with a note, and at interpreter exit ignored
outright. Real processes, real torchrun (2 gloo ranks), real signals sent at
random moments from the first line of ripresa's code to the process's exit.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ripresa.session import torchrun as launcher

CHILD = """
import signal, sys, time
time.sleep(float(sys.argv[1]))  # starting: no handler yet
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
t0 = time.monotonic()
while not got and time.monotonic() - t0 < 20:
    time.sleep(0.01)
print("usr1" if got else "none", flush=True)
"""

#: A real training loop (DDP over gloo under torchrun, or one process): trains, closes, lingers after close.
TRAINER = """
from ripresa.session.signals import hold
hold()  # a script's first line: what ripresa's own entry points do
import json, os, sys, time
import torch
import ripresa
ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if ddp:
    import torch.distributed as dist
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
ckpt = ripresa.Checkpointer(sys.argv[1], ripresa.TrainingState(model=model, optimizer=opt), every=0)
start = ckpt.resume()
for step in range(start + 1, int(sys.argv[2]) + 1):
    loss = net(torch.ones(2, 4)).square().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)
    if ckpt.step_done(step, loss=loss.item()):
        break
ckpt.close()
time.sleep(float(sys.argv[3]))  # after close: signals still arrive
rank = int(os.environ.get("RANK", "0"))
open(os.path.join(sys.argv[1], f"done.{rank}"), "w").write(str(ckpt.progress.step))
if ddp:
    dist.barrier()
    dist.destroy_process_group()
"""


def _status_bit(pid: int, field: bytes, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(field):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _ripresa_is_running(pid: int) -> bool:
    """ripresa's first line has run in ``pid``: SIGUSR1 is blocked (the launcher) or caught (hold())."""
    return _status_bit(pid, b"SigBlk:", signal.SIGUSR1) or _status_bit(pid, b"SigCgt:", signal.SIGUSR1)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONDONTWRITEBYTECODE="1")


def _storm(proc: subprocess.Popen, rng: random.Random, *, ranks: bool, gap: float, limit: float = 240) -> int:
    """SIGUSR1 at random moments from ripresa's first line until ``proc`` exits (to it, and to its ranks); the count."""
    t0 = time.monotonic()
    while not _ripresa_is_running(proc.pid):
        assert proc.poll() is None and time.monotonic() - t0 < 60, "the process never reached ripresa's first line"
    sent = 0
    while proc.poll() is None:
        assert time.monotonic() - t0 < limit, "the run did not end"
        targets = [proc.pid] + (launcher.children(proc.pid) if ranks else [])
        try:
            os.kill(rng.choice(targets), signal.SIGUSR1)
            sent += 1
        except ProcessLookupError:
            pass
        time.sleep(rng.uniform(0, gap))
    return sent


def _events(run: Path) -> list[str]:
    import json

    return [json.loads(x).get("event") for x in (run / ".loss.jsonl").read_text().splitlines() if x.strip()]


def _torchrun(script: Path, run: Path, steps: int, linger: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ripresa.torchrun", "--standalone", "--nproc_per_node=2", str(script),
                             str(run), str(steps), str(linger)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(), start_new_session=True)


@pytest.mark.slow
def test_a_sigusr1_storm_through_a_torchrun_runs_whole_life_ends_nothing(tmp_path):
    """Start, rank start (import, group, resume), training, saves, close, after close, exit: 0 deaths."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    run = tmp_path / "run"
    proc = _torchrun(script, run, 30, 0.5)
    try:
        sent = _storm(proc, random.Random(20), ranks=True, gap=0.15)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"launcher exit {proc.returncode} after {sent} SIGUSR1:\n{out[-3000:]}"
    assert (run / "done.0").read_text() == (run / "done.1").read_text() == "30", out[-3000:]
    assert "signal" in _events(run) and sent > 10, (sent, out[-2000:])


@pytest.mark.slow  # the default tier keeps the torchrun storm; this one is the single-process path
def test_one_process_that_holds_first_survives_a_sigusr1_storm_and_notes_those_after_close(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run), "30", "1.0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
    try:
        sent = _storm(proc, random.Random(21), ranks=False, gap=0.06)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"exit {proc.returncode} after {sent} SIGUSR1:\n{out[-3000:]}"
    assert (run / "done.0").read_text() == "30"
    assert "signal" in _events(run)
    assert "SIGUSR1 after the Checkpointer closed: ignored" in out  # the second after close.


@pytest.mark.slow
def test_a_sigusr1_at_random_offsets_from_the_launchers_first_line_never_ends_the_run(tmp_path):
    """One SIGUSR1 per launch at a random offset (start, rank start, training, close): every launch exits 0."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    rng = random.Random(22)
    for i in range(12):
        run = tmp_path / f"run{i}"
        proc = _torchrun(script, run, 30, 0.3)
        try:
            t0 = time.monotonic()
            while not _ripresa_is_running(proc.pid) and proc.poll() is None:
                assert time.monotonic() - t0 < 60
            time.sleep(rng.uniform(0, 8))
            targets = [proc.pid, *launcher.children(proc.pid)]
            os.kill(rng.choice(targets), signal.SIGUSR1)
            out, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, (i, out[-3000:])
        assert (run / "done.0").exists() and (run / "done.1").exists(), (i, out[-2000:])


@pytest.mark.slow
def test_a_rank_whose_launcher_is_killed_dies_with_it(tmp_path):
    """torchrun starts ranks in sessions of their own: a SIGKILL of the launcher's group must not orphan them."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    run = tmp_path / "run"
    proc = _torchrun(script, run, 100000, 0)
    try:
        t0 = time.monotonic()
        while not (run / ".loss.jsonl").exists() or b'"step"' not in (run / ".loss.jsonl").read_bytes():
            assert proc.poll() is None and time.monotonic() - t0 < 120, proc.stdout.read()[-2000:]
            time.sleep(0.05)
        ranks = launcher.children(proc.pid)
        assert len(ranks) == 2
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        t1 = time.monotonic()
        while any(Path(f"/proc/{r}").exists() and b"zombie" not in Path(f"/proc/{r}/status").read_bytes()
                  for r in ranks):
            assert time.monotonic() - t1 < 10, "a rank trains on after its launcher was killed"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_sigusr1_forwarded_to_a_starting_rank_waits_for_its_handler():
    """A child not started by the launcher (no blocked SIGUSR1): the signal waits until it catches it."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, "1.0"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        assert not launcher.catches(child.pid, signal.SIGUSR1)  # still starting
        launcher._forward(signal.SIGUSR1, None)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0, child.returncode  # not ended by SIGUSR1's default action (-10)
    assert out.strip() == "usr1"  # and the signal was delivered once the handler existed


def test_a_rank_with_its_handler_gets_sigusr1_at_once():
    child = subprocess.Popen([sys.executable, "-c", CHILD, "0"], stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not launcher.catches(child.pid, signal.SIGUSR1):
            assert time.monotonic() - t0 < 20
            time.sleep(0.01)
        launcher._forward(signal.SIGUSR1, None)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip() == "usr1"


UNCLOSED = """
import atexit, signal, sys
import torch
import ripresa
# registered before the session's own exit hook, so it runs after it (atexit is last in, first out)
atexit.register(lambda: print("at exit:", "ignored" if signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN else
                              repr(signal.getsignal(signal.SIGUSR1)), flush=True))
model = torch.nn.Linear(2, 1)
ckpt = ripresa.Checkpointer(sys.argv[1], ripresa.TrainingState(model=model), every=0)
ckpt.resume()
raise SystemExit("the script ends by an error, its Checkpointer never closed")
"""


def test_a_session_never_closed_leaves_sigusr1_ignored_at_interpreter_exit(tmp_path):
    """The interpreter puts SIG_DFL back for every Python handler as it exits: a SIGUSR1 landing then would end
    a process that is leaving by an error of its own (exit -10 instead of its exit status). The session's
    handler is replaced by SIG_IGN at exit, as after close() (the soak saw the window: seed 2131)."""
    res = subprocess.run([sys.executable, "-c", UNCLOSED, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "at exit: ignored" in res.stdout, res.stdout + res.stderr[-2000:]


STARTING_RANK = """
import os, sys, time
from pathlib import Path
mark = Path(sys.argv[1])
rank = os.environ["RANK"]
(mark / f"{rank}.started").touch()
time.sleep(float(sys.argv[2]))  # still starting (importing torch, say) when its launcher is killed
import ripresa  # a rank of python -m ripresa.torchrun: dies with its launcher from here on, or now if it is gone
(mark / f"{rank}.imported").touch()
import torch.distributed as dist
dist.init_process_group("gloo")  # with the launcher gone: a rendezvous with a store that is gone
"""


def test_a_rank_whose_launcher_is_killed_while_it_starts_ends_at_import_ripresa(tmp_path):
    """Before the Checkpointer binds a rank to its launcher, ``import ripresa`` does: a rank whose launcher was
    killed during its start ends there, never waits out a rendezvous with a store that is gone (the soak,
    seed 2132: ranks alive 20 s after their launcher's SIGKILL)."""
    script = tmp_path / "rank.py"
    script.write_text(STARTING_RANK)
    mark = tmp_path / "marks"
    mark.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "ripresa.torchrun", "--standalone", "--nproc_per_node=2",
                             str(script), str(mark), "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(), start_new_session=True)
    try:
        t0 = time.monotonic()
        while len(list(mark.glob("*.started"))) < 2:
            assert proc.poll() is None and time.monotonic() - t0 < 120, proc.stdout.read()[-2000:]
            time.sleep(0.05)
        ranks = launcher.children(proc.pid)
        assert len(ranks) == 2
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks run in sessions of their own: they are not hit
        proc.wait(timeout=30)
        t1 = time.monotonic()
        while any(Path(f"/proc/{r}").exists() and b"zombie" not in Path(f"/proc/{r}/status").read_bytes()
                  for r in ranks):
            assert time.monotonic() - t1 < 20, "a rank lives on after its launcher was killed during its start"
            time.sleep(0.05)
        assert not list(mark.glob("*.imported"))  # it ended at the import, before any rendezvous
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for r in launcher.children(proc.pid) if proc.poll() is None else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r, signal.SIGKILL)
