"""The Checkpointer in a real user loop (examples/loop/train.py): signals, kills, exact resume."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import EXAMPLES, generation_file, popen, same_generation, valid_steps, wait_for_step

from ripresa.store.history import History, read_history

LOOP = EXAMPLES / "loop" / "train.py"


def start(run, *args):
    return popen([sys.executable, str(LOOP), "--run", str(run), *map(str, args)])






@pytest.mark.slow
def test_sigusr1_checkpoints_and_continues(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "--steps", "100000", "--every", "0", "--sleep", "0.005")
    try:
        wait_for_step(run, 20, proc)
        assert valid_steps(run) == []
        proc.send_signal(signal.SIGUSR1)
        t0 = time.time()
        while not valid_steps(run) and time.time() - t0 < 30:
            time.sleep(0.02)
        gens = valid_steps(run)
        assert len(gens) == 1
        reached = wait_for_step(run, gens[0] + 20, proc)  # still training
        assert reached >= gens[0] + 20 and proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    events = read_history(run / ".loss.jsonl").events
    sig = [e for e in events if e["event"] == "signal"]
    assert sig[0]["action"] == "checkpoint" and "SIGUSR1" in sig[0]["signals"]
    assert sig[-1]["action"] == "stop" and "SIGTERM" in sig[-1]["signals"]


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_exits_0(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "--steps", "100000", "--every", "0", "--sleep", "0.005")
    wait_for_step(run, 30, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second SIGTERM must not abort the save
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    view = read_history(run / ".loss.jsonl")
    last = max(view.steps)
    assert valid_steps(run) == [last]
    ck = [e for e in view.events if e["event"] == "checkpoint"]
    assert ck[-1]["step"] == last and ck[-1]["reason"] == "stop"
    # Resume goes on from exactly that step.
    res = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", str(last + 5)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    resume = [e for e in read_history(run / ".loss.jsonl").events if e["event"] == "resume"]
    assert resume[-1]["from_step"] == last


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_matches_uninterrupted(tmp_path):
    total = 400
    ref = tmp_path / "ref"
    res = subprocess.run([sys.executable, str(LOOP), "--run", str(ref), "--steps", str(total), "--every", "50"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "run"
    rnd = random.Random(7)
    kills = 0
    for _ in range(4):
        done = max(read_history(run / ".loss.jsonl").steps or [0]) if (run / ".loss.jsonl").exists() else 0
        if done >= total - 20:
            break
        proc = start(run, "--steps", total, "--every", "50")
        try:
            before = max(valid_steps(run) or [0]) if run.exists() else 0
            wait_for_step(run, done + 1, proc)  # training has started in this process
            t0 = time.time()
            while max(valid_steps(run) or [0]) <= before and proc.poll() is None and time.time() - t0 < 60:
                time.sleep(0.02)  # ... and committed a new generation, so the next start resumes
            time.sleep(rnd.uniform(0.0, 0.3))
        finally:
            if proc.poll() is None:
                proc.kill()
                kills += 1
            proc.wait()
    assert kills >= 1
    res = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", str(total), "--every", "50"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert same_generation(ref, run, total)
    ha, hb = read_history(ref / ".loss.jsonl"), read_history(run / ".loss.jsonl")
    assert sorted(ha.steps) == sorted(hb.steps) == list(range(1, total + 1))
    assert [ha.steps[s]["loss"] for s in ha.steps] == [hb.steps[s]["loss"] for s in ha.steps]
    assert len([e for e in hb.events if e["event"] == "resume"]) >= 1  # at least one real resume


def test_history_torn_line_is_ignored_and_never_corrupts(tmp_path):
    path = tmp_path / ".loss.jsonl"
    h = History(path)
    for s in range(1, 4):
        h.step(s, loss=float(s))
    h.close()
    with open(path, "ab") as f:
        f.write(b'{"step":4,"loss":4.')  # killed mid-write
    view = read_history(path)
    assert sorted(view.steps) == [1, 2, 3] and view.skipped_lines == [4]
    h = History(path)
    assert h.repaired_torn_line
    h.step(4, loss=4.5)
    h.step(2, loss=2.5)  # a resumed run re-appends step 2: the last line wins
    h.close()
    view = read_history(path)
    assert view.steps[4]["loss"] == 4.5 and view.steps[2]["loss"] == 2.5 and view.steps[1]["loss"] == 1.0
    lines = path.read_bytes().splitlines()
    assert json.loads(lines[0])["step"] == 1 and lines[3] == b'{"step":4,"loss":4.'  # never rewritten


def test_fresh_refuses_a_non_empty_folder(tmp_path, tiny):
    import ripresa

    (tmp_path / "x").write_text("something")
    with pytest.raises(ripresa.BadInput, match="--fresh"):
        ripresa.Checkpointer(tmp_path, tiny, fresh=True, handle_signals=False)


@pytest.mark.slow
def test_resume_skips_a_newest_generation_damaged_after_its_commit(tmp_path):
    """Bit rot in the newest generation: the Checkpointer warns, records it and resumes from the previous one."""
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", "200", "--every", "100"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    newest = generation_file(run, 200)
    data = bytearray(newest.read_bytes())
    data[-(len(data) // 3)] ^= 0x04  # in the tensors' bytes, past the header
    newest.write_bytes(bytes(data))
    res = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", "210", "--every", "100"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert re.search(r"(\.safetensors )?generation 200 not used", res.stderr) and "sha256" in res.stderr
    events = read_history(run / ".loss.jsonl").events
    assert [e for e in events if e["event"] == "resume"][-1]["from_step"] == 100
    assert any(e["event"] == "skipped_generation" and "200" in e["reason"] for e in events)
