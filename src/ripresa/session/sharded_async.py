"""Asynchronous sharded (FSDP2) saves: every rank stages its shards at the step boundary and writes them in the background.

:class:`ShardedWriter` holds a rank's staging buffers, its gloo save group and its in-flight
``dcp.async_save``; :class:`AsyncCollectivePipeline` is the save pipeline over it
(``session/saving.py``). The commit rule is the synchronous one's: a ``.dcp`` generation counts
only once every rank's shards are durable, and rank 0 writes the marker last; a rank that fails
or dies during the write fails rank 0's commit. The steps: docs/ARCHITECTURE.md, "Distributed
runs"; the user's view: docs/SHARDED.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..errors import SaveFailed
from ..store.backend import StorageBackend
from .distributed import DistContext, fault_point
from .saving import CollectivePipeline


class ShardedWriter:
    """Every rank: its asynchronous DCP writes, one at a time, on a gloo group of their own."""

    def __init__(self, dist: DistContext) -> None:
        import torch.distributed as tdist

        from ..formats.dcp import ShardStager

        self.dist = dist
        self.group = tdist.new_group(backend="gloo")  # collective: every rank builds it, in the same order
        self.stager = ShardStager(pinned=dist.device.type == "cuda")
        self.future: Any = None

    def wait(self) -> str | None:
        """Finish this rank's in-flight write; its error (a message) or None."""
        fut, self.future = self.future, None
        if fut is None:
            return None
        try:
            fut.result()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        return None

    def close(self) -> None:
        """Finish the in-flight write, then destroy the save group and drop it (``Checkpointer.close``).

        The group's gloo worker threads end here, while the interpreter is
        alive, not at its finalization (docs/ARCHITECTURE.md, "Distributed
        runs", exit). Not a collective.
        """
        self.wait()
        group, self.group = self.group, None
        if group is not None:
            import torch.distributed as tdist

            if tdist.is_initialized():
                tdist.destroy_process_group(group)

    def all_errors(self, error: str | None) -> list[str]:
        """Every rank's ``error`` (None: fine), on every rank of the training group.

        One ``all_reduce`` of a flag per rank (the agreement, and the barrier
        after rank 0's ``prepare``); the messages are gathered only when a
        rank failed.
        """
        import torch
        import torch.distributed as tdist

        flags = torch.zeros(self.dist.world_size, dtype=torch.int32, device=self.dist.device)
        flags[self.dist.rank] = int(error is not None)
        tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
        if not int(flags.sum()):
            return []
        out: list[Any] = [None] * self.dist.world_size
        tdist.all_gather_object(out, error)
        return [f"rank {r}: {e}" for r, e in enumerate(out) if e is not None]


class AsyncCollectivePipeline(CollectivePipeline):
    """FSDP2, asynchronous: every rank stages its shards now and writes them in the background; rank 0 commits."""

    def write(self, step: int, reason: str, must_succeed: bool, extra: dict[str, Any] | None, t0: float) -> bool:
        """One asynchronous sharded save (every rank); False when it failed before the write started."""
        from ..formats import dcp as dcp_fmt

        d, sw = self.dist, self.shards
        assert sw is not None
        sw.wait()  # a failure of the previous write is rank 0's to record (its commit never ran)
        if d.is_main:
            self.collect(block=True, must_succeed=False)
            self.backend.prepare(step)  # before the agreement below: no rank writes before the stale partial is gone
        staged, error = None, None
        try:
            staged = sw.stager.stage(dcp_fmt.shard_state(self.state.model, self.state.optimizer))
        except Exception as exc:  # staging failed on this rank (memory): no rank may start writing
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        errors = sw.all_errors(error)
        if errors:
            if d.is_main:
                self.backend.abandon(step)
            self.fail(step, SaveFailed(f"sharded save of step {step} failed while staging: {'; '.join(errors)[:600]}",
                                       file=self.run_dir, hint="the previous generation is intact"), must_succeed)
            return False
        partial = dcp_fmt.partial_path(self.run_dir, step)
        sw.future = dcp_fmt.write_shards_async(staged, partial, group=sw.group,
                                               after_write=lambda: fault_point("shards_written", step, d.rank))
        if d.is_main:
            assert self.writer is not None
            commit = self.backend.capture(step, self.state, self.progress(), extra, world_size=d.world_size)
            self.writer.submit(step, _commit_after(self.backend, self.run_dir, step, sw.future, commit))
            self.pending = (step, reason, t0)
        self.stalls.append(time.perf_counter() - t0)
        return True


def _commit_after(backend: StorageBackend, run_dir: Path, step: int, future: Any, commit: Any) -> Any:
    """Rank 0's background write: wait until every rank's shards are durable, then commit."""

    def write() -> Any:
        try:
            future.result()
        except BaseException as exc:
            backend.abandon(step)
            raise SaveFailed(f"sharded save of step {step} failed: {type(exc).__name__}: {str(exc)[:400]}",
                             file=run_dir, hint="a rank failed or died while writing; the previous generation is intact") from None
        return commit()

    return write
