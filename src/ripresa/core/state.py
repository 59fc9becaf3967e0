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

from ..errors import BadInput, IdentityMismatch, IntegrityError, RipresaError, SchemaError
from .identity import COMPARED_VERSIONS, code_identity, versions
from .identity import data_identity as compute_data_identity
from .rng import RandomStreams
from .schema import FORMAT, FORMAT_VERSION, UNEXPECTED, validate_saved_state  # noqa: F401 (re-exported)

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


# ---------------------------------------------------------------------- script variables
def _script_value_error(value: Any, where: str, depth: int = 0) -> str | None:
    """Why ``value`` cannot be a saved script variable (None when it can)."""
    if depth > 16:
        return f"{where}: nested more than 16 levels deep"
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            bad = _script_value_error(v, f"{where}[{i}]", depth + 1)
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str) or (k.startswith("__") and k.endswith("__")):
                return f"{where}: key {k!r} (keys are strings, not __dunder__)"
            bad = _script_value_error(v, f"{where}[{k!r}]", depth + 1)
            if bad:
                return bad
        return None
    hint = " (convert it: int(x), float(x), x.item(), torch.as_tensor(x))" if type(value).__module__ == "numpy" else ""
    return f"{where}: a {type(value).__name__}{hint}"


def _tensor_devices(value: Any, out: list[str]) -> list[str]:
    """The devices of the tensors in ``value``, in traversal order."""
    if isinstance(value, torch.Tensor):
        out.append(str(value.device))
    elif isinstance(value, list | tuple):
        for v in value:
            _tensor_devices(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensor_devices(v, out)
    return out


def _to_devices(value: Any, devices: list[str]) -> Any:
    """``value`` with each tensor moved to the next device of ``devices`` (the CPU where that one is absent)."""
    if isinstance(value, torch.Tensor):
        dev = torch.device(devices.pop(0)) if devices else torch.device("cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():
            dev = torch.device("cpu")
        return value.to(dev)
    if isinstance(value, tuple):
        return tuple(_to_devices(v, devices) for v in value)
    if isinstance(value, list):
        return [_to_devices(v, devices) for v in value]
    if isinstance(value, dict):
        return {k: _to_devices(v, devices) for k, v in value.items()}
    return value


class ScriptState:
    """The variables of a training script that the next steps depend on, saved with the run.

    A loop keeps state outside the model and optimizer: a batch prefetched
    before the optimizer step, a running-average loss, an early-stopping
    counter, the best validation loss. Declare them once, with their initial
    values, and register the holder as a user object::

        vars = ScriptState(batch=None, ema_loss=0.0, bad_evals=0, best_val=float("inf"))
        state = TrainingState(model=model, optimizer=opt, objects={"script": vars})

    then read and write them as attributes (``vars.batch = get_batch()``) or
    items (``vars["batch"]``). A value is ``None``, a ``bool``/``int``/
    ``float``/``str`` (restored exactly: same type, same bits), a tensor
    (saved as a tensor — dtype, shape and bits; a general generation keeps it
    in its tensor file — and put back on the device it was on, or the CPU when
    that device is absent), or a list, tuple or str-keyed dict of these.

    The names are fixed at construction: assigning an undeclared name is an
    ``AttributeError`` (a typo would otherwise be silently left out of every
    checkpoint), and a checkpoint whose names differ is refused at the resume
    (docs/FORMAT.md, "Script variables"). docs/API.md, "State in script
    variables", gives the rule for where ``resume()`` goes.
    """

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            bad = _script_value_error(value, name)
            if bad:
                raise TypeError(f"script variable {bad} cannot be saved; use None, bool, int, float, str, a tensor, "
                                "or a list/tuple/str-keyed dict of these")
        object.__setattr__(self, "_values", dict(values))

    # --------------------------------------------------------------- access
    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"ScriptState has no variable {name!r} (declared: {sorted(self._values)})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_values":  # copy.copy / deepcopy / pickle restoring the slot
            object.__setattr__(self, name, value)
            return
        self[name] = value

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"ScriptState has no variable {name!r}: declare it with its initial value, "
                                 f"ScriptState(..., {name}=...), so that every checkpoint carries it")
        bad = _script_value_error(value, name)
        if bad:
            raise TypeError(f"script variable {bad} cannot be saved; use None, bool, int, float, str, a tensor, "
                            "or a list/tuple/str-keyed dict of these")
        self._values[name] = value

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> Any:
        return self._values.keys()

    def update(self, **values: Any) -> None:
        """Set several declared variables at once (``sv.update(batch=(X, Y), best_val=best_val)``)."""
        for name, value in values.items():
            self[name] = value

    def items(self) -> Any:
        return self._values.items()

    def __repr__(self) -> str:
        return "ScriptState(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    # --------------------------------------------------------------- Stateful
    def state_dict(self) -> dict[str, Any]:
        """``{"values": name -> value, "devices": name -> [device of each tensor]}`` (tensors as they are)."""
        for name, value in self._values.items():  # a list or dict may have been changed in place
            bad = _script_value_error(value, name)
            if bad:
                raise TypeError(f"script variable {bad} cannot be saved")
        return {"values": dict(self._values),
                "devices": {k: _tensor_devices(v, []) for k, v in self._values.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put the saved values back (checked whole before any is changed)."""
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"values", "devices"}:
            raise SchemaError("script state is malformed", expected='{"values": ..., "devices": ...}',
                              found=sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__)
        values, devices = state_dict["values"], state_dict["devices"]
        if not isinstance(values, Mapping) or not isinstance(devices, Mapping):
            raise SchemaError("script state is malformed", expected="two dicts", found=type(values).__name__)
        if set(values) != set(self._values):
            raise SchemaError("the script variables differ from the checkpoint's",
                              expected=sorted(map(str, values)), found=sorted(self._values),
                              hint="declare the same ScriptState variables as the run that saved; "
                                   "missing or unused state is an error, never silently defaulted")
        for name, value in values.items():
            bad = _script_value_error(value, name)
            devs = devices.get(name)
            if bad or not isinstance(devs, list) or not all(isinstance(d, str) for d in devs):
                raise SchemaError("a saved script variable is malformed", found=bad or f"{name}: devices {devs!r}")
        restored = {name: _to_devices(value, list(devices[name])) for name, value in values.items()}
        self._values.update({name: restored[name] for name in self._values})
