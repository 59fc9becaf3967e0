"""EpochSampler: mid-epoch resume continues with exactly the next rows, across epochs."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import ripresa
from ripresa import EpochSampler


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


def test_without_restoring_the_generator_the_next_epoch_differs():
    """The data position alone is not enough: the next permutation needs the generator."""
    a = EpochSampler(24, 4, seed=3)
    _draw(a, 5)
    b = EpochSampler(24, 4, seed=3)
    b.load_state_dict(a.state_dict())  # generator NOT restored: still at its initial state
    assert _draw(a, 1) == _draw(b, 1)  # same epoch: rows come from the saved permutation
    assert _draw(a, 3) != _draw(b, 3)  # next epoch: the permutation differs


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
