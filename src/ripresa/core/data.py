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

from ..errors import SchemaError
from .args import check_int


def _check_source(generator: object, seed: object, drop_last: object) -> None:
    """The constructor arguments besides the sizes: ``TypeError`` for a wrong type (API misuse)."""
    if generator is not None and not isinstance(generator, np.random.Generator):
        raise TypeError(f"generator must be a numpy.random.Generator, not {type(generator).__name__}")
    if seed is not None:
        check_int(seed, "seed", at_least=0)
    if not isinstance(drop_last, bool | np.bool_):
        raise TypeError(f"drop_last must be a bool, not {type(drop_last).__name__}")


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
        n_rows = check_int(n_rows, "n_rows", at_least=1)
        batch_size = check_int(batch_size, "batch_size", at_least=1)
        _check_source(generator, seed, drop_last)
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
        """Restore the position; refuses a state for another data set or batch size.

        Everything is checked (:func:`validate_sampler_state`) before anything changes.
        """
        validate_sampler_state(state)
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


_INT64 = 2**63 - 1


def validate_sampler_state(state: Any, where: str = "data") -> None:
    """Structural check of a saved :meth:`EpochSampler.state_dict` (types and ranges); :class:`SchemaError`.

    Used by :meth:`EpochSampler.load_state_dict` and, for a state read from a
    file, by :func:`ripresa.core.state.validate_saved_state` (what ``ripresa inspect
    --deep`` and a resume share).
    """
    if not isinstance(state, Mapping):
        raise SchemaError(f"{where}: data position is not a dict", found=type(state).__name__)
    for key in ("n_rows", "batch_size", "drop_last", "epoch", "cursor", "rows_consumed"):
        if key not in state:
            raise SchemaError(f"data position lacks '{key}'", expected=key, found=sorted(map(str, state)))
    for key in ("n_rows", "batch_size", "epoch", "cursor", "rows_consumed"):
        v = state.get(key)
        if type(v) is not int or not -1 <= v <= _INT64:
            raise SchemaError(f"{where}.{key} is not an integer in range", expected=f"-1..{_INT64}", found=repr(v)[:80])
    if type(state.get("drop_last")) is not bool:
        raise SchemaError(f"{where}.drop_last is not a bool", found=repr(state.get("drop_last"))[:80])
    n, cursor, epoch = state["n_rows"], state["cursor"], state["epoch"]
    if n < 1 or state["batch_size"] < 1 or state["rows_consumed"] < 0:
        raise SchemaError(f"{where}: n_rows, batch_size must be >= 1 and rows_consumed >= 0",
                          found={k: state[k] for k in ("n_rows", "batch_size", "rows_consumed")})
    if not 0 <= cursor <= n:
        raise SchemaError(f"{where}: data cursor out of range", expected=f"0..{n}", found=cursor)
    perm = state.get("permutation")
    if perm is None:
        if epoch != -1 or cursor != 0:
            raise SchemaError(f"{where}: data position has a cursor but no permutation", found=f"epoch {epoch}, cursor {cursor}")
    elif not (isinstance(perm, torch.Tensor) and perm.dtype == torch.int64 and tuple(perm.shape) == (n,)):
        found = f"{perm.dtype}, shape {tuple(perm.shape)}" if isinstance(perm, torch.Tensor) else type(perm).__name__
        raise SchemaError(f"{where}: saved permutation is not an int64 tensor of n_rows ids", expected=f"int64, shape ({n},)",
                          found=found)
    elif epoch < 0:
        raise SchemaError(f"{where}: data position has a permutation but no epoch", found=f"epoch {epoch}")
    if state.get("distributed"):
        from .rng import validate_numpy_state

        ws = state.get("world_size")
        if type(ws) is not int or not 1 <= ws <= 1 << 20:
            raise SchemaError(f"{where}.world_size out of range", expected="1..1048576", found=repr(ws)[:80])
        validate_numpy_state(state.get("generator"), f"{where}.generator")


