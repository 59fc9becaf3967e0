"""Durable writes, and the face of ripresa's disk layer.

Every durable write goes through :class:`StagedFile`: streamed to a temporary
sibling (same filesystem), hashed in the same pass, ``fsync``'d, renamed into
place, and the folder ``fsync``'d; an ``fsync`` error fails the save. The
syscall seam is :mod:`~ripresa.io.fileops`, safe reads :mod:`~ripresa.io.safe_read`,
hashes and sidecars :mod:`~ripresa.io.hashing`; their names stay importable
from here. Protocol and faults: docs/FORMAT.md, docs/FAULTS.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import SaveFailed
from .fileops import CHUNK, Digest, FileOps, RecordedOp, describe_oserror, ops
from .hashing import (
    SIDECAR_MAX,
    drop_page_cache,
    parse_sha256sum,
    parse_sha256sum_line,
    read_sidecar,
    read_whole_hashing,
    sha256_fd,
    sha256_file,
    sidecar_line,
    sidecar_path,
    verify_against_sidecar,
)
from .lock import pid_alive
from .safe_read import (
    MAX_JSON_COST,
    check_json_cost,
    iter_chunks,
    json_parse_cost,
    match_ascii,
    open_regular,
    open_run_file,
    parse_json_bytes,
    read_exact_hashing,
    read_json_small,
    read_small,
    require_regular_file,
)

#: A temporary's name: ``.NAME.tmp.PID.RANDOM``. The pid has at most 7
#: digits without a leading zero (Linux's ``PID_MAX_LIMIT`` is 4194304): a
#: name with more digits was not made by :func:`temp_name_for` and is not
#: treated as a temporary (no ``int`` of 10**400, no ``OverflowError``).
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>[1-9][0-9]{0,6})\.[0-9a-f]{8}\Z")
#: Largest pid a temporary's name may carry (Linux ``PID_MAX_LIMIT``).
PID_MAX = 1 << 22


def temp_name_for(final: Path) -> Path:
    """The temporary sibling of ``final``: ``.NAME.tmp.PID.RANDOM``."""
    return final.with_name(f".{final.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")


def temp_name_pid(name: str) -> int | None:
    """The writer pid in a name made by :func:`temp_name_for`, or ``None``.

    ``None`` for any other name, including one whose pid is out of range
    (0, or above :data:`PID_MAX`): such a file is not ours and is left alone.
    Never raises.
    """
    if len(name) > 512:
        return None
    m = _TEMP_RE.match(name)
    if m is None:
        return None
    pid = int(m.group("pid"))  # at most 7 digits: cannot overflow
    return pid if 0 < pid <= PID_MAX else None


def is_temp_name(name: str) -> bool:
    """True for names made by :func:`temp_name_for` (a pid in range, see :func:`temp_name_pid`)."""
    return temp_name_pid(name) is not None


def clean_temporaries(folder: Path, *, only_dead: bool = True) -> list[Path]:
    """Remove leftover temporary files of interrupted saves in ``folder``.

    With ``only_dead`` (the default) a temporary file whose writer pid is still
    alive is left alone: it may be a save in progress in another process. A
    holder of the run folder's writer lock passes ``only_dead=False``.
    """
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        pid = temp_name_pid(entry.name)
        if pid is None:
            continue
        if only_dead and (pid == os.getpid() or pid_alive(pid)):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                continue
            entry.unlink()  # unlinks a symlink itself, never its target
            removed.append(entry)
        except FileNotFoundError:
            pass
    return removed


#: Pieces at least this large are hashed in the helper thread while written (bytes).
_OVERLAP_MIN = 1 << 20
_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
    """One helper thread for sha256 updates (FIFO, so each file's updates stay in order)."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ripresa-sha256")
        return _HASHER


def _reset_hasher_after_fork() -> None:
    global _HASHER
    _HASHER = None  # a forked child has no helper thread; make a new one on demand


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_hasher_after_fork)


