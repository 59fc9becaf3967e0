"""The contract of a mirror's second store (docs/MIRROR.md): the :class:`ObjectStore` protocol, its keys and errors.

Both stores build on it: :mod:`ripresa.io.folderstore` (a folder) and :mod:`ripresa.io.s3store` (S3-compatible);
:func:`ripresa.io.objstore.open_store` picks one from a URL.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ..errors import IntegrityError, SaveFailed
from .fsio import CHUNK, open_run_file

#: Most keys a listing returns before it is refused as hostile.
MAX_KEYS = 100_000
#: Most entries a listing may go through in all, its pages together, kept or not (docs/FAULTS.md, "Many
#: pieces, one budget"): each page is bounded, their sum is bounded too (an empty page counts as one).
MAX_LISTED = 4 * MAX_KEYS
#: The writer lock of an S3 mirror (an object; a folder mirror uses an ``flock`` on ``LOCK``).
LOCK_KEY = "RIPRESA_MIRROR.lock"
#: Seconds an S3 writer's lease lasts without renewal (renewed every third of it while the writer lives).
LEASE = 120.0
#: Objects above this size are uploaded in parts (bytes).
MULTIPART_THRESHOLD = 64 * 1024 * 1024
#: Size of one part of a multipart upload (bytes; S3's minimum is 5 MiB).
PART_SIZE = 16 * 1024 * 1024
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}(?:/(?!\.\.?\Z)[A-Za-z0-9_.][A-Za-z0-9._-]{0,254})?")


def key_ok(key: object) -> bool:
    """Whether ``key`` is a name ripresa writes (:func:`check_key` without the exception)."""
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None and ".." not in key


class RemoteUnavailable(SaveFailed):
    """The store could not be reached or refused for now (network, timeout, reset, 5xx, throttling): retry later."""


class RemoteNotFound(IntegrityError):
    """A key the caller expected is not in the store."""


def check_key(key: str) -> str:
    """``key`` if it is a name ripresa writes, else ``ValueError``: at most one ``/`` (a ``.dcp`` folder's file,
    which may start with ``.``: ``.metadata``), no ``..``, no other leading ``.``."""
    if not key_ok(key):
        raise ValueError(f"not an object key ripresa writes: {key!r:.120}")
    return key


class Writer(Protocol):
    def write(self, data: bytes | bytearray | memoryview) -> int: ...


class ObjectStore(Protocol):
    """What the mirror needs from a second store.

    Keys are names relative to the prefix: ``config.json``, ``step_000100.bin``, ``step_000100.dcp/__0_0.distcp``
    (:func:`check_key`). Everything read from the store is hostile: :meth:`get_into` streams at most ``limit`` bytes
    into the caller's writer (never the whole object in memory), :meth:`get_bytes` refuses an object larger than its
    limit before reading it, and a listing is bounded (:data:`MAX_KEYS`). :meth:`put_file` re-hashes the file as it
    reads it and completes the object only when the sha256 is the one the caller expects (a multipart upload above
    :attr:`multipart_threshold` is aborted otherwise). Each store also has a writer lock (``acquire``/``release``: a
    folder's ``flock``, an S3 prefix's lease object :data:`LOCK_KEY`) and ``entries`` (the raw names, to tell a
    mirror from a run folder). Failures are typed: :class:`RemoteUnavailable` (retried by the mirror),
    :class:`RemoteNotFound`, :class:`~ripresa.errors.BadInput` for a bad URL or missing credentials,
    :class:`~ripresa.errors.MissingDependency` without boto3.
    """

    url: str
    multipart_threshold: int

    def put_file(self, key: str, path: Path, *, sha256: str) -> int:
        """Upload the file at ``path`` as ``key``, re-hashed as read; complete it only if its sha256 is ``sha256``."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Upload a small object whole."""

    def get_into(self, key: str, out: Writer, *, limit: int) -> int:
        """Stream object ``key`` into ``out`` (at most ``limit`` bytes, else refused); return its size."""

    def get_bytes(self, key: str, *, limit: int) -> bytes:
        """A small object whole (refused above ``limit`` bytes)."""

    def list(self) -> dict[str, int]:
        """Every key under the prefix that :func:`check_key` accepts, with its size."""

    def delete(self, key: str) -> None:
        """Remove ``key`` (absent: nothing happens)."""


class HashedFile:
    """The pieces of a run folder's file (no symlink, no FIFO), hashed as they are read; :meth:`check` compares."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.sha = hashlib.sha256()

    def __iter__(self) -> Iterator[memoryview]:
        fd = open_run_file(self.path, "generation file", error=IntegrityError)
        buf = memoryview(bytearray(CHUNK))
        try:
            while True:
                n = os.readv(fd, [buf])
                if not n:
                    return
                self.sha.update(buf[:n])
                yield buf[:n]
        finally:
            os.close(fd)

    def check(self, want: str) -> None:
        if self.sha.hexdigest() != want:
            raise _changed(self.path, want, self.sha.hexdigest())


def _changed(path: Path, want: str, found: str) -> IntegrityError:
    return IntegrityError("the local file does not match its commit marker: not uploaded", file=path, expected=want,
                          found=found, hint="it changed after its commit (bit rot, an edit); `ripresa inspect` the run")


class GetBytes:
    """``get_bytes`` for a store: its ``get_into`` into memory (bounded by ``limit``, like every read)."""

    def get_bytes(self, key: str, *, limit: int) -> bytes:
        buf = bytearray()

        class _W:
            def write(self, data: Any) -> int:
                buf.extend(data)
                return len(data)

        self.get_into(key, _W(), limit=limit)  # type: ignore[attr-defined]
        return bytes(buf)
