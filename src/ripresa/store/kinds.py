"""The kinds of generation a run folder holds: their registry, and every policy across kinds.

A *kind* is one registered :class:`BackendSpec`: a name (``bin``, ``general``, ``dcp``; old
names such as ``st`` still read), how its files are named (:class:`~ripresa.formats.naming.NameFormat`),
how its backend opens on a run folder, and its place in each run mode. The kind API for
tools: :func:`kinds`, :func:`spec_of`, :func:`owner_of`, :func:`backend_of`; a kind's
``names`` say ``name(step)``, ``parse(name)``, ``files(step)``, ``owns(name)``. A new kind is
one module plus one :func:`register_backend` line (docs/ARCHITECTURE.md, "Storage backends").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..core.state import TrainingState
from ..errors import BadInput, IntegrityError
from ..formats.generation import Generation
from ..formats.naming import NameFormat
from ..io import auth
from ..io.fsio import parse_sha256sum
from .base import StorageBackend
from .bin import BinBackend
from .commit import newest_valid
from .dcp import DcpBackend
from .folder import RunFolder
from .general import GeneralBackend
from .shards import ShardsBackend

__all__ = ["AUTO", "MODES", "BackendSpec", "Owner", "backend_of", "backends_for", "check_generation_file", "choose_writer",
           "describe", "formats", "generation_files", "kinds", "latest_valid_any", "latest_valid_of", "newest_kind", "owner_of", "pull_order", "register_backend",
           "registered", "retain", "spec_of", "unregister_backend"]

#: The run modes a session can be in.
MODES = ("single", "ddp", "fsdp2")
#: The formats a session may ask for besides the registered kinds' names: ``auto``.
AUTO = "auto"


@dataclass(frozen=True)
class BackendSpec:
    """A registered kind: its name, how to open its backend on a run folder, and its place in each run mode.

    ``modes`` maps a run mode (:data:`MODES`) to a preference: the lowest
    writes that mode's generations; the others of the mode are resumed too
    (with an ``other_mode_generation`` warning); a backend without the mode
    is ignored in it (an ``ignored_generations`` warning when it has
    generations on disk).
    """

    kind: str
    open: Callable[[RunFolder], StorageBackend]
    modes: Mapping[str, int]
    #: the name a session's ``format=`` gives this kind (``"andrea"``, ``"general"``), or None
    format: str | None = None
    #: ``fits(state)``: why this kind cannot hold ``state`` (None: it can); None: it holds any state
    fits: Callable[[TrainingState], str | None] | None = None
    #: ``suits(state)``: why ``format="auto"`` should not choose this kind for ``state``; None: as ``fits``
    suits: Callable[[TrainingState], str | None] | None = None
    #: how its files are named; None: the ``names`` of what ``open`` returns (its class attribute)
    names: NameFormat | None = None
    #: older names of this kind, still accepted wherever a kind is named (``st`` for ``general``)
    aliases: tuple[str, ...] = ()
    #: the kinds retained together form one sequence of steps (docs/FORMAT.md, "Retention across kinds");
    #: None: this kind alone
    pool: str | None = None
    #: how messages name its files (``general .safetensors``); None: the kind
    describes: str | None = None
    #: its preference when a pull from a mirror finds generations of several kinds at one step: the lowest
    #: is tried first (:func:`pull_order`; docs/MIRROR.md, "For contributors: the code")
    pull_rank: int = 100
    #: the registration order (set by :func:`register_backend`)
    order: int = field(default=0, compare=False)

    @property
    def naming(self) -> NameFormat | None:
        """:attr:`names`, or the opened class's ``names`` (None: the kind says nothing of its names)."""
        names = self.names if self.names is not None else getattr(self.open, "names", None)
        return names if isinstance(names, NameFormat) else None

    @property
    def collective(self) -> bool:
        """Whether every rank writes part of a generation of this kind (a sharded kind: ``dcp``)."""
        return bool(getattr(self.open, "collective", False))


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) the kind ``spec.kind``."""
    unknown = set(spec.modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown run modes {sorted(unknown)} (known: {MODES})")
    old = _REGISTRY.get(spec.kind)
    order = old.order if old is not None else max((s.order for s in _REGISTRY.values()), default=-1) + 1
    _REGISTRY[spec.kind] = BackendSpec(**{**spec.__dict__, "order": order})


def unregister_backend(kind: str) -> None:
    """Remove a registered kind (``bin`` and ``dcp`` may be replaced, not removed for good)."""
    _REGISTRY.pop(kind, None)


def registered() -> dict[str, BackendSpec]:
    """The registered kinds by name."""
    return dict(_REGISTRY)


def kinds() -> list[BackendSpec]:
    """Every registered kind, in registration order."""
    return sorted(_REGISTRY.values(), key=lambda s: s.order)


def spec_of(kind: str) -> BackendSpec:
    """The registered kind named ``kind`` (or one of its old names); ``ValueError`` for an unknown one."""
    spec = _REGISTRY.get(kind) or next((s for s in _REGISTRY.values() if kind in s.aliases), None)
    if spec is None:
        raise ValueError(f"unknown generation kind {kind!r} (registered: {sorted(_REGISTRY)})")
    return spec


class Owner(NamedTuple):
    """The kind, step and main name of the generation a file belongs to (:func:`owner_of`)."""

    spec: BackendSpec
    step: int
    main: str


def pull_order(kind: str) -> tuple[int, int]:
    """Where generations of ``kind`` come among the kinds of one step in a pull from a mirror (smaller first):
    its spec's ``pull_rank``, then its registration order. The mirror asks this; it names no kind itself."""
    spec = spec_of(kind)
    return spec.pull_rank, spec.order


