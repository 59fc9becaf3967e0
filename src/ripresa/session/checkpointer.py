"""The :class:`Checkpointer` session: exact, crash-safe checkpoints for any training loop.

Five added lines in a loop::

    ckpt = ripresa.Checkpointer("runs/my-run", state, every=100)   # state: a TrainingState
    start = ckpt.resume()                  # 0 for a new run; else restores everything, RNG last
    for step in range(start + 1, total + 1):
        loss = train_one_step(...)
        if ckpt.step_done(step, loss=loss):  # history, cadence, signals, sample audit
            break                            # SIGTERM/SIGINT: checkpoint written, stop
    ckpt.close()

Each checkpoint is a generation of the run folder's :class:`~ripresa.store.store.CheckpointStore`
(by default a general ``step_NNNNNN.safetensors`` + companion + marker, for any state; with
``format="andrea"`` an ANDREA ``step_NNNNNN.bin`` one), written asynchronously by default.

Failed saves: a save that fails (full disk, I/O error) is reported as a
warning and a ``checkpoint_failed`` history event, training goes on and the
next cadence retries — the previous generation is intact, so at most one
cadence of work is at risk, and a transient condition (a disk briefly full)
does not kill a run that may have days left. After ``max_failed_saves``
consecutive failures the session raises :class:`~ripresa.errors.SaveFailed`
and the run stops with its last valid checkpoint. A save requested by
SIGTERM that fails always raises: the operator asked for a durable stop.

Which generations a resume considers (docs/FORMAT.md, docs/FAULTS.md): the
kind the session writes first, then the others registered for its mode — a
single-process session also resumes a ``.dcp`` that is the newest valid
generation (docs/SHARDED.md), an FSDP2 session ``.dcp`` ones first; a generation of another format (``.bin`` against
``.safetensors``) or another mode (``.dcp`` against the others) only while
saying so (a warning and an ``other_mode_generation`` history event). The
newest candidate that fails any check — at the choice or while it is loaded —
is skipped with a warning and a ``skipped_generation`` event, and the next
older valid one is used. Under require-signature nothing unsigned loads: not a
``.bin`` without companion (a "foreign" one), not an unsigned ``.dcp``.

Distributed runs (docs/FORMAT.md, ``.dcp``): inside an initialised process group (DDP or
FSDP2 under ``torchrun``) the same five lines work on every rank. Rank 0 takes
the lock and writes the history; every rank agrees at each step boundary on
signals (a SIGTERM or SIGUSR1 delivered to any rank makes all ranks save the
same step); DDP generations are ``.bin`` files written by rank 0 with every
rank's random streams and data position in the companion, FSDP2 generations
are ``step_NNNNNN.dcp`` folders written by all ranks. See
:mod:`ripresa.session.distributed`.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..core.state import Progress, TrainingState, _tensor_tree_clone
from ..errors import BadInput, IntegrityError, RipresaError, SaveFailed
from ..io import auth
from ..io.fsio import read_json_small, write_atomic
from ..store.async_save import AsyncCheckpointWriter
from ..store.backend import (
    ForeignCheckpointWarning,
    StorageBackend,
    backend_of,
    backends_for,
    choose_writer,
    newest_kind,
)
from ..store.history import HISTORY_NAME, History
from ..store.mirror import Mirror, has_local_generation, open_mirror, pull_run, record_url
from ..store.restore import rank_view, saved_record
from ..store.retention import DEFAULT_RETENTION, RetentionPolicy
from ..store.store import CheckpointStore, CheckpointWarning, Generation, not_used
from .cadence import (
    DEFAULT_MTBF_S,
    STEP_WINDOW,
    AutoCadence,
    median,
    parse_duration,
    parse_max_redo,
)
from .deadline import Deadline
from .distributed import (
    WORLD_CHANGE_NOTE,
    DistContext,
    NullHistory,
    fault_point,
)
from .sharded_async import ShardedWriter, save_async
from .signals import SignalRequests, hold
from .steer import DistSteeredRecorder, SteeredRecorder, Steering
from .torchrun import bind_to_launcher

__all__ = ["Checkpointer", "ForeignCheckpointWarning", "OtherModeWarning", "rank_view"]


class OtherModeWarning(CheckpointWarning):
    """A generation of another kind than the session writes was ignored (or, distributed, used)."""


#: What restoring a hostile (but hash-consistent) state can raise besides ripresa's own errors.
_RESTORE_FAULTS = (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)

#: How messages name each run mode.
_MODE_NAMES = {"single": "single-process", "ddp": "DDP", "fsdp2": "sharded (FSDP2)"}
#: How messages name each kind of generation (its file).
_KIND_FILES = {"bin": "ANDREA .bin", "st": "general .safetensors", "dcp": "sharded .dcp"}


#: The run-folder file recording the metric values each generation was saved with (``KeepBest``).
METRICS_NAME = "retention_metrics.json"
METRICS_SCHEMA = "ripresa.retention_metrics/1"
_METRICS_LIMIT = 16 * 1024 * 1024


def _as_metric(value: Any) -> float | None:
    """A reported metric as a finite float (a Python/NumPy number or a one-element tensor), else None."""
    if isinstance(value, bool) or isinstance(value, str | bytes):
        return None
    try:
        v = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return v if math.isfinite(v) else None


def read_metrics_sidecar(path: Path) -> dict[int, dict[str, float]]:
    """The ``{step: {metric: value}}`` recorded in ``retention_metrics.json``; {} when absent.

    Read through the safe opener (no link followed, size bounded); anything but
    the schema written by the ``Checkpointer`` is a :class:`BadInput`: a metric
    retention policy must not delete generations on values it cannot trust.
    """
    if not os.path.lexists(path):
        return {}
    doc = read_json_small(path, "the retention metrics", _METRICS_LIMIT)

    def bad(found: str) -> BadInput:
        return BadInput("the retention metrics file is not what the Checkpointer writes", file=path,
                        expected=f'{{"schema": "{METRICS_SCHEMA}", "steps": {{"STEP": {{"METRIC": number}}}}}}',
                        found=found, hint="move the file away: the best-by-metric generations kept so far then lose "
                                          "their values and only the step-based part of the policy keeps them")

    if not isinstance(doc, dict) or doc.get("schema") != METRICS_SCHEMA or not isinstance(doc.get("steps"), dict):
        raise bad(f"{str(doc)[:120]}")
    out: dict[int, dict[str, float]] = {}
    for key, values in doc["steps"].items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 18) or not isinstance(values, dict):
            raise bad(f"step entry {str(key)[:40]!r}")
        clean: dict[str, float] = {}
        for name, v in values.items():
            if not isinstance(name, str) or isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise bad(f"step {key}: {str(name)[:40]!r} = {str(v)[:40]}")
            clean[name] = float(v)
        out[int(key)] = clean
    return out


_URL_RE = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/")


def local_run_dir(run_dir: str | os.PathLike[str], what: str = "run_dir") -> Path:
    """``run_dir`` as a local folder; a URL is refused, never turned into a folder named ``s3:``.

    ``file:///abs/path`` (and ``file://localhost/abs/path``) is the local
    folder it names. Any other ``scheme://...`` (``s3://``, ``gs://``,
    ``https://``, ...) raises :class:`BadInput` with the fix: a local run folder
    and the URL as its ``mirror`` (docs/MIRROR.md). A local folder whose name
    really starts with ``word:`` is written ``./word:/...`` (as text).
    """
    text = os.fspath(run_dir)
    if isinstance(text, bytes):
        raise TypeError(f"{what} must be a str or os.PathLike of str, not bytes")
    m = _URL_RE.match(text)
    if m is None:
        return Path(text)
    scheme = m["scheme"].lower()
    after = text[len(m["scheme"]) + 1:]  # '//host/path', or '/path' when Path() collapsed the '//'
    if scheme == "file":
        if not after.startswith("//"):
            return Path(after)
        host, _, tail = after[2:].partition("/")
        if host.lower() not in ("", "localhost"):
            raise BadInput(f"{what} is a file:// URL of another host", file=text, expected="file:///absolute/path",
                           found=f"host {host!r}", hint="name a local folder")
        return Path("/" + tail)
    url = f"{m['scheme']}://{after.lstrip('/')}"
    raise BadInput(f"{what} is a URL, not a local run folder: a run folder is always local", file=text,
                   expected="a local folder (a path, or file:///absolute/path)", found=f"a {scheme}:// URL",
                   hint=f"keep the run in a local folder and mirror it there: Checkpointer('runs/x', state, "
                        f"mirror={url!r}) or ripresa train --run runs/x --mirror {url} (docs/MIRROR.md)")


class Checkpointer:
    """A training session over a run folder.

    Args:
        run_dir: the run folder (created if needed; locked for this process).
        state: the run's :class:`~ripresa.TrainingState` (any model and optimizer; see ``format``).
        every: checkpoint cadence in optimizer steps (0 = only on signals and at close), or
            ``"auto"``: chosen from the measured step time and save cost (Young–Daly,
            docs/CADENCE.md), with ``mtbf`` (seconds or ``"24h"``; default 24 h) and
            ``max_redo`` (at most this many steps, or seconds such as ``"30m"``, of work lost).
        deadline: an aware ``datetime``, seconds from now, or ``"72h"``: stop in time to
            save, drain ``mirror`` and run ``on_deadline(step)`` (an export) before it
            (docs/CADENCE.md, "Deadline").
        asynchronous: stage at the step boundary, write in the background.
        retention: which generations to keep.
        on_checkpoint: called as ``on_checkpoint(step)`` at every checkpoint
            (the sample-audit hook; it must not perturb the training streams).
        sidecars: ``{file name: callable returning a JSON-able dict}`` written
            atomically beside each checkpoint (e.g. ``.state.json``).
        handle_signals: install the SIGTERM/SIGINT/SIGUSR1 handlers.
        fresh: refuse a run folder that already holds checkpoints or history.
        allow_version_change, allow_code_change, allow_data_change: see
            :meth:`TrainingState.restore`.
        allow_config_change: a resume whose ``state.config`` differs from the
            saved one: ``False`` refuses it (:class:`~ripresa.errors.BadInput`,
            exit 2, naming the keys); ``None`` (the default) and ``True`` accept
            it and record it (a ``config_change`` history event, and the lineage
            of every later generation).
        save_on_close: :meth:`close` saves the last step that :meth:`step_done`
            completed when no generation holds it yet (default True; False, or
            ``close(final_save=False)``, opts out). Never after an exception:
            ``__exit__`` with an exception and :meth:`abort` do not save
            (docs/FAULTS.md, "The end of a run").
        max_failed_saves: consecutive failed saves tolerated before raising.
        distributed: None (the default) detects an initialised process group
            (world size > 1, or a sharded FSDP2 model); False forces a
            single-process session; True requires a group.
        format: which kind of generation this session writes, decided here
            (docs/FORMAT.md, "Which format a session writes"): ``"auto"`` the
            general ``.safetensors`` format for any state (FSDP2: ``.dcp``);
            ``"andrea"`` the ANDREA ``.bin`` (float32 parameters, Adam/AdamW
            without amsgrad; a state that does not fit is a
            :class:`~ripresa.errors.BadInput` now, naming what does not fit);
            ``"general"`` the general format. Generations of the other kinds in
            the folder are still resumed (a ``format_change`` event).
        mirror: a second store for every committed generation (docs/MIRROR.md):
            ``"s3://bucket/prefix"``, ``"file:///path"``, a path, or a
            :class:`~ripresa.store.mirror.MirrorSpec`. Uploads run in the
            background; :meth:`resume` of an empty folder pulls the newest
            verified remote generation. :attr:`mirror` is None or the
            :class:`~ripresa.store.mirror.Mirror` (``drain(timeout)``,
            ``last_upload_seconds``).

    Distributed attributes: :attr:`dist` (None in a single process),
    :attr:`world_change` (after :meth:`resume`: None, or the saved and current
    world sizes) and :attr:`fresh_streams` (this rank had no saved entry: its
    random streams were not restored).
    """

    def __init__(
        self,
        run_dir: str | Path,
        state: TrainingState,
        *,
        every: int | str = 100,
        asynchronous: bool = True,
        retention: RetentionPolicy = DEFAULT_RETENTION,
        on_checkpoint: Callable[[int], None] | None = None,
        sidecars: Mapping[str, Callable[[], dict[str, Any]]] | None = None,
        handle_signals: bool = True,
        fresh: bool = False,
        allow_version_change: bool = False,
        allow_code_change: bool = False,
        allow_data_change: bool = False,
        allow_config_change: bool | None = None,
        save_on_close: bool = True,
        max_failed_saves: int = 3,
        distributed: bool | None = None,
        format: str = "auto",
        mirror: Any = None,
        mtbf: float | str | None = None,
        max_redo: int | float | str | None = None,
        deadline: Any = None,
        on_deadline: Callable[[int], Any] | None = None,
    ) -> None:
        if handle_signals:
            hold()  # a SIGUSR1 before the handlers below (lock, resume of the mirror) is deferred, never fatal
        bind_to_launcher()  # a rank of python -m ripresa.torchrun dies with its launcher, never trains on orphaned
        auto = every == "auto"
        if auto:
            every = 0
        if not isinstance(state, TrainingState) or not isinstance(every, int) or isinstance(every, bool):
            raise TypeError(f"need a ripresa.TrainingState and an int every, got {type(state).__name__}, {type(every).__name__}")
        if every < 0 or max_failed_saves < 1:  # misuse of the API: TypeError/ValueError (docs/FAULTS.md)
            raise ValueError(f"need every >= 0 (0: on signals only) and max_failed_saves >= 1, got {every}, {max_failed_saves}")
        state.check_stateful()  # data or objects swapped in after the TrainingState was built: refused here, before any lock
        if not auto and (mtbf is not None or max_redo is not None):
            raise ValueError("mtbf and max_redo apply to every='auto' only")
        #: ``every="auto"``: the measured cadence (docs/CADENCE.md), else None; :attr:`deadline` likewise.
        self.cadence = AutoCadence(mtbf_s=parse_duration(DEFAULT_MTBF_S if mtbf is None else mtbf, "mtbf"),
                                   max_redo=parse_max_redo(max_redo)) if auto else None
        self.deadline = Deadline(deadline) if deadline is not None else None  # both checked before the folder is locked
        #: ``ripresa verify``'s steering of this process (docs/VERIFY.md), or None: see :mod:`ripresa.session.steer`.
        self.steering = Steering.take_from_env()
        self.run_dir = local_run_dir(run_dir) if self.steering is None else self.steering.run_dir
        if fresh and self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise BadInput("--fresh refuses a run folder that is not empty", file=self.run_dir,
                           expected="an empty or new folder", found=sorted(p.name for p in self.run_dir.iterdir())[:8],
                           hint="choose a new --run folder, or drop --fresh to resume this one")
        self.state = state
        self._fresh = fresh
        self.every = int(every)
        self.on_checkpoint = on_checkpoint
        self.sidecars = dict(sidecars or {})
        self.allow = {"allow_version_change": allow_version_change, "allow_code_change": allow_code_change,
                      "allow_data_change": allow_data_change, "allow_config_change": allow_config_change}
        self.save_on_close = bool(save_on_close)
        self._resumed_step: int | None = None  # the step resume() returned: step_done must go beyond it
        self._done_step: int | None = None  # the last step step_done() completed (returned from)
        self.max_failed_saves = max_failed_saves
        self.retention = retention
        #: The metrics ``retention`` reads (``KeepBest``): each generation records their latest values (docs/RETENTION.md).
        self._metric_names: tuple[str, ...] = getattr(retention, "metric_names", ())
        self._latest_metrics: dict[str, float] = {}
        self._gen_metrics: dict[int, dict[str, float]] = {}
        self.format = format
        self.dist: DistContext | None = None if distributed is False else DistContext.detect(state.model)
        if distributed is True and self.dist is None:
            raise BadInput("distributed=True but no process group is initialised", expected="torch.distributed.init_process_group() first",
                           hint="launch with torchrun; a single process passes distributed=None or False")
        self.world_change: dict[str, Any] | None = None
        self.fresh_streams = False
        self._captured_step: int | None = None  # distributed: the step whose state every rank handed over last
        self.mode = "single" if self.dist is None else "fsdp2" if self.dist.sharded else "ddp"
        self._shards: ShardedWriter | None = None  # FSDP2, asynchronous: every rank's background DCP writes
        choose_writer(self.mode, state, format)  # a refused format fails here, on every rank, before any lock
        if self.dist is None:
            self.store = CheckpointStore(self.run_dir, retention=retention)
            self._open_backends()
            self.history = History(self.run_dir / HISTORY_NAME)
        else:
            # Rank 0 creates the folder and takes the lock; the others wait, then read only.
            self.dist.barrier()
            if self.dist.is_main:
                self.store = CheckpointStore(self.run_dir, retention=retention)
                self._open_backends()
                self.backend.clean()  # what interrupted saves of the kind it writes left
                self.history = History(self.run_dir / HISTORY_NAME)
            self.dist.barrier()
            if not self.dist.is_main:
                self.store = CheckpointStore(self.run_dir, writer=False)
                self._open_backends()
                self.history = NullHistory()  # type: ignore[assignment]
            if asynchronous and self.mode == "fsdp2":
                self._shards = ShardedWriter(self.dist)
            asynchronous = asynchronous and self.dist.is_main
        asynchronous = asynchronous and self.backend.background
        if self._metric_names and (self.dist is None or self.dist.is_main):
            try:
                self._gen_metrics = read_metrics_sidecar(self.run_dir / METRICS_NAME)
            except BaseException:
                self.history.close()
                self.store.close()
                raise
            self.store.metrics = lambda: self._gen_metrics  # read by retention, in the writer's thread too
        self.mirror: Mirror | None = None
        # A steered path (ripresa verify) never writes to the script's mirror: verify touches only its own folders.
        if mirror is not None and self.steering is None and (self.dist is None or self.dist.is_main):
            try:
                self.mirror = open_mirror(mirror, self.run_dir, local_retention=retention, event=self.history.event)
                record_url(self.run_dir, self.mirror.spec.url)
            except BaseException:
                self.history.close()
                self.store.close()
                raise
            self.store.pinned = self.mirror.pinned  # local retention keeps what the mirror still lacks
            self.mirror.metrics = self.store.step_metrics  # a KeepBest policy keeps the same best ones remotely
        if self.history.repaired_torn_line:
            self.history.event("torn_line_terminated")
        previous = newest_kind(self.backends)
        if previous is not None and previous != self.backend.kind:  # the folder's newest generation is of another kind
            self.history.event("format_change", previous=previous, now=self.backend.kind, format=self.format)
        self.writer = AsyncCheckpointWriter(self.store) if asynchronous else None
        self.signals = SignalRequests().install() if handle_signals else SignalRequests()
        self.progress = Progress()
        self.failed_saves = 0
        self.last_saved_step: int | None = None
        self.resumed_from: Generation | None = None
        self._pending: tuple[int, str, float] | None = None  # (step, reason, t0) of the in-flight save
        self._deferred_error: SaveFailed | None = None  # distributed: a stop-save failure, raised on every rank
        self._last_gen: Any = None
        self.save_stalls: list[float] = []  # seconds the loop was blocked by each save
        if self.cadence is not None:
            self.cadence.background, self.cadence.follow = self.writer is not None, self.dist is None
        self.on_deadline = on_deadline
        self._step_exit: float | None = None  # when step_done last returned (the step time is measured outside it)
        self._step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._recorder = (None if self.steering is None else SteeredRecorder(self.steering, state) if self.dist is None
                          else DistSteeredRecorder(self.steering, state, self.dist))  # every rank is steered
        if self.steering is not None:
            self.history.event("verify_steered", path=self.steering.path, stop_at=self.steering.stop_at,
                               restore_rng=self.steering.restore_rng)

    def _open_backends(self) -> None:
        """The storage backends of this run mode (docs/ARCHITECTURE.md): the first writes, all are resumed."""
        self.backends, self._ignored = backends_for(self.mode, self.store, state=self.state, format=self.format)
        self.backend: StorageBackend = self.backends[0]

    def _backend_of(self, gen: Generation) -> StorageBackend:
        """The backend that owns ``gen`` (one of this session's, or a registered one for ``--resume PATH``)."""
        for b in self.backends:
            if b.kind == gen.kind:
                return b
        return backend_of(gen.kind, self.store)

    # ------------------------------------------------------------------ start
    def resume(self, *, from_path: str | Path | None = None, restore_rng: bool = True) -> int:
        """Restore the newest valid generation (or ``from_path``); return its step (0 if none).

        Call it after building every object and right before the first step:
        the random streams are restored last. ``from_path`` is a
        ``step_NNNNNN.bin`` (with companion, or a foreign one without) or a
        ``step_NNNNNN.dcp`` folder. In a distributed run every rank calls it;
        rank 0 chooses the generation and every rank loads it.
        """
        if self._recorder is not None:  # steered by ripresa verify: the path decides, then the start is recorded
            step = self._resume(from_path, restore_rng and self._recorder.steer.restore_rng)
            self._recorder.start(self.progress, str(self.resumed_from.path) if self.resumed_from is not None else None)
            return step
        return self._resume(from_path, restore_rng)

    def _resume(self, from_path: str | Path | None, restore_rng: bool) -> int:
        if self.mirror is not None:
            if from_path is None and not self._fresh and not has_local_generation(self.run_dir):  # a new machine
                pull_run(self.mirror.store, self.run_dir, self.store, kinds=[b.kind for b in self.backends],
                     event=self.history.event, spec=self.mirror.spec)
            self.mirror.start()
        if self.dist is not None:
            return self._resume_dist(from_path, restore_rng)
        if from_path is not None:
            gen = self._choose_path(from_path)
            restored = self._restore(gen, restore_rng, wrap=not gen.foreign)
        else:
            gen, restored, last_error = None, None, None
            for cand in self._candidates():
                try:
                    restored = self._restore(cand, restore_rng, wrap=True)
                except IntegrityError as exc:  # damaged after its check (bit rot, a hostile state): the next older
                    last_error = exc
                    msg = not_used(self._backend_of(cand).label, cand.step, exc.message, exc.file)
                    warnings.warn(msg, CheckpointWarning, stacklevel=2)
                    self.history.event("skipped_generation", reason=msg)
                    continue
                gen = cand
                break
            if gen is None and last_error is not None:
                raise last_error
            if gen is None:
                self._refuse_if_only_damaged()
        if gen is None or restored is None:
            self.history.event("start", step=0, rng_restored=restore_rng)
            self._resumed_step = 0
            self._write_config()
            return 0
        return self._resumed(gen, restored, from_path, restore_rng, world_size=1)

    def _resumed(self, gen: Generation, restored: Any, from_path: Any, restore_rng: bool, *, world_size: int) -> int:
        """Record a restored generation: progress, history event, world change, config."""
        self.progress = restored.progress
        self._resumed_step = self.progress.step
        if self._metric_names:  # the metric values as they were at the resumed step; later ones belong to no generation
            self._gen_metrics = {s: m for s, m in self._gen_metrics.items() if s <= self._resumed_step}
            self._latest_metrics = dict(self._gen_metrics.get(self._resumed_step, {}))
        if gen.foreign:  # weights, m and v only: no generation of this run was resumed
            self.history.event("resume", from_step=gen.step, file=str(gen.path), **restored.event)
            self._write_config()
            return gen.step
        self.resumed_from = gen
        self.fresh_streams = restored.fresh
        self.last_saved_step = gen.step if from_path is None else None
        if self.dist is not None:
            self._captured_step = self.last_saved_step
        dist_fields = {} if self.dist is None else {"world_size": world_size}
        self.history.event("resume", from_step=gen.step, file=str(gen.path), rng_restored=restore_rng, **dist_fields,
                           lineage=self.state.lineage[-1] if self.state.lineage else None)
        self._note_world_change(restored.extra, world_size=world_size, fresh=restored.fresh)
        if self.state.accepted_config_changes:  # allowed (allow_config_change): recorded, as in the lineage
            self.history.event("config_change", step=gen.step, changes=self.state.accepted_config_changes,
                               allowed="explicitly" if self.allow["allow_config_change"] else "by default")
        self._write_config()
        return self.progress.step

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
        self._skipped_committed: list[str] = []  # committed generations that failed a check (not uncommitted leftovers)
        for other in self._ignored:
            ignored = other.steps_on_disk()
            if ignored:
                msg = (f"ignoring {other.label}(s) {ignored[-3:]} in {self.run_dir}: a {_MODE_NAMES[self.mode]} run "
                       f"resumes only {' and '.join(b.label for b in self.backends)}s ({other.written_by}; resume one "
                       "explicitly with --resume, or convert it with `ripresa convert`)")
                warnings.warn(msg, OtherModeWarning, stacklevel=3)
                self.history.event("ignored_generations", kind=other.kind, steps=ignored[-8:], reason=msg)
        on_disk = [set(b.steps_on_disk()) for b in self.backends]
        for step in sorted(set().union(*on_disk), reverse=True):
            for b, steps in zip(self.backends, on_disk, strict=True):
                if step not in steps:
                    continue
                g = b.check_to_resume(step)
                if not g.valid:
                    msg = not_used(b.label, step, g.reason, g.path)
                    warnings.warn(msg, CheckpointWarning, stacklevel=3)
                    self.history.event("skipped_generation", reason=msg)
                    if os.path.lexists(g.marker):
                        self._skipped_committed.append(msg)
                    continue
                if b is not writer:
                    msg = self._other_kind_message(g, b, writer)
                    warnings.warn(msg, OtherModeWarning, stacklevel=3)
                    self.history.event("other_mode_generation", step=step, kind=b.kind, reason=msg)
                yield g

    def _other_kind_message(self, g: Generation, b: StorageBackend, writer: StorageBackend) -> str:
        """Why resuming ``g`` (of backend ``b``) is announced: another *mode* (a sharded ``.dcp`` against a
        ``.bin``/``.safetensors``: FSDP2 against single-process/DDP) or, in the same mode, another *format*
        (``.bin`` against general ``.safetensors``)."""
        theirs, mine = _KIND_FILES.get(b.kind, b.kind), _KIND_FILES.get(writer.kind, writer.kind)
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
            raise BadInput(f"--resume needs {names}", file=src,
                           expected="step_NNNNNN.bin or step_NNNNNN.dcp", found=src.name)
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
        skipped = getattr(self, "_skipped_committed", [])
        if skipped:
            raise IntegrityError(f"none of the {len(skipped)} committed generation(s) in {self.run_dir} passes its checks",
                                 file=self.run_dir, expected="at least one valid generation to resume",
                                 found="; ".join(skipped[:3])[:600],
                                 hint="`ripresa inspect RUN` shows why; to start over on purpose, use a new run "
                                      "folder (or move the damaged generations aside)")

    def _resume_dist(self, from_path: str | Path | None, restore_rng: bool) -> int:
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
            self.history.event("start", step=0, rng_restored=restore_rng, world_size=d.world_size)
            self._resumed_step = 0
            self._write_config()
            return 0
        restored = self._restore(choice, restore_rng, wrap=False)
        return self._resumed(choice, restored, from_path, restore_rng, world_size=d.world_size)

    def _note_world_change(self, saved_extra: Mapping[str, Any], *, world_size: int, fresh: bool) -> None:
        """Record a resume on another number of ranks than the save's (history event, :attr:`world_change`)."""
        rec = saved_record({"extra": saved_extra}, None)
        saved_world = int(rec["world_size"]) if rec else 1
        if saved_world == world_size:
            return
        self.world_change = {
            "saved_world_size": saved_world,
            "world_size": world_size,
            "saved_shard": rec.get("shard") if rec else None,
            "fresh_stream_ranks": list(range(saved_world, world_size)),
            "dropped_ranks": list(range(world_size, saved_world)),
        }
        self.history.event("world_size_change", step=self.progress.step, **self.world_change, note=WORLD_CHANGE_NOTE)
        if fresh or self.world_change["dropped_ranks"]:
            warnings.warn(f"resumed a checkpoint of {saved_world} rank(s) on {world_size}: weights, m and v are exact, "
                          "the data order and trajectory are not those of the saved world size", stacklevel=3)

    def _write_config(self) -> None:
        if self.dist is not None and not self.dist.is_main:
            return
        auth.write_signed_run_file(self.run_dir / "config.json",
                                   json.dumps(self.state.config, indent=2, default=str).encode() + b"\n")

    # ------------------------------------------------------------------ each step
    def step_done(self, step: int, **metrics: Any) -> bool:
        """Record step ``step`` (just completed) and act on cadence and signals.

        Metrics go to the history line (``loss``, ``lr``, ``arm``, ...);
        ``tokens`` and ``samples`` also advance the progress counters and
        ``epoch`` sets it. Returns True when the loop must stop (a stop signal
        was handled: the checkpoint is committed).

        Steps must increase: a ``step`` lower than or equal to the one
        :meth:`resume` returned, or to the previous ``step_done``'s, is a
        ``ValueError`` naming both (it would write generations older than the
        run's newest beside them).
        """
        step = self._check_step(step)
        entered = time.perf_counter()
        if self._step_exit is not None:  # the step itself, measured outside step_done
            self._step_times.append(entered - self._step_exit)
            if self.cadence is not None:
                self.cadence.step_time(entered - self._step_exit)
        p = self.progress
        p.step = int(step)
        if "tokens" in metrics:
            p.tokens_seen += int(metrics["tokens"])
        if "samples" in metrics:
            p.samples_seen += int(metrics["samples"])
        if "epoch" in metrics:
            p.epoch = int(metrics["epoch"])
        self.history.step(step, **metrics)
        if self._metric_names:
            self._note_metrics(metrics)
        steered_stop = False
        if self._recorder is not None and not self._recorder.finished:
            self._recorder.step(step, metrics)
            steered_stop = step >= self._recorder.steer.stop_at
        self._collect(block=False)
        who: dict[str, Any] = {}
        deadline_stop = self.deadline is not None and self.deadline.check(
            step, median(self._step_times), getattr(self, "mirror", None), self.history.event)
        if self.dist is None:
            stop = self.signals.stop_requested or deadline_stop
            asked = self.signals.take_checkpoint_request()
        else:
            # The agreement: a signal on any rank is a signal on every rank, at this step.
            stop_ranks, ask_ranks = self.dist.agree(self.signals.stop_requested or deadline_stop,
                                                    self.signals.take_checkpoint_request())
            stop, asked = bool(stop_ranks), bool(ask_ranks)
            who = {"ranks_stop": stop_ranks, "ranks_checkpoint": ask_ranks}
            if stop and not deadline_stop and self.deadline is not None and not self.signals.received:
                self.history.event("deadline_stop", **self.deadline.stop(step, time.time()))  # another rank's clock
                deadline_stop = True
        if (asked or stop) and not (deadline_stop and not self.signals.received):
            self.history.event("signal", step=step, signals=list(self.signals.received), action="stop" if stop else "checkpoint", **who)
            self.signals.received.clear()
        if steered_stop:  # ripresa verify's cut (or end): saved and stopped as on SIGTERM
            self.history.event("verify_stop", step=step, path=self._recorder.steer.path)
            stop = True
        if self.cadence is not None:
            due = self.cadence.due(step)
        else:
            due = self.every > 0 and step % self.every == 0
        if self.deadline is not None and self.deadline.needs_probe(len(self._step_times) + 1):
            due = True  # one save to measure what the deadline plan needs (docs/CADENCE.md)
        if due or asked or stop:
            n = len(self.save_stalls)
            self._save(step, "stop" if stop else "signal" if asked else "cadence", must_succeed=stop)
            if self.cadence is not None and not stop:
                self.cadence.saved(step, self.save_stalls[-1] if len(self.save_stalls) > n else float("nan"))
                self._cadence_event(step, force=True)
                if self.dist is not None:  # every rank adopts rank 0's interval, at the same step
                    self.cadence.every = self.dist.broadcast(self.cadence.proposed)
        elif self.cadence is not None:
            self._cadence_event(step, force=False)
        if stop:
            if self.dist is None:
                self._collect(block=True, must_succeed=True)
            else:
                self._collect_all()
            if self._recorder is not None:
                self._recorder.finish(self.progress)  # the state saved is the state recorded: nothing ran between
            if deadline_stop and self.deadline is not None and (self.dist is None or self.dist.is_main):
                self.deadline.finish(step, getattr(self, "mirror", None), self.on_deadline, self.history.event)
            self._done_step = step
            return True
        self._step_exit = time.perf_counter()
        self._done_step = step
        return False

    def _check_step(self, step: Any) -> int:
        """``step`` as an int, refused unless it goes beyond the resumed step and the previous step_done's."""
        if isinstance(step, bool) or not isinstance(step, int | float) and not hasattr(step, "__index__"):
            raise TypeError(f"step_done needs an int step, got {type(step).__name__}")
        step = int(step)
        if self._done_step is not None and step <= self._done_step:
            raise ValueError(f"step_done({step}) after step_done({self._done_step}): steps must increase "
                             "(each call records one completed optimizer step)")
        if self._resumed_step is not None and step <= self._resumed_step:
            raise ValueError(f"step_done({step}) but resume() returned step {self._resumed_step}: the next step is "
                             f"{self._resumed_step + 1} (loop over range(start + 1, total + 1))")
        return step

    def _cadence_event(self, step: int, *, force: bool) -> None:
        """``every="auto"``: re-evaluate the interval; record a ``cadence`` event when it changed (docs/CADENCE.md)."""
        fields = self.cadence.reevaluate(step, force=force) if self.cadence is not None else None
        if fields is not None:
            self.history.event("cadence", **fields)

    def steps_to_next_checkpoint(self) -> int | None:
        if self.cadence is not None:
            return self.cadence.steps_to_next(self.progress.step)
        if self.every <= 0:
            return None
        return self.every - (self.progress.step % self.every)

    # ------------------------------------------------------------------ saving
    def save_now(self, reason: str = "manual") -> Generation | None:
        """Checkpoint the current step synchronously (waits for the commit).

        Distributed: every rank calls it; rank 0 returns the generation, the others None.
        """
        if self.dist is not None:
            self._save(self.progress.step, reason, must_succeed=True)
            self._collect_all()
            return self._last_gen if self.dist.is_main else None
        self._save(self.progress.step, reason, must_succeed=True)
        return self._collect(block=True, must_succeed=True)

    def _note_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Keep the latest finite value of each metric the retention policy reads."""
        for name in self._metric_names:
            if name in metrics:
                value = _as_metric(metrics[name])
                if value is None:
                    self._latest_metrics.pop(name, None)  # NaN / inf / not a number: this step is not a candidate
                else:
                    self._latest_metrics[name] = value

    def _record_metrics(self, step: int) -> None:
        """Record, before generation ``step`` is committed, the metric values it is saved with (``KeepBest``)."""
        if not self._metric_names or (self.dist is not None and not self.dist.is_main):
            return
        older = {s: m for s, m in self._gen_metrics.items() if s < step}
        self._gen_metrics = {**older, step: dict(self._latest_metrics)}  # a new dict: the writer's thread reads it
        doc = {"schema": METRICS_SCHEMA, "metric_names": list(self._metric_names),
               "steps": {str(s): m for s, m in sorted(self._gen_metrics.items())}}
        write_atomic(self.run_dir / METRICS_NAME, [json.dumps(doc, indent=1).encode() + b"\n"])

    def _save(self, step: int, reason: str, must_succeed: bool) -> None:
        self._record_metrics(step)
        if self.dist is not None:
            self._save_dist(step, reason, must_succeed)
            return
        if self.last_saved_step == step and self._pending is None:
            return  # this exact state is already committed
        t0 = time.perf_counter()
        try:
            self._submit(step, reason, must_succeed, t0)
        except SaveFailed as exc:
            self._failed(step, exc, must_succeed)
            return
        self._write_sidecars()
        for name, fn in self.sidecars.items():
            write_atomic(self.run_dir / name, [json.dumps(fn(), indent=1, allow_nan=True).encode() + b"\n"])
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)  # runs while the background writer writes

    def _write_sidecars(self) -> None:
        for name, fn in self.sidecars.items():
            write_atomic(self.run_dir / name, [json.dumps(fn(), indent=1, allow_nan=True).encode() + b"\n"])

    def _submit(self, step: int, reason: str, must_succeed: bool, t0: float, extra: dict[str, Any] | None = None) -> None:
        """Capture the state now through the writing backend; commit it in the background, or now."""
        if self.writer is not None:
            self._collect(block=True, must_succeed=must_succeed)
            write = self.backend.capture(step, self.state, self.progress, extra, stage=self.writer.stage)
            self.writer.submit(step, write)
            self._pending = (step, reason, t0)
            self.save_stalls.append(time.perf_counter() - t0)
        else:
            gen = self.backend.capture(step, self.state, self.progress, extra)()
            self.save_stalls.append(time.perf_counter() - t0)
            self._committed(gen, reason, time.perf_counter() - t0)

    def _collect(self, *, block: bool, must_succeed: bool = False) -> Generation | None:
        """Account for a finished (or, with ``block``, the in-flight) background save."""
        if self.writer is None or self._pending is None:
            return None
        if not block and self.writer.in_flight:
            return None
        step, reason, t0 = self._pending
        self._pending = None
        try:
            gen = self.writer.wait()
        except SaveFailed as exc:
            self._failed(step, exc, must_succeed)
            return None
        if gen is not None:
            self._committed(gen, reason, self.writer.last_write_s)
        return gen

    def _committed(self, gen: Any, reason: str, seconds: float) -> None:
        self.failed_saves = 0
        self.last_saved_step = gen.step
        self._last_gen = gen
        background = self.writer is not None
        stall = self.save_stalls[-1] if self.save_stalls else seconds
        if self.cadence is not None and background:
            self.cadence.written(seconds)
            self._cadence_event(self.progress.step, force=True)
        if self.deadline is not None:
            self.deadline.saved(stall + seconds if background else seconds)
        self.history.event("checkpoint", step=gen.step, reason=reason, file=gen.path.name, bytes=gen.size,
                           seconds=round(seconds, 4), stall=round(stall, 4), background=background)
        self.history.sync()
        if self.mirror is not None:
            self.mirror.notify(gen.step)

    def _failed(self, step: int, exc: SaveFailed, must_succeed: bool) -> None:
        if self._captured_step == step:
            self._captured_step = None  # a later request for this step saves it again
        self.failed_saves += 1
        self.history.event("checkpoint_failed", step=step, error=exc.message, found=str(exc.found)[:200])
        if must_succeed or self.failed_saves >= self.max_failed_saves:
            raise exc
        warnings.warn(f"checkpoint at step {step} failed (training goes on; next cadence retries):\n{exc}", stacklevel=3)

    # ------------------------------------------------------------------ distributed saving
    def _rank_entry(self) -> dict[str, Any]:
        """This rank's own state, captured now: random streams, data position, user objects."""
        s = self.state
        assert self.dist is not None
        return {
            "rank": self.dist.rank,
            "rng": s.rng.state_dict(),
            "data": _tensor_tree_clone(s.data.state_dict()) if s.data is not None else None,
            "objects": {n: _tensor_tree_clone(o.state_dict()) for n, o in s.objects.items()},
        }

    def _save_dist(self, step: int, reason: str, must_succeed: bool) -> None:
        """Every rank: hand over this rank's part; DDP: rank 0 writes the .bin; FSDP2: all write the .dcp."""
        d = self.dist
        assert d is not None
        if d.broadcast(self._captured_step == step):  # rank 0 decides, so every rank takes the same path
            return
        t0 = time.perf_counter()
        entry = self._rank_entry()
        fault_point("before_gather", step, d.rank)
        entries = d.gather(entry)  # every rank has handed over its part once this returns on rank 0
        self._captured_step = step
        extra = {"distributed": {**d.describe(), "ranks": entries}} if d.is_main else None
        if self.backend.collective:
            if not self._save_collective(step, reason, must_succeed, extra, t0):
                return
        elif d.is_main:
            try:
                self._submit(step, reason, must_succeed, t0, extra)
            except SaveFailed as exc:
                if must_succeed:
                    self._deferred_error = exc  # raised by _collect_all, after every rank has been told
                    self.failed_saves += 1
                    self.history.event("checkpoint_failed", step=step, error=exc.message, found=str(exc.found)[:200])
                else:
                    self._failed(step, exc, must_succeed)
                return
        if d.is_main:
            self._write_sidecars()
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)  # on every rank: a sharded model's forward is collective

    def _save_collective(self, step: int, reason: str, must_succeed: bool, extra: dict[str, Any] | None, t0: float) -> bool:
        """Every rank writes its part (FSDP2: its shards), a barrier, then rank 0 commits (companion, rename, marker)."""
        d = self.dist
        assert d is not None
        if self._shards is not None:  # staged now, written in the background (session/sharded_async.py)
            return save_async(self, step, reason, must_succeed, extra, t0)
        if d.is_main:
            self.backend.prepare(step)
        d.barrier()
        error: str | None = None
        try:
            self.backend.write_part(step, self.state)
        except Exception as exc:  # DCP reports a failure on every rank
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        fault_point("after_shards", step, d.rank)
        d.barrier()  # every rank has finished its part: only now may the generation count
        gen = None
        if d.is_main and error is None:
            try:
                gen = self.backend.capture(step, self.state, self.progress, extra, world_size=d.world_size)()
            except (RipresaError, OSError) as exc:
                error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        error = d.broadcast(error)
        if error is not None:
            if d.is_main:
                self.backend.abandon(step)
            self._failed(step, SaveFailed(f"sharded save of step {step} failed: {error}", file=self.run_dir,
                                          hint="the previous generation is intact"), must_succeed)
            return False
        self.save_stalls.append(time.perf_counter() - t0)
        if d.is_main:
            self._committed(gen, reason, time.perf_counter() - t0)
        return True

    def _collect_all(self) -> None:
        """Distributed: rank 0 finishes its in-flight write; every rank learns whether it committed."""
        d = self.dist
        assert d is not None
        err: SaveFailed | None = None
        if self._shards is not None:
            self._shards.wait()  # this rank's write; a failure anywhere fails rank 0's commit, broadcast below
        if d.is_main:
            err, self._deferred_error = self._deferred_error, None
            if err is None:
                try:
                    self._collect(block=True, must_succeed=True)
                except SaveFailed as exc:
                    err = exc
        msg = d.broadcast(None if err is None else err.message)
        if err is not None:
            raise err
        if msg is not None:
            raise SaveFailed(f"rank 0 could not commit the checkpoint: {msg}", hint="the previous generation is intact")

    # ------------------------------------------------------------------ end
    def close(self, *, final_save: bool | None = None) -> None:
        """Finish the in-flight save, save the final state, release the folder.

        The final save (``final_save``, default :attr:`save_on_close`, True)
        commits the last step that :meth:`step_done` completed, when no
        generation holds it yet: a run that ends between cadence points keeps
        its last steps. It is skipped — a ``final_save_skipped`` history event
        and a warning — when the live state may be past that step: ``close()``
        called while an exception is being handled (in a ``finally`` or
        ``except`` block), or after a ``step_done`` that raised. On an error
        path call :meth:`abort` (or use the ``with`` block, which does), never
        a save (docs/FAULTS.md, "The end of a run").
        """
        final = self.save_on_close if final_save is None else bool(final_save)
        try:
            if self._recorder is not None and self._recorder.started:
                self._recorder.finish(self.progress)  # the script stopped before the steered step: record where
            step = self._final_step() if final else None
            if self.dist is not None:
                self._collect_all()
                if step is not None:
                    self._save(step, "final", must_succeed=True)
                    self._collect_all()
            else:
                self._collect(block=True, must_succeed=True)
                if step is not None and self.last_saved_step != step:
                    self._save(step, "final", must_succeed=True)
                    self._collect(block=True, must_succeed=True)
            if self.mirror is not None:
                heard = len(self.signals.received)  # a signal during the close leaves it at once (docs/MIRROR.md)
                self.mirror.close(interrupted=lambda: len(self.signals.received) > heard)
            if self._shards is not None:
                self._shards.close()  # its gloo save group ends now, not at interpreter exit
        finally:
            try:
                self.history.sync()
            except OSError:
                pass
            self._release()

    def _final_step(self) -> int | None:
        """The step a final save may commit: the last one step_done completed, if the live state is still it."""
        step = self._done_step
        if step is None:
            return None  # no step in this process: nothing new to save
        why = None
        if sys.exc_info()[1] is not None:
            why = f"close() was called while {type(sys.exc_info()[1]).__name__} was being handled"
        elif self.progress.step != step:
            why = f"step_done({self.progress.step}) did not complete"
        if why is None:
            return step
        msg = (f"no final checkpoint: {why}, so the state may be past step {step} (use abort() or a with block on "
               "an error path)")
        warnings.warn(msg, CheckpointWarning, stacklevel=3)
        self.history.event("final_save_skipped", step=step, reason=msg)
        return None

    def abort(self) -> None:
        """Release the folder on an error path: no collective, no new save (no final save either).

        An in-flight background write is let finish (a generation is never
        left half-written by choice); its failure, if any, is not raised.
        """
        try:
            if self.writer is not None and self._pending is not None:
                self.writer.wait()
        except Exception:
            pass
        self._release()

    def _release(self) -> None:
        """Close the history, restore the signal handlers (SIGUSR1: ignored, never fatal), release the lock."""
        if self.mirror is not None:
            self.mirror.close(timeout=0)
        self.history.close()
        self.signals.uninstall()
        self.store.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()  # never leave a half-written generation behind by choice
