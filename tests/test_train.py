"""`ripresa train` end to end: real processes, real signals, exact resume, zombie arms, audits."""

from __future__ import annotations

import json
import random
import signal
import sys
import time

import numpy as np
import pytest
from conftest import ripresa_cli, ripresa_train_proc, valid_steps, wait_for_step

from ripresa.engine.gpt.model import CONFIGS
from ripresa.formats.andrea_bin import read_bin
from ripresa.store.history import read_history

FAST = ["--config", "tiny", "--quiet", "--set", "train.batch_size=4", "--threads", "1"]








@pytest.mark.slow
def test_train_writes_generations_audits_sidecars_and_resumes(tmp_path):
    run = tmp_path / "run"
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "20", "--every", "10")
    assert res.returncode == 0, res.stderr
    assert valid_steps(run) == [10, 20]
    n = CONFIGS["tiny"].param_count()
    assert (run / "step_000020.bin").stat().st_size == 8 + 12 * n
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["name"] == "tiny" and cfg["train"]["batch_size"] == 4
    samples = json.loads((run / ".samples.json").read_text())
    assert [a["step"] for a in samples["audits"]] == [10, 20]  # an audit at every checkpoint
    assert all(s["completion"] for a in samples["audits"] for s in a["samples"])
    state = json.loads((run / ".state.json").read_text())
    assert set(state["arms"]) == {"stdlib-code", "stdlib-docstrings", "pydoc-topics"}
    assert sum(s["pulls"] for s in state["stats"].values()) == 20
    view = read_history(run / ".loss.jsonl")
    assert sorted(view.steps) == list(range(1, 21))
    assert all({"loss", "lr", "arm", "tokens"} <= set(r) for r in view.steps.values())
    # Starting again on the folder resumes automatically, and says so; --steps is the run's end step.
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "25", "--every", "10")
    assert res.returncode == 0, res.stderr
    assert "resumed" in res.stdout and "step 20" in res.stdout
    events = read_history(run / ".loss.jsonl").events
    assert [e for e in events if e["event"] == "resume"][-1]["from_step"] == 20
    assert valid_steps(run) == [10, 20, 25]  # the end between cadence points is saved
    # --fresh refuses it.
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "1", "--fresh")
    assert res.returncode == 2 and "--fresh" in res.stderr


@pytest.mark.slow
def test_verify_the_engine_at_tolerance_zero(tmp_path):
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--contract", "--steps", "6", "--cut", "3", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-m", "ripresa", "train", *FAST, "--every", "0", "--no-audit")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((out / "verification.json").read_text())
    assert report["all_checks_passed"] and report["tolerance"]["absolute"] == 0.0
    checks = {c["name"]: c for c in report["checks"]["resume"]}
    assert checks["parameters"]["values_compared"] > 100_000 and checks["parameters"]["max_abs_gap"] == 0.0


@pytest.mark.slow
def test_sigusr1_then_sigterm_on_a_running_train(tmp_path):
    run = tmp_path / "run"
    proc = ripresa_train_proc("--run", run, *FAST, "--every", "0", "--no-audit")
    try:
        wait_for_step(run, 5, proc)
        res = ripresa_cli("signal", run, "checkpoint")
        assert res.returncode == 0 and "SIGUSR1" in res.stdout
        t0 = time.time()
        while not valid_steps(run) and time.time() - t0 < 60:
            time.sleep(0.05)
        first = valid_steps(run)
        assert len(first) == 1
        wait_for_step(run, first[0] + 3, proc)  # it continued
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    last = max(read_history(run / ".loss.jsonl").steps)
    assert valid_steps(run)[-1] == last > first[0]
    assert "stopped by signal" in out
    res = ripresa_cli("signal", run, "stop")
    assert res.returncode == 2 and "no process" in res.stderr


@pytest.mark.slow
def test_sigkill_at_random_moments_then_identical_to_uninterrupted(tmp_path):
    total = 60
    ref = tmp_path / "ref"
    res = ripresa_cli("train", "--run", ref, *FAST, "--steps", total, "--every", "4", "--no-audit")
    assert res.returncode == 0, res.stderr
    run = tmp_path / "run"
    rnd = random.Random(3)
    kills = 0
    for _ in range(3):
        done = max(valid_steps(run) or [0]) if run.exists() else 0
        if done >= total - 8:
            break
        proc = ripresa_train_proc("--run", run, *FAST, "--steps", total, "--every", "4", "--no-audit")  # the same command
        try:
            wait_for_step(run, done + 1, proc)  # training has started in this process
            time.sleep(rnd.uniform(0.0, 0.4))
        finally:
            if proc.poll() is None:
                proc.kill()
                kills += 1
            proc.wait()
    assert kills >= 1
    done = max(valid_steps(run) or [0])
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", total, "--every", "4", "--no-audit")
    assert res.returncode == 0, res.stderr
    a, b = read_bin(ref / f"step_{total:06d}.bin"), read_bin(run / f"step_{total:06d}.bin")
    assert np.array_equal(a.weights, b.weights) and np.array_equal(a.m, b.m) and np.array_equal(a.v, b.v)
    ha, hb = read_history(ref / ".loss.jsonl"), read_history(run / ".loss.jsonl")
    assert [ha.steps[s]["loss"] for s in range(1, total + 1)] == [hb.steps[s]["loss"] for s in range(1, total + 1)]
    assert [ha.steps[s]["arm"] for s in range(1, total + 1)] == [hb.steps[s]["arm"] for s in range(1, total + 1)]


