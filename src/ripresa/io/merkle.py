"""The Merkle tree of the state fingerprint: leaves of named bytes, hashed in blocks over threads (docs/FORMAT.md,
"The state fingerprint").

A leaf is a name, a kind (a dtype name such as ``float32``, or ``json``), a shape and its bytes in logical order,
given as segments: bytes in memory or ranges of open files. Its bytes are cut into blocks of :data:`BLOCK` bytes
counted from the leaf's first byte, whatever the segments (so a tensor split over two files hashes as one held
whole); each block is hashed with sha256 on its own, in a pool of threads (``hashlib`` releases the GIL), and the
leaf's digest is the sha256 of its description and its block digests. A node (the root, a part) is the sha256 of
its leaves' names and digests in sorted name order. This module knows bytes only: the names and what a leaf is
come from :mod:`ripresa.formats.fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import IntegrityError

#: Bytes per hashed block of a leaf (a leaf of n bytes has ceil(n / BLOCK) blocks; an empty leaf none).
BLOCK = 4 * 1024 * 1024
#: The version tag hashed into every leaf and node: a change of the construction changes every fingerprint.
DOMAIN = b"ripresa.fingerprint/1"


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes at ``offset`` of the open file ``fd`` (the caller opened it safely and keeps it open)."""

    fd: int
    offset: int
    length: int
    path: str


Segment = memoryview | FileRange


@dataclass
class Leaf:
    """One named value of the tree: ``kind`` (a dtype name or ``json``), ``shape``, its bytes as ``segments``."""

    name: str
    kind: str
    shape: tuple[int, ...]
    segments: list[Segment] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.length if isinstance(s, FileRange) else s.nbytes for s in self.segments)

    def description(self) -> bytes:
        """What the leaf digest binds besides the bytes: name, kind, shape and byte count, as canonical JSON."""
        return json.dumps([self.name, self.kind, list(self.shape), self.nbytes], ensure_ascii=True,
                          separators=(",", ":")).encode()


def _cut(segments: Sequence[Segment], start: int, stop: int) -> list[Segment]:
    """The pieces of ``segments`` covering logical bytes ``[start, stop)``."""
    out: list[Segment] = []
    pos = 0
    for s in segments:
        n = s.length if isinstance(s, FileRange) else s.nbytes
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            if isinstance(s, FileRange):
                out.append(FileRange(s.fd, s.offset + lo - pos, hi - lo, s.path))
            else:
                out.append(s[lo - pos:hi - pos])
        pos += n
        if pos >= stop:
            break
    return out


_local = threading.local()


def _buffer(n: int) -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = memoryview(bytearray(max(n, BLOCK)))
        _local.buf = buf
    return buf[:n]


def _hash_block(pieces: Sequence[Segment]) -> bytes:
    h = hashlib.sha256()
    for p in pieces:
        if not isinstance(p, FileRange):
            h.update(p)
            continue
        done = 0
        while done < p.length:
            want = min(p.length - done, BLOCK)
            view = _buffer(want)
            try:
                got = os.preadv(p.fd, [view], p.offset + done)
            except OSError as exc:
                raise IntegrityError("a file could not be read while fingerprinted", file=p.path,
                                     expected=f"{p.length} bytes at offset {p.offset}",
                                     found=f"{type(exc).__name__}: {exc}"[:200], hint="the disk or the file is damaged") from None
            if got <= 0:
                raise IntegrityError("a file is shorter than its layout says (truncated while read?)", file=p.path,
                                     expected=f"{p.length} bytes at offset {p.offset}",
                                     found=f"end of file after {done} of them",
                                     hint="the file changed or was truncated after it was checked; fingerprint it again")
            h.update(view[:got])
            done += got
    return h.digest()


def default_threads() -> int:
    """Threads of a fingerprint by default: the CPUs this process may run on, at most 32."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    return max(1, min(32, n))


def leaf_digests(leaves: Sequence[Leaf], *, threads: int | None = None,
                 progress: Callable[[int], None] | None = None) -> list[bytes]:
    """The digest of each leaf, its blocks hashed over ``threads`` threads (:func:`default_threads`).

    ``progress(n)`` is told each time ``n`` more bytes are hashed (from the worker threads).
    """
    threads = default_threads() if threads is None else max(1, int(threads))
    blocks: list[list[bytes | None]] = []
    units: list[list[tuple[int, int, list[Segment]]]] = [[]]
    unit_bytes = 0
    for i, leaf in enumerate(leaves):
        n = leaf.nbytes
        count = -(-n // BLOCK)
        blocks.append([None] * count)
        for b in range(count):
            lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
            units[-1].append((i, b, _cut(leaf.segments, lo, hi)))
            unit_bytes += hi - lo
            if unit_bytes >= BLOCK:  # small leaves are gathered: one task holds at least a block's bytes
                units.append([])
                unit_bytes = 0

    def run(unit: list[tuple[int, int, list[Segment]]]) -> None:
        done = 0
        for i, b, pieces in unit:
            blocks[i][b] = _hash_block(pieces)
            done += sum(p.length if isinstance(p, FileRange) else p.nbytes for p in pieces)
        if progress is not None and done:
            progress(done)

    units = [u for u in units if u]
    if threads == 1 or len(units) <= 1:
        for u in units:
            run(u)
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(units)), thread_name_prefix="ripresa-fingerprint") as pool:
            for _ in pool.map(run, units):
                pass
    out = []
    for leaf, digests in zip(leaves, blocks, strict=True):
        h = hashlib.sha256(DOMAIN + b"\0leaf\0" + leaf.description() + b"\n")
        for d in digests:
            assert d is not None
            h.update(d)
        out.append(h.digest())
    return out


def node_digest(label: str, named: Iterable[tuple[str, bytes]]) -> bytes:
    """A node of the tree: sha256 of ``label`` and each (name, digest) in sorted name order."""
    h = hashlib.sha256(DOMAIN + b"\0node\0" + json.dumps(label).encode() + b"\n")
    for name, digest in sorted(named):
        h.update(json.dumps(name, ensure_ascii=True).encode() + b"\0" + digest)
    return h.digest()
