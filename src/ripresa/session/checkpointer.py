"""The :class:`Checkpointer`: exact, crash-safe checkpoints for any training loop, in five added lines (README.md).

It wires the session's parts: the run folder and its backends (``store/``), the save pipeline
(``saving.py``), the resume choice (``resuming.py``), cadence and deadline, signals, steering,
history and the mirror. What it writes, which generations a resume considers and how a failed
save is handled: docs/FORMAT.md, docs/FAULTS.md; the walk of one save and one resume, and
distributed runs: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..console import install_script_hooks
from ..core.loader import per_rank_sampling
from ..core.numbers import checked_number
from ..core.state import Progress, TrainingState
from ..errors import BadInput, SaveFailed
from ..io import auth
from ..io.fsio import write_atomic
from ..store.async_save import AsyncCheckpointWriter
from ..store.backend import (
    ForeignCheckpointWarning,
    StorageBackend,
    backends_for,
    choose_writer,
    newest_kind,
)
from ..store.folder import DEFAULT_SHARD_THRESHOLD, SaveOptions
from ..store.history import HISTORY_NAME, History
from ..store.mirror import Mirror, has_local_generation, open_mirror, pull_run, record_url
from ..store.restore import rank_view, saved_record
from ..store.retention import DEFAULT_RETENTION, RetentionPolicy
from ..store.store import CheckpointStore, CheckpointWarning, Generation
from .cadence import (
    DEFAULT_MTBF_S,
    STEP_WINDOW,
    AutoCadence,
    median,
    parse_duration,
    parse_max_redo,
)
from .closing import CloseResult, close_plan, parse_final_upload_timeout
from .deadline import Deadline
from .distributed import INVARIANT_CHANGE_NOTE, WORLD_CHANGE_NOTE, DistContext, NullHistory
from .hyperparams import SIDES, HyperparameterWarning, reconcile, script_values
from .hyperparams import message as hyperparameter_message
from .invariant import (
    InvariantSteps,
    check_micro_batches,
    fresh_seed,
    invariant_record,
    saved_invariant,
    world_change_verdict,
)
from .memory import MemorySession, MemoryTierWarning
from .nodes import (
    Heartbeat,
    NodeLayout,
    NodePipeline,
    NodeStore,
    land_replica,
    land_sharded,
    mark_node_local,
    once_node_local,
    one_node,
    report_pulled,
)
from .nodes import detect as detect_nodes
from .nodes import watch as watch_nodes
from .probe import LiveProbe, ReplaySession, take_replay
from .resuming import OtherModeWarning, Resumer
from .run_files import METRICS_NAME, GenerationMetrics, local_run_dir
from .saving import CollectivePipeline, LocalPipeline, RankZeroPipeline, SaveHooks
from .sharded_async import AsyncCollectivePipeline, ShardedWriter
from .signals import SignalRequests, hold
from .steer import DistSteeredRecorder, SteeredRecorder, steer_session
from .torchrun import bind_to_launcher

__all__ = ["Checkpointer", "ForeignCheckpointWarning", "HyperparameterWarning", "OtherModeWarning", "rank_view", "METRICS_NAME", "local_run_dir"]


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
        on_checkpoint: called as ``on_checkpoint(step)`` at every checkpoint, on the
            loop, on every rank (it must not perturb the training streams).
        on_staged: called as ``on_staged(step, weights)`` once generation ``step`` is
            committed, ``weights`` mapping each parameter name to its saved value
            (the sample-audit hook, off the loop; docs/API.md, "on_staged"). With a
            background writer it runs on the writer's thread, ``weights`` being views
            of the staged copy (valid during the call only; the next save waits for
            it); a synchronous session, and every rank of a sharded FSDP2 one, call it
            on the loop with the live parameters; a DDP run on rank 0 only. What it
            raises is a warning and an ``on_staged_failed`` history event, never a
            failed save.
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
        hyperparameters: which side wins when the script's optimizer param
            groups (``lr``, ``weight_decay``, ``betas``, ...) differ from the
            resumed checkpoint's: ``"checkpoint"`` (the default) keeps the
            checkpoint's (an exact resume) and warns
            (:class:`~ripresa.session.hyperparams.HyperparameterWarning`),
            naming each changed key; ``"script"`` applies the script's. Both
            record a ``hyperparameter_change`` history event; ``"loop"``: the
            loop sets them itself after :meth:`resume` (a schedule applied
            every step), nothing is compared (docs/API.md, "Changed
            hyper-parameters").
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
        final_upload_timeout: at a normal end, how long :meth:`close` waits
            for a mirror that cannot be reached before it leaves the final
            generation pending (seconds, or ``"15m"``; default the mirror's
            ``close_timeout``, 900 s; never past ``deadline``). A stop
            (SIGTERM/SIGINT) keeps the short bound. :meth:`close` returns a
            :class:`~ripresa.session.closing.CloseResult`; :attr:`upload_pending`
            (docs/MIRROR.md, "The close").

        memory_every: keep a complete generation of every ``memory_every``-th
            step in shared memory (``/dev/shm``; 0, the default: off): copied
            while the next step runs, the optimizer's step waiting only for an
            unfinished copy; a SIGKILLed run started again resumes from it when
            it is newer than the newest disk generation (at most one step
            redone at ``memory_every=1``); removed at a normal end; never
            trusted across a reboot, another user or another run. Single-process
            sessions (docs/TIERS.md).

        world_size_invariant: 0 (the default: off), or ``G``, the number of
            micro-batches of every step (a multiple of every world size the
            run may use): :attr:`invariant` is then an
            :class:`~ripresa.session.invariant.InvariantSteps` over
            ``state.model`` — run ``with ckpt.invariant.micro_batch(step, i):``
            for each ``i`` in ``ckpt.invariant.indices()``, ``backward(loss)``,
            then ``reduce()`` before the optimizer's step — and 1, 2 or 4 ranks
            give the same weights bit for bit; a resume on another number of
            ranks keeps the trajectory exact. BatchNorm, a DDP-wrapped model
            and a per-rank sampler are refused (docs/ARCHITECTURE.md,
            "World-size changes").
        probe_every: replay the first cadence generation and then every
            ``probe_every``-th one in a side process — the script started
            again, resuming that generation as a resume would, running the next
            step — and compare it bit for bit with what this run computed: the
            loss, the weights and optimizer state, the scheduler, the random
            streams, the data position and the batch (0, the default: off). The
            loop never waits for it; a difference is a ``probe_mismatch``
            history event and one
            :class:`~ripresa.session.probe.ProbeMismatchWarning` naming what
            differs first and the generation to resume from; a probe that
            cannot run says so once and turns itself off (docs/VERIFY.md, "The
            live probe"). :attr:`probe` holds its outcome.
        probe_command: the command that starts this script again for the
            probe (default: this process's own command line, in its working
            folder and environment).

        shard_threshold, shards, staging_budget: how a general generation is
            laid out and staged (:class:`~ripresa.store.folder.SaveOptions`):
            tensors of ``shard_threshold`` bytes or more (default 2 GiB; None:
            never) are written as ``shards`` files (default one per CPU, 2 to
            8) of a ``step_NNNNNN.shards/`` folder in Hugging Face's sharded
            layout, each written and hashed by its own worker (docs/FORMAT.md,
            "Sharded general generations"); a background save copies at most
            ``staging_budget`` bytes into staging and writes the rest before
            the loop goes on (docs/API.md, "Memory: staging_budget").

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
        on_staged: Callable[[int, Mapping[str, Any]], Any] | None = None,
        sidecars: Mapping[str, Callable[[], dict[str, Any]]] | None = None,
        handle_signals: bool = True,
        fresh: bool = False,
        allow_version_change: bool = False,
        allow_code_change: bool = False,
        allow_data_change: bool = False,
        allow_config_change: bool | None = None,
        hyperparameters: str = "checkpoint",
        save_on_close: bool = True,
        max_failed_saves: int = 3,
        distributed: bool | None = None,
        format: str = "auto",
        mirror: Any = None,
        mtbf: float | str | None = None,
        max_redo: int | float | str | None = None,
        deadline: Any = None,
        on_deadline: Callable[[int], Any] | None = None,
        shard_threshold: int | None = DEFAULT_SHARD_THRESHOLD,
        shards: int | None = None,
        staging_budget: int | None = None,
        final_upload_timeout: float | str | None = None,
        memory_every: int = 0,
        world_size_invariant: int = 0,
        probe_every: int = 0,
        probe_command: Sequence[str] | None = None,
    ) -> None:
        install_script_hooks()  # a ripresa error that ends the script: one paragraph and its exit code (docs/API.md)
        if handle_signals:
            hold()  # a SIGUSR1 before the handlers below (lock, resume of the mirror) is deferred, never fatal
        bind_to_launcher()  # a rank of python -m ripresa.torchrun dies with its launcher, never trains on orphaned
        save_options = SaveOptions(shard_threshold, shards, staging_budget)  # a bad value fails before any lock
        if not isinstance(probe_every, int) or isinstance(probe_every, bool) or probe_every < 0:
            raise ValueError(f"probe_every must be an int >= 0 (0: no probe), got {probe_every!r}")
        replay = take_replay()  # a probe's side process (session/probe.py): resume the probed generation in a folder
        if replay is not None:  # of its own, save nothing, touch nothing of the live run, exit after the replayed step
            run_dir, every, mirror, memory_every, deadline, mtbf, max_redo, probe_every = (
                replay.run_dir, 0, None, 0, None, None, None, 0)
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
        if not isinstance(memory_every, int) or isinstance(memory_every, bool) or memory_every < 0:
            raise ValueError(f"memory_every must be an int >= 0 (0: no memory tier), got {memory_every!r}")
        world_size_invariant = check_micro_batches(world_size_invariant)
        if hyperparameters not in SIDES:
            raise ValueError(f"hyperparameters must be one of {SIDES}, got {hyperparameters!r}")
        self.hyperparameters = hyperparameters
        #: ``every="auto"``: the measured cadence (docs/CADENCE.md), else None; :attr:`deadline` likewise.
        self.cadence = AutoCadence(mtbf_s=parse_duration(DEFAULT_MTBF_S if mtbf is None else mtbf, "mtbf"),
                                   max_redo=parse_max_redo(max_redo)) if auto else None
        self.deadline = Deadline(deadline) if deadline is not None else None  # both checked before the folder is locked
        self.final_upload_timeout = parse_final_upload_timeout(final_upload_timeout)
        #: What :meth:`close` ended with (None before it): the final step, what the mirror still lacks.
        self.close_result: CloseResult | None = None
        #: ``ripresa verify``'s steering of this process (docs/VERIFY.md), or None: see :mod:`ripresa.session.steer`.
        self.steering = steer_session()  # every session of a verified process (session/steer.py)
        self.run_dir = local_run_dir(run_dir) if self.steering is None else self.steering.run_dir
        if fresh and self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise BadInput("--fresh refuses a run folder that is not empty", file=self.run_dir,
                           expected="an empty or new folder", found=sorted(p.name for p in self.run_dir.iterdir())[:8],
                           hint="choose a new --run folder, or drop --fresh to resume this one")
        self.state = state
        self._fresh = fresh
        self.every = int(every)
        self.on_checkpoint = on_checkpoint
        self.on_staged = on_staged
        self.sidecars = dict(sidecars or {})
        self.allow = {"allow_version_change": allow_version_change, "allow_code_change": allow_code_change,
                      "allow_data_change": allow_data_change, "allow_config_change": allow_config_change}
        self.save_on_close = bool(save_on_close)
        self._resumed_step: int | None = None  # the step resume() returned: step_done must go beyond it
        self._done_step: int | None = None  # the last step step_done() completed (returned from)
        self.max_failed_saves = max_failed_saves
        self.retention = retention
        #: The metrics ``retention`` reads (``KeepBest``): each generation records their latest values (docs/RETENTION.md).
        self._metrics = GenerationMetrics(getattr(retention, "metric_names", ()), self.run_dir)
        self.format = format
        self.dist: DistContext | None = None if distributed is False else DistContext.detect(state.model)
        if distributed is True and self.dist is None:
            raise BadInput("distributed=True but no process group is initialised", expected="torch.distributed.init_process_group() first",
                           hint="launch with torchrun; a single process passes distributed=None or False")
        self.world_change: dict[str, Any] | None = None
        self.fresh_streams = False
        self.mode = "single" if self.dist is None else "fsdp2" if self.dist.sharded else "ddp"
        shards: ShardedWriter | None = None  # FSDP2, asynchronous: every rank's background DCP writes
        choose_writer(self.mode, state, format)  # a refused format fails here, on every rank, before any lock
        #: The nodes of a multi-node run (None on one node); node-local folders: docs/DISTRIBUTED.md
        self.layout: NodeLayout | None = None if self.dist is None else detect_nodes(self.dist, self.run_dir)
        if self.layout is None and self.dist is not None and mirror is not None and once_node_local(self.run_dir):
            self.layout = one_node(self.dist)  # a node-local run resumed on one node: its store stays the truth
        self.node_local = self.layout is not None and not self.layout.shared
        self.node_store: NodeStore | None = None
        self.heartbeat: Heartbeat | None = None
        if self.node_local and (mirror is None or self.steering is not None):
            raise BadInput("the nodes of this run do not share the run folder, and no store joins them",
                           file=self.run_dir, expected="a mirror (the object store every node reaches)",
                           found="node-local run folders without --mirror",
                           hint="pass mirror='s3://bucket/run' (ripresa train --mirror URL); docs/DISTRIBUTED.md")
        leader = self.layout.is_leader if self.node_local and self.layout is not None else False
        if self.node_local and self.mode == "fsdp2":
            asynchronous = False  # committed in the store at the save (docs/DISTRIBUTED.md, "What a save costs")
        if self.dist is None:
            self.store = CheckpointStore(self.run_dir, retention=retention)
            self.store.save_options = save_options
            self._open_backends()
            self.backend.clean()  # what interrupted saves of the kind it writes left (a sharded save's partial folder)
            self.history = History(self.run_dir / HISTORY_NAME)
        else:
            # Rank 0 creates the folder and takes the lock; the others wait, then read only.
            self.dist.barrier()
            if self.dist.is_main or leader:  # node-local folders: each node's first rank holds its node's folder
                self.store = CheckpointStore(self.run_dir, retention=retention)
                self.store.save_options = save_options
                self._open_backends()
                self.backend.clean()  # what interrupted saves of the kind it writes left
                self.history = History(self.run_dir / HISTORY_NAME) if self.dist.is_main else NullHistory()  # type: ignore[assignment]
            self.dist.barrier()
            if not (self.dist.is_main or leader):
                self.store = CheckpointStore(self.run_dir, writer=False)
                self._open_backends()
                self.history = NullHistory()  # type: ignore[assignment]
            if self.layout is not None:
                self.heartbeat = watch_nodes(self.layout, self.dist.rank)  # a lost node: NodeLost, exit 4
            if self.node_local:
                if leader:
                    mark_node_local(self.run_dir, self.layout)
                url = getattr(mirror, "url", None) or os.fspath(mirror)
                self.node_store = NodeStore(url, self.layout, event=self.history.event)
                self.store.node_part = self.mode == "fsdp2"
                self.store.fetch = self.node_store.fetch
            if asynchronous and self.mode == "fsdp2":
                shards = ShardedWriter(self.dist)  # a collective: built here, in the same order on every rank
            asynchronous = asynchronous and (self.dist.is_main or leader)
        asynchronous = asynchronous and self.backend.background
        self.resumer = Resumer(store=self.store, backends=self.backends, ignored=self._ignored, state=state,
                               allow=self.allow, dist=self.dist, history=self.history, run_dir=self.run_dir,
                               mode=self.mode, format=format)
        if self._metrics.names and (self.dist is None or self.dist.is_main):
            try:
                self._metrics.load()
            except BaseException:
                self.history.close()
                self.store.close()
                raise
            self.store.metrics = lambda: self._metrics.by_step  # read by retention, in the writer's thread too
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
            if self.node_store is not None and self.mode == "fsdp2":
                self.mirror.generations = False  # the nodes commit each generation in the store themselves
                self.node_store.keep = self.mirror.policy
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
        #: True when ``resume()`` restored a generation of the memory tier (promoted into the folder; docs/TIERS.md).
        self.resumed_from_memory = False
        self.save_stalls: list[float] = []  # seconds the loop was blocked by each save
        self.pipeline = self._pipeline(shards)
        if self.cadence is not None:
            self.cadence.background, self.cadence.follow = self.writer is not None, self.dist is None
        self.on_deadline = on_deadline
        self._step_exit: float | None = None  # when step_done last returned (the step time is measured outside it)
        self._step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._recorder = (None if self.steering is None or not self.steering.records else SteeredRecorder(self.steering, state) if self.dist is None
                          else DistSteeredRecorder(self.steering, state, self.dist))  # every rank is steered
        if self.steering is not None:
            self.history.event("verify_steered", path=self.steering.path, stop_at=self.steering.stop_at,
                               restore_rng=self.steering.restore_rng)
        #: The memory tier (``memory_every``; docs/TIERS.md), or None.
        self.memory: MemorySession | None = None
        if memory_every and self.dist is not None:
            why = "the memory tier is built for single-process sessions; this one is distributed"
            self.history.event("memory_tier_off", reason=why)
            if self.dist.is_main:
                warnings.warn(f"{why}: it is off, the disk tier goes on (docs/TIERS.md)", MemoryTierWarning, stacklevel=2)
        elif memory_every:
            self.memory = MemorySession(memory_every, self.run_dir, state, self.history.event)
        #: World-size-invariant steps (``world_size_invariant``; docs/ARCHITECTURE.md, "World-size changes"), or None.
        self.invariant: InvariantSteps | None = None
        if world_size_invariant:
            self.invariant = self._invariant_steps(world_size_invariant)
        #: The live probe (``probe_every``; docs/VERIFY.md, "The live probe"), or None; :attr:`replaying`: this
        #: process is a probe's side process (None in a run of its own).
        self.replaying = None if replay is None else ReplaySession(replay, state)
        self.probe = (LiveProbe(probe_every, state, self.history.event, self.dist, probe_command)
                      if probe_every and self.steering is None else None)
        if self.probe is not None and (self.dist is None or self.dist.is_main):
            self.store.pinned = self.probe.pinning(self.store.pinned)  # retention keeps the generation being probed

    def _invariant_steps(self, micro_batches: int) -> InvariantSteps:
        """The session's :class:`InvariantSteps`: refused data, the micro-batch streams' seed (rank 0's
        ``torch.initial_seed()``; a resume takes the saved one), recorded in every generation."""
        why = per_rank_sampling(self.state.data) if self.state.data is not None else None
        if why is not None:
            raise BadInput("world-size-invariant steps need a data order that is a function of the global sample "
                           "index", found=why, expected="a loader over the whole data set, split into micro-batches "
                           "by index (ExactLoader.select / StatefulLoader.select)",
                           hint="drop the DistributedSampler: docs/ARCHITECTURE.md, \"World-size changes\"")
        seed = fresh_seed()
        if self.dist is not None:
            seed = int(self.dist.broadcast(seed))
        exact = bool(getattr(self.steering, "invariant", True)) if self.steering is not None else True
        steps = InvariantSteps(self.state.model, micro_batches=micro_batches, seed=seed, exact=exact)
        self.pipeline.extra["invariant"] = invariant_record(steps)
        self.history.event("world_size_invariant", micro_batches=micro_batches, world_size=steps.world,
                           exact=exact, sharded=steps.sharded)
        return steps

    def _open_backends(self) -> None:
        """The storage backends of this run mode (docs/ARCHITECTURE.md): the first writes, all are resumed."""
        self.backends, self._ignored = backends_for(self.mode, self.store, state=self.state, format=self.format)
        self.backend: StorageBackend = self.backends[0]

    def _pipeline(self, shards: ShardedWriter | None) -> LocalPipeline:
        """The save pipeline of this run mode and backend (session/saving.py), picked once, as the backend is."""
        hooks = SaveHooks(committed=self._committed, failed=self._failed, failed_quietly=self._failed_quietly,
                          staged=self.on_staged, staged_failed=self._staged_failed)
        args = (self.backend, self.state, lambda: self.progress, self.writer, hooks, self.save_stalls, self.run_dir)
        if self.dist is None:
            return LocalPipeline(*args)
        if self.node_store is not None and self.backend.collective:
            return NodePipeline(*args, self.dist, None, nodes=self.node_store)
        if not self.backend.collective:
            pipe = RankZeroPipeline(*args, self.dist, shards)
            if self.node_local and self.layout is not None:  # DDP: every node keeps a whole copy of its own
                pipe.main, pipe.replicas = self.layout.is_leader, True
            return pipe
        return (CollectivePipeline if shards is None else AsyncCollectivePipeline)(*args, self.dist, shards)

    # ------------------------------------------------------------------ start
    def resume(self, *, from_path: str | Path | None = None, restore_rng: bool = True) -> int:
        """Restore the newest valid generation (or ``from_path``); return its step (0 if none).

        Call it after building every object and right before the first step:
        the random streams are restored last. ``from_path`` names a generation
        of any registered kind: a ``step_NNNNNN.safetensors``, a
        ``step_NNNNNN.bin`` (with companion, or a foreign one without) or a
        ``step_NNNNNN.dcp`` folder. In a distributed run every rank calls it;
        rank 0 chooses the generation and every rank loads it
        (session/resuming.py).
        """
        if self.replaying is not None:  # a probe's side process: the probed generation, as a resume restores it
            step = self._resume(self.replaying.replay.generation, restore_rng)
            self.replaying.resumed(step, self.progress)
            return step
        if self._recorder is not None:  # steered by ripresa verify: the path decides, then the start is recorded
            step = self._resume(from_path, restore_rng and self._recorder.steer.restore_rng)
            self._recorder.start(self.progress, str(self.resumed_from.path) if self.resumed_from is not None else None)
            return step
        return self._resume(from_path, restore_rng)

    def _resume(self, from_path: str | Path | None, restore_rng: bool) -> int:
        landed, ns = False, self.node_store
        if ns is not None and from_path is None and not self._fresh:
            # FSDP2: every node holds its part of the store's newest generation; DDP: every node a whole copy
            assert self.dist is not None
            from_path = (land_sharded(self.dist, ns, self.run_dir, self.backend) if self.mode == "fsdp2" else
                         land_replica(self.dist, ns, self.run_dir, self.backends, self.store, self.history.event))
            landed = from_path is not None
            self.resumer.reroot = True
        if self.memory is not None:
            if from_path is not None or self._fresh:
                self.memory.forget()  # another past than the memory generations'
            else:
                self.resumer.promoted = self.memory.resume(self._newest_on_disk(), self.store.hmac_key)
        if self.mirror is not None:
            # node-local folders: generations come from the nodes and the store above; the mirror keeps the run's files
            if ns is None and from_path is None and not self._fresh and not has_local_generation(self.run_dir):
                pull_run(self.mirror.store, self.run_dir, self.store, kinds=[b.kind for b in self.backends],
                     event=self.history.event, spec=self.mirror.spec)
            self.mirror.start()
        before = script_values(self.state.optimizer, self.state.scheduler)  # the script's, before the restore
        gen, restored = self.resumer.take(from_path, restore_rng)
        if landed:
            assert self.dist is not None and ns is not None
            from_path = None  # the newest committed generation, as a resume without a path would take it
            report_pulled(self.dist, ns, gen, self.history.event)
        if gen is not None and restored is not None:
            self._hyperparameters(gen, before)
            self.resumed_from_memory = self.resumer.promoted is not None and gen.step == self.resumer.promoted
            if self.resumed_from_memory:
                self._write_sidecars()  # a promoted generation has its sidecars too (not the older disk step's)
        if gen is None or restored is None:
            world = {} if self.dist is None else {"world_size": self.dist.world_size}
            self.history.event("start", step=0, rng_restored=restore_rng, **world)
            self._resumed_step = 0
            self._write_config()
            return 0
        return self._resumed(gen, restored, from_path, restore_rng, world_size=1 if self.dist is None else self.dist.world_size)

    def _newest_on_disk(self) -> int | None:
        """The step of the newest generation of the folder that passes its (cheap) check, of any kind resumed."""
        best: int | None = None
        for b in self.backends:
            for s in sorted(b.steps_on_disk(), reverse=True):
                if best is not None and s <= best:
                    break
                if b.check(s).valid:
                    best = s
                    break
        return best

    def _hyperparameters(self, gen: Generation, before: Any) -> None:
        """The script's optimizer hyper-parameters against the restored ones: which side wins, never silently."""
        if self.hyperparameters == "loop":
            return  # the loop sets them itself after resume() (docs/API.md, "Changed hyper-parameters")
        changes = reconcile(before, self.state.optimizer, self.hyperparameters, self.state.scheduler)
        if not changes:
            return
        self.history.event("hyperparameter_change", step=gen.step, used=self.hyperparameters, changes=changes)
        if self.hyperparameters == "checkpoint" and (self.dist is None or self.dist.is_main):
            groups = len(self.state.optimizer.param_groups) if self.state.optimizer is not None else 1
            warnings.warn(hyperparameter_message(changes, groups), HyperparameterWarning, stacklevel=4)

    def _resumed(self, gen: Generation, restored: Any, from_path: Any, restore_rng: bool, *, world_size: int) -> int:
        """Record a restored generation: progress, history event, world change, config."""
        self.progress = restored.progress
        self._resumed_step = self.progress.step
        if self._metrics.names:
            self._metrics.resumed(self._resumed_step)
        if gen.foreign:  # weights, m and v only: no generation of this run was resumed
            self.history.event("resume", from_step=gen.step, file=str(gen.path), **restored.event)
            self._write_config()
            return gen.step
        self.resumed_from = gen
        self.fresh_streams = restored.fresh
        self.last_saved_step = gen.step if from_path is None else None
        self.pipeline.resumed(self.last_saved_step)
        dist_fields = {} if self.dist is None else {"world_size": world_size}
        self.history.event("resume", from_step=gen.step, file=str(gen.path), rng_restored=restore_rng, **dist_fields,
                           lineage=self.state.lineage[-1] if self.state.lineage else None)
        saved_mode = saved_invariant(restored.extra, file=gen.path)
        if self.invariant is not None and saved_mode is not None:
            self.invariant.seed = saved_mode["seed"]  # the micro-batch streams go on as saved
            self.pipeline.extra["invariant"] = invariant_record(self.invariant)
        self._note_world_change(restored.extra, world_size=world_size, fresh=restored.fresh, saved_mode=saved_mode)
        if self.state.accepted_config_changes:  # allowed (allow_config_change): recorded, as in the lineage
            self.history.event("config_change", step=gen.step, changes=self.state.accepted_config_changes,
                               allowed="explicitly" if self.allow["allow_config_change"] else "by default")
        self._write_config()
        return self.progress.step

    def _note_world_change(self, saved_extra: Mapping[str, Any], *, world_size: int, fresh: bool,
                           saved_mode: dict[str, int] | None = None) -> None:
        """Record a resume on another number of ranks than the save's (history event, :attr:`world_change`);
        warn when the trajectory is no longer the saved world size's (docs/ARCHITECTURE.md, "World-size changes")."""
        rec = saved_record({"extra": saved_extra}, None)
        saved_world = checked_number(rec["world_size"], file=None, field="world_size", lo=1, hi=2**20) if rec else 1
        if saved_world == world_size:
            return
        not_exact = world_change_verdict(saved_mode, self.invariant)
        self.world_change = {
            "saved_world_size": saved_world,
            "world_size": world_size,
            "saved_shard": rec.get("shard") if rec else None,
            "fresh_stream_ranks": list(range(saved_world, world_size)),
            "dropped_ranks": list(range(world_size, saved_world)),
            "trajectory": "exact" if not_exact is None else "changed",
        }
        note = WORLD_CHANGE_NOTE if not_exact is not None else INVARIANT_CHANGE_NOTE
        self.history.event("world_size_change", step=self.progress.step, **self.world_change, note=note,
                           **({} if not_exact is None else {"why": not_exact}))
        if not_exact is not None and (fresh or self.world_change["dropped_ranks"]):
            warnings.warn(f"resumed a checkpoint of {saved_world} rank(s) on {world_size}: weights, m and v are exact, "
                          f"the trajectory is not that of the saved world size: {not_exact} "
                          "(docs/ARCHITECTURE.md, \"World-size changes\")", stacklevel=3)

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
        if self.replaying is not None:  # a probe's side process: record; after its last replayed step it exits
            self.replaying.step_done(step, p, metrics)
        elif self.probe is not None:  # records the step a probe replays; starts it; compares its answer (no wait)
            self.probe.step_done(step, p, metrics)
        if self.memory is not None:  # the previous capture committed before this step's line (docs/TIERS.md)
            self.memory.before_record(step)
        self.history.step(step, **metrics)
        if self._metrics.names:
            self._metrics.note(metrics)
        steered_stop = False
        if self._recorder is not None and not self._recorder.finished:
            self._recorder.step(step, metrics)
            steered_stop = step >= self._recorder.steer.stop_at
        self.pipeline.collect(block=False)
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
        if self.memory is not None and not stop and self.memory.due(step):
            self.memory.capture(step, self.progress)  # copied while the next step runs (docs/TIERS.md)
        if stop:
            self.pipeline.finish()
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
        self._save(self.progress.step, reason, must_succeed=True)
        return self.pipeline.finish()

    def _save(self, step: int, reason: str, must_succeed: bool) -> None:
        """Save ``step`` through the pipeline; then the sidecars (once), ``on_staged`` when it runs on the loop,
        and the ``on_checkpoint`` hook."""
        if self._metrics.names and self.pipeline.main:
            self._metrics.record(step)  # before the generation is committed: retention reads it
        handed = self.pipeline.save(step, reason, must_succeed)
        if self.probe is not None:
            self.probe.saved(step, reason, self.progress, handed)  # every rank: rank 0 decides whether to probe it
        if not handed:
            return  # already saved, or failed (reported)
        if self.pipeline.main:
            self._write_sidecars()
        self.pipeline.staged_on_loop(step)  # a synchronous or sharded session; a background writer runs it itself
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)  # on every rank (a sharded model's forward is collective); runs while the writer writes

    def _write_sidecars(self) -> None:
        for name, fn in self.sidecars.items():
            write_atomic(self.run_dir / name, [json.dumps(fn(), indent=1, allow_nan=True).encode() + b"\n"])

    def _committed(self, gen: Any, reason: str, seconds: float) -> None:
        self.failed_saves = 0
        self.last_saved_step = gen.step
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
        if self.probe is not None:
            self.probe.committed(gen.step, gen.path)
        if self.mirror is not None:
            self.mirror.notify(gen.step)

    def _staged_failed(self, step: int, exc: BaseException) -> None:
        """``on_staged`` raised: a warning and a history event; the generation stands and training goes on."""
        error = f"{type(exc).__name__}: {exc}"[:300]
        self.history.event("on_staged_failed", step=step, error=error)
        warnings.warn(f"the on_staged hook failed at step {step} (the checkpoint is committed; training goes on): "
                      f"{error}", CheckpointWarning, stacklevel=2)

    def _failed(self, step: int, exc: SaveFailed, must_succeed: bool) -> None:
        self._failed_quietly(step, exc)
        if must_succeed or self.failed_saves >= self.max_failed_saves:
            raise exc
        warnings.warn(f"checkpoint at step {step} failed (training goes on; next cadence retries):\n{exc}", stacklevel=3)

    def _failed_quietly(self, step: int, exc: SaveFailed) -> None:
        self.failed_saves += 1
        self.history.event("checkpoint_failed", step=step, error=exc.message, found=str(exc.found)[:200])

    # ------------------------------------------------------------------ end
    def close(self, *, final_save: bool | None = None) -> CloseResult:
        """Finish the in-flight save, save the final state, upload it to the mirror, release the folder.

        The final save (``final_save``, default :attr:`save_on_close`, True)
        commits the last step that :meth:`step_done` completed, when no
        generation holds it yet: a run that ends between cadence points keeps
        its last steps. It is skipped — a ``final_save_skipped`` history event
        and a warning — when the live state may be past that step: ``close()``
        called while an exception is being handled (in a ``finally`` or
        ``except`` block), or after a ``step_done`` that raised. On an error
        path call :meth:`abort` (or use the ``with`` block, which does), never
        a save (docs/FAULTS.md, "The end of a run").

        With a mirror, a normal end waits for the store up to
        ``final_upload_timeout`` (a stop by SIGTERM/SIGINT: the short bound).
        Returns a :class:`~ripresa.session.closing.CloseResult`:
        ``upload_pending`` / ``safe_off_machine``, the ``pending`` steps,
        ``exit_code`` (0, or 3 pending) and ``raise_if_pending()``
        (:class:`~ripresa.errors.UploadPending`) (docs/MIRROR.md, "The close").
        """
        if self.close_result is not None:
            return self.close_result  # closed already (a close() inside a with block): nothing more to do
        final = self.save_on_close if final_save is None else bool(final_save)
        result: CloseResult | None = None
        try:
            if self._recorder is not None and self._recorder.started:
                self._recorder.finish(self.progress)  # the script stopped before the steered step: record where
            step = self._final_step() if final else None
            self.pipeline.finish()
            if step is not None and not self.pipeline.holds(step):
                self._save(step, "final", must_succeed=True)
                self.pipeline.finish()
            if self.mirror is not None:
                result = self._close_mirror(self.mirror)
            if self.probe is not None:
                self.probe.close()  # a side process in flight answers (bounded wait) and is compared
            self.pipeline.close()  # FSDP2, asynchronous: its gloo save group ends now, not at interpreter exit
            if self.memory is not None:  # the disk holds the last step: the memory generations go
                self.memory.close(normal=True)
        finally:
            if self.memory is not None:
                self.memory.close(normal=False)
            try:
                self.history.sync()
            except OSError:
                pass
            self._release()
        self.close_result = result if result is not None else CloseResult(step=self.last_saved_step, run_dir=str(self.run_dir))
        return self.close_result

    def _close_mirror(self, mirror: Mirror) -> CloseResult:
        """The close's upload: a normal end waits for the store (``final_upload_timeout``, never past the deadline),
        a stop keeps the short bound; a stop signal during the wait leaves at once (docs/MIRROR.md, "The close")."""
        stopped = self.signals.stop_requested
        timeout, wait, label = close_plan(mirror.spec.close_timeout, self.final_upload_timeout, stopped=stopped,
                                          deadline=self.deadline.deadline if self.deadline is not None else None)
        if wait:  # only a stop signal (SIGTERM, SIGINT) leaves the wait; a SIGUSR1 does not
            heard = sum(n in ("SIGTERM", "SIGINT") for n in self.signals.received)
            interrupted = lambda: sum(n in ("SIGTERM", "SIGINT") for n in self.signals.received) > heard  # noqa: E731
        else:  # a signal during the close leaves it at once
            heard = len(self.signals.received)
            interrupted = lambda: len(self.signals.received) > heard  # noqa: E731
        mirror.close(timeout, interrupted=interrupted, wait=wait, label=label)
        return CloseResult(step=self.last_saved_step, mirror=mirror.spec.url, pending=tuple(mirror.pending),
                           reason=mirror.close_reason, seconds=round(mirror.close_seconds, 3),
                           push_command=mirror.push_command(), run_dir=str(self.run_dir))

    @property
    def upload_pending(self) -> list[int]:
        """The steps the mirror still lacks: after :meth:`close`, what it left pending ("done, upload pending");
        before, what the mirror's thread has not uploaded yet. Empty without a mirror."""
        if self.close_result is not None:
            return list(self.close_result.pending)
        return self.mirror.pending if self.mirror is not None else []

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
            self.pipeline.drain()
        except Exception:
            pass
        if self.memory is not None:
            self.memory.close(normal=False)  # kept: the next start resumes from them when they are the newest
        if self.probe is not None:
            self.probe.abort()
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
