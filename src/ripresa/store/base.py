"""The storage-backend protocol every kind of generation implements, and the base kinds derive from.

docs/ARCHITECTURE.md, "Storage backends". A kind writes, checks, loads and deletes its own
generations; the registry (:mod:`ripresa.store.kinds`) orders kinds and applies retention.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..core.state import Progress, TrainingState
from ..errors import BadInput, IntegrityError
from ..formats.generation import Generation
from ..formats.naming import NameFormat
from .commit import newest_valid
from .folder import RunFolder
from .restore import Loaded, Restored, restore_loaded

__all__ = ["BackendBase", "StorageBackend", "load_full_into"]


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
        """Main rank: capture ``state`` now; the returned call commits the generation (then the registry's retention)."""

    def save(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None = None) -> Generation:
        """:meth:`capture` and commit at once."""

    def abandon(self, step: int) -> None:
        """Main rank, after a failed save: remove what it left (never a committed generation)."""

    def delete(self, step: int) -> None:
        """Remove a generation, its commit marker first."""

    def clean(self) -> list[Path]:
        """The writer, at start: remove what interrupted saves of this kind left; return it."""


class BackendBase:
    """What every kind derives from its ``names``, ``check``, ``load`` and ``commit_for``.

    A kind implements :meth:`commit_for` (capture the state now, return the call that writes
    and commits it through :func:`~ripresa.store.commit.commit_generation`) and never applies
    retention: :meth:`capture` runs :attr:`retain` after the commit, which the registry sets
    on every backend it opens (:func:`ripresa.store.kinds.retain`).
    """

    kind = ""
    label = "generation"
    written_by = ""
    collective = False
    background = False
    #: how this kind names its files (:class:`~ripresa.store.naming.NameFormat`)
    names: NameFormat
    folder: Path

    def __init__(self, store: RunFolder) -> None:
        self.store = store  # the run folder: its lock, key, signature policy and retention
        self.folder = store.folder
        #: run after each commit of :meth:`capture` with the committed step (the registry's retention), or None
        self.retain: Callable[[int], Any] | None = None

    def check(self, step: int, *, deep: bool = False) -> Generation:  # pragma: no cover - overridden
        raise NotImplementedError

    def load(self, gen: Generation, state: TrainingState) -> Loaded:  # pragma: no cover - overridden
        raise NotImplementedError

    def commit_for(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                   stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        raise NotImplementedError  # pragma: no cover - overridden

    def step_of(self, path: Path) -> int | None:
        return self.names.parse(Path(path).name)

    def steps_on_disk(self) -> list[int]:
        return self.names.steps(self.folder)

    def capture(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        commit = self.commit_for(step, state, progress, extra, stage=stage, world_size=world_size)
        retain = self.retain
        if retain is None:
            return commit

        def commit_and_retain() -> Generation:
            gen = commit()
            retain(step)
            return gen

        return commit_and_retain

    def checked_at(self, path: Path, check: Callable[[Path, int], Generation]) -> Generation:
        """``--resume PATH`` of a kind: ``path`` named as this kind's main name, ``check(its folder, step)``
        valid, or a typed error naming the file (``at_path`` of the kinds that check by folder)."""
        src = Path(path)
        step = self.step_of(src)
        if step is None:
            want = f"step_NNNNNN{self.names.suffix}"
            raise BadInput(f"not a {want}", file=src, expected=want, found=src.name)
        gen = check(src.parent, step)
        if not gen.valid:
            raise IntegrityError(f"cannot resume from {self.label} {step}: {gen.reason}", file=src,
                                 hint="`ripresa inspect` shows the valid generations")
        return gen

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


def load_full_into(model: Any, optimizer: Any, saved: Mapping[str, Any], sharded: bool) -> None:
    """A complete snapshot's model and optimizer into a (sharded) model: every rank keeps its shard."""
    from ..formats.dcp import (
        load_full_into as full_into,  # torch.distributed.checkpoint: only when loading
    )

    full_into(model, optimizer, dict(saved))