class DistributedEpochSampler(EpochSampler):
    """An :class:`EpochSampler` shared by the ranks of a distributed run, without overlap or gaps.

    Every rank holds the same *global* position — the epoch, its permutation
    and a cursor into it — and draws the same permutations (same seed on every
    rank). Each call to :meth:`next_batch` advances the global cursor by one
    global batch of ``batch_size * world_size`` rows and returns this rank's
    share: the rows at positions ``rank, rank + world_size, ...`` of that
    global batch. Over an epoch the ranks together see every row exactly once.

    Args:
        n_rows: rows in the data set.
        batch_size: rows per rank per batch (the global batch is ``batch_size * world_size``).
        rank, world_size: this process's place; default: the initialised
            process group's (0 and 1 without one).
        generator, seed: the permutation stream, as for :class:`EpochSampler`;
            use the same seed on every rank.
        drop_last: drop an incomplete final global batch of an epoch. Without
            it the final global batch is split the same strided way, so a rank
            may get fewer rows than the others (possibly none): with DDP,
            where every rank must take a step, use ``drop_last=True``.

    Resume, on the same or another number of ranks: the state is global (it
    includes the permutation generator's state, because on a world-size
    change a new rank restores rank 0's data position but not random
    streams), so after :meth:`load_state_dict` every rank continues with the
    next global batch, split over the new world size: the remaining rows of
    the epoch are still each seen once. With another world size the global
    batch has another size, so the batches — not the order of the rows — differ
    from a run that kept the world size.
    """

    def __init__(
        self,
        n_rows: int,
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        generator: np.random.Generator | None = None,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if rank is None or world_size is None:
            import torch.distributed as dist

            grouped = dist.is_available() and dist.is_initialized()
            rank = (dist.get_rank() if grouped else 0) if rank is None else rank
            world_size = (dist.get_world_size() if grouped else 1) if world_size is None else world_size
        n_rows = check_int(n_rows, "n_rows", at_least=1)
        batch_size = check_int(batch_size, "batch_size", at_least=1)
        world_size = check_int(world_size, "world_size", at_least=1)
        rank = check_int(rank, "rank", at_least=0)
        if rank >= world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
        if drop_last and batch_size * world_size > n_rows:
            raise ValueError(f"drop_last with a global batch of {batch_size * world_size} > n_rows {n_rows} yields no batch")
        super().__init__(n_rows, batch_size * world_size, generator=generator, seed=seed, drop_last=drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.per_rank_batch_size = int(batch_size)
        #: World size of the state loaded last, when it differs from this one (a reshard).
        self.resharded_from: int | None = None

    def next_batch(self) -> list[int]:
        """This rank's rows of the next global batch."""
        return super().next_batch()[self.rank :: self.world_size]

    def next_global_batch(self) -> list[int]:
        """The whole next global batch (every rank's rows), advancing the position. For tests and tools."""
        return super().next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The global position (as :class:`EpochSampler`), the permutation stream's state, and the world it was saved in."""
        from .rng import _numpy_bitgen_state

        state = super().state_dict()
        state["batch_size"] = self.per_rank_batch_size
        state["world_size"] = self.world_size
        state["generator"] = _numpy_bitgen_state(self.generator.bit_generator.state)
        state["distributed"] = True
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the global position; a state saved on another number of ranks is accepted (resharding)."""
        from .rng import _numpy_bitgen_state_back

        if not state.get("distributed"):
            raise SchemaError("data position was not saved by a DistributedEpochSampler", found=sorted(state),
                              hint="an EpochSampler's state has no global cursor to share between ranks")
        for key in ("batch_size", "world_size", "generator"):
            if key not in state:
                raise SchemaError(f"data position lacks '{key}'", expected=key, found=sorted(state))
        validate_sampler_state(state)
        if int(state["batch_size"]) != self.per_rank_batch_size:
            raise SchemaError(f"data position was saved with batch_size={state['batch_size']} per rank, "
                              f"this run has {self.per_rank_batch_size}", expected=self.per_rank_batch_size,
                              found=state["batch_size"], hint="resume with the same per-rank batch size")
        saved_world = int(state["world_size"])
        base = dict(state)
        base["batch_size"] = self.batch_size  # the global batch of *this* world size
        super().load_state_dict(base)
        self.generator.bit_generator.state = _numpy_bitgen_state_back(state["generator"], "data.generator")
        self.resharded_from = saved_world if saved_world != self.world_size else None
