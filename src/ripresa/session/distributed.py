"""Distributed runs: who writes what, and how every rank agrees.

A :class:`~ripresa.Checkpointer` inside an initialised process group (DDP or
FSDP2 under ``torchrun``) coordinates its ranks through a :class:`DistContext`:
one ``all_reduce`` per step boundary so a signal to any rank makes every rank
save the same step; rank 0 writes DDP generations, every rank writes its FSDP2
shards; only rank 0 holds the lock and the history. The rules, resharding on a
different world size and the fault hook points: docs/ARCHITECTURE.md,
"Distributed runs".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch

from ..core.schema import MAX_WORLD_SIZE, check_distributed_record  # noqa: F401 (re-exported)
from ..errors import BadInput

__all__ = [
    "DistContext",
    "NullHistory",
    "exit_rank",
    "fault_point",
    "init_from_env",
    "is_sharded",
    "leave",
    "rank_generator",
    "rank_seed",
    "torchrun_env",
    "WORLD_CHANGE_NOTE",
    "INVARIANT_CHANGE_NOTE",
]

#: What a world-size change does to the data order, written into the history event.
WORLD_CHANGE_NOTE = (
    "weights, m, v and shared state restored exactly; ranks below the saved world size restore their own "
    "random streams and data position, new ranks take rank 0's data position and objects with fresh "
    "random streams derived from the run seed and their rank, entries of ranks that no longer exist are dropped; "
    "the global batch is now batch_size x world_size, so the data order and the trajectory differ from a "
    "run that kept the saved world size"
)
#: The same event of a run in world-size-invariant steps (docs/ARCHITECTURE.md, "World-size changes").
INVARIANT_CHANGE_NOTE = (
    "weights, m, v and shared state restored exactly; world-size-invariant steps: the global batch is the same "
    "G micro-batches, drawn by global sample index, each under streams of its own, summed in one fixed tree, "
    "so the trajectory is the one the saved world size would have followed, bit for bit"
)


def torchrun_env() -> dict[str, int] | None:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as set by ``torchrun``, or None outside it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        return {
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        }
    except ValueError as exc:
        raise BadInput("RANK/WORLD_SIZE/LOCAL_RANK are not integers", found=str(exc)) from None


def init_from_env(device_type: str, *, need_group: bool = False) -> bool:
    """Initialise the default process group from ``torchrun``'s environment.

    Returns True when a group is (now) initialised. Outside ``torchrun`` (no
    ``RANK``/``WORLD_SIZE``), or with ``WORLD_SIZE=1`` unless ``need_group``
    (FSDP2 needs a group even on one rank), nothing is initialised: a single
    process never creates a process group. Backend: nccl on CUDA, gloo on CPU.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    env = torchrun_env()
    if env is None or (env["world_size"] <= 1 and not need_group):
        return False
    if not dist.is_available():
        raise BadInput("torch.distributed is not available in this torch build", hint="install a torch with distributed support")
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise BadInput("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not",
                       expected="launch with torchrun", found={k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")})
    kwargs: dict[str, Any] = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun hosts the store and keeps it across `--max-restarts` attempts; a
        # restarted group that rendezvoused under the same keys read the dead
        # group's addresses (gloo "connectFullMesh ... Connection refused").
        # A prefix per attempt gives every attempt its own keys.
        from datetime import timedelta

        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env["world_size"],
                             is_master=False, timeout=timedelta(minutes=30))
        kwargs = {"store": dist.PrefixStore(f"ripresa/attempt_{attempt}", base), "rank": env["rank"],
                  "world_size": env["world_size"]}
    if device_type == "cuda":
        torch.cuda.set_device(env["local_rank"])
        dist.init_process_group("nccl", device_id=torch.device("cuda", env["local_rank"]), **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    global _CREATED_GROUP
    _CREATED_GROUP = True
    return True


_CREATED_GROUP = False  # init_from_env created this process's group: leave() exits through exit_rank()


def exit_rank(code: int) -> NoReturn:
    """Leave this rank with ``code`` without interpreter finalization (docs/ARCHITECTURE.md, "Distributed runs").

    A gloo rank can abort (SIGABRT, "terminate called without an active
    exception") in interpreter finalization, after a complete run and
    ``destroy_process_group()``: a ProcessGroupGloo worker thread that is
    still alive (any object, e.g. a DDP wrapper or a cached device mesh,
    keeps the group) drops its last finished collective, whose captured
    thread-local state holds a Python object; the decref waits for the GIL,
    the finalizing interpreter ends the thread with ``pthread_exit``, and the
    forced unwind through a ``noexcept`` destructor calls ``std::terminate``.
    Here, in the order of a normal exit: the group destroyed (if still
    initialised), the non-daemon threads joined, the ``atexit`` handlers run
    (logging's, the caller's), stdio flushed, then ``os._exit(code)``.
    Call it after ``Checkpointer.close`` (which makes every commit and the
    history durable) instead of ``destroy_process_group()`` and returning.
    """
    import atexit
    import sys
    import threading

    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def leave(code: int) -> int:
    """``ripresa``'s exit: :func:`exit_rank` in a rank whose group :func:`init_from_env` created, else ``code``."""
    if _CREATED_GROUP:
        exit_rank(code)
    return code


def is_sharded(model: torch.nn.Module) -> bool:
    """True when the model's parameters are DTensors (FSDP2 ``fully_shard``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def rank_seed(seed: int, rank: int) -> int:
    """A seed for rank ``rank`` derived from the run's ``seed`` (rank 0 keeps ``seed``)."""
    if rank == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(rank)]).generate_state(1, dtype=np.uint64)[0] >> 1)


