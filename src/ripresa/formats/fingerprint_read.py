"""The state fingerprint of a generation on disk, whatever its layout (docs/FORMAT.md, "The state fingerprint").

:func:`fingerprint_path` reads an ANDREA ``.bin`` (with or without its companion), a general ``.safetensors``
generation, a ``.shards`` folder, a ``.dcp`` folder (ripresa's or any ``torch.distributed.checkpoint`` folder), a
Hugging Face ``checkpoint-N/`` folder, a plain ``.safetensors`` file and a ``checkpoint.pt``, gives the state its
canonical names (:mod:`ripresa.formats.fingerprint`) and hashes it. The tensors of the ``.bin`` and safetensors
layouts are hashed straight from the files (each block read and hashed by one of the threads, never the whole
state in memory); a ``.dcp`` or a torch pickle is loaded first (``weights_only``, the restricted metadata reader).
Every file is opened without following links or blocking on a FIFO, every header is checked against the file's
size before use; what fails is an :class:`~ripresa.errors.IntegrityError` (exit 1) or a
:class:`~ripresa.errors.BadInput` (exit 2). The commit marker and signature are not checked: that is
``ripresa inspect --deep``'s (the fingerprint says what the bytes hold, not whether they were committed).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import stat
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput, IntegrityError, RipresaError, SchemaError
from ..io.fsio import open_run_file, read_small
from ..io.merkle import FileRange
from . import companion as companion_fmt
from . import fingerprint as fp
from . import general as general_fmt
from . import shards as shards_fmt
from .andrea_bin import FLOAT, HEADER, HEADER_SIZE
from .andrea_bin import read_header as read_bin_header
from .safetensors_file import Header, header_fd

#: A tensor of at most this many bytes is read into memory at once (the rest are hashed from the file).
SMALL = 64 * 1024
#: Largest ``optimizer.pt`` / ``scheduler.pt`` of a Hugging Face folder read (bytes).
MAX_PICKLE_BYTES = 1 << 40


class _Files(contextlib.ExitStack):
    """The files a fingerprint keeps open until its blocks are hashed."""

    def open(self, path: Path, what: str) -> int:
        fd = open_run_file(path, what, error=IntegrityError)
        self.callback(os.close, fd)
        return fd


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadInput("the path cannot be read", file=path, found=str(exc)[:160]) from None


def detect(path: Path) -> str:
    """The layout of ``path``: ``bin``, ``general``, ``safetensors``, ``pt``, ``shards``, ``dcp``, ``hf``."""
    st = _lstat(path)
    if st is None:
        raise BadInput("nothing to fingerprint at this path", file=path, expected="a generation (file or folder)",
                       found="nothing", hint="`ripresa inspect RUN` lists a run folder's generations")
    if stat.S_ISLNK(st.st_mode):
        raise BadInput("the path is a symlink", file=path, expected="a generation's file or folder", found="a symlink",
                       hint="ripresa never follows links to checkpoints; give the path itself")
    if stat.S_ISDIR(st.st_mode):
        if path.name.endswith(".shards"):
            return "shards"
        if _lstat(path / ".metadata") is not None:
            return "dcp"
        if _lstat(path / "model.safetensors") is not None or _lstat(path / "model.safetensors.index.json") is not None:
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
        return "general" if _lstat(path.with_name(path.name + ".json")) is not None else "safetensors"
    if path.suffix in (".pt", ".pth"):
        return "pt"
    raise BadInput("this file is no layout the fingerprint reads", file=path,
                   expected="a .bin, .safetensors, .pt file, or a generation folder", found=path.suffix or "no suffix")


# ---- safetensors files: placeholders for the tensors, hashed from the file --------------------------


def _read_range(fd: int, offset: int, n: int, path: Path) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise IntegrityError("a file is shorter than its header says", file=path,
                                 expected=f"{n} bytes at offset {offset}", found=f"{done} bytes",
                                 hint="the file is truncated or changed while read")
        done += got
    return buf


def _placeholders(fd: int, path: Path, header: Header, sources: dict[int, list[FileRange]],
                  keep: list[Any]) -> dict[str, torch.Tensor]:
    """key -> tensor of a safetensors file: small ones (and the 1-D ``U8``/``I64`` a companion may decode) read,
    the others meta tensors standing for their byte range (``sources``)."""
    out: dict[str, torch.Tensor] = {}
    for e in header.entries:
        dt, n = e.torch_dtype, e.end - e.begin
        if n <= SMALL or (len(e.shape) == 1 and dt in (torch.uint8, torch.int64)):
            raw = _read_range(fd, header.data_start + e.begin, n, path)
            t = torch.frombuffer(raw, dtype=dt).reshape(e.shape) if n else torch.empty(e.shape, dtype=dt)
        else:
            t = torch.empty(e.shape, dtype=dt, device="meta")
            sources[id(t)] = [FileRange(fd, header.data_start + e.begin, n, str(path))]
        keep.append(t)
        out[e.key] = t
    return out


def _join(doc: dict[str, Any], tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, Any]:
    try:
        return general_fmt.join_state(doc, tensors, path)
    except SchemaError as exc:
        raise IntegrityError(exc.message, file=exc.file, expected=exc.expected, found=exc.found, hint=exc.hint) from None


def _general(path: Path, files: _Files, sources: dict[int, list[FileRange]], keep: list[Any]) -> dict[str, Any]:
    fd = files.open(path, "tensor file")
    header = header_fd(fd, path)
    cp = path.with_name(path.name + ".json")
    doc = companion_fmt.loads_bounded(read_small(cp, "companion", general_fmt.MAX_COMPANION_BYTES, error=IntegrityError),
                                      file=cp)
    try:
        general_fmt.validate_envelope(doc, cp)
    except SchemaError as exc:
        raise IntegrityError(exc.message, file=cp, expected=exc.expected, found=exc.found, hint=exc.hint) from None
    return _join(doc, _placeholders(fd, path, header, sources, keep), cp)


def _shards(folder: Path, files: _Files, sources: dict[int, list[FileRange]], keep: list[Any]) -> dict[str, Any]:
    cp = folder / shards_fmt.COMPANION_NAME
    doc = companion_fmt.loads_bounded(read_small(cp, "companion", general_fmt.MAX_COMPANION_BYTES, error=IntegrityError),
                                      file=cp)
    shards_fmt.validate_companion(doc, cp)
    tensors: dict[str, torch.Tensor] = {}
    for rec in doc["tensors"]["shards"]:
        p = folder / rec["name"]
        fd = files.open(p, "shard")
        for k, t in _placeholders(fd, p, header_fd(fd, p), sources, keep).items():
            if k in tensors:
                raise IntegrityError("two shards hold the same tensor", file=p, found=k[:120],
                                     hint="the folder was edited; it is not a generation ripresa wrote")
            tensors[k] = t
    return _join(doc, tensors, cp)


def _plain_safetensors(paths: Sequence[Path], files: _Files, sources: dict[int, list[FileRange]],
                       keep: list[Any]) -> dict[str, torch.Tensor]:
    model: dict[str, torch.Tensor] = {}
    for p in paths:
        fd = files.open(p, "safetensors file")
        for k, t in _placeholders(fd, p, header_fd(fd, p), sources, keep).items():
            if k in model:
                raise IntegrityError("two files hold the same tensor", file=p, found=k[:120])
            model[k] = t
    return model


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


def _bin(path: Path, files: _Files, model: torch.nn.Module | None, keep: list[Any]
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
    if _lstat(cp) is not None:
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


# ---- DCP folders -------------------------------------------------------------------------------------


def _dcp_item(fd: int, offset: int, length: int, path: Path, what: str) -> Any:
    raw = _read_range(fd, offset, length, path)
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, OverflowError) as exc:
        raise IntegrityError("a .dcp shard item is not a torch archive", file=path, expected="a torch.save zip",
                             found=f"{what}: {type(exc).__name__}: {str(exc)[:160]}", hint="the shard is damaged") from None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(raw):
            raise IntegrityError("a .dcp shard item holds a compressed or oversized member", file=path,
                                 found=f"{what}: {info.filename[:80]!r}", hint="the shard was crafted or damaged")
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise IntegrityError("a .dcp shard item was refused by the safe loader (weights_only=True)", file=path,
                             found=f"{what}: {str(exc).splitlines()[0][:200]}",
                             hint="the shard was crafted or damaged; it was not executed") from None
    except Exception as exc:
        raise IntegrityError("a .dcp shard item could not be read", file=path,
                             found=f"{what}: {type(exc).__name__}: {str(exc)[:200]}", hint="the shard is damaged") from None


def _set_path(root: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    node: Any = root
    for i, k in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, dict):
            node = node.setdefault(k, [] if isinstance(nxt, int) else {})
        else:
            while len(node) <= k:
                node.append(None)
            if node[k] is None:
                node[k] = [] if isinstance(nxt, int) else {}
            node = node[k]
    last = path[-1]
    if isinstance(node, dict):
        node[last] = value
    else:
        while len(node) <= last:
            node.append(None)
        node[last] = value


def _dcp_tree(folder: Path, files: _Files) -> dict[str, Any]:
    """Every item of a DCP folder, unsharded, as the nested state DCP saved (tensors whole, in memory)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from .dcp_safe import read_metadata

    md = read_metadata(folder)
    fds: dict[str, int] = {}

    def item(fqn: str, offsets: Any = None) -> Any:
        idx = MetadataIndex(fqn, offsets) if offsets is not None else MetadataIndex(fqn)
        info = md.storage_data.get(idx)
        if info is None:
            raise IntegrityError("the .dcp metadata lists an item with no storage", file=folder / ".metadata",
                                 found=f"{fqn[:120]} at {list(offsets) if offsets is not None else '-'}")
        name = info.relative_path
        if name not in fds:
            fds[name] = files.open(folder / name, ".dcp shard")
        return _dcp_item(fds[name], info.offset, info.length, folder / name, fqn[:120])

    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    tree: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            if not isinstance(dtype, torch.dtype):
                raise IntegrityError("a .dcp tensor entry has no dtype", file=folder / ".metadata", found=fqn[:120])
            chunks = entry.chunks
            if len(chunks) == 1 and list(chunks[0].offsets) == [0] * len(entry.size) and chunks[0].sizes == entry.size:
                value = item(fqn, chunks[0].offsets)
                _check_chunk(value, tuple(entry.size), dtype, folder, fqn)
            else:
                # decided from the metadata before anything is allocated: the chunks cover the tensor's elements
                # exactly, and its bytes fit in the items that store them (a 2^48-element claim is refused here)
                covered = sum(math.prod(c.sizes) for c in chunks)
                stored = sum(getattr(md.storage_data.get(MetadataIndex(fqn, c.offsets)), "length", 0) for c in chunks)
                need = math.prod(entry.size) * dtype.itemsize
                if covered != math.prod(entry.size) or need > stored:
                    raise IntegrityError("the .dcp chunks of a tensor do not cover it exactly", file=folder / ".metadata",
                                         expected=f"{math.prod(entry.size)} elements in at least {need} stored bytes",
                                         found=f"{covered} elements in chunks of {stored} bytes",
                                         hint="the metadata was edited or a rank's shard is missing")
                value = torch.zeros(tuple(entry.size), dtype=dtype)
                for c in chunks:
                    part = item(fqn, c.offsets)
                    _check_chunk(part, tuple(c.sizes), dtype, folder, fqn)
                    value[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = part
        else:
            value = item(fqn)
        path = mappings.get(fqn)
        if not (isinstance(path, tuple) and 0 < len(path) <= 64
                and all(type(k) is str or (type(k) is int and 0 <= k <= len(md.state_dict_metadata)) for k in path)):
            path = tuple(fqn.split("."))
        try:
            _set_path(tree, path, value)
        except (TypeError, IndexError, AttributeError, KeyError) as exc:
            raise IntegrityError("the .dcp metadata's paths do not form one state", file=folder / ".metadata",
                                 found=f"{fqn[:120]}: {type(exc).__name__}",
                                 hint="the metadata was edited; it is not a folder DCP wrote") from None
    return tree


def _check_chunk(t: Any, shape: tuple[int, ...], dtype: torch.dtype, folder: Path, fqn: str) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
        raise IntegrityError("a .dcp shard item is not the tensor its metadata says", file=folder / ".metadata",
                             expected=f"{fqn[:80]}: {dtype} {list(shape)}",
                             found=f"{type(t).__name__} {getattr(t, 'dtype', '')} {list(getattr(t, 'shape', []))}"[:160])


def _index_keys(opt: Any) -> Any:
    """DCP writes the dict keys of a state as strings: an index-keyed ``optimizer.state_dict()`` comes back with
    ``"0"`` where its ``param_groups`` say ``0``; such keys are turned back into the indices they were."""
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        return opt
    indices = {i for g in opt["param_groups"] if isinstance(g, dict) for i in g.get("params", [])
               if isinstance(i, int) and not isinstance(i, bool)}
    st = opt["state"]
    if st and all(isinstance(k, str) and k.isdigit() and int(k) in indices for k in st):
        opt = dict(opt)
        opt["state"] = {int(k): v for k, v in st.items()}
    return opt


def _dcp(folder: Path, files: _Files) -> tuple[dict[str, Any], list[str]]:
    tree = _dcp_tree(folder, files)
    for key in ("optim", "optimizer"):
        if key in tree:
            tree[key] = _index_keys(tree[key])
    notes: list[str] = []
    if _lstat(folder / "ripresa.json") is not None:
        from .dcp import decode_state, read_dcp_companion

        state = decode_state(read_dcp_companion(folder), folder)
        state = dict(state)
        state["model"] = {**(state.get("model") or {}), **tree.pop("model", {})}
        state["optimizer"] = tree.pop("optim", None)
        for k, v in tree.items():
            state[f"dcp_{k}"] = v
        return state, notes
    notes.append("a DCP folder without ripresa's companion: 'model' and 'optim'/'optimizer' are read as the model and "
                 "the optimizer, every other top-level key as its own part")
    state = {"model": tree.pop("model", {}), "optimizer": tree.pop("optim", None) or tree.pop("optimizer", None)}
    state.update(tree)
    return state, notes


# ---- a Hugging Face checkpoint folder -----------------------------------------------------------------


def _torch_pickle(path: Path) -> Any:
    from .torch_pt import check_zip_directory

    raw = bytes(read_small(path, path.name, MAX_PICKLE_BYTES, error=IntegrityError))
    check_zip_directory(path, raw)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise IntegrityError(f"{path.name} was refused by the safe loader (weights_only=True)", file=path,
                             expected="tensors, numbers, strings, lists, dicts",
                             found=str(exc).splitlines()[0][:200] if str(exc) else "a refused global",
                             hint="it was not executed; a crafted pickle is never loaded") from None
    except Exception as exc:
        raise IntegrityError(f"{path.name} could not be read", file=path, found=f"{type(exc).__name__}: {str(exc)[:200]}",
                             hint="the file is damaged") from None


def _hf(folder: Path, files: _Files, sources: dict[int, list[FileRange]], keep: list[Any]) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    index = folder / "model.safetensors.index.json"
    if _lstat(index) is not None:
        doc = companion_fmt.loads_bounded(read_small(index, "index", 64 << 20, error=IntegrityError), file=index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise IntegrityError("the index has no weight_map", file=index, expected='{"weight_map": {key: file}}')
        names = sorted(set(wm.values()))
        if any("/" in n or n in ("", ".", "..") or not n.endswith(".safetensors") for n in names):
            raise IntegrityError("the index names a file outside the folder", file=index, found=str(names)[:160])
        paths = [folder / n for n in names]
    else:
        paths = [folder / "model.safetensors"]
    state: dict[str, Any] = {"model": _plain_safetensors(paths, files, sources, keep)}
    if _lstat(folder / "optimizer.pt") is not None:
        state["optimizer"] = _torch_pickle(folder / "optimizer.pt")
        if not isinstance(state["optimizer"], dict) or not isinstance(state["optimizer"].get("state"), dict):
            raise IntegrityError("optimizer.pt is not an optimizer state_dict", file=folder / "optimizer.pt",
                                 expected='{"state", "param_groups"}', found=type(state["optimizer"]).__name__)
    if _lstat(folder / "scheduler.pt") is not None:
        state["scheduler"] = _torch_pickle(folder / "scheduler.pt")
    skipped = sorted(n for n in ("rng_state.pth", "trainer_state.json", "training_args.bin", "scaler.pt")
                     if _lstat(folder / n) is not None)
    if skipped:
        notes.append("not hashed (no canonical place, or a pickle of classes never unpickled): " + ", ".join(skipped))
    return state, notes


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
    with _Files() as files:
        if layout == "bin":
            items, sources, notes = _bin(p, files, model, keep)
        else:
            if layout == "general":
                state = _general(p, files, sources, keep)
            elif layout == "shards":
                state = _shards(p, files, sources, keep)
            elif layout == "safetensors":
                state = {"model": _plain_safetensors([p], files, sources, keep)}
            elif layout == "pt":
                state = _torch_pickle(p)
                if not isinstance(state, dict):
                    raise IntegrityError("the .pt file does not hold a dict", file=p, found=type(state).__name__)
                if "model" not in state:  # a bare state_dict
                    state = {"model": state}
            elif layout == "dcp":
                state, notes = _dcp(p, files)
            else:
                state, notes = _hf(p, files, sources, keep)
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
