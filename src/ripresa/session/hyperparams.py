"""Which side wins when a resume meets an optimizer hyper-parameter the script changed (docs/API.md, "Changed hyper-parameters").

The script builds its optimizer (``lr=3e-4``), then :meth:`~ripresa.Checkpointer.resume` loads the
checkpoint's optimizer state, param groups included (``lr=1e-3``). :func:`script_values` records
the param groups' hyper-parameters before the restore; :func:`reconcile` compares them with the
restored ones afterwards and, per ``side``:

* ``"checkpoint"`` (the default): the checkpoint's values stay (an exact resume) and one
  :class:`HyperparameterWarning` names each changed key, old and new value, and how to apply the
  script's value instead;
* ``"script"``: the script's values are put back into the param groups (and, when a learning-rate
  scheduler is restored, its ``base_lrs`` follow ``initial_lr``); no warning, the change is recorded;
* ``"loop"``: the loop sets them itself after ``resume()`` (a schedule applied before every step, as
  ``ripresa train`` does): nothing is compared, the checkpoint's values stand until the loop sets its own.

Either way a ``hyperparameter_change`` history event lists the changes: never silent.
Keys a scheduler drives (``lr`` always; ``betas``/``momentum`` of a momentum-cycling scheduler)
are not compared while a scheduler is part of the state: their value at construction is the
scheduler's start, not a choice (a change of the base rate shows as ``initial_lr``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..store.store import CheckpointWarning

__all__ = ["SIDES", "HyperparameterWarning", "message", "reconcile", "script_values"]

#: The values of ``Checkpointer(..., hyperparameters=...)``.
SIDES = ("checkpoint", "script", "loop")


class HyperparameterWarning(CheckpointWarning):
    """An optimizer hyper-parameter of the script differs from the checkpoint's; the checkpoint's is used."""


def _copy(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, list | tuple):
        return type(v)(_copy(x) for x in v)
    return v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        try:
            return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
        except (TypeError, RuntimeError):
            return False
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    number = (int, float)
    if isinstance(a, number) and isinstance(b, number) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b or (a != a and b != b)  # 1 == 1.0; NaN == NaN
    return type(a) is type(b) and a == b


def _scheduled(scheduler: Any) -> set[str]:
    """The param-group keys a restored scheduler drives (not compared: their construction value is its start)."""
    if scheduler is None:
        return set()
    keys = {"lr"}
    if getattr(scheduler, "cycle_momentum", False):  # OneCycleLR, CyclicLR
        keys |= {"betas", "momentum"}
    return keys


def script_values(optimizer: torch.optim.Optimizer | None, scheduler: Any = None) -> list[dict[str, Any]] | None:
    """The param groups' hyper-parameters as the script built them (before any restore)."""
    if optimizer is None:
        return None
    skip = _scheduled(scheduler) | {"params", "param_names"}
    return [{k: _copy(v) for k, v in g.items() if k not in skip} for g in optimizer.param_groups]


def _show(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        v = v.tolist() if v.numel() <= 4 else f"tensor{tuple(v.shape)}"
    if isinstance(v, float) and math.isfinite(v) and float(f"{v:g}") == v:
        return f"{v:g}"  # 0.0003, not 0.00030000000000000003
    return str(v)


def reconcile(before: Sequence[dict[str, Any]] | None, optimizer: torch.optim.Optimizer | None, side: str,
              scheduler: Any = None) -> list[dict[str, Any]]:
    """Compare the restored param groups with the script's ``before``; apply ``side``; return the changes.

    Each change: ``{"group", "key", "checkpoint", "script"}`` (values as text). With ``side="script"``
    the script's values are written back into the param groups.
    """
    if before is None or optimizer is None or len(before) != len(optimizer.param_groups):
        return []
    changes: list[dict[str, Any]] = []
    for i, (mine, g) in enumerate(zip(before, optimizer.param_groups, strict=True)):
        for key, value in mine.items():
            if key not in g or _same(value, g[key]):
                continue
            changes.append({"group": i, "key": key, "checkpoint": _show(g[key]), "script": _show(value)})
            if side == "script":
                g[key] = _copy(value)
    if side == "script" and scheduler is not None and hasattr(scheduler, "base_lrs"):
        if any(c["key"] == "initial_lr" for c in changes):  # a fresh scheduler takes its base from initial_lr
            scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    return changes


def message(changes: Sequence[dict[str, Any]], groups: int) -> str:
    """The warning: each changed key, ``checkpoint -> script``, which side is used and how to pick the other."""
    seen: dict[tuple[str, str, str], list[int]] = {}
    for c in changes:
        seen.setdefault((c["key"], c["checkpoint"], c["script"]), []).append(c["group"])
    parts = []
    for (key, old, new), where in seen.items():
        scope = "" if groups == 1 or len(where) == groups else f" (param group {', '.join(map(str, where))})"
        parts.append(f"{key} {old} -> {new}{scope}")
    return (f"the optimizer's hyper-parameters differ from the checkpoint's: {'; '.join(parts)} (the checkpoint's "
            "value is used; to apply the new one: Checkpointer(..., hyperparameters=\"script\") or set it after "
            "resume(); docs/API.md, \"Changed hyper-parameters\")")
