"""Reading ``torch.distributed.checkpoint`` folders without unpickling untrusted bytes.

``torch.distributed.checkpoint`` as shipped trusts its files: its
``FileSystemReader.read_metadata`` is a plain ``pickle.load`` of ``.metadata``
(any global, so any code), and its ``DefaultLoadPlanner.load_bytes`` is a
``torch.load(weights_only=False)`` of every non-tensor item inside the
``.distcp`` shard files (an optimizer's hyper-parameters). A ``.dcp``
generation's commit marker holds plain sha256s, so whoever can write the
folder can make a crafted ``.metadata`` pass it (docs/FAULTS.md, hostile run
folders). Every DCP read of ripresa goes through this module instead:

* :class:`SafeFileSystemReader` reads ``.metadata`` (at most
  :data:`MAX_METADATA_BYTES`, never through a symlink or a FIFO) with
  :class:`MetadataUnpickler`, whose ``find_class`` allows only the DCP
  metadata classes, ``torch.Size``, ``torch`` dtypes and layouts and
  ``pathlib.PosixPath`` — a refused global is an
  :class:`~ripresa.errors.IntegrityError` naming the file and the global, and
  nothing of it is imported or run. It then checks what the metadata says
  against the folder before DCP uses it: every storage entry names a shard
  file of the folder (``__R_I.distcp``, no path), its byte range lies inside
  that file, and no storage transform (compression) is declared — ripresa
  never writes one. Each slice of a shard is read (bounded by that range) and
  its ``torch.save`` zip directory is checked (members stored, not
  compressed; their sizes within the slice) before ``torch.load``.
* :class:`SafeLoadPlanner` loads the non-tensor items with
  ``torch.load(weights_only=True)``.

:func:`read_metadata` is the same check for ``inspect`` and ``check_dcp``
(one validation path: what a deep check passes, a load passes too).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import IntegrityError, RipresaError

#: Largest ``.metadata`` read (bytes): a 120M-parameter model's is about 100 KB.
MAX_METADATA_BYTES = 64 * 1024 * 1024
#: The shard files DCP's ``FileSystemWriter`` writes: ``__<rank>_<index>.distcp``.
SHARD_RE = re.compile(r"^__[0-9]{1,9}_[0-9]{1,9}\.distcp$")

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
#: Every global a ``.metadata`` written by ``save_shards`` may name (module, name).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(_METADATA_MODULE, n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside :data:`ALLOWED_GLOBALS`."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` allows only DCP metadata classes.

    ``torch.<dtype>`` (e.g. ``torch.float32``) is allowed when it is a
    :class:`torch.dtype`; everything else raises :class:`RefusedGlobal`
    before anything is imported. Persistent ids are refused.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and re.fullmatch(r"[a-z0-9_]{1,32}", name):
            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype):
                return obj
        raise RefusedGlobal(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def _metadata_error(path: Path, found: str, hint: str) -> IntegrityError:
    return IntegrityError("the .dcp generation's .metadata is not a DCP index ripresa can trust", file=path,
                          expected="a DCP index naming only DCP metadata classes and the folder's own shard files",
                          found=found[:300], hint=hint)


def read_metadata(folder: str | os.PathLike[str]) -> Metadata:
    """Read, unpickle (restricted) and check ``folder/.metadata`` against the folder's shard files.

    Raises :class:`~ripresa.errors.IntegrityError` (file, expected, found,
    hint) for an oversized or special file, a refused global, a malformed
    pickle, and metadata that names files or byte ranges the folder does not
    have.
    """
    from ..io.fsio import read_small

    d = Path(folder)
    p = d / ".metadata"
    raw = read_small(p, ".dcp metadata", MAX_METADATA_BYTES, error=IntegrityError)
    try:
        md = MetadataUnpickler(io.BytesIO(raw)).load()
    except RefusedGlobal as exc:
        raise IntegrityError("the .dcp generation's .metadata names a global that is not allowed", file=p,
                             expected="only DCP metadata classes, torch.Size, torch dtypes (docs/FORMAT.md, .dcp)",
                             found=f"global {exc.module}.{exc.name}",
                             hint="this file was crafted or damaged; it was refused unread and nothing of it ran. "
                             "Never load it with torch.distributed.checkpoint's own reader") from None
    except RipresaError:
        raise
    except (Exception, RecursionError) as exc:  # a malformed pickle: any decoding error
        raise _metadata_error(p, f"{type(exc).__name__}: {exc}", "the .metadata is damaged") from None
    check_metadata(md, d)
    return md


def check_metadata(md: Any, folder: Path) -> None:
    """What DCP will use of ``md``, checked against ``folder``'s files before it is used."""
    p = folder / ".metadata"
    hint = "the .metadata does not describe this folder's shards; it was edited or belongs elsewhere"
    if type(md) is not Metadata:
        raise _metadata_error(p, f"a {type(md).__name__}", hint)
    sdm, storage = md.state_dict_metadata, md.storage_data
    if type(sdm) is not dict or type(storage) is not dict:
        raise _metadata_error(p, "state_dict_metadata or storage_data is not a dict", hint)
    for key, entry in sdm.items():
        if type(key) is not str:
            raise _metadata_error(p, f"a key of type {type(key).__name__}", hint)
        if type(entry) is TensorStorageMetadata:
            if type(entry.size) is not torch.Size or type(entry.chunks) is not list:
                raise _metadata_error(p, f"entry {key!r}: malformed tensor metadata", hint)
            for c in entry.chunks:
                if (type(c) is not ChunkStorageMetadata or type(c.offsets) is not torch.Size
                        or type(c.sizes) is not torch.Size or len(c.offsets) != len(entry.size)
                        or len(c.sizes) != len(entry.size)):
                    raise _metadata_error(p, f"entry {key!r}: malformed chunk", hint)
        elif type(entry) is not BytesStorageMetadata:
            raise _metadata_error(p, f"entry {key!r}: a {type(entry).__name__}", hint)
    sizes: dict[str, int] = {}
    for idx, info in storage.items():
        if type(idx) is not MetadataIndex or type(info) is not _StorageInfo:
            raise _metadata_error(p, f"a storage entry of type {type(idx).__name__} -> {type(info).__name__}", hint)
        rel, off, length = info.__dict__.get("relative_path"), info.__dict__.get("offset"), info.__dict__.get("length")
        if type(rel) is not str or not SHARD_RE.match(rel):
            raise _metadata_error(p, f"a storage entry names the file {str(rel)[:80]!r}", hint)
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise _metadata_error(p, f"a storage entry of {rel} has offset {off!r}, length {length!r}", hint)
        if info.__dict__.get("transform_descriptors"):
            raise _metadata_error(p, f"a storage transform {info.transform_descriptors!r} on {rel}",
                                  "ripresa never writes compressed or transformed DCP items")
        if rel not in sizes:
            try:
                st = os.lstat(folder / rel)
            except OSError:
                raise _metadata_error(p, f"a storage entry names {rel}, which the folder does not hold", hint) from None
            import stat as _stat

            if not _stat.S_ISREG(st.st_mode):
                raise _metadata_error(p, f"{rel} is not a regular file", hint)
            sizes[rel] = st.st_size
        if off + length > sizes[rel]:
            raise _metadata_error(p, f"bytes {off}..{off + length} of {rel}, which has {sizes[rel]}", hint)


