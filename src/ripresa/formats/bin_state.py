"""A :class:`~ripresa.TrainingState` as an ANDREA ``.bin`` plus its companion.

The ``.bin`` carries weights, m (``exp_avg``) and v (``exp_avg_sq``) in
``model.parameters()`` order; the companion carries the rest of the snapshot
(``TrainingState.snapshot(include_parameters=False)``). :func:`join_state`
puts the two halves back into one complete snapshot, which then goes through
the same validation and restore order as a ``checkpoint.pt``. The model and
its AdamW map to the ``.bin``'s three regions through
:func:`flatten_model_and_adamw` / :func:`load_into_model_and_adamw`; the bytes
are :mod:`ripresa.formats.andrea_bin`'s.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.state import BIN_MOMENTS, Progress, TrainingState
from ..errors import BadInput, SchemaError
from .andrea_bin import FLOAT, MAX_STEP, REGIONS, BinArrays, BinContents, Chunk, check_n_params
from .torch_pt import validate_checkpoint


def bin_arrays(state: TrainingState) -> BinArrays:
    """Per-parameter views (no copy) of weights, m and v, for writing or staging."""
    if state.optimizer is None:
        raise SchemaError("an ANDREA .bin needs an Adam/AdamW optimizer", expected="optimizer", found="none")
    return flatten_model_and_adamw(state.model, state.optimizer)


def bin_fits(state: TrainingState) -> str | None:
    """Why ``state`` cannot be stored as an ANDREA ``.bin`` + companion (None when it can).

    The ``.bin`` holds float32 parameters and Adam/AdamW (``amsgrad=False``)
    moments with one shared step: what :func:`bin_arrays` accepts. Checked
    when a session is built, so the choice of format never waits for a save.
    """
    if state.optimizer is None:
        return "an ANDREA .bin needs an Adam/AdamW optimizer (found none)"
    try:
        flatten_model_and_adamw(state.model, state.optimizer)
        adamw_step(state.model, state.optimizer)
    except BadInput as exc:
        return exc.message + ("" if exc.found is None else f" (found {exc.found})")
    return None


#: ``ripresa train`` asks for a ``.bin`` only when its companion would carry at most this many buffer elements
#: as JSON numbers (two 1024x1024 masks: an 8 MB companion); docs/FORMAT.md, "Which format a session writes".
AUTO_MAX_BUFFER_ELEMENTS = 1 << 16


def bin_suits(state: TrainingState) -> str | None:
    """:func:`bin_fits`, and model buffers small enough for the JSON companion (``ripresa train``'s choice)."""
    why = bin_fits(state)
    if why is not None:
        return why
    n = sum(t.numel() for t in state.model.buffers())
    if n > AUTO_MAX_BUFFER_ELEMENTS:
        return f"the model's buffers hold {n} elements, more than the .bin's JSON companion carries well " \
               f"({AUTO_MAX_BUFFER_ELEMENTS})"
    return None


def companion_snapshot(state: TrainingState, progress: Progress, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the ``.bin`` lacks, captured now (small: no parameters, no moments)."""
    return state.snapshot(progress, extra, include_parameters=False)


def _optimizer_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) → index of the param in ``optimizer.state_dict()['state']``."""
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    return {id(p): i for i, p in enumerate(params)}


def join_state(state: TrainingState, contents: BinContents, companion: dict[str, Any]) -> dict[str, Any]:
    """Complete snapshot = companion + tensors of the ``.bin`` (views, no copy)."""
    if state.optimizer is None:
        raise SchemaError("an ANDREA .bin needs an Adam/AdamW optimizer", expected="optimizer", found="none")
    params = list(state.model.parameters())
    n = sum(p.numel() for p in params)
    if contents.n_params != n:
        raise SchemaError(
            "the .bin holds another number of parameters than the model",
            file=contents.path, expected=n, found=contents.n_params,
            hint="build the model from the run's config.json",
        )
    if contents.step != companion["progress"]["step"]:
        raise SchemaError(
            "the .bin and its companion describe different steps",
            file=contents.path, expected=companion["progress"]["step"], found=contents.step,
        )
    offsets: dict[int, tuple[int, torch.Size]] = {}
    off = 0
    for p in params:
        offsets[id(p)] = (off, p.shape)
        off += p.numel()

    def view(arr: np.ndarray, p_id: int) -> torch.Tensor:
        start, shape = offsets[p_id]
        return torch.from_numpy(arr[start : start + int(np.prod(shape, dtype=np.int64))]).view(shape)

    full = dict(companion)
    model_sd = dict(companion["model"])
    for name, t in state.model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.nn.Parameter):
            model_sd[name] = view(contents.weights, id(t))
    full["model"] = model_sd
    opt = dict(companion["optimizer"])
    saved_state = opt["state"]
    new_state: dict[int, dict[str, Any]] = {}
    index = _optimizer_index(state.optimizer)
    for p in params:
        i = index.get(id(p))
        if i is None:
            continue
        entry = saved_state.get(i)
        if entry is None:
            continue  # the parameter had no optimizer state at the save (m = v = 0 in the .bin)
        entry = dict(entry)
        entry[BIN_MOMENTS[0]] = view(contents.m, id(p))
        entry[BIN_MOMENTS[1]] = view(contents.v, id(p))
        new_state[i] = entry
    extra_ids = set(saved_state) - set(new_state)
    if extra_ids:
        raise SchemaError(
            "companion holds optimizer state for parameters the model does not have",
            file=contents.path, found=sorted(extra_ids)[:5],
        )
    opt["state"] = new_state
    full["optimizer"] = opt
    validate_checkpoint(full, contents.path, one_instant=False)  # structure; see state.validate_saved_state
    return full


# ---- model + AdamW mapping -----------------------------------------------------


def _params_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``model.parameters()`` in order (shared parameters once), the file's order."""
    return list(model.parameters())


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _check_model(model: torch.nn.Module, path: Path | None) -> list[torch.nn.Parameter]:
    params = _params_of(model)
    names = _param_names(model)
    for p in params:
        if p.dtype != torch.float32:
            raise BadInput(
                f"parameter '{names.get(id(p), '?')}' is not float32",
                file=path,
                expected="a float32 model (the .bin stores float32)",
                found=str(p.dtype),
                hint="cast the model with model.float(), or use checkpoint.pt",
            )
    return params


def _check_optimizer(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], path: Path | None
) -> dict[int, dict]:
    """Map ``id(param)`` → its param group; refuse what the format cannot hold."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise BadInput(
            "the ANDREA .bin holds Adam/AdamW state only",
            file=path,
            expected="torch.optim.AdamW (or Adam)",
            found=type(optimizer).__name__,
            hint="use checkpoint.pt for other optimizers",
        )
    group_of: dict[int, dict] = {}
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise BadInput(
                "AdamW with amsgrad=True cannot be stored in an ANDREA .bin",
                file=path,
                expected="amsgrad=False",
                found="amsgrad=True (max_exp_avg_sq has no place in the file)",
                hint="use checkpoint.pt",
            )
        for p in group["params"]:
            group_of[id(p)] = group
    in_model = {id(p) for p in params}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in in_model]
    if stray:
        raise BadInput(
            "the optimizer holds parameters that are not in the model",
            file=path,
            expected="optimizer parameters ⊆ model.parameters()",
            found=f"{len(stray)} extra parameter(s), shapes {[tuple(p.shape) for p in stray[:4]]}",
            hint="build the optimizer from model.parameters()",
        )
    return group_of


def _zeros_view(p: torch.Tensor) -> torch.Tensor:
    """A 1-D zero view as long as ``p``, with no storage behind it (stride 0)."""
    return torch.zeros((), dtype=torch.float32).expand(p.numel())


def flatten_model_and_adamw(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> BinArrays:
    """Per-parameter views of weights, m (``exp_avg``) and v (``exp_avg_sq``).

    In ``model.parameters()`` order; zero views (no memory) for a parameter
    without optimizer state yet or not held by the optimizer. Views of live
    tensors: write them before the next optimizer step. Pass to
    :func:`write_bin` / :func:`save_bin` as ``*arrays``.
    """
    params = _check_model(model, None)
    group_of = _check_optimizer(optimizer, params, None)
    names = _param_names(model)
    w_chunks: list[Chunk] = []
    m_chunks: list[Chunk] = []
    v_chunks: list[Chunk] = []
    for p in params:
        w_chunks.append(p.detach().reshape(-1))
        state = optimizer.state.get(p, {}) if id(p) in group_of else {}
        for key, out in (("exp_avg", m_chunks), ("exp_avg_sq", v_chunks)):
            t = state.get(key)
            if t is None:
                out.append(_zeros_view(p))
                continue
            if t.dtype != torch.float32 or t.numel() != p.numel():
                raise BadInput(
                    f"optimizer state '{key}' of '{names.get(id(p), '?')}' cannot be stored",
                    expected=f"float32 with {p.numel()} elements",
                    found=f"{t.dtype} with {t.numel()} elements",
                )
            out.append(t.detach().reshape(-1))
    arrays = BinArrays(tuple(w_chunks), tuple(m_chunks), tuple(v_chunks))
    check_n_params(arrays.n_params)
    return arrays


def adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The one per-parameter AdamW ``step`` shared by all parameters (0 if no state).

    A ``.bin`` holds a single step; if the per-parameter steps differ (a
    parameter that got no gradient in some steps, a GradScaler that skipped
    steps) the file cannot represent the optimizer exactly, and this refuses.
    """
    params = _check_model(model, None)
    group_of = _check_optimizer(optimizer, params, None)
    steps: set[float] = set()
    for p in params:
        if id(p) in group_of:
            s = optimizer.state.get(p, {}).get("step")
            if s is not None:
                steps.add(float(s.item() if isinstance(s, torch.Tensor) else s))
    if not steps:
        return 0
    if len(steps) > 1:
        raise BadInput(
            "per-parameter AdamW steps differ; one .bin step cannot represent them",
            expected="the same step for every parameter",
            found=f"steps {sorted(steps)[:6]}",
            hint="use checkpoint.pt, which keeps per-parameter steps",
        )
    (s,) = steps
    if s != int(s) or not 0 <= s <= MAX_STEP:
        raise BadInput("AdamW step is not a valid int32 step", expected=f"0..{MAX_STEP}", found=s)
    return int(s)


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype torch gives AdamW's ``step`` (``torch.optim.optimizer._get_scalar_dtype``)."""
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def load_into_model_and_adamw(
    contents: BinContents, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[str]:
    """Copy weights into the model and m, v, step into AdamW, bit-exactly.

    Everything is checked before anything changes (float32 model, Adam/AdamW
    without amsgrad, optimizer parameters within the model, n_params equal to
    the model's, zero moments for parameters the optimizer does not hold), so
    a refused load leaves model and optimizer untouched.

    The optimizer's state is (re)created the way ``torch.optim.Adam`` creates
    it lazily: ``exp_avg``/``exp_avg_sq`` like the parameter (same device,
    memory format), and ``step`` a 0-d tensor holding the header's step — on
    the parameter's device in ``fused``/``capturable`` mode, else on the CPU
    (float32, or float64 under a float64 default dtype). Works on a fresh
    optimizer with no state.

    Limits of the format: every parameter gets the header's step, including
    one that never had a gradient in the original run; a float32 ``step`` is
    exact up to 2**24 (as is torch's own counter).

    Returns notes on what was *not* restored (model buffers, parameters the
    optimizer does not hold); the caller reports them.
    """
    path = contents.path
    params = _check_model(model, path)
    group_of = _check_optimizer(optimizer, params, path)
    names = _param_names(model)
    n_model = sum(p.numel() for p in params)
    if n_model != contents.n_params:
        raise SchemaError(
            "ANDREA .bin does not fit the model: parameter counts differ",
            file=path,
            expected=f"n_params = {n_model} (the model's)",
            found=f"n_params = {contents.n_params}",
            hint="this checkpoint was written for another model architecture or size",
        )
    for name in REGIONS:
        arr = getattr(contents, name)
        if arr.shape != (contents.n_params,) or arr.dtype != FLOAT:
            raise SchemaError(
                f"region {name} has the wrong shape or dtype",
                file=path,
                expected=f"({contents.n_params},) float32",
                found=f"{arr.shape} {arr.dtype}",
            )
    notes: list[str] = []
    offsets: list[int] = []
    off = 0
    for p in params:
        offsets.append(off)
        k = p.numel()
        if id(p) not in group_of:
            if np.any(contents.m[off : off + k]) or np.any(contents.v[off : off + k]):
                raise BadInput(
                    f"parameter '{names.get(id(p), '?')}' has optimizer moments in the file "
                    "but the optimizer does not hold it",
                    file=path,
                    expected="the optimizer built over all trained parameters",
                    found="non-zero m/v for a parameter outside the optimizer",
                    hint="build the optimizer from model.parameters()",
                )
            notes.append(f"parameter '{names.get(id(p), '?')}': weights restored, not in the optimizer")
        off += k

    def chunk(arr: np.ndarray, start: int, p: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(arr[start : start + p.numel()]).view(p.shape)

    step_value = float(contents.step)
    with torch.no_grad():
        for p, start in zip(params, offsets, strict=True):
            p.copy_(chunk(contents.weights, start, p))
            group = group_of.get(id(p))
            if group is None:
                continue
            fused = bool(group.get("fused"))
            if fused or group.get("capturable"):
                step_t = torch.tensor(step_value, dtype=_scalar_dtype(fused), device=p.device)
            else:
                step_t = torch.tensor(step_value, dtype=_scalar_dtype(False), device="cpu")
            exp_avg = torch.empty_like(p, memory_format=torch.preserve_format)
            exp_avg.copy_(chunk(contents.m, start, p))
            exp_avg_sq = torch.empty_like(p, memory_format=torch.preserve_format)
            exp_avg_sq.copy_(chunk(contents.v, start, p))
            optimizer.state[p] = {"step": step_t, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        notes.append(
            f"{len(buffers)} model buffer(s) not stored in a .bin and left as they are: "
            + ", ".join(buffers[:8])
            + (" ..." if len(buffers) > 8 else "")
        )
    return notes