def rank_generator(seed: int, rank: int) -> np.random.Generator:
    """A PCG64 stream for rank ``rank``: ``PCG64(seed)`` jumped ``rank`` times.

    Rank 0's stream is exactly ``PCG64(seed)`` (the single-process stream);
    each jump advances by ~2^127 draws, so ranks never overlap.
    """
    return np.random.Generator(np.random.PCG64(int(seed)).jumped(int(rank)))


#: Called as ``fault_hook(point, step, rank)`` by :func:`fault_point`; None (the
#: default) does nothing. A hook point for the tests' fault injector: it may
#: kill the process there to simulate a rank dying at that point of a save.
fault_hook: Callable[[str, int, int], None] | None = None


def fault_point(point: str, step: int, rank: int) -> None:
    """A named point of a distributed save (``before_gather``, ``after_shards``, ``shards_written``): calls :data:`fault_hook` if set."""
    hook = fault_hook
    if hook is not None:
        hook(point, step, rank)


class NullHistory:
    """The history of a rank other than 0: it writes nothing (rank 0 writes ``.loss.jsonl``)."""

    repaired_torn_line = False

    def append(self, record: dict[str, Any]) -> None:
        pass

    def step(self, step: int, **metrics: Any) -> None:
        pass

    def event(self, name: str, **fields: Any) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class DistContext:
    """The process group as the Checkpointer sees it."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    sharded: bool

    @classmethod
    def detect(cls, model: torch.nn.Module | None = None) -> DistContext | None:
        """The context of an initialised group, or None (a single process).

        A group of one rank with a replicated model is treated as a single
        process (its files are byte-compatible with one); with a sharded
        (FSDP2) model it is distributed, since the state lives in DTensors.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        sharded = model is not None and is_sharded(model)
        world = dist.get_world_size()
        if world <= 1 and not sharded:
            return None
        backend = str(dist.get_backend())
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(rank=dist.get_rank(), world_size=world, backend=backend, device=device, sharded=sharded)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (main thread only, same order on every rank) ---------------------
    def barrier(self) -> None:
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def agree(self, stop: bool, checkpoint: bool) -> tuple[list[int], list[int]]:
        """All-reduce (MAX) this rank's two flags; return the ranks that asked to stop / to checkpoint."""
        import torch.distributed as dist

        t = torch.zeros(2, self.world_size, dtype=torch.int32, device=self.device)
        t[0, self.rank] = int(bool(stop))
        t[1, self.rank] = int(bool(checkpoint))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flags = t.cpu()
        return ([r for r in range(self.world_size) if flags[0, r]], [r for r in range(self.world_size) if flags[1, r]])

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks (float64 sum / world size)."""
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / self.world_size

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (pickled; small objects only)."""
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.device if self.backend == "nccl" else None)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (a list indexed by rank); None elsewhere."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank (a list indexed by rank; pickled, small objects only)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def describe(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "backend": self.backend, "shard": "fsdp" if self.sharded else "ddp"}
