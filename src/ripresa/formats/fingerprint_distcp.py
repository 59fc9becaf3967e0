"""Where a DCP tensor's bytes lie in its ``.distcp`` files, for the state fingerprint to hash them in place
(docs/FORMAT.md, "The state fingerprint", "Reading").

A DCP item is a ``torch.save`` zip archive of one tensor: ``data.pkl`` (a few hundred bytes naming the storage,
its offset, size and strides), ``byteorder`` and ``data/0`` (the storage's bytes, stored uncompressed). When
the archive is exactly what ``torch.save`` writes for a contiguous little-endian tensor that owns its whole
storage, :func:`chunk_range` returns the byte range of its values in the shard file, found from the zip's
directory and ``data.pkl`` alone (read through a pickle reader that knows five names and builds nothing but
records of them). :func:`tensor_segments` joins the chunks of a tensor split by rows (FSDP2's dim-0 shards) into
the tensor's row-major bytes. Anything else returns None, and the caller loads the item with
``torch.load(weights_only=True)`` instead: this path decides only *where* to read, never runs anything, and every
range it returns is checked to lie inside its item.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..io.merkle import FileRange

#: ``torch.save``'s storage classes (``torch.<Name>Storage``) and their dtypes.
_STORAGES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
#: Largest ``data.pkl`` read on this path (a tensor's is about 150 bytes).
_MAX_PICKLE = 64 * 1024
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


class _NotPlain(Exception):
    """The item is not the plain archive this path reads: the caller loads it instead."""


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage) or type(offset) is not int or not isinstance(size, tuple) \
            or not isinstance(stride, tuple) or not all(type(x) is int for x in (*size, *stride)):
        raise _NotPlain
    return _Tensor(storage, offset, size, stride)


class _LayoutReader(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Reads ``data.pkl``: five names, each a record-maker; any other global or persistent id stops it.

    The pure-Python unpickler, as :mod:`ripresa.formats.dcp_safe`'s: its memo is a dict, so a ``LONG_BINPUT``
    index of 2^32 stores one entry instead of asking C's unpickler for a table that large."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        raise _NotPlain

    def persistent_load(self, pid: Any) -> Any:
        if (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)
                and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            return _Storage(pid[2], pid[1], pid[4])
        raise _NotPlain


class _Slice(io.RawIOBase):
    """``length`` bytes at ``offset`` of an open file, seekable, read with ``pread`` (what zipfile reads)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        got = os.preadv(self.fd, [memoryview(buf)[:n]], self.base + self.pos) if n else 0
        self.pos += got
        return got


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(size):
        out.append(step)
        step *= max(s, 1)
    return tuple(reversed(out))


def chunk_range(fd: int, offset: int, length: int, path: str, dtype: torch.dtype,
                sizes: Sequence[int]) -> FileRange | None:
    """The file range of a DCP item's values (row-major, little-endian), or None when the item is not a plain
    ``torch.save`` archive of a contiguous tensor of ``dtype`` and ``sizes`` that owns its storage."""
    try:
        src = io.BufferedReader(_Slice(fd, offset, length), buffer_size=64 * 1024)
        with zipfile.ZipFile(src) as zf:
            infos = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
            pkl, order = infos.get("data.pkl"), infos.get("byteorder")
            if pkl is None or order is None or pkl.file_size > _MAX_PICKLE or order.file_size > 16:
                return None
            if any(i.compress_type != zipfile.ZIP_STORED for i in infos.values()) or zf.read(order) != b"little":
                return None
            t = _LayoutReader(io.BytesIO(zf.read(pkl))).load()
        if not isinstance(t, _Tensor):
            return None
        n = math.prod(sizes)
        if (t.size != tuple(sizes) or t.storage.dtype != dtype or t.offset != 0 or t.storage.numel != n
                or (n > 1 and t.stride != _contiguous(t.size))):
            return None
        data = infos.get(f"data/{t.storage.key}")
        nbytes = n * dtype.itemsize
        if data is None or data.file_size != nbytes or data.compress_size != nbytes:
            return None
        head = os.pread(fd, _LOCAL_HEADER.size, offset + data.header_offset)
        if len(head) != _LOCAL_HEADER.size:
            return None
        sig, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        start = data.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if sig != b"PK\x03\x04" or start + nbytes > length:
            return None
        return FileRange(fd, offset + start, nbytes, path)
    except (_NotPlain, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, TypeError, KeyError, EOFError,
            OSError, OverflowError, IndexError, AttributeError, struct.error, RecursionError, MemoryError):
        return None


def tensor_segments(size: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int], FileRange]]
                    ) -> list[FileRange] | None:
    """The row-major bytes of a tensor of ``size`` from its chunks ``(offsets, sizes, range)``: whole, or split
    along the first dimension only into rows that tile it exactly; None for any other split."""
    if len(chunks) == 1 and list(chunks[0][0]) == [0] * len(size) and list(chunks[0][1]) == list(size):
        return [chunks[0][2]]
    if not size or any(list(o[1:]) != [0] * (len(size) - 1) or list(s[1:]) != list(size[1:]) for o, s, _ in chunks):
        return None
    pos, out = 0, []
    for o, s, r in sorted(chunks, key=lambda c: c[0][0]):
        if o[0] != pos:
            return None
        pos += s[0]
        out.append(r)
    return out if pos == size[0] else None
