"""make_exact: a user's own DataLoader, made exact in place, resumes bitwise after a real SIGKILL (docs/FORMAT.md).

A plain training loop — ``DataLoader(shuffle=True, num_workers=2)`` over a map-style dataset whose
``__getitem__`` augments with torch, ``random`` and NumPy, a model with dropout, draws from the main
process's ``random``/NumPy on every step — runs in a real child process with a ``Checkpointer``. One
child runs uninterrupted; another is SIGKILLed by itself right after an optimizer step that follows a
checkpoint mid-epoch, and the same command run again resumes it in a fresh process. The batches after
the cut and the final parameters must equal the uninterrupted run's bit for bit (tolerance 0).

The loop draws ``iter(loader)`` mid-epoch at the resume, where the uninterrupted run did not: a
DataLoader's own draws at ``iter()`` (the sampler's seed, the workers' base seed) would shift the
dropout masks after the resume; the negative case (slow) adds such a draw back and sees the drift.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ripresa
from ripresa.core.loader import make_exact

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
N, BATCH = 22, 4  # 6 batches an epoch, the last one short
PER_EPOCH = -(-N // BATCH)


class Augmented(torch.utils.data.Dataset):
    """Row i with random augmentation from torch, Python's random and NumPy's global generator."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.full((4,), float(i) / self.n) + 0.1 * torch.randn(4)
        if random.random() < 0.5:
            x = x.flip(0)
        x = x + float(np.random.normal(scale=0.05))
        return x, torch.tensor([x.sum().item() * 0.5]), torch.tensor(i)


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))


_CHILD = r'''
import json, os, random, signal, sys
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["here"])
import numpy as np, torch
import ripresa
from test_make_exact import Augmented, make_model

dist = cfg.get("dist", False)
rank = 0
if dist:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
torch.manual_seed(0); random.seed(0); np.random.seed(0)
model = make_model()
net = torch.nn.parallel.DistributedDataParallel(model) if dist else model
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ds = Augmented(cfg["n"])
if dist:
    sampler = torch.utils.data.DistributedSampler(ds, seed=cfg.get("order_seed", 0))
    loader = torch.utils.data.DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=cfg["workers"])
else:
    loader = torch.utils.data.DataLoader(ds, batch_size=cfg["batch"], shuffle=True, num_workers=cfg["workers"],
                                         persistent_workers=cfg.get("persistent", False) and cfg["workers"] > 0)
ripresa.make_exact(loader)  # the one line
state = ripresa.TrainingState(model=model, optimizer=opt, data=loader)
ck = ripresa.Checkpointer(cfg["run"], state, every=cfg["every"], asynchronous=False)  # committed before the kill
step = start = ck.resume()
record, epoch = [], 0
while step < cfg["steps"]:
    if dist:
        sampler.set_epoch(epoch)  # as users write it; the exact loader counts its epochs itself
    if cfg.get("draw_at_iter"):  # the negative: a loader that draws from the global generator at iter()
        torch.empty((), dtype=torch.int64).random_()
    for x, y, idx in loader:
        noise = 1 + 1e-3 * random.random() + 1e-3 * float(np.random.rand())  # main-process global streams
        loss = ((net(x) - y) ** 2).mean() * noise
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        record.append({"step": step, "x": x, "idx": idx})
        ck.step_done(step)
        if step == cfg.get("kill_after"):
            os.kill(os.getpid(), signal.SIGKILL)
        if step >= cfg["steps"]:
            break
    epoch += 1
ck.close()
torch.save({"start": start, "params": model.state_dict(), "record": record}, f"{cfg['out']}.{rank}")
'''


def child_cmd(tmp_path: Path, *, source: str = _CHILD, **cfg) -> list[str]:
    script = tmp_path / "train_exact.py"
    script.write_text(source)
    full = {"here": str(HERE), "n": N, "batch": BATCH, "workers": 2, **{k: str(v) if isinstance(v, Path) else v
                                                                        for k, v in cfg.items()}}
    return [str(script), json.dumps(full)]


