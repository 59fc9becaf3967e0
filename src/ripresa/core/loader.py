"""Data loaders whose position resumes exactly, worker augmentation included (docs/API.md, "Data loaders").

:func:`make_exact` makes a ``torch.utils.data.DataLoader`` the user already has exact, in place (its
:class:`ExactLoader` is the position); ripresa's own loader, :class:`StatefulLoader`, lives in
:mod:`ripresa.core.stateful_loader` and is importable from here. Both seed each sample's transform from
``(seed, epoch, i)`` (:func:`sample_seed`). The saved layout: docs/FORMAT.md, "The data position".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import SchemaError
from .micro_batches import MAX_MICRO_BATCHES, Selection
from .seeds import sample_seed
from .seeds import seeded as _seeded
from .stateful_loader import LOADER_FORMAT as LOADER_FORMAT  # re-exported
from .stateful_loader import StatefulLoader as StatefulLoader  # re-exported

_M64 = (1 << 64) - 1


# ============================================================================ make_exact
#: ``ExactLoader.state_dict()["format"]``.
EXACT_FORMAT = "ripresa.exact_loader/1"
_M63 = (1 << 63) - 1
#: The loader's own "indices" of sample_seed: the epoch's order and the workers' base seed.
_ORDER_INDEX, _BASE_SEED_INDEX = _M64, _M64 - 1


class _Key(int):
    """A dataset index that carries the random seed of its sample's randomness (:func:`sample_seed`).

    An ``int`` for everything that handles indices (batch samplers, accelerate's
    shards); only :class:`_ExactDataset` reads :attr:`seed`. It travels to the
    workers with the index, so they hold no state of their own.
    """

    seed: int

    def __new__(cls, index: int, seed: int) -> _Key:
        key = super().__new__(cls, index)
        key.seed = seed
        return key

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Key, (int(self), self.seed))

    def __repr__(self) -> str:
        return f"{int(self)}"


class _ExactDataset(Dataset):
    """The user's map-style dataset, ``dataset[key]`` under the randomness of ``key.seed``.

    A plain ``int`` (``loader.dataset[3]`` by hand) reaches the user's dataset
    unseeded. Other attributes are the user's dataset's (``len``,
    ``loader.dataset.classes``, ``set_epoch``); dunder names are not forwarded,
    so torch's fetcher never finds the inner dataset's ``__getitems__`` (which
    would bypass the per-sample seeding).
    """

    def __init__(self, dataset: Any) -> None:
        self.__dict__["_ripresa_inner"] = dataset

    def __len__(self) -> int:
        return len(self._ripresa_inner)

    def __getitem__(self, key: Any) -> Any:
        inner = self._ripresa_inner
        if isinstance(key, _Key):
            with _seeded(key.seed):
                return inner[int(key)]
        return inner[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_ripresa_inner":
            raise AttributeError(name)
        return getattr(self._ripresa_inner, name)

    def __repr__(self) -> str:
        return f"exact({self._ripresa_inner!r})"


def _dl_set(dl: Any, name: str, value: Any) -> None:
    """Set a DataLoader attribute that ``DataLoader.__setattr__`` guards after construction."""
    object.__setattr__(dl, name, value)


def _generator_seed(g: Any) -> int | None:
    return int(g.initial_seed()) if isinstance(g, torch.Generator) else None


class _Order:
    """The index order of one epoch as a function of ``(seed, epoch)`` only, for each sampler kind torch and accelerate build.

    ``describe`` is what a saved position must match to be loaded (the data
    set's length and the shape of the order: a resume with another world size,
    rank, ``num_samples`` or batch size is refused).
    """

    def __init__(self, sampler: Any, where: str) -> None:
        from torch.utils.data import (
            DistributedSampler,
            RandomSampler,
            SequentialSampler,
            SubsetRandomSampler,
            WeightedRandomSampler,
        )

        kind = type(sampler)
        self.default_seed: int | None = None
        if kind is SequentialSampler:
            self.kind, self.length = "sequential", len(sampler.data_source)
            self.describe: dict[str, Any] = {"kind": "sequential", "n": self.length}
        elif kind is RandomSampler or _is_accelerate(sampler, "SeedableRandomSampler") or _is_torchdata(sampler, "RandomSampler"):
            self.kind = "random"
            self.n = len(sampler.data_source)
            self.replacement, self.length = bool(sampler.replacement), int(sampler.num_samples)
            self.describe = {"kind": "random", "n": self.n, "num_samples": self.length, "replacement": self.replacement}
            self.default_seed = (int(sampler.initial_seed) if hasattr(sampler, "initial_seed")
                                 else _generator_seed(sampler.generator))
        elif kind is SubsetRandomSampler:
            self.kind, self.subset = "subset", torch.as_tensor(list(sampler.indices), dtype=torch.int64)
            self.length = len(self.subset)
            self.describe = {"kind": "subset", "n": self.length}
            self.default_seed = _generator_seed(sampler.generator)
        elif kind is WeightedRandomSampler:
            self.kind, self.weights = "weighted", sampler.weights
            self.replacement, self.length = bool(sampler.replacement), int(sampler.num_samples)
            self.describe = {"kind": "weighted", "n": len(self.weights), "num_samples": self.length,
                             "replacement": self.replacement}
            self.default_seed = _generator_seed(sampler.generator)
        elif kind is DistributedSampler or _is_torchdata(sampler, "StatefulDistributedSampler"):
            self.kind = "distributed"
            self.n = len(sampler.dataset)
            self.shuffle, self.order_seed, self.drop_last = bool(sampler.shuffle), int(sampler.seed), bool(sampler.drop_last)
            self.world, self.rank = int(sampler.num_replicas), int(sampler.rank)
            self.length, self.total = int(sampler.num_samples), int(sampler.total_size)
            self.describe = {"kind": "distributed", "n": self.n, "shuffle": self.shuffle, "order_seed": self.order_seed,
                             "drop_last": self.drop_last, "world_size": self.world, "rank": self.rank}
            self.default_seed = self.order_seed
        else:
            raise TypeError(
                f"make_exact: {where} is a {kind.__module__}.{kind.__qualname__}, whose order ripresa cannot "
                "regenerate from (seed, epoch); it knows SequentialSampler, RandomSampler (shuffle=True), "
                "SubsetRandomSampler, WeightedRandomSampler, DistributedSampler, accelerate's "
                "SeedableRandomSampler and torchdata's RandomSampler and StatefulDistributedSampler. Build the DataLoader with one of these, or use ripresa.StatefulLoader "
                "(docs/API.md, \"Data loaders\")")

    def indices(self, seed: int, epoch: int) -> torch.Tensor:
        """The epoch's indices (int64), a pure function of ``(seed, epoch)``: no global generator is drawn from."""
        if self.kind == "sequential":
            return torch.arange(self.length, dtype=torch.int64)
        if self.kind == "distributed":  # DistributedSampler.__iter__ after set_epoch(epoch), verbatim
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.order_seed + epoch)
                idx = torch.randperm(self.n, generator=g)
            else:
                idx = torch.arange(self.n, dtype=torch.int64)
            if not self.drop_last:
                pad = self.total - len(idx)
                if pad > 0:
                    reps = -(-pad // len(idx))
                    idx = torch.cat([idx, idx.repeat(reps)[:pad]])
            else:
                idx = idx[: self.total]
            return idx[self.rank: self.total: self.world]
        g = torch.Generator()
        g.manual_seed(sample_seed(seed, epoch, _ORDER_INDEX) & _M63)
        if self.kind == "subset":
            return self.subset[torch.randperm(self.length, generator=g)]
        if self.kind == "weighted":
            w = torch.as_tensor(self.weights, dtype=torch.double)
            return torch.multinomial(w, self.length, self.replacement, generator=g)
        if self.replacement:
            return torch.randint(self.n, (self.length,), dtype=torch.int64, generator=g)
        reps = -(-self.length // self.n) if self.n else 0
        return torch.cat([torch.randperm(self.n, generator=g) for _ in range(reps)] or
                         [torch.empty(0, dtype=torch.int64)])[: self.length]


class _ExactSampler(torch.utils.data.Sampler):
    """The innermost sampler of an exact loader: the epoch's order as :class:`_Key` s.

    ``skip=True`` (no batching: ``batch_size=None``) starts at the loader's
    cursor; inside a batch sampler it yields the whole epoch and the loader
    skips whole batches. ``set_epoch`` is accepted and ignored: the epoch is
    counted by the loader itself (docs/FORMAT.md, "The data position").
    """

    def __init__(self, handle: ExactLoader, order: _Order, *, skip: bool) -> None:
        self.handle, self.order, self.skip = handle, order, skip

    def __iter__(self) -> Iterator[_Key]:
        h = self.handle
        epoch = h._plan_epoch
        seed = h.seed
        idx = h._epoch_indices(epoch)
        if self.skip and h._selection is not None:  # one sample a micro-batch: this rank's only
            for k in h._selection.plan(h._plan_cursor):
                i = int(idx[k])
                yield _Key(i, sample_seed(seed, epoch, i))
            return
        start = h._plan_cursor if self.skip else 0
        for i in idx[start:].tolist():
            yield _Key(i, sample_seed(seed, epoch, i))

    def __len__(self) -> int:
        sel = self.handle._selection
        return sel.local_per_epoch if self.skip and sel is not None else self.order.length

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the exact loader counts its epochs itself."""


class _ExactBatches(torch.utils.data.Sampler):
    """A ``BatchSampler`` over :class:`_ExactSampler` that starts at the loader's cursor in O(1)."""

    def __init__(self, handle: ExactLoader, sampler: _ExactSampler, batch_size: int, drop_last: bool) -> None:
        self.handle, self.sampler, self.batch_size, self.drop_last = handle, sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[list[_Key]]:
        h = self.handle
        epoch, seed, bs = h._plan_epoch, h.seed, self.batch_size
        idx = h._epoch_indices(epoch)
        n = len(idx)
        if h._selection is not None:  # this rank's micro-batches only: the others' samples are never fetched
            for k in h._selection.plan(h._plan_cursor):
                yield [_Key(i, sample_seed(seed, epoch, i)) for i in idx[k * bs: (k + 1) * bs].tolist()]
            return
        pos = h._plan_cursor * bs
        while pos < n and not (self.drop_last and n - pos < bs):
            yield [_Key(i, sample_seed(seed, epoch, i)) for i in idx[pos: pos + bs].tolist()]
            pos += bs

    def __len__(self) -> int:
        sel = self.handle._selection
        if sel is not None:
            return sel.local_per_epoch
        n = self.sampler.order.length
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the exact loader counts its epochs itself."""


class _SkipBatches(torch.utils.data.Sampler):
    """A known batch sampler (accelerate's ``BatchSamplerShard``) over an exact sampler, from the loader's cursor.

    The epoch's batches are regenerated and the first ``cursor`` dropped: index
    arithmetic only, no sample is loaded. Other attributes are the wrapped one's.
    """

    def __init__(self, handle: ExactLoader, batch_sampler: Any) -> None:
        self.__dict__.update(handle=handle, _ripresa_inner=batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        skip = self.handle._plan_cursor
        for j, batch in enumerate(self._ripresa_inner):
            if j >= skip:
                yield batch

    def __len__(self) -> int:
        return len(self._ripresa_inner)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the exact loader counts its epochs itself."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_ripresa_inner":
            raise AttributeError(name)
        return getattr(self._ripresa_inner, name)


def _is_accelerate(obj: Any, name: str) -> bool:
    return type(obj).__name__ == name and type(obj).__module__.startswith("accelerate.")


def _is_torchdata(obj: Any, name: str) -> bool:
    return type(obj).__name__ == name and type(obj).__module__.startswith("torchdata.stateful_dataloader")


def _is_batch_sampler(bs: Any) -> bool:
    """torch's ``BatchSampler`` or torchdata's (the same batches, plus a state of its own that is not used)."""
    return type(bs) is torch.utils.data.BatchSampler or _is_torchdata(bs, "BatchSampler")


_EXACT_CLASSES: dict[type, type] = {}


def _exact_class(cls: type) -> type:
    """``cls`` with an ``__iter__`` that counts the batches it delivers (one subclass per loader class, cached)."""
    sub = _EXACT_CLASSES.get(cls)
    if sub is None:
        def __iter__(self: Any) -> Iterator[Any]:
            handle: ExactLoader = self.__dict__["_ripresa_exact"]
            handle._begin()
            return handle._deliver(cls.__iter__(self))

        sub = type(f"Exact{cls.__name__}", (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                                    "__qualname__": f"Exact{cls.__qualname__}"})
        _EXACT_CLASSES[cls] = sub
    return sub


class ExactLoader:
    """The exact position of a ``DataLoader`` made exact by :func:`make_exact` — a ``Stateful`` for ``TrainingState(data=...)``.

    ``state_dict()`` is O(1) (docs/FORMAT.md, "The data position"): the sampling seed,
    the epoch and the cursor — batches *delivered* by the loader in that epoch,
    less :attr:`held_back`. A framework that fetches ahead of the step it
    trains (Lightning's prefetching) sets ``held_back`` to the number of
    batches it holds that were not yet trained on, so the position saved at a
    step is the one after that step's batch.
    """

    def __init__(self, loader: Any, target: Any, order: _Order, seed: int, seed_given: bool, per_epoch: int) -> None:
        self.loader = loader
        self._target = target  # the DataLoader whose parts were replaced (an accelerate shard's base loader)
        self._order = order
        self.seed = seed
        self._seed_given = seed_given
        #: batches in a full epoch (``len(loader)``).
        self.batches_per_epoch = per_epoch
        #: batches delivered that the caller has not trained on yet (subtracted by state_dict()).
        self.held_back = 0
        self._epoch, self._cursor, self._done = -1, 0, False
        self._plan_epoch, self._plan_cursor = 0, 0
        self._cached: tuple[int, int, torch.Tensor] | None = None
        self._base_generator = torch.Generator()
        #: this rank's micro-batches of every step (:meth:`select`); None: every batch of the order.
        self._selection: Selection | None = None
        self._saved_micro: int | None = None  # micro_batches of a loaded position, until select() takes it

    # -- position -----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the last batch delivered (-1 before the first)."""
        return self._epoch

    @property
    def cursor(self) -> int:
        """Batches delivered in :attr:`epoch` — after :meth:`select`, the global micro-batches passed (every rank's)."""
        return self._cursor

    @property
    def selection(self) -> Selection | None:
        """What :meth:`select` chose (None: the loader yields every batch of the order)."""
        return self._selection

    def select(self, *, micro_batches: int, indices: Any) -> ExactLoader:
        """Yield only this rank's micro-batches of every step, for world-size-invariant steps (docs/API.md, "Data loaders").

        The loader must be built over the *global* order (``shuffle=True``, a ``RandomSampler``, a
        ``SequentialSampler``...; ``batch_size`` = the micro-batch size), the same on every rank. Its
        batches are then the global micro-batches of an epoch, ``micro_batches`` (``G``) to a step, and
        iterating yields, step after step, micro-batches ``s·G + i`` for ``i`` in ``indices`` (this
        rank's, e.g. ``InvariantSteps.indices()``), in index order; the batch sampler skips the others, so
        neither the loader nor its workers fetch another rank's samples. The saved position counts
        global micro-batches and holds no world size or rank: a run saved on 2 ranks resumes on 1 or 4
        with the micro-batches the uninterrupted run draws. An epoch uses ``⌊len(loader) / G⌋ · G``
        micro-batches (the rest makes no whole step). Returns the handle.

        Raises:
            TypeError: a loader that samples per rank (``DistributedSampler``, accelerate's shards).
            ValueError: ``micro_batches``/``indices`` malformed, or an epoch too short for one step.
            SchemaError: a loaded position was saved with another ``micro_batches``.
        """
        why = self._per_rank()
        if why is not None:
            raise TypeError(f"select: this loader samples per rank ({why}); world-size-invariant steps need the "
                            "global order on every rank: build the DataLoader with shuffle=True (or a RandomSampler, "
                            "SequentialSampler...) and batch_size = the micro-batch size (docs/API.md, \"Data loaders\")")
        sel = Selection(micro_batches, indices, self.batches_per_epoch)
        if self._saved_micro is not None and self._saved_micro != sel.G:
            raise SchemaError(f"data position was saved with micro_batches={self._saved_micro}, this run selects "
                              f"{sel.G}", expected=sel.G, found=self._saved_micro,
                              hint="resume with the micro-batches of the run that saved (the global batch and "
                                   "the steps depend on them)")
        self._selection = sel
        return self

    def _per_rank(self) -> str | None:
        """How this loader samples per rank, or None (the global order)."""
        if self._order.kind == "distributed":
            return (f"a DistributedSampler: rank {self._order.rank} of {self._order.world} takes every "
                    f"{self._order.world}-th sample")
        if self._target is not self.loader or isinstance(self._target.__dict__.get("batch_sampler"), _SkipBatches):
            return "an accelerate prepared loader: each process takes its own shard of the batches"
        return None

    def _limit(self) -> int:
        return self._selection.limit if self._selection is not None else self.batches_per_epoch

    def _exhausted(self) -> bool:
        return self._epoch < 0 or self._done or self._cursor >= self._limit()

    def _epoch_indices(self, epoch: int) -> torch.Tensor:
        cached = self._cached
        if cached is None or cached[:2] != (self.seed, epoch):
            cached = self._cached = (self.seed, epoch, self._order.indices(self.seed, epoch))
        return cached[2]

    def _begin(self) -> None:
        """At ``iter(loader)``: the rest of the current epoch, or all of the next one; no global generator is drawn from."""
        if self._saved_micro is not None and self._selection is None:
            raise SchemaError(f"data position was saved by a loader selected for micro_batches={self._saved_micro}",
                              expected=f"select(micro_batches={self._saved_micro}, indices=...) before iterating",
                              found="a loader not selected",
                              hint="call handle.select(...) as the run that saved did (docs/API.md, \"Data loaders\")")
        if self._exhausted():
            self._epoch, self._cursor, self._done = self._epoch + 1, 0, False
        self._plan_epoch, self._plan_cursor = self._epoch, self._cursor
        # torch draws the workers' base seed from loader.generator at iter(): ours, a function of (seed, epoch).
        self._base_generator.manual_seed(sample_seed(self.seed, self._epoch, _BASE_SEED_INDEX) & _M63)

    def _deliver(self, batches: Iterator[Any]) -> Iterator[Any]:
        epoch, sel = self._epoch, self._selection
        if sel is not None:  # the batch sampler follows the same plan: the position after each is known
            for batch, k in zip(batches, sel.plan(self._plan_cursor), strict=False):
                if self._epoch == epoch:
                    self._cursor = sel.after(k)
                yield batch
            if self._epoch == epoch:
                self._done = True
            return
        for batch in batches:
            if self._epoch == epoch:
                self._cursor += 1
            yield batch
        if self._epoch == epoch:
            self._done = True

    # -- Stateful -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"format", "seed", "epoch", "cursor", "batches_per_epoch", "order"}``: the position after the last batch trained on.

        After :meth:`select`, ``cursor`` counts global micro-batches and ``micro_batches`` is added.
        """
        epoch, cursor, held, done = self._epoch, self._cursor, int(self.held_back), self._done
        sel = self._selection
        if sel is not None:
            local = sel.local_count(cursor)
            if held < 0 or held > local + (sel.local_per_epoch if epoch > 0 else 0):
                raise ValueError(f"held_back={held} is more than the batches delivered")
            if held:
                done = False
                if held <= local:
                    cursor = sel.from_local(local - held)
                else:
                    epoch, cursor = epoch - 1, sel.from_local(sel.local_per_epoch - (held - local))
            return {"format": EXACT_FORMAT, "seed": int(self.seed), "epoch": int(epoch), "cursor": int(cursor),
                    "done": bool(done), "batches_per_epoch": int(self.batches_per_epoch),
                    "order": dict(self._order.describe), "micro_batches": sel.G}
        if held < 0 or held > self._cursor + (self.batches_per_epoch if epoch > 0 else 0):
            raise ValueError(f"held_back={held} is more than the batches delivered")
        if held:
            done = False
            if held <= cursor:  # (epoch, 0): the epoch begun, none of its batches trained on
                cursor -= held
            else:  # the held batches opened this epoch: the position is in the previous one
                epoch, cursor = epoch - 1, self.batches_per_epoch - (held - cursor)
        return {"format": EXACT_FORMAT, "seed": int(self.seed), "epoch": int(epoch), "cursor": int(cursor),
                "done": bool(done), "batches_per_epoch": int(self.batches_per_epoch),
                "order": dict(self._order.describe)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved position; refuses another data set, order, batching or explicit seed (nothing changed then)."""
        if not isinstance(state, Mapping) or state.get("format") != EXACT_FORMAT:
            raise SchemaError("data position was not saved by a loader made exact (ripresa.make_exact)",
                              expected=EXACT_FORMAT,
                              found=state.get("format") if isinstance(state, Mapping) else type(state).__name__,
                              hint="resume with the same kind of loader as the run that saved")
        seed, epoch, cursor, per = state.get("seed"), state.get("epoch"), state.get("cursor"), state.get("batches_per_epoch")
        if state.get("order") != self._order.describe or per != self.batches_per_epoch:
            raise SchemaError("data position was saved for another data set or order",
                              expected={"order": self._order.describe, "batches_per_epoch": self.batches_per_epoch},
                              found={"order": state.get("order"), "batches_per_epoch": per},
                              hint="build the DataLoader as the run that saved (same data set length, sampler, "
                                   "batch size, drop_last, world size and rank)")
        if (type(seed) is not int or not 0 <= seed <= _M64 or type(epoch) is not int or epoch < -1
                or type(cursor) is not int or not 0 <= cursor <= self.batches_per_epoch
                or type(state.get("done")) is not bool):
            raise SchemaError("data position is malformed", expected="seed in 0..2**64-1, epoch >= -1, "
                              f"cursor in 0..{self.batches_per_epoch}, done a bool",
                              found={k: state.get(k) for k in ("seed", "epoch", "cursor", "done")})
        micro = state.get("micro_batches")
        if micro is not None and (type(micro) is not int or not 1 <= micro <= MAX_MICRO_BATCHES
                                  or type(cursor) is not int or cursor > (self.batches_per_epoch // micro) * micro):
            raise SchemaError("data position is malformed: micro_batches",
                              expected=f"an int in 1..{MAX_MICRO_BATCHES}, with the cursor inside the epoch's "
                                       "whole steps",
                              found={"micro_batches": repr(micro)[:40], "cursor": repr(cursor)[:40]})
        sel = self._selection  # a loader not selected yet takes a selected position: select() checks it
        if sel is not None and sel.G != micro:
            raise SchemaError(f"data position was saved with micro_batches={micro}, this loader is "
                              + (f"selected for {sel.G}" if sel is not None else "not selected"),
                              expected=sel.G if sel is not None else None, found=micro,
                              hint="select the loader (handle.select) as the run that saved did (docs/API.md, "
                                   "\"Data loaders\")")
        if self._seed_given and seed != self.seed:
            raise SchemaError(f"data position was saved with seed={seed}, this loader has seed={self.seed}",
                              expected=self.seed, found=seed,
                              hint="make the loader exact with the sampling seed of the run that saved (the same order and "
                                   "augmentation), or leave seed= out to take the saved one")
        self.seed = seed
        self._epoch, self._cursor, self._done = epoch, cursor, bool(state["done"])
        self._saved_micro = micro
        self.held_back = 0

    def __repr__(self) -> str:
        sel = f", micro_batches={self._selection.G}, indices={list(self._selection.indices)}" if self._selection else ""
        return (f"ExactLoader(epoch={self._epoch}, cursor={self._cursor}/{self.batches_per_epoch}, seed={self.seed}, "
                f"order={self._order.kind}{sel})")


def exact_handle(obj: Any) -> ExactLoader | None:
    """The :class:`ExactLoader` of a loader made exact (or the handle itself); None otherwise."""
    if isinstance(obj, ExactLoader):
        return obj
    d = getattr(obj, "__dict__", None)
    h = d.get("_ripresa_exact") if isinstance(d, dict) else None
    return h if isinstance(h, ExactLoader) else None


def make_exact(loader: Any, *, seed: int | None = None) -> ExactLoader:
    """Make a user's own ``DataLoader`` resume exactly, in place; return its position (a ``Stateful``).

    After the call, iterating the *same* loader object yields, epoch after
    epoch, an order regenerated from ``(seed, epoch)`` — ``shuffle=True``'s
    ``RandomSampler`` becomes a permutation drawn from a generator seeded by
    both, a ``DistributedSampler`` keeps its own order and this rank's shard
    (``seed + epoch``) — and each sample's ``__getitem__`` draws from torch,
    ``random`` and NumPy seeded by ``(seed, epoch, index)``, in whichever worker.
    The draws a ``DataLoader`` makes at ``iter()`` (the sampler's seed, the
    workers' base seed) no longer touch the global generators. ``batch_size``,
    ``drop_last``, ``num_workers``, ``collate_fn``, ``worker_init_fn``,
    ``pin_memory`` and ``persistent_workers`` are kept. Each ``iter(loader)``
    yields the rest of the current epoch (all of the next one when it is done).

    For world-size-invariant steps, build it over the global order (the same on
    every rank) and call :meth:`ExactLoader.select` on the handle: the loader
    then yields only this rank's micro-batches of every step.

    Pass the loader (or the returned handle) as ``TrainingState(data=...)``;
    its saved position is O(1): seed, epoch, batches delivered. Calling it
    again returns the same handle. Works on ``DataLoader`` and its subclasses
    (torchdata's ``StatefulDataLoader``) and on what ``accelerator.prepare``
    returns (``DataLoaderShard``, ``DataLoaderDispatcher``).

    Args:
        loader: the DataLoader, over a map-style dataset.
        seed: the base of the order and of every sample's randomness. Default:
            the sampler's seed (``DistributedSampler.seed``, accelerate's
            ``data_seed``), else the random seed of the generator given to the loader
            or sampler, else ``torch.initial_seed()`` (what ``torch.manual_seed``
            set). A default seed yields to the saved one at a resume; an
            explicit one must match it.

    Raises:
        TypeError: not a DataLoader; an iterable-style dataset; a sampler or
            batch sampler whose order cannot be regenerated (the message names
            it and the fix).
    """
    handle = exact_handle(loader)
    if handle is not None:
        if seed is not None and seed != handle.seed:
            raise ValueError(f"make_exact: this loader is already exact with seed={handle.seed}, not {seed}")
        return handle
    if not isinstance(loader, DataLoader):
        raise TypeError(f"make_exact takes a torch.utils.data.DataLoader, not {type(loader).__name__}")
    if seed is not None and (type(seed) is not int or not 0 <= seed <= _M64):
        raise ValueError(f"seed must be an int in 0..2**64-1, got {seed!r}")
    adapter = _is_accelerate(loader, "DataLoaderShard") or _is_accelerate(loader, "DataLoaderDispatcher")
    dl = loader.__dict__["base_dataloader"] if adapter else loader
    if exact_handle(dl) is not None or "_ripresa_exact_part" in dl.__dict__:
        raise TypeError("make_exact: this DataLoader is already part of a loader made exact; pass that one")
    if isinstance(dl.dataset, torch.utils.data.IterableDataset):
        has_state = callable(getattr(dl.dataset, "state_dict", None)) and callable(getattr(dl.dataset, "load_state_dict", None))
        raise TypeError(
            f"make_exact: the loader's dataset ({type(dl.dataset).__name__}) is an IterableDataset: its order is "
            "its own, not a sampler's, so ripresa cannot regenerate it. "
            + ("Save its position itself: pass the dataset as TrainingState(objects={'data': dataset}) and "
               "make its draws deterministic" if has_state else
               "It has no state_dict()/load_state_dict(), so its position cannot be saved at all: give it both "
               "methods (the Stateful protocol), or use a map-style dataset (len and dataset[i]) with a DataLoader "
               "(shuffle=True) and make_exact"))
    if isinstance(dl.dataset, _ExactDataset):
        raise TypeError("make_exact: this DataLoader's dataset is already an exact one; pass the loader made exact")

    handle_ref: list[ExactLoader] = []
    bs = dl.batch_sampler
    if bs is None:  # batch_size=None: one sample at a time
        order = _Order(dl.sampler, "its sampler")

        def install() -> None:
            _dl_set(dl, "sampler", _ExactSampler(handle_ref[0], order, skip=True))
        per_epoch = order.length
    elif _is_batch_sampler(bs):
        order = _Order(bs.sampler, "its sampler")
        batch_size, drop_last = int(bs.batch_size), bool(bs.drop_last)

        def install() -> None:
            sampler = _ExactSampler(handle_ref[0], order, skip=False)
            _dl_set(dl, "sampler", sampler)
            _dl_set(dl, "batch_sampler", _ExactBatches(handle_ref[0], sampler, batch_size, drop_last))
        per_epoch = len(bs)
    elif _is_accelerate(bs, "BatchSamplerShard") and _is_batch_sampler(bs.batch_sampler):
        inner = bs.batch_sampler
        order = _Order(inner.sampler, "the sampler inside accelerate's BatchSamplerShard")

        def install() -> None:
            inner.sampler = _ExactSampler(handle_ref[0], order, skip=False)
            _dl_set(dl, "sampler", inner.sampler)
            _dl_set(dl, "batch_sampler", _SkipBatches(handle_ref[0], bs))
        per_epoch = len(bs)
    else:
        kind = type(bs)
        raise TypeError(
            f"make_exact: the loader's batch_sampler is a {kind.__module__}.{kind.__qualname__}: ripresa cannot "
            "regenerate its batches from (seed, epoch). Build the DataLoader with batch_size= and a sampler "
            "(shuffle=True, a DistributedSampler, ...), or use ripresa.StatefulLoader (docs/API.md, \"Data loaders\")")

    if seed is None:
        gen_seed = _generator_seed(dl.generator)
        chosen = order.default_seed if order.default_seed is not None else gen_seed
        seed_value, given = (int(chosen) if chosen is not None else int(torch.initial_seed())) & _M64, False
    else:
        seed_value, given = seed, True
    handle = ExactLoader(loader, dl, order, seed_value, given, per_epoch)
    handle_ref.append(handle)

    # A persistent worker pool made before this call holds the old dataset and sampler: close it.
    it = dl.__dict__.get("_iterator")
    if it is not None:
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        dl.__dict__["_iterator"] = None
    install()
    _dl_set(dl, "dataset", _ExactDataset(dl.dataset))
    _dl_set(dl, "generator", handle._base_generator)
    if dl is not loader:
        dl.__dict__["_ripresa_exact_part"] = True
    loader.__dict__["_ripresa_exact"] = handle
    object.__dict__["__class__"].__set__(loader, _exact_class(type(loader)))
    return handle


def per_rank_sampling(obj: Any) -> str | None:
    """How ``obj`` (a ``TrainingState``'s data) samples per rank, or None: what world-size-invariant steps refuse.

    A description when ``obj`` — a ``DataLoader``, one made exact (or its :class:`ExactLoader`), a
    :class:`StatefulLoader`, a ``DistributedEpochSampler`` — draws a per-rank share of the data (a
    ``DistributedSampler``, accelerate's prepared loaders, a sampler built with a rank and world size)
    and has not been :meth:`ExactLoader.select` ed; None for a loader over the global order, selected or
    not, and for anything else (docs/API.md, "Data loaders").
    """
    from .data import DistributedEpochSampler

    handle = exact_handle(obj)
    if handle is not None:
        return None if handle.selection is not None else handle._per_rank()
    if isinstance(obj, DistributedEpochSampler):
        return (f"a DistributedEpochSampler: rank {obj.rank} of {obj.world_size} takes every "
                f"{obj.world_size}-th row of a global batch of batch_size x world_size")
    if isinstance(obj, StatefulLoader):
        return None  # one global order, the same on every rank
    if isinstance(obj, DataLoader):
        if _is_accelerate(obj, "DataLoaderShard") or _is_accelerate(obj, "DataLoaderDispatcher"):
            return f"accelerate's {type(obj).__name__}: each process takes its own shard of the batches"
        samplers = [obj.sampler, getattr(obj.batch_sampler, "sampler", None)]
        bs = obj.batch_sampler
        if _is_accelerate(bs, "BatchSamplerShard"):
            return "accelerate's BatchSamplerShard: each process takes its own shard of the batches"
        for sampler in samplers:
            if isinstance(sampler, torch.utils.data.DistributedSampler) or _is_torchdata(sampler, "StatefulDistributedSampler"):
                return (f"a {type(sampler).__name__}: rank {sampler.rank} of {sampler.num_replicas} takes every "
                        f"{sampler.num_replicas}-th sample")
    return None
