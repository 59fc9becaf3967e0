"""World-size-invariant steps (issue 32, work in progress): the same state, bit for bit, on 1, 2 and 4 ranks.

Real torchrun process groups on gloo (tests/fixtures/invariant_loop.py), tolerance 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

from ripresa.errors import BadInput
from ripresa.session.invariant import InvariantSteps, tree_sum

LOOP = FIXTURES / "invariant_loop.py"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")


def _run(folder: Path, world: int, steps: int, *extra: str) -> dict:
    out = folder.with_suffix(".json")
    launch = [sys.executable, "-B"] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc-per-node={world}"]
    res = subprocess.run([*launch, str(LOOP), "--folder", str(folder), "--steps", str(steps), "--out", str(out),
                          *extra], capture_output=True, text=True, timeout=300, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def _losses(folder: Path) -> dict[int, float]:
    out = {}
    for line in (folder / ".loss.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec and "step" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def test_the_fixed_tree_is_the_same_sum_whatever_the_blocks_each_rank_adds_first():
    """A rank's block of a power-of-two G is a subtree: its partial sum, then the upper levels, give the very
    bits of the whole tree; the order an all-reduce of W partial sums would use does not."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(1000, generator=g) * 10 ** (i % 3) for i in range(8)]
    whole = tree_sum(parts)
    for w in (1, 2, 4, 8):
        k = 8 // w
        partial = [tree_sum(parts[r * k:(r + 1) * k]) for r in range(w)]
        assert torch.equal(tree_sum(partial), whole), w
    sequential = parts[0].clone()
    for p in parts[1:]:
        sequential += p
    assert not torch.equal(sequential, whole)  # another order: other bits (why an all-reduce is not invariant)


def test_what_makes_a_step_depend_on_the_ranks_is_refused_at_start():
    with pytest.raises(BadInput, match="BatchNorm"):
        InvariantSteps(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)), micro_batches=4)
    with pytest.raises(ValueError):
        InvariantSteps(torch.nn.Linear(2, 2), micro_batches=0)


@pytest.mark.slow
def test_one_two_and_four_ranks_give_the_same_state_and_losses_and_plain_ddp_does_not(tmp_path):
    runs = {w: _run(tmp_path / f"w{w}", w, 6) for w in (1, 2, 4)}
    assert runs[1]["state"] == runs[2]["state"] == runs[4]["state"]
    assert _losses(tmp_path / "w1") == _losses(tmp_path / "w2") == _losses(tmp_path / "w4")
    d1, d2 = _run(tmp_path / "d1", 1, 6, "--mode", "ddp"), _run(tmp_path / "d2", 2, 6, "--mode", "ddp")
    assert d1["state"] != d2["state"]  # the negative control diverges


@pytest.mark.slow
def test_a_run_resumed_on_two_then_one_then_two_ranks_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    ref = _run(tmp_path / "ref", 2, 12)
    run = tmp_path / "run"
    _run(run, 2, 4)
    _run(run, 1, 8)
    last = _run(run, 2, 12)
    assert last["state"] == ref["state"]
    assert _losses(run) == _losses(tmp_path / "ref")
