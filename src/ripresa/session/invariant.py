"""World-size-invariant steps: the same gradients, bit for bit, on 1, 2 or 4 ranks (docs/ARCHITECTURE.md).

A data-parallel step sums each rank's gradient with an all-reduce whose order of additions follows
the number of ranks, so a run resumed on another number of ranks leaves its uninterrupted
trajectory at the first step. :class:`InvariantSteps` cuts the global batch into ``G`` fixed
micro-batches (``G`` a multiple of every world size the run may use) and makes every quantity of
a step a function of the micro-batch index alone:

* rank ``r`` of ``W`` computes micro-batches ``r·G/W … (r+1)·G/W − 1``, each under random
  streams seeded from ``(seed, step, index)`` (dropout does not follow the rank);
* each micro-batch's gradient is kept apart, and the ``G`` gradients are summed in one fixed
  binary tree over the index — never by an all-reduce. When ``G`` and ``W`` are powers of two a
  rank's block is a subtree: the rank sums it locally and the ranks all-gather ``W`` partial
  sums; otherwise the ranks all-gather the ``G`` gradients and each sums the whole tree;
* the mean loss is the same tree over the ``G`` micro-batch losses.

Every rank then holds the same gradient, the mean over the global batch, whatever ``W`` is; the
optimizer's step follows on every rank. What breaks it is refused at start: BatchNorm (its
statistics follow the batch each rank sees), a model wrapped in DDP or FSDP (their own
reductions run in the backward).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import BadInput

__all__ = ["InvariantSteps", "tree_sum"]


def _split(lo: int, hi: int) -> int:
    """Where the fixed tree splits ``[lo, hi)``: the largest power of two below ``hi - lo`` from ``lo``."""
    n = hi - lo
    half = 1 << ((n - 1).bit_length() - 1)
    return lo + half


def tree_sum(parts: list[torch.Tensor], lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """The sum of ``parts[lo:hi]`` in the fixed binary tree over their indices (a new tensor)."""
    hi = len(parts) if hi is None else hi
    if hi - lo == 1:
        return parts[lo].clone()
    mid = _split(lo, hi)
    return tree_sum(parts, lo, mid).add_(tree_sum(parts, mid, hi))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _micro_seed(seed: int, step: int, index: int) -> int:
    raw = hashlib.sha256(f"ripresa.invariant:{int(seed)}:{int(step)}:{int(index)}".encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << 63) - 1)


def refuse_unsuited(model: torch.nn.Module) -> None:
    """BadInput naming what in ``model`` makes a step depend on the number of ranks."""
    from torch.nn.modules.batchnorm import _BatchNorm

    wrapped = type(model).__name__
    if wrapped in ("DistributedDataParallel", "FullyShardedDataParallel") or hasattr(model, "reshard"):
        raise BadInput("world-size-invariant steps sum the gradients themselves: the model must not be wrapped",
                       expected="the plain module (no DistributedDataParallel, no FSDP)", found=wrapped,
                       hint="pass the unwrapped model; the mode replaces the wrapper's all-reduce "
                            "(docs/ARCHITECTURE.md, \"World-size changes\")")
    for name, mod in model.named_modules():
        if isinstance(mod, _BatchNorm) and mod.training:
            raise BadInput("BatchNorm makes a step depend on how the batch is split across ranks",
                           found=f"{name or 'the model'}: {type(mod).__name__}",
                           expected="no batch statistics (LayerNorm, GroupNorm, or BatchNorm in eval mode)",
                           hint="replace it, or train without world_size_invariant "
                                "(docs/ARCHITECTURE.md, \"World-size changes\")")


class InvariantSteps:
    """One world-size-invariant optimizer step at a time: :meth:`indices`, :meth:`micro_batch`,
    :meth:`backward`, :meth:`reduce` (docs/ARCHITECTURE.md, "World-size changes")."""

    def __init__(self, model: torch.nn.Module, *, micro_batches: int, seed: int = 0, group: Any = None) -> None:
        import torch.distributed as dist

        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        refuse_unsuited(model)
        self.model, self.G, self.seed, self.group = model, micro_batches, int(seed), group
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0
        if self.G % self.world:
            raise BadInput("the micro-batches do not divide among the ranks", expected=f"a multiple of {self.world}",
                           found=f"micro_batches={self.G}",
                           hint="choose micro_batches as a multiple of every world size the run may use "
                                "(e.g. 8 for 1, 2, 4 or 8 ranks)")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.per_rank = self.G // self.world
        self._grads: dict[int, torch.Tensor] = {}
        self._losses: dict[int, float] = {}
        self._current: int | None = None
        self.bytes_sent = 0  # what this rank's collectives carried (the benchmark's communication bytes)

    def indices(self) -> range:
        """This rank's micro-batches of every step: a contiguous block of the ``G`` indices."""
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

    @contextlib.contextmanager
    def micro_batch(self, step: int, index: int) -> Iterator[None]:
        """Run micro-batch ``index`` of ``step`` under random streams of its own (CPU and every CUDA device);
        the process's streams are restored after it."""
        if index not in self.indices():
            raise ValueError(f"micro-batch {index} is not this rank's ({self.indices()})")
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_micro_seed(self.seed, step, index))
            self._current = index
            try:
                yield
            finally:
                self._current = None

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the current micro-batch's loss; its gradient is kept apart from the others'."""
        index = self._current
        if index is None:
            raise RuntimeError("backward() outside `with steps.micro_batch(step, index):`")
        for p in self.params:
            p.grad = None
        loss.backward()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        self._grads[index] = flat
        self._losses[index] = float(loss.detach())
        for p in self.params:
            p.grad = None

    def reduce(self) -> float:
        """Sum the step's micro-batch gradients in the fixed tree, divide by ``G``, set every parameter's
        ``.grad`` (the same bits on every rank, for any world size); return the step's mean loss."""
        mine = list(self.indices())
        if sorted(self._grads) != mine:
            raise RuntimeError(f"reduce() needs one backward per micro-batch of this rank: {mine}, got "
                               f"{sorted(self._grads)}")
        grads = [self._grads[i] for i in mine]
        losses = torch.tensor([self._losses[i] for i in mine], dtype=torch.float64)
        if _is_power_of_two(self.G) and _is_power_of_two(self.world):
            partial = tree_sum(grads)  # this rank's block is a subtree of the tree over the G indices
            parts = self._gather(partial)  # W partial sums, by rank: the tree's upper levels
            total = tree_sum(parts)
        else:
            stacked = self._gather(torch.stack(grads))  # every micro-batch's gradient, by index
            total = tree_sum([g for block in stacked for g in block.unbind(0)])
        all_losses = torch.cat(self._gather(losses))
        mean_loss = float(tree_sum(list(all_losses.unbind(0))) / self.G)
        total.div_(self.G)
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[off : off + n].view_as(p).to(p.dtype).clone()
            off += n
        self._grads.clear()
        self._losses.clear()
        return mean_loss

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.world == 1:
            return [t]
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        self.bytes_sent += t.numel() * t.element_size() * (self.world - 1)
        return out
