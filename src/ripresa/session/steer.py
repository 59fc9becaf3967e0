"""A :class:`~ripresa.Checkpointer` steered by ``ripresa verify`` (docs/VERIFY.md, "Verifying a script
that uses the Checkpointer, with no extra code").

``ripresa verify`` runs an unchanged script four times and steers its ``Checkpointer`` through
one environment variable, :data:`ENV`, a JSON document of schema :data:`SCHEMA` (the run folder
to use, the step to stop at, whether to restore the random streams, whether a
``world_size_invariant`` Checkpointer keeps its fixed-tree reduction: docs/VERIFY.md, "Across world
sizes"); the steered session records
the trajectory itself (:class:`SteeredRecorder`, :class:`DistSteeredRecorder`). A malformed
document is refused, never half-read; the first ``Checkpointer`` built takes the variable out of
the environment, and every later one of the process is steered too (:func:`steer_session`), each into
a folder of its own under the path's output, never the folder the script names (docs/VERIFY.md,
"Every session of the process is steered").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.state import Progress, TrainingState
from ..errors import BadInput
from .trajectory import Trajectory, to_json_tree

#: The environment variable ``ripresa verify`` sets for a steered path.
ENV = "RIPRESA_VERIFY"
#: The schema of its JSON value.
SCHEMA = "ripresa.verify.steer/1"
_KEYS = {"schema", "path", "run_dir", "output", "stop_at", "restore_rng", "invariant", "verifier"}
#: How many parents up a steered process may be from its ``ripresa verify`` (a shell, a launcher, a rank...).
_MAX_DEPTH = 64


@dataclass(frozen=True)
class Steering:
    """What ``ripresa verify`` asks of one path's ``Checkpointer``."""

    path: str
    run_dir: Path
    output: Path
    stop_at: int
    restore_rng: bool = True
    #: Whether this session records the trajectory and stops at ``stop_at`` (the process's first session only).
    records: bool = True
    #: Whether a ``Checkpointer(world_size_invariant=G)`` keeps its fixed-tree reduction (True) or reduces the
    #: ordinary way, an all-reduce whose order follows the rank count (False: the negative control of a
    #: verification across world sizes, docs/VERIFY.md, "Across world sizes"). A script without the mode ignores it.
    invariant: bool = True

    def to_env(self) -> dict[str, str]:
        """The environment entry that steers a process this way, bound to this process (the verifier)."""
        from .torchrun import launcher_value

        doc = {"schema": SCHEMA, "path": self.path, "run_dir": str(self.run_dir), "output": str(self.output),
               "stop_at": self.stop_at, "restore_rng": self.restore_rng, "invariant": self.invariant,
               "verifier": launcher_value()}
        return {ENV: json.dumps(doc)}

    @classmethod
    def parse(cls, raw: str) -> Steering:
        """The steering in ``raw`` (the variable's value); a BadInput unless it is exactly what ``ripresa verify`` writes."""
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or set(doc) != _KEYS:
            raise BadInput(f"the environment variable {ENV} is set but is not a ripresa verify steering",
                           expected=f"a JSON object of schema {SCHEMA} with keys {sorted(_KEYS)}", found=raw[:200],
                           hint=f"only `ripresa verify` sets {ENV}; unset it to run the script as itself")
        ok = (isinstance(doc["path"], str) and isinstance(doc["run_dir"], str) and doc["run_dir"]
              and isinstance(doc["output"], str) and doc["output"]
              and type(doc["stop_at"]) is int and 0 < doc["stop_at"] < 2**63 and type(doc["restore_rng"]) is bool
              and type(doc["invariant"]) is bool and isinstance(doc["verifier"], str))
        if not ok:
            raise BadInput(f"the environment variable {ENV} has a field of the wrong type", found=raw[:200],
                           expected="path, run_dir, output, verifier: text; stop_at: an int > 0; "
                                    "restore_rng, invariant: true or false")
        _check_verifier(doc["verifier"])
        return cls(doc["path"], Path(doc["run_dir"]), Path(doc["output"]), doc["stop_at"], doc["restore_rng"],
                   invariant=doc["invariant"])

    @classmethod
    def take_from_env(cls) -> Steering | None:
        """The steering of this process, taken out of the environment (None: the process is not steered)."""
        raw = os.environ.pop(ENV, None)
        return None if raw is None else cls.parse(raw)


