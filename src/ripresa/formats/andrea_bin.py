"""The ANDREA raw ``.bin`` checkpoint: exact bytes, for interop (docs/FORMAT.md, "ANDREA ``step_NNNNNN.bin``").

``step``, ``n_params`` (int32 LE), then float32 weights, m and v: ``8 + 12 * n_params`` bytes, no
magic, no checksum; integrity lives *beside* it (``step_NNNNNN.bin.sha256``), so a ``.bin`` written
by ripresa is byte-for-byte what the ANDREA engine writes. Writing streams each parameter into a
:class:`~ripresa.io.fsio.StagedFile` (hashed in the same pass, no concatenated copy); reading checks
header and size *before* allocating. Names: :data:`BIN_NAMES`. A ``.bin`` alone is not a complete
resume point (:func:`describe_missing`). The bytes only: a model and its AdamW map to them in
:mod:`ripresa.formats.bin_state`.
"""

from __future__ import annotations

import hashlib
import mmap as _mmap
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from ..errors import BadInput, IntegrityError, SaveFailed, SchemaError
from ..io.fsio import (
    CHUNK,
    Digest,
    StagedFile,
    fsync_dir,
    open_regular,
    read_exact_hashing,
    sidecar_path,
    write_sidecar,
)
from .naming import NameFormat

# ---- format constants ----------------------------------------------------------

#: Header: int32 step, int32 n_params, little-endian (8 bytes).
HEADER = struct.Struct("<ii")
HEADER_SIZE = HEADER.size  # 8 bytes
#: Bytes per parameter: one float32 each in weights, m and v.
BYTES_PER_PARAM = 12
#: Largest n_params (and step) an int32 can hold.
MAX_PARAMS = 2**31 - 1
MAX_STEP = 2**31 - 1
#: The on-disk element type: float32, little-endian whatever the host.
FLOAT = np.dtype("<f4")
#: The three regions after the header, in file order.
REGIONS = ("weights", "m", "v")

#: Elements per write/hash piece: fsio's streaming granularity (8 MiB), so a
#: non-contiguous, zero-stride or GPU chunk is copied at most this much at a time.
_PIECE_ELEMS = CHUNK // FLOAT.itemsize
#: Elements per NaN/Inf scan block (4 MiB of floats → 1 MiB bool temporary).
_SCAN_ELEMS = 1 << 20

#: What a ``.bin`` never holds, whoever wrote it (a resume point's contents, docs/FORMAT.md, minus weights/m/v).
BIN_LACKS: tuple[str, ...] = (
    "random generator states (Python, NumPy, torch CPU/CUDA, registered generators)",
    "data position (epoch, permutation or its seed, cursor)",
    "LR scheduler state",
    "GradScaler state (mixed precision)",
    "optimizer hyperparameters (lr, betas, eps, weight decay) and per-parameter steps "
    "(one shared step is assumed)",
    "model buffers (e.g. BatchNorm running statistics) — only parameters are stored",
    "progress beyond the step (epochs, samples and tokens seen)",
    "resolved config, versions, code identity and data identity",
)


def _file_size_of(n: int) -> int:
    """Exact size in bytes of a ``.bin`` holding ``n`` parameters."""
    return HEADER_SIZE + BYTES_PER_PARAM * n


# ---- names ---------------------------------------------------------------------


