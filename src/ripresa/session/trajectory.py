"""Recording a run's trajectory for the resume verifier (docs/VERIFY.md).

The recorder lives in the session layer so that both a contract trainer
(through :class:`Trajectory`) and a :class:`~ripresa.Checkpointer` steered by
``ripresa verify`` (:mod:`ripresa.session.steer`) write the same
``summary.json``; :mod:`ripresa.verify.trajectory` re-exports these names and
reads the file back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState
from ..io.fsio import write_atomic

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
