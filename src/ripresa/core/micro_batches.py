"""This rank's micro-batches of a global data order: the plan a selected exact loader follows (docs/API.md, "Data loaders").

A loader over the *global* order — every rank builds the same one — yields its batches as the global
micro-batches ``0, 1, 2, …`` of an epoch; a step takes ``G`` consecutive ones (step ``s`` of the epoch:
``s·G … s·G + G − 1``). :class:`Selection` is the part of that order one rank trains on — the
micro-batch indices ``i`` in ``0 … G−1`` it was given (its block, or an interleaved share) of every
step — and the arithmetic between a position counted in *global* micro-batches (what a loader saves:
the same number on every rank, a multiple of ``G`` between steps) and the batches this rank delivers.
An epoch uses ``⌊B / G⌋ · G`` of its ``B`` micro-batches: the last ``B mod G`` make no whole step and
are skipped on every world size alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

#: Largest ``micro_batches`` a selection or a saved position may name.
MAX_MICRO_BATCHES = 1 << 30


def check_micro_batches(value: Any, where: str) -> int:
    """``value`` as the number of micro-batches of a step (an int in ``1 … MAX_MICRO_BATCHES``), else ValueError."""
    if type(value) is not int or not 1 <= value <= MAX_MICRO_BATCHES:
        raise ValueError(f"{where}: micro_batches must be an int in 1..{MAX_MICRO_BATCHES}, got {value!r}"[:200])
    return value


class Selection:
    """Micro-batches ``indices`` (of ``0 … G−1``) of every step of an epoch of ``batches_per_epoch`` global micro-batches.

    Raises ValueError for indices that are not distinct ints in ``0 … G−1``, none at all, or an epoch too
    short to hold one step.
    """

    def __init__(self, micro_batches: int, indices: Iterable[int], batches_per_epoch: int) -> None:
        g = check_micro_batches(micro_batches, "select")
        try:
            got = list(indices)
        except TypeError:
            raise TypeError(f"select: indices must be an iterable of ints, not {type(indices).__name__}") from None
        if not got or len(got) > g:
            raise ValueError(f"select: indices must name 1..{g} of the {g} micro-batches of a step, got {len(got)}")
        if any(type(i) is not int or not 0 <= i < g for i in got) or len(set(got)) != len(got):
            raise ValueError(f"select: indices must be distinct ints in 0..{g - 1}, got {got[:8]!r}"[:200])
        steps = batches_per_epoch // g
        if steps < 1:
            raise ValueError(f"select: an epoch of {batches_per_epoch} micro-batches holds no step of {g}; "
                             "use a smaller micro-batch or fewer micro-batches a step")
        self.G = g
        self.indices = tuple(sorted(got))
        self.per = len(self.indices)
        #: global micro-batches an epoch uses (``⌊B / G⌋ · G``).
        self.limit = steps * g
        #: batches this rank delivers in a full epoch.
        self.local_per_epoch = steps * self.per
        self._last = self.indices[-1]

    def plan(self, start: int) -> Iterator[int]:
        """The global micro-batch numbers this rank delivers from global position ``start`` to the epoch's end."""
        s, o = divmod(max(start, 0), self.G)
        while s * self.G < self.limit:
            for i in self.indices:
                if i >= o:
                    yield s * self.G + i
            s, o = s + 1, 0

    def after(self, k: int) -> int:
        """The global position once micro-batch ``k`` is delivered: ``k + 1``, or the next step's start after this rank's last."""
        s, i = divmod(k, self.G)
        return (s + 1) * self.G if i == self._last else k + 1

    def local_count(self, position: int) -> int:
        """This rank's micro-batches before global ``position`` in an epoch."""
        s, o = divmod(min(position, self.limit), self.G)
        return s * self.per + sum(1 for i in self.indices if i < o)

    def from_local(self, count: int) -> int:
        """The global position after this rank's first ``count`` micro-batches of an epoch (a step's start between steps)."""
        s, j = divmod(count, self.per)
        return s * self.G if j == 0 else s * self.G + self.indices[j - 1] + 1

    def __repr__(self) -> str:
        return f"Selection(micro_batches={self.G}, indices={list(self.indices)})"