def _check_verifier(value: str) -> None:
    """The steering is trusted only under the ``ripresa verify`` that wrote it: that process (pid and start
    time, as the launcher's variable, docs/ARCHITECTURE.md) must be alive and an ancestor of this one. A value
    left in a shell, copied to another terminal, or inherited by a job the verifier did not start would
    otherwise send a real training into a verify folder and stop it at ``stop_at`` (docs/VERIFY.md,
    "Every session of the process is steered"): it is refused, one paragraph, before anything is touched."""
    import sys

    from .torchrun import parent_of, parse_identity, start_time

    parsed = parse_identity(value)
    if parsed is None or parsed[1] is None:
        raise BadInput(f"the environment variable {ENV} has a verifier that is not PID:START",
                       expected="the pid and start time of the ripresa verify that set it", found=value[:60],
                       hint=f"only `ripresa verify` sets {ENV}; unset it to run the script as itself")
    if not sys.platform.startswith("linux"):
        return
    verifier, start = parsed
    pid: int | None = os.getpid()  # the verifier itself, or one of its descendants (a shell, a launcher, a rank)
    for _ in range(_MAX_DEPTH):
        if pid is None or pid <= 1:
            break
        if pid == verifier:
            if start_time(pid) == start:
                return
            break
        pid = parent_of(pid)
    raise BadInput(f"the environment variable {ENV} is set, but the ripresa verify that set it (pid {verifier}) "
                   "is not running this process: a value left over or inherited",
                   expected=f"{ENV} only in a process that ripresa verify started",
                   found=f"pid {verifier} {'is not an ancestor of this process' if start_time(verifier) == start else 'has ended'}",
                   hint=f"unset {ENV} (`unset {ENV}`) and run the script again: it then trains in the folder it "
                        "names; nothing was touched")


#: The steering this process's first Checkpointer took, and how many sessions have been steered since.
_TAKEN: dict[str, Any] = {}


def steer_session() -> Steering | None:
    """The steering of a new ``Checkpointer`` of this process (None: the process is not steered).

    The first takes :data:`ENV` out of the environment, records the trajectory and stops at ``stop_at``.
    Every later one — a second ``Checkpointer`` of a two-phase script, a second ``fit()`` or ``train()``
    with a framework integration — is steered into ``OUTPUT/session-N`` (N = 2, 3, ... in the order the
    process builds them, the same in the four paths), records nothing and stops only where the script
    does: the folder the script names is never used, whatever session names it. A later session never
    writes into the first one's folder, which the resumed paths copy (docs/VERIFY.md, "Every session of
    the process is steered").
    """
    first = Steering.take_from_env()
    if first is not None:
        _TAKEN.clear()
        _TAKEN.update(steering=first, sessions=1)
        return first
    base = _TAKEN.get("steering")
    if base is None:
        return None
    _TAKEN["sessions"] += 1
    folder = base.output / f"session-{_TAKEN['sessions']}"
    return Steering(base.path, folder, folder, base.stop_at, base.restore_rng, records=False, invariant=base.invariant)


def forget() -> None:
    """Forget this process's steering (a test that steered a Checkpointer in its own process cleans up so)."""
    _TAKEN.clear()


