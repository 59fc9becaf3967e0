"""Complete training-state capture and restore (DESIGN §2).

:class:`TrainingState` holds references to the live objects of a run — model,
optimizer, scheduler, GradScaler, data position, random streams, any
``Stateful`` user object — plus the run's config, code and data identity.
:meth:`TrainingState.snapshot` captures all of it at one instant (a step
boundary) as ``weights_only``-safe primitives; :meth:`TrainingState.restore`
puts it back in the order that keeps it exact:

    model → scheduler → optimizer → scaler → data position → user objects →
    random streams (last, immediately before the next step)

The scheduler must have been *constructed* before ``optimizer.load_state_dict``
(constructing a scheduler rewrites the LRs); build all objects first, then call
``restore``. Everything is validated before anything is changed, so a refused
checkpoint leaves the live objects as they were.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from .errors import IdentityMismatch, SchemaError
from .formats.torch_pt import FORMAT, FORMAT_VERSION, Checkpoint
from .identity import COMPARED_VERSIONS, code_identity, versions
from .identity import data_identity as compute_data_identity
from .rng import RandomStreams

#: Optimizer state entries that an ANDREA .bin carries (m and v).
BIN_MOMENTS = ("exp_avg", "exp_avg_sq")


@runtime_checkable
class Stateful(Protocol):
    """The protocol of ``torch.distributed.checkpoint.stateful.Stateful``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class Progress:
    """How far a run is: optimizer steps completed, epoch, samples and tokens seen."""

    step: int = 0
    epoch: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0

    def as_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in asdict(self).items()}


