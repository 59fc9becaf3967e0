"""``ripresa train --invariant G`` (docs/ENGINE.md, "World size"): the engine's GPT on 1, 2 and 4 ranks, replicated
or sharded by FSDP2, writes bit-identical generations, and a run moved 2 -> 1 -> 2 ranks ends on the bytes of
an uninterrupted one. Real torchrun process groups on gloo; slow tier (the default tier samples the mode with
tests/test_invariant.py's 2 -> 1 -> 2)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

COMMON = ("--invariant", "4", "--every", "2", "--quiet", "--no-audit", "--threads", "1")


def _train(run: Path, world: int, steps: int, *extra: str) -> None:
    launch = [sys.executable, "-m", "ripresa"] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m", "--",
        "ripresa"]
    res = subprocess.run([*launch, "train", "--run", str(run), "--steps", str(steps), *COMMON, *extra],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _losses(run: Path) -> dict[int, float]:
    lines = (run / ".loss.jsonl").read_text().splitlines()
    return {e["step"]: e["loss"] for e in map(json.loads, lines) if "event" not in e and "loss" in e}


def test_one_two_and_four_ranks_write_the_same_generation_bytes(tmp_path):
    for w in (1, 2, 4):
        _train(tmp_path / f"w{w}", w, 4)
    shas = {w: _sha(tmp_path / f"w{w}" / "step_000004.bin") for w in (1, 2, 4)}
    assert len(set(shas.values())) == 1, shas
    assert _losses(tmp_path / "w1") == _losses(tmp_path / "w2") == _losses(tmp_path / "w4")


def test_a_run_moved_two_one_two_ranks_ends_on_the_bytes_of_an_uninterrupted_one(tmp_path):
    _train(tmp_path / "ref", 2, 6)
    run = tmp_path / "run"
    for world, upto in ((2, 2), (1, 4), (2, 6)):
        _train(run, world, upto)
    assert _sha(run / "step_000006.bin") == _sha(tmp_path / "ref" / "step_000006.bin")
    assert _losses(run) == _losses(tmp_path / "ref")
    events = [json.loads(x) for x in (run / ".loss.jsonl").read_text().splitlines()]
    assert [e["trajectory"] for e in events if e.get("event") == "world_size_change"] == ["exact", "exact"]


def test_fsdp2_on_two_and_four_ranks_follows_the_replicated_losses(tmp_path):
    _train(tmp_path / "rep", 1, 4)
    for w in (2, 4):
        _train(tmp_path / f"f{w}", w, 4, "--shard", "fsdp")
    assert _losses(tmp_path / "f2") == _losses(tmp_path / "f4") == _losses(tmp_path / "rep")


def test_a_g_that_the_ranks_do_not_divide_is_refused_before_anything_is_built(tmp_path):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "--", "ripresa"]
    res = subprocess.run([*launch, "train", "--run", str(tmp_path / "r"), "--steps", "2", "--invariant", "3",
                          "--quiet"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode != 0 and "exitcode: 2" in res.stderr, res.stderr[-2000:]  # the ranks' BadInput exit code
    assert "multiple of the world size 2" in res.stderr
    assert "ripresa/" not in "".join(ln for ln in res.stderr.splitlines(True) if ln.lstrip().startswith("File "))
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").glob("step_*"))