def parameters_digest(params: Mapping[str, Any]) -> str:
    """sha256 of a (whole) model state dict: each tensor's name, dtype, shape and bytes, in name order. Recorded
    per step, it names the first step whose weights differ even when the losses still agree (docs/VERIFY.md,
    "Across world sizes")."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name]
        h.update(f"{name}\0".encode())
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}\0".encode())
            try:
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            except (RuntimeError, TypeError):  # a layout with no byte view (e.g. quantized): its values
                h.update(repr(t.tolist()).encode())
        else:
            h.update(repr(t).encode())
    return h.hexdigest()


def _float_or_none(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several values
        return None


class SteeredRecorder:
    """The trajectory a steered ``Checkpointer`` records: ``summary.json`` as a contract trainer writes it.

    ``start`` right after ``resume()``; per step the loss (``step_done``'s
    ``loss`` metric), the LR of each param group as ``step_done`` sees it
    (after the step's scheduler step, in every path alike), the data
    position (the ``data`` object's ``state_dict()``) and the digest of the
    weights after the step (:func:`parameters_digest`); ``final`` at the stop,
    with ``evaluation = {"last_loss": …}``. Row ids are not known to the
    session: ``rows`` is empty and the data position stands for them.
    """

    def __init__(self, steer: Steering, state: TrainingState) -> None:
        self.steer = steer
        self.state = state
        self.trajectory = Trajectory(state, resumed_from=None, rng_restored=steer.restore_rng)
        self.started = False
        self.finished = False
        self.last_loss: float | None = None

    def start(self, progress: Progress, resumed_from: str | None) -> None:
        self.trajectory.doc["resumed_from"] = resumed_from
        self.trajectory.start(progress)
        self.started = True

    def step(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.started:
            raise BadInput("ripresa verify steers a script that calls Checkpointer.resume() before its first step",
                           expected="ckpt.resume() before the first ckpt.step_done()", found=f"step_done({step}) first",
                           hint="call resume() even for a new run (it returns 0)")
        if self.finished:
            return  # the script went on after step_done returned True: not part of this path
        opt = self.state.optimizer
        loss = _float_or_none(metrics.get("loss"))
        self.last_loss = loss
        self.trajectory.doc["steps"].append({
            "step": int(step),
            "rows": [],
            "lr": [float(g["lr"]) for g in opt.param_groups] if opt is not None else [],
            "loss": loss,
            "data": to_json_tree(self.state.data.state_dict()) if self.state.data is not None else None,
            "parameters_sha256": parameters_digest(self.state.model.state_dict()),
        })

    def finish(self, progress: Progress) -> None:
        if self.finished:
            return
        loss = self.last_loss
        self.trajectory.finish(progress, evaluation={"last_loss": loss} if loss is not None else {})
        self.finished = True
        self.steer.output.mkdir(parents=True, exist_ok=True)
        self.trajectory.write(self.steer.output / "summary.json")


def _full(obj: Any) -> Any:
    """Every DTensor of a tree gathered whole (``DTensor.full_tensor()``: a collective, same order on every rank)."""
    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()  # type: ignore[assignment,misc]
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_full(v) for v in obj]
    return obj


class DistSteeredRecorder(SteeredRecorder):
    """The recorder of a steered distributed run (DDP or FSDP2 under torchrun; docs/SHARDED.md).

    Every rank takes the steering and calls each method (they hold
    collectives); rank 0 records and writes ``summary.json``. A state block
    holds the whole parameters and optimizer state (FSDP2 shards gathered with
    ``DTensor.full_tensor()`` — never through ``get_optimizer_state_dict``,
    which would initialise a fresh optimizer's state), the data position and
    ``Stateful`` objects of every rank (a list by rank) and the next draws of
    every rank's streams (``rankR/stream``). Each step holds rank 0's loss
    (as the script passes it), the LR, every rank's data position and
    ``loss_per_rank``, so a divergence on any rank is seen, and the digest of
    the whole weights after the step (FSDP2: gathered, a collective).
    """

    def __init__(self, steer: Steering, state: TrainingState, dist: Any) -> None:
        super().__init__(steer, state)
        self.dist = dist

    def _observe(self, progress: Progress) -> dict[str, Any] | None:
        from .trajectory import to_json_tree

        s, opt = self.state, self.state.optimizer
        params = _full(s.model.state_dict())
        optim = _full(opt.state_dict()) if opt is not None else None
        mine = {"data": to_json_tree(s.data.state_dict()) if s.data is not None else None,
                "objects": {n: to_json_tree(o.state_dict()) for n, o in s.objects.items()},
                "next_draws": s.rng.peek()}
        every = self.dist.gather(mine)
        if not self.dist.is_main:
            return None
        return {
            "progress": progress.as_dict(),
            "data": [r["data"] for r in every],
            "parameters": to_json_tree(params),
            "optimizer": to_json_tree(optim),
            "scheduler": to_json_tree(s.scheduler.state_dict()) if s.scheduler is not None else None,
            "scaler": to_json_tree(s.scaler.state_dict()) if s.scaler is not None else None,
            "objects": [r["objects"] for r in every],
            "next_lr": [float(g["lr"]) for g in opt.param_groups] if opt is not None else None,
            "next_draws": {f"rank{i}/{k}": v for i, r in enumerate(every) for k, v in (r["next_draws"] or {}).items()},
            "evaluation": {},
        }

    def start(self, progress: Progress, resumed_from: str | None) -> None:
        self.trajectory.doc["resumed_from"] = resumed_from
        block = self._observe(progress)
        if block is not None:
            self.trajectory.doc["start"] = block
        self.started = True

    def step(self, step: int, metrics: Mapping[str, Any]) -> None:
        from .trajectory import to_json_tree

        if not self.started:
            super().step(step, metrics)  # raises: resume() first
        if self.finished:
            return
        loss = _float_or_none(metrics.get("loss"))
        data = to_json_tree(self.state.data.state_dict()) if self.state.data is not None else None
        params = _full(self.state.model.state_dict())  # every rank: gathering a DTensor is a collective
        every = self.dist.gather({"loss": loss, "data": data})
        self.last_loss = loss
        if not self.dist.is_main:
            return
        opt = self.state.optimizer
        self.trajectory.doc["steps"].append({
            "step": int(step), "rows": [],
            "lr": [float(g["lr"]) for g in opt.param_groups] if opt is not None else [],
            "loss": loss, "data": [r["data"] for r in every], "loss_per_rank": [r["loss"] for r in every],
            "parameters_sha256": parameters_digest(params),
        })

    def finish(self, progress: Progress) -> None:
        if self.finished:
            return
        block = self._observe(progress)
        self.finished = True
        if block is None:
            return
        if self.last_loss is not None:
            block["evaluation"] = {"last_loss": self.last_loss}
        self.trajectory.doc["final"] = block
        self.steer.output.mkdir(parents=True, exist_ok=True)
        self.trajectory.write(self.steer.output / "summary.json")
