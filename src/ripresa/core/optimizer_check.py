"""The optimizer-state check of a saved training state (docs/FORMAT.md, "optimizer_params").

:func:`optimizer_record` captures which parameters the optimizer holds state for; :func:`check_optimizer_state`
refuses a saved optimizer state that does not fit the live model or is not whole (every kind of generation).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError

#: Per-parameter optimizer entries that have the parameter's shape and dtype (Adam/AdamW, SGD, RMSprop, Adagrad, ...).
PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "grad_avg")


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in the order of its ``state_dict()`` indices."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in the model (a tied parameter keeps the first)."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    return names


def _number(v: Any) -> float | None:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v.item())
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    return None


def canonical_order(opt_sd: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with its ``state`` in one order: by parameter index, each entry's keys sorted.

    ``optimizer.state`` lists parameters in the order they first got state (a
    parameter without a gradient at the first step comes later) and each entry's
    keys in the order the optimizer created them, while a restored state lists them
    in the saved order: a generation written after a resume would differ in bytes
    from one written by a run never interrupted. Every kind of generation saves this
    order (docs/FORMAT.md, "optimizer_params"); the values are the same objects.
    """
    if opt_sd is None or not isinstance(opt_sd.get("state"), Mapping):
        return None if opt_sd is None else dict(opt_sd)

    def index(k: Any) -> tuple[int, Any]:
        return (0, k) if isinstance(k, int) and not isinstance(k, bool) else (1, str(k))

    def entry(v: Any) -> Any:
        if isinstance(v, Mapping) and all(isinstance(k, str) for k in v):
            return {k: v[k] for k in sorted(v)}
        return v

    out = dict(opt_sd)
    out["state"] = {k: entry(opt_sd["state"][k]) for k in sorted(opt_sd["state"], key=index)}
    return out


def optimizer_record(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]] | None:
    """Which parameters the optimizer holds state for, captured with the state (docs/FORMAT.md, "optimizer_params").

    One entry per parameter with state: its index in ``optimizer.state_dict()``,
    name, shape, dtype, the names of its entries and its per-parameter step.
    Saved beside the optimizer's own state, so a state whose ``optimizer.state``
    lost (or gained) an entry after the save is refused at the resume
    (:func:`check_optimizer_state`), never trained on fresh moments.
    """
    if optimizer is None:
        return None
    names = _param_names(model)
    out = []
    for i, p in enumerate(_flat_params(optimizer)):
        st = optimizer.state.get(p)
        if not st:
            continue
        out.append({"index": i, "name": names.get(id(p), f"#{i}"), "shape": [int(d) for d in p.shape],
                    "dtype": str(p.dtype).removeprefix("torch."), "keys": sorted(map(str, st)),
                    "step": _number(st.get("step"))})
    return out


def check_optimizer_state(saved: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          source: Path | None = None) -> None:
    """THE check that a saved optimizer state fits the live model and is whole (every kind of generation).

    Called by :meth:`TrainingState.check_structure`, so ``checkpoint.pt``, the
    general ``.safetensors`` generation and the ANDREA ``.bin`` (its companion
    joined with its moments) all pass through it before anything is restored.
    :class:`~ripresa.errors.IntegrityError` (exit 1) naming the parameter when

    * the saved ``optimizer_params`` record (what the optimizer held state for
      at the save) and ``optimizer.state`` disagree: an entry missing (it would
      train on fresh moments) or an extra one, other entry names, another
      per-parameter step;
    * the record names another parameter, shape or dtype than the live model's
      parameter at that index;
    * a parameter-shaped entry (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
      ...) has another shape or dtype than its parameter.

    A state written before the record existed (no ``optimizer_params``) gets the
    last check only (docs/FORMAT.md).
    """
    opt = saved.get("optimizer")
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping):
        return
    params = _flat_params(optimizer)
    names = _param_names(model)

    def name_of(i: int) -> str:
        return names.get(id(params[i]), f"#{i}") if 0 <= i < len(params) else f"#{i}"

    def refuse(what: str, i: int, expected: Any, found: Any) -> IntegrityError:
        return IntegrityError(f"optimizer state of parameter '{name_of(i)}' (index {i}) {what}", file=source,
                              expected=expected, found=found,
                              hint="the optimizer state does not match what was saved with it or the model (edited, "
                                   "or mixed from two checkpoints); it is refused rather than trained on fresh or "
                                   "wrong moments — resume from another generation")

    state = opt["state"]
    record = saved.get("optimizer_params")
    if record is not None:
        if not isinstance(record, list) or not all(isinstance(r, Mapping) and type(r.get("index")) is int
                                                   for r in record):
            raise IntegrityError("the saved optimizer_params record is malformed", file=source,
                                 expected="a list of {index, name, shape, dtype, keys, step}", found=repr(record)[:120])
        by_index = {int(r["index"]): r for r in record}
        for i in sorted(set(by_index) - set(state)):
            raise refuse("is missing", i, f"an entry with {by_index[i].get('keys')} (the saved optimizer had state "
                         "for this parameter)", "no entry in optimizer.state")
        for i in sorted(set(state) - set(by_index)):
            raise refuse("is an extra entry", i, "no entry (the saved optimizer had no state for this parameter)",
                         f"an entry with {sorted(map(str, state[i])) if isinstance(state[i], Mapping) else state[i]!r}")
        for i, r in sorted(by_index.items()):
            entry = state[i]
            if i >= len(params):
                raise refuse("names a parameter the optimizer does not have", i, f"an index < {len(params)}", i)
            p = params[i]
            live = {"name": name_of(i), "shape": [int(d) for d in p.shape], "dtype": str(p.dtype).removeprefix("torch.")}
            saved_p = {k: r.get(k) for k in live}
            if saved_p != live:
                raise refuse("was saved for another parameter", i, live, saved_p)
            keys = sorted(map(str, entry)) if isinstance(entry, Mapping) else None
            if keys != r.get("keys"):
                raise refuse("has other entries than were saved", i, r.get("keys"), keys)
            if _number(entry.get("step")) != r.get("step"):
                raise refuse("has another step count than was saved", i, r.get("step"), _number(entry.get("step")))
    for i, entry in state.items():
        if not isinstance(entry, Mapping) or type(i) is not int or not 0 <= i < len(params):
            continue  # validate_saved_state refuses these
        p = params[i]
        for k in PARAM_SHAPED:
            t = entry.get(k)
            if isinstance(t, torch.Tensor) and (tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype):
                raise refuse(f"entry '{k}' does not fit the parameter", i, f"{tuple(p.shape)} {p.dtype}",
                             f"{tuple(t.shape)} {t.dtype}")
