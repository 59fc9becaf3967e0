"""Resumable data order: epoch permutations, a cursor, and the ids each batch took.

A mid-epoch resume must continue with exactly the next rows, and crossing into
the next epoch must draw the same next permutation. Knowing the epoch number
alone is not enough; :class:`EpochSampler` stores the epoch's permutation and
the cursor inside it. The permutation is drawn from a NumPy ``Generator``
(PCG64 by default) whose state is captured with the other random streams, so
the *next* epoch's permutation is reproduced too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import SchemaError


class EpochSampler:
    """Yields batches of row ids, one epoch permutation at a time.

    Args:
        n_rows: number of rows in the data set.
        batch_size: rows per batch.
        generator: the NumPy generator that draws permutations. Register the
            same generator in :class:`~ripresa.RandomStreams` so that its state
            is saved; pass ``seed`` instead to let the sampler own a PCG64.
        drop_last: drop an incomplete final batch of an epoch (else it is short).

    The permutation of epoch ``e`` is drawn lazily, when the first batch of
    ``e`` is requested, so that a save at the end of an epoch does not yet
    hold the next one and a resume draws it from the restored generator.
    """

    def __init__(
        self,
        n_rows: int,
        batch_size: int,
        *,
        generator: np.random.Generator | None = None,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if n_rows <= 0:
            raise ValueError(f"n_rows must be positive, got {n_rows}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > n_rows:
            raise ValueError(f"drop_last with batch_size {batch_size} > n_rows {n_rows} yields no batch")
        if generator is None:
            generator = np.random.Generator(np.random.PCG64(0 if seed is None else seed))
        self.n_rows = int(n_rows)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.generator = generator
        self.epoch = -1  # no permutation drawn yet
        self.cursor = 0
        self.permutation: np.ndarray | None = None
        self.rows_consumed = 0

    def _epoch_exhausted(self) -> bool:
        if self.permutation is None:
            return True
        remaining = self.n_rows - self.cursor
        return remaining == 0 or (self.drop_last and remaining < self.batch_size)

    def next_batch(self) -> list[int]:
        """Ids of the rows of the next batch (a new permutation when an epoch ends)."""
        if self._epoch_exhausted():
            self.permutation = self.generator.permutation(self.n_rows)
            self.epoch += 1
            self.cursor = 0
        assert self.permutation is not None
        ids = self.permutation[self.cursor : self.cursor + self.batch_size]
        self.cursor += len(ids)
        self.rows_consumed += len(ids)
        return [int(i) for i in ids]

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.n_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    # -- Stateful -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Epoch, cursor, the epoch's permutation (int64 tensor) and rows consumed.

        The generator's state is *not* here: it belongs to the random streams,
        restored last (it may be shared with other draws, such as noise).
        """
        return {
            "n_rows": self.n_rows,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "rows_consumed": self.rows_consumed,
            "permutation": None
            if self.permutation is None
            else torch.from_numpy(np.ascontiguousarray(self.permutation, dtype=np.int64)).clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position; refuses a state for another data set or batch size."""
        for key, mine in (("n_rows", self.n_rows), ("batch_size", self.batch_size), ("drop_last", self.drop_last)):
            if key not in state:
                raise SchemaError(f"data position lacks '{key}'", expected=key, found=sorted(state))
            if state[key] != mine:
                raise SchemaError(
                    f"data position was saved with {key}={state[key]}, this run has {key}={mine}",
                    expected=mine,
                    found=state[key],
                    hint="resume with the same data set and batch size",
                )
        perm = state.get("permutation")
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if perm is None:
            if epoch != -1 or cursor != 0:
                raise SchemaError("data position has a cursor but no permutation", found=f"epoch {epoch}, cursor {cursor}")
            self.permutation = None
        else:
            arr = perm.numpy() if isinstance(perm, torch.Tensor) else np.asarray(perm)
            if arr.shape != (self.n_rows,) or not np.array_equal(np.sort(arr), np.arange(self.n_rows)):
                raise SchemaError(
                    "saved permutation is not a permutation of the data set's rows",
                    expected=f"a permutation of 0..{self.n_rows - 1}",
                    found=f"shape {arr.shape}",
                )
            if not 0 <= cursor <= self.n_rows:
                raise SchemaError("data cursor out of range", expected=f"0..{self.n_rows}", found=cursor)
            self.permutation = arr.astype(np.int64, copy=True)
        self.epoch, self.cursor = epoch, cursor
        self.rows_consumed = int(state["rows_consumed"])
