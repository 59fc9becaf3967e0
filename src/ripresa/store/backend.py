"""Storage backends: one protocol for every kind of generation a run folder holds (docs/ARCHITECTURE.md).

A :class:`StorageBackend` owns one kind of generation (``bin``: ANDREA
``.bin`` + companion + marker, docs/FORMAT.md; ``dcp``: sharded FSDP2
folders) and says, through its methods alone, everything the session needs:
which files are its generations (:meth:`~StorageBackend.step_of`,
:meth:`~StorageBackend.steps_on_disk`), whether one can be trusted
(:meth:`~StorageBackend.check`, with named checks), how a
:class:`~ripresa.core.state.TrainingState` is saved
(:meth:`~StorageBackend.capture`, plus :meth:`~StorageBackend.write_part`
on every rank when the save is ``collective``), how a generation is read and
restored into the live state (:meth:`~StorageBackend.load`,
:meth:`~StorageBackend.restore`), and how it is deleted. Every backend
returns the same :class:`~ripresa.formats.generation.Generation` record.

Backends are registered (:func:`register_backend`) with the run modes in
which they resume (``single``, ``ddp``, ``fsdp2``) and a preference in each;
:func:`backends_for` orders them for a session: the first writes, the others
are resumed with a warning, and the registered ones without a place in this
mode are ignored with a warning. A new kind of generation is one more
registration; the session does not change.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..core.state import Progress, TrainingState
from ..errors import BadInput, IntegrityError
from ..formats.generation import Check, Generation
from ..io import auth
from .restore import Loaded, Restored, restore_loaded
from .retention import plan_deletions
from .store import CheckpointStore, generation_paths, newest_valid

__all__ = ["MODES", "BackendSpec", "BinBackend", "Check", "DcpBackend", "ForeignCheckpointWarning", "Generation",
           "StorageBackend", "backends_for", "choose_writer", "formats", "latest_valid_of", "newest_kind", "register_backend",
           "registered", "unregister_backend"]

#: The run modes a session can be in.
MODES = ("single", "ddp", "fsdp2")


class ForeignCheckpointWarning(UserWarning):
    """A .bin without companion was resumed: weights, m, v only."""


@runtime_checkable
class StorageBackend(Protocol):
    """One kind of generation in a run folder.

    Attributes: ``kind`` (the :attr:`Generation.kind` it owns), ``label``
    (how messages name one: ``generation``, ``.dcp generation``),
    ``written_by`` (who writes them, for the message that ignores them),
    ``folder``, ``collective`` (every rank writes part of a save),
    ``background`` (a save may run in the background writer).
    """

    kind: str
    label: str
    written_by: str
    folder: Path
    collective: bool
    background: bool

    def step_of(self, path: Path) -> int | None:
        """The step of the generation ``path`` names (its main file), None if it is not of this kind."""

    def steps_on_disk(self) -> list[int]:
        """Steps with any file of this kind (committed or not), ascending."""

    def check(self, step: int, *, deep: bool = False) -> Generation:
        """Validate generation ``step`` (named checks; never raises for a damaged generation)."""

    def check_to_resume(self, step: int) -> Generation:
        """The check a resume runs before :meth:`load` (as deep as this kind needs)."""

    def at_path(self, path: Path) -> Generation:
        """The generation an explicit ``--resume PATH`` names, checked; raises when it cannot be resumed."""

    def generations(self, *, deep: bool = False) -> list[Generation]:
        """Every generation of this kind on disk, ascending, each checked."""

    def latest_valid(self, *, deep: bool = True, warn: bool = True) -> Generation | None:
        """The newest valid generation of this kind (each newer one skipped with a warning)."""

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        """Read and check everything of ``gen`` for ``state``; nothing live changes."""

    def restore(self, gen: Generation, state: TrainingState, *, restore_rng: bool, allow: Mapping[str, bool],
                rank: int | None = None, sharded: bool = False) -> Restored:
        """Restore ``gen`` into the live ``state`` (random streams last)."""

    def prepare(self, step: int) -> None:
        """Main rank, before a collective save's parts are written (clear a stale partial)."""

    def write_part(self, step: int, state: TrainingState) -> None:
        """Every rank of a collective save writes its part (nothing for a non-collective backend)."""

    def capture(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        """Main rank: capture ``state`` now; the returned call commits the generation (and applies retention)."""

    def save(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None = None) -> Generation:
        """:meth:`capture` and commit at once."""

    def abandon(self, step: int) -> None:
        """Main rank, after a failed save: remove what it left (never a committed generation)."""

    def delete(self, step: int) -> None:
        """Remove a generation, its commit marker first."""

    def clean(self) -> list[Path]:
        """The writer, at start: remove what interrupted saves of this kind left; return it."""


class _Base:
    """What every backend derives from its ``steps_on_disk``/``check``/``load``/``capture``."""

    kind = ""
    label = "generation"
    written_by = ""
    collective = False
    background = False
    folder: Path

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store  # the run folder: its lock, key, signature policy and retention
        self.folder = store.folder

    def check(self, step: int, *, deep: bool = False) -> Generation:  # pragma: no cover - overridden
        raise NotImplementedError

    def steps_on_disk(self) -> list[int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def load(self, gen: Generation, state: TrainingState) -> Loaded:  # pragma: no cover - overridden
        raise NotImplementedError

    def capture(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        raise NotImplementedError  # pragma: no cover - overridden

    def generations(self, *, deep: bool = False) -> list[Generation]:
        return [self.check(s, deep=deep) for s in self.steps_on_disk()]

    def latest_valid(self, *, deep: bool = True, warn: bool = True) -> Generation | None:
        return newest_valid(((self.label, self.check(s, deep=deep)) for s in reversed(self.steps_on_disk())), warn=warn)

    def check_to_resume(self, step: int) -> Generation:
        return self.check(step, deep=True)

    def restore(self, gen: Generation, state: TrainingState, *, restore_rng: bool, allow: Mapping[str, bool],
                rank: int | None = None, sharded: bool = False) -> Restored:
        return restore_loaded(state, self.load(gen, state), restore_rng=restore_rng, allow=allow, rank=rank,
                              sharded=sharded)

    def save(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None = None) -> Generation:
        return self.capture(step, state, progress, extra)()

    def prepare(self, step: int) -> None:
        return None

    def write_part(self, step: int, state: TrainingState) -> None:
        return None

    def abandon(self, step: int) -> None:
        return None

    def clean(self) -> list[Path]:
        return []


class BinBackend(_Base):
    """``step_NNNNNN.bin`` + companion + marker (single process, DDP), around :class:`CheckpointStore`."""

    kind = "bin"
    label = "generation"
    written_by = ".bin ones are written by single-process and DDP runs"
    background = True

    def step_of(self, path: Path) -> int | None:
        from ..formats.andrea_bin import parse_bin_name

        return parse_bin_name(Path(path).name)

    def steps_on_disk(self) -> list[int]:
        return self.store.steps_on_disk()

    def check(self, step: int, *, deep: bool = False) -> Generation:
        return self.store.check(step, deep=deep)

    def check_to_resume(self, step: int) -> Generation:
        return self.store.check(step, deep=False)  # load() hashes the .bin while reading it

    def at_path(self, path: Path) -> Generation:
        src = Path(path)
        step = self.step_of(src)
        if step is None:
            raise BadInput("not a step_NNNNNN.bin", file=src, expected="step_NNNNNN.bin", found=src.name)
        b, c, mk = generation_paths(src.parent, step)
        if not os.path.lexists(c):
            if self.store.require_signature or auth.require_signature_from_env():
                raise auth.unsigned_error("a .bin without companion", src,
                                          "no companion, no commit marker and no signature (.bin.hmac)")
            return Generation(step, self.kind, src, c, mk, valid=True, foreign=True)
        gen = CheckpointStore(src.parent, writer=False).check(step, deep=False)
        if not gen.valid:
            raise IntegrityError(f"cannot resume from generation {step}: {gen.reason}", file=src,
                                 hint="`ripresa inspect` shows the valid generations")
        return gen

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        from ..formats.bin_state import join_state

        n = sum(p.numel() for p in state.model.parameters())
        reader = self.store if gen.path.parent == self.folder else CheckpointStore(gen.path.parent, writer=False)
        contents, comp = reader.load(gen.step, expected_n=n)
        return Loaded(join_state(state, contents, comp), True, _load_full_into, gen.companion)

    def restore(self, gen: Generation, state: TrainingState, *, restore_rng: bool, allow: Mapping[str, bool],
                rank: int | None = None, sharded: bool = False) -> Restored:
        if gen.foreign:
            return self._restore_foreign(gen.path, state, sharded)
        return super().restore(gen, state, restore_rng=restore_rng, allow=allow, rank=rank, sharded=sharded)

    def _restore_foreign(self, src: Path, state: TrainingState, sharded: bool) -> Restored:
        """Weights, m and v of a ``.bin`` without companion; data order and random streams start fresh."""
        from ..formats.andrea_bin import describe_missing, load_into_model_and_adamw, read_bin

        if sharded:
            raise BadInput("a foreign .bin (no companion) cannot be resumed into a sharded model", file=src,
                           hint="resume it in one process or with DDP, then continue from the generation it writes")
        contents = read_bin(src, expected_n=sum(p.numel() for p in state.model.parameters()))
        if state.optimizer is None:
            raise BadInput("a foreign .bin needs an AdamW optimizer to load m and v", file=src)
        notes = load_into_model_and_adamw(contents, state.model, state.optimizer)
        msg = (f"{src} has no companion: weights, m and v restored at step {contents.step}; data order and random "
               "streams start fresh, so this resume is only bit-equivalent modulo data randomness")
        warnings.warn(msg, ForeignCheckpointWarning, stacklevel=4)
        return Restored(Progress(step=contents.step), {}, event={"foreign": True, "lacks": describe_missing(src),
                                                                 "notes": notes})

    def capture(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        from ..formats.bin_state import bin_arrays, companion_snapshot

        arrays = bin_arrays(state)
        companion = companion_snapshot(state, progress, extra)
        if stage is not None:  # the background writer copies weights, m, v now; the write comes later
            arrays = stage(arrays)

        def commit() -> Generation:
            from .general import retain_across_kinds

            gen = self.store.save(step, arrays, companion)  # retention of the .bin ones, then across kinds
            retain_across_kinds(self.store, newest_valid=step)
            return gen

        return commit

    def delete(self, step: int) -> None:
        self.store.delete(step)


class DcpBackend(_Base):
    """``step_NNNNNN.dcp`` folders (FSDP2), around :mod:`ripresa.formats.dcp`; every rank writes its shards."""

    kind = "dcp"
    label = ".dcp generation"
    written_by = ".dcp ones are written by sharded FSDP2 runs"
    collective = True
    background = True  # rank 0 commits in the background once every rank's shards are durable

    @staticmethod
    def _fmt() -> Any:
        from ..formats import dcp  # torch.distributed.checkpoint: only when asked

        return dcp

    def step_of(self, path: Path) -> int | None:
        return self._fmt().parse_dcp_name(Path(path).name)

    def steps_on_disk(self) -> list[int]:
        return self._fmt().dcp_steps_on_disk(self.folder)

    def check(self, step: int, *, deep: bool = False, folder: Path | None = None) -> Generation:
        return self._fmt().check_dcp(folder or self.folder, step, deep=deep,
                                     require_signature=self.store.require_signature or None,
                                     hmac_key=self.store.hmac_key if self.store.require_signature else None)

    def at_path(self, path: Path) -> Generation:
        src = Path(path)
        step = self.step_of(src)
        if step is None:
            raise BadInput("not a step_NNNNNN.dcp folder", file=src, expected="step_NNNNNN.dcp", found=src.name)
        gen = self.check(step, deep=True, folder=src.parent)  # the run's signature policy holds for an explicit path too
        if not gen.valid:
            raise IntegrityError(f"cannot resume from .dcp generation {step}: {gen.reason}", file=src,
                                 hint="check it with `sha256sum -c` from its folder")
        return gen

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        dcp = self._fmt()
        n = sum(p.numel() for p in state.model.parameters())
        if gen.companion_sha256 is None:
            raise IntegrityError("the .dcp generation was not checked before its load", file=gen.path,
                                 expected="the marker hashes of its check", found="none")
        doc = dcp.read_dcp_companion(gen.path, gen.companion_sha256)
        if doc["n_params"] != n:
            raise IntegrityError("the .dcp generation holds another number of parameters than the model",
                                 file=gen.path, expected=n, found=doc["n_params"], hint="build the model from the run's config.json")

        def load_weights(model: Any, optimizer: Any, saved: Mapping[str, Any], sharded: bool) -> None:
            # exactly the bytes the check verified: every file re-read into memory and re-hashed against the
            # marker hashes the check found (signed under require-signature), never re-opened by DCP
            dcp.load_shards(model, optimizer, gen.path, files=gen.files, sizes=doc["files"], no_dist=not sharded)

        return Loaded(dcp.decode_state(doc, gen.path), False, load_weights, gen.companion, validated=True)

    def prepare(self, step: int) -> None:
        self.abandon(step)

    def write_part(self, step: int, state: TrainingState) -> None:
        self._fmt().save_shards(state.model, state.optimizer, self._fmt().partial_path(self.folder, step))

    def capture(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        from .restore import rest_proxy

        dcp = self._fmt()
        rest = rest_proxy(state).snapshot(progress, extra, include_parameters=False)
        n = sum(p.numel() for p in state.model.parameters())

        def commit() -> Generation:
            gen = dcp.commit_dcp(self.folder, step, dcp.partial_path(self.folder, step), world_size=world_size,
                                 n_params=n, state=rest, hmac_key=self.store.hmac_key)
            valid = [g.step for g in self.generations() if g.valid]
            for old in plan_deletions(valid, self.store.retention, newest_valid=step,
                                      protected=self.store.protected_steps(valid), metrics=self.store.step_metrics()):
                self.delete(old)
            return gen

        return commit

    def abandon(self, step: int) -> None:
        from ..io.fsio import ops

        part = self._fmt().partial_path(self.folder, step)
        if part.exists():
            ops.rmtree(part)

    def delete(self, step: int) -> None:
        self._fmt().delete_dcp(self.folder, step)

    def clean(self) -> list[Path]:
        return self._fmt().clean_partials(self.folder)


def _load_full_into(model: Any, optimizer: Any, saved: Mapping[str, Any], sharded: bool) -> None:
    """A complete snapshot's model and optimizer into a (sharded) model: every rank keeps its shard."""
    from ..formats.dcp import load_full_into

    load_full_into(model, optimizer, dict(saved))


# ---- the registry -----------------------------------------------------------------------


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend: its ``kind``, how to open it on a run folder, and its place in each run mode.

    ``modes`` maps a run mode (:data:`MODES`) to a preference: the lowest
    writes that mode's generations; the others of the mode are resumed too
    (with an ``other_mode_generation`` warning); a backend without the mode
    is ignored in it (an ``ignored_generations`` warning when it has
    generations on disk).
    """

    kind: str
    open: Callable[[CheckpointStore], StorageBackend]
    modes: Mapping[str, int]
    #: the name a session's ``format=`` gives this kind (``"andrea"``, ``"general"``), or None
    format: str | None = None
    #: ``fits(state)``: why this kind cannot hold ``state`` (None: it can); None: it holds any state
    fits: Callable[[TrainingState], str | None] | None = None
    #: ``suits(state)``: why ``format="auto"`` should not choose this kind for ``state``; None: as ``fits``
    suits: Callable[[TrainingState], str | None] | None = None


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) the backend of ``spec.kind``."""
    unknown = set(spec.modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown run modes {sorted(unknown)} (known: {MODES})")
    _REGISTRY[spec.kind] = spec


def unregister_backend(kind: str) -> None:
    """Remove a registered backend (``bin`` and ``dcp`` may be replaced, not removed for good)."""
    _REGISTRY.pop(kind, None)


def registered() -> dict[str, BackendSpec]:
    """The registered backends by kind."""
    return dict(_REGISTRY)


def _bin_fits(state: TrainingState) -> str | None:
    from ..formats.bin_state import bin_fits

    return bin_fits(state)


def _open_general(store: CheckpointStore) -> StorageBackend:
    from .general import GeneralBackend

    return GeneralBackend(store)


# format="auto" is the general format for any state (docs/FORMAT.md, "Which format a session writes"); the .bin
# is written when a session asks for "andrea" (ripresa train does). Every mode resumes every kind: an FSDP2 session
# loads a .bin or general generation whole and shards it (docs/SHARDED.md, "Resuming": 2 -> 1 -> 2).
register_backend(BackendSpec("bin", BinBackend, {"single": 10, "ddp": 10, "fsdp2": 20}, "andrea", _bin_fits))
register_backend(BackendSpec("dcp", DcpBackend, {"single": 30, "ddp": 20, "fsdp2": 10}))
register_backend(BackendSpec("st", _open_general, {"single": 5, "ddp": 5, "fsdp2": 15}, "general"))

#: The formats a session may ask for besides the registered kinds' names: ``auto``.
AUTO = "auto"


def formats() -> list[str]:
    """The values a session's ``format=`` accepts: ``auto`` and each registered kind's format name."""
    return [AUTO, *sorted(s.format for s in _REGISTRY.values() if s.format)]


def choose_writer(mode: str, state: TrainingState | None = None, format: str = AUTO) -> BackendSpec | None:
    """The registered kind a ``mode`` session writes (no run folder needed: every rank decides it alike).

    With ``format="auto"`` the most preferred kind of the mode that suits
    ``state`` (its spec's ``suits``, else ``fits``: the general format in a
    single-process or DDP session, ``.dcp`` in an FSDP2 one); with a
    format name, the kind of that name, and a
    :class:`~ripresa.errors.BadInput` naming what does not fit when it cannot
    hold ``state``. ``ValueError`` for an unknown mode or format.
    """
    if mode not in MODES:
        raise ValueError(f"unknown run mode {mode!r} (known: {MODES})")
    if format not in formats():
        raise ValueError(f"unknown checkpoint format {format!r} (known: {formats()})")
    used = sorted((s for s in _REGISTRY.values() if mode in s.modes), key=lambda s: s.modes[mode])

    def reason(check: Callable[[TrainingState], str | None] | None) -> str | None:
        return None if state is None or check is None else check(state)

    if format == AUTO:
        return next((s for s in used if reason(s.suits or s.fits) is None), used[0] if used else None)
    writer = next((s for s in used if s.format == format), None)
    if writer is None:
        raise BadInput(f"format {format!r} cannot be written by a {mode} session",
                       expected=[s.format for s in used if s.format], found=format)
    why = reason(writer.fits)
    if why is not None:
        raise BadInput(f"format={format!r} cannot hold this training state: {why}",
                       expected=f"a state the {format} format holds", found=why,
                       hint=f"use format='auto' (or another format: {formats()})")
    return writer


def backends_for(mode: str, store: CheckpointStore, *, state: TrainingState | None = None,
                 format: str = AUTO) -> tuple[list[StorageBackend], list[StorageBackend]]:
    """(the backends a ``mode`` session uses, the one that writes first; the registered ones it ignores).

    The writer is :func:`choose_writer`'s, decided once when the session is
    built; the other kinds of the mode are resumed too.
    """
    writer = choose_writer(mode, state, format)
    specs = list(_REGISTRY.values())
    used = sorted((s for s in specs if mode in s.modes), key=lambda s: s.modes[mode])
    order = ([writer] if writer is not None else []) + [s for s in used if s is not writer]
    return [s.open(store) for s in order], [s.open(store) for s in specs if mode not in s.modes]


def newest_kind(backends: list[StorageBackend]) -> str | None:
    """The kind of the newest generation on disk among ``backends`` (committed or not; None: none)."""
    best: tuple[int, int] | None = None
    kind = None
    for i, b in enumerate(backends):
        steps = b.steps_on_disk()
        if steps and (best is None or (steps[-1], -i) > best):
            best, kind = (steps[-1], -i), b.kind
    return kind


def backend_of(kind: str, store: CheckpointStore) -> StorageBackend:
    """The registered backend of ``kind`` on ``store``'s folder."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown generation kind {kind!r} (registered: {sorted(_REGISTRY)})")
    return _REGISTRY[kind].open(store)


def latest_valid_of(folder: Path, kinds: tuple[str, ...], *, deep: bool = False, warn: bool = True,
                    store: CheckpointStore | None = None) -> Generation | None:
    """The newest valid generation among ``kinds`` (``"bin"``, ``"dcp"``, ...), or None.

    At equal steps the earlier kind in ``kinds`` wins. Each newer generation
    of those kinds that fails its check is skipped with a
    :class:`CheckpointWarning` naming it and the reason. ``store`` (a
    :class:`CheckpointStore` of ``folder``) is opened as a reader if None.
    """
    store = store if store is not None else CheckpointStore(folder, writer=False)
    backends = [backend_of(k, store) for k in kinds]
    on_disk = [set(b.steps_on_disk()) for b in backends]
    return newest_valid(((b.label, b.check(step, deep=deep)) for step in sorted(set().union(*on_disk), reverse=True)
                         for b, steps in zip(backends, on_disk, strict=True) if step in steps), warn=warn)


def latest_valid_any(folder: Path, *, deep: bool = False, warn: bool = True) -> Generation | None:
    """The newest valid generation of any registered kind (``inspect``'s view of a mixed folder)."""
    return latest_valid_of(folder, tuple(sorted(_REGISTRY, key=lambda k: k != "dcp")), deep=deep, warn=warn)
