"""The soak with the memory tier on (``tests/soak/soak.py --memory-every K``; issue 31): steps redone per SIGKILL.

For each interruption that ends a trainer the soak measures the steps redone: the last step line in the
lap's history when it landed minus the step the next start resumed from. With the memory tier every step
(``Checkpointer(memory_every=1)``, a generation in ``/dev/shm``), a SIGKILL of a trainer whose run folder
stays must redo at most one step, and every lap must still end bitwise equal to the uninterrupted run;
with the tier off the same kills redo up to the disk cadence (10 steps here). The default tier runs a few
real SIGKILLs of one lane; the slow tier runs every SIGKILL kind of both single-process lanes, before
(off: more than one step redone) and after (on: at most one).

``test_a_sigkill_right_after_a_step_line_redoes_at_most_one_step`` pins what the soak found: the history
line of step N used to be written before the capture of step N-1 was committed (its hash still running on
the tier's thread), so a SIGKILL right after that line found step N-2 in memory and redid two steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent / "soak" / "soak.py"
SINGLE = ("sigkill", "sigkill-start", "sigusr1+kill")


def _soak(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="160")
    res = subprocess.run([sys.executable, str(SOAK), "--out", str(out), "--fresh-share", "0", *args],
                         capture_output=True, text=True, timeout=900, env=env)
    return res, json.loads((out / "soak.json").read_text())


def _redone(rec: dict, kinds: tuple[str, ...]) -> list[int]:
    return [v for lane in rec["lanes"].values() for k, vs in lane.get("redone_by_kind", {}).items()
            if k in kinds for v in vs]


def test_soak_with_the_memory_tier_redoes_at_most_one_step_per_sigkill(tmp_path):
    res, rec = _soak(tmp_path, "--seed", "41", "--interruptions", "5", "--lanes", "andrea", "--kinds", "sigkill",
                     "--total", "200", "--memory-every", "1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lane = rec["lanes"]["andrea"]
    assert rec["memory_every"] == lane["memory_every"] == 1
    assert rec["delivered"] == rec["survived"] == 5 and rec["lost"] == 0 and rec["diverged_steps"] == 0
    assert rec["equal_laps"] == rec["laps"] >= 1
    redone = _redone(rec, ("sigkill",))
    assert len(redone) >= 3, lane  # kills that landed before the lap's end, each measured at the next start
    assert max(redone) <= 1, lane
    assert lane["memory_resumes"] >= 1, lane  # resumed from /dev/shm, not from the disk (every 10 steps)
    assert rec["redone_per_interruption"]["sigkill"]["max"] == max(redone)
    assert "steps redone per interruption (memory tier every 1 step(s))" in " ".join(res.stdout.split())


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import ripresa
    import ripresa.store.memory as mem

    run, kill_at = sys.argv[1], int(sys.argv[2])
    if kill_at:  # the tier's hash slower than a step (as for a large state): its marker comes 0.5 s late
        write = mem._write_small
        def late_marker(path, data):
            if path.name.endswith(".marker"):
                time.sleep(0.5)
            write(path, data)
        mem._write_small = late_marker
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = ripresa.Checkpointer(run, ripresa.TrainingState(model=model, optimizer=opt), every=0, memory_every=1)
    start = ckpt.resume()
    print("start", start, flush=True)
    if kill_at:
        line = ckpt.history.step
        def step_line(step, **metrics):
            line(step, **metrics)
            if step == kill_at:  # step kill_at is recorded: the SIGKILL lands right after its line
                os.kill(os.getpid(), signal.SIGKILL)
        ckpt.history.step = step_line
    for step in range(start + 1, 7):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step_done(step, loss=loss.item())
    ckpt.close()
""")


def test_a_sigkill_right_after_a_step_line_redoes_at_most_one_step(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    killed = subprocess.run([sys.executable, "-c", CHILD, str(run), "4"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    lines = [json.loads(x) for x in (run / ".loss.jsonl").read_text().splitlines() if x.strip()]
    assert max(x["step"] for x in lines if "event" not in x) == 4  # the killed run's last step line
    again = subprocess.run([sys.executable, "-c", CHILD, str(run), "0"], capture_output=True, text=True,
                           timeout=120, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "start 3" in again.stdout, again.stdout + again.stderr  # step 3 from memory: one step redone, not two
    events = [json.loads(x) for x in (run / ".loss.jsonl").read_text().splitlines() if '"memory_resume"' in x]
    assert [(e["step"], e["newest_disk"]) for e in events] == [(3, None)], events


@pytest.mark.slow
def test_soak_steps_redone_before_and_after_the_memory_tier(tmp_path):
    """Every SIGKILL kind of both single-process lanes: off, the disk cadence (10) bounds the steps redone and
    more than one is seen; on (every step), at most one, the laps bitwise and nothing lost."""
    args = ("--seed", "43", "--interruptions", "16", "--lanes", "general,andrea", "--kinds", ",".join(SINGLE),
            "--total", "300")
    off_res, off = _soak(tmp_path / "off", *args)
    assert off_res.returncode == 0, off_res.stdout[-3000:] + off_res.stderr[-3000:]
    before = _redone(off, SINGLE)
    assert len(before) >= 8 and max(before) > 1, off["redone_per_interruption"]  # the bar can fail
    on_res, on = _soak(tmp_path / "on", *args, "--memory-every", "1")
    assert on_res.returncode == 0, on_res.stdout[-3000:] + on_res.stderr[-3000:]
    after = _redone(on, SINGLE)
    assert len(after) >= 8 and max(after) <= 1, on["redone_per_interruption"]
    assert on["lost"] == 0 and on["diverged_steps"] == 0 and on["equal_laps"] == on["laps"] >= 2
    assert sum(lane["memory_resumes"] for lane in on["lanes"].values()) >= 4
    assert sum(before) / len(before) > sum(after) / len(after)
