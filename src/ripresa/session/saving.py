"""Save pipelines: how one step's state becomes a committed generation (docs/ARCHITECTURE.md, "One save").

The :class:`~ripresa.Checkpointer` picks one when it is built, as it picks its backend:
:class:`LocalPipeline` (one process), :class:`RankZeroPipeline` (DDP: rank 0 commits every
rank's part), :class:`CollectivePipeline` (FSDP2: every rank writes its shards, rank 0
commits); the asynchronous collective one is ``session/sharded_async.py``. A pipeline reports
to its session through :class:`SaveHooks` only. Call order, on every rank: :meth:`save` at a
save point, :meth:`collect` at each step boundary, :meth:`finish` to wait for the commit (a
stop, ``save_now``, the close), :meth:`drain` on an error path, :meth:`close` at the end. Where
the ``on_staged`` hook runs (the writer's thread, or the loop): docs/API.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState, tensor_tree_clone
from ..errors import RipresaError, SaveFailed
from ..store.async_save import AsyncCheckpointWriter
from ..store.backend import StorageBackend
from ..store.store import Generation
from .distributed import DistContext, fault_point

__all__ = ["CollectivePipeline", "LocalPipeline", "RankZeroPipeline", "SaveHooks"]


@dataclass(frozen=True)
class SaveHooks:
    """The session's accounting of a save (history, cadence, deadline, mirror), called by the pipeline.

    ``committed(generation, reason, seconds)``; ``failed(step, error, must_succeed)``
    counts and records a failure, then raises it or warns; ``failed_quietly(step,
    error)`` counts and records one that the pipeline raises later, on every rank.
    ``staged(step, weights)`` is the user's ``on_staged`` hook (None: none), and
    ``staged_failed(step, error)`` reports what it raised, on the loop's thread.
    """

    committed: Callable[[Generation, str, float], None]
    failed: Callable[[int, SaveFailed, bool], None]
    failed_quietly: Callable[[int, SaveFailed], None]
    staged: Callable[[int, Mapping[str, torch.Tensor]], Any] | None = None
    staged_failed: Callable[[int, BaseException], None] | None = None


def live_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: detached live parameter}``: what ``on_staged`` gets when it runs on the loop."""
    return {name: p.detach() for name, p in model.named_parameters()}


