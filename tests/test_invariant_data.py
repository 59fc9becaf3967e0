"""The data order as a function of the global sample index, through a world-size change (docs/API.md, "Data loaders").

A loader over the global order, made exact (``make_exact``) or ripresa's ``StatefulLoader``, is
``select`` ed to one rank's micro-batches of every step. Single-process units simulate the ranks of
1, 2 and 4 (and the interleaved shares of FSDP2): together they draw the very micro-batches of one
rank alone, each rank fetches only its own samples, and a position saved on 2 ranks loads on 1 or 4
and goes on with the micro-batches the uninterrupted run draws. Hostile positions are refused with
typed errors. The slow tier runs the real thing: torchrun process groups on gloo
(tests/fixtures/invariant_data_loop.py) resumed 2 -> 1 -> 4 -> 2 ranks, ending bitwise equal to an
uninterrupted 2-rank run.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

from ripresa.core.data import DistributedEpochSampler
from ripresa.core.loader import StatefulLoader, make_exact, per_rank_sampling
from ripresa.errors import SchemaError

N, MB, G = 45, 3, 4  # 15 micro-batches an epoch: 3 steps of 4 (the last 3 micro-batches make no step)


class Noisy(torch.utils.data.Dataset):
    """Row i plus noise drawn in ``__getitem__``; every fetch is recorded (in the process that fetches)."""

    def __init__(self, n: int = N) -> None:
        self.n, self.fetched = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched.append(int(i))
        return torch.tensor([float(i), float(torch.randn(()))])


def exact(**kw):
    dl = torch.utils.data.DataLoader(Noisy(), batch_size=MB, shuffle=True, **kw)
    return dl, make_exact(dl, seed=7)


def stateful(**kw):
    loader = StatefulLoader(Noisy(), MB, shuffle=True, seed=5, **kw)
    return loader, loader


BUILDERS = {"exact": exact, "stateful": stateful}


def shares(world: int, interleaved: bool = False) -> list[list[int]]:
    """Each rank's micro-batch indices: a block (DDP), or round j -> j*W + r (FSDP2)."""
    if interleaved:
        return [list(range(r, G, world)) for r in range(world)]
    return [list(range(r * G // world, (r + 1) * G // world)) for r in range(world)]


def epochs(loader):
    """The loader's batches, epoch after epoch."""
    return (b for _ in itertools.count() for b in loader)


class Ranks:
    """``world`` simulated ranks, each its own loader selected to its share; ``steps(k)`` gathers k steps' micro-batches by index."""

    def __init__(self, build, world: int, *, interleaved: bool = False, state: dict | None = None, **kw) -> None:
        self.loaders, self.handles, self.its, self.idx = [], [], [], shares(world, interleaved)
        for r in range(world):
            loader, handle = build(**kw)
            if state is not None:
                handle.load_state_dict(state)
            handle.select(micro_batches=G, indices=self.idx[r])
            self.loaders.append(loader)
            self.handles.append(handle)
            self.its.append(epochs(loader))

    def steps(self, k: int) -> list[torch.Tensor]:
        out = []
        for _ in range(k):
            got = {}
            for it, idx in zip(self.its, self.idx, strict=True):
                for i in idx:
                    got[i] = next(it)
            out.append(torch.stack([got[i] for i in range(G)]))
        return out

    def state(self) -> dict:
        states = [h.state_dict() for h in self.handles]
        assert all(s == states[0] for s in states), "the ranks' positions differ"
        return states[0]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_one_two_and_four_ranks_draw_the_same_global_micro_batches_and_fetch_only_their_own(kind):
    build = BUILDERS[kind]
    one = Ranks(build, 1).steps(8)  # across two epoch ends
    for world in (2, 4):
        for interleaved in (False, True):
            ranks = Ranks(build, world, interleaved=interleaved)
            assert same(ranks.steps(8), one), (world, interleaved)
            for loader, idx, handle in zip(ranks.loaders, ranks.idx, ranks.handles, strict=True):
                dataset = handle.dataset if kind == "stateful" else loader.dataset._ripresa_inner
                assert len(dataset.fetched) == 8 * len(idx) * MB  # this rank's samples, no other's
    # the global order is the unselected loader's, its epoch cut to whole steps (3 of 4 micro-batches)
    loader, _ = build()
    plain = [b for _ in range(3) for b in list(loader)[: 3 * G]]
    assert same([torch.stack(plain[s * G:(s + 1) * G]) for s in range(8)], one)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("cut", [2, 3, 5])  # mid-epoch, at the epoch's end, in the second epoch
def test_a_position_saved_on_two_ranks_goes_on_identically_on_one_and_four(kind, cut):
    build = BUILDERS[kind]
    reference = Ranks(build, 2).steps(9)
    two = Ranks(build, 2)
    head = two.steps(cut)
    saved = two.state()
    assert "world" not in json.dumps(saved) and "rank" not in json.dumps(saved)
    if kind == "exact":
        assert saved["cursor"] % G == 0 and saved["micro_batches"] == G
    for world, interleaved in ((1, False), (4, False), (4, True), (2, True)):
        tail = Ranks(build, world, interleaved=interleaved, state=saved).steps(9 - cut)
        assert same(head + tail, reference), (world, interleaved)


def test_workers_fetch_the_same_micro_batches_and_an_exact_loader_selected_after_the_load_goes_on():
    reference = Ranks(exact, 2).steps(6)
    ranks = Ranks(exact, 2, num_workers=2)
    assert same(ranks.steps(6), reference)
    # select after load_state_dict (a Checkpointer's resume before the selection) and held-back batches
    two = Ranks(exact, 2)
    head = two.steps(2)
    two.steps(1)
    for h in two.handles:
        h.held_back = G // 2  # one step's batches fetched ahead, not trained on
    saved = two.state()
    assert saved["cursor"] == 2 * G
    dl, h = exact()
    h.load_state_dict(saved)
    h.select(micro_batches=G, indices=range(G))
    it = epochs(dl)
    tail = [torch.stack([next(it) for _ in range(G)]) for _ in range(4)]
    assert same(head + tail, reference)


def test_hostile_and_mismatched_positions_are_refused_with_typed_errors():
    ranks = Ranks(exact, 2)
    ranks.steps(1)
    good = ranks.state()
    for bad in ({"micro_batches": "4"}, {"micro_batches": -1}, {"micro_batches": 1 << 40}, {"micro_batches": True},
                {"cursor": 13}, {"micro_batches": 8}, {"micro_batches": None}):
        _, h = exact()
        h.select(micro_batches=G, indices=[0, 1])
        with pytest.raises(SchemaError):
            h.load_state_dict({**good, **bad})
        assert h.state_dict()["epoch"] == -1  # nothing changed
    _, h = exact()
    h.load_state_dict(good)  # not selected yet: select() must agree, iterating without it is refused
    with pytest.raises(SchemaError):
        h.select(micro_batches=2, indices=[0])
    with pytest.raises(SchemaError):
        iter(h.loader)
    sl = Ranks(stateful, 1)
    sl.steps(1)
    sgood = sl.state()
    for bad in ({"micro_batches": 2.0}, {"micro_batches": 0}, {"micro_batches": 2}):
        loader = StatefulLoader(Noisy(), MB, shuffle=True, seed=5).select(micro_batches=G, indices=[0])
        with pytest.raises(SchemaError):
            loader.load_state_dict({**sgood, **bad})
    loader = StatefulLoader(Noisy(), MB, shuffle=True, seed=5)
    loader.load_state_dict(sgood)
    with pytest.raises(SchemaError):
        next(iter(loader))
    # misuse of select itself
    for kw in ({"micro_batches": 0, "indices": [0]}, {"micro_batches": G, "indices": []},
               {"micro_batches": G, "indices": [0, 0]}, {"micro_batches": G, "indices": [G]},
               {"micro_batches": G, "indices": [True]}, {"micro_batches": 16, "indices": [0]}):
        with pytest.raises(ValueError):
            exact()[1].select(**kw)
        with pytest.raises(ValueError):
            StatefulLoader(Noisy(), MB, seed=5).select(**kw)


def test_per_rank_sampling_names_what_samples_per_rank():
    dist = torch.utils.data.DataLoader(Noisy(), batch_size=MB,
                                       sampler=torch.utils.data.DistributedSampler(Noisy(), num_replicas=2, rank=1))
    assert "DistributedSampler" in per_rank_sampling(dist)
    handle = make_exact(dist)
    assert "DistributedSampler" in per_rank_sampling(handle)
    with pytest.raises(TypeError, match="samples per rank"):
        handle.select(micro_batches=G, indices=[0])
    sampler = DistributedEpochSampler(N, MB, rank=0, world_size=2, seed=0)
    assert "DistributedEpochSampler" in per_rank_sampling(sampler)
    loader, h = exact()
    assert per_rank_sampling(loader) is None and per_rank_sampling(h) is None
    h.select(micro_batches=G, indices=[1])
    assert per_rank_sampling(loader) is None
    assert per_rank_sampling(StatefulLoader(Noisy(), MB, seed=0)) is None
    assert per_rank_sampling(torch.utils.data.DataLoader(Noisy(), batch_size=MB)) is None
    assert per_rank_sampling(torch.nn.Linear(1, 1)) is None


LOOP = FIXTURES / "invariant_data_loop.py"


def _run(folder: Path, world: int, steps: int, *extra: str) -> dict:
    out = folder.with_name(f"{folder.name}-{world}-{steps}.json")
    launch = [sys.executable, "-B"] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc-per-node={world}"]
    res = subprocess.run([*launch, str(LOOP), "--folder", str(folder), "--steps", str(steps), "--out", str(out), *extra],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def _losses(folder: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (folder / ".loss.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "event" not in r and "step" in r}


@pytest.mark.slow
def test_a_run_resumed_on_two_one_four_then_two_ranks_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    """Real torchrun (gloo), a DataLoader made exact and selected (ripresa's StatefulLoader: the units above; the
    fixture takes ``--loader stateful``): the position crosses 2 -> 1 -> 4 -> 2 ranks and two epoch ends, the
    first leg with a worker process."""
    loader = "exact"
    ref = _run(tmp_path / "ref", 2, 12, "--loader", loader)
    run = tmp_path / "run"
    _run(run, 2, 4, "--loader", loader, "--workers", "1")
    _run(run, 1, 8, "--loader", loader)
    _run(run, 4, 10, "--loader", loader)
    last = _run(run, 2, 12, "--loader", loader)
    assert last["state"] == ref["state"]
    assert last["data"] == ref["data"]
    assert _losses(run) == _losses(tmp_path / "ref") and len(_losses(run)) == 12


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_a_mid_step_position_of_another_rank_ends_the_epoch_instead_of_spinning(kind):
    """A position saved mid-step by rank 1 of 2 (after its micro-batch 2 of the last step) loaded by a rank
    whose micro-batches of that step are all behind it: the epoch ends, the next one starts."""
    loader, h = BUILDERS[kind]()
    h.select(micro_batches=G, indices=[2, 3])
    it = epochs(loader)
    for _ in range(5):  # steps 0, 1 and micro-batch 2 of step 2, the epoch's last
        next(it)
    saved = h.state_dict()
    other, h2 = BUILDERS[kind]()
    h2.load_state_dict(saved)
    h2.select(micro_batches=G, indices=[0, 1])
    fresh, h3 = BUILDERS[kind]()
    h3.select(micro_batches=G, indices=[0, 1])
    list(fresh)  # epoch 0
    assert torch.equal(next(b for _ in range(3) for b in other), next(iter(fresh)))  # epoch 1's first
