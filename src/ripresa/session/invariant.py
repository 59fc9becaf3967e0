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


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def refuse_unsuited(model: torch.nn.Module) -> None:
    """BadInput naming what in ``model`` makes a step depend on the number of ranks."""
    from torch.nn.modules.batchnorm import _BatchNorm

    wrapped = type(model).__name__
    if wrapped in ("DistributedDataParallel", "FullyShardedDataParallel") or (
            hasattr(model, "reshard") and not is_fsdp2(model)):
        raise BadInput("world-size-invariant steps sum the gradients themselves: the model must not be wrapped",
                       expected="the plain module, or one sharded by FSDP2's fully_shard (no DistributedDataParallel, "
                                "no FSDP1 wrapper)", found=wrapped,
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
    :meth:`backward`, :meth:`reduce` (docs/ARCHITECTURE.md, "World-size changes").

    ``exact=False`` keeps the same calls but reduces the ordinary way — each rank sums its own
    micro-batches in order, then one all-reduce (FSDP2: its own reduce-scatter, accumulated round
    after round) — the rank-count-dependent order of DDP: the negative control of ``ripresa verify``.
    """

    def __init__(self, model: torch.nn.Module, *, micro_batches: int, seed: int = 0, group: Any = None,
                 exact: bool = True) -> None:
        import torch.distributed as dist

        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        refuse_unsuited(model)
        self.model, self.G, self.seed, self.group, self.exact = model, micro_batches, int(seed), group, bool(exact)
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0
        if self.G % self.world:
            raise BadInput("the micro-batches do not divide among the ranks", expected=f"a multiple of {self.world}",
                           found=f"micro_batches={self.G}",
                           hint="choose micro_batches as a multiple of every world size the run may use "
                                "(e.g. 8 for 1, 2, 4 or 8 ranks)")
        #: FSDP2: rank r computes micro-batch j·W + r in round j; each round is reduce-scattered in the fixed tree.
        self.sharded = is_fsdp2(model)
        if self.sharded and not (_is_power_of_two(self.G) and _is_power_of_two(self.world)):
            raise BadInput("world-size-invariant FSDP2 steps need powers of two", expected="micro_batches and the "
                           "world size powers of two (1, 2, 4, 8, ...)", found=f"micro_batches={self.G}, "
                           f"world size {self.world}",
                           hint="each round of W micro-batches must be a subtree of the fixed tree "
                                "(docs/ARCHITECTURE.md, \"World-size changes\")")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.per_rank = self.G // self.world
        self._grads: dict[int, torch.Tensor] = {}  # the general path: every micro-batch's gradient, by index
        self._pending: list[tuple[int, torch.Tensor]] = []  # subtrees not yet merged: (leaves, sum)
        self._losses: dict[int, float] = {}
        self._current: int | None = None
        self._templates: list[Any] = []
        self.bytes_sent = 0  # what this rank's collectives carried (the benchmark's communication bytes)
        if self.sharded:
            self._install_reduce_scatter()

    # -- layout ---------------------------------------------------------------------------
    def indices(self) -> list[int]:
        """This rank's micro-batches of every step, in the order it runs them: a contiguous block of the ``G``
        indices (FSDP2: one per round, ``r, r+W, r+2W, ...``)."""
        if self.sharded:
            return [j * self.world + self.rank for j in range(self.per_rank)]
        return list(range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank))

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

    def backward(self, loss: torch.Tensor, *, scaler: Any = None) -> None:
        """Backward of the current micro-batch's loss (scaled by ``scaler``, a GradScaler, when given); its
        gradient is kept apart from the others'. The loss recorded for the step is the unscaled one."""
        index = self._current
        if index is None:
            raise RuntimeError("backward() outside `with steps.micro_batch(step, index):`")
        for p in self.params:
            p.grad = None
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if self.sharded:  # the round's reduce-scattered sum, this rank's shard of every parameter
            grads = [p.grad for p in self.params]
            self._templates = grads
            flat = torch.cat([(g.to_local() if g is not None else torch.zeros(0)).reshape(-1) for g in grads])
        else:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        self._keep(index, flat)
        self._losses[index] = float(loss.detach())
        for p in self.params:
            p.grad = None

    def _streams(self) -> bool:
        """Whether this rank's gradients can be summed as they come (a subtree, or the ordinary running sum)."""
        return not self.exact or self.sharded or (_is_power_of_two(self.G) and _is_power_of_two(self.world))

    def _keep(self, index: int, flat: torch.Tensor) -> None:
        """Hold micro-batch ``index``'s gradient: merged at once into the pending subtrees when this rank's block
        is a subtree (a binary counter: at most log2(G/W)+1 gradients held), else kept until :meth:`reduce`."""
        if not self._streams():
            self._grads[index] = flat
            return
        expected = self.indices()[len(self._losses)] if len(self._losses) < self.per_rank else None
        if index != expected:
            raise RuntimeError(f"micro-batch {index} out of order: run them in the order of indices() "
                               f"({self.indices()}), one backward each")
        if not self.exact:
            self._pending = [(1, flat if not self._pending else self._pending[0][1].add_(flat))]
            return
        self._pending.append((1, flat))
        while len(self._pending) >= 2 and self._pending[-1][0] == self._pending[-2][0]:
            (n, right), (_, left) = self._pending.pop(), self._pending.pop()
            self._pending.append((2 * n, left.add_(right)))  # the tree's node: left subtree + right subtree

    # -- the reduction -------------------------------------------------------------------
    def reduce(self) -> float:
        """Sum the step's micro-batch gradients in the fixed tree, divide by ``G``, set every parameter's
        ``.grad`` (the same bits on every rank, for any world size); return the step's mean loss."""
        mine = self.indices()
        if sorted(self._losses) != sorted(mine):
            raise RuntimeError(f"reduce() needs one backward per micro-batch of this rank: {mine}, got "
                               f"{sorted(self._losses)}")
        losses = torch.tensor([self._losses[i] for i in mine], dtype=torch.float64)
        if not self.exact:
            total = self._pending[0][1]
            if not self.sharded and self.world > 1:
                import torch.distributed as dist

                dist.all_reduce(total, group=self.group)  # the rank-count-dependent order of DDP
                self.bytes_sent += 2 * total.numel() * total.element_size() * (self.world - 1) // self.world
        elif not self._streams():
            stacked = self._gather(torch.stack([self._grads[i] for i in mine]))  # every micro-batch's, by index
            total = tree_sum([g for block in stacked for g in block.unbind(0)])
        elif self.sharded:  # round j's sum is the subtree over indices jW .. jW+W-1; the rounds: the upper levels
            total = self._pending[0][1]
        else:  # this rank's block is a subtree of the tree over the G indices; the W partial sums: the upper levels
            total = self._upper_levels(self._pending[0][1])
        gathered = self._gather(losses)
        if self.sharded:  # rank r's j-th loss is micro-batch j·W + r
            ordered = [gathered[r][j] for j in range(self.per_rank) for r in range(self.world)]
        else:
            ordered = [v for block in gathered for v in block.unbind(0)]
        mean_loss = float(tree_sum(ordered) / self.G)
        total.div_(self.G)
        self._assign(total)
        self._grads.clear()
        self._pending = []
        self._losses.clear()
        return mean_loss

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients set by :meth:`reduce` to a total 2-norm of ``max_norm``, the same bits for any
        world size; return the norm before clipping. Replicated: ``torch.nn.utils.clip_grad_norm_`` (every rank
        holds the whole gradient). FSDP2: the norm of the whole gradients, all-gathered (a norm summed over
        shards would follow the layout)."""
        if not self.sharded:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        norms = []
        for p in self.params:
            if p.grad is None:
                continue
            full = p.grad.full_tensor()
            self.bytes_sent += full.numel() * full.element_size() * (self.world - 1) // self.world
            norms.append(torch.linalg.vector_norm(full, 2.0, dtype=torch.float32))
        if not norms:
            return 0.0
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params:
            if p.grad is not None:
                p.grad.to_local().mul_(coef.to(p.grad.dtype))
        return float(total)

    def _assign(self, total: torch.Tensor) -> None:
        off = 0
        if self.sharded:
            for p, g in zip(self.params, self._templates, strict=True):
                if g is None:
                    continue
                local = g.to_local()
                n = local.numel()
                local.copy_(total[off: off + n].view_as(local))
                p.grad = g
                off += n
            return
        for p in self.params:
            n = p.numel()
            p.grad = total[off: off + n].view_as(p).to(p.dtype).clone()
            off += n

    def _upper_levels(self, partial: torch.Tensor) -> torch.Tensor:
        """The tree over the ranks' ``W`` partial sums, on every rank, with a ring all-reduce's bytes: the levels are
        elementwise, so each rank sums one ``1/W`` slice of all ``W`` (an all-to-all), then the slices are
        all-gathered — the very bits of the whole tree summed on every rank, ``2(W-1)/W`` of the gradient sent."""
        if self.world == 1:
            return partial
        import torch.distributed as dist

        n, w = partial.numel(), self.world
        k = -(-n // w)
        padded = partial if n == k * w else torch.cat([partial, partial.new_zeros(k * w - n)])
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded, group=self.group)  # chunk r: rank r's partial sum, my slice
        mine = tree_sum(list(received.view(w, k).unbind(0)))
        slices = [torch.empty_like(mine) for _ in range(w)]
        dist.all_gather(slices, mine, group=self.group)
        self.bytes_sent += 2 * k * (w - 1) * padded.element_size()
        return torch.cat(slices)[:n]

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.world == 1:
            return [t]
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        self.bytes_sent += t.numel() * t.element_size() * (self.world - 1)
        return out

    def _install_reduce_scatter(self) -> None:
        """Every FSDP2 unit sums its reduce-scatter without dividing, in the fixed tree over the ranks' indices."""
        from torch.distributed.fsdp import FSDPModule

        comm = _TreeReduceScatter(self)
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
                m.set_custom_reduce_scatter(comm)


def _reduce_scatter_base() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class _TreeReduceScatter(_reduce_scatter_base()):  # type: ignore[misc]
    """FSDP2's reduce-scatter as an all-to-all and a fixed-tree sum over the ranks (= micro-batch indices jW..jW+W-1);
    the backend's own reduce-scatter when the steps are not exact."""

    def __init__(self, steps: InvariantSteps) -> None:
        self.steps = steps

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        import torch.distributed as dist

        world = dist.get_world_size(group)
        if not self.steps.exact:  # the ordinary collective, in the order the backend picks for this many ranks
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(output_tensor, input_tensor, group=group)
            self.steps.bytes_sent += input_tensor.numel() * input_tensor.element_size() * (world - 1) // world
            return None
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        self.steps.bytes_sent += input_tensor.numel() * input_tensor.element_size() * (world - 1) // world
        output_tensor.copy_(tree_sum(list(received.view(world, -1).unbind(0))))
        return None


# ============================================================================ the session's side
#: ``extra["invariant"]`` of a generation saved in the mode (docs/FORMAT.md, "The generation's extra").
RECORD_KEYS = ("micro_batches", "seed")


def invariant_record(steps: InvariantSteps) -> dict[str, int]:
    """What a generation records of the mode: the number of micro-batches and their streams' seed (docs/ARCHITECTURE.md, "World-size changes")."""
    return {"micro_batches": steps.G, "seed": steps.seed}


def saved_invariant(extra: Any, *, file: Any = None) -> dict[str, int] | None:
    """``extra["invariant"]`` of a restored generation, checked (an :class:`~ripresa.errors.IntegrityError`
    naming ``file`` when malformed), or None when the generation was saved without the mode."""
    from ..errors import IntegrityError

    rec = extra.get("invariant") if isinstance(extra, dict) else None
    if rec is None:
        return None
    ok = (isinstance(rec, dict) and set(rec) == set(RECORD_KEYS)
          and type(rec["micro_batches"]) is int and 1 <= rec["micro_batches"] <= 2**20
          and type(rec["seed"]) is int and 0 <= rec["seed"] < 2**63)
    if not ok:
        raise IntegrityError("the saved world-size-invariant record (extra.invariant) is malformed", file=file,
                             expected="{micro_batches: int in 1..2**20, seed: int in 0..2**63-1}",
                             found=str(rec)[:160], hint="the companion was edited or damaged; this generation "
                                                        "cannot be trusted")
    return dict(rec)


def check_micro_batches(value: Any) -> int:
    """``world_size_invariant``: 0 (off) or the number of micro-batches ``G`` (a ValueError otherwise)."""
    if value is True:
        raise ValueError("world_size_invariant takes the number of micro-batches G of every step (a multiple of "
                         "every world size the run may use, e.g. 8), not True")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"world_size_invariant must be 0 (off) or the number of micro-batches, an int >= 1; got {value!r}")
    return value


def world_change_verdict(saved: dict[str, int] | None, steps: InvariantSteps | None) -> str | None:
    """None when a resume on another number of ranks keeps the trajectory exact; else why not, in words."""
    if steps is None:
        return "the run does not use world-size-invariant steps (Checkpointer(world_size_invariant=G))"
    if not steps.exact:
        return "world-size-invariant steps are switched off (ripresa verify's negative control)"
    if saved is None:
        return "the generation was saved without world-size-invariant steps"
    if saved["micro_batches"] != steps.G:
        return f"the generation was saved with {saved['micro_batches']} micro-batches per step, this run uses {steps.G}"
    return None


def fresh_seed() -> int:
    """The seed of a new run's micro-batch streams: what ``torch.manual_seed`` set (``torch.initial_seed()``)."""
    return int(torch.initial_seed()) & ((1 << 63) - 1)
