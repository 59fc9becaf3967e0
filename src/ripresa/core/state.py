"""Complete training-state capture and restore (docs/FORMAT.md; the restore's walk: docs/ARCHITECTURE.md, "One resume").

:class:`TrainingState` holds references to the live objects of a run (model, optimizer,
scheduler, GradScaler, data position, random streams, ``Stateful`` user objects) plus its
config, code and data identity. :meth:`TrainingState.snapshot` captures all of it at a step
boundary; :meth:`TrainingState.restore` checks everything first (:meth:`~TrainingState.check_restore`),
then puts it back: model → scheduler → optimizer → scaler → data position → user objects →
random streams last. Build every object (the scheduler before the restore) first.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ..errors import BadInput, IdentityMismatch, RipresaError, SchemaError
from .identity import COMPARED_VERSIONS, code_identity, versions
from .identity import data_identity as compute_data_identity
from .optimizer_check import PARAM_SHAPED, canonical_order, check_optimizer_state, optimizer_record  # noqa: F401 (re-exported)
from .rng import RandomStreams
from .schema import FORMAT, FORMAT_VERSION, UNEXPECTED, validate_saved_state  # noqa: F401 (re-exported)
from .script_state import ScriptState  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # annotation only (excluded from the layer contract)
    from ..formats.torch_pt import Checkpoint

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


def _like(saved: Any, live: Any, where: str, depth: int = 0) -> str | None:
    """Where ``saved`` does not have the shape of ``live`` (keys, list lengths, leaf kinds); None if alike."""
    if live is None or saved is None or depth > 16:
        return None
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping) or set(map(str, saved)) != set(map(str, live)):
            return f"{where}: keys {sorted(map(str, saved))[:8] if isinstance(saved, Mapping) else type(saved).__name__}"
        for k, v in live.items():
            if k in saved:
                bad = _like(saved[k], v, f"{where}.{k}", depth + 1)
                if bad:
                    return bad
        return None
    if isinstance(live, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(live):
            return f"{where}: {type(saved).__name__} of {len(saved) if isinstance(saved, list | tuple) else '?'}"
        for i, (a, b) in enumerate(zip(saved, live, strict=True)):
            bad = _like(a, b, f"{where}[{i}]", depth + 1)
            if bad:
                return bad
        return None
    if isinstance(live, bool) or isinstance(saved, bool):
        return None if isinstance(live, bool) and isinstance(saved, bool) else f"{where}: {type(saved).__name__}"
    if isinstance(live, int | float):
        ok = isinstance(saved, int | float) or (isinstance(saved, torch.Tensor) and saved.numel() == 1)
        return None if ok else f"{where}: {type(saved).__name__}"
    if isinstance(live, torch.Tensor):
        ok = isinstance(saved, torch.Tensor) and saved.shape == live.shape or isinstance(saved, int | float)
        return None if ok else f"{where}: {type(saved).__name__}"
    if isinstance(live, str):
        return None if isinstance(saved, str) else f"{where}: {type(saved).__name__}"
    return None


def tensor_tree_clone(obj: Any) -> Any:
    """Deep copy with tensors detached, cloned and moved to CPU (a true snapshot)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: tensor_tree_clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [tensor_tree_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(tensor_tree_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _flatten_config(cfg: Any, prefix: str, out: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    if isinstance(cfg, Mapping) and cfg and depth < 16:
        for k, v in cfg.items():
            _flatten_config(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    else:
        out[prefix] = cfg
    return out


def config_changes(saved: Any, now: Any, ignore: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """The dotted keys whose values differ between two configs: ``{"train.batch_size": {"saved": 16, "now": 8}}``.

    Keys in ``ignore`` (and everything under them) are operational settings
    that may change between processes (``train.every``): never compared.
    """
    a = _flatten_config(saved if saved is not None else {}, "", {})
    b = _flatten_config(now if now is not None else {}, "", {})
    skip = tuple(ignore)

    def ignored(k: str) -> bool:
        return any(k == s or k.startswith(s + ".") for s in skip)

    return {k: {"saved": a.get(k), "now": b.get(k)} for k in sorted(set(a) | set(b))
            if not ignored(k) and (k not in a or k not in b or a[k] != b[k])}


def config_change_error(changes: Mapping[str, Mapping[str, Any]], source: Path | None, *, against: str) -> BadInput:
    """The refusal of a changed experiment config (exit 2): one line naming the keys, and the ways on."""
    shown = ", ".join(f"{k} ({v['saved']!r} -> {v['now']!r})" for k, v in list(changes.items())[:6])
    more = f" and {len(changes) - 6} more" if len(changes) > 6 else ""
    return BadInput(f"the experiment config differs from {against}: {shown}{more}", file=source,
                    expected={k: v["saved"] for k, v in changes.items()}, found={k: v["now"] for k, v in changes.items()},
                    hint="resume with the run's config; to change it knowingly pass --allow-config-change "
                         "(allow_config_change=True: recorded in the history and the lineage), or start a variant "
                         "with `ripresa fork RUN --set ...` (a mixture change: `ripresa pivot`)")


def _exact_data(data: Any) -> Any:
    """A DataLoader made exact by ``ripresa.make_exact`` stands for its position (its ``ExactLoader``)."""
    from .loader import exact_handle

    handle = exact_handle(data)
    return handle if handle is not None else data


def _check_stateful(data: Any, objects: Mapping[str, Any]) -> None:
    """TypeError naming a data object or user object without an exact ``state_dict()``/``load_state_dict()``, and the fix."""
    from .loader import ExactLoader

    if isinstance(data, torch.utils.data.DataLoader) and not isinstance(data, ExactLoader):
        # Every DataLoader not made exact: a plain one has no position; torchdata's StatefulDataLoader and
        # accelerate's prepared loaders have state_dict(), but their resume redraws the sampler's seed and the
        # workers' seeds (or, accelerate's, fails at the first save): refused here, never at a save.
        kind, mod = type(data).__name__, type(data).__module__.split(".")[0]
        if type(data) is torch.utils.data.DataLoader:
            why = ("it lacks state_dict()/load_state_dict(), so its position and its workers' random state cannot "
                   "be saved")
        elif mod == "accelerate":
            why = ("its state_dict() serves only accelerate's own stateful loader (without it the first save fails: "
                   "no 'dl_state_dict'), and its resume skips batches without their random state")
        else:
            why = ("its own state_dict() does not resume exactly: its iter() draws the sampler's and the workers' "
                   "seeds from torch's global generator after the random streams were restored, and its workers "
                   "re-seed (random augmentation differs after a resume)")
        kind = "a plain torch DataLoader" if type(data) is torch.utils.data.DataLoader else f"{mod}'s {kind}"
        raise TypeError(
            f"data={data!r} is {kind}, not made exact: {why}. Fix: call ripresa.make_exact(loader) once, before the loop "
            "(it makes this very loader exact in place: the order and each sample's augmentation regenerated from "
            "(seed, epoch), an O(1) position), then pass the loader as data=; or use ripresa.StatefulLoader "
            "(docs/API.md, \"Data loaders\")"
        )
    if data is not None and not isinstance(data, Stateful):
        raise TypeError(f"data={type(data).__name__} lacks state_dict()/load_state_dict(), so its position cannot be "
                        "saved; give it both methods (the Stateful protocol), or use ripresa.EpochSampler, "
                        "ripresa.StatefulLoader or ripresa.make_exact(loader)")
    for name, obj in objects.items():
        if not isinstance(obj, Stateful):
            raise TypeError(f"object {name!r} ({type(obj).__name__}) lacks state_dict()/load_state_dict(), so it "
                            "cannot be saved; give it both methods (the Stateful protocol), or keep its values "
                            "in a ripresa.ScriptState")


@dataclass(frozen=True)
class RestorePlan:
    """What :meth:`TrainingState.check_restore` accepted: the identity and config changes a restore records."""

    changes: dict[str, dict[str, Any]]
    config: dict[str, dict[str, Any]]


@contextmanager
def _restore_errors(source: Path | None) -> Iterator[None]:
    """What the live objects still refuse after every check is a :class:`SchemaError` naming ``source``."""
    try:
        yield
    except RipresaError:
        raise
    except UNEXPECTED as exc:
        # Every check ran before any change; this is a state the live objects still refused.
        raise SchemaError("the saved state could not be restored into the live objects", file=source,
                          found=f"{type(exc).__name__}: {str(exc)[:200]}",
                          hint="the checkpoint does not fit this run (or was edited); build the same objects as "
                          "the run that saved, or resume from another generation") from exc


class TrainingState:
    """Everything that determines the next updates of a run.

    Args:
        model: the ``nn.Module`` (parameters and buffers).
        optimizer: its optimizer (Adam/AdamW moments and per-parameter step).
        scheduler: LR scheduler, constructed *before* any optimizer load.
        scaler: ``torch.amp.GradScaler`` for mixed precision, if used.
        data: the data position, e.g. :class:`~ripresa.EpochSampler`,
            :class:`~ripresa.StatefulLoader`, or a ``DataLoader`` made exact by
            :func:`~ripresa.make_exact` (the loader or its handle). A
            ``DataLoader`` not made exact is refused here, naming the fix.
        rng: the run's :class:`~ripresa.RandomStreams` (globals always included).
        objects: named user objects following the ``Stateful`` protocol.
        config: the resolved config (JSON-like primitives).
        code_files: the training code files whose sha256 is the code identity.
        data_sources: ``name -> path or bytes`` hashed into the data identity.
        data_identity: ``name -> sha256`` already computed by the caller.
        config_ignore: dotted config keys that are operational, not part of the
            experiment (e.g. ``"train.every"``): a resume never compares them.
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
        config_ignore: Iterable[str] = (),
    ) -> None:
        if not isinstance(model, torch.nn.Module):  # misuse of the API: TypeError (docs/FAULTS.md)
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if rng is not None and not isinstance(rng, RandomStreams):
            raise TypeError(f"rng must be a ripresa.RandomStreams, not {type(rng).__name__}")
        data = _exact_data(data)
        _check_stateful(data, dict(objects or {}))
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.data = data
        self.rng = rng if rng is not None else RandomStreams()
        self.objects = dict(objects or {})
        self.config = dict(config or {})
        self.config_ignore = tuple(config_ignore)
        #: the config changes the last restore accepted (``{dotted key: {"saved", "now"}}``).
        self.accepted_config_changes: dict[str, dict[str, Any]] = {}
        self.code = code_identity(code_files)
        self.data_identity = {**compute_data_identity(data_sources or {}), **dict(data_identity or {})}
        self.versions = versions(device)
        #: changes accepted at resumes (versions/code/data), carried forward.
        self.lineage: list[dict[str, Any]] = []

    def check_stateful(self) -> None:
        """TypeError naming ``data`` or a user object that cannot be saved (the Checkpointer checks at construction)."""
        _check_stateful(self.data, self.objects)

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
        opt_sd = canonical_order(self.optimizer.state_dict()) if self.optimizer is not None else None
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
            "model": tensor_tree_clone(model_sd),
            "optimizer": tensor_tree_clone(opt_sd) if opt_sd is not None else None,
            "scheduler": tensor_tree_clone(sched) if sched is not None else None,
            "scaler": tensor_tree_clone(self.scaler.state_dict()) if self.scaler is not None else None,
            "data": tensor_tree_clone(self.data.state_dict()) if self.data is not None else None,
            "objects": {n: tensor_tree_clone(o.state_dict()) for n, o in self.objects.items()},
            "rng": self.rng.state_dict(),
            "config": copy.deepcopy(self.config),
            "versions": dict(self.versions),
            "code": copy.deepcopy(self.code),
            "data_identity": dict(self.data_identity),
            "lineage": copy.deepcopy(self.lineage),
            "extra": tensor_tree_clone(dict(extra or {})),
            "optimizer_params": optimizer_record(self.model, self.optimizer),
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
            for i, (gs, gl) in enumerate(zip(groups_saved, groups_live, strict=True)):
                bad = _like({k: v for k, v in gs.items() if k != "params"}, {k: v for k, v in gl.items() if k != "params"},
                            f"optimizer.param_groups[{i}]")
                if bad:
                    raise SchemaError("optimizer hyper-parameters do not fit the optimizer", file=source,
                                      expected=sorted(k for k in gl if k != "params"), found=bad,
                                      hint="build the same optimizer as the run that saved")
            check_optimizer_state(state, self.model, self.optimizer, source)
        for key, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if obj is not None:
                bad = _like(state[key], obj.state_dict(), key)
                if bad:
                    raise SchemaError(f"{key} state does not fit the live {key}", file=source, found=bad,
                                      hint=f"build the same {key} as the run that saved")
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
        allow_config_change: bool | None = None,
    ) -> Progress:
        """Restore everything, random streams last; return the saved progress.

        ``restore_rng=False`` deliberately omits the random streams (the
        verifier's negative case). A difference in versions, code or data is
        refused unless allowed, and an allowed one is recorded in the lineage
        carried by every later checkpoint. The experiment ``config`` (less
        ``config_ignore``) is compared too: ``allow_config_change=False``
        refuses a change (:class:`~ripresa.errors.BadInput`, exit 2, naming the
        keys); ``True`` or ``None`` (the default) accept it and record it in the
        lineage (``config.KEY``) and in :attr:`accepted_config_changes`.
        """
        # A loaded Checkpoint (formats/torch_pt, a layer above) is recognised by its fields.
        loaded = not isinstance(checkpoint, Mapping) and hasattr(checkpoint, "state") and hasattr(checkpoint, "path")
        source = checkpoint.path if loaded else None
        state = checkpoint.state if loaded else checkpoint
        allow = {"allow_version_change": allow_version_change, "allow_code_change": allow_code_change,
                 "allow_data_change": allow_data_change, "allow_config_change": allow_config_change}
        with _restore_errors(source):
            return self.restore_checked(state, self.check_restore(state, source, **allow), restore_rng=restore_rng,
                                        source=source)

    def restore_read(self, state: Mapping[str, Any], *, restore_rng: bool = True, allow_version_change: bool = False,
                     allow_code_change: bool = False, allow_data_change: bool = False,
                     allow_config_change: bool | None = None) -> Progress:
        """:meth:`restore` of a state whose structure was checked where it was read.

        A storage backend's load runs :func:`~ripresa.core.schema.validate_saved_state`
        on the state it returns (``store/restore.py``); here the rest of
        :meth:`restore` runs (the checks against the live objects, then the
        restore, random streams last), with the same errors.
        """
        allow = {"allow_version_change": allow_version_change, "allow_code_change": allow_code_change,
                 "allow_data_change": allow_data_change, "allow_config_change": allow_config_change}
        with _restore_errors(None):
            return self.restore_checked(state, self.check_restore(state, structure_checked=True, **allow),
                                        restore_rng=restore_rng)

    def check_identity(self, state: Mapping[str, Any], source: Path | None = None, *,
                       allow_version_change: bool = False, allow_code_change: bool = False,
                       allow_data_change: bool = False,
                       allow_config_change: bool | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Refuse what is not allowed to differ; return ``(identity changes, config changes)`` to record.

        The one identity check of every restore (whole, or the rest of a
        ``.dcp``/sharded one): a config change is a :class:`~ripresa.errors.BadInput`
        (exit 2) — never an integrity failure, so a resume never skips healthy
        generations for it.
        """
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
            expected, found = {}, {}
            for k, v in refused.items():
                if k == "data_identity":  # name the sources that changed, not the whole table
                    saved, now = dict(v["saved"] or {}), dict(v["now"] or {})
                    for name in sorted(set(saved) | set(now)):
                        if saved.get(name) != now.get(name):
                            expected[f"data source {name!r}"] = saved.get(name, "absent")
                            found[f"data source {name!r}"] = now.get(name, "absent")
                else:
                    expected[k], found[k] = v["saved"], v["now"]
            raise IdentityMismatch(
                "the checkpoint was written by different versions, code or data",
                file=source,
                expected=expected,
                found=found,
                hint=f"an exact resume needs the same; to accept the change knowingly pass {' '.join(flags)} (it is recorded)",
            )
        cfg = config_changes(state.get("config"), self.config, self.config_ignore)
        if cfg and allow_config_change is False:
            raise config_change_error(cfg, source, against="the checkpoint's")
        return changes, cfg

    def check_restore(self, state: Mapping[str, Any], source: Path | None = None, *, structure_checked: bool = False,
                      allow_version_change: bool = False, allow_code_change: bool = False,
                      allow_data_change: bool = False, allow_config_change: bool | None = None) -> RestorePlan:
        """Every check of a restore, before anything changes (docs/ARCHITECTURE.md, "One resume").

        The saved state's structure (:func:`~ripresa.core.schema.validate_saved_state`;
        skipped with ``structure_checked``: it ran where the state was read), its
        fit to the live objects (:meth:`check_structure`) and its identity
        (:meth:`check_identity`). Returns what :meth:`restore_checked` records.
        """
        if not structure_checked:
            validate_saved_state(state, where=source)
        self.check_structure(state, source)
        changes, cfg = self.check_identity(state, source, allow_version_change=allow_version_change,
                                           allow_code_change=allow_code_change, allow_data_change=allow_data_change,
                                           allow_config_change=allow_config_change)
        return RestorePlan(changes, cfg)

    def restore_checked(self, state: Mapping[str, Any], plan: RestorePlan, *, restore_rng: bool = True,
                        source: Path | None = None) -> Progress:
        """Restore a state :meth:`check_restore` accepted (nothing is checked again); return the saved progress."""
        with _restore_errors(source):
            return self._apply(state, plan, restore_rng)

    def _apply(self, state: Mapping[str, Any], plan: RestorePlan, restore_rng: bool) -> Progress:
        changes, cfg = plan.changes, plan.config
        self.lineage = list(state.get("lineage", []))
        accepted = {**changes, **{f"config.{k}": v for k, v in cfg.items()}}
        if accepted:
            self.lineage.append({"at_step": int(state["progress"]["step"]), "accepted_changes": accepted})
        self.accepted_config_changes = cfg

        # The order of the module doc. The scheduler was constructed by the caller
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
