"""World-size-invariant steps (docs/ARCHITECTURE.md, "World-size changes"): the same state, bit for bit, on 1, 2
and 4 ranks, replicated or sharded by FSDP2, and through a resume on another number of ranks.

Real torchrun process groups on gloo (tests/fixtures/invariant_loop.py, ``Checkpointer(world_size_invariant=G)``),
tolerance 0. The default tier runs the 2 -> 1 -> 2 sample; the slow tier 1, 2, 4, FSDP2 and the negative controls.
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

import ripresa
from ripresa.errors import BadInput, IntegrityError
from ripresa.session.invariant import InvariantSteps, saved_invariant, tree_sum

LOOP = FIXTURES / "invariant_loop.py"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")


def _run(folder: Path, world: int, steps: int, *extra: str) -> dict:
    out = folder.with_suffix(".json")
    sharded = "fsdp" in extra or "fsdp-plain" in extra  # FSDP2 needs a group, even of one rank
    launch = [sys.executable, "-B"] if world == 1 and not sharded else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    res = subprocess.run([*launch, str(LOOP), "--folder", str(folder), "--steps", str(steps), "--out", str(out),
                          *extra], capture_output=True, text=True, timeout=300, env=_env())
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def _events(folder: Path, name: str) -> list[dict]:
    lines = (folder / ".loss.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


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


@pytest.mark.parametrize("G", [4, 8, 6])
def test_one_rank_holds_the_tree_sum_of_the_micro_batch_gradients_whether_it_streams_or_keeps_them(G):
    """Powers of two merge each gradient into the pending subtrees as it comes (at most log2(G)+1 held); G=6 keeps
    them all: either way .grad is the fixed tree's sum / G, bit for bit, and the loss the tree's mean."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    x, y = torch.randn(G, 3, 5), torch.randn(G, 3, 1)
    grads, losses = [], []
    for i in range(G):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        losses.append(torch.tensor(float(loss.detach()), dtype=torch.float64))
    steps = InvariantSteps(model, micro_batches=G)
    for i in steps.indices():
        with steps.micro_batch(1, i):
            steps.backward(torch.nn.functional.mse_loss(model(x[i]), y[i]))
        assert len(steps._pending) <= G.bit_length()
    mean = steps.reduce()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(got, tree_sum(grads).div_(G)) and mean == float(tree_sum(losses) / G)
    if G != 6:  # streamed: the micro-batches must come in the order of indices()
        with steps.micro_batch(2, 1), pytest.raises(RuntimeError, match="out of order"):
            steps.backward(torch.nn.functional.mse_loss(model(x[1]), y[1]))


def test_what_makes_a_step_depend_on_the_ranks_is_refused_at_start(tmp_path):
    with pytest.raises(BadInput, match="BatchNorm"):
        InvariantSteps(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)), micro_batches=4)
    with pytest.raises(ValueError):
        InvariantSteps(torch.nn.Linear(2, 2), micro_batches=0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="number of micro-batches"):
        ripresa.Checkpointer(tmp_path / "a", ripresa.TrainingState(model=model, optimizer=opt), world_size_invariant=True)
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    state = ripresa.TrainingState(model=model, optimizer=opt, data=ripresa.make_exact(loader))
    with pytest.raises(BadInput, match="global sample index") as err:
        ripresa.Checkpointer(tmp_path / "b", state, world_size_invariant=4, handle_signals=False)
    assert "DistributedSampler" in str(err.value)


def test_a_malformed_saved_record_of_the_mode_is_an_integrity_error():
    assert saved_invariant({}) is None
    assert saved_invariant({"invariant": {"micro_batches": 8, "seed": 3}}) == {"micro_batches": 8, "seed": 3}
    for bad in ({"micro_batches": 2**40, "seed": 0}, {"micro_batches": 8}, {"micro_batches": "8", "seed": 0},
                {"micro_batches": 8, "seed": -1, "x": 1}, [8, 0], "8"):
        with pytest.raises(IntegrityError, match="extra.invariant"):
            saved_invariant({"invariant": bad}, file="step_000004.safetensors")


