"""ripresa's own multi-worker data loader with an exact, O(1) position: :class:`StatefulLoader`.

Its order is an :class:`~ripresa.EpochSampler` whose cursor counts the batches *delivered*; each sample's transform
draws from generators seeded from ``(seed, epoch, i)`` (:func:`~ripresa.core.seeds.sample_seed`) in whichever worker.
The saved layout: docs/FORMAT.md, "The data position"; use: docs/API.md, "Data loaders".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import SchemaError
from .data import EpochSampler
from .micro_batches import MAX_MICRO_BATCHES, Selection
from .seeds import sample_seed, seeded

#: ``StatefulLoader.state_dict()["format"]``.
LOADER_FORMAT = "ripresa.loader/1"
_M64 = (1 << 64) - 1
#: DataLoader arguments the loader decides itself.
_OWN = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")


class _SeededDataset(Dataset):
    """``dataset[(epoch, i)]`` is ``dataset[i]`` under the randomness of :func:`sample_seed`."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        with seeded(sample_seed(self.seed, epoch, index)):
            return self.dataset[index]


class _Batches:
    """The DataLoader's batch sampler: the rest of the current epoch, from the loader's cursor at ``iter()``."""

    def __init__(self, owner: StatefulLoader) -> None:
        self.owner = owner

    def _plan(self) -> tuple[int, int, Callable[[int, int], np.ndarray]]:
        s = self.owner._sampler
        if self.owner.shuffle:
            perm, feistel = s.permutation, s._feistel
            if perm is not None:
                return s.epoch, s.cursor, lambda a, b: perm[a:b]
            assert feistel is not None
            return s.epoch, s.cursor, lambda a, b: feistel(np.arange(a, b, dtype=np.uint64))
        return s.epoch, s.cursor, lambda a, b: np.arange(a, b, dtype=np.int64)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        s = self.owner._sampler
        epoch, pos, rows = self._plan()
        n, bs = s.n_rows, s.batch_size
        sel = self.owner._selection
        if sel is not None:  # this rank's micro-batches only: the others' rows are never fetched
            for k in sel.plan(-(-pos // bs)):
                yield [(epoch, int(r)) for r in rows(k * bs, min((k + 1) * bs, n))]
            return
        while pos < n and not (s.drop_last and n - pos < bs):
            stop = min(pos + bs, n)
            yield [(epoch, int(r)) for r in rows(pos, stop)]
            pos = stop

    def __len__(self) -> int:
        s = self.owner._sampler
        sel = self.owner._selection
        if sel is not None:
            return sel.local_per_epoch - (0 if self.owner._exhausted() else sel.local_count(-(-s.cursor // s.batch_size)))
        start = 0 if s._epoch_exhausted() else s.cursor
        left = s.n_rows - start
        full, rest = divmod(left, s.batch_size)
        return full + (1 if rest and not s.drop_last else 0)


class StatefulLoader:
    """A multi-worker ``DataLoader`` with an exact, O(1) ``state_dict()`` — pass it as ``TrainingState(data=...)``.

    Args:
        dataset: a map-style dataset (``len`` and ``dataset[i]``); its
            ``__getitem__`` may draw from torch, ``random`` or NumPy's global
            generator: those draws are seeded per sample (module doc).
        batch_size: samples per batch.
        shuffle: a new permutation each epoch (else the rows in order).
        num_workers: worker processes of the underlying ``DataLoader``.
        seed: the base seed of the order and of every sample's randomness.
        collate_fn, worker_init_fn: as for ``DataLoader``.
        drop_last: drop an incomplete final batch of an epoch.
        permutation: ``"auto"``, ``"numpy"`` or ``"feistel"``, as for :class:`~ripresa.EpochSampler`.
        **loader_kwargs: other ``DataLoader`` arguments (``pin_memory``,
            ``prefetch_factor``, ``persistent_workers``, ``multiprocessing_context``, ``timeout``...).

    Each ``iter(loader)`` yields the rest of the current epoch (all of the next
    epoch when the current one is done), as ``for epoch ...: for batch in
    loader`` expects; after :meth:`load_state_dict` the first ``iter()`` goes
    on from the saved batch. Randomness drawn by the sampler or the samples
    never touches the caller's global generators.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        drop_last: bool = False,
        permutation: str = "auto",
        **loader_kwargs: Any,
    ) -> None:
        clash = sorted(set(loader_kwargs) & set(_OWN))
        if clash:
            raise TypeError(f"StatefulLoader decides {clash} itself (the order must be resumable); remove them")
        if type(seed) is not int or not 0 <= seed <= _M64:
            raise ValueError(f"seed must be an int in 0..2**64-1, got {seed!r}")
        self.dataset = dataset
        self.seed = seed
        self.shuffle = bool(shuffle)
        # Without shuffling the order is the identity; a feistel sampler then costs no memory.
        self._sampler = EpochSampler(len(dataset), batch_size, seed=seed, drop_last=drop_last,
                                     permutation=permutation if shuffle else "feistel")
        self._selection: Selection | None = None
        self._saved_micro: int | None = None  # micro_batches of a loaded position, until select() takes it
        self._batches = _Batches(self)
        # A private generator: the DataLoader draws its workers' base seed from it, never from torch's global one.
        self._loader = DataLoader(
            _SeededDataset(dataset, seed),
            batch_sampler=self._batches,
            num_workers=num_workers,
            collate_fn=collate_fn,
            worker_init_fn=worker_init_fn,
            generator=torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF),
            **loader_kwargs,
        )

    @property
    def epoch(self) -> int:
        """The epoch of the last batch delivered (-1 before the first)."""
        return self._sampler.epoch

    @property
    def batches_per_epoch(self) -> int:
        return self._sampler.batches_per_epoch

    @property
    def rows_consumed(self) -> int:
        return self._sampler.rows_consumed

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields."""
        return len(self._batches)

    @property
    def selection(self) -> Selection | None:
        """What :meth:`select` chose (None: every batch of the order)."""
        return self._selection

    def select(self, *, micro_batches: int, indices: Any) -> StatefulLoader:
        """Yield only this rank's micro-batches of every step, as :meth:`ripresa.core.loader.ExactLoader.select`.

        ``batch_size`` is the micro-batch size; the loader (the same on every rank) is the global
        order; iterating yields micro-batches ``s·G + i`` for ``i`` in ``indices``, step after step,
        and its workers fetch no other rank's rows. The saved position stays global (rows of the
        epoch's permutation passed, the same on every rank between steps) and adds ``micro_batches``.
        An epoch uses ``⌊batches_per_epoch / G⌋ · G`` micro-batches. Returns the loader.
        """
        sel = Selection(micro_batches, indices, self._sampler.batches_per_epoch)
        if self._saved_micro is not None and self._saved_micro != sel.G:
            raise SchemaError(f"data position was saved with micro_batches={self._saved_micro}, this run selects "
                              f"{sel.G}", expected=sel.G, found=self._saved_micro,
                              hint="resume with the micro-batches of the run that saved (the global batch and "
                                   "the steps depend on them)")
        self._selection = sel
        return self

    def _exhausted(self) -> bool:
        s, sel = self._sampler, self._selection
        if sel is None:
            return s._epoch_exhausted()
        return s.epoch < 0 or s.cursor >= min(sel.limit * s.batch_size, s.n_rows)

    def __iter__(self) -> Iterator[Any]:
        s, sel = self._sampler, self._selection
        if self._saved_micro is not None and sel is None:
            raise SchemaError(f"data position was saved by a loader selected for micro_batches={self._saved_micro}",
                              expected=f"select(micro_batches={self._saved_micro}, indices=...) before iterating",
                              found="a loader not selected",
                              hint="call loader.select(...) as the run that saved did (docs/API.md, \"Data loaders\")")
        if self._exhausted():
            s._begin_epoch()
        if sel is not None:
            epoch, bs = s.epoch, s.batch_size
            for batch, k in zip(self._loader, sel.plan(-(-s.cursor // bs)), strict=False):
                if s.epoch == epoch:
                    rows = min(sel.after(k) * bs, s.n_rows)
                    s.rows_consumed += rows - s.cursor
                    s.cursor = rows
                yield batch
            end = min(sel.limit * bs, s.n_rows)
            if s.epoch == epoch and s.cursor < end:  # the rest of the epoch holds none of this rank's: it is done
                s.rows_consumed += end - s.cursor
                s.cursor = end
            return
        for batch in self._loader:
            take = min(s.batch_size, s.n_rows - s.cursor)
            s.cursor += take
            s.rows_consumed += take
            yield batch

    # -- Stateful -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered: the sampler's O(1) state, its generator's and its base seed."""
        from .rng import numpy_bitgen_state

        out = {
            "format": LOADER_FORMAT,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "sampler": self._sampler.state_dict(),
            "generator": numpy_bitgen_state(self._sampler.generator.bit_generator.state),
        }
        if self._selection is not None:  # the cursor counts the rows of global micro-batches passed
            out["micro_batches"] = self._selection.G
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved position; refuses one of another seed, data set or batch size (nothing changed then)."""
        from .rng import validate_numpy_state

        if not isinstance(state, Mapping) or state.get("format") != LOADER_FORMAT:
            raise SchemaError("data position was not saved by a ripresa StatefulLoader", expected=LOADER_FORMAT,
                              found=state.get("format") if isinstance(state, Mapping) else type(state).__name__)
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise SchemaError(f"data position was saved with {key}={state.get(key)!r}, this loader has {key}={mine!r}",
                                  expected=mine, found=state.get(key),
                                  hint="build the loader as the run that saved (same seed: the same order and augmentation)")
        generator = validate_numpy_state(state.get("generator"), "data.generator")
        micro = state.get("micro_batches")
        if micro is not None and (type(micro) is not int or not 1 <= micro <= MAX_MICRO_BATCHES):
            raise SchemaError("data position is malformed: micro_batches", expected=f"an int in 1..{MAX_MICRO_BATCHES}",
                              found=repr(micro)[:40])
        sel = self._selection  # a loader not selected yet takes a selected position: select() checks it
        if sel is not None and sel.G != micro:
            raise SchemaError(f"data position was saved with micro_batches={micro}, this loader is selected for "
                              f"{sel.G}", expected=sel.G, found=micro,
                              hint="select the loader (loader.select) as the run that saved did (docs/API.md, "
                                   "\"Data loaders\")")
        self._sampler.load_state_dict(state.get("sampler"))  # validated before it changes anything
        self._sampler.generator.bit_generator.state = generator
        self._saved_micro = micro
