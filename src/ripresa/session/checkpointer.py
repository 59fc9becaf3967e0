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
(``step_NNNNNN.bin`` + companion + marker), written asynchronously by default.

Failed saves: a save that fails (full disk, I/O error) is reported as a
warning and a ``checkpoint_failed`` history event, training goes on and the
next cadence retries — the previous generation is intact, so at most one
cadence of work is at risk, and a transient condition (a disk briefly full)
does not kill a run that may have days left. After ``max_failed_saves``
consecutive failures the session raises :class:`~ripresa.errors.SaveFailed`
and the run stops with its last valid checkpoint. A save requested by
SIGTERM that fails always raises: the operator asked for a durable stop.

Which generations a resume considers (docs/FORMAT.md, docs/FAULTS.md): the
kind the session writes — a single-process session only ``.bin`` generations
(a ``.dcp`` folder in its run folder is never read, and a warning names it),
an FSDP2 session ``.dcp`` ones, and a ``.bin`` of another mode only while
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

import copy
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState, _tensor_tree_clone
from ..errors import BadInput, IdentityMismatch, IntegrityError, RipresaError, SaveFailed
from ..formats import dcp as dcp_fmt
from ..formats.andrea_bin import (
    describe_missing,
    load_into_model_and_adamw,
    parse_bin_name,
    read_bin,
)
from ..formats.bin_state import bin_arrays, companion_snapshot, join_state
from ..io import auth
from ..io.fsio import write_atomic
from ..store.async_save import AsyncCheckpointWriter
from ..store.history import HISTORY_NAME, History
from ..store.retention import DEFAULT_RETENTION, RetentionPolicy, plan_deletions
from ..store.store import CheckpointStore, CheckpointWarning, Generation
from .distributed import (
    WORLD_CHANGE_NOTE,
    DistContext,
    NullHistory,
    check_distributed_record,
    fault_point,
)
from .signals import SignalRequests


class ForeignCheckpointWarning(UserWarning):
    """A .bin without companion was resumed: weights, m, v only."""


class OtherModeWarning(CheckpointWarning):
    """A generation of another kind than the session writes was ignored (or, distributed, used)."""


#: What restoring a hostile (but hash-consistent) state can raise besides ripresa's own errors.
_RESTORE_FAULTS = (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)