def _tensor_tree_clone(obj: Any) -> Any:
    """Deep copy with tensors detached, cloned and moved to CPU (a true snapshot)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _tensor_tree_clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensor_tree_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_tensor_tree_clone(v) for v in obj)
    return copy.deepcopy(obj)


class TrainingState:
    """Everything that determines the next updates of a run.

    Args:
        model: the ``nn.Module`` (parameters and buffers).
        optimizer: its optimizer (Adam/AdamW moments and per-parameter step).
        scheduler: LR scheduler, constructed *before* any optimizer load.
        scaler: ``torch.amp.GradScaler`` for mixed precision, if used.
        data: the data position, e.g. :class:`~ripresa.EpochSampler`, or any
            ``Stateful`` loader (torchdata's ``StatefulDataLoader`` included).
        rng: the run's :class:`~ripresa.RandomStreams` (globals always included).
        objects: named user objects following the ``Stateful`` protocol.
        config: the resolved config (JSON-like primitives).
        code_files: the training code files whose sha256 is the code identity.
        data_sources: ``name -> path or bytes`` hashed into the data identity.
        data_identity: ``name -> sha256`` already computed by the caller.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        scaler: Any | None = None,
        data: Stateful | None = None,
        rng: RandomStreams | None = None,
        objects: Mapping[str, Stateful] | None = None,
        config: Mapping[str, Any] | None = None,
        code_files: Iterable[str | Path] = (),
        data_sources: Mapping[str, str | Path | bytes] | None = None,
        data_identity: Mapping[str, str] | None = None,
        device: str | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.data = data
        self.rng = rng if rng is not None else RandomStreams()
        self.objects = dict(objects or {})
        for name, obj in self.objects.items():
            if not isinstance(obj, Stateful):
                raise TypeError(f"object {name!r} lacks state_dict()/load_state_dict()")
        self.config = dict(config or {})
        self.code = code_identity(code_files)
        self.data_identity = {**compute_data_identity(data_sources or {}), **dict(data_identity or {})}
        self.versions = versions(device)
        #: changes accepted at resumes (versions/code/data), carried forward.
        self.lineage: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ capture
    def snapshot(
        self, progress: Progress, extra: Mapping[str, Any] | None = None, *, include_parameters: bool = True
    ) -> dict[str, Any]:
        """Capture the complete state *now* (call at a step boundary).

        Tensors are copied to CPU, so training may go on while it is written.
        With ``include_parameters=False`` the model's parameters and the
        optimizer's ``exp_avg``/``exp_avg_sq`` are left out (they travel in an
        ANDREA ``.bin``, copied once into staging buffers); buffers, per-parameter
        steps and everything else are kept.
        """
        sched = self.scheduler.state_dict() if self.scheduler is not None else None
        model_sd = self.model.state_dict(keep_vars=True)
        opt_sd = self.optimizer.state_dict() if self.optimizer is not None else None
        if not include_parameters:
            model_sd = {k: v for k, v in model_sd.items() if not isinstance(v, torch.nn.Parameter)}
            if opt_sd is not None:
                opt_sd = dict(opt_sd)
                opt_sd["state"] = {
                    i: {k: v for k, v in s.items() if k not in BIN_MOMENTS} for i, s in opt_sd["state"].items()
                }
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "progress": progress.as_dict(),
            "model": _tensor_tree_clone(model_sd),
            "optimizer": _tensor_tree_clone(opt_sd) if opt_sd is not None else None,
            "scheduler": _tensor_tree_clone(sched) if sched is not None else None,
            "scaler": _tensor_tree_clone(self.scaler.state_dict()) if self.scaler is not None else None,
            "data": _tensor_tree_clone(self.data.state_dict()) if self.data is not None else None,
            "objects": {n: _tensor_tree_clone(o.state_dict()) for n, o in self.objects.items()},
            "rng": self.rng.state_dict(),
            "config": copy.deepcopy(self.config),
            "versions": dict(self.versions),
            "code": copy.deepcopy(self.code),
            "data_identity": dict(self.data_identity),
            "lineage": copy.deepcopy(self.lineage),
            "extra": _tensor_tree_clone(dict(extra or {})),
        }

    # ------------------------------------------------------------------ restore
    def identity_changes(self, state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """What differs between the checkpoint's identity and this process's."""
        changes: dict[str, dict[str, Any]] = {}
        saved_v = state.get("versions", {})
        for k in COMPARED_VERSIONS:
            if saved_v.get(k) != self.versions.get(k):
                changes[f"versions.{k}"] = {"saved": saved_v.get(k), "now": self.versions.get(k)}
        saved_code = state.get("code", {}).get("files_sha256")
        if saved_code != self.code.get("files_sha256"):
            changes["code.files_sha256"] = {
                "saved": saved_code,
                "now": self.code.get("files_sha256"),
                "files_saved": state.get("code", {}).get("files"),
                "files_now": self.code.get("files"),
            }
        if dict(state.get("data_identity", {})) != self.data_identity:
            changes["data_identity"] = {"saved": state.get("data_identity"), "now": self.data_identity}
        return changes

    def check_structure(self, state: Mapping[str, Any], source: Path | None = None) -> None:
        """Refuse a checkpoint whose structure does not fit the live objects."""
        mine = self.model.state_dict()
        saved = state["model"]
        missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
        if missing or unexpected:
            raise SchemaError(
                "model state does not match the model",
                file=source,
                expected=f"keys of the live model (missing from checkpoint: {missing[:5]})",
                found=f"unexpected keys: {unexpected[:5]}",
                hint="build the same architecture as the run that saved (see the checkpoint's config)",
            )
        for k, t in mine.items():
            s = saved[k]
            if tuple(s.shape) != tuple(t.shape) or s.dtype != t.dtype:
                raise SchemaError(
                    f"model tensor '{k}' differs", file=source,
                    expected=f"{tuple(t.shape)} {t.dtype}", found=f"{tuple(s.shape)} {s.dtype}",
                )
        for key, obj in (("optimizer", self.optimizer), ("scheduler", self.scheduler), ("scaler", self.scaler), ("data", self.data)):
            has_saved, has_live = state.get(key) is not None, obj is not None
            if has_saved != has_live:
                raise SchemaError(
                    f"{key} state {'present in the checkpoint but no ' + key + ' was given' if has_saved else 'missing from the checkpoint'}",
                    file=source,
                    expected=f"{key} {'given' if has_saved else 'state'}",
                    found="none",
                    hint="missing or unused state is an error, never silently defaulted",
                )
        if self.optimizer is not None:
            groups_saved = state["optimizer"]["param_groups"]
            groups_live = self.optimizer.state_dict()["param_groups"]
            if [len(g["params"]) for g in groups_saved] != [len(g["params"]) for g in groups_live]:
                raise SchemaError(
                    "optimizer parameter groups differ", file=source,
                    expected=[len(g["params"]) for g in groups_live], found=[len(g["params"]) for g in groups_saved],
                )
        if set(state["objects"]) != set(self.objects):
            raise SchemaError(
                "user objects differ from the checkpoint's", file=source,
                expected=sorted(state["objects"]), found=sorted(self.objects),
                hint="register the same Stateful objects as the run that saved",
            )
        self.rng.check_compatible(state["rng"])

    def restore(
        self,
        checkpoint: Checkpoint | Mapping[str, Any],
        *,
        restore_rng: bool = True,
        allow_version_change: bool = False,
        allow_code_change: bool = False,
        allow_data_change: bool = False,
    ) -> Progress:
        """Restore everything, random streams last; return the saved progress.

        ``restore_rng=False`` deliberately omits the random streams (the
        verifier's negative case). A difference in versions, code or data is
        refused unless allowed, and an allowed one is recorded in the lineage
        carried by every later checkpoint.
        """
        source = checkpoint.path if isinstance(checkpoint, Checkpoint) else None
        state = checkpoint.state if isinstance(checkpoint, Checkpoint) else checkpoint
        self.check_structure(state, source)
        changes = self.identity_changes(state)
        refused = {
            k: v
            for k, v in changes.items()
            if (k.startswith("versions.") and not allow_version_change)
            or (k.startswith("code.") and not allow_code_change)
            or (k == "data_identity" and not allow_data_change)
        }
        if refused:
            flags = sorted(
                {"--allow-version-change" if k.startswith("versions.") else "--allow-code-change" if k.startswith("code.") else "--allow-data-change" for k in refused}
            )
            raise IdentityMismatch(
                "the checkpoint was written by different versions, code or data",
                file=source,
                expected={k: v["saved"] for k, v in refused.items()},
                found={k: v["now"] for k, v in refused.items()},
                hint=f"an exact resume needs the same; to accept the change knowingly pass {' '.join(flags)} (it is recorded)",
            )
        self.lineage = list(state.get("lineage", []))
        if changes:
            self.lineage.append({"at_step": int(state["progress"]["step"]), "accepted_changes": changes})

        # The order of DESIGN §2. The scheduler was constructed by the caller
        # before this call, so optimizer.load_state_dict's LRs are final.
        self.model.load_state_dict(state["model"], strict=True)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.data is not None:
            self.data.load_state_dict(state["data"])
        for name, obj in self.objects.items():
            obj.load_state_dict(state["objects"][name])
        if restore_rng:
            self.rng.load_state_dict(state["rng"])
        return Progress(**{k: int(v) for k, v in state["progress"].items()})
