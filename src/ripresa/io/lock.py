"""One writer per run folder: an ``flock`` on ``RUN/LOCK``, held for the process's lifetime.

:class:`RunLock` refuses a second writer (another process, or another ``RunLock`` in this process)
with :class:`~ripresa.errors.LockHeld` naming the holder; the kernel drops the lock when the holder
dies, even by ``SIGKILL``, so liveness is tested with the lock itself, never by trusting the file.
:func:`signal_holder` is the only way ripresa signals a trainer: ``LOCK``'s pid is a claim, checked
against the kernel's lock table before any signal. The file's content, why ``flock`` and not record
locks, and the fork rule: docs/FORMAT.md, "Writer lock ``LOCK``"; the refusals of ``ripresa
signal``: docs/FAULTS.md, "Signalling the trainer".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, LockHeld
from .liveness import boot_id as _boot_id
from .liveness import holds_lock as _holds_lock
from .liveness import pid_alive
from .liveness import pid_max as _pid_max
from .liveness import pidfd_open as _pidfd_open
from .liveness import pidns as _pidns

__all__ = [
    "LOCK_NAME",
    "LockInfo",
    "NotRunning",
    "RunLock",
    "is_locked",
    "pid_alive",
    "read_lock_holder",
    "signal_holder",
]

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
#: A pid on LOCK's first line has at most this many digits before it is even
#: converted (a megabyte of digits must not reach ``int()``).
_PID_RE = re.compile(rb"-?[0-9]{1,20}")

#: The hint of every refusal to signal: it fits a ``ripresa train`` run as well
#: as a program that uses :class:`ripresa.Checkpointer` (both hold RUN/LOCK).
_SIGNAL_HINT = (
    "`ripresa signal` and `ripresa pivot` signal only the process that holds RUN/LOCK on this host "
    "and in this pid namespace: a `ripresa train`, or your own program using ripresa.Checkpointer. "
    "If it runs on another host or in a container, send the signal there (`kill -USR1 PID` saves a "
    "checkpoint, `kill -TERM PID` saves and stops); if LOCK was edited or copied from elsewhere, "
    "restart the trainer and LOCK is rewritten (see docs/FAULTS.md, \"Signalling the trainer\")"
)

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
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None
            lock._info = None
    _held.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class NotRunning(BadInput):
    """Nobody holds the run folder's lock: no trainer is running (exit 2)."""


@dataclass(frozen=True)
class LockInfo:
    """Who holds a run folder's lock, as the holder wrote it in ``LOCK``.

    ``pid`` is always present; ``hostname`` (where that pid lives), ``started``
    (unix seconds), ``argv``, ``boot_id`` (the kernel's boot id) and ``pidns``
    (the inode of the holder's pid namespace) are ``None`` if the holder did
    not write them (older ``LOCK`` files) or wrote something unusable. This is
    what the *file* says: :func:`signal_holder` checks it against the kernel.
    """

    pid: int
    path: Path
    hostname: str | None = None
    started: float | None = None
    argv: tuple[str, ...] | None = None
    boot_id: str | None = None
    pidns: int | None = None

    @property
    def is_local(self) -> bool:
        """True unless LOCK says the holder runs on another host, boot or pid namespace.

        Only then can its pid name a process here. A field the holder did not
        write is not held against it.
        """
        if self.hostname is not None and self.hostname != socket.gethostname():
            return False
        mine = _boot_id()
        if self.boot_id is not None and mine is not None and self.boot_id != mine:
            return False
        ns = _pidns()
        return self.pidns is None or ns is None or self.pidns == ns

    def describe(self) -> str:
        """One line for messages: pid, host, start time and command."""
        text = f"pid {self.pid}"
        if self.hostname is not None and self.hostname != socket.gethostname():
            text += f" on host {self.hostname[:100]}"
        elif not self.is_local:
            text += " in another boot or pid namespace"
        if self.started is not None:
            text += time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(self.started))
        if self.argv:
            command = " ".join(self.argv)
            text += f" ({command[:200]}{'...' if len(command) > 200 else ''})"
        return text


_pid_alive = pid_alive  # the former private name, for callers not yet switched


def _content_for(pid: int) -> bytes:
    extra = {
        "pid": pid,
        "hostname": socket.gethostname(),
        "started": time.time(),
        "argv": list(sys.argv),
        "boot_id": _boot_id(),
        "pidns": _pidns(),
    }
    return f"{pid}\n{json.dumps(extra)}\n".encode()