class Checkpointer:
    """A training session over a run folder.

    Args:
        run_dir: the run folder (created if needed; locked for this process).
        state: the run's :class:`~ripresa.TrainingState` (model + AdamW required).
        every: checkpoint cadence in optimizer steps (0 = only on signals and at close).
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
        max_failed_saves: consecutive failed saves tolerated before raising.
        distributed: None (the default) detects an initialised process group
            (world size > 1, or a sharded FSDP2 model); False forces a
            single-process session; True requires a group.

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
        every: int = 100,
        asynchronous: bool = True,
        retention: RetentionPolicy = DEFAULT_RETENTION,
        on_checkpoint: Callable[[int], None] | None = None,
        sidecars: Mapping[str, Callable[[], dict[str, Any]]] | None = None,
        handle_signals: bool = True,
        fresh: bool = False,
        allow_version_change: bool = False,
        allow_code_change: bool = False,
        allow_data_change: bool = False,
        max_failed_saves: int = 3,
        distributed: bool | None = None,
    ) -> None:
        if not isinstance(state, TrainingState) or not isinstance(every, int) or isinstance(every, bool):
            raise TypeError(f"need a ripresa.TrainingState and an int every, got {type(state).__name__}, {type(every).__name__}")
        if every < 0 or max_failed_saves < 1:  # misuse of the API: TypeError/ValueError (docs/FAULTS.md)
            raise ValueError(f"need every >= 0 (0: on signals only) and max_failed_saves >= 1, got {every}, {max_failed_saves}")
        self.run_dir = Path(run_dir)
        if fresh and self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise BadInput("--fresh refuses a run folder that is not empty", file=self.run_dir,
                           expected="an empty or new folder", found=sorted(p.name for p in self.run_dir.iterdir())[:8],
                           hint="choose a new --run folder, or drop --fresh to resume this one")
        self.state = state
        self.every = int(every)
        self.on_checkpoint = on_checkpoint
        self.sidecars = dict(sidecars or {})
        self.allow = {"allow_version_change": allow_version_change, "allow_code_change": allow_code_change,
                      "allow_data_change": allow_data_change}
        self.max_failed_saves = max_failed_saves
        self.retention = retention
        self.dist: DistContext | None = None if distributed is False else DistContext.detect(state.model)
        if distributed is True and self.dist is None:
            raise BadInput("distributed=True but no process group is initialised", expected="torch.distributed.init_process_group() first",
                           hint="launch with torchrun; a single process passes distributed=None or False")
        self.world_change: dict[str, Any] | None = None
        self.fresh_streams = False
        self._captured_step: int | None = None  # distributed: the step whose state every rank handed over last
        if self.dist is None:
            self.store = CheckpointStore(self.run_dir, retention=retention)
            self.history = History(self.run_dir / HISTORY_NAME)
        else:
            # Rank 0 creates the folder and takes the lock; the others wait, then read only.
            self.dist.barrier()
            if self.dist.is_main:
                self.store = CheckpointStore(self.run_dir, retention=retention)
                if self.dist.sharded:
                    dcp_fmt.clean_partials(self.run_dir)
                self.history = History(self.run_dir / HISTORY_NAME)
            self.dist.barrier()
            if not self.dist.is_main:
                self.store = CheckpointStore(self.run_dir, writer=False)
                self.history = NullHistory()  # type: ignore[assignment]
            asynchronous = asynchronous and self.dist.is_main and not self.dist.sharded
        if self.history.repaired_torn_line:
            self.history.event("torn_line_terminated")
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

    # ------------------------------------------------------------------ start
    def resume(self, *, from_path: str | Path | None = None, restore_rng: bool = True) -> int:
        """Restore the newest valid generation (or ``from_path``); return its step (0 if none).

        Call it after building every object and right before the first step:
        the random streams are restored last. ``from_path`` is a
        ``step_NNNNNN.bin`` (with companion, or a foreign one without) or a
        ``step_NNNNNN.dcp`` folder. In a distributed run every rank calls it;
        rank 0 chooses the generation and every rank loads it.
        """
        if self.dist is not None:
            return self._resume_dist(from_path, restore_rng)
        n = sum(p.numel() for p in self.state.model.parameters())
        if from_path is not None:
            gen, store, foreign = self._choose_path(from_path)
            if foreign is not None:
                return self._resume_foreign(foreign, n)
            saved_extra = self._load_generation(gen, store, n, restore_rng)
        else:
            gen, saved_extra, last_error = None, {}, None
            for cand in self._candidates():
                try:
                    saved_extra = self._load_generation(cand, self.store, n, restore_rng)
                except IntegrityError as exc:  # damaged after its check (bit rot, a hostile state): the next older
                    last_error = exc
                    what = ".dcp generation" if isinstance(cand, dcp_fmt.DcpGeneration) else "generation"
                    msg = f"skipping {what} {cand.step}: {exc.message} ({exc.file})"
                    warnings.warn(msg, CheckpointWarning, stacklevel=2)
                    self.history.event("skipped_generation", reason=msg)
                    continue
                gen = cand
                break
            if gen is None and last_error is not None:
                raise last_error
            if gen is None:
                self._refuse_if_only_damaged()
        if gen is None:
            self.history.event("start", step=0, rng_restored=restore_rng)
            self._write_config()
            return 0
        self.resumed_from = gen
        self.last_saved_step = gen.step if from_path is None else None
        self.history.event("resume", from_step=gen.step, file=str(_gen_path(gen)), rng_restored=restore_rng,
                           lineage=self.state.lineage[-1] if self.state.lineage else None)
        self._note_world_change(saved_extra, world_size=1, fresh=False)
        self._write_config()
        return self.progress.step

    def _load_generation(self, gen: Any, store: CheckpointStore | None, n: int, restore_rng: bool) -> dict[str, Any]:
        """Single process: load ``gen`` (a checked ``.bin`` or ``.dcp``) into the live state; its ``extra``.

        Everything read is checked before the live objects change; a state that
        passes the file checks but cannot be restored is an IntegrityError.
        """
        try:
            if isinstance(gen, dcp_fmt.DcpGeneration):
                rest = self._read_dcp_rest(gen, n)
                _validate_rest(self.state, rest, self.allow)
                dcp_fmt.load_shards(self.state.model, self.state.optimizer, gen.path, no_dist=True)
                self.progress = _restore_rest(self.state, rest, restore_rng, self.allow)
                return rest.get("extra") or {}
            reader = store if store is not None else CheckpointStore(gen.bin.parent, writer=False)
            contents, comp = reader.load(gen.step, expected_n=n)
            full = join_state(self.state, contents, comp)
            _saved_record(full, gen.companion)
            self.progress = self.state.restore(full, restore_rng=restore_rng, **self.allow)
            return full.get("extra") or {}
        except _RESTORE_FAULTS as exc:
            raise IntegrityError("the generation's state cannot be restored", file=_gen_path(gen),
                                 expected="a state as ripresa writes it",
                                 found=f"{type(exc).__name__}: {str(exc)[:200]}",
                                 hint="it was edited or damaged; an older generation will be used") from None

    def _kinds(self) -> tuple[str, ...]:
        """The generation kinds this session may resume, the one it writes first."""
        if self.dist is None:
            return ("bin",)
        return ("dcp", "bin") if self.dist.sharded else ("bin", "dcp")

    def _candidates(self):
        """The valid generations of the kinds this session resumes, newest first (a generator).

        A generation that fails its check is skipped with a warning and a
        ``skipped_generation`` event; one of another kind than the session
        writes is announced (``other_mode_generation``) before it is used; a
        single-process session names the ``.dcp`` folders it ignores.
        """
        kinds = self._kinds()
        store = self.store
        req, key = store.require_signature, store.hmac_key
        self._skipped_committed: list[str] = []  # committed generations that failed a check (not uncommitted leftovers)
        if "dcp" not in kinds:
            ignored = dcp_fmt.dcp_steps_on_disk(self.run_dir)
            if ignored:
                msg = (f"ignoring .dcp generation(s) {ignored[-3:]} in {self.run_dir}: a single-process run resumes only "
                       ".bin generations (.dcp ones are written by sharded FSDP2 runs; resume one explicitly with "
                       "--resume, or convert it with `ripresa convert`)")
                warnings.warn(msg, OtherModeWarning, stacklevel=3)
                self.history.event("ignored_generations", kind="dcp", steps=ignored[-8:], reason=msg)
        bins = set(store.steps_on_disk()) if "bin" in kinds else set()
        dcps = set(dcp_fmt.dcp_steps_on_disk(self.run_dir)) if "dcp" in kinds else set()
        for step in sorted(bins | dcps, reverse=True):
            for kind in kinds:
                if step not in (dcps if kind == "dcp" else bins):
                    continue
                if kind == "dcp":  # shards are hashed before loading (DCP reads them unhashed)
                    g: Any = dcp_fmt.check_dcp(self.run_dir, step, deep=True, require_signature=req, hmac_key=key)
                else:  # shallow: load() hashes the .bin while reading it
                    g = store.check(step, deep=False)
                if not g.valid:
                    what = ".dcp generation" if kind == "dcp" else "generation"
                    msg = f"skipping {what} {step}: {g.reason}"
                    warnings.warn(msg, CheckpointWarning, stacklevel=3)
                    self.history.event("skipped_generation", reason=msg)
                    if os.path.lexists(g.marker):
                        self._skipped_committed.append(msg)
                    continue
                if kind != kinds[0]:
                    msg = (f"resuming {_gen_path(g).name}, a {kind} generation written by another mode than this "
                           f"{'sharded (FSDP2)' if kinds[0] == 'dcp' else 'DDP'} run (it writes {kinds[0]} generations)")
                    warnings.warn(msg, OtherModeWarning, stacklevel=3)
                    self.history.event("other_mode_generation", step=step, kind=kind, reason=msg)
                yield g

    def _choose_path(self, from_path: str | Path) -> tuple[Any, CheckpointStore | None, Path | None]:
        """(generation, store to load it from, foreign .bin) for an explicit ``--resume`` path."""
        src = Path(from_path)
        dstep = dcp_fmt.parse_dcp_name(src.name)
        if dstep is not None:
            gen = dcp_fmt.check_dcp(src.parent, dstep, deep=True)
            if not gen.valid:
                raise IntegrityError(f"cannot resume from .dcp generation {dstep}: {gen.reason}", file=src,
                                     hint="check it with `sha256sum -c` from its folder")
            return gen, None, None
        step = parse_bin_name(src.name)
        if step is None:
            raise BadInput("--resume needs a step_NNNNNN.bin or a step_NNNNNN.dcp folder", file=src,
                           expected="step_NNNNNN.bin or step_NNNNNN.dcp", found=src.name)
        companion = src.with_suffix(".json")
        if not os.path.lexists(companion):
            if self.store.require_signature or auth.require_signature_from_env():
                raise auth.unsigned_error("a .bin without companion", src,
                                          "no companion, no commit marker and no signature (.bin.hmac)")
            return None, None, src
        reader = CheckpointStore(src.parent, writer=False)
        gen = reader.check(step, deep=False)
        if not gen.valid:
            raise IntegrityError(f"cannot resume from generation {step}: {gen.reason}", file=src,
                                 hint="`ripresa inspect` shows the valid generations")
        return gen, reader, None

    def _choose(self, from_path: str | Path | None) -> tuple[Any, CheckpointStore | None, Path | None]:
        """(generation, store to load it from, foreign .bin) for ``from_path`` or the run folder."""
        if from_path is not None:
            return self._choose_path(from_path)
        gen = next(iter(self._candidates()), None)
        if gen is None:
            self._refuse_if_only_damaged()
        return gen, self.store, None

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

    def _read_dcp_rest(self, gen: dcp_fmt.DcpGeneration, n: int) -> dict[str, Any]:
        """The companion state of a ``.dcp`` generation (everything DCP does not hold)."""
        doc = dcp_fmt.read_dcp_companion(gen.path, gen.files.get(dcp_fmt.COMPANION_NAME))
        if doc["n_params"] != n:
            raise IntegrityError("the .dcp generation holds another number of parameters than the model",
                                 file=gen.path, expected=n, found=doc["n_params"], hint="build the model from the run's config.json")
        rest = dcp_fmt.decode_state(doc, gen.path)
        _saved_record(rest, gen.companion)
        return rest

    def _resume_dist(self, from_path: str | Path | None, restore_rng: bool) -> int:
        d = self.dist
        assert d is not None
        n = sum(p.numel() for p in self.state.model.parameters())
        choice: Any = None
        error: str | None = None
        raised: BaseException | None = None
        if d.is_main:
            try:
                gen, _store, foreign = self._choose(from_path)
                choice = ("foreign", foreign) if foreign is not None else None if gen is None else ("gen", gen)
            except Exception as exc:  # every rank must learn it, or they would wait forever
                raised, error = exc, f"{type(exc).__name__}: {exc}"
        choice, error = d.broadcast((choice, error))
        if raised is not None:
            raise raised
        if error is not None:
            raise BadInput(f"rank 0 could not choose a generation to resume: {error}", file=self.run_dir)
        if choice is None:
            self.history.event("start", step=0, rng_restored=restore_rng, world_size=d.world_size)
            self._write_config()
            return 0
        if choice[0] == "foreign":
            if d.sharded:
                raise BadInput("a foreign .bin (no companion) cannot be resumed into a sharded model", file=choice[1],
                               hint="resume it in one process or with DDP, then continue from the generation it writes")
            return self._resume_foreign(choice[1], n)
        gen = choice[1]
        if isinstance(gen, dcp_fmt.DcpGeneration):
            rest = self._read_dcp_rest(gen, n)
            rest, fresh, saved_world = rank_view(rest, d.rank)
            _validate_rest(self.state, rest, self.allow)
            dcp_fmt.load_shards(self.state.model, self.state.optimizer, gen.path, no_dist=not d.sharded)
            self.progress = _restore_rest(self.state, rest, restore_rng and not fresh, self.allow)
            saved_extra = rest.get("extra", {})
        else:
            reader = CheckpointStore(gen.bin.parent, writer=False)
            contents, comp = reader.load(gen.step, expected_n=n)
            full = join_state(self.state, contents, comp)
            full, fresh, saved_world = rank_view(full, d.rank)
            if d.sharded:
                _validate_rest(self.state, full, self.allow)
                dcp_fmt.load_full_into(self.state.model, self.state.optimizer, full)
                self.progress = _restore_rest(self.state, full, restore_rng and not fresh, self.allow)
            else:
                self.progress = self.state.restore(full, restore_rng=restore_rng and not fresh, **self.allow)
            saved_extra = full.get("extra", {})
        self.resumed_from = gen
        self.fresh_streams = fresh
        self.last_saved_step = gen.step if from_path is None else None
        self._captured_step = self.last_saved_step
        self.history.event("resume", from_step=gen.step, file=str(_gen_path(gen)), rng_restored=restore_rng,
                           world_size=d.world_size, lineage=self.state.lineage[-1] if self.state.lineage else None)
        self._note_world_change(saved_extra, world_size=d.world_size, fresh=fresh)
        self._write_config()
        return self.progress.step

    def _note_world_change(self, saved_extra: Mapping[str, Any], *, world_size: int, fresh: bool) -> None:
        """Record a resume on another number of ranks than the save's (history event, :attr:`world_change`)."""
        rec = _saved_record({"extra": saved_extra}, None)
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

    def _resume_foreign(self, src: Path, n: int) -> int:
        contents = read_bin(src, expected_n=n)
        if self.state.optimizer is None:
            raise BadInput("a foreign .bin needs an AdamW optimizer to load m and v", file=src)
        notes = load_into_model_and_adamw(contents, self.state.model, self.state.optimizer)
        lacks = describe_missing(src)
        msg = (f"{src} has no companion: weights, m and v restored at step {contents.step}; data order and random "
               "streams start fresh, so this resume is only bit-equivalent modulo data randomness")
        warnings.warn(msg, ForeignCheckpointWarning, stacklevel=3)
        self.progress = Progress(step=contents.step)
        self.history.event("resume", from_step=contents.step, file=str(src), foreign=True, lacks=lacks, notes=notes)
        self._write_config()
        return contents.step

    def _write_config(self) -> None:
        if self.dist is not None and not self.dist.is_main:
            return
        write_atomic(self.run_dir / "config.json", [json.dumps(self.state.config, indent=2, default=str).encode() + b"\n"])

    # ------------------------------------------------------------------ each step
    def step_done(self, step: int, **metrics: Any) -> bool:
        """Record step ``step`` (just completed) and act on cadence and signals.

        Metrics go to the history line (``loss``, ``lr``, ``arm``, ...);
        ``tokens`` and ``samples`` also advance the progress counters and
        ``epoch`` sets it. Returns True when the loop must stop (a stop signal
        was handled: the checkpoint is committed).
        """
        p = self.progress
        p.step = int(step)
        if "tokens" in metrics:
            p.tokens_seen += int(metrics["tokens"])
        if "samples" in metrics:
            p.samples_seen += int(metrics["samples"])
        if "epoch" in metrics:
            p.epoch = int(metrics["epoch"])
        self.history.step(step, **metrics)
        self._collect(block=False)
        who: dict[str, Any] = {}
        if self.dist is None:
            stop = self.signals.stop_requested
            asked = self.signals.take_checkpoint_request()
        else:
            # The agreement: a signal on any rank is a signal on every rank, at this step.
            stop_ranks, ask_ranks = self.dist.agree(self.signals.stop_requested, self.signals.take_checkpoint_request())
            stop, asked = bool(stop_ranks), bool(ask_ranks)
            who = {"ranks_stop": stop_ranks, "ranks_checkpoint": ask_ranks}
        if asked or stop:
            self.history.event("signal", step=step, signals=list(self.signals.received), action="stop" if stop else "checkpoint", **who)
            self.signals.received.clear()
        due = self.every > 0 and step % self.every == 0
        if due or asked or stop:
            self._save(step, "stop" if stop else "signal" if asked else "cadence", must_succeed=stop)
        if stop:
            if self.dist is None:
                self._collect(block=True, must_succeed=True)
            else:
                self._collect_all()
            return True
        return False

    def steps_to_next_checkpoint(self) -> int | None:
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

    def _save(self, step: int, reason: str, must_succeed: bool) -> None:
        if self.dist is not None:
            self._save_dist(step, reason, must_succeed)
            return
        if self.last_saved_step == step and self._pending is None:
            return  # this exact state is already committed
        t0 = time.perf_counter()
        try:
            self._submit_bin(step, reason, must_succeed, t0)
        except SaveFailed as exc:
            self._failed(step, exc, must_succeed)
            return
        for name, fn in self.sidecars.items():
            write_atomic(self.run_dir / name, [json.dumps(fn(), indent=1, allow_nan=True).encode() + b"\n"])
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)  # runs while the background writer writes

    def _submit_bin(self, step: int, reason: str, must_succeed: bool, t0: float, extra: dict[str, Any] | None = None) -> None:
        """Capture weights/m/v and the companion now; write them in the background, or commit them now."""
        arrays = bin_arrays(self.state)
        companion = companion_snapshot(self.state, self.progress, extra)
        if self.writer is not None:
            self._collect(block=True, must_succeed=must_succeed)
            self.writer.save(step, arrays, companion)
            self._pending = (step, reason, t0)
            self.save_stalls.append(time.perf_counter() - t0)
        else:
            gen = self.store.save(step, arrays, companion)
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
        self.history.event("checkpoint", step=gen.step, reason=reason, file=_gen_path(gen).name, bytes=gen.size,
                           seconds=round(seconds, 4))
        self.history.sync()

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
        if d.sharded:
            if not self._save_dcp(step, reason, must_succeed, extra, t0):
                return
        elif d.is_main:
            try:
                self._submit_bin(step, reason, must_succeed, t0, extra)
            except SaveFailed as exc:
                if must_succeed:
                    self._deferred_error = exc  # raised by _collect_all, after every rank has been told
                    self.failed_saves += 1
                    self.history.event("checkpoint_failed", step=step, error=exc.message, found=str(exc.found)[:200])
                else:
                    self._failed(step, exc, must_succeed)
                return
        if d.is_main:
            for name, fn in self.sidecars.items():
                write_atomic(self.run_dir / name, [json.dumps(fn(), indent=1, allow_nan=True).encode() + b"\n"])
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)  # on every rank: a sharded model's forward is collective

    def _save_dcp(self, step: int, reason: str, must_succeed: bool, extra: dict[str, Any] | None, t0: float) -> bool:
        """FSDP2: every rank writes its shards, a barrier, then rank 0 commits (companion, rename, marker)."""
        d = self.dist
        assert d is not None
        part = dcp_fmt.partial_path(self.run_dir, step)
        if d.is_main and part.exists():
            shutil.rmtree(part, ignore_errors=True)
        d.barrier()
        error: str | None = None
        try:
            dcp_fmt.save_shards(self.state.model, self.state.optimizer, part)
        except Exception as exc:  # DCP reports a failure on every rank
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        fault_point("after_shards", step, d.rank)
        d.barrier()  # every rank has finished its part: only now may the generation count
        gen = None
        if d.is_main and error is None:
            try:
                rest = _rest_proxy(self.state).snapshot(self.progress, extra, include_parameters=False)
                n = sum(p.numel() for p in self.state.model.parameters())
                gen = dcp_fmt.commit_dcp(self.run_dir, step, part, world_size=d.world_size, n_params=n, state=rest,
                                         hmac_key=self.store.hmac_key)
                self._dcp_retention(step)
            except (RipresaError, OSError) as exc:
                error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        error = d.broadcast(error)
        if error is not None:
            if d.is_main:
                shutil.rmtree(part, ignore_errors=True)
            self._failed(step, SaveFailed(f"sharded save of step {step} failed: {error}", file=part,
                                          hint="the previous generation is intact"), must_succeed)
            return False
        self.save_stalls.append(time.perf_counter() - t0)
        if d.is_main:
            self._committed(gen, reason, time.perf_counter() - t0)
        return True

    def _dcp_retention(self, newest: int) -> list[int]:
        """Rank 0: delete the ``.dcp`` generations the policy drops (never the newest valid)."""
        valid = [g.step for g in dcp_fmt.dcp_generations(self.run_dir) if g.valid]
        doomed = plan_deletions(valid, self.retention, newest_valid=newest)
        for step in doomed:
            dcp_fmt.delete_dcp(self.run_dir, step)
        return doomed

    def _collect_all(self) -> None:
        """Distributed: rank 0 finishes its in-flight write; every rank learns whether it committed."""
        d = self.dist
        assert d is not None
        err: SaveFailed | None = None
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
    def close(self, *, final_save: bool = False) -> None:
        """Finish the in-flight save (and optionally save the last step), release the folder."""
        try:
            if self.dist is not None:
                self._collect_all()
                if final_save:
                    self._save(self.progress.step, "final", must_succeed=True)
                    self._collect_all()
            else:
                self._collect(block=True, must_succeed=True)
                if final_save and self.last_saved_step != self.progress.step:
                    self._save(self.progress.step, "final", must_succeed=True)
                    self._collect(block=True, must_succeed=True)
        finally:
            try:
                self.history.sync()
            except OSError:
                pass
            self.history.close()
            self.signals.uninstall()
            self.store.close()

    def abort(self) -> None:
        """Release the folder on an error path: no collective, no new save.

        An in-flight background write is let finish (a generation is never
        left half-written by choice); its failure, if any, is not raised.
        """
        try:
            if self.writer is not None and self._pending is not None:
                self.writer.wait()
        except Exception:
            pass
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



