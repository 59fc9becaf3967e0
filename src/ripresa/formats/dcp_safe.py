"""Reading ``torch.distributed.checkpoint`` folders without unpickling untrusted bytes (docs/FORMAT.md).

DCP as shipped ``pickle.load``s ``.metadata`` and ``torch.load(weights_only=False)``s non-tensor
items; every DCP read of ripresa goes through this module instead ("Reading ``.metadata`` and
shard items", "Loading exactly the verified bytes"): :class:`SafeFileSystemReader` with the
restricted, bounded :class:`MetadataUnpickler` (allowed globals only; every storage entry checked
against the folder), :class:`SafeLoadPlanner` (``weights_only=True``), and :class:`VerifiedFiles`
(every file read once while hashed against the check's sha256s). :func:`read_metadata` is the same
check for ``inspect`` and ``check_dcp``. Every refusal is an :class:`~ripresa.errors.IntegrityError`.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
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
from .companion import brief
from .companion import check_shape as shape_bound

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


#: Most entries the unpickler's memo may hold (a real 120M-parameter ``.metadata`` memoizes a few thousand).
MAX_MEMO = 1 << 20
#: Most work units one ``.metadata`` may cost: one per opcode, plus one per item a container
#: opcode gathers or copies (``APPENDS``, ``SETITEMS``, ``TUPLE``, ``BUILD``, ``REDUCE`` ...) and one per
#: node of a key measured before it is hashed. One unit allocates at most about 64 bytes (an empty list
#: and its stack slot), so a hostile pickle is refused before it takes about 512 MB; a real ``.metadata``
#: costs about 0.75 units per byte (about 150 per storage entry: some 55 000 entries, e.g. 600 tensors
#: sharded over 64 ranks, fit).
MAX_PICKLE_UNITS = 8 << 20
#: Deepest nesting of the unpickled index (a real one nests 6 levels: Metadata, dict, entry, list, chunk, Size).
MAX_METADATA_DEPTH = 32


class MetadataTooCostly(pickle.UnpicklingError):
    """The pickle asked for more memo entries or work than :data:`MAX_MEMO` / :data:`MAX_PICKLE_UNITS`."""


def _weight(obj: Any) -> int:
    """Items a constructor or ``BUILD`` copies out of ``obj``: its length plus its containers' (one level)."""
    if isinstance(obj, (list, tuple, dict, set, frozenset)):
        inner = obj.values() if isinstance(obj, dict) else obj
        return len(obj) + sum(len(v) for v in inner if isinstance(v, (list, tuple, dict, set, frozenset)))
    return 0


def _key_nodes(keys: Any, limit: int) -> int:
    """Nodes of the objects ``keys`` (about to be hashed), walked iteratively; nesting deeper than ``limit`` raises.

    CPython hashes a tuple recursively in C with no recursion guard: a key of
    a few million nested ``TUPLE1`` opcodes would crash the interpreter
    (a segmentation fault, not an exception), so every key is measured
    before a dict, set or ``OrderedDict`` hashes it.
    """
    n = 0
    stack = [(k, 1) for k in keys]
    while stack:
        obj, depth = stack.pop()
        n += 1
        if type(obj) in (str, int, float, bool, bytes) or obj is None:
            continue
        if depth > limit:
            raise MetadataTooCostly(f"a key nested deeper than {limit} levels")
        if isinstance(obj, (tuple, frozenset, list)):
            stack.extend((c, depth + 1) for c in obj)
        elif hasattr(obj, "__dict__"):
            stack.extend((c, depth + 1) for c in vars(obj).values())
    return n


def _keys_of(u: MetadataUnpickler, code: bytes) -> Any:
    """What the opcode ``code`` is about to hash, from the unpickler's stack."""
    st = u.stack
    if code == pickle.SETITEM:
        return st[-2:-1]
    if code in (pickle.SETITEMS, pickle.DICT):
        return st[0::2]
    if code in (pickle.ADDITEMS, pickle.FROZENSET):
        return st
    if code == pickle.REDUCE and len(st) >= 2 and st[-2] is OrderedDict and type(st[-1]) is tuple and st[-1]:
        pairs = st[-1][0]
        return [p[0] for p in pairs if type(p) in (tuple, list) and p] if type(pairs) in (list, tuple) else ()
    return ()


