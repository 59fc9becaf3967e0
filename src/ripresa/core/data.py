"""Resumable data order: epoch permutations, a cursor, and the ids each batch took (docs/FORMAT.md, "The data position").

:class:`EpochSampler` saves how to *regenerate* the epoch's permutation (the generator's state
at the epoch's start, or the epoch's Feistel key) and the cursor inside it, never the
permutation: a few hundred bytes whatever the number of rows. A mid-epoch resume continues
with exactly the next rows, and the next epoch's permutation is drawn the same.
"""

from __future__ import annotations

import copy
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

#: ``permutation="auto"`` draws NumPy permutations up to this many rows (an int64
#: permutation of 2**26 rows is 512 MiB) and uses the Feistel bijection above it
#: (docs/FORMAT.md, "The data position").
AUTO_FEISTEL_ABOVE = 2**26
#: Permutation kinds an :class:`EpochSampler` can draw.
PERMUTATION_KINDS = ("numpy", "feistel")
#: Rounds of the Feistel network (any number makes a bijection; 8 mixes well).
FEISTEL_ROUNDS = 8
#: Largest data set the Feistel bijection covers (its halves stay below 2**31).
FEISTEL_MAX_ROWS = 2**62

_M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of SplitMix64's output function on a Python int (mod 2**64)."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """A keyed bijection on ``[0, n)`` with O(1) memory and random access.

    A balanced Feistel network of :data:`FEISTEL_ROUNDS` rounds permutes
    ``[0, 4**k)``, the smallest power of four (an even number of bits) that
    holds ``n``; a value that lands at or above ``n`` is encrypted again
    (cycle-walking) until it falls inside, which keeps the map a bijection on
    ``[0, n)``. Since ``4**k < 4 n``, fewer than 4 passes are needed on
    average. The round keys come from ``key`` through SplitMix64.
    """

    def __init__(self, n: int, key: int) -> None:
        if not 1 <= n <= FEISTEL_MAX_ROWS:
            raise ValueError(f"a Feistel permutation covers 1..{FEISTEL_MAX_ROWS} rows, got {n}")
        self.n = int(n)
        self.key = int(key) & _M64
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        k, keys = self.key, []
        for _ in range(FEISTEL_ROUNDS):
            k = splitmix64(k)
            keys.append(np.uint64(k))
        self.round_keys = keys

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The rows at ``positions`` (ints in ``[0, n)``) of the permutation, as int64."""
        x = np.asarray(positions, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} out of range for {self.n} rows")
        x = self._encrypt(x)
        out = x >= np.uint64(self.n)
        while out.any():
            x[out] = self._encrypt(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)


def _bitgen_from_state(state: Mapping[str, Any]) -> np.random.Generator:
    """A fresh NumPy generator whose bit generator is at ``state`` (a numpy-form state dict)."""
    bitgen = getattr(np.random, str(state["bit_generator"]))()
    bitgen.state = state
    return np.random.Generator(bitgen)