@pytest.mark.slow
def test_sample_audits_do_not_perturb_training(tmp_path):
    a, b = tmp_path / "audits", tmp_path / "none"
    assert ripresa_cli("train", "--run", a, *FAST, "--steps", "6", "--every", "2").returncode == 0
    assert ripresa_cli("train", "--run", b, *FAST, "--steps", "6", "--every", "2", "--no-audit").returncode == 0
    assert len(json.loads((a / ".samples.json").read_text())["audits"]) == 3
    assert not (b / ".samples.json").exists()
    x, y = read_bin(a / "step_000006.bin"), read_bin(b / "step_000006.bin")
    assert np.array_equal(x.weights, y.weights) and np.array_equal(x.v, y.v)


@pytest.mark.slow
def test_zombie_arm_is_dropped_with_a_warning_and_an_event(tmp_path):
    extra = tmp_path / "extra.txt"
    extra.write_text("zombie text " * 500)
    run = tmp_path / "run"
    res = ripresa_cli("train", "--run", run, *FAST, "--source", f"extra={extra}", "--steps", "8", "--every", "4", "--no-audit")
    assert res.returncode == 0, res.stderr
    assert "extra" in json.loads((run / ".state.json").read_text())["arms"]
    extra.unlink()  # the source is gone
    res = ripresa_cli("train", "--run", run, "--quiet", "--threads", "1", "--steps", "12", "--every", "4", "--no-audit")
    assert res.returncode == 0, res.stderr
    assert "zombie" in res.stderr.lower()
    events = read_history(run / ".loss.jsonl").events
    zombies = [e for e in events if e["event"] == "zombie_arm"]
    assert zombies and all(z["arm"] == "extra" for z in zombies)
    state = json.loads((run / ".state.json").read_text())
    assert "extra" not in state["arms"]
    assert all(r["arm"] != "extra" for s, r in read_history(run / ".loss.jsonl").steps.items() if s > 8)


@pytest.mark.slow
def test_foreign_bin_resumes_weights_m_v_with_a_warning(tmp_path):
    run = tmp_path / "run"
    assert ripresa_cli("train", "--run", run, *FAST, "--steps", "4", "--every", "4", "--no-audit").returncode == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "step_000004.bin").write_bytes((run / "step_000004.bin").read_bytes())  # no companion, no sidecar
    res = ripresa_cli("train", "--output", tmp_path / "out", *FAST, "--steps", "2", "--resume", foreign / "step_000004.bin", "--no-audit")
    assert res.returncode == 0, res.stderr
    assert "bit-equivalent modulo data randomness" in res.stderr
    ev = [e for e in read_history(tmp_path / "out" / ".loss.jsonl").events if e["event"] == "resume"][0]
    assert ev["foreign"] and ev["from_step"] == 4 and ev["lacks"]


@pytest.mark.parametrize("name", ["tiny", "andrea-12m", "andrea-120m"])
def test_bin_size_formula_for_every_config(name):
    """8 + 12·n: tiny is checked on disk above; the big ones by their exact parameter count."""
    import torch

    from ripresa.engine.gpt.model import GPT

    with torch.device("meta"):
        model = GPT(CONFIGS[name])
    n = sum(p.numel() for p in model.parameters())
    assert n == CONFIGS[name].param_count()
    target = {"tiny": None, "andrea-12m": 12.8e6, "andrea-120m": 120e6}[name]
    if target:
        assert abs(n - target) / target <= 0.05
    from ripresa.formats.andrea_bin import BinHeader

    assert BinHeader(step=1, n_params=n).file_size == 8 + 12 * n


@pytest.mark.slow
def test_andrea_12m_one_step_bin_on_disk(tmp_path):
    run = tmp_path / "run"
    res = ripresa_cli("train", "--run", run, "--config", "andrea-12m", "--quiet", "--set", "train.batch_size=1",
                      "--steps", "1", "--every", "1", "--no-audit", timeout=900)
    assert res.returncode == 0, res.stderr
    assert (run / "step_000001.bin").stat().st_size == 8 + 12 * CONFIGS["andrea-12m"].param_count()