def _metered(fn: Any, cost: Any, code: bytes = b"", hashes: bool = False) -> Any:
    def op(self: MetadataUnpickler) -> None:
        self._units += 1 + cost(self)
        if hashes:
            self._units += _key_nodes(_keys_of(self, code), MAX_METADATA_DEPTH)
        if self._units > self.max_units:
            raise MetadataTooCostly(f"more than {self.max_units} work units (a pickle bomb)")
        fn(self)

    return op


def _memo_put(fn: Any) -> Any:
    def op(self: MetadataUnpickler) -> None:
        before = len(self.memo)
        fn(self)
        if len(self.memo) > before and len(self.memo) > self.max_memo:
            raise MetadataTooCostly(f"more than {self.max_memo} memo entries")

    return op


def _refused_op(name: str) -> Any:
    def op(self: MetadataUnpickler) -> None:
        raise pickle.UnpicklingError(f"the opcode {name} is not allowed in DCP metadata")

    return op


def _dispatch() -> dict[int, Any]:
    """The pure-Python unpickler's opcodes, each metered; the memo a bounded dict; extensions and buffers refused."""
    base = pickle._Unpickler.dispatch  # type: ignore[attr-defined]
    items = {pickle.APPENDS, pickle.SETITEMS, pickle.TUPLE, pickle.LIST, pickle.DICT, pickle.OBJ, pickle.INST,
             pickle.ADDITEMS, pickle.FROZENSET}
    top = {pickle.BUILD, pickle.REDUCE, pickle.NEWOBJ, pickle.NEWOBJ_EX}
    hashing = {pickle.SETITEM, pickle.SETITEMS, pickle.DICT, pickle.ADDITEMS, pickle.FROZENSET, pickle.REDUCE}
    puts = {pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE}
    refused = {pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER,
               pickle.PERSID, pickle.BINPERSID}
    out: dict[int, Any] = {}
    for code, fn in base.items():
        op = bytes([code])
        if op in refused:
            out[code] = _refused_op(fn.__name__[len("load_"):].upper())
            continue
        if op in puts:
            fn = _memo_put(fn)
        if op in items:
            cost = lambda u: len(u.stack)  # noqa: E731 - the items since the mark
        elif op in top:
            cost = lambda u: sum(_weight(x) for x in u.stack[-3:])  # noqa: E731 - args, kwargs or state
        else:
            cost = lambda u: 0  # noqa: E731
        out[code] = _metered(fn, cost, op, op in hashing)
    return out


class MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """The pure-Python ``pickle`` unpickler, restricted and bounded.

    ``find_class`` allows only DCP metadata classes: ``torch.<dtype>`` (e.g.
    ``torch.float32``) is allowed when it is a :class:`torch.dtype`;
    everything else raises :class:`RefusedGlobal` before anything is
    imported. Persistent ids, extension codes and out-of-band buffers are
    refused. Memory is bounded by design, not by luck: the memo is a dict
    (an index such as ``LONG_BINPUT 0x7fffffff`` costs one entry, never a
    table sized by the index) of at most :data:`MAX_MEMO` entries, and every
    opcode is metered (:data:`MAX_PICKLE_UNITS`, items gathered or copied
    counted), so 11 hostile bytes cannot allocate gigabytes. The unpickler
    is iterative (no recursion, whatever the nesting).
    """

    dispatch = _dispatch()

    def __init__(self, file: Any, *, max_units: int | None = None, max_memo: int = MAX_MEMO) -> None:
        super().__init__(file)
        self._units = 0
        self.max_units = MAX_PICKLE_UNITS if max_units is None else max_units
        self.max_memo = max_memo

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


_ATOMS = (str, int, float, bool, type(None), bytes, torch.dtype, torch.layout, torch.memory_format)


