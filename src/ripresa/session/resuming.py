"""Which generation a resume takes, and its restore through the backend that owns it (docs/FORMAT.md, docs/FAULTS.md).

The newest valid generation of the kinds the run mode resumes (the writer's kind first), or an
explicit ``--resume`` path; one that fails a check, at the choice or at its load, is skipped for
the next older one. In a distributed run rank 0 chooses and every rank restores its own view.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..core.state import TrainingState
from ..errors import BadInput, IntegrityError
from ..store.backend import StorageBackend, backend_of, describe
from ..store.history import History
from ..store.store import CheckpointStore, CheckpointWarning, Generation, not_used
from .distributed import DistContext

__all__ = ["OtherModeWarning", "Resumer"]


class OtherModeWarning(CheckpointWarning):
    """A generation of another kind than the session writes was ignored (or, distributed, used)."""


#: What restoring a hostile (but hash-consistent) state can raise besides ripresa's own errors.
_RESTORE_FAULTS = (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)

#: How messages name each run mode.
_MODE_NAMES = {"single": "single-process", "ddp": "DDP", "fsdp2": "sharded (FSDP2)"}


class Resumer:
    """The resume side of a session: its backends (the writer first), the ignored kinds, the live state."""

    def __init__(self, *, store: CheckpointStore, backends: list[StorageBackend], ignored: list[StorageBackend],
                 state: TrainingState, allow: Mapping[str, Any], dist: DistContext | None, history: History,
                 run_dir: Path, mode: str, format: str) -> None:
        self.store, self.backends, self._ignored, self.state, self.allow = store, backends, ignored, state, allow
        self.dist, self.history, self.run_dir, self.mode, self.format = dist, history, run_dir, mode, format
        self.backend = backends[0]
        self._skipped_committed: list[str] = []  # committed generations that failed a check (not uncommitted leftovers)
        #: Node-local folders (docs/DISTRIBUTED.md): rank 0's choice names its own folder; each rank reads its node's.
        self.reroot = False
        #: The step of a memory generation this session promoted into the folder (a general one, whatever the
        #: session writes: its resume is announced as a ``memory_resume`` event, not as another format's).
        self.promoted: int | None = None

    def take(self, from_path: str | Path | None, restore_rng: bool) -> tuple[Generation | None, Any]:
        """Choose the generation and restore it into the live state: ``(generation, Restored)``, or ``(None, None)``."""
        if self.dist is not None:
            return self._take_dist(from_path, restore_rng)
        if from_path is not None:
            gen = self._choose_path(from_path)
            return gen, self._restore(gen, restore_rng, wrap=not gen.foreign)
        last_error = None
        for cand in self._candidates():
            try:
                restored = self._restore(cand, restore_rng, wrap=True)
            except IntegrityError as exc:  # damaged after its check (bit rot, a hostile state): the next older
                last_error = exc
                msg = not_used(self._backend_of(cand).label, cand.step, exc.message, exc.file)
                warnings.warn(msg, CheckpointWarning, stacklevel=3)
                self.history.event("skipped_generation", reason=msg)
                continue
            return cand, restored
        if last_error is not None:
            raise last_error
        self._refuse_if_only_damaged()
        return None, None

    def _take_dist(self, from_path: str | Path | None, restore_rng: bool) -> tuple[Generation | None, Any]:
        d = self.dist
        assert d is not None
        choice: Any = None
        error: str | None = None
        raised: BaseException | None = None
        if d.is_main:
            try:
                choice = self._choose(from_path)
            except Exception as exc:  # every rank must learn it, or they would wait forever
                raised, error = exc, f"{type(exc).__name__}: {exc}"
        choice, error = d.broadcast((choice, error))
        if raised is not None:
            raise raised
        if error is not None:
            raise BadInput(f"rank 0 could not choose a generation to resume: {error}", file=self.run_dir)
        if choice is None:
            return None, None
        if self.reroot:
            from .nodes import reroot

            choice = reroot(choice, self.run_dir)
        return choice, self._restore(choice, restore_rng, wrap=False)

    def _backend_of(self, gen: Generation) -> StorageBackend:
        """The backend that owns ``gen`` (one of this session's, or a registered one for ``--resume PATH``)."""
        for b in self.backends:
            if b.kind == gen.kind:
                return b
        return backend_of(gen.kind, self.store)

    def _restore(self, gen: Generation, restore_rng: bool, *, wrap: bool) -> Any:
        """Restore ``gen`` into the live state through its backend (everything is checked before anything changes).

        With ``wrap``, a state that passes the file checks but cannot be
        restored is an IntegrityError (so a resume falls back to an older one).
        """
        d = self.dist
        backend = self._backend_of(gen)
        kw: dict[str, Any] = {} if d is None else {"rank": d.rank, "sharded": d.sharded}
        try:
            return backend.restore(gen, self.state, restore_rng=restore_rng, allow=self.allow, **kw)
        except _RESTORE_FAULTS as exc:
            if not wrap:
                raise
            raise IntegrityError("the generation's state cannot be restored", file=gen.path,
                                 expected="a state as ripresa writes it",
                                 found=f"{type(exc).__name__}: {str(exc)[:200]}",
                                 hint="it was edited or damaged; an older generation will be used") from None

    def _candidates(self) -> Iterator[Generation]:
        """The valid generations of the kinds this session resumes, newest first (a generator).

        A generation that fails its check is skipped with a warning and a
        ``skipped_generation`` event; one of another kind than the session
        writes is announced (``other_mode_generation``) before it is used;
        the registered kinds this run mode does not resume are named
        (``ignored_generations``) and never read.
        """
        writer = self.backend
        self._skipped_committed = []
        for other in self._ignored:
            ignored = other.steps_on_disk()
            if ignored:
                msg = (f"ignoring {other.label}(s) {ignored[-3:]} in {self.run_dir}: a {_MODE_NAMES[self.mode]} run "
                       f"resumes only {' and '.join(b.label for b in self.backends)}s ({other.written_by}; resume one "
                       "explicitly with --resume, or convert it with `ripresa convert`)")
                warnings.warn(msg, OtherModeWarning, stacklevel=4)
                self.history.event("ignored_generations", kind=other.kind, steps=ignored[-8:], reason=msg)
        on_disk = [set(b.steps_on_disk()) for b in self.backends]
        for step in sorted(set().union(*on_disk), reverse=True):
            for b, steps in zip(self.backends, on_disk, strict=True):
                if step not in steps:
                    continue
                g = b.check_to_resume(step)
                if not g.valid:
                    msg = not_used(b.label, step, g.reason, g.path)
                    warnings.warn(msg, CheckpointWarning, stacklevel=4)
                    self.history.event("skipped_generation", reason=msg)
                    if os.path.lexists(g.marker):
                        self._skipped_committed.append(msg)
                    continue
                if b.kind not in getattr(writer, "writes", (writer.kind,)) and step != self.promoted:  # general writes .shards too
                    msg = self._other_kind_message(g, b, writer)
                    warnings.warn(msg, OtherModeWarning, stacklevel=4)
                    self.history.event("other_mode_generation", step=step, kind=b.kind, reason=msg)
                yield g

    def _other_kind_message(self, g: Generation, b: StorageBackend, writer: StorageBackend) -> str:
        """Why resuming ``g`` (of backend ``b``) is announced: another *mode* (a sharded ``.dcp`` against a
        ``.bin``/``.safetensors``: FSDP2 against single-process/DDP) or, in the same mode, another *format*
        (``.bin`` against general ``.safetensors``)."""
        theirs, mine = describe(b.kind), describe(writer.kind)
        if b.collective != writer.collective:
            return (f"resuming {g.path.name}, a {theirs} generation written by another mode than this "
                    f"{_MODE_NAMES[self.mode]} run (it writes {mine} generations)")
        return (f"resuming {g.path.name}, a generation of another format ({theirs}) than this run writes "
                f"({mine}, format={self.format!r})")

    def _choose_path(self, from_path: str | Path) -> Generation:
        """The generation an explicit ``--resume`` path names (any registered kind), checked."""
        src = Path(from_path)
        owners = [b for b in self.backends + self._ignored if b.step_of(src) is not None]
        if not owners:
            names = " or ".join(f"a {b.label}" for b in self.backends + self._ignored)
            mains = [b.names.name(0).replace("000000", "NNNNNN") for b in self.backends + self._ignored
                     if getattr(b, "names", None) is not None]
            raise BadInput(f"--resume needs {names}", file=src, expected=" or ".join(mains), found=src.name)
        return owners[0].at_path(src)

    def _choose(self, from_path: str | Path | None) -> Generation | None:
        """The generation to resume: ``from_path``'s, or the newest valid one of the run folder."""
        if from_path is not None:
            return self._choose_path(from_path)
        gen = next(iter(self._candidates()), None)
        if gen is None:
            self._refuse_if_only_damaged()
        return gen

    def _refuse_if_only_damaged(self) -> None:
        """No generation resumes, yet committed ones exist: refuse rather than start again at step 0.

        Uncommitted leftovers (a kill during the first save) start a new run as
        before; committed generations that all fail their checks are damage or
        tampering, and silently training from scratch over them would lose the
        run's work without anyone deciding it.
        """
        skipped = self._skipped_committed
        if skipped:
            raise IntegrityError(f"none of the {len(skipped)} committed generation(s) in {self.run_dir} passes its checks",
                                 file=self.run_dir, expected="at least one valid generation to resume",
                                 found="; ".join(skipped[:3])[:600],
                                 hint="`ripresa inspect RUN` shows why; to start over on purpose, use a new run "
                                      "folder (or move the damaged generations aside)")

