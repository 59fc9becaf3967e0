"""A :class:`~ripresa.TrainingState` as an ANDREA ``.bin`` plus its companion.

The ``.bin`` carries weights, m (``exp_avg``) and v (``exp_avg_sq``) in
``model.parameters()`` order; the companion carries the rest of the snapshot
(``TrainingState.snapshot(include_parameters=False)``). :func:`join_state`
puts the two halves back into one complete snapshot, which then goes through
the same validation and restore order as a ``checkpoint.pt``.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from ..core.state import BIN_MOMENTS, Progress, TrainingState
from ..errors import BadInput, SchemaError
from .andrea_bin import BinArrays, BinContents, adamw_step, flatten_model_and_adamw
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
