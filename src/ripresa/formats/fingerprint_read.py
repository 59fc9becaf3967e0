"""The state fingerprint of a generation on disk, whatever its layout (docs/FORMAT.md, "The state fingerprint").

:func:`fingerprint_path` reads an ANDREA ``.bin`` (with or without its companion), a general ``.safetensors``
generation, a ``.shards`` folder, a ``.dcp`` folder (ripresa's or any ``torch.distributed.checkpoint`` folder), a
Hugging Face ``checkpoint-N/`` folder, a plain ``.safetensors`` file and a ``checkpoint.pt``, gives the state its
canonical names (:mod:`ripresa.formats.fingerprint`) and hashes it. The tensors of the ``.bin`` and safetensors
layouts, and a ``.dcp``'s plain archives (:mod:`ripresa.formats.fingerprint_distcp`), are hashed straight from the
files (each block read and hashed by one of the threads, never the whole state in memory); any other ``.dcp`` item
and a torch pickle are loaded first (``weights_only``, the restricted metadata reader).
Every file is opened without following links or blocking on a FIFO, every header is checked against the file's
size before use; what fails is an :class:`~ripresa.errors.IntegrityError` (exit 1) or a
:class:`~ripresa.errors.BadInput` (exit 2). The commit marker and signature are not checked: that is
``ripresa inspect --deep``'s (the fingerprint says what the bytes hold, not whether they were committed).
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput, IntegrityError, RipresaError, SchemaError
from ..io.fsio import read_small
from ..io.merkle import FileRange
from . import companion as companion_fmt
from . import fingerprint as fp
from . import general as general_fmt
from . import shards as shards_fmt
from .andrea_bin import FLOAT, HEADER, HEADER_SIZE
from .andrea_bin import read_header as read_bin_header
from .fingerprint_dcp import dcp_state, hf_state, torch_pickle
from .fingerprint_files import OpenFiles, lstat_or_none, placeholders, plain_safetensors
from .safetensors_file import header_fd


def detect(path: Path) -> str:
    """The layout of ``path``: ``bin``, ``general``, ``safetensors``, ``pt``, ``shards``, ``dcp``, ``hf``."""
    st = lstat_or_none(path)
    if st is None:
        raise BadInput("nothing to fingerprint at this path", file=path, expected="a generation (file or folder)",
                       found="nothing", hint="`ripresa inspect RUN` lists a run folder's generations")
    if stat.S_ISLNK(st.st_mode):
        raise BadInput("the path is a symlink", file=path, expected="a generation's file or folder", found="a symlink",
                       hint="ripresa never follows links to checkpoints; give the path itself")
    if stat.S_ISDIR(st.st_mode):
        if path.name.endswith(".shards"):
            return "shards"
        if lstat_or_none(path / ".metadata") is not None:
            return "dcp"
        if lstat_or_none(path / "model.safetensors") is not None or lstat_or_none(path / "model.safetensors.index.json") is not None:
            return "hf"
        raise BadInput("this folder is no layout the fingerprint reads", file=path,
                       expected="a .shards or .dcp generation, a DCP folder (.metadata), a Hugging Face checkpoint "
                       "folder (model.safetensors)", found="none of them",
                       hint="give a generation: `ripresa inspect RUN` lists them")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput("the path is not a regular file", file=path, expected="a generation's file or folder",
                       found="a special file (FIFO, socket or device)", hint="ripresa never reads from special files")
    if path.suffix == ".bin":
        return "bin"
    if path.suffix == ".safetensors":
        return "general" if lstat_or_none(path.with_name(path.name + ".json")) is not None else "safetensors"
    if path.suffix in (".pt", ".pth"):
        return "pt"
    raise BadInput("this file is no layout the fingerprint reads", file=path,
                   expected="a .bin, .safetensors, .pt file, or a generation folder", found=path.suffix or "no suffix")


# ---- safetensors files: placeholders for the tensors, hashed from the file --------------------------


def _join(doc: dict[str, Any], tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, Any]:
    try:
        return general_fmt.join_state(doc, tensors, path)
    except SchemaError as exc:
        raise IntegrityError(exc.message, file=exc.file, expected=exc.expected, found=exc.found, hint=exc.hint) from None


def _general(path: Path, files: OpenFiles, sources: dict[int, list[FileRange]], keep: list[Any]) -> dict[str, Any]:
    fd = files.open(path, "tensor file")
    header = header_fd(fd, path)
    cp = path.with_name(path.name + ".json")
    doc = companion_fmt.loads_bounded(read_small(cp, "companion", general_fmt.MAX_COMPANION_BYTES, error=IntegrityError),
                                      file=cp)
    try:
        general_fmt.validate_envelope(doc, cp)
    except SchemaError as exc:
        raise IntegrityError(exc.message, file=cp, expected=exc.expected, found=exc.found, hint=exc.hint) from None
    return _join(doc, placeholders(fd, path, header, sources, keep), cp)


def _shards(folder: Path, files: OpenFiles, sources: dict[int, list[FileRange]], keep: list[Any]) -> dict[str, Any]:
    cp = folder / shards_fmt.COMPANION_NAME
    doc = companion_fmt.loads_bounded(read_small(cp, "companion", general_fmt.MAX_COMPANION_BYTES, error=IntegrityError),
                                      file=cp)
    shards_fmt.validate_companion(doc, cp)
    tensors: dict[str, torch.Tensor] = {}
    for rec in doc["tensors"]["shards"]:
        p = folder / rec["name"]
        fd = files.open(p, "shard")
        for k, t in placeholders(fd, p, header_fd(fd, p), sources, keep).items():
            if k in tensors:
                raise IntegrityError("two shards hold the same tensor", file=p, found=k[:120],
                                     hint="the folder was edited; it is not a generation ripresa wrote")
            tensors[k] = t
    return _join(doc, tensors, cp)


# ---- the ANDREA .bin ---------------------------------------------------------------------------------


def _bin_names(state: Mapping[str, Any] | None, n_params: int, model: torch.nn.Module | None
               ) -> tuple[list[tuple[str, tuple[int, ...]]] | None, str]:
    """(name, shape) of each parameter in the ``.bin``'s order, and how they were found; None: positional."""
    if model is not None:
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        if sum(math.prod(s) for _, s in named) != n_params:
            raise BadInput("the model given has another number of parameters than the .bin", expected=n_params,
                           found=sum(math.prod(s) for _, s in named), hint="build the model of the run's config")
        return named, "parameter names from the model given"
    if state is None:
        return None, "no companion: the .bin is hashed positionally (model/@all, optimizer/@all/...)"
    rec, opt = state.get("optimizer_params"), state.get("optimizer")
    groups = opt.get("param_groups") if isinstance(opt, Mapping) else None
    if (isinstance(rec, list) and isinstance(groups, list) and len(groups) == 1
            and all(isinstance(r, Mapping) and isinstance(r.get("name"), str) and isinstance(r.get("shape"), list)
                    and all(type(d) is int and d >= 0 for d in r["shape"]) for r in rec)
            and [r.get("index") for r in rec] == list(range(len(rec))) == list(groups[0].get("params", []))
            and sum(math.prod(r["shape"]) for r in rec) == n_params):
        return [(r["name"], tuple(r["shape"])) for r in rec], \
            "parameter names from the companion's optimizer record (one parameter group, every parameter)"
    return None, ("the companion does not say which parameter each .bin offset holds (several parameter groups, or "
                  "parameters without optimizer state): hashed positionally; pass the model to name them")