@dataclass(frozen=True)
class _Content:
    """``LOCK`` content, examined: what it claims and what is wrong with it."""

    info: LockInfo | None  # None: the first line names no pid (``problem`` says why)
    complete: bool  # the JSON line parsed
    problem: str | None = None


def _examine(raw: bytes, path: Path) -> _Content:
    """Parse ``LOCK`` content without trusting it: bounded, never raises.

    The first line must be a (possibly negative) number of at most 20 digits;
    range checks are the caller's. The JSON line's fields are kept only if
    they have the right type and a sane value; a ``pid`` there that differs
    from the first line makes the whole content unusable.
    """
    first, newline, rest = raw.partition(b"\n")
    first = first.strip()
    if not newline:
        return _Content(None, False, "no complete first line" if raw else "an empty file")
    if not _PID_RE.fullmatch(first):
        if first.isdigit():
            return _Content(None, False, f"a number of {len(first)} digits, beyond the largest pid of any system")
        return _Content(None, False, f"{first[:40]!r} on the first line, not a pid")
    pid = int(first)
    extra = None
    if rest.strip():
        try:
            extra = json.loads(rest.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            extra = None
    if not isinstance(extra, dict):
        return _Content(LockInfo(pid, path), False)
    claimed = extra.get("pid")
    if claimed is not None and claimed != pid:
        return _Content(None, True, f"pid {pid} on the first line but {str(claimed)[:40]!r} in the JSON line")
    hostname = extra.get("hostname")
    started = extra.get("started")
    argv = extra.get("argv")
    boot_id = extra.get("boot_id")
    pidns = extra.get("pidns")
    good_started = (
        isinstance(started, int | float)
        and not isinstance(started, bool)
        and 0 <= started < 1e11  # compared first: math.isfinite(10**400) would overflow
        and math.isfinite(started)
    )
    good_pidns = isinstance(pidns, int) and not isinstance(pidns, bool) and 0 < pidns < 1 << 64
    return _Content(
        LockInfo(
            pid,
            path,
            hostname=hostname if isinstance(hostname, str) else None,
            started=float(started) if good_started else None,
            argv=tuple(argv)
            if isinstance(argv, list) and all(isinstance(a, str) for a in argv)
            else None,
            boot_id=boot_id if isinstance(boot_id, str) and 0 < len(boot_id) <= 64 else None,
            pidns=pidns if good_pidns else None,
        ),
        True,
    )


def _parse(raw: bytes, path: Path, *, complete: bool) -> LockInfo | None:
    """``LOCK`` content as a :class:`LockInfo`, or ``None`` if it does not parse.

    With ``complete=True`` the JSON line must parse too (a holder may be in the
    middle of writing); otherwise a complete first line is enough. A pid
    outside ``1..pid_max`` names no process: ``None``.
    """
    content = _examine(raw, path)
    info = content.info
    if info is None or not 0 < info.pid <= _pid_max():
        return None
    if complete and not content.complete:
        return None
    return info


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


def _open_lock(path: Path, *, write: bool) -> int:
    """Open ``LOCK`` without following a symlink or blocking on a FIFO; must be a regular file.

    Raises ``FileNotFoundError`` for a missing file (when not creating it);
    every other refusal is a :class:`~ripresa.errors.BadInput`.
    """
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    flags |= (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
    mode = "writing" if write else "reading"
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if write:
            raise BadInput(
                "cannot create the run folder's lock file",
                file=path,
                expected="a run folder this user may write",
                found="the folder vanished",
                hint="check the path",
            ) from None
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(
                "the run folder's lock file is a symlink",
                file=path,
                expected="a regular file LOCK inside the run folder",
                found="a symlink",
                hint="ripresa never follows links inside a run folder; remove the link "
                "(the next trainer creates LOCK again)",
            ) from None
        raise _open_error(path, exc, mode) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a special file"
            raise BadInput(
                "the run folder's lock file is not a regular file",
                file=path,
                expected="a regular file LOCK inside the run folder",
                found=kind,
                hint="remove it (the next trainer creates LOCK again)",
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        fd = _open_lock(self.path, write=True)
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
            fd = _open_lock(path, write=False)
        except (OSError, BadInput):
            return None
        try:
            raw = _read_fd(fd)
        finally:
            os.close(fd)
        info = _parse(raw, path, complete=True)
        if info is not None and (not info.is_local or pid_alive(info.pid)):
            return info
        if time.monotonic() >= deadline:
            return _parse(raw, path, complete=False)
        time.sleep(_POLL_S)


@dataclass(frozen=True)
class _Look:
    """One look at a run folder's lock: free, held by this process (``mine``), or held and ``raw`` read."""

    free: bool
    mine: LockInfo | None = None
    key: tuple[int, int] | None = None
    raw: bytes = b""


def _look(path: Path) -> _Look:
    """Probe the lock of ``path`` (a shared ``flock`` on our own descriptor) and read ``LOCK`` if it is held.

    The probe is granted only if nobody holds the exclusive lock, and closing
    our descriptor never affects the holder. A missing ``LOCK`` is free.
    """
    try:
        fd = _open_lock(path, write=False)
    except FileNotFoundError:
        return _Look(free=True)
    try:
        key = _key(fd)
        with _guard:
            mine = _held.get(key)
            if mine is not None:  # held by this process: no probe needed
                return _Look(free=False, mine=mine._info or LockInfo(os.getpid(), path), key=key)
            if _try_flock(fd, path, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return _Look(free=True, key=key)
        return _Look(free=False, key=key, raw=_read_fd(fd))
    finally:
        os.close(fd)


def _wait_for_holder(path: Path, wait: float, written: Callable[[bytes], bool]) -> _Look:
    """Look at the lock until it is free, held by this process, or ``LOCK`` is ``written`` (up to ``wait`` s).

    The holder writes ``LOCK`` right after locking and empties it before
    unlocking, so an empty or half-written file gets a moment; at least two
    looks are taken, even with ``wait=0``. Returns the last look.
    """
    deadline = time.monotonic() + wait
    tries = 0
    while True:
        tries += 1
        look = _look(path)
        if look.free or look.mine is not None or written(look.raw) or (tries >= 2 and time.monotonic() >= deadline):
            return look
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

    def named(raw: bytes) -> bool:
        info = _parse(raw, path, complete=True)
        return info is not None and (not info.is_local or pid_alive(info.pid))

    look = _wait_for_holder(path, wait, named)
    if look.free or look.mine is not None:
        return look.mine
    info = _parse(look.raw, path, complete=True)
    if info is not None and (not info.is_local or pid_alive(info.pid)):
        return info
    info = _parse(look.raw, path, complete=False)
    if info is not None:
        return info
    raise BadInput(
        "the run folder is locked, but LOCK does not name the holder",
        file=path,
        expected="the holder's pid on the first line of LOCK",
        found=repr(look.raw[:80]) if look.raw else "an empty file",
        hint="another program holds the lock; find it with `fuser` or `lsof` on LOCK",
    )


def is_locked(folder: str | os.PathLike[str]) -> bool:
    """True while some process (this one included) holds the run folder's lock.

    Asks the lock itself (a non-blocking shared ``flock`` probe), never
    ``LOCK``'s content, so it cannot be fooled by what the file says.
    """
    folder = Path(folder)
    _require_folder(folder)
    path = folder / LOCK_NAME
    try:
        fd = _open_lock(path, write=False)
    except FileNotFoundError:
        return False
    try:
        with _guard:
            if _key(fd) in _held:
                return True
            if _try_flock(fd, path, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return False
            return True
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- signalling the holder
def _not_running(folder: Path, path: Path) -> NotRunning:
    return NotRunning(
        f"no process is training this run: no trainer is running in {folder}",
        file=path,
        expected="a live trainer holding the run folder's lock",
        found="the lock is free (a LOCK file left by a stopped or killed trainer holds nobody)",
        hint="start it with `ripresa train --run RUN`, or run your program that uses ripresa.Checkpointer",
    )


def _refuse(message: str, info: LockInfo | None, path: Path, found: str, expected: str) -> BadInput:
    if info is not None:
        found = f"{found}; LOCK says: {info.describe()}"
    return BadInput(message, file=path, expected=expected, found=found, hint=_SIGNAL_HINT)


def signal_holder(
    folder: str | os.PathLike[str], sig: int | signal.Signals, *, wait: float = 1.0, pid: int | None = None
) -> LockInfo:
    """Send ``sig`` to the process holding the run folder's lock; return what LOCK says of it.

    The one way ripresa signals a trainer (``ripresa signal``, ``ripresa
    pivot``). ``LOCK``'s content is checked against the kernel first (see the
    module doc and docs/FAULTS.md, "Signalling the trainer"); any doubt is a
    refusal, never a signal to some other process. Raises :class:`NotRunning`
    if nobody holds the lock, and :class:`~ripresa.errors.BadInput` (exit 2)
    for a pid ``<= 0``, out of range or not a number, a holder on another host,
    boot or pid namespace, a dead pid, and a live process that does not hold
    this ``LOCK``. If this process holds the lock itself, it signals itself.
    With ``pid``, only that process is signalled (a second signal to the
    trainer that got the first); another holder is refused.
    """
    folder = Path(folder)
    _require_folder(folder)
    sig = signal.Signals(sig)
    path = folder / LOCK_NAME
    look = _wait_for_holder(path, wait, lambda raw: _examine(raw, path).complete or (raw.strip() != b"" and raw.endswith(b"\n")))
    if look.free:
        raise _not_running(folder, path)
    key = look.key
    assert key is not None
    if look.mine is not None:
        if pid is not None and pid != os.getpid():
            raise _refuse(f"the run's lock is now held by this process, not by pid {pid}",
                          look.mine, path, f"pid {os.getpid()}", f"pid {pid}")
        os.kill(os.getpid(), sig)
        return look.mine
    content = _examine(look.raw, path)
    info = content.info
    if info is None:
        raise _refuse(
            "LOCK does not name a process that could be signalled",
            None,
            path,
            content.problem or "no pid",
            "the holder's pid (1..pid_max) on the first line of LOCK",
        )
    if pid is not None and info.pid != pid:
        raise _refuse(
            f"the run's lock is now held by another process than pid {pid}",
            info,
            path,
            f"pid {info.pid}",
            f"pid {pid}, the trainer signalled before",
        )
    pid = info.pid
    if pid <= 0:
        raise _refuse(
            f"LOCK names pid {pid}, which is no process: signalling it would hit a whole process group",
            info,
            path,
            f"pid {pid}",
            "a positive pid",
        )
    if pid > _pid_max():
        raise _refuse(
            f"LOCK names pid {pid}, beyond the largest pid of this system ({_pid_max()})",
            info,
            path,
            f"pid {pid}",
            f"a pid between 1 and {_pid_max()}",
        )
    host = socket.gethostname()
    if info.hostname is not None and info.hostname != host:
        raise _refuse(
            f"the trainer of this run runs on host {info.hostname[:100]!r}, not on this one ({host})",
            info,
            path,
            f"host {info.hostname[:100]!r}",
            f"a holder on this host ({host})",
        )
    boot = _boot_id()
    if info.boot_id is not None and boot is not None and info.boot_id != boot:
        raise _refuse(
            "the trainer of this run was started on another machine or before this machine rebooted",
            info,
            path,
            f"boot id {info.boot_id[:64]!r}",
            f"this kernel's boot id {boot}",
        )
    ns = _pidns()
    if info.pidns is not None and ns is not None and info.pidns != ns:
        raise _refuse(
            "the trainer of this run runs in another pid namespace (a container?): "
            f"pid {pid} there is not pid {pid} here",
            info,
            path,
            f"pid namespace {info.pidns}",
            f"this process's pid namespace ({ns})",
        )
    if pid == os.getpid():
        raise _refuse(
            f"LOCK names this very process (pid {pid}), which does not hold the lock",
            info,
            path,
            f"pid {pid} (the caller)",
            "the pid of the trainer holding the lock",
        )
    expected = f"the live process that holds the lock of {path}"
    try:
        pidfd = _pidfd_open(pid)
    except ProcessLookupError:
        pidfd = None
        alive = False
    else:
        alive = pidfd is not None or pid_alive(pid)
    if not alive:
        raise _refuse(f"LOCK names pid {pid}, and no process has that pid", info, path, f"pid {pid}: no such process", expected)
    try:
        # With a pidfd, the process is pinned *before* the check: if it dies and its
        # pid is reused after the check, the kernel refuses the signal below.
        holds, found = _holds_lock(pid, key)
        if holds is None:
            raise _refuse(
                f"cannot verify that pid {pid} is the trainer of this run ({found})",
                info,
                path,
                found,
                expected,
            )
        if not holds:
            raise _refuse(f"pid {pid} is not the trainer of this run", info, path, found, expected)
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            raise _refuse(
                f"the trainer (pid {pid}) exited before the signal was sent", info, path, "no such process", expected
            ) from None
        except PermissionError:
            raise BadInput(
                f"not permitted to signal the trainer of this run (pid {pid})",
                file=path,
                expected="a trainer started by this user",
                found=f"{info.describe()}, owned by another user",
                hint="run `ripresa signal` as the user who started the trainer",
            ) from None
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return info
