"""The one small layer through which ripresa touches the disk.

Every durable write goes through :class:`StagedFile`: the bytes are streamed to
a temporary name *in the destination folder* (never ``$TMPDIR``: a rename is
atomic only inside one filesystem), hashed with sha256 in the same pass, then
``fsync``'d, renamed into place, and the folder is ``fsync``'d so the rename
itself survives a power cut. An ``fsync`` error fails the save: a page that
failed to reach the disk may be dropped by the kernel, so retrying and
trusting the second answer would be a lie.

All system calls go through :data:`ops`, an instance of :class:`FileOps`, so
that tests can inject faults (``OSError`` at the n-th ``write``/``fsync``/
``rename``) or record the operations of a save, without mocking any class of
the library.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInput, IntegrityError, SaveFailed

#: Read/write granularity for streaming (bytes). 8 MiB keeps syscalls few
#: without a large private buffer.
CHUNK = 8 * 1024 * 1024

_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp\.(?P<pid>\d+)\.[0-9a-f]{8}$")
_SHA_LINE_RE = re.compile(r"^(?P<hex>[0-9a-f]{64}) [ *](?P<name>[^/\x00\n]+)\n?$")


@dataclass(frozen=True)
class Digest:
    """sha256 (lowercase hex) and size in bytes of a file's content."""

    sha256: str
    size: int


class FileOps:
    """System calls used for durable writes. Subclass or wrap to inject faults.

    ``hook`` (if set) is called as ``hook(op, path)`` *before* each operation;
    raising from it simulates the operation failing (``OSError``), and a hook
    may also kill the process there to simulate a crash at that point.
    """

    def __init__(self) -> None:
        self.hook: Callable[[str, str], None] | None = None

    def _before(self, op: str, path: str | Path) -> None:
        if self.hook is not None:
            self.hook(op, str(path))

    def open_new(self, path: Path) -> int:
        self._before("open", path)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)

    def write(self, fd: int, data: memoryview, path: Path) -> int:
        self._before("write", path)
        return os.write(fd, data)

    def fsync(self, fd: int, path: Path) -> None:
        self._before("fsync", path)
        os.fsync(fd)

    def close(self, fd: int, path: Path) -> None:
        os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        self._before("rename", dst)
        os.replace(src, dst)

    def fsync_dir(self, folder: Path) -> None:
        self._before("fsync_dir", folder)
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: Path) -> None:
        self._before("unlink", path)
        os.unlink(path)


#: The process-wide file-operation layer. Tests replace ``ops.hook``.
ops = FileOps()


def _install_env_kill_hook() -> None:
    """``RIPRESA_CRASH_AT=op:N`` kills this process with SIGKILL right before
    the N-th call of ``op`` (``write``, ``fsync``, ``rename``, ``fsync_dir``,
    ``open``, ``unlink``, or ``any``). Used by the crash tests to stop a real
    process at an exact system-call boundary of the save protocol."""
    spec = os.environ.get("RIPRESA_CRASH_AT")
    if not spec:
        return
    op, _, n = spec.partition(":")
    target = int(n or "1")
    counts: dict[str, int] = {}

    def hook(name: str, path: str) -> None:
        key = "any" if op == "any" else name
        if key != op:
            return
        counts[key] = counts.get(key, 0) + 1
        if counts[key] == target:
            os.kill(os.getpid(), 9)

    ops.hook = hook


_install_env_kill_hook()