# ---------------------------------------------------------------------- helpers
def _gen_path(gen: Any) -> Path:
    """The main file of a generation: the ``.bin`` or the ``.dcp`` folder."""
    return gen.path if isinstance(gen, dcp_fmt.DcpGeneration) else gen.bin


def rank_view(full: Mapping[str, Any], rank: int) -> tuple[dict[str, Any], bool, int]:
    """This rank's view of a saved state: ``(state, fresh, saved world size)``.

    The companion's top-level random streams, data position and objects are
    rank 0's; ``extra.distributed.ranks[r]`` holds rank ``r``'s. A rank the
    saved run did not have keeps rank 0's data position and objects and is
    ``fresh``: its random streams are not restored.
    """
    out = dict(full)
    rec = _saved_record(full, None)
    saved_world = int(rec["world_size"]) if rec else 1
    if rank >= saved_world:
        return out, True, saved_world
    if rec:
        entry = rec["ranks"][rank]
        if int(entry["rank"]) != rank:
            raise IntegrityError("per-rank entries are out of order in the companion", expected=rank, found=entry["rank"])
        out["rng"], out["data"], out["objects"] = entry["rng"], entry["data"], entry["objects"]
    return out, False, saved_world


def _saved_record(full: Mapping[str, Any], file: Any) -> dict[str, Any] | None:
    """``extra.distributed`` of a saved state, validated (counts against the list it holds) before any use."""
    extra = full.get("extra")
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        raise IntegrityError("the saved state's 'extra' is not a dict", file=file, found=type(extra).__name__)
    return check_distributed_record(extra.get("distributed"), file=file)


