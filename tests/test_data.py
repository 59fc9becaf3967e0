"""EpochSampler: mid-epoch resume continues with exactly the next rows, across epochs."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch

import ripresa
from ripresa import DistributedEpochSampler, EpochSampler
from ripresa.core.data import FeistelPermutation


def _draw(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


@pytest.mark.parametrize("cut", [0, 1, 5, 6, 7, 11, 12, 13])
def test_resume_at_any_cut_continues_the_same_rows(cut):
    ref = EpochSampler(24, 4, seed=7)
    reference = _draw(ref, 20)

    a = EpochSampler(24, 4, seed=7)
    head = _draw(a, cut)
    saved = a.state_dict()
    gen_state = a.generator.bit_generator.state
    buf = io.BytesIO()
    torch.save(saved, buf)  # weights_only-safe
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    b = EpochSampler(24, 4, seed=999)  # a different seed: restoring must not depend on it
    b.load_state_dict(loaded)
    b.generator.bit_generator.state = gen_state
    assert head + _draw(b, 20 - cut) == reference


def test_each_epoch_is_a_permutation_and_cursor_counts_rows():
    s = EpochSampler(24, 4, seed=1)
    first = _draw(s, 6)
    assert sorted(sum(first, [])) == list(range(24))
    assert s.epoch == 0 and s.cursor == 24
    s.next_batch()
    assert s.epoch == 1 and s.cursor == 4 and s.rows_consumed == 28


def test_after_five_batches_cursor_is_20_of_24():
    s = EpochSampler(24, 4, seed=0)
    _draw(s, 5)
    assert (s.epoch, s.cursor, s.rows_consumed) == (0, 20, 20)
    _draw(s, 5)
    assert (s.epoch, s.rows_consumed) == (1, 40)


def test_short_last_batch_and_drop_last():
    s = EpochSampler(10, 4, seed=0)
    assert [len(b) for b in _draw(s, 4)] == [4, 4, 2, 4]
    d = EpochSampler(10, 4, seed=0, drop_last=True)
    assert [len(b) for b in _draw(d, 3)] == [4, 4, 4] and d.epoch == 1


def test_without_restoring_a_passed_generator_the_next_epoch_differs():
    """A generator passed in belongs to the random streams: the data position alone does not restore it."""
    a = EpochSampler(24, 4, generator=np.random.Generator(np.random.PCG64(3)))
    _draw(a, 5)
    b = EpochSampler(24, 4, generator=np.random.Generator(np.random.PCG64(3)))
    b.load_state_dict(a.state_dict())  # generator NOT restored: still at its initial state
    assert "generator" not in a.state_dict()
    assert _draw(a, 1) == _draw(b, 1)  # same epoch: rows come from the saved permutation
    assert _draw(a, 3) != _draw(b, 3)  # next epoch: the permutation differs


@pytest.mark.parametrize("kind", ["numpy", "feistel"])
@pytest.mark.parametrize("cut", [3, 6, 8])
def test_a_seeded_sampler_resumes_exactly_for_three_more_epochs(kind, cut):
    """A sampler that owns its generator (``seed=``) saves that generator's current state (O(1)): after a
    resume, the current epoch *and the following ones* are those of an uninterrupted sampler."""
    ref = EpochSampler(24, 4, seed=7, permutation=kind)
    reference = _draw(ref, cut + 3 * 6 + 2)
    a = EpochSampler(24, 4, seed=7, permutation=kind)
    head = _draw(a, cut)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert "generator" in saved and len(pickle.dumps(saved)) < 1024
    b = EpochSampler(24, 4, seed=7, permutation=kind)
    b.load_state_dict(saved)
    assert head + _draw(b, 3 * 6 + 2) == reference
    # a state written before the generator was saved still loads: the current epoch is exact
    old = {k: v for k, v in saved.items() if k != "generator"}
    c = EpochSampler(24, 4, seed=7, permutation=kind)
    c.load_state_dict(old)
    left = 6 - cut % 6 if cut % 6 else 0
    assert _draw(c, left) == reference[cut:cut + left]
    with pytest.raises(ripresa.errors.SchemaError, match="generator"):
        EpochSampler(24, 4, seed=7, permutation=kind).load_state_dict({**saved, "generator": {"bit_generator": "X"}})


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s: s.update(n_rows=25), "n_rows"),
        (lambda s: s.update(batch_size=8), "batch_size"),
        (lambda s: s.update(permutation=torch.zeros(24, dtype=torch.int64)), "not a permutation"),
        (lambda s: s.update(cursor=99), "cursor out of range"),
        (lambda s: s.pop("n_rows"), "lacks 'n_rows'"),
    ],
)
def test_inconsistent_positions_are_refused(mutate, match):
    s = EpochSampler(24, 4, seed=0)
    _draw(s, 2)
    st = s.state_dict()
    mutate(st)
    fresh = EpochSampler(24, 4, seed=0)
    with pytest.raises(ripresa.errors.SchemaError, match=match):
        fresh.load_state_dict(st)
    assert fresh.epoch == -1 and fresh.permutation is None  # untouched


def test_shared_generator_is_captured_by_random_streams():
    g = np.random.Generator(np.random.PCG64(5))
    s = EpochSampler(24, 4, generator=g)
    streams = ripresa.RandomStreams(numpy={"data": g})
    _draw(s, 7)
    pos, rng = s.state_dict(), streams.state_dict()
    expected = _draw(s, 10)
    g2 = np.random.Generator(np.random.PCG64(0))
    s2 = EpochSampler(24, 4, generator=g2)
    s2.load_state_dict(pos)
    ripresa.RandomStreams(numpy={"data": g2}).load_state_dict(rng)
    assert _draw(s2, 10) == expected


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: EpochSampler(0, 4, seed=0), ValueError),
        (lambda: EpochSampler(-3, 4, seed=0), ValueError),
        (lambda: EpochSampler(24, 0, seed=0), ValueError),
        (lambda: EpochSampler(24.0, 4, seed=0), TypeError),
        (lambda: EpochSampler("24", 4, seed=0), TypeError),
        (lambda: EpochSampler(True, 4, seed=0), TypeError),
        (lambda: EpochSampler(24, 4, seed=-1), ValueError),
        (lambda: EpochSampler(24, 4, seed=1.5), TypeError),
        (lambda: EpochSampler(24, 4, generator=np.random.RandomState(0)), TypeError),
        (lambda: EpochSampler(24, 4, drop_last="yes"), TypeError),
        (lambda: ripresa.DistributedEpochSampler(24, 4, rank=2, world_size=2), ValueError),
        (lambda: ripresa.DistributedEpochSampler(24, 4, rank=-1, world_size=2), ValueError),
        (lambda: ripresa.DistributedEpochSampler(24, 4, rank=0, world_size=0), ValueError),
        (lambda: ripresa.DistributedEpochSampler(24, 4, rank=0.0, world_size=2), TypeError),
    ],
)
def test_constructor_misuse_is_a_type_or_value_error(make, error):
    """A wrong argument is a programming error, not a ripresa error (docs/FAULTS.md)."""
    with pytest.raises(error) as info:
        make()
    assert not isinstance(info.value, ripresa.RipresaError) and str(info.value)


def test_numpy_integers_are_accepted():
    s = EpochSampler(np.int64(24), np.int32(4), seed=np.uint8(3))
    assert (s.n_rows, s.batch_size) == (24, 4) and type(s.n_rows) is int


# -- O(1) data position (docs/FORMAT.md, "The data position") ---------------------------------

def _size(state) -> int:
    """Bytes of the state as torch.save pickles it (its data.pkl: the zip container adds a fixed ~1.2 KB)."""
    return len(pickle.dumps(state, protocol=2))


@pytest.mark.parametrize("kind", ["numpy", "feistel"])
@pytest.mark.parametrize("cut", [0, 3, 6, 7, 13])
def test_both_kinds_resume_at_any_cut_with_the_generator_restored_by_random_streams(kind, cut):
    def make(seed):
        g = np.random.Generator(np.random.PCG64(seed))
        return EpochSampler(24, 4, generator=g, permutation=kind), ripresa.RandomStreams(numpy={"data": g})

    ref, _ = make(11)
    reference = _draw(ref, 20)
    a, streams = make(11)
    head = _draw(a, cut)
    buf = io.BytesIO()
    torch.save({"data": a.state_dict(), "rng": streams.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["data"]["permutation"] is None or isinstance(saved["data"]["permutation"], dict)
    b, streams_b = make(999)
    b.load_state_dict(saved["data"])
    streams_b.load_state_dict(saved["rng"])  # last, as TrainingState.restore does
    assert head + _draw(b, 20 - cut) == reference


def test_the_saved_position_does_not_grow_with_the_rows():
    sizes = {}
    for n in (10**3, 10**6):
        s = EpochSampler(n, 100, seed=0, permutation="numpy")
        _draw(s, 3)
        sizes[n] = _size(s.state_dict())
    assert max(sizes.values()) < 512 and abs(sizes[10**3] - sizes[10**6]) <= 8  # (the 128-bit ints vary by a byte or two)
    big = EpochSampler(10**10, 100, seed=0)  # "auto" above 2**26 rows: feistel
    assert big.permutation_kind == "feistel"
    _draw(big, 3)
    assert _size(big.state_dict()) <= _size(EpochSampler(10**3, 100, seed=0, permutation="feistel").state_dict()) + 64


@pytest.mark.parametrize("n", [1, 2, 3, 5, 1000, 4097])
@pytest.mark.parametrize("key", [0, 1, 2**63 - 1, 0x5EED])
def test_feistel_is_a_permutation_exhaustively(n, key):
    perm = FeistelPermutation(n, key)(np.arange(n, dtype=np.uint64))
    assert perm.dtype == np.int64
    assert np.array_equal(np.sort(perm), np.arange(n))


def test_feistel_keys_and_epochs_give_different_orders():
    orders = {tuple(FeistelPermutation(1000, k)(np.arange(1000, dtype=np.uint64)).tolist()) for k in range(20)}
    assert len(orders) == 20
    s = EpochSampler(1000, 1000, seed=0, permutation="feistel")
    assert s.next_batch() != s.next_batch()  # a new key every epoch
    assert sorted(s.next_batch()) == list(range(1000))


@pytest.mark.parametrize("n", [10**9, 10**10, 2**62])
def test_feistel_on_large_n_is_injective_and_in_range_by_sampling(n):
    rng = np.random.default_rng(n % 1000)
    positions = np.unique(rng.integers(0, n, size=200_000, dtype=np.uint64 if n > 2**62 else np.int64).astype(np.uint64))
    positions = np.concatenate([positions, np.array([0, n - 1], dtype=np.uint64)])
    positions = np.unique(positions)
    rows = FeistelPermutation(n, 12345)(positions)
    assert rows.min() >= 0 and rows.max() < n
    assert len(np.unique(rows)) == len(positions)  # distinct positions, distinct rows
    again = FeistelPermutation(n, 12345)(positions[::-1])[::-1]
    assert np.array_equal(rows, again)  # random access: the order of the queries does not matter


def test_a_billion_rows_save_under_1kb_and_resume_at_a_random_cursor():
    rng = np.random.default_rng()
    batch, k = int(rng.integers(500, 2000)), int(rng.integers(1, 400))
    uninterrupted = EpochSampler(10**9, batch, seed=42, permutation="feistel")
    a = EpochSampler(10**9, batch, seed=42, permutation="feistel")
    _draw(a, k)
    _draw(uninterrupted, k)
    saved = a.state_dict()
    assert _size(saved) < 1024 and len(json.dumps(saved)) < 1024, (_size(saved), len(json.dumps(saved)))
    b = EpochSampler(10**9, batch, seed=7, permutation="feistel")
    b.load_state_dict(saved)
    nxt, ref = [], []
    while len(ref) < 1000:
        nxt += b.next_batch()
        ref += uninterrupted.next_batch()
    assert nxt[:1000] == ref[:1000], (batch, k)


def test_legacy_state_with_the_permutation_itself_still_loads():
    """A run folder written before the O(1) position: the data state holds the int64 permutation."""
    reference = _draw(EpochSampler(24, 4, seed=7), 12)
    g = np.random.Generator(np.random.PCG64(7))
    perm = g.permutation(24)  # what the old sampler drew for epoch 0
    old = {"n_rows": 24, "batch_size": 4, "drop_last": False, "epoch": 0, "cursor": 8, "rows_consumed": 8,
           "permutation": torch.from_numpy(perm.astype(np.int64))}
    b = EpochSampler(24, 4, seed=999)
    b.load_state_dict(old)
    b.generator.bit_generator.state = g.bit_generator.state  # the random streams, restored last
    assert _draw(b, 4) == reference[2:6]
    legacy_again = b.state_dict()  # still epoch 0: its permutation cannot be regenerated, so it is saved
    assert isinstance(legacy_again["permutation"], torch.Tensor)
    assert _draw(b, 6) == reference[6:12]
    assert b.state_dict()["permutation"]["kind"] == "numpy"  # a new epoch: O(1) again
    with pytest.raises(ripresa.errors.SchemaError, match="feistel"):
        EpochSampler(24, 4, seed=0, permutation="feistel").load_state_dict(old)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda p: p.update(kind="feistel"), "recipe"),
        (lambda p: p.update(extra=1), "recipe"),
        (lambda p: p.update(generator={"bit_generator": "os.system"}), "unknown numpy bit generator"),
        (lambda p: p.pop("generator"), "recipe"),
    ],
)
def test_hostile_recipes_are_refused_before_anything_changes(mutate, match):
    s = EpochSampler(24, 4, seed=0)
    _draw(s, 2)
    st = s.state_dict()
    mutate(st["permutation"])
    fresh = EpochSampler(24, 4, seed=0)
    with pytest.raises(ripresa.errors.SchemaError, match=match):
        fresh.load_state_dict(st)
    assert fresh.epoch == -1 and fresh.permutation is None


def test_a_recipe_of_the_other_kind_or_a_bad_key_is_refused():
    f = EpochSampler(24, 4, seed=0, permutation="feistel")
    _draw(f, 2)
    st = f.state_dict()
    with pytest.raises(ripresa.errors.SchemaError, match="permutation='feistel'"):
        EpochSampler(24, 4, seed=0, permutation="numpy").load_state_dict(st)
    for bad in (-1, 2**64, "7", 1.5):
        st["permutation"]["key"] = bad
        with pytest.raises(ripresa.errors.SchemaError, match="key"):
            EpochSampler(24, 4, seed=0, permutation="feistel").load_state_dict(st)
    with pytest.raises(ValueError, match="permutation"):
        EpochSampler(24, 4, seed=0, permutation="sorted")


@pytest.mark.parametrize("kind", ["numpy", "feistel"])
def test_distributed_sampler_position_is_o1_and_ranks_partition_the_epoch(kind):
    ranks = [DistributedEpochSampler(40, 3, rank=r, world_size=2, seed=5, permutation=kind) for r in range(2)]
    seen = [row for _ in range(3) for s in ranks for row in s.next_batch()]
    st = ranks[0].state_dict()
    assert _size(st) < 2048 and isinstance(st["permutation"], dict)
    fresh = [DistributedEpochSampler(40, 3, rank=r, world_size=2, seed=1, permutation=kind) for r in range(2)]
    for s in fresh:
        s.load_state_dict(st)
    rest_fresh = [row for _ in range(4) for s in fresh for row in s.next_batch()]
    rest_ref = [row for _ in range(4) for s in ranks for row in s.next_batch()]
    assert rest_fresh == rest_ref
    assert sorted(seen + rest_ref[:40 - len(seen)]) == list(range(40))


_CHILD = r"""
import os, sys, time, torch
from ripresa import DistributedEpochSampler, EpochSampler
from ripresa.core.data import FeistelPermutation
batch, k, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
s = EpochSampler(10**9, batch, seed=42)  # "auto": feistel above 2**26 rows
for _ in range(k):
    s.next_batch()
