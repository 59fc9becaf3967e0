"""The per-sample seeds of ripresa's data loaders (docs/FORMAT.md, "The data position").

:func:`sample_seed` derives sample ``index``'s seed in ``epoch`` from the loader's seed; :func:`seeded` runs a
sample's transform under it. Shared by :class:`~ripresa.core.stateful_loader.StatefulLoader` and
:func:`~ripresa.core.loader.make_exact`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from .data import splitmix64

_M64 = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index``'s randomness in ``epoch`` (SplitMix64 of the three)."""
    z = splitmix64(int(seed) & _M64)
    z = splitmix64(z ^ (int(epoch) & _M64))
    return splitmix64(z ^ (int(index) & _M64))


@contextlib.contextmanager
def seeded(s: int) -> Iterator[None]:
    """Seed torch (CPU), ``random`` and NumPy's global generator with ``s``; put the three back after.

    Only torch's CPU generator: ``torch.manual_seed`` would also reseed every
    CUDA generator, which a loader without workers shares with the training
    step (dropout on the GPU), and which is not put back.
    """
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        torch.default_generator.manual_seed(s)
        random.seed(s)
        np.random.seed([s & 0xFFFFFFFF, s >> 32])
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)
