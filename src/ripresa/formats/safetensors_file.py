"""The byte layout of a general generation ``step_NNNNNN.safetensors`` (docs/FORMAT.md, "the safetensors layout").

The safetensors layout written and read by ripresa itself (``safetensors.safe_open(path, "pt")``
reads it): a uint64 LE header length, a space-padded JSON header, then the tensors' bytes,
contiguous, by decreasing item size. Reading is hostile-safe (:func:`parse_header`): length,
depth, dtypes (:data:`DTYPES`), shapes and byte ranges (inside the file, no overlap, no gap) are
all decided from the header and the file size before any tensor is allocated; every refusal is an
:class:`~ripresa.errors.IntegrityError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError
from ..io.fsio import StagedFile, open_run_file, read_exact_hashing

#: safetensors dtype name -> torch dtype (the allowlist of names a header may use).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if getattr(torch, _attr, None) is not None:
        DTYPES[_name] = getattr(torch, _attr)
#: torch dtype -> safetensors name.
NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}

#: The largest header accepted (bytes), as the safetensors library does.
MAX_HEADER = 100 * 1024 * 1024
#: Most dimensions of one tensor.
MAX_NDIM = 32
#: Longest tensor key (characters).
MAX_KEY = 4096
#: Header padding: 8 + N is a multiple of this.
ALIGN = 8


def itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a 1-D uint8 view (no copy)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its key, safetensors dtype name, shape and byte range (relative to the data)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Header:
    """A parsed, validated header: entries in data order, metadata, where the data starts, the file's size."""

    entries: tuple[Entry, ...]
    metadata: dict[str, str]
    data_start: int
    file_size: int
    raw: bytes  # the 8 length bytes and the header, as read (hashed with the data)

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start