def _check_slice(raw: bytes, where: str, path: Path) -> None:
    """A torch.save zip of one DCP item: every member stored (not compressed), sizes within the slice."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, OverflowError) as exc:
        raise IntegrityError("a .dcp shard item is not a torch archive", file=path, expected="a torch.save zip",
                             found=f"{where}: {type(exc).__name__}: {str(exc)[:160]}", hint="the shard is damaged") from None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(raw):
            raise IntegrityError("a .dcp shard item holds a compressed or oversized member", file=path,
                                 expected="stored members no larger than the item (torch never compresses them)",
                                 found=f"{where}: member {info.filename[:80]!r} compress_type {info.compress_type}, "
                                 f"{info.file_size} bytes", hint="the shard was crafted or damaged")


class SafeFileSystemReader(FileSystemReader):  # read_metadata: restricted allowlist Unpickler
    """DCP's ``FileSystemReader`` with a restricted, checked ``read_metadata`` and bounded item reads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._folder = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata is None:
            self._metadata = read_metadata(self._folder)
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_metadata(metadata, self._folder)  # the metadata DCP passes in is the one checked here
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> Any:
        file.seek(sinfo.offset)
        raw = file.read(sinfo.length)
        path = self._folder / sinfo.relative_path
        if len(raw) != sinfo.length:
            raise IntegrityError("a .dcp shard is shorter than its metadata says", file=path,
                                 expected=f"{sinfo.length} bytes at offset {sinfo.offset}", found=f"{len(raw)} bytes")
        _check_slice(raw, f"bytes {sinfo.offset}..{sinfo.offset + sinfo.length}", path)
        return io.BytesIO(raw)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor items load with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise IntegrityError("a .dcp shard item was refused by the safe loader (weights_only=True)",
                                 expected="numbers, strings, tuples, lists, dicts, tensors",
                                 found=f"{read_item.dest_index.fqn}: {str(exc).splitlines()[0][:200]}",
                                 hint="the shard was crafted or damaged; it was not executed") from None
        except Exception as exc:
            raise IntegrityError("a .dcp shard item could not be read", found=f"{read_item.dest_index.fqn}: "
                                 f"{type(exc).__name__}: {str(exc)[:200]}", hint="the shard is damaged") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def unwrap(exc: BaseException) -> RipresaError | None:
    """The ripresa error inside a DCP ``CheckpointException`` (DCP wraps what a reader raises)."""
    if isinstance(exc, RipresaError):
        return exc
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for pair in failures.values():
            inner = pair[0] if isinstance(pair, tuple) and pair else pair
            if isinstance(inner, RipresaError):
                return inner
    cause = exc.__cause__ or exc.__context__
    return unwrap(cause) if cause is not None and cause is not exc else None