class EpochSampler:
    """Yields batches of row ids, one epoch permutation at a time.

    Args:
        n_rows: number of rows in the data set.
        batch_size: rows per batch.
        generator: the NumPy generator that draws permutations. Register the
            same generator in :class:`~ripresa.RandomStreams` so that its state
            is saved; pass ``seed`` instead to let the sampler own a PCG64.
        drop_last: drop an incomplete final batch of an epoch (else it is short).
        permutation: ``"numpy"`` — ``generator.permutation(n_rows)`` at each
            epoch's start (O(n_rows) memory); ``"feistel"`` — a keyed
            bijection (:class:`FeistelPermutation`) whose 64-bit key is drawn
            from ``generator`` at each epoch's start (O(1) memory, random
            access); ``"auto"`` (default) — numpy up to
            :data:`AUTO_FEISTEL_ABOVE` rows, feistel above.

    The permutation of epoch ``e`` is drawn lazily, when the first batch of
    ``e`` is requested, so that a save at the end of an epoch does not yet
    hold the next one and a resume draws it from the restored generator.
    Either way the saved position is O(1): the generator's state at the
    epoch's start (numpy) or the epoch's key (feistel), from which
    :meth:`load_state_dict` regenerates the same permutation bit for bit.
    """

    def __init__(
        self,
        n_rows: int,
        batch_size: int,
        *,
        generator: np.random.Generator | None = None,
        seed: int | None = None,
        drop_last: bool = False,
        permutation: str = "auto",
    ) -> None:
        n_rows = check_int(n_rows, "n_rows", at_least=1)
        batch_size = check_int(batch_size, "batch_size", at_least=1)
        _check_source(generator, seed, drop_last)
        if drop_last and batch_size > n_rows:
            raise ValueError(f"drop_last with batch_size {batch_size} > n_rows {n_rows} yields no batch")
        #: True when the kind was chosen by size: a loaded state's kind is then adopted.
        self.permutation_auto = permutation == "auto"
        if permutation == "auto":
            permutation = "feistel" if n_rows > AUTO_FEISTEL_ABOVE else "numpy"
        if permutation not in PERMUTATION_KINDS:
            raise ValueError(f"permutation must be 'auto', 'numpy' or 'feistel', got {permutation!r}")
        if permutation == "feistel" and n_rows > FEISTEL_MAX_ROWS:
            raise ValueError(f"permutation='feistel' covers at most {FEISTEL_MAX_ROWS} rows, got {n_rows}")
        #: True when the sampler made its own generator (``seed=``): nothing else saves it, so its state does.
        self.owns_generator = generator is None
        if generator is None:
            generator = np.random.Generator(np.random.PCG64(0 if seed is None else seed))
        self.n_rows = int(n_rows)
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.generator = generator
        #: "numpy" or "feistel" (``"auto"`` resolved).
        self.permutation_kind = permutation
        self.epoch = -1  # no permutation drawn yet
        self.cursor = 0
        #: The epoch's permutation (numpy kind, or a legacy state's); None for feistel.
        self.permutation: np.ndarray | None = None
        self.rows_consumed = 0
        # How to regenerate the current epoch's permutation: the saved form
        # ({"kind": "numpy", "generator": ...} or {"kind": "feistel", "key": ...});
        # None before the first epoch and after loading a legacy state.
        self._recipe: dict[str, Any] | None = None
        self._feistel: FeistelPermutation | None = None

    def _epoch_exhausted(self) -> bool:
        if self.epoch < 0:
            return True
        remaining = self.n_rows - self.cursor
        return remaining == 0 or (self.drop_last and remaining < self.batch_size)

    def _begin_epoch(self) -> None:
        """Draw the next epoch's permutation (or key) from the generator; cursor to 0."""
        from .rng import numpy_bitgen_state

        if self.permutation_kind == "numpy":
            start = numpy_bitgen_state(self.generator.bit_generator.state)
            self.permutation = self.generator.permutation(self.n_rows)
            self._recipe = {"kind": "numpy", "generator": start}
        else:
            key = int(self.generator.integers(0, 2**63, dtype=np.int64))
            self._feistel = FeistelPermutation(self.n_rows, key)
            self.permutation = None
            self._recipe = {"kind": "feistel", "key": key}
        self.epoch += 1
        self.cursor = 0

    def _rows(self, start: int, stop: int) -> np.ndarray:
        """Rows at positions ``[start, stop)`` of the current epoch's permutation (int64)."""
        if self.permutation is not None:
            return self.permutation[start:stop]
        assert self._feistel is not None
        return self._feistel(np.arange(start, stop, dtype=np.uint64))

    def next_batch(self) -> list[int]:
        """Ids of the rows of the next batch (a new permutation when an epoch ends)."""
        if self._epoch_exhausted():
            self._begin_epoch()
        ids = self._rows(self.cursor, min(self.cursor + self.batch_size, self.n_rows))
        self.cursor += len(ids)
        self.rows_consumed += len(ids)
        return [int(i) for i in ids]

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.n_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    # -- Stateful -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Epoch, cursor, rows consumed and how to regenerate the epoch's permutation — O(1) in ``n_rows``.

        ``permutation`` is None before the first epoch, else
        ``{"kind": "numpy", "generator": <bit-generator state at the epoch's
        start>}`` or ``{"kind": "feistel", "key": <int>}``. After loading a
        legacy state (which carried the permutation itself) the permutation
        tensor is saved again until the next epoch starts. A generator passed
        in: its *current* state is not here, it belongs to the random streams,
        restored last (it may be shared with other draws, such as noise). A
        generator the sampler made itself (``seed=``) is saved nowhere else:
        its current state is ``generator`` (O(1)), so that the epochs after a
        resume draw the same permutations.
        """
        if self.epoch < 0:
            perm: Any = None
        elif self._recipe is not None:
            perm = copy.deepcopy(self._recipe)
        else:  # a legacy state's permutation, not regenerable
            assert self.permutation is not None
            perm = torch.from_numpy(np.ascontiguousarray(self.permutation, dtype=np.int64)).clone()
        out = {
            "n_rows": self.n_rows,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "rows_consumed": self.rows_consumed,
            "permutation": perm,
        }
        if self.owns_generator:
            from .rng import numpy_bitgen_state

            out["generator"] = numpy_bitgen_state(self.generator.bit_generator.state)
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position, regenerating the epoch's permutation; refuses a state for another data set or batch size.

        Everything is checked (:func:`validate_sampler_state`) before anything changes.
        A legacy state that carries the permutation itself (an int64 tensor) is accepted, and so is one
        without ``generator`` (written before it was saved: the current epoch is exact, later ones are not).
        A saved ``generator`` is restored into a generator this sampler owns (``seed=``); a generator passed
        in is the random streams' to restore.
        """
        validate_sampler_state(state)
        for key, mine in (("n_rows", self.n_rows), ("batch_size", self.batch_size), ("drop_last", self.drop_last)):
            if state[key] != mine:
                raise SchemaError(
                    f"data position was saved with {key}={state[key]}, this run has {key}={mine}",
                    expected=mine,
                    found=state[key],
                    hint="resume with the same data set and batch size",
                )
        perm = state.get("permutation")
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        recipe: dict[str, Any] | None = None
        feistel: FeistelPermutation | None = None
        arr: np.ndarray | None = None
        kind = None if perm is None else perm["kind"] if isinstance(perm, Mapping) else "numpy"
        # "auto" adopts the saved kind — but draws a NumPy permutation above the threshold only when asked explicitly.
        adopt = self.permutation_auto and not (isinstance(perm, Mapping) and kind == "numpy")
        if kind is not None and kind != self.permutation_kind and not adopt:
            raise SchemaError(
                f"data position was saved with permutation={kind!r}, this sampler draws {self.permutation_kind!r}",
                expected=self.permutation_kind, found=kind,
                hint=f"build the sampler with permutation={kind!r} (or 'auto'), as the run that saved",
            )
        if isinstance(perm, Mapping):
            recipe = copy.deepcopy(dict(perm))
            if kind == "numpy":
                from .rng import numpy_bitgen_state_back

                start = numpy_bitgen_state_back(perm["generator"], "data.permutation.generator")
                arr = _bitgen_from_state(start).permutation(self.n_rows)
            else:
                feistel = FeistelPermutation(self.n_rows, int(perm["key"]))
        elif perm is not None:  # legacy: the permutation itself (numpy kind)
            arr = perm.numpy() if isinstance(perm, torch.Tensor) else np.asarray(perm)
            if arr.shape != (self.n_rows,) or not np.array_equal(np.sort(arr), np.arange(self.n_rows)):
                raise SchemaError(
                    "saved permutation is not a permutation of the data set's rows",
                    expected=f"a permutation of 0..{self.n_rows - 1}",
                    found=f"shape {arr.shape}",
                )
            arr = arr.astype(np.int64, copy=True)
        self.permutation, self._recipe, self._feistel = arr, recipe, feistel
        if kind is not None:  # an "auto" sampler goes on with the kind of the run that saved
            self.permutation_kind = kind
        self.epoch, self.cursor = epoch, cursor
        self.rows_consumed = int(state["rows_consumed"])
        if self.owns_generator and state.get("generator") is not None:
            from .rng import numpy_bitgen_state_back

            self.generator.bit_generator.state = numpy_bitgen_state_back(state["generator"], "data.generator")


