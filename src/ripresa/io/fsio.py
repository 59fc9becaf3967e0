"""The one small layer through which ripresa touches the disk.

Every durable write goes through :class:`StagedFile`: the bytes are streamed to
a temporary name *in the destination folder* (never ``$TMPDIR``: a rename is
atomic only inside one filesystem), hashed with sha256 in the same pass, then
``fsync``'d, renamed into place, and the folder is ``fsync``'d so the rename
itself survives a power cut. An ``fsync`` error fails the save: a page that
failed to reach the disk may be dropped by the kernel, so retrying and
trusting the second answer would be a lie.

Reads of checkpoints and sidecars open through :func:`open_regular` (or its
private core): open first (non-blocking, so a FIFO cannot hang the
reader), then ``fstat`` the descriptor, so what is read is what was checked.
:func:`read_exact_hashing` reads into the caller's buffers and hashes in the
same pass, so a checkpoint is read *and* verified with one read of the disk.

All system calls of a save go through :data:`ops`, an instance of :class:`FileOps`, so
that tests can inject faults (``OSError`` at the n-th ``write``/``fsync``/
``rename``, SIGKILL before or after an operation or in the middle of a
write's bytes) or record the operations of a save, without mocking any class
of the library. ``ops.recorder`` (off by default) receives every operation with,
for a write, its file offset and a copy of its bytes: the fault matrix replays
those records to materialise what a power cut could leave on the disk
(``docs/FAULTS.md``). This module only offers the hook points; it never
decides to crash or fail, and reads no environment variable to do so. The
injectors that do are test support (``tests/support/ripresa_faults.py``),
switched on in a child process by the ``sitecustomize.py`` next to it, which
the tests put on the child's ``PYTHONPATH`` (docs/FAULTS.md, section 1).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput, IntegrityError, RipresaError, SaveFailed
from .lock import pid_alive

#: Read/write granularity for streaming (bytes). 8 MiB keeps syscalls few
#: without a large private buffer.
CHUNK = 8 * 1024 * 1024
#: Buffers of one ``readv`` (Linux's IOV_MAX is 1024).
_MAX_IOV = 512

#: A temporary's name: ``.NAME.tmp.PID.RANDOM``. The pid has at most 7
#: digits without a leading zero (Linux's ``PID_MAX_LIMIT`` is 4194304): a
#: name with more digits was not made by :func:`temp_name_for` and is not
#: treated as a temporary (no ``int`` of 10**400, no ``OverflowError``).
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>[1-9][0-9]{0,6})\.[0-9a-f]{8}\Z")
#: Largest pid a temporary's name may carry (Linux ``PID_MAX_LIMIT``).
PID_MAX = 1 << 22
#: One ``sha256sum`` line; matched with ``fullmatch`` (``\Z``, not ``$``, so a
#: second newline is refused). No control characters (``\r``, NUL, ...) in the
#: name, and at most one ``/`` (a ``.dcp`` marker names ``FOLDER/FILE``);
#: :func:`parse_sha256sum_line` refuses the ``/`` unless asked.
_SHA_LINE_RE = re.compile(r"(?P<hex>[0-9a-f]{64}) [ *](?P<name>[^/\x00-\x1f\x7f]+(?:/[^/\x00-\x1f\x7f]+)?)\n?\Z")
#: Largest sidecar accepted (bytes). A valid line is at most 64 + 2 + 255 + 1.
SIDECAR_MAX = 4096


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
#: Hash updates a ``stable`` writer may leave queued (bounds the lag, in pieces).
_MAX_PENDING = 4
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
    """

    def __init__(self, final: str | Path) -> None:
        self.final = Path(final)
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
        lag behind across calls; otherwise this call waits for its own hash.
        The digest is the same either way: updates run in order.
        """
        if self._fd is None:
            raise SaveFailed("write after finish()", file=self.final)
        view = memoryview(data).cast("B")
        total = len(view)
        if total >= _OVERLAP_MIN or (stable and self._pending):
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
        while len(self._pending) > _MAX_PENDING:
            self._pending.pop(0).result()
        self.size += total
        return total

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
        found=_describe_oserror(exc),
        hint=hint,
    )


def _describe_oserror(exc: OSError) -> str:
    """``OSError: [errno 28 ENOSPC] No space left on device`` (errno number and name)."""
    if exc.errno is None:
        return f"{type(exc).__name__}: {exc}"
    name = errno.errorcode.get(exc.errno, "?")
    text = exc.strerror or os.strerror(exc.errno)
    return f"{type(exc).__name__}: [errno {exc.errno} {name}] {text}"


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


def sidecar_path(path: str | Path) -> Path:
    """``X`` → ``X.sha256``."""
    p = Path(path)
    return p.with_name(p.name + ".sha256")


def parse_sha256sum_line(line: str, *, in_folder: bool = False) -> tuple[str, str] | None:
    """``"<64 hex>  NAME"`` (one ``sha256sum`` line, text or binary mode) → ``(hex, NAME)``; None if malformed.

    The one parser of the ``sha256sum`` lines ripresa writes (sidecars,
    generation markers, ``.dcp`` markers). ``NAME`` holds no control
    character and no ``/`` — except, with ``in_folder``, exactly one
    (``FOLDER/FILE``, a ``.dcp`` marker's lines). One trailing newline is
    accepted, nothing after it.
    """
    m = _SHA_LINE_RE.fullmatch(line)
    if m is None:
        return None
    name = m.group("name")
    if "/" in name and not in_folder:
        return None
    return m.group("hex"), name


def parse_sha256sum(raw: bytes, *, in_folder: bool = False) -> list[tuple[str, str]] | None:
    """Every line of a ``sha256sum`` file (:func:`parse_sha256sum_line`); None if any is malformed or not ASCII."""
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        return None
    out = []
    for line in lines:
        parsed = parse_sha256sum_line(line, in_folder=in_folder)
        if parsed is None:
            return None
        out.append(parsed)
    return out


def sidecar_line(digest: Digest | str, name: str) -> bytes:
    """One ``sha256sum`` line: ``<hex>  <name>\\n`` (two spaces: text mode)."""
    hexd = digest.sha256 if isinstance(digest, Digest) else digest
    return f"{hexd}  {name}\n".encode()


def write_sidecar(path: str | Path, digest: Digest | str, *, sync_dir: bool = True) -> Path:
    """Write ``path.sha256`` atomically, so that ``sha256sum -c`` passes."""
    p = Path(path)
    side = sidecar_path(p)
    write_atomic(side, [sidecar_line(digest, p.name)], sync_dir=sync_dir)
    return side


# ---- reading: open what was checked, read it once -------------------------------


def _kind_of(mode: int) -> str:
    """A file type in words, for error messages."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "a special file"


class _Refused(Exception):
    """Why :func:`_open_checked` refused a path (mapped to a public error by the caller).

    ``kind``: ``missing``, ``symlink``, ``folder``, ``special``, ``unreadable``
    or ``error``; ``found``: what is there, in words.
    """

    def __init__(self, kind: str, found: str) -> None:
        super().__init__(kind, found)
        self.kind = kind
        self.found = found


def _open_checked(
    path: Path, *, follow_symlinks: bool = True, access: int = os.O_RDONLY, create_mode: int = 0o644,
    dir_fd: int | None = None,
) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only and return ``(fd, fstat)`` if it is a regular file.

    ``O_NONBLOCK`` makes the open of a FIFO (or of a FIFO swapped in for a
    file) return at once instead of waiting for a writer; ``fstat`` on the
    *open descriptor* then decides, so there is no window between a check of
    the path and the open. ``O_NONBLOCK`` is cleared again before returning.
    Without ``follow_symlinks`` a symlink is refused (``O_NOFOLLOW``).
    Reads do not go through :data:`ops` (its hook counts the save protocol's
    operations).
    """
    flags = access | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, create_mode, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise _Refused("missing", "nothing at this path") from exc
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise _Refused("folder", "a folder") from exc
        if exc.errno == errno.ELOOP:
            if not follow_symlinks and _is_link(path, dir_fd):
                raise _Refused("symlink", "a symlink") from exc
            raise _Refused("special", "a symlink loop") from exc
        if exc.errno == errno.ENXIO:  # a socket, or a device with nothing behind it
            raise _Refused("special", "a socket or device") from exc
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise _Refused("unreadable", _describe_oserror(exc)) from exc
        raise _Refused("error", _describe_oserror(exc)) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _Refused("folder", "a folder")
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("special", _kind_of(st.st_mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


_FOLDER_HINT = (
    "give the path of a file inside the folder (e.g. RUN/checkpoint.pt); "
    "`ripresa inspect RUN` lists a run folder's generations"
)

#: For each kind of refused open: what is wrong with the file, what was expected, the hint.
_OPEN_ERRORS = {
    "missing": ("not found", "an existing file", "check the path; `ripresa inspect RUN` lists the valid generations"),
    "folder": ("is a folder", "a regular file", _FOLDER_HINT),
    "special": ("is not a regular file", "a regular file", "ripresa never reads from special files"),
    "symlink": ("is not a regular file", "a regular file", "ripresa never reads from special files"),
    "unreadable": ("is not readable", "read permission", "check the file's permissions and owner"),
}
_OPEN_FAILED = ("could not be opened", "a readable regular file", "check the disk and the path")


def _open_error(path: Path, what: str, refused: _Refused) -> BadInput:
    """The :class:`BadInput` for a refused open of ``path``."""
    problem, expected, hint = _OPEN_ERRORS.get(refused.kind, _OPEN_FAILED)
    return BadInput(f"{what} {problem}", file=path, expected=expected, found=refused.found, hint=hint)


def open_regular(path: str | Path, what: str = "checkpoint") -> int:
    """Open an existing regular file read-only; return the descriptor (caller closes).

    The file is opened first (``O_RDONLY | O_NONBLOCK | O_CLOEXEC``) and the
    *descriptor* is checked with ``fstat``, so what is read is exactly what
    was checked, and a FIFO never blocks. ``O_NONBLOCK`` is cleared before
    returning. A symlink to a regular file is followed.

    Raises :class:`~ripresa.errors.BadInput` (naming file, expected, found and
    a hint) for a missing path, a folder, a FIFO, socket or device, and a file
    that cannot be opened (permissions, I/O error). ``what`` names the file in
    the message (``"checkpoint"``, ``"ANDREA .bin"``, ...).
    """
    p = Path(path)
    try:
        fd, _ = _open_checked(p)
    except _Refused as refused:
        raise _open_error(p, what, refused) from refused.__cause__
    return fd


_RUN_FILE_ACCESS = {
    "read": os.O_RDONLY,
    "append": os.O_RDWR | os.O_APPEND,
    "create_append": os.O_RDWR | os.O_APPEND | os.O_CREAT,
}


def open_run_file(
    path: str | Path, what: str, *, mode: str = "read", error: type[RipresaError] = BadInput,
    dir_fd: int | None = None,
) -> int:
    """Open a file of a run folder, a bundle or a ledger; return the descriptor (caller closes).

    The one way ripresa opens such a file (``docs/FAULTS.md``, hostile run
    folders): ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``, then ``fstat`` on the
    *descriptor*, so a symlink is refused (never followed out of the folder),
    a FIFO never blocks (neither for reading nor for writing), and a folder,
    socket or device is refused. ``O_NONBLOCK`` is cleared before returning.

    ``mode``: ``"read"`` (read-only), ``"append"`` (read-write, every write
    appended, the file must exist; the descriptor can ``pread`` the very file
    it appends to, e.g. to repair a torn last line) or ``"create_append"`` (the same, created ``0o644`` if
    missing; a dangling symlink is refused, not followed to create its target).

    Every refusal is an ``error`` (:class:`~ripresa.errors.BadInput` by
    default; a caller reading an integrity-covered file passes
    :class:`~ripresa.errors.IntegrityError`) naming file, expected, found and
    a hint. ``dir_fd``: ``path`` is a name relative to that open folder
    (``openat``), so no component above it is resolved again.
    """
    try:
        access = _RUN_FILE_ACCESS[mode]
    except KeyError:
        raise ValueError(f"open_run_file: unknown mode {mode!r}") from None
    p = Path(path)
    try:
        fd, _ = _open_checked(p, follow_symlinks=False, access=access, dir_fd=dir_fd)
    except _Refused as refused:
        raise _run_file_error(p, what, refused, error) from None
    return fd


def _is_link(path: Path, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _run_file_error(path: Path, what: str, refused: _Refused, error: type[RipresaError]) -> RipresaError:
    base = _open_error(path, what, refused)
    if refused.kind == "symlink":
        return error(
            f"{what} is a symlink",
            file=path,
            expected="a regular file inside the folder",
            found="a symlink",
            hint="ripresa never follows links inside a run folder, bundle or ledger; "
            "replace the link by the file itself",
        )
    return error(base.message, file=path, expected=base.expected, found=base.found, hint=base.hint)


def read_small(
    path: str | Path, what: str, limit: int, *, error: type[RipresaError] = BadInput
) -> bytes:
    """Read a whole small file of a run folder, a bundle or a ledger, bounded by ``limit`` bytes.

    The one bounded small-file reader: opened with :func:`open_run_file` (no
    symlink, no FIFO, a regular file), its size checked on the descriptor
    *before* any buffer is allocated, then at most ``limit + 1`` bytes read
    (a file that grew past ``limit`` while read is refused too). Refusals are
    ``error`` (:class:`~ripresa.errors.BadInput` by default).
    """
    p = Path(path)
    fd = open_run_file(p, what, error=error)
    try:
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:  # pragma: no cover - fstat of an open fd
            raise _read_error(p, what, exc, "a readable file") from exc
        if size > limit:
            raise _too_large(error, p, what, limit, f"{size} bytes", "this is not a file ripresa wrote; remove or replace it")
        chunks: list[bytes] = []
        got_total = 0
        while got_total <= limit:
            try:
                got = os.read(fd, min(CHUNK, limit + 1 - got_total))
            except OSError as exc:
                raise _read_error(p, what, exc, f"at most {limit} bytes") from exc
            if not got:
                break
            chunks.append(got)
            got_total += len(got)
    finally:
        os.close(fd)
    if got_total > limit:
        raise _too_large(error, p, what, limit, f"more than {limit} bytes (it grew while read)",
                         "another process is writing this file")
    return b"".join(chunks)


def _too_large(error: type[RipresaError], path: Path, what: str, limit: int, found: str, hint: str) -> RipresaError:
    return error(f"{what} is too large", file=path, expected=f"at most {limit} bytes", found=found, hint=hint)


#: The most memory (bytes, :func:`json_parse_cost`'s upper estimate) parsing one JSON file of a
#: run folder may take (docs/FAULTS.md, "Memory"). A companion of real float buffers costs
#: ~3.5 bytes per file byte (a 36 MiB one fits); a file of tiny containers (``[{},{},...]``)
#: costs ~80 and is refused before ``json.loads`` allocates anything.
MAX_JSON_COST = 128 * 1024 * 1024
# Upper bounds (bytes, CPython 3.11-3.13, 64-bit) of what json.loads allocates per token; measured
# with tracemalloc: a dict ~200 with a few keys, a list ~64, a number ~32 plus its slot, a
# string ~49 plus its text, a key's entry in its dict ~40.
_COST_DICT, _COST_LIST, _COST_VALUE, _COST_STRING, _COST_KEY = 232, 96, 48, 64, 48


def json_parse_cost(raw: bytes | str) -> int:
    """An upper estimate of the memory ``json.loads(raw)`` allocates, from a bounded pre-scan.

    Counts the structural bytes (``{``, ``[``, ``,``, ``:`` and ``"``) with
    ``bytes.count`` (C speed, no allocation): every container, value, string
    and key of the document is announced by one of them, so the estimate
    bounds the parse whatever the document's shape (a brace inside a string
    is counted too: the estimate errs high, never low). Valid ripresa files
    cost 2-10 bytes per file byte; hostile ones of empty containers ~80.
    """
    b = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    return (2 * len(b)  # the decoded text and the strings' characters
            + _COST_DICT * b.count(b"{") + _COST_LIST * b.count(b"[")
            + _COST_VALUE * (b.count(b",") + 1) + _COST_KEY * b.count(b":")
            + _COST_STRING * (b.count(b'"') // 2 + 1))


def check_json_cost(
    raw: bytes | str, path: str | Path | None, what: str, *, limit: int = MAX_JSON_COST,
    error: type[RipresaError] = BadInput,
) -> int:
    """Refuse, before parsing, a JSON document whose :func:`json_parse_cost` exceeds ``limit``; return the cost."""
    cost = json_parse_cost(raw)
    if cost > limit:
        raise error(
            f"{what} would take too much memory to parse",
            file=path,
            expected=f"a JSON document whose parse takes at most {limit >> 20} MiB",
            found=f"{len(raw)} bytes whose structure would take ~{cost >> 20} MiB",
            hint="the file is made of far more containers, keys or strings than ripresa writes; "
            "it was not written by ripresa and is not parsed (docs/FAULTS.md, \"Memory\")",
        )
    return cost


def parse_json_bytes(
    raw: bytes, path: str | Path | None, what: str, *, error: type[RipresaError] = BadInput,
    max_cost: int = MAX_JSON_COST,
) -> Any:
    """``json.loads`` of bytes read from a file, every failure mapped to ``error``.

    The document's parse cost is bounded first (:func:`check_json_cost`, at
    most ``max_cost`` bytes of parsed objects). Invalid UTF-8, invalid JSON,
    deep nesting (``RecursionError``) and numbers the parser cannot hold are all
    refused with file, expected, found and hint; nothing else escapes.
    """
    import json

    check_json_cost(raw, path, what, limit=max_cost, error=error)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        found = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RecursionError) else "nesting too deep"
        raise error(
            f"{what} is not valid JSON",
            file=path,
            expected="a JSON document as ripresa writes it",
            found=found[:300],
            hint="the file is damaged or was not written by ripresa",
        ) from None


def read_json_small(
    path: str | Path, what: str, limit: int, *, error: type[RipresaError] = BadInput,
    max_cost: int = MAX_JSON_COST,
) -> Any:
    """:func:`read_small` then :func:`parse_json_bytes` (parse cost bounded); every failure is an ``error``."""
    return parse_json_bytes(read_small(path, what, limit, error=error), path, what, error=error, max_cost=max_cost)


def _read_error(path: str | Path | None, what: str, exc: OSError, expected: str) -> BadInput:
    return BadInput(
        f"{what} could not be read",
        file=path,
        expected=expected,
        found=_describe_oserror(exc),
        hint="check the disk and the file's permissions",
    )


def read_exact_hashing(
    fd: int,
    views: Sequence[memoryview | bytearray],
    hasher: Any | None = None,
    *,
    path: str | Path | None = None,
    what: str = "file",
    piece: int = CHUNK,
    overlap: bool = True,
) -> int:
    """Fill every buffer in ``views``, in order, from ``fd``, hashing as it reads.

    One pass: each piece (at most ``piece`` bytes; consecutive small buffers are
    gathered into one piece, one ``os.readv``) is read straight into the caller's
    buffers (no intermediate copy) and then fed to ``hasher``
    (anything with ``update``, e.g. ``hashlib.sha256()``; ``None`` to only
    read). A reader can so read a 1.4 GB file into preallocated arrays *and*
    verify its sha256 with one read of the disk. With ``overlap`` (and more
    than two pieces) the hashing of a piece runs in one helper thread while
    the next piece is read (``hashlib`` releases the GIL), in file order.

    Returns the number of bytes read (the total length of ``views``). A file
    that ends early raises :class:`~ripresa.errors.IntegrityError` (it shrank
    while it was read); a read error raises :class:`~ripresa.errors.BadInput`.
    ``path`` and ``what`` name the file in these errors.
    """
    flat = [v if isinstance(v, memoryview) else memoryview(v) for v in views]
    flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in flat]
    for v in flat:
        if v.readonly:
            raise ValueError("read_exact_hashing needs writable buffers")
    total = sum(len(v) for v in flat)
    if piece < 1:
        raise ValueError("piece must be >= 1")
    use_thread = hasher is not None and overlap and total > 2 * piece
    done = 0

    def groups() -> Iterator[list[memoryview]]:
        """Pieces of at most ``piece`` bytes, each one ``readv`` over consecutive buffers (small tensors gathered)."""
        group: list[memoryview] = []
        size = 0
        for v in flat:
            for start in range(0, len(v), piece):
                seg = v[start : start + piece]
                if group and (size + len(seg) > piece or len(group) >= _MAX_IOV):
                    yield group
                    group, size = [], 0
                group.append(seg)
                size += len(seg)
        if group:
            yield group

    def fill(group: list[memoryview]) -> None:
        nonlocal done
        want = sum(len(b) for b in group)
        got_here, i, bufs = 0, 0, list(group)
        while got_here < want:
            try:
                got = os.readv(fd, bufs[i:])
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
            except OSError as exc:
                raise _read_error(path, what, exc, f"{total} bytes") from exc
            if got == 0:
                raise IntegrityError(
                    f"{what} ended early: it shrank while it was read",
                    file=path,
                    expected=f"{total} bytes",
                    found=f"{done + got_here} bytes, then end of file",
                    hint="another process is writing this file; read a committed generation",
                )
            got_here += got
            while got and i < len(bufs):  # skip what this read filled; go on inside a partly filled buffer
                if got >= len(bufs[i]):
                    got -= len(bufs[i])
                    i += 1
                else:
                    bufs[i] = bufs[i][got:]
                    got = 0
        done += want

    def digest(group: list[memoryview]) -> None:
        for b in group:
            hasher.update(b)

    if not use_thread:
        for group in groups():
            fill(group)
            if hasher is not None:
                digest(group)
        return done

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ripresa-hash") as pool:
        pending: Future[None] | None = None
        try:
            for group in groups():
                fill(group)
                if pending is not None:
                    pending.result()  # keep the hash in file order
                pending = pool.submit(digest, group)
        finally:
            if pending is not None:
                pending.result()
    return done


def iter_chunks(fd: int, *, what: str = "file", path: str | Path | None = None) -> Iterator[memoryview]:
    """The bytes ``fd`` reads from its current offset to EOF, as views of one reused buffer.

    Each view is valid until the next one is asked for (copy it to keep it).
    A read error is :class:`~ripresa.errors.BadInput` naming ``path``.
    """
    view = memoryview(bytearray(CHUNK))
    while True:
        try:
            n = os.readv(fd, [view])
        except OSError as exc:
            raise _read_error(path, what, exc, "a readable file") from exc
        if not n:
            return
        yield view[:n]


def sha256_fd(fd: int, *, what: str = "file", path: str | Path | None = None) -> Digest:
    """sha256 and size of everything ``fd`` reads from its current offset to EOF.

    For a freshly opened descriptor (e.g. from :func:`open_regular`) that is
    the whole file. One reused buffer; the descriptor is left open at EOF.
    """
    h = hashlib.sha256()
    size = 0
    for piece in iter_chunks(fd, what=what, path=path):
        h.update(piece)
        size += len(piece)
    return Digest(h.hexdigest(), size)


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


def _fadvise(fd: int, advice_name: str) -> bool:
    advice = getattr(os, advice_name, None)
    if advice is None or not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except OSError:
        return False
    return True


def sha256_file(path: str | Path, *, drop_cache: bool = False, what: str = "file") -> Digest:
    """Stream a regular file through sha256 with one reused buffer; return its digest.

    Opened with :func:`open_regular` (a FIFO, folder or device is refused
    with :class:`~ripresa.errors.BadInput`, never read or waited on). With
    ``drop_cache`` the file's clean pages are dropped from the page cache
    afterwards.
    """
    p = Path(path)
    fd = open_regular(p, what)
    try:
        _fadvise(fd, "POSIX_FADV_SEQUENTIAL")
        digest = sha256_fd(fd, what=what, path=p)
        if drop_cache:
            _fadvise(fd, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)
    return digest


def drop_page_cache(path: str | Path) -> bool:
    """Ask the kernel to drop ``path``'s cached pages (``POSIX_FADV_DONTNEED``).

    For benchmarks of cold reads. No ``fsync`` is done: dirty pages (a file
    written but not yet synced) stay cached; files published through
    :class:`StagedFile` are already synced. Returns ``False`` where the
    platform has no ``posix_fadvise`` or the advice failed. Refuses a path
    that is not a regular file (:class:`~ripresa.errors.BadInput`).
    """
    fd = open_regular(path, "file")
    try:
        return _fadvise(fd, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


def match_ascii(pattern: re.Pattern[str], raw: bytes | bytearray) -> re.Match[str] | None:
    """``pattern.fullmatch`` of ``raw`` read as ASCII: None when it does not match or is not ASCII.

    How a one-line file (a sha256 sidecar, an HMAC signature) is parsed.
    """
    try:
        return pattern.fullmatch(raw.decode("ascii"))
    except UnicodeDecodeError:
        return None


def read_sidecar(path: str | Path) -> str:
    """Read and validate ``path.sha256``; return the expected sha256 (hex).

    Refuses (:class:`~ripresa.errors.IntegrityError`) a missing marker,
    anything that is not a regular file (a symlink, folder or FIFO — opened
    without following links and without blocking, and checked on the open
    descriptor), more than :data:`SIDECAR_MAX` bytes (at most
    ``SIDECAR_MAX + 1`` are ever read), more than one line, bad hex, wrong
    length, and a file name other than ``path``'s own (no ``../`` or absolute
    paths: the sidecar can only vouch for its neighbour). A sidecar that
    cannot be read (permissions, I/O error) is :class:`~ripresa.errors.BadInput`.
    """
    p = Path(path)
    side = sidecar_path(p)
    try:
        fd, _ = _open_checked(side, follow_symlinks=False)
    except _Refused as refused:
        if refused.kind == "missing":
            raise IntegrityError(
                "missing commit marker (sha256 sidecar): the save did not complete",
                file=side,
                expected=f"a file '{side.name}' written after '{p.name}'",
                found="nothing",
                hint="this generation is uncommitted; use an earlier one",
            ) from None
        if refused.kind in ("symlink", "folder", "special"):
            raise IntegrityError(
                "sha256 sidecar is not a regular file",
                file=side,
                expected="a regular file",
                found=refused.found,
                hint="remove it; only ripresa's own sidecars are trusted",
            ) from None
        raise _open_error(side, "sha256 sidecar", refused) from refused.__cause__
    try:
        raw = bytearray()
        while len(raw) <= SIDECAR_MAX:
            try:
                got = os.read(fd, SIDECAR_MAX + 1 - len(raw))
            except OSError as exc:
                raise _read_error(side, "sha256 sidecar", exc, "one sha256sum line") from exc
            if not got:
                break
            raw += got
    finally:
        os.close(fd)
    if len(raw) > SIDECAR_MAX:
        raise IntegrityError(
            "malformed sha256 sidecar: too large",
            file=side,
            expected=f"one line '<64 lowercase hex>  <file name>' (at most {SIDECAR_MAX} bytes)",
            found=f"more than {SIDECAR_MAX} bytes, starting {bytes(raw[:60])!r}",
            hint="the commit marker is damaged; this generation cannot be trusted",
        )
    try:
        text: str | None = raw.decode("ascii")
    except UnicodeDecodeError:
        text = None
    parsed = parse_sha256sum_line(text) if text is not None else None
    if parsed is None:
        raise IntegrityError(
            "malformed sha256 sidecar",
            file=side,
            expected="one line '<64 lowercase hex>  <file name>'",
            found=repr(bytes(raw[:120])),
            hint="the commit marker is damaged; this generation cannot be trusted",
        )
    digest, name = parsed
    if name != p.name:
        raise IntegrityError(
            "sha256 sidecar names another file",
            file=side,
            expected=p.name,
            found=name,
            hint="a sidecar only vouches for the file beside it",
        )
    return digest


def require_regular_file(path: str | Path, what: str = "checkpoint") -> Path:
    """Return ``path`` if it is an existing, readable regular file, else a clear error.

    A check of the *path* for early, friendly errors; whoever then reads the
    file must open it with :func:`open_regular` (which re-checks the open
    descriptor), never trust this check alone.
    """
    p = Path(path)
    if not os.path.lexists(p):
        raise BadInput(
            f"{what} not found",
            file=p,
            expected="an existing file",
            found="nothing at this path",
            hint="check the path; `ripresa inspect RUN` lists the valid generations",
        )
    if p.is_dir():
        raise BadInput(
            f"{what} is a folder", file=p, expected="a regular file", found="a folder", hint=_FOLDER_HINT
        )
    if not p.is_file():
        try:
            found = _kind_of(os.stat(p).st_mode)
        except OSError:
            found = "a dangling symlink"
        raise BadInput(
            f"{what} is not a regular file",
            file=p,
            expected="a regular file",
            found=found,
            hint="ripresa never reads from special files",
        )
    if not os.access(p, os.R_OK):
        raise BadInput(f"{what} is not readable", file=p, expected="read permission", found="none")
    return p


def verify_against_sidecar(path: str | Path) -> Digest:
    """Check ``path`` against ``path.sha256``; return its digest or raise."""
    p = require_regular_file(path)
    expected = read_sidecar(p)
    digest = sha256_file(p, what="checkpoint")
    if digest.sha256 != expected:
        raise IntegrityError(
            "sha256 mismatch: the file changed after it was committed",
            file=p,
            expected=expected,
            found=digest.sha256,
            hint="the file is damaged (truncated, bit rot, or edited); use an earlier generation",
        )
    return digest