def _bin(path: Path, files: OpenFiles, model: torch.nn.Module | None, keep: list[Any]
         ) -> tuple[list[tuple[str, Any]], dict[int, list[FileRange]], list[str]]:
    head = read_bin_header(path)
    fd = files.open(path, "ANDREA .bin")
    size = os.fstat(fd).st_size
    if size != head.file_size or os.pread(fd, HEADER_SIZE, 0) != HEADER.pack(head.step, head.n_params):
        raise IntegrityError("the .bin changed while it was read", file=path, expected=f"{head.file_size} bytes",
                             found=f"{size} bytes", hint="another process is writing it; fingerprint it again")
    cp = path.with_name(path.stem + ".json")
    state: dict[str, Any] | None = None
    notes: list[str] = []
    if lstat_or_none(cp) is not None:
        doc = companion_fmt.read_companion(cp)
        try:
            state = companion_fmt.decode_tree(doc["state"], "companion.state")
        except RipresaError:
            raise
        except (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                RuntimeError, MemoryError) as exc:
            raise IntegrityError("companion is malformed: its state cannot be decoded", file=cp,
                                 found=f"{type(exc).__name__}: {str(exc)[:160]}") from None
        if not isinstance(state, dict) or doc["bin"]["n_params"] != head.n_params:
            raise IntegrityError("the companion does not describe this .bin", file=cp, expected=head.n_params,
                                 found=doc["bin"]["n_params"])
    names, how = _bin_names(state, head.n_params, model)
    notes.append(how)
    sources: dict[int, list[FileRange]] = {}
    items: list[tuple[str, Any]] = []
    with_state: set[Any] | None = None  # the parameters the optimizer held state for (None: all)
    n = head.n_params
    itemsz = FLOAT.itemsize

    def region(r: int, start: int, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device="meta")
        sources[id(t)] = [FileRange(fd, HEADER_SIZE + (r * n + start) * itemsz, math.prod(shape) * itemsz, str(path))]
        keep.append(t)  # the placeholder (its id) stays alive until the fingerprint is made
        return t

    if state is not None:
        rest, more = fp.canonical_items(state, param_names=None)
        notes += more
        items += rest
        opt, rec = state.get("optimizer"), state.get("optimizer_params")
        if isinstance(opt, Mapping) and isinstance(rec, list) and names is not None:
            by_index = {r.get("index"): r.get("name") for r in rec if isinstance(r, Mapping)}
            with_state = {by_index.get(i) for i in (opt.get("state") or {})}
    else:
        items.append(("bin/step", head.step))
    off = 0
    if names is None:
        items += [("model/@all", region(0, 0, (n,))), ("optimizer/@all/exp_avg", region(1, 0, (n,))),
                  ("optimizer/@all/exp_avg_sq", region(2, 0, (n,)))]
    else:
        placed: dict[str, torch.Tensor] = {}
        for name, shape in names:
            k = math.prod(shape)
            placed[name] = region(0, off, shape)
            items.append((f"model/{name}", placed[name]))
            if with_state is None or name in with_state:
                items.append((f"optimizer/{name}/exp_avg", region(1, off, shape)))
                items.append((f"optimizer/{name}/exp_avg_sq", region(2, off, shape)))
            off += k
        if model is not None:  # a tied weight under each of its state_dict names, as the other layouts hold it
            first = {id(p): n for n, p in model.named_parameters()}
            for alias, t in model.state_dict(keep_vars=True).items():
                if isinstance(t, torch.nn.Parameter) and alias not in placed and first.get(id(t)) in placed:
                    items.append((f"model/{alias}", placed[first[id(t)]]))
    return items, sources, notes


