"""RandomStreams: every generator restored exactly; states are weights_only-safe."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

import ripresa


def _draws(streams, np_gen, tgen, prand):
    return (
        random.random(),
        float(np.random.random()),
        torch.rand(3).tolist(),
        float(np_gen.normal()),
        torch.rand(2, generator=tgen).tolist(),
        prand.random(),
        random.gauss(0, 1),
    )


def test_capture_restore_every_stream_through_weights_only_load():
    np_gen = np.random.Generator(np.random.PCG64(11))
    tgen = torch.Generator().manual_seed(12)
    prand = random.Random(13)
    streams = ripresa.RandomStreams(numpy={"g": np_gen}, torch_generators={"t": tgen}, python={"p": prand})
    random.gauss(0, 1)  # leaves a cached gauss_next in Python's state
    _draws(streams, np_gen, tgen, prand)
    buf = io.BytesIO()
    torch.save(streams.state_dict(), buf)
    expected = _draws(streams, np_gen, tgen, prand)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    # Disturb everything, then restore.
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    np_gen.normal(size=100), tgen.manual_seed(99), prand.seed(98)
    streams.load_state_dict(state)
    assert _draws(streams, np_gen, tgen, prand) == expected


def test_reseeding_is_not_restoring():
    np_gen = np.random.Generator(np.random.PCG64(1))
    streams = ripresa.RandomStreams(numpy={"g": np_gen})
    np_gen.random(5)
    state = streams.state_dict()
    after = np_gen.random()
    np_gen.bit_generator.state = np.random.PCG64(1).state  # re-seed
    assert np_gen.random() != after
    streams.load_state_dict(state)
    assert np_gen.random() == after


def test_peek_observes_without_disturbing():
    np_gen = np.random.Generator(np.random.PCG64(2))
    streams = ripresa.RandomStreams(numpy={"g": np_gen})
    peeked = streams.peek()
    assert set(peeked) >= {"python", "numpy_legacy", "torch_cpu", "numpy:g"}
    assert peeked["python"] == random.random()
    assert peeked["numpy:g"] == np_gen.random()
    assert peeked["torch_cpu"] == torch.rand(1, dtype=torch.float64).item()


def test_different_registered_generators_are_refused():
    a = ripresa.RandomStreams(numpy={"g": np.random.default_rng(0)})
    b = ripresa.RandomStreams(numpy={"h": np.random.default_rng(0)})
    with pytest.raises(ripresa.errors.SchemaError, match="differ"):
        b.load_state_dict(a.state_dict())


def test_no_numpy_arrays_in_state():
    state = ripresa.RandomStreams(numpy={"g": np.random.default_rng(0)}).state_dict()

    def walk(v):
        assert not isinstance(v, np.ndarray | np.generic)
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(state)