class StagedFile:
    """A file streamed to a temporary sibling, hashed as written, then published.

    Use as::

        with StagedFile(path) as f:
            f.write(b"...")
            digest = f.finish()   # fsync + close
            f.publish()           # atomic rename into place
        fsync_dir(path.parent)

    Leaving the ``with`` block by an exception removes the temporary file.
    ``overlap=False`` hashes each piece in the writing thread (files written
    side by side by their own workers, one hash stream each).
    """

    def __init__(self, final: str | Path, *, overlap: bool = True) -> None:
        self.final = Path(final)
        self._overlap = overlap
        self.temp = temp_name_for(self.final)
        self._sha = hashlib.sha256()
        self._pending: list[Future] = []
        self.size = 0
        self._fd: int | None = None
        self._published = False
        self.digest: Digest | None = None
        try:
            self._fd = ops.open_new(self.temp)
        except OSError as exc:
            raise _save_error("could not create a temporary file", self.temp, exc) from exc

    def write(self, data: bytes | bytearray | memoryview, *, stable: bool = False) -> int:
        """Write all of ``data`` (looping over partial writes) and hash it.

        A large piece is hashed in a helper thread *while* it is written
        (sha256 and ``write`` both release the GIL), so a save costs about
        max(hash, write) instead of their sum. ``stable=True`` promises that
        ``data`` stays unchanged until :meth:`finish`, which lets the hashing
        lag behind across calls, as far as it must (the writer runs at the
        disk's pace, the hash catches up by :meth:`finish`); otherwise this
        call waits for its own hash.
        The digest is the same either way: updates run in order.
        """
        if self._fd is None:
            raise SaveFailed("write after finish()", file=self.final)
        view = memoryview(data).cast("B")
        total = len(view)
        if not self._overlap:
            self._sha.update(view)
        elif total >= _OVERLAP_MIN or (stable and self._pending):
            self._pending.append(_hasher().submit(self._sha.update, view))
        elif self._pending:
            # Queue behind the pending updates (order matters) without waiting for them;
            # a private copy, since the caller may reuse its small buffer at once.
            self._pending.append(_hasher().submit(self._sha.update, bytes(view)))
        else:
            self._sha.update(view)
        done = 0
        try:
            while done < total:
                done += ops.write(self._fd, view[done:], self.temp)
        except OSError as exc:
            self._drain_hashes(ignore_errors=True)
            raise _save_error("write failed", self.temp, exc) from exc
        finally:
            if not stable:
                self._drain_hashes(ignore_errors=True)
        while self._pending and self._pending[0].done():  # finished updates: forget them (a failure is raised)
            self._pending.pop(0).result()
        self.size += total
        return total

    def settle(self) -> None:
        """Wait until every byte written so far is hashed: a ``stable`` piece may change after this returns."""
        self._drain_hashes()

    def _drain_hashes(self, *, ignore_errors: bool = False) -> None:
        """Wait for every queued hash update of this file (in order)."""
        while self._pending:
            fut = self._pending.pop(0)
            try:
                fut.result()
            except Exception:
                if not ignore_errors:
                    raise

    def flush(self) -> None:  # file-like protocol (torch.save calls it)
        return None

    def finish(self) -> Digest:
        """``fsync`` and close the temporary file; return its digest."""
        if self._fd is None:
            assert self.digest is not None
            return self.digest
        fd, self._fd = self._fd, None
        self._drain_hashes()
        try:
            ops.fsync(fd, self.temp)
        except OSError as exc:
            os.close(fd)
            raise _save_error("fsync failed (the data may not be on disk)", self.temp, exc) from exc
        ops.close(fd, self.temp)
        self.digest = Digest(self._sha.hexdigest(), self.size)
        return self.digest

    def publish(self) -> None:
        """Rename the finished temporary file to its final name (atomic)."""
        if self.digest is None:
            self.finish()
        try:
            ops.rename(self.temp, self.final)
        except OSError as exc:
            raise _save_error("rename into place failed", self.final, exc) from exc
        self._published = True

    def discard(self) -> None:
        """Close and remove the temporary file (idempotent)."""
        self._drain_hashes(ignore_errors=True)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if not self._published:
            try:
                ops.discard(self.temp)
            except FileNotFoundError:
                pass
            except OSError:
                pass

    def __enter__(self) -> StagedFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._published:
            self.discard()