def check_shape(md: Any, path: Path, *, max_depth: int = MAX_METADATA_DEPTH, max_nodes: int = MAX_PICKLE_UNITS) -> None:
    """The unpickled index is a tree of bounded depth: checked iteratively before anything walks it.

    A deep structure made only of allowed classes, a cycle, or a container
    reached twice (a "billion laughs" DAG that any recursive consumer would
    expand) is an :class:`~ripresa.errors.IntegrityError` — never a
    ``RecursionError`` — so a resume falls back to the previous generation.
    Flat tuples (``torch.Size``, tuples of strings and numbers) may be shared.
    """
    import enum

    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(md, 0)]
    nodes = 0
    while stack:
        obj, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise _metadata_error(path, f"more than {max_nodes} objects", "the .metadata was crafted or damaged")
        if isinstance(obj, _ATOMS) or isinstance(obj, enum.Enum) or isinstance(obj, os.PathLike):
            continue
        if isinstance(obj, tuple) and all(isinstance(x, _ATOMS) for x in obj):
            continue  # flat: torch.Size, a tuple of names (may be shared)
        if depth >= max_depth:
            raise _metadata_error(path, f"nesting deeper than {max_depth} levels",
                                  "a real DCP index nests about 6 levels; this one was crafted")
        if id(obj) in seen:
            raise _metadata_error(path, f"a {type(obj).__name__} reached twice (a cycle or a shared container)",
                                  "DCP never shares containers in its index; this one was crafted")
        seen.add(id(obj))
        if isinstance(obj, dict):
            children: Any = [x for kv in obj.items() for x in kv]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj
        elif type(obj).__module__.startswith("torch.distributed.checkpoint") and hasattr(obj, "__dict__"):
            children = list(vars(obj).values())
        else:
            raise _metadata_error(path, f"an object of type {type(obj).__name__}", "the .metadata was crafted")
        stack.extend((c, depth + 1) for c in children)


def _metadata_error(path: Path, found: str, hint: str) -> IntegrityError:
    return IntegrityError("the .dcp generation's .metadata is not a DCP index ripresa can trust", file=path,
                          expected="a DCP index naming only DCP metadata classes and the folder's own shard files",
                          found=found[:300], hint=hint)


def read_metadata(folder: str | os.PathLike[str], *, raw: bytes | None = None,
                  sizes: Mapping[str, int] | None = None) -> Metadata:
    """Read, unpickle (restricted, bounded) and check ``folder/.metadata`` against the folder's shard files.

    ``raw``: the ``.metadata`` bytes already read and verified (a load passes
    the bytes it hashed, :class:`VerifiedFiles`); else the file is read once,
    bounded. ``sizes``: the verified size of each shard file (else each is
    ``lstat``-ed). Raises :class:`~ripresa.errors.IntegrityError` (file,
    expected, found, hint) for an oversized or special file, a refused
    global, a malformed pickle, a memo or work bomb, a structure too deep,
    cyclic or shared, and metadata that names files or byte ranges the
    folder does not have.
    """
    from ..io.fsio import read_small

    d = Path(folder)
    p = d / ".metadata"
    if raw is None:
        raw = read_small(p, ".dcp metadata", MAX_METADATA_BYTES, error=IntegrityError)
    try:
        md = MetadataUnpickler(io.BytesIO(raw)).load()
    except RefusedGlobal as exc:
        raise IntegrityError("the .dcp generation's .metadata names a global that is not allowed", file=p,
                             expected="only DCP metadata classes, torch.Size, torch dtypes (docs/FORMAT.md, .dcp)",
                             found=f"global {exc.module}.{exc.name}",
                             hint="this file was crafted or damaged; it was refused unread and nothing of it ran. "
                             "Never load it with torch.distributed.checkpoint's own reader") from None
    except MetadataTooCostly as exc:
        raise _metadata_error(p, f"{exc} in {len(raw)} bytes",
                              "the .metadata was crafted to exhaust memory; it was refused before it could") from None
    except RipresaError:
        raise
    except (Exception, RecursionError, MemoryError) as exc:  # a malformed pickle: any decoding error
        raise _metadata_error(p, f"{type(exc).__name__}: {str(exc)[:200]}", "the .metadata is damaged") from None
    check_shape(md, p)
    check_metadata(md, d, sizes=sizes)
    return md