def describe(kind: str) -> str:
    """How messages name ``kind``'s files (``general .safetensors``): its spec's ``describes``, else the name."""
    spec = _REGISTRY.get(kind) or next((s for s in _REGISTRY.values() if kind in s.aliases), None)
    return (spec.describes or spec.kind) if spec is not None else kind


def owner_of(path: str | os.PathLike[str]) -> Owner | None:
    """The generation that file ``path`` belongs to, by its name alone: a main file, companion, signature
    or marker in a run folder (``step_000007.json`` is the ``.bin``'s), or a file inside a folder kind's
    folder (``step_000007.dcp/.metadata``, also as a mirror's object key); None: no kind's file."""
    p = Path(os.fspath(path))
    names = ((f"{p.parent.name}/{p.name}",) if p.parent.name else ()) + (p.name,)
    for name in names:
        for spec in kinds():
            of = spec.naming.main_of(name) if spec.naming is not None else None
            if of is not None:
                return Owner(spec, of[1], of[0])
    return None


def generation_files(main: str, marker: bytes, *, where: str) -> list[tuple[str, str]]:
    """The files of generation ``main``: the (sha256, name) lines of its commit marker ``marker``, each name one
    its kind says is that generation's own (:meth:`~ripresa.formats.naming.NameFormat.holds`: a folder kind's
    ``main/<file>``, whichever rank wrote it; another kind's files beside the marker), in the marker's order.

    What the mirror uploads and pulls of a generation (docs/MIRROR.md): no part of it knows a kind's files.
    A marker read from a store or a folder is hostile: anything else (no line, one line, a name twice, a
    name of another generation or kind, a marker or signature) is an :class:`~ripresa.errors.IntegrityError`
    naming ``where``.
    """
    parsed = parse_sha256sum(marker, in_folder=True)
    owner = owner_of(main)
    naming = owner.spec.naming if owner is not None and owner.main == main else None
    ok = parsed is not None and naming is not None and len(parsed) >= 2 and len({n for _, n in parsed}) == len(parsed)
    if ok:
        assert parsed is not None and naming is not None
        ok = all(getattr(owner_of(name), "main", None) == main and naming.holds(main, name) for _, name in parsed)
    if not ok:
        raise IntegrityError("malformed commit marker", file=where, expected=f"sha256sum lines naming the files of {main}",
                             found=repr(marker[:160]), hint="this generation cannot be trusted")
    return parsed  # type: ignore[return-value]


def open_backend(spec: BackendSpec, store: RunFolder) -> StorageBackend:
    """``spec``'s backend on ``store``'s folder, with its retention (:func:`retain`) run after each commit."""
    backend = spec.open(store)
    if hasattr(backend, "retain"):
        backend.retain = lambda step: retain(store, spec.kind, newest_valid=step)
    return backend


def retain(store: RunFolder, kind: str, *, newest_valid: int) -> list[int]:
    """Apply ``store``'s retention after a commit of ``kind``: to the valid generations of every kind of its
    pool together (``bin`` and ``general``: one sequence of steps; ``dcp`` alone), each dropped one deleted by
    its own kind, marker first (:meth:`RunFolder.retain`). Returns the steps deleted."""
    spec = spec_of(kind)
    pool = spec.pool or spec.kind
    members = [s.open(store) for s in kinds() if (s.pool or s.kind) == pool]
    return store.retain(members, newest_valid=newest_valid)


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


def backends_for(mode: str, store: RunFolder, *, state: TrainingState | None = None,
                 format: str = AUTO) -> tuple[list[StorageBackend], list[StorageBackend]]:
    """(the backends a ``mode`` session uses, the one that writes first; the registered ones it ignores).

    The writer is :func:`choose_writer`'s, decided once when the session is
    built; the other kinds of the mode are resumed too.
    """
    writer = choose_writer(mode, state, format)
    specs = list(_REGISTRY.values())
    used = sorted((s for s in specs if mode in s.modes), key=lambda s: s.modes[mode])
    order = ([writer] if writer is not None else []) + [s for s in used if s is not writer]
    return [open_backend(s, store) for s in order], [open_backend(s, store) for s in specs if mode not in s.modes]