def staged_weights(backend: StorageBackend, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a background capture staged, by parameter name; else a copy of the live ones, taken now.

    The backend's ``staged_model()`` (views of its staged copy), when it has one and it
    returns a mapping; otherwise a clone of every parameter on the loop's thread (a
    longer stall, never a wrong sample).
    """
    get = getattr(backend, "staged_model", None)
    weights = get() if callable(get) else None
    if weights is None:
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return weights


class LocalPipeline:
    """One process: capture the state at the step boundary, commit it now or in the background writer."""

    #: This rank writes the run folder's files beside a generation (sidecars).
    main = True

    def __init__(self, backend: StorageBackend, state: TrainingState, progress: Callable[[], Progress],
                 writer: AsyncCheckpointWriter | None, hooks: SaveHooks, stalls: list[float], run_dir: Path) -> None:
        self.backend, self.state, self.progress, self.writer = backend, state, progress, writer
        self.hooks, self.stalls, self.run_dir = hooks, stalls, run_dir
        self.pending: tuple[int, str, float] | None = None  # (step, reason, t0) of the in-flight save
        self.saved_step: int | None = None  # the step of the last committed (or resumed) generation
        self.last_gen: Generation | None = None
        #: What every generation of the session records beside the state (``extra``; e.g. the invariant mode).
        self.extra: dict[str, Any] = {}

    def resumed(self, step: int | None) -> None:
        """The resumed generation's step counts as saved (None: nothing of this run was)."""
        self.saved_step = step

    def holds(self, step: int) -> bool:
        """True when generation ``step`` is committed and nothing is in flight: a save of it would write nothing new."""
        return self.saved_step == step and self.pending is None

    def save(self, step: int, reason: str, must_succeed: bool) -> bool:
        """Save ``step``; False when nothing was handed over (already saved, or failed: already reported)."""
        if self.holds(step):
            return False  # this exact state is already committed
        t0 = time.perf_counter()
        try:
            self.submit(step, reason, must_succeed, t0, dict(self.extra) or None)
        except SaveFailed as exc:
            self.fail(step, exc, must_succeed)
            return False
        return True

    def submit(self, step: int, reason: str, must_succeed: bool, t0: float, extra: dict[str, Any] | None = None) -> None:
        """Capture the state now through the writing backend; commit it in the background, or now."""
        if self.writer is not None:
            self.collect(block=True, must_succeed=must_succeed)
            write = self.backend.capture(step, self.state, self.progress(), extra, stage=self.writer.stage)
            self.writer.submit(step, write, after=self.staged_call(step))
            self.pending = (step, reason, t0)
            self.stalls.append(time.perf_counter() - t0)
        else:
            gen = self.backend.capture(step, self.state, self.progress(), extra)()
            self.stalls.append(time.perf_counter() - t0)
            self.commit(gen, reason, time.perf_counter() - t0)

    def collect(self, *, block: bool, must_succeed: bool = False) -> Generation | None:
        """Account for a finished (or, with ``block``, the in-flight) background save."""
        if self.writer is None or self.pending is None:
            return None
        if not block and self.writer.in_flight:
            return None
        step, reason, t0 = self.pending
        self.pending = None
        try:
            gen = self.writer.wait()
        except SaveFailed as exc:
            self.fail(step, exc, must_succeed)
            return None
        if gen is not None:
            self.commit(gen, reason, self.writer.last_write_s)
        self.report_staged_errors()
        return gen

    def staged_call(self, step: int) -> Callable[[], Any] | None:
        """The writer's ``after``: the ``on_staged`` hook with the weights just staged (None without a hook)."""
        hook = self.hooks.staged
        if hook is None:
            return None
        weights = staged_weights(self.backend, self.state.model)
        return lambda: hook(step, weights)

    def staged_on_loop(self, step: int) -> None:
        """After a save was handed over: the ``on_staged`` hook here, with the live weights, when no writer runs it.

        A synchronous session (the generation is committed: the live weights are its weights).
        """
        if self.hooks.staged is not None and self.writer is None:
            self.run_staged(step, live_weights(self.state.model))

    def run_staged(self, step: int, weights: Mapping[str, torch.Tensor]) -> None:
        """The hook on this thread; what it raises is reported, never raised (training and the save go on)."""
        assert self.hooks.staged is not None
        try:
            self.hooks.staged(step, weights)
        except Exception as exc:
            self.report_staged(step, exc)

    def report_staged_errors(self) -> None:
        """Report what the hook raised on the writer's thread (after a wait: it has finished)."""
        if self.writer is None:
            return
        errors, self.writer.after_errors = self.writer.after_errors, []
        for step, exc in errors:
            self.report_staged(step, exc)

    def report_staged(self, step: int, exc: BaseException) -> None:
        if self.hooks.staged_failed is not None:
            self.hooks.staged_failed(step, exc)

    def finish(self) -> Generation | None:
        """Wait for the in-flight save; a failure raises. The generation it committed, if any."""
        return self.collect(block=True, must_succeed=True)

    def drain(self) -> None:
        """An error path: let the in-flight background write (and its ``on_staged`` call) finish; its failure is
        the caller's to ignore."""
        if self.writer is not None and self.pending is not None:
            self.writer.wait()

    def close(self) -> None:
        """Release what the pipeline holds (nothing in one process)."""

    def commit(self, gen: Generation, reason: str, seconds: float) -> None:
        self.saved_step = gen.step
        self.last_gen = gen
        self.hooks.committed(gen, reason, seconds)

    def fail(self, step: int, exc: SaveFailed, must_succeed: bool) -> None:
        self.hooks.failed(step, exc, must_succeed)


