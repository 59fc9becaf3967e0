"""StatefulLoader: a real multi-worker DataLoader with random augmentation resumes bit-exactly (docs/FORMAT.md).

The uninterrupted reference runs 2.5 epochs; the interrupted run stops at a random batch in a real
process that is then SIGKILLed, and a fresh process loads the saved position and goes on. Batches are
compared bitwise (torch.equal, tolerance 0).
"""

from __future__ import annotations

import io
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ripresa
from ripresa.core.loader import StatefulLoader

HERE = Path(__file__).resolve().parent
N, BATCH, WORKERS, SEED = 22, 4, 2, 1234  # 6 batches an epoch, the last one short
PER_EPOCH = -(-N // BATCH)
TOTAL = PER_EPOCH * 5 // 2  # 2.5 epochs


class AugmentedRows(torch.utils.data.Dataset):
    """Row i plus random augmentation drawn in the worker from torch, Python random and NumPy's global generator."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = torch.full((3,), float(i), dtype=torch.float64) + torch.rand(3, dtype=torch.float64)
        if torch.randint(0, 2, ()).item():
            x = -x
        x = x * (1 + random.uniform(-0.1, 0.1)) + float(np.random.normal())
        info = torch.utils.data.get_worker_info()
        return x, torch.tensor(i), torch.tensor(-1 if info is None else info.id)


def make_loader(num_workers=WORKERS, seed=SEED, **kw):
    return StatefulLoader(AugmentedRows(), BATCH, shuffle=True, num_workers=num_workers, seed=seed, **kw)


def take(loader, n):
    """n batches across epochs, as for-epoch/for-batch loops take them: (x, index) of each."""
    out = []
    while len(out) < n:
        for x, idx, _worker in loader:
            out.append((x, idx))
            if len(out) == n:
                break
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(i1, i2) for (x1, i1), (x2, i2) in zip(a, b, strict=True))


def save(obj, path):
    tmp = Path(str(path) + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from test_loader import make_loader, save, take
mode, k, out = sys.argv[2], int(sys.argv[3]), sys.argv[4]
loader = make_loader()
if mode == "first":  # k batches, save the position, then go on working until SIGKILL
    head = take(loader, k)
    save({"batches": head, "position": loader.state_dict()}, out)
    print("saved", flush=True)
    while True:
        take(loader, 1)
        time.sleep(0.01)
saved = torch.load(sys.argv[5], weights_only=True)
if mode == "resume":
    loader.load_state_dict(saved["position"])
save({"batches": take(loader, k)}, out)  # mode "fresh": the negative case, no position loaded
"""


def child(*args, wait=True):
    cmd = [sys.executable, "-c", _CHILD, str(HERE), *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    subprocess.run(cmd, check=True, timeout=300)


def test_a_killed_loader_resumes_bitwise_in_a_fresh_process(tmp_path):
    reference = take(make_loader(), TOTAL)  # (a) uninterrupted, 2.5 epochs
    assert len({int(i) for _x, idx in reference[:PER_EPOCH] for i in idx}) == N  # an epoch covers every row
    k = random.Random().randint(1, TOTAL - 1)  # (b) a random batch
    first = child("first", k, tmp_path / "first.pt", wait=False)
    try:
        assert first.stdout.readline().strip() == "saved"
        first.send_signal(signal.SIGKILL)  # killed while its workers are busy
        assert first.wait(timeout=60) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    head = torch.load(tmp_path / "first.pt", weights_only=True)
    assert len(pickle.dumps(head["position"])) < 1024  # O(1): no permutation, no worker states
    child("resume", TOTAL - k, tmp_path / "rest.pt", tmp_path / "first.pt")
    rest = torch.load(tmp_path / "rest.pt", weights_only=True)["batches"]
    assert same(head["batches"] + rest, reference), f"cut at batch {k}"
    # (c) the negative case: a fresh loader that did not load the position does not continue the run
    child("fresh", TOTAL - k, tmp_path / "fresh.pt", tmp_path / "first.pt")
    fresh = torch.load(tmp_path / "fresh.pt", weights_only=True)["batches"]
    assert not same(head["batches"] + fresh, reference)


@pytest.mark.parametrize("cut", [0, 1, PER_EPOCH - 1, PER_EPOCH, PER_EPOCH + 1, TOTAL - 1])
def test_resume_at_epoch_edges_in_process(cut):
    reference = take(make_loader(), TOTAL)
    a = make_loader()
    head = take(a, cut)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = make_loader()
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert same(head + take(b, TOTAL - cut), reference)


def test_batches_do_not_depend_on_the_number_of_workers_nor_touch_global_rngs():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    in_main = take(make_loader(num_workers=0), PER_EPOCH + 2)
    assert (torch.rand(2), random.random(), np.random.rand())[1:] == expected[1:]
    torch.manual_seed(0)
    after = take(make_loader(num_workers=2), PER_EPOCH + 2)
    assert torch.equal(torch.rand(2), expected[0])  # the workers' base seed came from the loader's own generator
    assert same(in_main, after)
    assert not same(take(make_loader(seed=SEED + 1), PER_EPOCH + 2), after)


def test_a_loader_round_trips_through_a_training_state():
    model = torch.nn.Linear(3, 1)
    a = make_loader()
    head = take(a, 4)
    snap = ripresa.TrainingState(model=model, data=a).snapshot(ripresa.Progress(step=4))
    buf = io.BytesIO()
    torch.save(snap, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    b = make_loader()
    ripresa.TrainingState(model=model, data=b).restore(loaded)
    assert same(head + take(b, 5), take(make_loader(), 9))


def test_a_position_of_another_seed_or_data_set_is_refused():
    a = make_loader()
    take(a, 3)
    st = a.state_dict()
    for other in (make_loader(seed=SEED + 1), StatefulLoader(list(range(N + 1)), BATCH, seed=SEED)):
        with pytest.raises(ripresa.errors.SchemaError):
            other.load_state_dict(st)
        assert other.epoch == -1
    with pytest.raises(ripresa.errors.SchemaError, match="StatefulLoader"):
        make_loader().load_state_dict({"epoch": 0})
    with pytest.raises(TypeError, match="shuffle|sampler"):
        StatefulLoader(AugmentedRows(), BATCH, sampler=range(N))


def test_a_plain_dataloader_as_data_is_refused_at_construction_naming_the_fix():
    plain = torch.utils.data.DataLoader(AugmentedRows(), batch_size=BATCH, shuffle=True, num_workers=2)
    with pytest.raises(TypeError, match="DataLoader") as exc:
        ripresa.TrainingState(model=torch.nn.Linear(3, 1), data=plain)
    assert "StatefulLoader" in str(exc.value) and repr(plain) in str(exc.value)
    assert "ripresa.make_exact(loader)" in str(exc.value)


def _torchdata_resume(cut, exact=True):
    """torchdata's StatefulDataLoader, uninterrupted and resumed at ``cut`` (in process): (reference, resumed).

    ``exact``: made exact by ripresa.make_exact (its position is the handle's); else torchdata's own state_dict().
    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        loader = StatefulDataLoader(AugmentedRows(), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                                    generator=torch.Generator().manual_seed(SEED))
        return loader, (ripresa.make_exact(loader) if exact else loader)

    def rest(loader, n):
        out = []
        while len(out) < n:
            for x, idx, _w in loader:
                out.append((x, idx))
                if len(out) == n:
                    break
        return out

    reference = rest(make()[0], TOTAL)
    a, pos_a = make()
    if exact:
        assert ripresa.TrainingState(model=torch.nn.Linear(3, 1), data=a).data is pos_a  # the loader stands for its position
    it = iter(a)
    head = [next(it)[:2] for _ in range(cut)]
    st = pos_a.state_dict()
    b, pos_b = make()
    pos_b.load_state_dict(st)
    return reference, head + rest(b, TOTAL - cut)


def test_torchdata_stateful_dataloader_made_exact_resumes_augmentation_bitwise():
    """torchdata's StatefulDataLoader (the `loader` extra), made exact, resumes order and worker augmentation."""
    pytest.importorskip("torchdata")
    reference, resumed = _torchdata_resume(3)
    assert same(resumed, reference)


@pytest.mark.slow
def test_torchdata_stateful_dataloader_own_resume_drifts_and_is_refused_as_data():
    """Why it is refused unless made exact: its own state_dict() resumes the order, not the workers' augmentation."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    reference, resumed = _torchdata_resume(3, exact=False)
    assert [idx.tolist() for _x, idx in resumed] == [idx.tolist() for _x, idx in reference]
    assert not same(resumed, reference)
    with pytest.raises(TypeError, match=r"StatefulDataLoader not made exact.*ripresa\.make_exact\(loader\)"):
        ripresa.TrainingState(model=torch.nn.Linear(3, 1),
                              data=StatefulDataLoader(AugmentedRows(), batch_size=BATCH, shuffle=True))