def newest_kind(backends: list[StorageBackend]) -> str | None:
    """The kind of the newest generation on disk among ``backends`` (committed or not; None: none)."""
    best: tuple[int, int] | None = None
    kind = None
    for i, b in enumerate(backends):
        steps = b.steps_on_disk()
        if steps and (best is None or (steps[-1], -i) > best):
            best, kind = (steps[-1], -i), b.kind
    return kind


def backend_of(kind: str, store: RunFolder) -> StorageBackend:
    """The registered backend of ``kind`` (or one of its old names) on ``store``'s folder."""
    return open_backend(spec_of(kind), store)


def latest_valid_of(folder: Path, kinds: tuple[str, ...], *, deep: bool = False, warn: bool = True,
                    store: RunFolder | None = None) -> Generation | None:
    """The newest valid generation among ``kinds`` (``"bin"``, ``"dcp"``, ...), or None.

    At equal steps the earlier kind in ``kinds`` wins. Each newer generation
    of those kinds that fails its check is skipped with a
    :class:`~ripresa.store.commit.CheckpointWarning` naming it and the reason. ``store`` (a
    run folder of ``folder``) is opened as a reader if None.
    """
    store = store if store is not None else RunFolder(folder, writer=False)
    backends = [backend_of(k, store) for k in kinds]
    on_disk = [set(b.steps_on_disk()) for b in backends]
    return newest_valid(((b.label, b.check(step, deep=deep)) for step in sorted(set().union(*on_disk), reverse=True)
                         for b, steps in zip(backends, on_disk, strict=True) if step in steps), warn=warn)


def latest_valid_any(folder: Path, *, deep: bool = False, warn: bool = True) -> Generation | None:
    """The newest valid generation of any registered kind (``inspect``'s view of a mixed folder)."""
    return latest_valid_of(folder, tuple(sorted(_REGISTRY, key=lambda k: k != "dcp")), deep=deep, warn=warn)


def check_generation_file(path: str | os.PathLike[str]) -> None:
    """Verify the signature of the generation whose main file (or companion) is ``path``.

    For ``ripresa inspect --require-signature FILE``: the generation's deep check with the
    signature required. Raises :class:`~ripresa.io.auth.SignatureError` (exit 1) for an
    unsigned, mis-signed or invalid generation and :class:`~ripresa.errors.BadInput` (exit 2)
    for a path that is not a generation's main file or companion.
    """
    p = Path(path)
    owner = owner_of(p.name)
    naming = owner.spec.naming if owner is not None else None
    if owner is None or naming is None or naming.folder or p.name not in (owner.main, naming.companion_name(owner.main)):
        folders = [s.naming.name(0).replace("000000", "NNNNNN") for s in kinds() if s.naming and s.naming.folder]
        raise BadInput(
            "--require-signature checks a run folder, a generation folder or a generation's step_NNNNNN.bin or "
            ".safetensors",
            file=p,
            expected=", ".join(["a run folder", *folders, "step_NNNNNN.bin or step_NNNNNN.safetensors"]),
            found=p.name,
            hint="checkpoint.pt files are not signed; sign generations of a run folder",
        )
    key = auth.load_key()
    if key is None:
        raise auth.missing_key_error("--require-signature")
    gen = owner.spec.open(RunFolder(p.parent, writer=False, require_signature=True, hmac_key=key)).check(owner.step,
                                                                                                        deep=True)
    if not gen.valid:
        raise auth.SignatureError(f"generation {owner.step} is not trusted under --require-signature: {gen.reason}",
                                  file=p, hint="an unsigned, mis-signed or damaged generation is never trusted")


def _bin_fits(state: TrainingState) -> str | None:
    from ..formats.bin_state import bin_fits

    return bin_fits(state)


# format="auto" is the general format for any state (docs/FORMAT.md, "Which format a session writes"); the .bin
# is written when a session asks for "andrea" (ripresa train does). Every mode resumes every kind: an FSDP2 session
# loads a .bin or general generation whole and shards it (docs/SHARDED.md, "Resuming": 2 -> 1 -> 2).
register_backend(BackendSpec("bin", BinBackend, {"single": 10, "ddp": 10, "fsdp2": 20}, "andrea", _bin_fits,
                             pool="run", describes="ANDREA .bin", pull_rank=10))
# A pull from a mirror prefers, at equal steps, .bin, then general, .shards, .dcp (pull_rank).
register_backend(BackendSpec("dcp", DcpBackend, {"single": 30, "ddp": 20, "fsdp2": 10}, describes="sharded .dcp",
                             pull_rank=40))
register_backend(BackendSpec("general", GeneralBackend, {"single": 5, "ddp": 5, "fsdp2": 15}, "general", aliases=("st",),
                             pool="run", describes="general .safetensors", pull_rank=20))
# Written by the general kind for a state of SaveOptions.shard_threshold bytes or more (never chosen by `format=`).
register_backend(BackendSpec("shards", ShardsBackend, {"single": 40, "ddp": 40, "fsdp2": 40}, pool="run",
                             describes="sharded general .shards", pull_rank=30))
