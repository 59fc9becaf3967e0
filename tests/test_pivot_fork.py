"""Pivot on a live trainer and audit forks, through the real CLI."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
from conftest import ripresa_cli, ripresa_train_proc, wait_for_step

from ripresa.formats.andrea_bin import read_bin
from ripresa.io.lock import read_lock_holder
from ripresa.store.history import read_history
from ripresa.store.store import CheckpointStore

FAST = ["--quiet", "--threads", "1", "--set", "train.batch_size=4"]


def start_train(run, *extra):
    return ripresa_train_proc("--run", run, "--config", "tiny", *FAST, *extra)




def same_arrays(a, b):
    x, y = read_bin(a), read_bin(b)
    return np.array_equal(x.weights, y.weights) and np.array_equal(x.m, y.m) and np.array_equal(x.v, y.v)


@pytest.mark.slow
def test_pivot_on_a_live_trainer(tmp_path):
    run = tmp_path / "run"
    proc = start_train(run, "--steps", "100000", "--every", "50")
    try:
        wait_for_step(run, 60, proc)
        # An invalid policy is refused before anything is stopped.
        bad = ripresa_cli("pivot", run, "--floors", "stdlib-code=0.9", "pydoc-topics=0.9")
        assert bad.returncode == 2 and "floors" in bad.stderr.lower()
        assert proc.poll() is None and read_lock_holder(run).pid == proc.pid
        assert not (run / "archive").exists()
        res = ripresa_cli("pivot", run, "--caps", "stdlib-code=0.2", "--floors", "pydoc-topics=0.4")
        assert res.returncode == 0, res.stderr
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    view = read_history(run / ".loss.jsonl")
    pivot_ev = [e for e in view.events if e["event"] == "pivot"][-1]
    step = pivot_ev["step"]
    assert step == max(view.steps) and sorted(view.steps) == list(range(1, step + 1))  # continuous history
    assert pivot_ev["trainer"]["sigusr1_step"] <= step
    arch = run / "archive" / f"pivot_{step:06d}"
    assert json.loads((arch / ".state.json").read_text())["phase"] == 0
    assert (arch / ".samples.json").is_file()
    assert not (run / ".state.json").exists() and not (run / ".samples.json").exists()
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["mixture"]["phase"] == 1 and cfg["mixture"]["caps"] == {"stdlib-code": 0.2}
    # The pivot generation resumes exactly: weights, m and v as saved.
    out_dir = tmp_path / "check"
    res = ripresa_cli("train", "--output", out_dir, "--config", run / "config.json", *FAST, "--steps", "0",
                      "--resume", run / f"step_{step:06d}.bin", "--no-audit")
    assert res.returncode == 0, res.stderr
    assert same_arrays(run / f"step_{step:06d}.bin", out_dir / f"step_{step:06d}.bin")
    # Restart: the bandit is fresh under the new policy, the history goes on.
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", step + 20, "--every", "10")  # the end step
    assert res.returncode == 0, res.stderr
    view = read_history(run / ".loss.jsonl")
    assert sorted(view.steps) == list(range(1, step + 21))
    assert [e for e in view.events if e["event"] == "bandit_fresh"][-1]["phase"] == 1
    state = json.loads((run / ".state.json").read_text())
    last_ckpt = [e for e in view.events if e["event"] == "checkpoint"][-1]["step"]
    assert state["phase"] == 1 and sum(s["pulls"] for s in state["stats"].values()) == last_ckpt - step  # .state.json: at checkpoints
    assert state["policy"]["caps"] == {"stdlib-code": 0.2}
    samples = json.loads((run / ".samples.json").read_text())
    assert all(a["step"] > step for a in samples["audits"])  # a fresh sample log


@pytest.mark.slow
def test_pivot_a_stopped_run_with_restart(tmp_path):
    run = tmp_path / "run"
    assert ripresa_cli("train", "--run", run, "--config", "tiny", *FAST, "--steps", "20", "--every", "10", "--no-audit").returncode == 0
    res = ripresa_cli("pivot", run, "--caps", "stdlib-docstrings=0.5", "--restart")
    assert res.returncode == 0, res.stderr
    assert "restarted the trainer" in res.stdout
    t0 = time.time()
    while read_lock_holder(run) is None and time.time() - t0 < 60:
        time.sleep(0.05)
    assert read_lock_holder(run) is not None
    t0 = time.time()
    while time.time() - t0 < 60:
        if any(e["event"] == "bandit_fresh" for e in read_history(run / ".loss.jsonl").events):
            break
        time.sleep(0.1)
    assert ripresa_cli("signal", run, "stop").returncode == 0
    t0 = time.time()
    while read_lock_holder(run) is not None and time.time() - t0 < 60:
        time.sleep(0.05)
    assert read_lock_holder(run) is None
    assert "resumed" in (run / "train.log").read_text()


@pytest.mark.slow
def test_forks_from_one_step_start_identical_and_diverge(tmp_path):
    parent = tmp_path / "parent"
    assert ripresa_cli("train", "--run", parent, "--config", "tiny", *FAST, "--steps", "30", "--every", "10", "--no-audit").returncode == 0
    a, b = tmp_path / "a", tmp_path / "b"
    ra = ripresa_cli("fork", parent, "--step", "20", "--into", a, "--set", "train.lr=0.01")
    rb = ripresa_cli("fork", parent, "--step", "20", "--into", b, "--set", "train.lr=0.0001")
    assert ra.returncode == 0 and rb.returncode == 0, ra.stderr + rb.stderr
    assert same_arrays(a / "step_000020.bin", b / "step_000020.bin")
    assert same_arrays(a / "step_000020.bin", parent / "step_000020.bin")
    assert sorted(p.name for p in a.glob("step_*")) == ["step_000020.bin", "step_000020.bin.sha256", "step_000020.json"]
    lineage = json.loads((a / "lineage.json").read_text())
    assert lineage["step"] == 20 and lineage["overrides"] == ["train.lr=0.01"] and len(lineage["bin_sha256"]) == 64
    hist = read_history(a / ".loss.jsonl")
    assert max(hist.steps) == 20 and hist.events[-1]["event"] == "fork"
    assert subprocess.run(["sha256sum", "-c", "step_000020.bin.sha256"], cwd=a, capture_output=True).returncode == 0
    for d in (a, b):
        res = ripresa_cli("train", "--run", d, *FAST, "--steps", "30", "--every", "10", "--no-audit")  # end step
        assert res.returncode == 0, res.stderr
        assert "resumed" in res.stdout and "step 20" in res.stdout
    assert not same_arrays(a / "step_000030.bin", b / "step_000030.bin")
    la = read_history(a / ".loss.jsonl").steps
    lb = read_history(b / ".loss.jsonl").steps
    assert abs(la[21]["lr"] - 0.01) < 1e-4 and lb[21]["lr"] < 5e-4  # the overrides apply from the first step


@pytest.mark.slow
def test_fork_refuses_bad_sources_and_destinations(tmp_path):
    parent = tmp_path / "parent"
    assert ripresa_cli("train", "--run", parent, "--config", "tiny", *FAST, "--steps", "20", "--every", "10", "--no-audit").returncode == 0
    res = ripresa_cli("fork", parent, "--step", "15", "--into", tmp_path / "x")
    assert res.returncode == 2 and "no generation 15" in res.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "f").write_text("keep")
    res = ripresa_cli("fork", parent, "--step", "20", "--into", busy)
    assert res.returncode == 2 and "not empty" in res.stderr and (busy / "f").read_text() == "keep"
    data = bytearray((parent / "step_000010.bin").read_bytes())
    data[100] ^= 1
    (parent / "step_000010.bin").write_bytes(bytes(data))
    res = ripresa_cli("fork", parent, "--step", "10", "--into", tmp_path / "y")
    assert res.returncode == 1 and "sha256" in res.stderr
    assert not (tmp_path / "y").exists()
    assert [g.step for g in CheckpointStore(parent, writer=False).generations(deep=True) if g.valid] == [20]