class RankZeroPipeline(LocalPipeline):
    """DDP: every rank hands over its own part (random streams, data position, objects); rank 0 commits.

    Every rank calls every method, in the same order (the collectives). A stop save that fails on
    rank 0 is raised by :meth:`finish` on every rank, after each has been told.
    """

    def __init__(self, backend: StorageBackend, state: TrainingState, progress: Callable[[], Progress],
                 writer: AsyncCheckpointWriter | None, hooks: SaveHooks, stalls: list[float], run_dir: Path,
                 dist: DistContext, shards: Any = None) -> None:
        super().__init__(backend, state, progress, writer, hooks, stalls, run_dir)
        self.dist = dist
        self.main = dist.is_main  # this rank writes the generation (rank 0; every node's leader on node-local folders)
        #: every node's leader writes a whole copy into its own folder (DDP on node-local folders, docs/DISTRIBUTED.md)
        self.replicas = False
        self.shards = shards  # FSDP2, asynchronous: every rank's background DCP writes (a sharded_async.ShardedWriter)
        self.captured: int | None = None  # the step whose state every rank handed over last
        self.deferred: SaveFailed | None = None  # a stop-save failure, raised on every rank by finish()

    def resumed(self, step: int | None) -> None:
        self.captured = step

    def holds(self, step: int) -> bool:
        return False  # rank 0 decides inside save(), so that every rank takes the same path

    def save(self, step: int, reason: str, must_succeed: bool) -> bool:
        d = self.dist
        if d.broadcast(self.captured == step):  # rank 0 decides, so every rank takes the same path
            return False
        t0 = time.perf_counter()
        entry = self.rank_entry()
        fault_point("before_gather", step, d.rank)
        entries = d.all_gather(entry) if self.replicas else d.gather(entry)  # every rank has handed over its part
        self.captured = step
        extra = {"distributed": {**d.describe(), "ranks": entries}, **self.extra} if self.main else None
        return self.write(step, reason, must_succeed, extra, t0)

    def staged_on_loop(self, step: int) -> None:
        """DDP: rank 0 alone (it holds the whole, replicated model; the other ranks stage nothing)."""
        if self.main:
            super().staged_on_loop(step)

    def rank_entry(self) -> dict[str, Any]:
        """This rank's own state, captured now: random streams, data position, user objects."""
        s = self.state
        return {
            "rank": self.dist.rank,
            "rng": s.rng.state_dict(),
            "data": tensor_tree_clone(s.data.state_dict()) if s.data is not None else None,
            "objects": {n: tensor_tree_clone(o.state_dict()) for n, o in s.objects.items()},
        }

    def write(self, step: int, reason: str, must_succeed: bool, extra: dict[str, Any] | None, t0: float) -> bool:
        """Rank 0 commits the whole state with every rank's entry; the other ranks are done."""
        if not self.main:
            return True
        try:
            self.submit(step, reason, must_succeed, t0, extra)
        except SaveFailed as exc:
            if must_succeed:
                self.deferred = exc  # raised by finish(), after every rank has been told
                self.hooks.failed_quietly(step, exc)
            else:
                self.fail(step, exc, must_succeed)
            return False
        return True

    def finish(self) -> Generation | None:
        """Rank 0 finishes its in-flight write; every rank learns whether it committed (rank 0 gets the generation)."""
        d = self.dist
        err: SaveFailed | None = None
        if self.shards is not None:
            self.shards.wait()  # this rank's write; a failure anywhere fails rank 0's commit, broadcast below
        if self.main:
            err, self.deferred = self.deferred, None
            if err is None:
                try:
                    self.collect(block=True, must_succeed=True)
                except SaveFailed as exc:
                    err = exc
        if self.replicas:
            msgs = [m for m in d.all_gather(None if err is None else err.message) if m]
            msg = "; ".join(msgs)[:600] or None
        else:
            msg = d.broadcast(None if err is None else err.message)
        if err is not None:
            raise err
        if msg is not None:
            raise SaveFailed(f"rank 0 could not commit the checkpoint: {msg}", hint="the previous generation is intact")
        return self.last_gen if self.main else None

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()  # its gloo save group ends now, not at interpreter exit

    def fail(self, step: int, exc: SaveFailed, must_succeed: bool) -> None:
        if self.captured == step:
            self.captured = None  # a later request for this step saves it again
        self.hooks.failed(step, exc, must_succeed)


class CollectivePipeline(RankZeroPipeline):
    """FSDP2: rank 0 prepares, every rank writes its part (its shards), a barrier, then rank 0 commits."""

    def staged_on_loop(self, step: int) -> None:
        """FSDP2: on every rank, on the loop, with the live (sharded) parameters: a sharded forward is collective."""
        if self.hooks.staged is not None:
            self.run_staged(step, live_weights(self.state.model))

    def write(self, step: int, reason: str, must_succeed: bool, extra: dict[str, Any] | None, t0: float) -> bool:
        d = self.dist
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
                gen = self.backend.capture(step, self.state, self.progress(), extra, world_size=d.world_size)()
            except (RipresaError, OSError) as exc:
                error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        error = d.broadcast(error)
        if error is not None:
            if d.is_main:
                self.backend.abandon(step)
            self.fail(step, SaveFailed(f"sharded save of step {step} failed: {error}", file=self.run_dir,
                                       hint="the previous generation is intact"), must_succeed)
            return False
        self.stalls.append(time.perf_counter() - t0)
        if d.is_main:
            self.commit(gen, reason, time.perf_counter() - t0)
        return True