def temp_name_for(final: Path) -> Path:
    """The temporary sibling of ``final``: ``.NAME.tmp.PID.RANDOM``."""
    return final.with_name(f".{final.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    """True for names made by :func:`temp_name_for`."""
    return _TEMP_RE.match(name) is not None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        m = _TEMP_RE.match(entry.name)
        if not m:
            continue
        pid = int(m.group("pid"))
        if only_dead and (pid == os.getpid() or _pid_alive(pid)):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                continue
            entry.unlink()
            removed.append(entry)
        except FileNotFoundError:
            pass
    return removed


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
        self.size = 0
        self._fd: int | None = None
        self._published = False
        self.digest: Digest | None = None
        try:
            self._fd = ops.open_new(self.temp)
        except OSError as exc:
            raise _save_error("could not create a temporary file", self.temp, exc) from exc

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write all of ``data`` (looping over partial writes) and hash it."""
        if self._fd is None:
            raise SaveFailed("write after finish()", file=self.final)
        view = memoryview(data).cast("B")
        self._sha.update(view)
        total = len(view)
        done = 0
        try:
            while done < total:
                done += ops.write(self._fd, view[done:], self.temp)
        except OSError as exc:
            raise _save_error("write failed", self.temp, exc) from exc
        self.size += total
        return total

    def flush(self) -> None:  # file-like protocol (torch.save calls it)
        return None

    def finish(self) -> Digest:
        """``fsync`` and close the temporary file; return its digest."""
        if self._fd is None:
            assert self.digest is not None
            return self.digest
        fd, self._fd = self._fd, None
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
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if not self._published:
            try:
                os.unlink(self.temp)
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
        found=f"{type(exc).__name__}: [errno {exc.errno}] {os.strerror(exc.errno or 0)}",
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


def sidecar_path(path: str | Path) -> Path:
    """``X`` → ``X.sha256``."""
    p = Path(path)
    return p.with_name(p.name + ".sha256")


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


def read_sidecar(path: str | Path) -> str:
    """Read and validate ``path.sha256``; return the expected sha256 (hex).

    Refuses a missing marker, anything that is not a regular file, more than
    one line, bad hex, wrong length, and a file name other than ``path``'s
    own (no ``../`` or absolute paths: the sidecar can only vouch for its
    neighbour).
    """
    p = Path(path)
    side = sidecar_path(p)
    if not os.path.lexists(side):
        raise IntegrityError(
            "missing commit marker (sha256 sidecar): the save did not complete",
            file=side,
            expected=f"a file '{side.name}' written after '{p.name}'",
            found="nothing",
            hint="this generation is uncommitted; use an earlier one",
        )
    if side.is_symlink() or not side.is_file():
        raise IntegrityError(
            "sha256 sidecar is not a regular file",
            file=side,
            expected="a regular file",
            found="a symlink" if side.is_symlink() else "a folder or special file",
            hint="remove it; only ripresa's own sidecars are trusted",
        )
    raw = side.read_bytes()[:4096]
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        text = None
    m = _SHA_LINE_RE.match(text) if text is not None else None
    if m is None:
        raise IntegrityError(
            "malformed sha256 sidecar",
            file=side,
            expected="one line '<64 lowercase hex>  <file name>'",
            found=repr(raw[:120]),
            hint="the commit marker is damaged; this generation cannot be trusted",
        )
    if m.group("name") != p.name:
        raise IntegrityError(
            "sha256 sidecar names another file",
            file=side,
            expected=p.name,
            found=m.group("name"),
            hint="a sidecar only vouches for the file beside it",
        )
    return m.group("hex")


def require_regular_file(path: str | Path, what: str = "checkpoint") -> Path:
    """Return ``path`` if it is an existing regular file, else a clear error."""
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
        raise BadInput(f"{what} is a folder", file=p, expected="a regular file", found="a folder")
    if not p.is_file():
        raise BadInput(
            f"{what} is not a regular file",
            file=p,
            expected="a regular file",
            found="a FIFO, socket or device",
            hint="ripresa never reads from special files",
        )
    if not os.access(p, os.R_OK):
        raise BadInput(f"{what} is not readable", file=p, expected="read permission", found="none")
    return p


def sha256_file(path: str | Path, *, drop_cache: bool = False) -> Digest:
    """Stream a file through sha256 with one reused buffer; return its digest."""
    p = Path(path)
    h = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(p, "rb", buffering=0) as f:
        fd = f.fileno()
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
        if drop_cache and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
    return Digest(h.hexdigest(), size)


def verify_against_sidecar(path: str | Path) -> Digest:
    """Check ``path`` against ``path.sha256``; return its digest or raise."""
    p = require_regular_file(path)
    expected = read_sidecar(p)
    digest = sha256_file(p)
    if digest.sha256 != expected:
        raise IntegrityError(
            "sha256 mismatch: the file changed after it was committed",
            file=p,
            expected=expected,
            found=digest.sha256,
            hint="the file is damaged (truncated, bit rot, or edited); use an earlier generation",
        )
    return digest