def _save_error(what: str, path: Path, exc: OSError) -> SaveFailed:
    hint = "the previous checkpoint is untouched"
    if exc.errno == errno.ENOSPC:
        hint = "the disk is full; free space and retry — " + hint
    elif exc.errno == errno.EIO:
        hint = "the device reported an I/O error; check the disk — " + hint
    elif exc.errno == errno.EFBIG:
        hint = "a file-size limit (RLIMIT_FSIZE or the filesystem's) was hit — " + hint
    return SaveFailed(
        f"save failed: {what}",
        file=path,
        expected="a durable write",
        found=describe_oserror(exc),
        hint=hint,
    )


def fsync_dir(folder: str | Path) -> None:
    """``fsync`` a folder, so that renames and creations inside it are durable."""
    try:
        ops.fsync_dir(Path(folder))
    except OSError as exc:
        raise _save_error("fsync of the folder failed", Path(folder), exc) from exc


def write_atomic(final: str | Path, chunks: Iterable[bytes | bytearray | memoryview], *, sync_dir: bool = True) -> Digest:
    """Stream ``chunks`` to ``final`` with the full commit protocol; return its digest."""
    final = Path(final)
    with StagedFile(final) as f:
        for chunk in chunks:
            f.write(chunk)
        digest = f.finish()
        f.publish()
    if sync_dir:
        fsync_dir(final.parent)
    return digest


def write_sidecar(path: str | Path, digest: Digest | str, *, sync_dir: bool = True) -> Path:
    """Write ``path.sha256`` atomically, so that ``sha256sum -c`` passes."""
    p = Path(path)
    side = sidecar_path(p)
    write_atomic(side, [sidecar_line(digest, p.name)], sync_dir=sync_dir)
    return side


def copy_hashing(fd: int, out: StagedFile, *, what: str = "file", path: str | Path | None = None,
                 on_chunk: Callable[[memoryview], None] | None = None, size: int | None = None) -> Digest:
    """Stream ``fd`` into ``out``, hashed while written; ``fsync`` it; return the copy's digest.

    The one copy loop of the verified copies (``ripresa fork``, ``ripresa
    export``): :class:`StagedFile` hashes each piece in a helper thread while
    it is written, so the copy costs about max(read+write, hash). Without
    ``size`` it copies to EOF; with it, exactly ``size`` bytes
    (:func:`read_exact_hashing`: a file that shrinks meanwhile is an
    :class:`~ripresa.errors.IntegrityError`). A read error is a
    :class:`~ripresa.errors.BadInput`. ``on_chunk`` sees each piece after it
    was written (a progress bar, a copy kept in memory). The caller compares
    the digest and publishes.
    """
    if size is None:
        for piece in iter_chunks(fd, what=what, path=path):
            out.write(piece)
            if on_chunk is not None:
                on_chunk(piece)
        return out.finish()
    view = memoryview(bytearray(max(1, min(CHUNK, size))))
    views = [view] * (size // len(view)) + ([view[: size % len(view)]] if size % len(view) else [])
    read_exact_hashing(fd, views, _WriteThrough(out, on_chunk), path=path, what=what, piece=len(view), overlap=False)
    return out.finish()


class _WriteThrough:
    """The ``hasher`` :func:`copy_hashing` gives :func:`read_exact_hashing`: each piece read is written to the copy."""

    def __init__(self, out: StagedFile, on_chunk: Callable[[memoryview], None] | None) -> None:
        self.out, self.on_chunk = out, on_chunk

    def update(self, piece: memoryview) -> None:
        self.out.write(piece)
        if self.on_chunk is not None:
            self.on_chunk(piece)


__all__ = [
    "CHUNK", "MAX_JSON_COST", "PID_MAX", "SIDECAR_MAX", "Digest", "FileOps", "RecordedOp", "StagedFile",
    "check_json_cost", "clean_temporaries", "copy_hashing", "describe_oserror", "drop_page_cache", "fsync_dir",
    "is_temp_name", "iter_chunks", "json_parse_cost", "match_ascii", "open_regular", "open_run_file", "ops",
    "parse_json_bytes", "parse_sha256sum", "parse_sha256sum_line", "read_exact_hashing", "read_json_small",
    "read_sidecar", "read_small", "read_whole_hashing", "require_regular_file", "sha256_fd", "sha256_file", "sidecar_line", "sidecar_path",
    "temp_name_for", "temp_name_pid", "verify_against_sidecar", "write_atomic", "write_sidecar",
]