def layout(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The order tensors are written in: by decreasing item size, then as given (natural alignment)."""
    items = list(tensors.items())
    order = sorted(range(len(items)), key=lambda i: (-items[i][1].element_size(), i))
    return [items[i] for i in order]


def header_bytes(tensors: Sequence[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> bytes:
    """The 8 length bytes and the padded JSON header for ``tensors`` in this order."""
    head: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    off = 0
    for key, t in tensors:
        if t.dtype not in NAMES:
            raise ValueError(f"dtype {t.dtype} has no safetensors name; store its bytes as uint8")
        n = t.numel() * t.element_size()
        head[key] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * ((-(8 + len(raw))) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


#: Bytes written per ``write`` call: a large tensor is streamed in pieces, so hashing and write-back overlap.
PIECE = 32 * 1024 * 1024
#: Start the disk write-back of what is written every this many bytes (see :func:`write`).
WRITEBACK_EVERY = 64 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    """libc ``sync_file_range`` (Linux), or None where it is not available."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range() if os.uname().sysname == "Linux" else None


class _WriteBack:
    """Start the disk write-back of the file's bytes written so far (``SYNC_FILE_RANGE_WRITE``:
    queues the dirty pages, does not wait), every :data:`WRITEBACK_EVERY` bytes. The final
    ``fsync`` then finds most of the file already on its way, instead of starting the whole
    write after the last byte is hashed. A hint only: any failure turns it off."""

    def __init__(self, path: Path) -> None:
        self.fd: int | None = None
        self.done = self.written = 0
        if _SFR is not None:
            try:
                self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                self.fd = None

    def advance(self, n: int) -> None:
        self.written += n
        if self.fd is not None and self.written - self.done >= WRITEBACK_EVERY:
            if _SFR(self.fd, self.done, self.written - self.done, _SYNC_FILE_RANGE_WRITE) != 0:
                self.close()
            self.done = self.written

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def write(out: StagedFile, tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
          metadata: Mapping[str, str], *, after: Callable[[int], None] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Stream the file into ``out`` (hashed as written); return the tensors in file order.

    ``tensors``: a mapping (written in :func:`layout` order) or (key, tensor)
    pairs already in file order. Every tensor must be contiguous, of a dtype in
    :data:`NAMES`, and unchanged until ``out.finish()`` (a snapshot's copy, or
    live tensors while the loop waits); one not on the CPU is copied to it one
    at a time. Large tensors go in :data:`PIECE`-byte writes, and the write-back
    to the disk is started as the file grows (:class:`_WriteBack`), so that
    writing to the disk overlaps the hashing instead of following it in the
    final ``fsync``. ``after(i)`` is called once tensor ``i`` is written.
    """
    ordered = layout(tensors) if isinstance(tensors, Mapping) else list(tensors)
    head = header_bytes(ordered, metadata)
    out.write(head)
    wb = _WriteBack(out.temp)
    try:
        wb.advance(len(head))
        for i, (_key, t) in enumerate(ordered):
            if t.numel():
                src = t if t.device.type == "cpu" else t.detach().to("cpu")
                view = memoryview(as_bytes(src).numpy())
                for start in range(0, len(view), PIECE):
                    piece = view[start : start + PIECE]
                    out.write(piece, stable=src is t)
                    wb.advance(len(piece))
            if after is not None:
                after(i)
    finally:
        wb.close()
    return ordered


def _bad(path: Path, message: str, expected: Any = None, found: Any = None) -> IntegrityError:
    return IntegrityError(f"safetensors file: {message}", file=path, expected=expected, found=found,
                          hint="it was not written by ripresa, or it was damaged or edited; it is not used")


def _header_length(raw_len: bytes, file_size: int, path: Path) -> int:
    """The header length of the first 8 bytes, refused unless it fits both MAX_HEADER and the file."""
    if len(raw_len) != 8:
        raise _bad(path, "shorter than its 8-byte header length", ">= 8 bytes", f"{file_size} bytes")
    (n,) = struct.unpack("<Q", raw_len)
    if n > MAX_HEADER or 8 + n > file_size:
        raise _bad(path, "header length out of bounds", f"<= {min(MAX_HEADER, max(file_size - 8, 0))} bytes",
                   f"{n} bytes in a file of {file_size}")
    return n


def parse_header(raw_len: bytes, raw_head: bytes, file_size: int, path: Path) -> Header:
    """Validate a header against the file size before anything is allocated (see the module doc)."""
    from .companion import brief, check_shape, loads_bounded

    n = _header_length(raw_len, file_size, path)
    if len(raw_head) != n:
        raise _bad(path, "header ended early", f"{n} bytes", f"{len(raw_head)} bytes")
    try:
        text = raw_head.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(path, "header is not UTF-8", found=str(exc)[:120]) from None
    doc = loads_bounded(text, file=path, what="safetensors header", max_depth=8)
    if not isinstance(doc, dict):
        raise _bad(path, "header is not a JSON object", found=type(doc).__name__)
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(path, "__metadata__ is not a map of strings to strings", found=brief(meta))
    data_size = file_size - 8 - n
    entries = []
    for key, rec in doc.items():
        if not key or len(key) > MAX_KEY:
            raise _bad(path, "bad tensor key", f"1..{MAX_KEY} characters", brief(key))
        if not isinstance(rec, dict) or set(rec) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {key!r}: malformed entry", '{"dtype", "shape", "data_offsets"}', brief(rec))
        dt, shape, offs = rec["dtype"], rec["shape"], rec["data_offsets"]
        if not isinstance(dt, str) or dt not in DTYPES:
            raise _bad(path, f"tensor {key!r}: unknown dtype", sorted(DTYPES), repr(dt)[:80])
        if not isinstance(shape, list):
            raise _bad(path, f"tensor {key!r}: bad shape", f"<= {MAX_NDIM} non-negative ints", brief(shape))
        try:
            check_shape(shape, f"safetensors file: tensor {brief(key, 80)}", file=path)  # the one shape bound
        except IntegrityError as exc:
            raise _bad(path, f"tensor {brief(key, 80)}: {exc.message.rsplit(': ', 1)[-1]}", exc.expected,
                       exc.found) from None
        if (not isinstance(offs, list) or len(offs) != 2 or any(type(o) is not int for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_size):
            raise _bad(path, f"tensor {key!r}: byte range outside the file's data",
                       f"0 <= begin <= end <= {data_size}", brief(offs))
        want = math.prod(shape) * itemsize(DTYPES[dt])  # Python ints: a shape asking for terabytes stays a number
        if offs[1] - offs[0] != want:
            raise _bad(path, f"tensor {key!r}: shape and dtype do not match its byte range",
                       f"{want} bytes ({dt} {shape})"[:200], f"{offs[1] - offs[0]} bytes")
        entries.append(Entry(key, dt, tuple(shape), offs[0], offs[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise _bad(path, "tensor byte ranges overlap" if e.begin < pos else "gap between tensor byte ranges",
                       f"{e.key!r} at {pos}", f"{e.key!r} at {e.begin}")
        pos = e.end
    if pos != data_size:
        raise _bad(path, "tensors do not cover the data exactly", f"{data_size} bytes of tensors", f"{pos} bytes")
    return Header(tuple(entries), meta, 8 + n, file_size, raw_len + raw_head)


def _read_header_fd(fd: int, path: Path, charge: Callable[[int], None] | None = None) -> Header:
    size = os.fstat(fd).st_size
    raw_len = os.pread(fd, 8, 0) if size >= 8 else b""
    n = _header_length(raw_len, size, path)
    if charge is not None:
        charge(8 + n)  # a budget shared with other pieces, charged before the header is read
    raw_head = os.pread(fd, n, 8)
    return parse_header(raw_len, raw_head, size, path)


def read_header(path: str | Path, *, charge: Callable[[int], None] | None = None) -> Header:
    """Open ``path`` (a regular file, no symlink) and validate its header (nothing else is read).

    ``charge(n)``, when given, is told the header's size before it is read (a shard's header
    charged to its generation's budget, docs/FAULTS.md, "Many pieces, one budget")."""
    p = Path(path)
    fd = open_run_file(p, "safetensors file", error=IntegrityError)
    try:
        return _read_header_fd(fd, p, charge)
    finally:
        os.close(fd)


#: Bytes per read-and-hash hand-off of a load (consecutive small tensors are gathered into one ``readv``).
READ_PIECE = 16 * 1024 * 1024


def header_fd(fd: int, path: Path, known: Header | None = None) -> Header:
    """The validated header of the open file ``fd``: parsed, or ``known`` (parsed at an earlier check) reused
    only when the file's header bytes and size are still exactly those; else an IntegrityError."""
    if known is None:
        return _read_header_fd(fd, path)
    size = os.fstat(fd).st_size
    if size != known.file_size or os.pread(fd, len(known.raw), 0) != known.raw:
        raise _bad(path, "the header changed between its check and the load", "the header checked",
                   f"other bytes ({size} bytes in the file)")
    return known


def read_fd(fd: int, path: Path, header: Header, *, expected_sha256: str | None = None,
            piece: int = READ_PIECE) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the open file ``fd`` whose ``header`` was validated on this ``fd``: (key -> tensor, sha256).

    Each tensor is read straight into its own buffer, ``piece`` bytes per
    ``readv`` (small tensors gathered), hashed in the same pass (the header
    bytes first). With ``expected_sha256`` a different digest is an IntegrityError.
    """
    tensors = {e.key: torch.empty(e.shape, dtype=e.torch_dtype) for e in header.entries}
    h = hashlib.sha256(header.raw)
    os.lseek(fd, header.data_start, os.SEEK_SET)
    views = [memoryview(as_bytes(tensors[e.key]).numpy()) for e in header.entries if e.end > e.begin]
    read_exact_hashing(fd, views, h, path=path, what="safetensors file", piece=piece)
    if os.read(fd, 1):
        raise _bad(path, "the file grew while it was read", f"{header.file_size} bytes", "more")
    digest = h.hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise IntegrityError("sha256 mismatch: the safetensors file changed after it was committed", file=path,
                             expected=expected_sha256, found=digest,
                             hint="bit rot or an edit; an older generation will be used")
    return tensors, digest


def read(path: str | Path, *, expected_sha256: str | None = None,
         piece: int = READ_PIECE) -> tuple[Header, dict[str, torch.Tensor], str]:
    """Read every tensor of ``path`` in one pass, hashed while read: (header, key -> tensor, sha256).

    The header is validated first (:func:`parse_header`), so the allocation is
    bounded by the file's size; then :func:`read_fd`. One open of the file.
    """
    p = Path(path)
    fd = open_run_file(p, "safetensors file", error=IntegrityError)
    try:
        header = _read_header_fd(fd, p)
        tensors, digest = read_fd(fd, p, header, expected_sha256=expected_sha256, piece=piece)
    finally:
        os.close(fd)
    return header, tensors, digest
