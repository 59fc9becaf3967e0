"""A byte-level GPT: the ANDREA model, nanoGPT style, in one readable file.

The vocabulary is the 256 byte values, the network GPT-2's (pre-LayerNorm blocks, GELU MLP), the
head untied, every parameter float32. Modules are registered in the ``model.parameters()`` order the
ANDREA ``.bin`` stores (:mod:`ripresa.formats.andrea_bin`): that order is part of the on-disk format.
:meth:`GPT.generate` draws only from the ``torch.Generator`` it is given, never the training RNG.
The contract, with the reasons: docs/ENGINE.md, "The model and its text".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

from ...core.numbers import checked_number
from ...errors import BadInput

# ---- configuration -------------------------------------------------------------


#: Upper bounds of a model shape read from a file (docs/FAULTS.md: bounds before allocations).
#: A config beyond them is refused before anything is built.
MAX_SHAPE = {"n_layer": 1024, "n_head": 1024, "n_embd": 65_536, "block_size": 1 << 20, "vocab_size": 1 << 20}
#: Most parameters a GPTConfig may describe: 2**31 (8 GiB of float32 weights, a 24 GiB .bin),
#: far above andrea-120m; counted arithmetically by :meth:`GPTConfig.param_count`.
MAX_PARAMS = 2**31


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. Frozen and validated: a config that builds is a valid one.

    Attributes:
        n_layer: transformer blocks.
        n_head: attention heads per block; ``n_embd % n_head == 0``.
        n_embd: width of the residual stream (channels).
        block_size: longest context in tokens (bytes); size of the position table.
        dropout: probability in ``[0, 1)`` on embeddings, attention weights and
            residual branches, during training only.
        bias: biases in the Linear layers and LayerNorms (GPT-2: True).
        vocab_size: 256 for raw bytes; smaller vocabularies cannot hold every byte.
    """

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    dropout: float = 0.0
    bias: bool = True
    vocab_size: int = 256

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            # bool is an int subclass: refuse True/False as a size.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadInput(f"GPTConfig.{name} must be a positive int", expected="int >= 1", found=repr(value)[:80])
            if value > MAX_SHAPE[name]:
                raise BadInput(f"GPTConfig.{name} is out of range", expected=f"1..{MAX_SHAPE[name]}", found=value,
                               hint="the config was edited or is not an ANDREA config")
        if self.n_embd % self.n_head:
            raise BadInput(
                "GPTConfig.n_embd must be a multiple of n_head",
                expected=f"n_embd % n_head == 0 (n_head={self.n_head})",
                found=f"n_embd={self.n_embd}",
                hint="each head gets n_embd // n_head channels",
            )
        if self.vocab_size < 256:
            raise BadInput(
                "GPTConfig.vocab_size is too small for byte-level text",
                expected=">= 256 (one token per byte value)",
                found=self.vocab_size,
            )
        dropout = checked_number(self.dropout, file=None, field="GPTConfig.dropout", lo=0.0, hi=1.0, integer=False,
                                 error=BadInput)
        if not dropout < 1.0:
            raise BadInput("GPTConfig.dropout out of range", expected="0 <= dropout < 1", found=self.dropout)
        if not isinstance(self.bias, bool):
            raise BadInput("GPTConfig.bias must be a bool", expected="true or false", found=repr(self.bias))
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.param_count() > MAX_PARAMS:
            raise BadInput("GPTConfig describes too large a model", expected=f"at most {MAX_PARAMS:,} parameters",
                           found=f"{self.param_count():,} parameters",
                           hint="refused before anything is allocated; check n_layer, n_embd, block_size, vocab_size")

    @property
    def head_size(self) -> int:
        """Channels per attention head."""
        return self.n_embd // self.n_head

    def param_count(self) -> int:
        """Number of parameters of ``GPT(self)``, computed without building it.

        Per block: two LayerNorms (``2d`` weights + ``2d`` biases), attention
        ``d x 3d`` + ``d x d``, MLP ``d x 4d`` + ``4d x d`` (``12 d^2``), plus
        ``3d + d + 4d + d`` Linear biases. Outside: ``V d`` token table,
        ``block_size d`` position table, final LayerNorm, ``d V`` head.
        """
        d, V, b = self.n_embd, self.vocab_size, int(self.bias)
        ln = d + b * d
        block = 2 * ln + 12 * d * d + b * (3 * d + d + 4 * d + d)
        return V * d + self.block_size * d + self.n_layer * block + ln + d * V

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (the ``config.json`` of a run); inverse of :func:`from_config_dict`."""
        return asdict(self)


def from_config_dict(d: Mapping[str, Any]) -> GPTConfig:
    """Build a :class:`GPTConfig` from :meth:`GPTConfig.to_dict` output (e.g. a loaded config.json).

    Unknown keys are refused rather than ignored: a misspelt ``n_embed`` must
    not silently fall back to a default.
    """
    if not isinstance(d, Mapping):
        raise BadInput("a GPT config must be a JSON object", expected="mapping", found=type(d).__name__)
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise BadInput("unknown keys in GPT config", expected=sorted(known), found=unknown)
    required = ("n_layer", "n_head", "n_embd", "block_size")  # the fields without defaults
    missing = [k for k in required if k not in d]
    if missing:
        raise BadInput("GPT config lacks required keys", expected=list(required), found=f"missing {missing}")
    return GPTConfig(**dict(d))


#: Named model shapes. Parameter counts (untied head, biases on):
#:   tiny        136,960 — a smoke-test model that trains at many steps/s on 2 CPU cores
#:   andrea-12m  12,815,232 — "ANDREA-12M (12.8M parameters)", .bin 153.8 MB
#:   andrea-120m 121,675,008 — "ANDREA-120M (~120M)", .bin 1.46 GB
CONFIGS: dict[str, GPTConfig] = {
    # dropout > 0 so that even the smoke test consumes the torch RNG during
    # training: a resume that forgets to restore it then diverges visibly.
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, dropout=0.1),
    "andrea-12m": GPTConfig(n_layer=7, n_head=6, n_embd=384, block_size=512, dropout=0.1),
    "andrea-120m": GPTConfig(n_layer=17, n_head=12, n_embd=768, block_size=1024, dropout=0.1),
}


@dataclass(frozen=True)
class TrainDefaults:
    """Recommended optimisation settings for a named config.

    Attributes:
        batch_size: sequences per optimizer step (each ``block_size`` bytes).
        lr: peak AdamW learning rate, reached after ``warmup_steps``.
        min_lr: floor of the cosine decay after warmup.
        warmup_steps: linear warmup length, in optimizer steps.
        weight_decay: AdamW decoupled decay on matrices and embeddings only.
        betas: AdamW (beta1, beta2); the ANDREA .bin's m and v use 0.9 and 0.999.
        grad_clip: max global gradient norm (0 disables clipping).
    """

    batch_size: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


#: Training defaults per config. The ANDREA learning rates stay well below
#: 1e-3: the ANDREA run's v1 lost 27K steps to lr=0.001 being too aggressive.
TRAIN_DEFAULTS: dict[str, TrainDefaults] = {
    "tiny": TrainDefaults(batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=10),
    "andrea-12m": TrainDefaults(batch_size=32, lr=6e-4, min_lr=6e-5, warmup_steps=1000),
    "andrea-120m": TrainDefaults(batch_size=16, lr=3e-4, min_lr=3e-5, warmup_steps=2000),
}


# ---- the network ---------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # q, k, v for all heads in one matmul: [d] -> [3d]
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time (bytes), channels
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # [B, T, C] -> [B, n_head, T, head_size]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # Fused causal attention. dropout_p is passed only in training: SDPA
        # has no notion of eval mode and would otherwise drop (and draw RNG) at
        # inference too.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: d -> 4d -> GELU -> d."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # Registration order = parameters() order: ln_1, attention, ln_2, MLP.
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The byte-level GPT. ``forward(idx[B, T]) -> (logits[B, T, 256], loss | None)``.

    Parameter names follow nanoGPT (``transformer.wte.weight``, ...,
    ``lm_head.weight``), so its checkpoints' state dicts map one to one.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise BadInput("GPT needs a GPTConfig", expected="GPTConfig", found=type(config).__name__)
        self.config = config
        # Registration order is the .bin order (module docstring): embeddings,
        # blocks, final LayerNorm, head.
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # byte -> [d]
                wpe=nn.Embedding(config.block_size, config.n_embd),  # position -> [d]
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied

        # GPT-2 init: N(0, 0.02) everywhere, zero biases; the residual output
        # projections scaled by 1/sqrt(2 n_layer) so the residual stream's
        # variance does not grow with depth (two branches per block).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def n_params(self) -> int:
        """Number of parameters, the ``n_params`` of the ANDREA ``.bin`` header."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy if ``targets`` are given.

        Args:
            idx: int64 ``[B, T]`` byte values, ``T <= block_size``.
            targets: int64 ``[B, T]`` next bytes (``-1`` = ignored position), or None.

        Returns:
            ``(logits [B, T, vocab_size] float32, loss scalar in nats/byte or None)``.
            At initialisation the loss is close to ``ln 256 = 5.545``.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise BadInput(
                "sequence longer than the model's context",
                expected=f"T <= block_size = {self.config.block_size}",
                found=f"T = {T}",
                hint="crop the input to its last block_size bytes",
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # [T]
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # [B, T, d] (+ broadcast [T, d])
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # [B, T, V]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizer(
        self,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        device_type: str | torch.device = "cpu",
        eps: float = 1e-8,
    ) -> torch.optim.AdamW:
        """AdamW with two groups: decay on matrices and embeddings (dim >= 2), none on biases and LayerNorms.

        Within each group parameters keep ``parameters()`` order. The fused
        kernel is used on CUDA only (CPU fused AdamW gains little and is a
        different code path to verify). ``amsgrad`` stays off: the ``.bin``
        has no room for its extra state.
        """
        params = list(self.parameters())
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": float(weight_decay)},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        kind = torch.device(device_type).type if not isinstance(device_type, torch.device) else device_type.type
        extra = {"fused": True} if kind == "cuda" else {}
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **extra)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        generator: torch.Generator,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled bytes to ``idx [B, T]``; returns ``[B, T + max_new_tokens]``.

        Every draw comes from ``generator`` (never the global torch RNG), so
        an audit sample taken mid-run leaves the training trajectory
        untouched. The draw runs on the generator's device: a CPU generator
        works with a CUDA model (the ``[B, V]`` probabilities are copied to it).
        ``temperature == 0`` is greedy decoding (argmax, no draw).

        Runs in eval mode (no dropout) under ``no_grad``, and puts every
        submodule back in the train/eval mode it had before.
        """
        if not isinstance(generator, torch.Generator):
            raise BadInput("generate needs an explicit torch.Generator", expected="torch.Generator",
                           found=type(generator).__name__, hint="torch.Generator().manual_seed(seed)")
        if temperature < 0:
            raise BadInput("temperature must be >= 0", expected=">= 0 (0 = greedy)", found=temperature)
        if top_k is not None and top_k < 1:
            raise BadInput("top_k must be >= 1 or None", expected=">= 1", found=top_k)
        modes = {m: m.training for m in self.modules()}
        self.eval()
        try:
            for _ in range(int(max_new_tokens)):
                # crop the context to the last block_size bytes
                idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
                logits, _ = self(idx_cond)
                logits = logits[:, -1, :].float()  # [B, V], the next byte only
                if temperature == 0:
                    idx_next = torch.argmax(logits, dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                        logits[logits < v[:, [-1]]] = -float("inf")
                    probs = F.softmax(logits, dim=-1).to(generator.device)
                    idx_next = torch.multinomial(probs, num_samples=1, generator=generator).to(idx.device)
                idx = torch.cat((idx, idx_next), dim=1)
        finally:
            for m, was_training in modes.items():
                m.training = was_training
        return idx
