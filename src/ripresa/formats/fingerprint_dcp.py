"""The state trees of a DCP folder and of a Hugging Face ``checkpoint-N/`` folder, for the state fingerprint
(docs/FORMAT.md, "The state fingerprint").

:func:`dcp_state`: every item of a ``torch.distributed.checkpoint`` folder (ripresa's ``.dcp`` or any other),
its ``.metadata`` through the restricted reader of :mod:`ripresa.formats.dcp_safe`; a tensor whose chunks are
plain archives split by rows is hashed in place (:mod:`ripresa.formats.fingerprint_distcp`), any other item is
loaded with ``weights_only`` and its tensor assembled whole from its chunks (its size decided from the metadata
and bounded by the bytes that store it before anything is allocated). :func:`hf_state`: ``model.safetensors`` (or
its sharded index) as placeholders hashed from the files, ``optimizer.pt`` and ``scheduler.pt`` loaded with
``weights_only`` after their zip directory is checked.
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError
from ..io.fsio import read_small
from ..io.merkle import FileRange
from . import companion as companion_fmt
from .fingerprint_distcp import chunk_range, tensor_segments
from .fingerprint_files import OpenFiles, lstat_or_none, plain_safetensors, read_range

#: Largest ``optimizer.pt`` / ``scheduler.pt`` / ``checkpoint.pt`` read (bytes; read whole, as torch loads it).
MAX_PICKLE_BYTES = 1 << 40


def _dcp_item(fd: int, offset: int, length: int, path: Path, what: str) -> Any:
    raw = read_range(fd, offset, length, path)
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


def _dcp_tree(folder: Path, files: OpenFiles, sources: dict[int, list[FileRange]], keep: list[Any]) -> dict[str, Any]:
    """Every item of a DCP folder, unsharded, as the nested state DCP saved: a tensor whose chunks are plain
    archives split by rows is a placeholder for their byte ranges (``sources``, hashed in place); any other is
    loaded whole into memory."""
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
        return _dcp_item(fd_of(info.relative_path), info.offset, info.length, folder / info.relative_path, fqn[:120])

    def fd_of(name: str) -> int:
        if name not in fds:
            fds[name] = files.open(folder / name, ".dcp shard")
        return fds[name]

    def in_place(fqn: str, entry: Any, dtype: torch.dtype) -> torch.Tensor | None:
        found = []
        for c in entry.chunks:
            info = md.storage_data.get(MetadataIndex(fqn, c.offsets))
            if info is None:
                return None
            r = chunk_range(fd_of(info.relative_path), info.offset, info.length, str(folder / info.relative_path),
                            dtype, tuple(c.sizes))
            if r is None:
                return None
            found.append((tuple(c.offsets), tuple(c.sizes), r))
        segments = tensor_segments(tuple(entry.size), found)
        if segments is None:
            return None
        t = torch.empty(tuple(entry.size), dtype=dtype, device="meta")
        sources[id(t)] = segments
        keep.append(t)
        return t

    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    tree: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = entry.properties.dtype
            if not isinstance(dtype, torch.dtype):
                raise IntegrityError("a .dcp tensor entry has no dtype", file=folder / ".metadata", found=fqn[:120])
            chunks = entry.chunks
            placed = in_place(fqn, entry, dtype)
            if placed is not None:
                value = placed
            elif len(chunks) == 1 and list(chunks[0].offsets) == [0] * len(entry.size) and chunks[0].sizes == entry.size:
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


def dcp_state(folder: Path, files: OpenFiles, sources: dict[int, list[FileRange]], keep: list[Any]
              ) -> tuple[dict[str, Any], list[str]]:
    """The state of a DCP folder (ripresa's ``.dcp``: with its companion's rest) and notes."""
    tree = _dcp_tree(folder, files, sources, keep)
    for key in ("optim", "optimizer"):
        if key in tree:
            tree[key] = _index_keys(tree[key])
    notes: list[str] = []
    if lstat_or_none(folder / "ripresa.json") is not None:
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


def torch_pickle(path: Path) -> Any:
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


def hf_state(folder: Path, files: OpenFiles, sources: dict[int, list[FileRange]], keep: list[Any]) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    index = folder / "model.safetensors.index.json"
    if lstat_or_none(index) is not None:
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
    state: dict[str, Any] = {"model": plain_safetensors(paths, files, sources, keep)}
    if lstat_or_none(folder / "optimizer.pt") is not None:
        state["optimizer"] = torch_pickle(folder / "optimizer.pt")
        if not isinstance(state["optimizer"], dict) or not isinstance(state["optimizer"].get("state"), dict):
            raise IntegrityError("optimizer.pt is not an optimizer state_dict", file=folder / "optimizer.pt",
                                 expected='{"state", "param_groups"}', found=type(state["optimizer"]).__name__)
    if lstat_or_none(folder / "scheduler.pt") is not None:
        state["scheduler"] = torch_pickle(folder / "scheduler.pt")
    skipped = sorted(n for n in ("rng_state.pth", "trainer_state.json", "training_args.bin", "scaler.pt")
                     if lstat_or_none(folder / n) is not None)
    if skipped:
        notes.append("not hashed (no canonical place, or a pickle of classes never unpickled): " + ", ".join(skipped))
    return state, notes