def check_metadata(md: Any, folder: Path, *, sizes: Mapping[str, int] | None = None) -> None:
    """What DCP will use of ``md``, checked against ``folder``'s files (or their verified ``sizes``) before use."""
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
            shape_bound(entry.size, f".dcp metadata: entry {brief(key, 80)}", file=p)  # the one shape bound
            for c in entry.chunks:
                shape_bound(c.sizes, f".dcp metadata: a chunk of {brief(key, 80)}", file=p)
                if any(o < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, entry.size, strict=True)):
                    raise _metadata_error(p, f"entry {brief(key, 80)}: a chunk at {list(c.offsets)} of "
                                             f"{list(c.sizes)} outside its tensor of {list(entry.size)}", hint)
        elif type(entry) is not BytesStorageMetadata:
            raise _metadata_error(p, f"entry {key!r}: a {type(entry).__name__}", hint)
    known: dict[str, int] = {}
    for idx, info in storage.items():
        if type(idx) is not MetadataIndex or type(info) is not _StorageInfo:
            raise _metadata_error(p, f"a storage entry of type {type(idx).__name__} -> {type(info).__name__}", hint)
        if type(idx.fqn) is not str:
            raise _metadata_error(p, f"a storage index names {type(idx.fqn).__name__}", hint)
        rel, off, length = info.__dict__.get("relative_path"), info.__dict__.get("offset"), info.__dict__.get("length")
        if type(rel) is not str or not SHARD_RE.match(rel):
            raise _metadata_error(p, f"a storage entry names the file {str(rel)[:80]!r}", hint)
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise _metadata_error(p, f"a storage entry of {rel} has offset {off!r}, length {length!r}", hint)
        if info.__dict__.get("transform_descriptors"):
            raise _metadata_error(p, f"a storage transform {info.transform_descriptors!r} on {rel}",
                                  "ripresa never writes compressed or transformed DCP items")
        if rel not in known:
            if sizes is not None:
                if rel not in sizes:
                    raise _metadata_error(p, f"a storage entry names {rel}, which the folder does not hold", hint)
                known[rel] = sizes[rel]
            else:
                try:
                    st = os.lstat(folder / rel)
                except OSError:
                    raise _metadata_error(p, f"a storage entry names {rel}, which the folder does not hold", hint) from None
                if not stat.S_ISREG(st.st_mode):
                    raise _metadata_error(p, f"{rel} is not a regular file", hint)
                known[rel] = st.st_size
        if off + length > known[rel]:
            raise _metadata_error(p, f"bytes {off}..{off + length} of {rel}, which has {known[rel]}", hint)


