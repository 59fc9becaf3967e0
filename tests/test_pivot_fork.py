"""Pivot on a live trainer and audit forks, through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

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


# ---------------------------------------------------------------- pivot --restart: the original flags, safely


def config_only_run(tmp_path: Path) -> Path:
    """A run folder with the tiny config and nothing trained (enough for what a pivot checks before stopping)."""
    from ripresa.engine.gpt.config import named_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(named_config("tiny"), indent=2))
    return run


def test_pivot_restart_refuses_a_planted_train_log_link(tmp_path):
    """``pivot --restart`` appends to RUN/train.log without following a link out of the folder: exit 2 first."""
    run = config_only_run(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    os.symlink(outside, run / "train.log")
    cfg = (run / "config.json").read_bytes()
    res = ripresa_cli("pivot", run, "--caps", "stdlib-docstrings=0.5", "--restart")
    assert res.returncode == 2 and "train.log is a symlink" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and outside.read_text() == "keep"
    assert (run / "config.json").read_bytes() == cfg and not (run / "archive").exists()  # refused before anything


@pytest.mark.slow
def test_pivot_restart_refuses_a_planted_train_log_fifo(tmp_path):
    run = config_only_run(tmp_path)
    os.mkfifo(run / "train.log")
    res = ripresa_cli("pivot", run, "--caps", "stdlib-docstrings=0.5", "--restart", timeout=60)
    assert res.returncode == 2 and "train.log" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (run / "archive").exists()


def planted_dcp(run: Path, world: int, key: bytes | None = None) -> None:
    """A real .dcp generation whose companion now says ``world`` ranks, marker recomputed (what anyone can do)."""
    from support.helpers import rebless_dcp
    from test_dcp_hostile import _dcp_generation

    from ripresa.formats import dcp as dcp_fmt

    gen = _dcp_generation(run, 5, key=key)
    doc = json.loads((gen.path / dcp_fmt.COMPANION_NAME).read_bytes())
    doc["world_size"] = world
    rebless_dcp(run, 5, companion=doc)


def test_pivot_restart_bounds_the_world_size_of_a_planted_dcp(tmp_path):
    """Issue 19 class 5: a planted ``.dcp`` asking for 2^20 ranks passes a hash check (no key); the restart
    refuses it (BadInput: exit 2) before anything is stopped, never starting a million processes."""
    from ripresa.engine.pivot import pivot
    from ripresa.errors import BadInput

    run = config_only_run(tmp_path)
    planted_dcp(run, 2**20)
    with pytest.raises(BadInput, match="world size") as err:
        pivot(run, caps=["stdlib-docstrings=0.5"], restart=True)
    assert "1048576 ranks" in str(err.value.found)
    assert not (run / "archive").exists() and not (run / "train.log").exists()


@pytest.mark.slow
def test_pivot_restart_of_a_planted_dcp_exits_2(tmp_path):
    run = config_only_run(tmp_path)
    planted_dcp(run, 2**20)
    res = ripresa_cli("pivot", run, "--caps", "stdlib-docstrings=0.5", "--restart")
    assert res.returncode == 2 and "world size" in res.stderr and "1048576 ranks" in res.stderr, res.stderr
    assert not (run / "archive").exists() and not (run / "train.log").exists()


@pytest.mark.slow
def test_restart_world_size_comes_from_a_verified_generation(tmp_path, monkeypatch):
    from test_dcp_hostile import KEY

    from ripresa.engine.pivot import _newest_generation, max_nproc, restart_command
    from ripresa.errors import BadInput
    from ripresa.io import auth

    run = config_only_run(tmp_path)
    planted_dcp(run, 2)  # within the bound: a sharded restart on 2 ranks
    cmd = restart_command(run, None, _newest_generation(run))
    assert cmd[1:4] == ["-P", "-m", "ripresa.torchrun"] and "--nproc_per_node=2" in cmd and cmd[-2:] == ["--shard", "fsdp"]
    planted_dcp(tmp_path / "big", max_nproc() + 1)
    (tmp_path / "big" / "config.json").write_text((run / "config.json").read_text())
    with pytest.raises(BadInput, match="world size"):
        restart_command(tmp_path / "big", None, _newest_generation(tmp_path / "big"))
    # Signatures required: an unsigned (planted) .dcp is no generation at all; a signed one gives its world size.
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    assert _newest_generation(tmp_path / "big") is None
    assert "ripresa.torchrun" not in restart_command(tmp_path / "big", None, None)
    signed = tmp_path / "signed"
    planted_dcp(signed, 2**20, key=KEY)  # the companion edited after signing: the signature no longer matches
    assert _newest_generation(signed) is None
    # A planted launch record asking for 2^20 ranks is bounded the same way.
    launch = {"command": "ripresa train", "options": {"shard": "ddp"}, "world_size": 2**20, "local_world_size": 2**20}
    with pytest.raises(BadInput, match="world size"):
        restart_command(run / "none", launch, None)


@pytest.mark.parametrize("record,found", [
    ({"command": "ripresa train", "options": {"threads": "1; rm -rf /"}}, "threads"),
    ({"command": "ripresa train", "options": {"output": "/elsewhere"}}, "output"),
    ({"command": "ripresa train", "options": {"mirror": "--fresh\n"}}, "mirror"),
    ({"command": "ripresa train", "options": []}, "options"),
    ({"command": "ripresa train", "options": {}, "world_size": 0}, "world_size"),
    ({"command": "ripresa train", "options": {"mtbf": "bogus"}}, "bogus"),
    ({"command": "ripresa train", "options": {"deadline": "72h"}}, "72h"),  # recorded as a time, never a duration
])
def test_a_malformed_launch_record_is_refused_before_anything(tmp_path, record, found):
    """The record is replayed as a command: every field is checked, nothing passes through (BadInput: exit 2)."""
    from ripresa.engine.pivot import pivot
    from ripresa.errors import BadInput

    run = config_only_run(tmp_path)
    (run / ".loss.jsonl").write_text(json.dumps({"event": "launch", **record}) + "\n")
    with pytest.raises(BadInput, match="launch record is malformed") as err:
        pivot(run, caps=["stdlib-docstrings=0.5"], restart=True)
    assert found in str(err.value)
    assert not (run / "archive").exists()


def test_restart_command_is_the_recorded_process_flags(tmp_path):
    """The rebuild, exactly: the recorded process flags as --opt=value, not the config-shaping ones, run by
    ``python -P -m ripresa`` (ripresa's own code); a redacted mirror URL is refused, never replayed."""
    import sys

    from ripresa.engine.pivot import restart_command
    from ripresa.errors import BadInput

    run = tmp_path / "run"
    opts = {"config": "tiny", "sets": ["train.lr=1"], "sources": ["x=/d"], "steps": 20, "every": "auto",
            "device": "cpu", "audit": False, "asynchronous": False, "quiet": True, "threads": 1,
            "allow_version_change": False, "allow_code_change": True, "allow_data_change": False, "shard": "ddp",
            "mirror": "s3://bucket/runs", "mtbf": "6h", "max_redo": "30m", "deadline": "2026-12-24T18:00:00+00:00",
            "require_signature": True}
    launch = {"command": "ripresa train", "options": opts, "world_size": 1, "local_world_size": 1}
    assert restart_command(run, launch, None) == [
        sys.executable, "-P", "-m", "ripresa", "train", "--run", str(run), "--steps=20", "--every=auto",
        "--threads=1", "--mtbf=6h", "--max-redo=30m", "--deadline=2026-12-24T18:00:00+00:00", "--device=cpu",
        "--mirror=s3://bucket/runs", "--no-audit", "--sync", "--quiet", "--allow-code-change", "--require-signature"]
    launch["world_size"] = launch["local_world_size"] = 2
    assert restart_command(run, launch, None)[3:7] == ["ripresa.torchrun", "--standalone", "--nproc_per_node=2", "-m"]
    with pytest.raises(BadInput, match="without its password"):
        restart_command(run, {**launch, "options": {**opts, "mirror": "/x/user:***@host/y"}}, None)


def test_the_launch_record_never_holds_a_password(tmp_path, monkeypatch):
    from ripresa.engine.gpt.train import TrainArgs, launch_record

    monkeypatch.chdir(tmp_path)
    rec = launch_record(TrainArgs(run=Path("r"), mirror="https://user:s3cret@example.org/bucket", threads=2), 1, 1)
    assert "s3cret" not in json.dumps(rec) and rec["options"]["mirror"] == "https://***@example.org/bucket"
    rec = launch_record(TrainArgs(run=Path("r"), mirror="relative/mirror", deadline=0.0), 2, 2)
    assert rec["options"]["mirror"] == str(tmp_path / "relative" / "mirror")  # a path: absolute
    assert rec["options"]["deadline"] == "1970-01-01T00:00:00+00:00" and rec["world_size"] == 2


def launch_events(run: Path) -> list[dict]:
    return [e for e in read_history(run / ".loss.jsonl").events if e["event"] == "launch"]


@pytest.mark.slow
def test_pivot_restart_replays_the_flags_and_the_mirror_keeps_the_pivot(tmp_path):
    """Issue 20 deliverable 3, with a local-path mirror and real restarts."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    url = f"file://{mirror}"
    flags = ["--threads", "1", "--steps", "20", "--every", "10", "--no-audit", "--sync", "--quiet", "--mirror", url]
    res = ripresa_cli("train", "--run", run, "--config", "tiny", "--set", "train.batch_size=4", *flags)
    assert res.returncode == 0, res.stderr
    first = launch_events(run)[-1]
    assert first["options"]["mirror"] == url and first["options"]["steps"] == 20 and first["world_size"] == 1
    # 1. A pivot of the stopped run: the pivot generation and config.json reach the mirror at once.
    res = ripresa_cli("pivot", run, "--caps", "stdlib-docstrings=0.5")
    assert res.returncode == 0, res.stderr
    assert f"--mirror={url}" in res.stdout and "--steps=20" in res.stdout and "--config" not in res.stdout
    remote_cfg = json.loads((mirror / "config.json").read_text())
    assert remote_cfg["mixture"]["phase"] == 1 and remote_cfg["mixture"]["caps"] == {"stdlib-docstrings": 0.5}
    # ... so a resume from the mirror on a blank machine keeps the pivot (caps and phase), bandit fresh.
    blank = tmp_path / "blank"
    res = ripresa_cli("train", "--run", blank, "--threads", "1", "--steps", "1", "--no-audit", "--quiet", "--mirror", url)
    assert res.returncode == 0, res.stderr
    cfg = json.loads((blank / "config.json").read_text())
    assert cfg["mixture"]["phase"] == 1 and cfg["mixture"]["caps"] == {"stdlib-docstrings": 0.5}
    assert [e for e in read_history(blank / ".loss.jsonl").events if e["event"] == "bandit_fresh"][-1]["phase"] == 1
    # 2. pivot --restart: the trainer comes back with the original flags (not its config-shaping ones).
    res = ripresa_cli("pivot", run, "--caps", "stdlib-docstrings=0.3", "--restart")
    assert res.returncode == 0, res.stderr
    t0 = time.time()
    while (len(launch_events(run)) < 2 or read_lock_holder(run) is not None) and time.time() - t0 < 180:
        time.sleep(0.2)
    assert read_lock_holder(run) is None and len(launch_events(run)) == 2, (run / "train.log").read_text()
    again = launch_events(run)[-1]
    process_flags = {k: v for k, v in first["options"].items() if k not in ("config", "sets", "sources")}
    assert {k: v for k, v in again["options"].items() if k in process_flags} == process_flags
    assert again["options"]["config"] is None and again["options"]["sets"] == []
    assert json.loads((mirror / "config.json").read_text())["mixture"]["phase"] == 2
    assert "resumed" in (run / "train.log").read_text()