def _rest_proxy(state: TrainingState) -> TrainingState:
    """The state without model and optimizer (restored by DCP or set_state_dict), sharing every other object."""
    proxy = copy.copy(state)
    proxy.model = torch.nn.Module()
    proxy.optimizer = None
    return proxy


def _strip(rest: Mapping[str, Any]) -> dict[str, Any]:
    r = dict(rest)
    r["model"] = {}
    r["optimizer"] = None
    return r


def _validate_rest(state: TrainingState, rest: Mapping[str, Any], allow: Mapping[str, bool]) -> None:
    """Refuse, before anything is changed, what :meth:`TrainingState.restore` would refuse."""
    proxy = _rest_proxy(state)
    r = _strip(rest)
    proxy.check_structure(r)
    changes = proxy.identity_changes(r)
    refused = {k: v for k, v in changes.items()
               if (k.startswith("versions.") and not allow["allow_version_change"])
               or (k.startswith("code.") and not allow["allow_code_change"])
               or (k == "data_identity" and not allow["allow_data_change"])}
    if refused:
        flags = sorted({"--allow-version-change" if k.startswith("versions.") else "--allow-code-change"
                        if k.startswith("code.") else "--allow-data-change" for k in refused})
        raise IdentityMismatch("the checkpoint was written by different versions, code or data",
                               expected={k: v["saved"] for k, v in refused.items()},
                               found={k: v["now"] for k, v in refused.items()},
                               hint=f"an exact resume needs the same; to accept the change knowingly pass {' '.join(flags)} (it is recorded)")


def _restore_rest(state: TrainingState, rest: Mapping[str, Any], restore_rng: bool, allow: Mapping[str, bool]) -> Progress:
    """Scheduler, scaler, data, objects, then the random streams last (model and optimizer are loaded)."""
    proxy = _rest_proxy(state)
    progress = proxy.restore(_strip(rest), restore_rng=restore_rng, **allow)
    state.lineage = proxy.lineage
    return progress