class VerifiedFiles:
    """The files of one ``.dcp`` generation, each read whole into memory while hashed, then verified.

    ``expected`` is ``{file name: sha256}`` as the generation's check found it
    (the commit marker, authenticated by the signature under
    require-signature: :attr:`ripresa.formats.generation.Generation.files`).
    :meth:`read` opens the file once through the safe opener (no symlink, no
    FIFO, a regular file), reads it into one buffer while hashing it, and
    returns the buffer only when the digest is the expected one: the bytes
    DCP is then given are exactly the bytes verified. A file swapped, edited
    or grown between the check and the load is an
    :class:`~ripresa.errors.IntegrityError` (nothing of it is used).
    """

    def __init__(self, folder: str | os.PathLike[str], expected: Mapping[str, str], sizes: Mapping[str, int], *,
                 fetch: Any = None) -> None:
        self.folder = Path(folder)
        #: ``fetch(name, sha256, size)`` lands a file the folder lacks (a node's part: docs/DISTRIBUTED.md)
        self.fetch = fetch
        self.expected = dict(expected)
        #: each file's committed size (the companion's ``files``, read from the bytes its marker hash covers)
        self.sizes = dict(sizes)
        self._cache: dict[str, memoryview] = {}

    def read(self, name: str, *, keep: bool = False) -> memoryview:
        """The verified bytes of ``name`` (kept for later calls with ``keep``)."""
        from ..io.fsio import open_run_file
        from ..io.hashing import read_whole_hashing

        if name in self._cache:
            return self._cache[name]
        p = self.folder / name
        want = self.expected.get(name)
        if want is None:
            raise IntegrityError("a .dcp file the load needs is not one its check verified", file=p,
                                 expected=sorted(self.expected)[:8], found=name,
                                 hint="the .metadata names a file the commit marker does not list")
        if self.fetch is not None and want is not None and not os.path.lexists(p):
            self.fetch(name, want, self.sizes.get(name))  # verified: by the fetch, then again below, as it is read
        fd = open_run_file(p, ".dcp file", error=IntegrityError)
        try:
            size = os.fstat(fd).st_size
            if size != self.sizes.get(name, size) or size > (1 << 50):
                raise IntegrityError("a .dcp file changed between its check and the load", file=p,
                                     expected=f"{self.sizes.get(name)} bytes", found=f"{size} bytes",
                                     hint="it was replaced or edited after the generation was checked; none of it "
                                     "was loaded (an older generation will be used)")
            buf, digest, grew = read_whole_hashing(fd, size, path=p, what=".dcp file")
        finally:
            os.close(fd)
        got = digest.sha256
        if grew or got != want:
            raise IntegrityError("a .dcp file changed between its check and the load", file=p, expected=want,
                                 found="a file that grew while read" if grew else got,
                                 hint="it was replaced or edited after the generation was checked; none of it was "
                                 "loaded (an older generation will be used)")
        view = memoryview(buf)
        if keep:
            self._cache[name] = view
        return view


class _BufferStream(io.RawIOBase):
    """A read-only, seekable view of verified bytes (what ``FileSystemReader._slice_file`` reads from)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = bytes(self._view[self._pos:end])
        self._pos = max(self._pos, end)
        return out


class _VerifiedFS:
    """The ``fs`` of :class:`SafeFileSystemReader`: streams over verified buffers, never a path re-opened."""

    def __init__(self, folder: Path, buffers: dict[str, memoryview]) -> None:
        self.folder, self.buffers = folder, buffers

    def concat_path(self, path: Any, suffix: str) -> str:
        return suffix

    def create_stream(self, name: Any, mode: str) -> Any:
        import contextlib

        if mode != "rb" or name not in self.buffers:
            raise IntegrityError("a .dcp file was asked for that was not read and verified", file=self.folder / str(name),
                                 hint="a bug in ripresa's DCP reader; nothing was loaded from it")
        return contextlib.closing(_BufferStream(self.buffers[name]))


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
    """DCP's ``FileSystemReader`` over verified bytes: a restricted, checked ``read_metadata`` and bounded items.

    ``files`` (:class:`VerifiedFiles`) holds the sha256 each file had when
    the generation was checked: ``.metadata`` is unpickled from the bytes it
    hashed, and :meth:`read_data` first reads and verifies every shard file
    the plan needs (all of them before any item is loaded, so a swapped shard
    changes nothing live), then lets DCP slice those buffers — no path is
    opened again.
    """

    def __init__(self, path: str | os.PathLike[str], files: VerifiedFiles) -> None:
        super().__init__(path)
        self._folder = Path(path)
        self._files = files
        self._metadata: Metadata | None = None
        self._sizes: dict[str, int] | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata is None:
            raw = self._files.read(".metadata")
            self._sizes = self._shard_sizes()
            self._metadata = read_metadata(self._folder, raw=bytes(raw), sizes=self._sizes)
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _shard_sizes(self) -> dict[str, int]:
        """The size of each shard file as committed (the companion's ``files``, verified with it by the caller)."""
        return self._files.sizes

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_shape(metadata, self._folder / ".metadata")
        check_metadata(metadata, self._folder, sizes=self._shard_sizes())  # the metadata DCP passes in is checked here
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: Any, planner: Any) -> Any:
        needed = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        buffers = {name: self._files.read(name) for name in needed}  # every one verified before any is used
        self.fs = _VerifiedFS(self._folder, buffers)  # type: ignore[assignment]
        self.path = ""
        try:
            return super().read_data(plan, planner)
        finally:
            buffers.clear()

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