torch.save({"data": s.state_dict(), "generator": s.generator.bit_generator.state}, out + ".tmp")
os.replace(out + ".tmp", out)
print("saved", flush=True)
while True:
    s.next_batch()  # still drawing when it is killed
"""


@pytest.mark.slow
def test_a_killed_process_resumes_a_billion_row_epoch_in_a_fresh_one(tmp_path):
    """A real process draws k batches, saves, goes on drawing and is SIGKILLed; this process resumes bitwise."""
    import signal
    import subprocess
    import sys

    rng = np.random.default_rng()
    batch, k = int(rng.integers(100, 3000)), int(rng.integers(1, 300))
    out = tmp_path / "pos.pt"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(batch), str(k), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saved"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    saved = torch.load(out, weights_only=False)
    assert out.stat().st_size < 4096  # with the zip container and the generator's state
    b = EpochSampler(10**9, batch, seed=0)
    b.load_state_dict(saved["data"])
    b.generator.bit_generator.state = saved["generator"]
    ref = EpochSampler(10**9, batch, seed=42)
    _draw(ref, k)
    got, want = [], []
    while len(want) < 1000:
        got += b.next_batch()
        want += ref.next_batch()
    assert got[:1000] == want[:1000]


def test_an_auto_sampler_adopts_the_kind_of_the_state_it_loads():
    """A legacy run above the threshold (its state holds the NumPy permutation) resumes with "auto"; the next
    epochs stay NumPy. A NumPy *recipe* above the threshold is not regenerated unless permutation="numpy" is explicit."""
    import ripresa.core.data as data

    small = 40
    old = EpochSampler(small, 8, seed=3, permutation="numpy")
    reference = _draw(EpochSampler(small, 8, seed=3, permutation="numpy"), 12)
    _draw(old, 2)
    legacy = old.state_dict()
    legacy["permutation"] = torch.from_numpy(old.permutation.copy())
    gen_state = old.generator.bit_generator.state
    limit = data.AUTO_FEISTEL_ABOVE
    data.AUTO_FEISTEL_ABOVE = small - 1  # as if the data set were above the threshold
    try:
        auto = EpochSampler(small, 8, seed=0)
        assert auto.permutation_kind == "feistel"
        auto.load_state_dict(legacy)
        auto.generator.bit_generator.state = gen_state
        assert auto.permutation_kind == "numpy" and _draw(auto, 10) == reference[2:]
        recipe = auto.state_dict()
        assert recipe["permutation"]["kind"] == "numpy"
        with pytest.raises(ripresa.errors.SchemaError, match="permutation='numpy'"):
            EpochSampler(small, 8, seed=0).load_state_dict(recipe)
        f = EpochSampler(small, 8, seed=0, permutation="feistel")
        _draw(f, 1)
        a2 = EpochSampler(small, 8, seed=9)
        a2.load_state_dict(f.state_dict())
        assert a2.permutation_kind == "feistel" and _draw(a2, 3) == _draw(f, 3)
    finally:
        data.AUTO_FEISTEL_ABOVE = limit