def bin_name(step: int) -> str:
    """``7`` → ``step_000007.bin`` (six digits, wider when the step needs it)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise BadInput(
            "invalid step for a .bin name",
            expected=f"an int in 0..{MAX_STEP}",
            found=repr(step),
        )
    return f"step_{step:06d}.bin"


#: How a ``.bin`` generation's files are named (``step_NNNNNN.bin``, ``.json``, ``.bin.hmac``, ``.bin.sha256``).
BIN_NAMES = NameFormat(".bin", companion=".json", max_step=MAX_STEP, namer=bin_name)


def parse_bin_name(name: str | os.PathLike[str]) -> int | None:
    """``step_000007.bin`` → ``7``; ``None`` for anything that is not a canonical name.

    Only the exact form :func:`bin_name` writes is accepted (``step_0000007.bin``
    is not), so names and steps map one to one. A path is reduced to its name.
    """
    return BIN_NAMES.parse(name)


def companion_path(path: str | os.PathLike[str]) -> Path:
    """``.../step_000007.bin`` → ``.../step_000007.json`` (the companion, docs/FORMAT.md)."""
    p = Path(path)
    return p.with_name(p.stem + ".json")


# ---- header --------------------------------------------------------------------


@dataclass(frozen=True)
class BinHeader:
    """The 8-byte header of a ``.bin``: ``step`` and ``n_params``."""

    step: int
    n_params: int

    @property
    def file_size(self) -> int:
        """Size in bytes the file must have: ``8 + 12 * n_params``."""
        return _file_size_of(self.n_params)

    def offset(self, region: str) -> int:
        """Byte offset of ``region`` (``weights``, ``m`` or ``v``) in the file."""
        return HEADER_SIZE + REGIONS.index(region) * FLOAT.itemsize * self.n_params


def _open_regular(path: Path) -> tuple[int, int]:
    """Open ``path`` read-only; return ``(fd, size)``. Refuses non-regular files.

    :func:`ripresa.io.fsio.open_regular` opens without blocking and checks the
    open descriptor, so a FIFO never hangs the reader and what is read is
    exactly what was checked.
    """
    fd = open_regular(path, "ANDREA .bin")
    try:
        size = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _read_exact(fd: int, buf: memoryview, path: Path, hasher: Any | None = None) -> None:
    """Fill ``buf`` from ``fd`` (hashing it if asked); a short read means the file shrank."""
    read_exact_hashing(fd, [buf], hasher, path=path, what="ANDREA .bin")


def _check_header(raw: bytes, size: int, path: Path, expected_n: int | None) -> BinHeader:
    """Validate a header and the file size; pure (no I/O), so it is cheap to test.

    Every check needs only the 8 header bytes and the size: nothing is
    allocated from an unvalidated ``n_params``.
    """
    if size < HEADER_SIZE:
        raise IntegrityError(
            "ANDREA .bin is empty" if size == 0 else "ANDREA .bin is truncated inside its header",
            file=path,
            expected=f">= {HEADER_SIZE} bytes (int32 step, int32 n_params)",
            found=f"{size} bytes",
            hint="the save was interrupted or the copy is incomplete; use an earlier generation",
        )
    step, n = HEADER.unpack(raw[:HEADER_SIZE])
    if step < 0:
        raise IntegrityError(
            "ANDREA .bin has a negative step",
            file=path,
            expected=f"step in 0..{MAX_STEP}",
            found=step,
            hint="the header is damaged, or this is not an ANDREA .bin",
        )
    if n < 1:
        raise IntegrityError(
            "ANDREA .bin has an invalid parameter count",
            file=path,
            expected=f"n_params in 1..{MAX_PARAMS}",
            found=n,
            hint="the header is damaged, or this is not an ANDREA .bin",
        )
    want = _file_size_of(n)
    if size != want:
        fits = ""
        if (size - HEADER_SIZE) % BYTES_PER_PARAM == 0 and size > HEADER_SIZE:
            fits = f"; the size would fit n_params={(size - HEADER_SIZE) // BYTES_PER_PARAM}, so the header may be damaged"
        if size < want:
            raise IntegrityError(
                "ANDREA .bin is truncated",
                file=path,
                expected=f"{want} bytes (8 + 12 x {n} params)",
                found=f"{size} bytes ({want - size} missing)",
                hint="the save was interrupted or the copy is incomplete; use an earlier generation" + fits,
            )
        raise IntegrityError(
            "ANDREA .bin has trailing bytes after the v region",
            file=path,
            expected=f"{want} bytes (8 + 12 x {n} params), nothing after v",
            found=f"{size} bytes ({size - want} extra)",
            hint="the format has no trailer: this file was appended to or is not an ANDREA .bin" + fits,
        )
    if expected_n is not None and n != expected_n:
        raise SchemaError(
            "ANDREA .bin does not fit the model: parameter counts differ",
            file=path,
            expected=f"n_params = {expected_n} (the model's)",
            found=f"n_params = {n}",
            hint="this checkpoint was written for another model architecture or size",
        )
    return BinHeader(step=step, n_params=n)


def read_header(path: str | os.PathLike[str], *, expected_n: int | None = None) -> BinHeader:
    """Read and validate a ``.bin``'s header against its size, before any allocation.

    Raises :class:`~ripresa.errors.BadInput` (exit 2) for a missing,
    unreadable or non-regular file, and :class:`~ripresa.errors.IntegrityError`
    (exit 1) for content that fails a check: size < 8, step < 0,
    n_params < 1, a truncated file, trailing bytes, and (as
    :class:`~ripresa.errors.SchemaError`) ``n_params != expected_n``.
    """
    p = Path(path)
    fd, size = _open_regular(p)
    try:
        raw = bytearray(min(size, HEADER_SIZE))
        _read_exact(fd, memoryview(raw), p)
    finally:
        os.close(fd)
    return _check_header(bytes(raw), size, p, expected_n)


# ---- writing -------------------------------------------------------------------

#: One piece of a region: a float32 tensor (any device, any shape, flattened in
#: logical row-major order) or a float32 numpy array.
Chunk: TypeAlias = torch.Tensor | np.ndarray
#: A region (weights, m or v): one chunk, or a sequence of per-parameter chunks.
Region: TypeAlias = Chunk | Sequence[Chunk] | Iterable[Chunk]


class BinArrays(NamedTuple):
    """Per-parameter flat views of the three regions, in file order.

    Unpacks as ``weights, m, v``. Each element is a tuple of 1-D chunks whose
    concatenation is the region; nothing is concatenated in memory. Chunks
    may be views of live tensors (zero copies), zero-stride views (a missing
    optimizer state is an ``expand``-ed zero: no memory), or on a GPU
    (copied to the host one piece at a time while writing).
    """

    weights: tuple[Chunk, ...]
    m: tuple[Chunk, ...]
    v: tuple[Chunk, ...]

    @property
    def n_params(self) -> int:
        """Elements per region (from shapes only; no data is touched)."""
        return _count(self.weights)


def _as_chunks(region: Region) -> tuple[Chunk, ...]:
    if isinstance(region, torch.Tensor | np.ndarray):
        return (region,)
    return tuple(region)


def _count(chunks: Sequence[Chunk]) -> int:
    return sum(int(c.numel()) if isinstance(c, torch.Tensor) else int(c.size) for c in chunks)


def _check_kinds(name: str, chunks: Sequence[Chunk], final: Path) -> None:
    """Refuse anything that is not a tensor or an array (so shapes can be counted)."""
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.Tensor | np.ndarray):
            raise BadInput(
                f"ANDREA .bin region {name}[{i}] is neither a tensor nor a numpy array",
                file=final,
                expected="torch.Tensor or numpy.ndarray (float32)",
                found=type(c).__name__,
            )


def _check_chunks(name: str, chunks: Sequence[Chunk], final: Path) -> None:
    """Refuse anything that is not float32 data we can read, before writing a byte."""
    for i, c in enumerate(chunks):
        where = f"{name}[{i}]"
        if isinstance(c, torch.Tensor):
            if c.dtype != torch.float32:
                raise BadInput(
                    f"ANDREA .bin region {where} is not float32",
                    file=final,
                    expected="torch.float32",
                    found=str(c.dtype),
                    hint="the .bin format stores float32 only; use checkpoint.pt for other dtypes",
                )
            if c.device.type == "meta" or c.is_sparse or c.is_quantized:
                raise BadInput(
                    f"ANDREA .bin region {where} has no dense data",
                    file=final,
                    expected="a dense tensor with storage",
                    found=f"layout={c.layout}, device={c.device}",
                )
        elif isinstance(c, np.ndarray):
            if c.dtype.kind != "f" or c.dtype.itemsize != 4:
                raise BadInput(
                    f"ANDREA .bin region {where} is not float32",
                    file=final,
                    expected="numpy float32",
                    found=str(c.dtype),
                    hint="the .bin format stores float32 only",
                )


def check_n_params(n: int, final: str | os.PathLike[str] | None = None) -> None:
    """Refuse a parameter count the format cannot hold (``1 .. 2**31-1``)."""
    if n > MAX_PARAMS:
        raise SaveFailed(
            "model too large for the ANDREA .bin format",
            file=final,
            expected=f"n_params <= {MAX_PARAMS} (int32 header field)",
            found=f"n_params = {n}",
            hint="save with checkpoint.pt (torch-native) or the sharded DCP format instead",
        )
    if n < 1:
        raise BadInput(
            "nothing to save in an ANDREA .bin",
            file=final,
            expected="n_params >= 1",
            found=f"n_params = {n}",
            hint="the model has no parameters",
        )


def _pieces(chunk: Chunk) -> Iterator[np.ndarray]:
    """Contiguous little-endian float32 host pieces of ``chunk``, in logical order.

    At most ``_PIECE_ELEMS`` elements are copied at a time, and only when the
    chunk is not already a contiguous host float32 array (GPU, non-contiguous,
    zero-stride or big-endian): the memory used is bounded by one piece,
    except for a non-contiguous *multi-dimensional* tensor, whose logical
    flattening copies that one parameter.
    """
    if isinstance(chunk, torch.Tensor):
        t = chunk.detach().reshape(-1)  # a view when the tensor is contiguous
        for start in range(0, t.numel(), _PIECE_ELEMS):
            piece = t[start : start + _PIECE_ELEMS]
            if piece.device.type != "cpu":
                piece = piece.to("cpu")
            yield np.ascontiguousarray(piece.numpy(), dtype=FLOAT)
    else:
        a = chunk.reshape(-1)
        for start in range(0, a.size, _PIECE_ELEMS):
            yield np.ascontiguousarray(a[start : start + _PIECE_ELEMS], dtype=FLOAT)


def write_bin(staged: StagedFile, step: int, weights: Region, m: Region, v: Region) -> BinHeader:
    """Stream a complete ``.bin`` into ``staged`` (hashed in the same pass).

    ``weights``, ``m`` and ``v`` are each a float32 tensor/array or a
    sequence of per-parameter chunks (see :class:`BinArrays`,
    :func:`flatten_model_and_adamw`); chunks are written as memory views,
    so no concatenated copy is made. Everything is validated before the
    first byte: ``staged`` must be empty, 0 <= step <= 2**31-1, all chunks
    float32, the three regions of equal length n with 1 <= n <= 2**31-1
    (counted from shapes, without touching data).

    The caller finishes and publishes ``staged`` (see :func:`save_bin`).
    """
    final = staged.final
    if staged.size != 0:
        raise BadInput(
            "an ANDREA .bin must be the whole file",
            file=final,
            expected="an empty staged file",
            found=f"{staged.size} bytes already written",
        )
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise BadInput("ANDREA .bin step must be an int", file=final, expected="int", found=type(step).__name__)
    step = int(step)
    if step < 0:
        raise BadInput("ANDREA .bin step is negative", file=final, expected=f"0..{MAX_STEP}", found=step)
    if step > MAX_STEP:
        raise SaveFailed(
            "step too large for the ANDREA .bin format",
            file=final,
            expected=f"step <= {MAX_STEP} (int32 header field)",
            found=step,
            hint="save with checkpoint.pt instead",
        )
    regions = {"weights": _as_chunks(weights), "m": _as_chunks(m), "v": _as_chunks(v)}
    for name, chunks in regions.items():
        _check_kinds(name, chunks, final)
    counts = {name: _count(chunks) for name, chunks in regions.items()}
    n = counts["weights"]
    check_n_params(n, final)
    if counts["m"] != n or counts["v"] != n:
        raise BadInput(
            "ANDREA .bin regions differ in length",
            file=final,
            expected=f"weights, m and v of {n} elements each",
            found=", ".join(f"{k}={c}" for k, c in counts.items()),
            hint="m and v must have one element per parameter element, in the same order",
        )
    for name, chunks in regions.items():
        _check_chunks(name, chunks, final)

    staged.write(HEADER.pack(step, n))
    for chunks in regions.values():
        for chunk in chunks:
            for piece in _pieces(chunk):
                staged.write(memoryview(piece).cast("B"), stable=True)
    if staged.size != _file_size_of(n):  # a chunk changed shape while we wrote it
        raise SaveFailed("ANDREA .bin came out with the wrong size", file=final, expected=f"{_file_size_of(n)} bytes",
                         found=f"{staged.size} bytes", hint="a tensor was resized during the save; save at a step boundary")
    return BinHeader(step=step, n_params=n)


def save_bin(
    path: str | os.PathLike[str],
    step: int,
    weights: Region,
    m: Region,
    v: Region,
    *,
    sidecar: bool = True,
) -> Digest:
    """Write ``path`` with the commit protocol of docs/FORMAT.md; return its digest.

    Temporary sibling → stream + sha256 → ``fsync`` → rename → ``fsync`` the
    folder → (if ``sidecar``) ``path.sha256``, the commit marker, last. A run
    folder that also writes a companion ``.json`` passes ``sidecar=False``
    and writes the marker itself after the companion.
    """
    final = Path(path)
    with StagedFile(final) as f:
        write_bin(f, step, weights, m, v)
        digest = f.finish()
        f.publish()
    fsync_dir(final.parent)
    if sidecar:
        write_sidecar(final, digest)
    return digest


# ---- reading -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class BinContents:
    """A read ``.bin``: header fields and the three regions as float32 arrays.

    ``digest`` is set when the read checked a sha256 (``expected_sha256``).
    """

    path: Path
    step: int
    n_params: int
    weights: npt.NDArray[np.float32]
    m: npt.NDArray[np.float32]
    v: npt.NDArray[np.float32]
    digest: Digest | None = None

    @property
    def header(self) -> BinHeader:
        return BinHeader(self.step, self.n_params)


def _check_finite(path: Path, header: BinHeader, regions: dict[str, np.ndarray]) -> None:
    """Reject NaN/Inf, naming the region, the first bad index and its file offset.

    Scans in blocks so the temporary boolean mask stays small (1 MiB).
    """
    for name, arr in regions.items():
        for start in range(0, arr.size, _SCAN_ELEMS):
            block = arr[start : start + _SCAN_ELEMS]
            ok = np.isfinite(block)
            if ok.all():
                continue
            i = start + int(np.argmin(ok))
            raise IntegrityError(
                f"ANDREA .bin holds a non-finite value in {name}",
                file=path,
                expected="finite float32 values (--check-finite)",
                found=f"{name}[{i}] = {float(arr[i])!r} (byte offset {header.offset(name) + 4 * i})",
                hint="the run diverged before this save; resume from an earlier generation",
            )


def refuse_growth(fd: int, path: Path, size: int, *, done: str = "read", do: str = "read") -> None:
    """Raise if ``fd`` (read up to the end of v, ``size`` bytes) holds more: another writer is appending."""
    try:
        extra = os.read(fd, 1)
    except OSError:
        extra = b""
    if extra:
        raise IntegrityError(f"ANDREA .bin grew while it was {done}", file=path, expected=f"{size} bytes",
                             found="more data after v",
                             hint=f"another process is writing this file; {do} a committed generation")


def read_bin(
    path: str | os.PathLike[str],
    *,
    expected_n: int | None = None,
    check_finite: bool = False,
    expected_sha256: str | None = None,
    mmap: bool = False,
) -> BinContents:
    """Read a ``.bin``: header → size → data (hashed as read) → digest → (finite check).

    Nothing is allocated before the header and the size are validated. The
    file is read *once*: with ``expected_sha256`` the regions are read
    straight into their preallocated arrays and hashed in the same pass
    (:func:`ripresa.io.fsio.read_exact_hashing`), and the digest is compared
    before the arrays are returned (a mismatch is an
    :class:`~ripresa.errors.IntegrityError` naming the file, the expected and
    the found hash; the arrays are dropped). With ``mmap`` the mapped memory
    is hashed, which pages the file in once for both. No sidecar or companion
    is needed: a foreign ``.bin`` loads; see :func:`describe_missing` for what
    it lacks.

    Args:
        expected_n: the model's parameter count; a mismatch is a
            :class:`~ripresa.errors.SchemaError` (exit 1).
        check_finite: reject NaN/Inf, naming the region and first bad index.
        expected_sha256: lowercase hex the file must hash to (e.g. from
            :func:`ripresa.io.fsio.read_sidecar` or the companion).
        mmap: map the file copy-on-write instead of reading it (no
            allocation; the arrays are writable but never write back). The
            map is of the descriptor that was checked, not of the path.
    """
    p = Path(path)
    fd, size = _open_regular(p)
    hasher = hashlib.sha256() if expected_sha256 is not None else None
    try:
        raw = bytearray(min(size, HEADER_SIZE))
        _read_exact(fd, memoryview(raw), p)
        header = _check_header(bytes(raw), size, p, expected_n)
        n = header.n_params
        if mmap:
            # Map the descriptor that was checked (not the path again); private
            # (copy-on-write), so the arrays are writable but never write back.
            mapped = _mmap.mmap(fd, size, access=_mmap.ACCESS_COPY)
            if hasher is not None:
                if hasattr(mapped, "madvise") and hasattr(_mmap, "MADV_SEQUENTIAL"):
                    try:
                        mapped.madvise(_mmap.MADV_SEQUENTIAL)
                    except OSError:
                        pass
                hasher.update(mapped)  # the mapped pages are the ones the arrays see
            block = np.frombuffer(mapped, dtype=FLOAT, count=3 * n, offset=HEADER_SIZE).reshape(3, n)
            regions = {name: block[i] for i, name in enumerate(REGIONS)}
        else:
            if hasher is not None:
                hasher.update(raw)
            regions = {name: np.empty(n, dtype=FLOAT) for name in REGIONS}
            # One pass: straight into the arrays, hashed as read.
            views = [memoryview(regions[name]).cast("B") for name in REGIONS]
            read_exact_hashing(fd, views, hasher, path=p, what="ANDREA .bin")
            refuse_growth(fd, p, header.file_size)
    finally:
        os.close(fd)
    digest: Digest | None = None
    if hasher is not None and expected_sha256 is not None:
        found = hasher.hexdigest()
        if found != expected_sha256.lower():
            raise IntegrityError(
                "sha256 mismatch: the .bin is not the file that was committed",
                file=p,
                expected=expected_sha256,
                found=found,
                hint="the file is damaged (truncated, bit rot, or edited); use an earlier generation",
            )
        digest = Digest(found, size)
    if check_finite:
        _check_finite(p, header, regions)
    return BinContents(
        path=p,
        step=header.step,
        n_params=n,
        weights=regions["weights"],
        m=regions["m"],
        v=regions["v"],
        digest=digest,
    )


def describe_missing(path: str | os.PathLike[str]) -> list[str]:
    """What a resume from ``path`` will lack, one line each (empty: nothing).

    Without a companion ``step_NNNNNN.json`` (a ``.bin`` from another engine,
    or a ripresa save interrupted before its companion) everything in
    :data:`BIN_LACKS` is missing; without the ``.sha256`` sidecar nothing
    vouches for the content. The caller warns with these lines; it never
    invents the missing state.
    """
    p = Path(path)
    missing: list[str] = []
    side = sidecar_path(p)
    if not side.is_file():
        missing.append(
            f"sha256 sidecar '{side.name}': the content cannot be checked against a commit marker"
        )
    comp = companion_path(p)
    if not comp.is_file():
        missing.append(f"companion '{comp.name}': the following state is not restored:")
        missing.extend(f"  - {item}" for item in BIN_LACKS)
    return missing


__all__ = [
    "BIN_LACKS",
    "BYTES_PER_PARAM",
    "HEADER_SIZE",
    "MAX_PARAMS",
    "MAX_STEP",
    "BinArrays",
    "BinContents",
    "BinHeader",
    "bin_name",
    "check_n_params",
    "companion_path",
    "describe_missing",
    "parse_bin_name",
    "read_bin",
    "read_header",
    "save_bin",
    "write_bin",
]
