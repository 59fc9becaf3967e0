"""The ``summary.json`` trajectory a trainer writes for the resume verifier.

A trainer that follows the verification contract (``--steps``, ``--output``,
``--resume``, ``--omit-rng-restore``) records, in ``OUTPUT/summary.json``:

* ``start`` — the state right after building (or restoring) and just before
  the first step of this process;
* ``steps`` — for each optimizer step it ran: the global step number, the ids
  of the rows consumed, the learning rate(s) used, the loss;
* ``final`` — the state after its last step.

A state block holds progress, data position, every model tensor, the
optimizer state, the scheduler state, the LR the *next* step would use, the
next draw of every random stream (observed, then undone) and the trainer's
evaluation output. :class:`Trajectory` builds all of it from a
:class:`~ripresa.TrainingState`; see docs/FORMAT.md for the schema.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState
from ..errors import BadInput, IntegrityError
from ..io.fsio import read_small, write_atomic

SCHEMA = "ripresa.verify.trajectory/1"


def to_json_tree(obj: Any) -> Any:
    """Tensors → (nested) lists of Python numbers; tuples → lists; keys → str."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.tolist()
    if isinstance(obj, Mapping):
        return {str(k): to_json_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_json_tree(v) for v in obj]
    if isinstance(obj, bool | int | float | str) or obj is None:
        return obj
    return repr(obj)


def observe(state: TrainingState, progress: Progress, evaluation: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One state block: everything the verifier compares at a point of the run."""
    opt = state.optimizer
    return {
        "progress": progress.as_dict(),
        "data": to_json_tree(state.data.state_dict()) if state.data is not None else None,
        "parameters": to_json_tree(state.model.state_dict()),
        "optimizer": to_json_tree(opt.state_dict()) if opt is not None else None,
        "scheduler": to_json_tree(state.scheduler.state_dict()) if state.scheduler is not None else None,
        "scaler": to_json_tree(state.scaler.state_dict()) if state.scaler is not None else None,
        "objects": {n: to_json_tree(o.state_dict()) for n, o in state.objects.items()},
        "next_lr": [float(g["lr"]) for g in opt.param_groups] if opt is not None else None,
        "next_draws": state.rng.peek(),
        "evaluation": to_json_tree(dict(evaluation or {})),
    }


class Trajectory:
    """Records a trainer's trajectory and writes ``summary.json``.

    Usage inside a trainer::

        traj = Trajectory(state)
        traj.start(progress)                       # after build/restore
        for ...:
            traj.step(progress.step, rows=ids, lr=lr, loss=loss)
        traj.finish(progress, evaluation={"mse": mse})
        traj.write(output / "summary.json")
    """

    def __init__(self, state: TrainingState, *, resumed_from: str | None = None, rng_restored: bool = True) -> None:
        self.state = state
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            "resumed_from": resumed_from,
            "rng_restored": rng_restored,
            "checkpoint": None,  # file name (relative to the output) of the checkpoint saved at the end
            "start": None,
            "steps": [],
            "final": None,
        }

    def start(self, progress: Progress, evaluation: Mapping[str, Any] | None = None) -> None:
        self.doc["start"] = observe(self.state, progress, evaluation)

    def step(self, step: int, *, rows: Sequence[int], lr: float | Sequence[float], loss: float, **extra: Any) -> None:
        lrs = [float(x) for x in lr] if isinstance(lr, Sequence) else [float(lr)]
        self.doc["steps"].append({"step": int(step), "rows": [int(r) for r in rows], "lr": lrs, "loss": float(loss), **to_json_tree(extra)})

    def finish(self, progress: Progress, evaluation: Mapping[str, Any] | None = None) -> None:
        self.doc["final"] = observe(self.state, progress, evaluation)

    def saved(self, name: str) -> None:
        """Record the checkpoint this process saved at its end (relative to its output folder)."""
        self.doc["checkpoint"] = name

    def write(self, path: str | Path) -> None:
        data = json.dumps(self.doc, indent=None, separators=(",", ":")).encode()
        write_atomic(Path(path), [data])


#: Largest ``summary.json`` read (bytes).
SUMMARY_MAX = 256 << 20


def read_trajectory(path: str | Path) -> dict[str, Any]:
    """Load and structurally check a ``summary.json``."""
    p = Path(path)
    if not os.path.lexists(p):
        raise BadInput(
            "trajectory summary not found",
            file=p,
            expected="summary.json written by the trainer",
            found="nothing",
            hint="the trainer must follow the verification contract (docs/VERIFY.md)",
        )
    raw = read_small(p, "trajectory summary", SUMMARY_MAX, error=IntegrityError)  # no link, no FIFO, bounded
    try:
        doc = json.loads(raw.decode("utf-8"),
                         parse_constant=lambda c: {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[c])
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise IntegrityError("summary.json is not valid JSON", file=p, found=f"{type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise IntegrityError(
            "summary.json has an unknown schema", file=p, expected=SCHEMA,
            found=doc.get("schema") if isinstance(doc, dict) else type(doc).__name__,
        )
    for key in ("start", "steps", "final"):
        if doc.get(key) is None:
            raise IntegrityError(f"summary.json lacks '{key}'", file=p, expected=key, found=sorted(doc))
    return doc
