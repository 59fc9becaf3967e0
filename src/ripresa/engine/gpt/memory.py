"""What one training step of the ANDREA GPT needs in memory, against what the machine has (``ripresa advise``).

Counted from the config, nothing allocated: parameters, gradients and AdamW's
two moments (float32: the engine keeps float32 weights under autocast), the
activations autograd keeps for the backward pass (:func:`activation_bytes`, term
by term from :mod:`.model`), the backward's largest working tensors, and the
host copies a checkpoint makes: the staging copy of a background save, and
the memory tier's two slots in ``/dev/shm`` (``ripresa train --memory-every K``,
off by default: sized, labelled, left out of the verdict; docs/TIERS.md). Set against the device's free memory (``torch.cuda.mem_get_info``),
the host's (``/proc/meminfo``) and ``/dev/shm`` (``statvfs``); the verdict and
its thresholds: docs/CADENCE.md, "Memory for a step".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...store.memory import MARGIN, SLOTS
from .model import GPTConfig

#: Bytes of one activation element by precision (autocast's matmul outputs; LayerNorm, softmax and the loss
#: stay float32 under autocast).
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Verdict thresholds on need / available: at most FITS fits, at most TIGHT is tight, above does not fit.
FITS, TIGHT = 0.8, 1.0


def activation_bytes(m: GPTConfig, batch: int, precision: str, device: str) -> int:
    """Bytes autograd saves in one forward of :class:`~.model.GPT` (training mode, ``T = block_size``).

    Per block: the two LayerNorm inputs (float32) and their mean/rstd, the inputs of the four Linear layers and
    GELU's input (``a`` bytes each: 4 in fp32, 2 under autocast), two dropout masks when ``dropout > 0``, and the
    attention: on the CPU with dropout, SDPA's math path keeps float32 q, k, v and three ``B·H·T·T`` matrices
    (softmax, mask, dropped); otherwise a fused kernel keeps q, k, v and a ``B·H·T`` logsumexp (its output, laid out as ``[B, T, C]``, is
    ``c_proj``'s input).
    Around the blocks: the embedding dropout's mask, ``ln_f``'s input, ``lm_head``'s input, the float32
    log-softmax of the logits (``B·T·V``), the indices; under autocast, the cached low-precision copy of every
    Linear weight. Measured on the CPU (tests/test_engine_round3.py): equal to the bytes of the tensors autograd
    saves for the tiny model, fp32 and bf16; the CUDA kernels' terms are from their saved tensors, not measured
    on a GPU here.
    """
    B, T, C, H, V, L = batch, m.block_size, m.n_embd, m.n_head, m.vocab_size, m.n_layer
    a = ELEMENT_BYTES[precision]
    BT, BTC = B * T, B * T * C
    dropout = m.dropout > 0
    cuda = device == "cuda"
    mask = 1 if cuda else a  # a CUDA dropout keeps a bool mask; the CPU one a mask of the activation's dtype
    per_layer = 2 * BTC * 4 + 2 * 2 * BT * 4  # LayerNorm inputs, float32, and their mean and rstd
    per_layer += BTC * a * (1 + 1 + 1 + 4 + 4)  # inputs of c_attn, attn.c_proj, c_fc, mlp.c_proj (4C); GELU's (4C)
    if dropout:
        per_layer += 2 * BTC * mask  # attention's and the MLP's residual dropout
    if dropout and not cuda:
        per_layer += 3 * BTC * 4 + 3 * B * H * T * T * 4  # SDPA's math path: q, k, v; softmax, mask, dropped
    else:
        per_layer += 3 * BTC * a + B * H * T * 4  # a fused kernel: q, k, v (its output is c_proj's input); logsumexp
    head = BTC * 4 + 2 * BT * 4 + BTC * a + BT * V * 4 + 2 * BT * 8 + T * 8  # ln_f in + stats, lm_head in, log-softmax
    if dropout:
        head += BTC * (1 if cuda else 4)  # the embedding dropout's mask (float32: the embeddings are not autocast)
    copies = 2 * (12 * L * C * C + V * C) if a == 2 else 0  # autocast's cached weight copies
    return L * per_layer + head + copies


def working_bytes(m: GPTConfig, batch: int, device: str) -> int:
    """The backward's largest transient tensors: the logits' gradient, and on the CPU with dropout the attention
    matrix's two gradients (float32)."""
    B, T = batch, m.block_size
    extra = 2 * B * m.n_head * T * T * 4 if m.dropout > 0 and device != "cuda" else 0
    return B * T * m.vocab_size * 4 + extra


def step_need(m: GPTConfig, batch: int, precision: str, device: str) -> dict[str, int]:
    """Bytes of one step, by part; ``state`` is what a checkpoint copies (weights, m, v: float32)."""
    P = m.param_count()
    return {
        "parameters": 4 * P,
        "gradients": 4 * P,
        "optimizer": 8 * P,  # AdamW: exp_avg and exp_avg_sq
        "activations": activation_bytes(m, batch, precision, device),
        "working": working_bytes(m, batch, device),
        "state": 12 * P,
    }


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> dict[str, int] | None:
    """``MemAvailable`` and ``MemTotal`` in bytes, or None where ``/proc/meminfo`` says neither."""
    try:
        text = meminfo.read_text()[:65536]
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key in ("MemAvailable", "MemTotal") and parts and parts[0].isdigit():
            out["available" if key == "MemAvailable" else "total"] = int(parts[0]) * 1024
    return out if len(out) == 2 else None


def shm_memory(path: str = "/dev/shm") -> dict[str, int] | None:
    """Free and total bytes of ``/dev/shm`` (``statvfs``), or None where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return {"available": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize}


def device_memory(device: str) -> dict[str, int] | None:
    """Free and total bytes of CUDA device 0 (``torch.cuda.mem_get_info``); None on the CPU or without CUDA."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"available": int(free), "total": int(total)}


def _verdict(need: int, have: dict[str, int] | None) -> str:
    if have is None:
        return "unknown"
    ratio = need / max(1, have["available"])
    return "fits" if ratio <= FITS else "tight" if ratio <= TIGHT else "does not fit"


def size_step(cfg: dict[str, Any], *, precision: str, device: str,
              measured: dict[str, dict[str, int] | None] | None = None) -> dict[str, Any]:
    """The memory report of a resolved config: what a step needs, where, against what is there, and a verdict.

    ``measured`` replaces the machine's figures (``device``, ``host``, ``shm``: ``{"available", "total"}`` or
    None), for a report of another machine or a test.
    """
    from .model import from_config_dict

    m = from_config_dict(cfg["model"])
    batch = int(cfg["train"]["batch_size"])
    need = step_need(m, batch, precision, device)
    have = measured if measured is not None else {
        "device": device_memory(device), "host": host_memory(), "shm": shm_memory()}
    step = need["parameters"] + need["gradients"] + need["optimizer"] + need["activations"] + need["working"]
    staging = need["state"]  # a background save's host copy of the state (--sync: none)
    tier = SLOTS * need["state"] + MARGIN  # --memory-every: what the tier checks /dev/shm for (store/memory.py)
    if device == "cuda":
        places = {"device": step, "host": staging}
    else:
        places = {"host": step + staging}
    verdicts = {place: _verdict(n, have.get(place)) for place, n in places.items()}
    order = ["does not fit", "tight", "unknown", "fits"]
    overall = min(verdicts.values(), key=order.index)
    fix = None
    if overall in ("does not fit", "tight"):
        fix = _what_to_change(m, batch, precision, device, need, places, have, verdicts)
    elif overall == "unknown":
        fix = "run ripresa advise on the machine that trains: its memory is measured there"
    return {
        "model": {"params": m.param_count(), "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd,
                  "block_size": m.block_size, "vocab_size": m.vocab_size, "dropout": m.dropout},
        "batch_size": batch, "precision": precision, "device": device,
        "need": need, "places": places, "available": have, "verdicts": verdicts, "verdict": overall, "change": fix,
        "memory_tier": {"need": tier, "where": "/dev/shm", "verdict": _verdict(tier, have.get("shm")),
                        "note": f"--memory-every K (off by default): {SLOTS} state copies (one generation, one in "
                                "flight) and a margin, checked again before its first capture (docs/TIERS.md)"},
    }


def _what_to_change(m: GPTConfig, batch: int, precision: str, device: str, need: dict[str, int],
                    places: dict[str, int], have: dict[str, Any], verdicts: dict[str, str]) -> str:
    """One sentence: the largest batch that fits, else what else to change."""
    place = next(p for p in ("device", "host") if verdicts.get(p) in ("does not fit", "tight"))
    budget = FITS * have[place]["available"]
    fixed = places[place] - need["activations"] - need["working"]
    if place == "host" and device == "cuda":  # the staging copy alone: a synchronous save makes none
        return "the staging copy of a background save does not fit the host: --sync saves without one"
    best = 0
    lo, hi = 1, batch
    while lo <= hi:  # the activations grow with the batch: bisect the largest that fits
        mid = (lo + hi) // 2
        if fixed + activation_bytes(m, mid, precision, device) + working_bytes(m, mid, device) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best >= batch:
        return "nothing to change"
    if best >= 1:
        return (f"lower the batch: --set train.batch_size={best} fits ({int(FITS * 100)}% of the {place}'s free "
                f"memory)" + ("" if precision != "fp32" else "; or --precision bf16 (fewer activation bytes)"))
    return f"even train.batch_size=1 does not fit the {place}: a smaller model (model.*) or a larger machine"


def _gib(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def render_memory(report: dict[str, Any]) -> str:
    """The memory section of ``ripresa advise``, one fact a line (80 columns)."""
    r, need = report, report["need"]
    m = r["model"]
    lines = [f"memory for one step: {m['params']:,} parameters, batch {r['batch_size']} x {m['block_size']}, "
             f"{r['precision']} on {r['device']}",
             f"  model: {m['n_layer']} layers x {m['n_embd']}, {m['n_head']} heads, vocab {m['vocab_size']}",
             f"  parameters {_gib(need['parameters'])}, gradients {_gib(need['gradients'])}, "
             f"AdamW {_gib(need['optimizer'])}",
             f"  activations {_gib(need['activations'])} (estimate), backward working {_gib(need['working'])}",
             f"  staging copy of a background save: {_gib(need['state'])} (host; --sync: none)"]
    for place, n in r["places"].items():
        have = r["available"].get(place)
        free = f"of {_gib(have['available'])} free ({_gib(have['total'])})" if have else "(not measurable here)"
        lines.append(f"  {place}: needs {_gib(n)} {free}: {r['verdicts'][place]}")
    tier = r["memory_tier"]
    shm = r["available"].get("shm")
    lines += [f"  memory tier (--memory-every K, off by default): {SLOTS} state copies,",
              f"    {_gib(tier['need'])} in /dev/shm "
              f"({_gib(shm['available']) + ' free' if shm else 'none here'}): {tier['verdict']}"]
    lines.append(f"verdict: {r['verdict']}")
    if r.get("change"):
        lines.append(f"  change: {r['change']}")
    return "\n".join(lines)


def memory_for(run_dir: Path | None, config: str | None, sets: tuple[str, ...] | list[str], precision: str | None,
               device: str) -> dict[str, Any] | None:
    """The report of :func:`size_step` for ``ripresa advise``: the config named (``--config``, ``--set``), else the
    run's ``config.json``; None when there is neither, or the run's config is not an ANDREA model's (a general
    Checkpointer run: its model is the user's, not sized here)."""
    import torch

    from ...errors import BadInput
    from .config import resolve_config
    from .train import pick_device, resolve_precision

    if device not in ("auto", "cpu", "cuda"):
        raise BadInput("unknown --device", expected="auto, cpu or cuda", found=device)
    own = run_dir / "config.json" if run_dir is not None else None
    if config is None and (own is None or not os.path.lexists(own)):
        if sets:
            raise BadInput("--set needs a config to apply to", expected="--config NAME|FILE or a run with config.json")
        return None
    try:
        cfg = resolve_config(config, tuple(sets), run_dir)
    except BadInput:
        if config is not None or sets:
            raise
        return None  # the run's config.json is not an ANDREA config
    if device == "cuda" and not torch.cuda.is_available():  # sizing a GPU from a machine without one
        dev = torch.device("cuda")
        chosen = precision or cfg["train"].get("precision") or "auto"
        prec = "bf16" if chosen == "auto" else chosen  # auto: sized as a GPU with bfloat16
        if prec not in ELEMENT_BYTES:
            raise BadInput("train.precision is not a precision", file=own, expected=sorted(ELEMENT_BYTES),
                           found=repr(prec)[:80])
    else:
        dev = pick_device(device)
        prec = resolve_precision(precision, cfg, None, dev, own if config is None else None)
    return size_step(cfg, precision=prec, device=dev.type)