def run_child(tmp_path: Path, **cfg: Any) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *child_cmd(tmp_path, **cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, expect: int = 0) -> None:
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}: {err[-3000:]}"


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def assert_bitwise(resumed: dict, reference: dict, *, cut: int) -> None:
    """The resumed process started at the checkpoint ``cut``; its batches and final parameters equal the reference's."""
    assert resumed["start"] == cut
    ref_tail = reference["record"][cut:]
    assert [r["step"] for r in resumed["record"]] == [r["step"] for r in ref_tail]
    for got, want in zip(resumed["record"], ref_tail, strict=True):
        assert torch.equal(got["idx"], want["idx"]), f"step {got['step']}: rows {got['idx']} != {want['idx']}"
        assert torch.equal(got["x"], want["x"]), f"step {got['step']}: the augmentation differs"
    for k, v in reference["params"].items():
        assert torch.equal(resumed["params"][k], v), f"parameter {k} differs after the resume"


def kill_and_resume(tmp_path: Path, *, steps: int, every: int, kill_after: int, **cfg: Any) -> tuple[dict, dict]:
    """(uninterrupted, resumed): the reference runs beside the run that kills itself, then the same command again."""
    ref = run_child(tmp_path, run=tmp_path / "ref", steps=steps, every=0, out=tmp_path / "ref.pt", **cfg)
    run = dict(run=tmp_path / "run", steps=steps, every=every, out=tmp_path / "res.pt", **cfg)
    finish(run_child(tmp_path, kill_after=kill_after, **run), expect=-signal.SIGKILL)
    finish(run_child(tmp_path, **run))  # the same command again: it resumes
    finish(ref)
    return load(tmp_path / "ref.pt.0"), load(tmp_path / "res.pt.0")


@pytest.mark.slow  # the default tier's kill-and-rerun sample of make_exact is tests/test_accelerate.py's (a plain
# DataLoader inside accelerate's prepared shard, the same make_exact): the framework tests' time budget
def test_a_plain_dataloader_made_exact_resumes_bitwise_after_sigkill(tmp_path):
    """Checkpoint at step 8 (epoch 1, batch 2), SIGKILL after step 10, resume across the epoch boundary at 12."""
    reference, resumed = kill_and_resume(tmp_path, steps=16, every=4, kill_after=10)
    assert 8 % PER_EPOCH  # mid-epoch
    assert_bitwise(resumed, reference, cut=8)


