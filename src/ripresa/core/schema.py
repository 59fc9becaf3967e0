"""The structural schema of a saved training state (docs/FORMAT.md): what every reader checks.

:func:`validate_checkpoint` is ``checkpoint.pt``'s schema; :func:`validate_saved_state`
the one structural check every reader of a generation shares (``inspect --deep``,
``CheckpointStore.check``/``load``, the ``.dcp`` reader); :func:`check_distributed_record`
the per-rank record of a distributed save. Pure checks on in-memory trees: no file is read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError, RipresaError, SchemaError
from .numbers import checked_number
from .rng import validate_rng_state

FORMAT = "ripresa.checkpoint"
FORMAT_VERSION = 1

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _need(state: Mapping[str, Any], key: str, types: type | tuple[type, ...], path: Path | None, where: str = "") -> Any:
    if key not in state:
        raise SchemaError(
            f"checkpoint lacks '{where}{key}'",
            file=path,
            expected=f"a key '{where}{key}'",
            found=f"keys {sorted(map(str, state))}",
            hint="the checkpoint is incomplete; missing state is never defaulted",
        )
    v = state[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise SchemaError(
            f"checkpoint '{where}{key}' has the wrong type", file=path, expected=names, found=type(v).__name__
        )
    return v


def validate_checkpoint(state: Any, path: Path | None = None, *, one_instant: bool = True) -> None:
    """Check the structure of a checkpoint dict (see docs/FORMAT.md)."""
    if not isinstance(state, dict):
        raise SchemaError("checkpoint is not a dict", file=path, expected="dict", found=type(state).__name__)
    fmt = _need(state, "format", str, path)
    if fmt != FORMAT:
        raise SchemaError("not a ripresa checkpoint", file=path, expected=FORMAT, found=fmt)
    ver = _need(state, "format_version", int, path)
    if ver != FORMAT_VERSION:
        raise SchemaError(
            "unsupported checkpoint format version",
            file=path,
            expected=FORMAT_VERSION,
            found=ver,
            hint="written by a newer ripresa; upgrade" if ver > FORMAT_VERSION else "written by an older ripresa",
        )
    progress = _need(state, "progress", dict, path)
    for k in ("step", "epoch", "samples_seen", "tokens_seen"):
        v = _need(progress, k, int, path, "progress.")
        if v < 0 and k != "epoch":
            raise SchemaError(f"progress.{k} is negative", file=path, expected=">= 0", found=v)
    model = _need(state, "model", dict, path)
    for k, t in model.items():
        if not isinstance(k, str) or not isinstance(t, torch.Tensor):
            raise SchemaError("model state must map names to tensors", file=path, found=f"{k!r}: {type(t).__name__}")
    for key in ("optimizer", "scheduler", "scaler", "data"):
        _need(state, key, (dict, type(None)), path)
    opt = state["optimizer"]
    if opt is not None:
        _need(opt, "state", dict, path, "optimizer.")
        _need(opt, "param_groups", list, path, "optimizer.")
    for key in ("objects", "rng", "config", "versions", "code", "data_identity", "extra"):
        _need(state, key, dict, path)
    _need(state, "lineage", list, path)
    for name, h in state["data_identity"].items():
        if not isinstance(h, str) or not _HEX64.match(h):
            raise SchemaError(f"data_identity.{name} is not a sha256", file=path, expected="64 lowercase hex", found=repr(h)[:80])
    code = state["code"]
    h = code.get("files_sha256")
    if h is not None and (not isinstance(h, str) or not _HEX64.match(h)):
        raise SchemaError("code.files_sha256 is not a sha256", file=path, found=repr(h)[:80])
    if one_instant:  # checkpoint.pt's contract; a generation's companion is checked structurally only
        _check_progress_consistency(state, path)


def _check_progress_consistency(state: Mapping[str, Any], path: Path | None) -> None:
    """Optimizer per-parameter steps must agree with ``progress.step``.

    Each optimizer step increments the per-parameter ``step`` of every
    parameter that had a gradient, so none may exceed the steps completed;
    without a GradScaler (which skips steps on overflow) the largest must equal
    it. A mismatch means the checkpoint mixes two instants.
    """
    opt = state.get("optimizer")
    if not opt:
        return
    steps = []
    for s in opt["state"].values():
        if isinstance(s, dict) and "step" in s:
            v = s["step"]
            steps.append(checked_number(v.item() if isinstance(v, torch.Tensor) else v, file=path,  # no OverflowError
                                        field="optimizer.state.step", lo=0, hi=2**63 - 1, integer=False,
                                        error=SchemaError))
    if not steps:
        return
    step = state["progress"]["step"]
    top = max(steps)
    if top > step or (state.get("scaler") is None and top != step):
        raise SchemaError(
            "optimizer state and progress describe different instants",
            file=path,
            expected=f"per-parameter optimizer step {'<=' if state.get('scaler') else '=='} progress.step = {step}",
            found=f"max per-parameter step {top:g}",
            hint="a checkpoint must be taken at a step boundary, after a complete optimizer update",
        )


_INT64 = 2**63 - 1
#: What a restore can raise on a state that passed every check but was still not what the
#: live objects accept (a last line: each is turned into a SchemaError naming the file).
UNEXPECTED = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError, AssertionError)


def validate_saved_state(state: Any, *, where: str | Path | None = None) -> None:
    """Structural check of a training state read from disk (docs/FORMAT.md); :class:`SchemaError` only.

    The ONE validation that ``ripresa inspect --deep``, ``CheckpointStore.check(deep=True)``
    and ``CheckpointStore.load`` (hence every resume) share, so that a state
    inspect calls valid never crashes a resume: the checkpoint schema
    (:func:`~ripresa.formats.torch_pt.validate_checkpoint`: keys, types,
    progress consistent with the optimizer), progress integers in int64 range,
    optimizer param groups and per-parameter steps well formed, every random
    stream well formed and of its exact size (:func:`~ripresa.core.rng.validate_rng_state`),
    an :class:`~ripresa.EpochSampler` data position in range, scheduler and
    scaler dicts with string keys, ``extra.distributed`` per-rank records.
    Works on a companion's state (no parameters) and on a full one. What can
    only be checked against the live objects (names, shapes, groups) is
    :meth:`TrainingState.check_structure`'s.
    """
    file = where
    try:
        # Structure only: whether the optimizer's per-parameter steps equal progress.step
        # depends on the loop (gradient accumulation, skipped fp16 steps, the user's
        # numbering), and a generation its own writer committed must never be refused
        # at resume for it. checkpoint.pt keeps that rule (docs/FORMAT.md).
        validate_checkpoint(state, None if where is None else Path(where), one_instant=False)
    except SchemaError:
        raise
    except RipresaError as exc:  # pragma: no cover - validate_checkpoint raises SchemaError
        raise SchemaError(exc.message, file=file, expected=exc.expected, found=exc.found) from exc
    except UNEXPECTED as exc:
        raise SchemaError("saved state is malformed", file=file, found=f"{type(exc).__name__}: {str(exc)[:160]}") from exc

    def bad(what: str, expected: Any = None, found: Any = None) -> SchemaError:
        return SchemaError(f"saved state is malformed: {what}", file=file, expected=expected, found=found,
                           hint="the companion was edited or not written by ripresa; this generation cannot be trusted")

    for k, v in state["progress"].items():
        if type(v) is not int or not -1 <= v <= _INT64:
            raise bad(f"progress.{k}", f"an integer in -1..{_INT64}", repr(v)[:80])
    extra_keys = set(state["progress"]) - {"step", "epoch", "samples_seen", "tokens_seen"}
    if extra_keys:
        raise bad("progress has unknown keys", ["step", "epoch", "samples_seen", "tokens_seen"], sorted(map(str, extra_keys)))
    opt = state["optimizer"]
    if opt is not None:
        seen: set[int] = set()
        for i, g in enumerate(opt["param_groups"]):
            if not isinstance(g, dict) or not isinstance(g.get("params"), list) or not all(isinstance(k, str) for k in g):
                raise bad(f"optimizer.param_groups[{i}]", "a dict with a 'params' list", type(g).__name__)
            ids = g["params"]
            if not all(type(x) is int and 0 <= x <= _INT64 for x in ids) or seen & set(ids) or len(set(ids)) != len(ids):
                raise bad(f"optimizer.param_groups[{i}].params", "distinct non-negative parameter indices", str(ids)[:120])
            seen |= set(ids)
        for idx, entry in opt["state"].items():
            if type(idx) is not int or idx not in seen:
                raise bad(f"optimizer.state key {idx!r}", "the index of a parameter of a group", repr(idx)[:80])
            if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
                raise bad(f"optimizer.state[{idx}]", "a dict", type(entry).__name__)
            step = entry.get("step")
            if step is not None and not (
                (isinstance(step, torch.Tensor) and step.numel() == 1
                 and (step.dtype.is_floating_point or not (step.dtype.is_complex or step.dtype == torch.bool)))
                or (type(step) in (int, float))
            ):
                raise bad(f"optimizer.state[{idx}].step", "a number or a one-element real tensor", repr(step)[:80])
            # Other per-parameter entries may be tensors of any dtype: a user-written or
            # quantized optimizer keeps int counters or uint8 states (docs/FORMAT.md, general generation).
    for key in ("scheduler", "scaler"):
        v = state[key]
        if v is not None and not all(isinstance(k, str) for k in v):
            raise bad(f"{key} has non-string keys", "string keys", sorted(map(repr, v))[:5])
    validate_rng_state(state["rng"], "rng")
    data = state["data"]
    if isinstance(data, dict) and {"n_rows", "cursor", "permutation"} <= set(data):
        from .data import validate_sampler_state

        validate_sampler_state(data)
    if not all(isinstance(k, str) for k in state["objects"]):
        raise bad("objects has non-string names", "string names", sorted(map(repr, state["objects"]))[:5])
    for k, v in state["model"].items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise bad("model state must map names to tensors", found=f"{k!r}: {type(v).__name__}")
    rec = state["extra"].get("distributed")
    if rec is not None:
        check_distributed_record(rec, file=file)
        for r, entry in enumerate(rec["ranks"][1:], start=1):
            validate_rng_state(entry["rng"], f"extra.distributed.ranks[{r}].rng")
            d = entry["data"]
            if isinstance(d, dict) and {"n_rows", "cursor", "permutation"} <= set(d):
                from .data import validate_sampler_state

                validate_sampler_state(d, f"extra.distributed.ranks[{r}].data")


#: Largest world size a saved record may claim (torchrun jobs are far smaller).
MAX_WORLD_SIZE = 1 << 20


def check_distributed_record(rec: Any, *, file: Any = None, world_size: int | None = None) -> dict[str, Any] | None:
    """Validate ``extra.distributed`` of a saved state before anything indexes or sizes by it.

    ``None`` (a single-process save) passes. Otherwise: a dict whose
    ``world_size`` is an int in ``1..MAX_WORLD_SIZE`` (equal to ``world_size``
    when given, e.g. a ``.dcp`` companion's own), whose ``ranks`` is a list of
    exactly that many entries, entry ``r`` a dict with ``rank == r`` and the
    keys ``rng``, ``data``, ``objects`` (``objects`` a dict). Every failure is
    an :class:`~ripresa.errors.IntegrityError` naming ``file``; nothing is
    allocated from the claimed numbers (the list must already hold them).
    """
    if rec is None:
        return None

    def bad(what: str, expected: Any, found: Any) -> IntegrityError:
        return IntegrityError(f"the saved per-rank record (extra.distributed) is malformed: {what}", file=file,
                              expected=expected, found=str(found)[:160],
                              hint="the companion was edited or damaged; this generation cannot be trusted")

    if not isinstance(rec, dict):
        raise bad("not a dict", "a dict", type(rec).__name__)
    ws = rec.get("world_size")
    if type(ws) is not int or not 1 <= ws <= MAX_WORLD_SIZE:
        raise bad("world_size", f"an int in 1..{MAX_WORLD_SIZE}", repr(ws))
    if world_size is not None and ws != world_size:
        raise bad("world_size differs from the generation's", world_size, ws)
    ranks = rec.get("ranks")
    if type(ranks) is not list or len(ranks) != ws:
        raise bad("ranks", f"a list of {ws} entries (one per rank)",
                  f"{type(ranks).__name__} of {len(ranks)}" if isinstance(ranks, list) else type(ranks).__name__)
    for r, entry in enumerate(ranks):
        if not isinstance(entry, dict) or not {"rank", "rng", "data", "objects"} <= set(entry):
            raise bad(f"entry {r}", "a dict with rank, rng, data, objects", type(entry).__name__)
        if type(entry["rank"]) is not int or entry["rank"] != r:
            raise bad(f"entry {r} names another rank", r, repr(entry["rank"]))
        if not isinstance(entry["objects"], dict):
            raise bad(f"entry {r}: objects", "a dict", type(entry["objects"]).__name__)
    return rec
