"""The syscall seam of every durable write: :data:`ops`, an instance of :class:`FileOps`.

Tests inject faults through its hooks (``OSError`` at the n-th operation, a
kill before, after or inside a write) or record a save's operations with
``ops.recorder`` to replay what a power cut could leave; this module only
offers the hook points and never decides to fail (docs/FAULTS.md, section 1).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Read/write granularity for streaming (bytes). 8 MiB keeps syscalls few
#: without a large private buffer.
CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class Digest:
    """sha256 (lowercase hex) and size in bytes of a file's content."""

    sha256: str
    size: int


@dataclass(frozen=True)
class RecordedOp:
    """One file operation as :attr:`FileOps.recorder` receives it, after it succeeded.

    ``op`` is ``open`` (a new file was created), ``write``, ``fsync``,
    ``rename``, ``fsync_dir``, ``unlink`` or ``rmtree`` (a folder removed). ``path`` is the file operated on
    (for ``write``/``fsync`` the temporary being written; for ``rename`` the
    source; for ``fsync_dir`` the folder); ``dst`` is a rename's destination;
    ``offset`` and ``data`` are a write's file offset and a copy of the bytes
    that the system call actually wrote.
    """

    op: str
    path: str
    dst: str | None = None
    offset: int | None = None
    data: bytes | None = None


class FileOps:
    """System calls used for durable writes. Subclass or wrap to inject faults.

    ``hook`` (if set) is called as ``hook(op, path)`` *before* each operation;
    raising from it simulates the operation failing (``OSError``), and a hook
    may also kill the process there to simulate a crash at that point.
    ``after_hook`` (if set) is called the same way right *after* an operation
    completed (a crash there leaves the operation done). For ``rename`` both
    hooks receive the destination.

    ``recorder`` (if set) receives a :class:`RecordedOp` after each successful
    operation, including the unlink of a discarded temporary; writes are
    recorded with their offset and a copy of their bytes. ``byte_budget`` (if
    set) is the number of bytes that writes may still put on disk: a write is
    cut to the budget, and once it is spent ``on_budget_spent`` is called
    (the crash tests kill the process there, possibly in the middle of a
    write's bytes). With all of these unset, each operation costs one
    attribute test more than the bare system call.
    """

    def __init__(self) -> None:
        self.hook: Callable[[str, str], None] | None = None
        self.after_hook: Callable[[str, str], None] | None = None
        self.recorder: Callable[[RecordedOp], None] | None = None
        self.byte_budget: int | None = None
        self.on_budget_spent: Callable[[], None] | None = None

    def _before(self, op: str, path: str | Path) -> None:
        if self.hook is not None:
            self.hook(op, str(path))

    def _after(self, op: str, path: str | Path) -> None:
        if self.after_hook is not None:
            self.after_hook(op, str(path))

    def _record(self, op: str, path: str | Path, **info: Any) -> None:
        if self.recorder is not None:
            self.recorder(RecordedOp(op, str(path), **info))

    def open_new(self, path: Path) -> int:
        self._before("open", path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._record("open", path)
        self._after("open", path)
        return fd

    def write(self, fd: int, data: memoryview, path: Path) -> int:
        self._before("write", path)
        if self.byte_budget is not None:
            if self.byte_budget <= 0:
                self._spent()
            data = data[: self.byte_budget]
        if self.recorder is None:
            n = os.write(fd, data)
        else:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
            n = os.write(fd, data)
            self.recorder(RecordedOp("write", str(path), offset=offset, data=bytes(data[:n])))
        if self.byte_budget is not None:
            self.byte_budget -= n
        self._after("write", path)
        if self.byte_budget is not None and self.byte_budget <= 0:
            self._spent()
        return n

    def _spent(self) -> None:
        if self.on_budget_spent is not None:
            self.on_budget_spent()

    def fsync(self, fd: int, path: Path) -> None:
        self._before("fsync", path)
        os.fsync(fd)
        self._record("fsync", path)
        self._after("fsync", path)

    def close(self, fd: int, path: Path) -> None:
        os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        self._before("rename", dst)
        os.replace(src, dst)
        self._record("rename", src, dst=str(dst))
        self._after("rename", dst)

    def fsync_dir(self, folder: Path) -> None:
        self._before("fsync_dir", folder)
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._record("fsync_dir", folder)
        self._after("fsync_dir", folder)

    def unlink(self, path: Path) -> None:
        self._before("unlink", path)
        os.unlink(path)
        self._record("unlink", path)
        self._after("unlink", path)

    def discard(self, path: Path) -> None:
        """Unlink a temporary left by a failed save (no hooks: it is a failure path)."""
        os.unlink(path)
        self._record("unlink", path)

    def rmtree(self, path: Path) -> None:
        """Remove a folder and everything in it (a ``.dcp`` generation or a partial one).

        Hooked as one operation ``rmtree`` on the folder; a missing folder is
        not an error. The entries are removed without following symlinks
        (:func:`shutil.rmtree`), so nothing outside the folder is touched.
        """
        self._before("rmtree", path)
        shutil.rmtree(path, ignore_errors=True)
        self._record("rmtree", path)
        self._after("rmtree", path)


#: The process-wide file-operation layer. Tests replace ``ops.hook``.
ops = FileOps()


def describe_oserror(exc: OSError) -> str:
    """``OSError: [errno 28 ENOSPC] No space left on device`` (errno number and name)."""
    if exc.errno is None:
        return f"{type(exc).__name__}: {exc}"
    name = errno.errorcode.get(exc.errno, "?")
    text = exc.strerror or os.strerror(exc.errno)
    return f"{type(exc).__name__}: [errno {exc.errno} {name}] {text}"