def test_a_run_resumed_on_two_then_one_then_two_ranks_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    """The default tier's sample (issue 32's "done when"): 2 -> 1 -> 2 ranks, every step's loss and the final
    weights and AdamW state equal, bit for bit, to an uninterrupted 2-rank run; the history says so."""
    ref = _run(tmp_path / "ref", 2, 6)
    run = tmp_path / "run"
    _run(run, 2, 2)
    _run(run, 1, 4)
    last = _run(run, 2, 6)
    assert last["state"] == ref["state"]
    assert _losses(run) == _losses(tmp_path / "ref")
    changes = _events(run, "world_size_change")
    assert [(e["saved_world_size"], e["world_size"], e["trajectory"]) for e in changes] == [(2, 1, "exact"), (1, 2, "exact")]


@pytest.mark.slow
def test_one_two_and_four_ranks_give_the_same_state_and_losses_and_plain_ddp_does_not(tmp_path):
    runs = {w: _run(tmp_path / f"w{w}", w, 6) for w in (1, 2, 4)}
    assert runs[1]["state"] == runs[2]["state"] == runs[4]["state"]
    assert _losses(tmp_path / "w1") == _losses(tmp_path / "w2") == _losses(tmp_path / "w4")
    d1, d2 = _run(tmp_path / "d1", 1, 6, "--mode", "ddp"), _run(tmp_path / "d2", 2, 6, "--mode", "ddp")
    assert d1["state"] != d2["state"]  # the negative control diverges


@pytest.mark.slow
def test_a_replicated_run_resumed_two_one_four_is_exact_and_the_same_change_without_the_mode_is_not(tmp_path):
    ref = _run(tmp_path / "ref", 2, 9, "--micro", "8")
    run = tmp_path / "run"
    for world, upto in ((2, 3), (1, 6), (4, 9)):
        last = _run(run, world, upto, "--micro", "8")
    assert last["state"] == ref["state"] and _losses(run) == _losses(tmp_path / "ref")
    ddp_ref = _run(tmp_path / "dref", 2, 9, "--micro", "8", "--mode", "ddp")
    neg = tmp_path / "neg"
    for world, upto in ((2, 3), (1, 6), (4, 9)):
        last = _run(neg, world, upto, "--micro", "8", "--mode", "ddp")
    assert last["state"] != ddp_ref["state"]  # without the mode, the same change leaves the trajectory
    assert [e["trajectory"] for e in _events(neg, "world_size_change")] == ["changed", "changed"]


@pytest.mark.slow
def test_fsdp2_on_one_two_and_four_ranks_gives_the_same_state_and_the_ordinary_reduce_scatter_does_not(tmp_path):
    runs = {w: _run(tmp_path / f"f{w}", w, 6, "--mode", "fsdp", "--micro", "8") for w in (1, 2, 4)}
    assert runs[1]["state"] == runs[2]["state"] == runs[4]["state"]
    assert _losses(tmp_path / "f1") == _losses(tmp_path / "f2") == _losses(tmp_path / "f4")
    plain = {w: _run(tmp_path / f"p{w}", w, 6, "--mode", "fsdp-plain", "--micro", "8") for w in (1, 2, 4)}
    assert len({plain[w]["state"] for w in (1, 2, 4)}) == 3  # the negative control: three trajectories


@pytest.mark.slow
def test_an_fsdp2_run_resumed_two_one_four_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    ref = _run(tmp_path / "ref", 2, 8, "--mode", "fsdp", "--micro", "8")
    run = tmp_path / "run"
    for world, upto in ((2, 3), (1, 5), (4, 8)):
        last = _run(run, world, upto, "--mode", "fsdp", "--micro", "8")
    assert last["state"] == ref["state"] and _losses(run) == _losses(tmp_path / "ref")
    assert [e["trajectory"] for e in _events(run, "world_size_change")] == ["exact", "exact"]
