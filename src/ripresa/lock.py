"""One writer per run folder: an OS lock on ``RUN/LOCK``, held for a lifetime.

The training process takes :class:`RunLock` when it starts and holds it until
it exits (DESIGN §4). A second writer — another process, or another
:class:`RunLock` in the same process — is refused with
:class:`~ripresa.errors.LockHeld`, which names the holder's pid.

Why ``flock`` and not ``lockf``/``fcntl`` record locks: a record lock belongs
to the *process* and is dropped when the process closes *any* descriptor of
the file, so merely reading ``LOCK`` (as :func:`read_lock_holder` does) would
silently release it, and a second lock from the same process would succeed.
An ``flock`` lock belongs to the open file description: a second ``open`` in
the same process conflicts with the first, and closing a reader's descriptor
leaves the holder's lock alone. The kernel drops it when the holder dies, even
by ``SIGKILL``, so a ``LOCK`` file left behind by a dead process never blocks
the next writer: liveness is always tested with the lock itself, never by
trusting the file's content. A registry of the locks this process holds makes
the same-process refusal independent of the filesystem (on NFS, Linux emulates
``flock`` with record locks; the lock is still honoured between hosts there,
but it is advisory only and needs a working lock daemon).

``LOCK`` is never deleted (deleting a lock file lets two writers lock two
different files of the same name). Its content, written by the holder *after*
the lock is obtained and emptied by :meth:`RunLock.release` before it lets go,
is the holder's pid on the first line — readable by ``head -n1 RUN/LOCK`` —
followed by one JSON line with the pid, host name, start time (unix seconds)
and command line::

    12345
    {"pid": 12345, "hostname": "gpu-07", "started": 1767225600.5, "argv": ["train.py"]}

A child made by ``fork`` (a data-loader worker, say) closes its inherited copy
of the descriptor at once, so that a child outliving a killed trainer does not
keep the run locked; a process that daemonizes must therefore take the lock
*after* forking. An ``exec``'d child never inherits it (close-on-exec).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInput, LockHeld

__all__ = ["LOCK_NAME", "LockInfo", "RunLock", "read_lock_holder"]

#: Name of the lock file inside a run folder.
LOCK_NAME = "LOCK"

#: A refused ``acquire`` keeps trying this long (seconds) even with
#: ``timeout=0``: :func:`read_lock_holder` probes with a shared lock held for
#: microseconds, and a writer starting at that instant must not be refused.
_PROBE_GRACE_S = 0.25
#: Interval between tries while waiting (seconds).
_POLL_S = 0.01
#: How long a refused ``acquire`` waits for the holder's pid to appear in
#: ``LOCK`` (the holder writes it right after locking), for its message.
_HOLDER_WAIT_S = 0.5
#: Largest ``LOCK`` content read (bytes); the real content is a few hundred.
_MAX_CONTENT = 1 << 20

# Locks held by this process, by (st_dev, st_ino) of the LOCK file. ``_guard``
# serializes the check-lock-register sequence between threads.
_guard = threading.Lock()
_held: dict[tuple[int, int], RunLock] = {}


def _after_fork_in_child() -> None:
    # Close (never unlock: the lock is shared with the parent) every inherited
    # descriptor, so that only the process that took the lock holds it.
    global _guard
    _guard = threading.Lock()  # the parent's may have been held by another thread
    for lock in _held.values():
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None
            lock._info = None
    _held.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class LockInfo:
    """Who holds a run folder's lock, as the holder wrote it in ``LOCK``.

    ``pid`` is always present; ``hostname`` (where that pid lives), ``started``
    (unix seconds) and ``argv`` are ``None`` if the holder did not write them.
    """

    pid: int
    path: Path
    hostname: str | None = None
    started: float | None = None
    argv: tuple[str, ...] | None = None

    @property
    def is_local(self) -> bool:
        """True if the holder runs on this host, so that its pid can be signalled."""
        return self.hostname is None or self.hostname == socket.gethostname()

    def describe(self) -> str:
        """One line for messages: pid, host, start time and command."""
        text = f"pid {self.pid}"
        if not self.is_local:
            text += f" on host {self.hostname}"
        if self.started is not None:
            text += time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(self.started))
        if self.argv:
            command = " ".join(self.argv)
            text += f" ({command[:200]}{'...' if len(command) > 200 else ''})"
        return text


def _content_for(pid: int) -> bytes:
    extra = {
        "pid": pid,
        "hostname": socket.gethostname(),
        "started": time.time(),
        "argv": list(sys.argv),
    }
    return f"{pid}\n{json.dumps(extra)}\n".encode()


def _parse(raw: bytes, path: Path, *, complete: bool) -> LockInfo | None:
    """``LOCK`` content as a :class:`LockInfo`, or ``None`` if it does not parse.

    With ``complete=True`` the JSON line must parse too (a holder may be in the
    middle of writing); otherwise a complete first line is enough.
    """
    first, newline, rest = raw.partition(b"\n")
    first = first.strip()
    if not newline or not first.isdigit() or not first.isascii():
        return None
    pid = int(first)
    try:
        extra = json.loads(rest.decode()) if rest.strip() else None
    except (UnicodeDecodeError, ValueError):
        extra = None
    if not isinstance(extra, dict):
        return None if complete else LockInfo(pid, path)
    hostname = extra.get("hostname")
    started = extra.get("started")
    argv = extra.get("argv")
    return LockInfo(
        pid,
        path,
        hostname=hostname if isinstance(hostname, str) else None,
        started=float(started) if isinstance(started, int | float) else None,
        argv=tuple(argv)
        if isinstance(argv, list) and all(isinstance(a, str) for a in argv)
        else None,
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    except OSError:
        return False
    return True


def _read_fd(fd: int) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while offset < _MAX_CONTENT:
        chunk = os.pread(fd, 65536, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _require_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise BadInput(
            "run folder does not exist" if not folder.exists() else "not a folder",
            file=folder,
            expected="an existing run folder",
            found="nothing there" if not folder.exists() else "a file",
            hint="check the path; a run folder is created by the trainer's first start",
        )


def _open_error(path: Path, exc: OSError, mode: str) -> BadInput:
    return BadInput(
        f"cannot open the run folder's lock file for {mode}: {exc.strerror or exc}",
        file=path,
        expected="a regular file that this user may open",
        found=f"errno {errno.errorcode.get(exc.errno or 0, exc.errno)}",
        hint="check the permissions of the run folder and of its LOCK file",
    )


def _lock_error(path: Path, exc: OSError) -> BadInput:
    return BadInput(
        f"the operating system refused to lock the run folder: {exc.strerror or exc}",
        file=path,
        expected="a filesystem that supports flock",
        found=f"errno {errno.errorcode.get(exc.errno or 0, exc.errno)}",
        hint="put the run folder on a local filesystem (or an NFS mount with locking enabled)",
    )


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def _try_flock(fd: int, path: Path, how: int) -> bool:
    """Non-blocking ``flock``; False if another open file description holds it."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise _lock_error(path, exc) from exc
    return True