# ---- the entry point --------------------------------------------------------------------------------


def fingerprint_path(path: str | os.PathLike[str], *, model: torch.nn.Module | None = None,
                     param_names: Sequence[str] | None = None, threads: int | None = None,
                     progress: Callable[[int], None] | None = None) -> fp.Fingerprint:
    """The :class:`~ripresa.formats.fingerprint.Fingerprint` of the generation at ``path`` (any layout).

    ``model``: a module (any device, ``meta`` too) whose ``named_parameters()`` names a ``.bin``'s offsets.
    ``param_names``: the parameters' names in the optimizer's order, for a layout that keeps the optimizer by index
    without saying whose (a Hugging Face ``optimizer.pt``, a state without ``optimizer_params``). ``threads``: how
    many threads hash (default: the CPUs this process may use). ``progress(n)``: ``n`` more bytes hashed.
    Raises :class:`~ripresa.errors.IntegrityError` (exit 1) or :class:`~ripresa.errors.BadInput` (exit 2).
    """
    p = Path(path)
    layout = detect(p)
    sources: dict[int, list[FileRange]] = {}
    keep: list[Any] = []
    notes: list[str] = []
    with OpenFiles() as files:
        if layout == "bin":
            items, sources, notes = _bin(p, files, model, keep)
        else:
            if layout == "general":
                state = _general(p, files, sources, keep)
            elif layout == "shards":
                state = _shards(p, files, sources, keep)
            elif layout == "safetensors":
                state = {"model": plain_safetensors([p], files, sources, keep)}
            elif layout == "pt":
                state = torch_pickle(p)
                if not isinstance(state, dict):
                    raise IntegrityError("the .pt file does not hold a dict", file=p, found=type(state).__name__)
                if "model" not in state:  # a bare state_dict
                    state = {"model": state}
            elif layout == "dcp":
                state, notes = dcp_state(p, files, sources, keep)
            else:
                state, notes = hf_state(p, files, sources, keep)
            try:
                items, more = fp.canonical_items(state, param_names=param_names)
            except (TypeError, AttributeError, KeyError, ValueError, RecursionError) as exc:
                raise IntegrityError("the generation's state is not shaped as a training state", file=p,
                                     expected="model, optimizer (state, param_groups), ... (docs/FORMAT.md)",
                                     found=f"{type(exc).__name__}: {str(exc)[:160]}",
                                     hint="it was edited or not written by a trainer") from None
            notes = [*notes, *more]
        try:
            leaves = fp.canonical_leaves(items, sources)
        except ValueError as exc:
            raise IntegrityError("the generation names one value twice", file=p, found=str(exc)[:160]) from None
        except RecursionError:
            raise IntegrityError("the generation holds a value nested too deeply", file=p, expected="<= 64 levels",
                                 hint="it was crafted; it is not hashed") from None
        return fp.fingerprint_leaves(leaves, threads=threads, notes=notes, layout=layout, progress=progress)