@pytest.mark.slow
@pytest.mark.parametrize("every,kill_after,persistent", [(6, 7, False), (5, 11, True), (3, 4, False)])
def test_cuts_at_and_around_epoch_boundaries(tmp_path, every, kill_after, persistent):
    """A checkpoint at the epoch's end (6), mid-epoch with persistent workers (10), in the first epoch (3)."""
    reference, resumed = kill_and_resume(tmp_path, steps=20, every=every, kill_after=kill_after, persistent=persistent)
    assert_bitwise(resumed, reference, cut=kill_after // every * every)


@pytest.mark.slow
def test_a_loader_that_draws_at_iter_drifts_after_the_resume(tmp_path):
    """The negative: one draw from torch's global generator at each iter(), as a plain DataLoader makes, shifts the run."""
    reference, resumed = kill_and_resume(tmp_path, steps=16, every=4, kill_after=10, draw_at_iter=True)
    assert [r["idx"].tolist() for r in resumed["record"]] == [r["idx"].tolist() for r in reference["record"][8:]]
    assert any(not torch.equal(resumed["params"][k], v) for k, v in reference["params"].items())


@pytest.mark.slow
def test_distributed_sampler_under_two_gloo_ranks_keeps_each_ranks_shard(tmp_path):
    """torchrun, 2 gloo ranks, a DistributedSampler: each rank's rows are DistributedSampler's for that rank and
    epoch, and the run SIGKILLed after a mid-epoch checkpoint resumes bitwise on both ranks."""
    steps, every, kill_after = 9, 2, 5
    per_rank_epoch = -(-((N + 1) // 2) // BATCH)  # 11 rows a rank: 3 batches

    def torchrun(out, run, **extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               *child_cmd(tmp_path, dist=True, run=run, steps=steps, out=out, order_seed=3, **extra)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    ref = torchrun(tmp_path / "ref.pt", tmp_path / "ref", every=0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = torchrun(tmp_path / "res.pt", tmp_path / "run", every=every, kill_after=kill_after)
    assert killed.returncode != 0
    again = torchrun(tmp_path / "res.pt", tmp_path / "run", every=every)
    assert again.returncode == 0, again.stderr[-3000:]
    ds = Augmented()
    for rank in (0, 1):
        reference, resumed = load(tmp_path / f"ref.pt.{rank}"), load(tmp_path / f"res.pt.{rank}")
        assert_bitwise(resumed, reference, cut=4)
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, seed=3)
        rows = []
        for epoch in range(-(-steps // per_rank_epoch)):
            sampler.set_epoch(epoch)
            rows += list(sampler)
        got = [i for r in reference["record"] for i in r["idx"].tolist()]
        assert got == rows[: len(got)], f"rank {rank} did not get its DistributedSampler shard"


# ---------------------------------------------------------------------------------------- in process
def take(loader, n):
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def same(a, b):
    return len(a) == len(b) and all(all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
                                    for x, y in zip(a, b, strict=True))


def plain(**kw):
    return torch.utils.data.DataLoader(Augmented(), **{"batch_size": BATCH, "shuffle": True, "num_workers": 0, **kw})


def test_make_exact_in_place_idempotent_o1_and_refusals():
    loader = plain(num_workers=2, generator=torch.Generator().manual_seed(11))
    handle = make_exact(loader)
    assert make_exact(loader) is handle and handle.seed == 11  # the loader's generator's seed by default
    assert ripresa.TrainingState(model=make_model(), data=loader).data is handle
    assert len(loader) == PER_EPOCH
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    head = take(loader, PER_EPOCH + 2)  # into the second epoch
    assert torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()
    assert np.array_equal(before[2], np.random.get_state()[1])  # no global draw at iter() nor in the samples
    position = handle.state_dict()
    assert (position["epoch"], position["cursor"]) == (1, 2) and len(json.dumps(position)) < 400
    fresh = plain(num_workers=0)  # workers do not matter; the default seed yields to the saved one
    make_exact(fresh).load_state_dict(position)
    assert same(head + take(fresh, 5), take(make_exact_loader(11), PER_EPOCH + 7))
    with pytest.raises(ripresa.errors.SchemaError, match="seed"):
        make_exact(plain(), seed=12).load_state_dict(position)
    with pytest.raises(ripresa.errors.SchemaError, match="another data set"):
        make_exact(plain(batch_size=5)).load_state_dict(position)
    with pytest.raises(ValueError, match="already exact"):
        make_exact(loader, seed=12)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="IterableDataset.*no state_dict"):
        make_exact(torch.utils.data.DataLoader(Stream()))
    odd = torch.utils.data.DataLoader(Augmented(), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(TypeError, match="batch_sampler"):
        make_exact(odd)


def make_exact_loader(seed, **kw):
    loader = plain(**kw)
    make_exact(loader, seed=seed)
    return loader


@pytest.mark.slow
def test_held_back_batches_and_every_cut_in_process():
    """held_back: a position saved while the caller holds prefetched batches is the one after the last trained on."""
    reference = take(make_exact_loader(5), 3 * PER_EPOCH)
    for cut in range(3 * PER_EPOCH):
        for held in (0, 1, 2):
            if held > cut:
                continue
            a = make_exact_loader(5)
            take(a, cut)
            a._ripresa_exact.held_back = held
            b = make_exact_loader(5)
            b._ripresa_exact.load_state_dict(a._ripresa_exact.state_dict())
            assert same(take(b, 3 * PER_EPOCH - cut + held), reference[cut - held:]), (cut, held)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sequential", "subset", "weighted", "replacement", "no_batching"])
def test_other_samplers_resume_exactly(kind):
    def build():
        ds = Augmented()
        kw = {"sequential": {"shuffle": False},
              "subset": {"shuffle": False, "sampler": torch.utils.data.SubsetRandomSampler(range(3, 20))},
              "weighted": {"shuffle": False, "sampler": torch.utils.data.WeightedRandomSampler([1.0] * N, 15)},
              "replacement": {"shuffle": False, "sampler": torch.utils.data.RandomSampler(ds, True, 30)},
              "no_batching": {"batch_size": None}}[kind]
        loader = torch.utils.data.DataLoader(ds, **{"batch_size": BATCH, "num_workers": 0, **kw})
        make_exact(loader, seed=9)
        return loader

    reference = take(build(), 12)
    a = build()
    head = take(a, 7)
    b = build()
    b._ripresa_exact.load_state_dict(a._ripresa_exact.state_dict())
    assert same(head + take(b, 5), reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_samples_seeded_in_the_main_process_leave_the_cuda_generator_alone():
    """num_workers=0: the per-sample seeding touches torch's CPU generator only (dropout on the GPU shares CUDA's)."""
    torch.cuda.manual_seed(1)
    before = torch.cuda.get_rng_state()
    take(make_exact_loader(4), PER_EPOCH + 1)
    assert torch.equal(before, torch.cuda.get_rng_state())