class RunLock:
    """The single-writer lock of a run folder (``RUN/LOCK``).

    ``RunLock(folder).acquire()`` takes it without blocking (or waits up to
    ``timeout`` seconds) and writes this process's pid into it; a second
    writer gets :class:`~ripresa.errors.LockHeld`. Use it as a context manager,
    or call :meth:`release`; a process that dies releases it too.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._info: LockInfo | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    @property
    def info(self) -> LockInfo | None:
        """What this holder wrote into ``LOCK``; ``None`` when not held."""
        return self._info

    def acquire(self, *, timeout: float = 0.0) -> RunLock:
        """Take the lock, waiting at most ``timeout`` seconds; returns ``self``.

        Raises :class:`~ripresa.errors.LockHeld` (naming the holder's pid) if
        another process or another :class:`RunLock` of this process holds it,
        and :class:`~ripresa.errors.BadInput` if the folder is missing or the
        lock file cannot be opened.
        """
        if self._fd is not None:
            raise LockHeld(
                "this RunLock already holds the run folder's lock",
                file=self.path,
                expected="acquire() once, release() before acquiring again",
                found=f"held by this process (pid {os.getpid()})",
            )
        _require_folder(self.folder)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            raise _open_error(self.path, exc, "writing") from exc
        try:
            key = _key(fd)
            start = time.monotonic()
            while True:
                with _guard:
                    same_process = key in _held
                    if not same_process and _try_flock(fd, self.path, fcntl.LOCK_EX):
                        self._fd, self._key = fd, key
                        _held[key] = self
                        break
                # Our own holder is no prober: no grace beyond ``timeout`` for it.
                waited = time.monotonic() - start
                if waited >= (timeout if same_process else max(timeout, _PROBE_GRACE_S)):
                    raise self._refusal(same_process=same_process)
                time.sleep(_POLL_S)
        except BaseException:
            if self._fd is None:
                os.close(fd)  # closing a descriptor we never locked leaves the holder's lock alone
            raise

        # Locked: only now may the content change.
        pid = os.getpid()
        content = _content_for(pid)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(content)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], written)
            os.fsync(fd)
        except OSError as exc:
            self.release()
            raise BadInput(
                f"locked the run folder but could not write this process's pid: {exc.strerror or exc}",
                file=self.path,
                expected="a writable run folder with free space",
                found=f"errno {errno.errorcode.get(exc.errno or 0, exc.errno)}",
                hint="free some space or fix the folder's permissions, then start again",
            ) from exc
        parsed = _parse(content, self.path, complete=True)
        assert parsed is not None  # we just wrote it
        self._info = parsed
        return self

    def _refusal(self, *, same_process: bool) -> LockHeld:
        holder = None if same_process else _read_holder_content(self.path, wait=_HOLDER_WAIT_S)
        if same_process:
            found = f"held by this process (pid {os.getpid()}) through another RunLock"
            message = (
                f"run folder {self.folder} is already locked by this process (pid {os.getpid()})"
            )
        elif holder is not None:
            found = f"held by {holder.describe()}"
            message = f"run folder {self.folder} is locked by another writer (pid {holder.pid})"
        else:
            found = "held by a process that has not written its pid into LOCK"
            message = f"run folder {self.folder} is locked by another writer (pid unknown)"
        return LockHeld(
            message,
            file=self.path,
            expected="no other process writing to this run folder",
            found=found,
            hint=(
                f"stop that run first (`ripresa signal {self.folder} stop`) or wait for it to "
                "exit; a LOCK file left by a killed process does not block a new writer"
            ),
        )

    def release(self) -> None:
        """Empty ``LOCK`` and let go of the lock. Does nothing if not held."""
        fd = self._fd
        if fd is None:
            return
        with _guard:
            try:
                os.ftruncate(fd, 0)  # no stale pid for `head -n1 LOCK` once we are gone
            except OSError:
                pass
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
                self._fd = None
                self._info = None
                if self._key is not None and _held.get(self._key) is self:
                    del _held[self._key]

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = f"held, pid {os.getpid()}" if self.held else "not held"
        return f"RunLock({str(self.folder)!r}, {state})"


def _read_holder_content(path: Path, *, wait: float) -> LockInfo | None:
    """The holder's info from ``LOCK``, waiting up to ``wait`` s for it to be written."""
    deadline = time.monotonic() + wait
    raw = b""
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            raw = _read_fd(fd)
        finally:
            os.close(fd)
        info = _parse(raw, path, complete=True)
        if info is not None and (not info.is_local or _pid_alive(info.pid)):
            return info
        if time.monotonic() >= deadline:
            return _parse(raw, path, complete=False)
        time.sleep(_POLL_S)


def read_lock_holder(folder: str | os.PathLike[str], *, wait: float = 1.0) -> LockInfo | None:
    """Who holds the run folder's writer lock, or ``None`` if nobody does.

    Whether the lock is held is tested with a non-blocking probe of the lock
    itself, so a ``LOCK`` file left by a killed process reads as not held. The
    holder writes its pid right after locking; a reader arriving in between
    waits up to ``wait`` seconds for it. Raises :class:`~ripresa.errors.BadInput`
    if the folder is missing, or if the lock is held but ``LOCK`` holds no pid
    (a holder that is not ripresa).
    """
    folder = Path(folder)
    _require_folder(folder)
    path = folder / LOCK_NAME
    deadline = time.monotonic() + wait
    tries = 0
    while True:
        tries += 1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _open_error(path, exc, "reading") from exc
        try:
            with _guard:
                mine = _held.get(_key(fd))
                if mine is not None:  # held by this process: no probe needed
                    return mine._info or LockInfo(os.getpid(), path)
                # A shared lock on our own descriptor: granted only if nobody
                # holds the exclusive one. Closing it never affects the holder.
                if _try_flock(fd, path, fcntl.LOCK_SH):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    return None
            raw = _read_fd(fd)
        finally:
            os.close(fd)
        info = _parse(raw, path, complete=True)
        if info is not None and (not info.is_local or _pid_alive(info.pid)):
            return info
        # At least two looks, even with wait=0: an empty LOCK may be a holder
        # between locking and writing, or between emptying and unlocking.
        if tries >= 2 and time.monotonic() >= deadline:
            info = _parse(raw, path, complete=False)
            if info is not None:
                return info
            raise BadInput(
                "the run folder is locked, but LOCK does not name the holder",
                file=path,
                expected="the holder's pid on the first line of LOCK",
                found=repr(raw[:80]) if raw else "an empty file",
                hint="another program holds the lock; find it with `fuser` or `lsof` on LOCK",
            )
        time.sleep(_POLL_S)