_INT64 = 2**63 - 1


def validate_sampler_state(state: Any, where: str = "data") -> None:
    """Structural check of a saved :meth:`EpochSampler.state_dict` (types and ranges); :class:`SchemaError`.

    Used by :meth:`EpochSampler.load_state_dict` and, for a state read from a
    file, by :func:`ripresa.core.state.validate_saved_state` (what ``ripresa inspect
    --deep`` and a resume share). ``permutation`` is None (no epoch yet), a
    regeneration recipe (numpy generator state or Feistel key), or — a legacy
    state — the int64 permutation itself.
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
    elif isinstance(perm, Mapping):
        _validate_recipe(perm, n, f"{where}.permutation")
        if epoch < 0:
            raise SchemaError(f"{where}: data position has a permutation but no epoch", found=f"epoch {epoch}")
    elif not (isinstance(perm, torch.Tensor) and perm.dtype == torch.int64 and tuple(perm.shape) == (n,)):
        found = f"{perm.dtype}, shape {tuple(perm.shape)}" if isinstance(perm, torch.Tensor) else type(perm).__name__
        raise SchemaError(f"{where}: saved permutation is not an int64 tensor of n_rows ids", expected=f"int64, shape ({n},)",
                          found=found)
    elif epoch < 0:
        raise SchemaError(f"{where}: data position has a permutation but no epoch", found=f"epoch {epoch}")
    if state.get("distributed"):
        ws = state.get("world_size")
        if type(ws) is not int or not 1 <= ws <= 1 << 20:
            raise SchemaError(f"{where}.world_size out of range", expected="1..1048576", found=repr(ws)[:80])
    if state.get("distributed") or state.get("generator") is not None:
        from .rng import validate_numpy_state

        validate_numpy_state(state.get("generator"), f"{where}.generator")


def _validate_recipe(perm: Mapping[str, Any], n: int, where: str) -> None:
    """A saved permutation recipe: ``{"kind": "numpy", "generator": state}`` or ``{"kind": "feistel", "key": int}``."""
    kind = perm.get("kind")
    fields = {"numpy": {"kind", "generator"}, "feistel": {"kind", "key"}}
    if kind not in fields or set(map(str, perm)) != fields[kind]:
        raise SchemaError(f"{where}: not a permutation recipe", expected="{kind: numpy, generator} or {kind: feistel, key}",
                          found=sorted(map(str, perm))[:8] if kind in fields else repr(kind)[:80])
    if kind == "numpy":
        from .rng import validate_numpy_state

        validate_numpy_state(perm["generator"], f"{where}.generator")
    else:
        key = perm["key"]
        if type(key) is not int or not 0 <= key <= _INT64:
            raise SchemaError(f"{where}.key is not an integer in range", expected=f"0..{_INT64}", found=repr(key)[:80])
        if n > FEISTEL_MAX_ROWS:
            raise SchemaError(f"{where}: a Feistel permutation covers at most {FEISTEL_MAX_ROWS} rows", found=n)


class DistributedEpochSampler(EpochSampler):
    """An :class:`EpochSampler` shared by the ranks of a distributed run, without overlap or gaps.

    Every rank holds the same *global* position — the epoch, how to regenerate
    its permutation (O(1), as :class:`EpochSampler`) and a cursor into it — and draws the same permutations (same seed on every
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
        permutation: ``"auto"``, ``"numpy"`` or ``"feistel"``, as for :class:`EpochSampler`.

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
        permutation: str = "auto",
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
        super().__init__(n_rows, batch_size * world_size, generator=generator, seed=seed, drop_last=drop_last,
                         permutation=permutation)
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
        from .rng import numpy_bitgen_state

        state = super().state_dict()
        state["batch_size"] = self.per_rank_batch_size
        state["world_size"] = self.world_size
        state["generator"] = numpy_bitgen_state(self.generator.bit_generator.state)
        state["distributed"] = True
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the global position; a state saved on another number of ranks is accepted (resharding)."""
        from .rng import numpy_bitgen_state_back

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
        self.generator.bit_generator.state = numpy_bitgen_state_back(state["generator"], "data.generator")
        self.resharded_from = saved_world if saved_world != self.world_size else None
