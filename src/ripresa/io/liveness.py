"""Processes as the kernel sees them: is a pid alive, does it hold the ``flock`` of a file.

The liveness side of the run lock (:mod:`ripresa.io.lock`, docs/FAULTS.md,
"Concurrent writers" and "Signalling the trainer"): :func:`pid_alive` is the
one pid liveness test of ripresa (temporary-file owners, ledger writers,
``LOCK``); :func:`holds_lock` asks ``/proc`` whether a live process holds the
exclusive ``flock`` of a given ``LOCK`` file, the check made before any signal
is sent to a trainer. Nothing here trusts a file's content: every answer comes
from the kernel (``kill(pid, 0)``, ``/proc/PID/fd``, ``fdinfo``,
``/proc/locks``), or is "cannot tell" (None).
"""

from __future__ import annotations

import errno
import functools
import os
import signal

__all__ = ["boot_id", "holds_lock", "pid_alive", "pid_max", "pidfd_open", "pidns", "proc_locks_holder"]

#: Linux's hard limit on pids (``PID_MAX_LIMIT`` on 64-bit); used where
#: ``/proc/sys/kernel/pid_max`` cannot be read.
_PID_MAX_LIMIT = 1 << 22
#: Most lines of ``/proc/locks`` read when looking for the holder.
_MAX_PROC_LOCKS_LINES = 1 << 20


@functools.lru_cache(maxsize=1)
def pid_max() -> int:
    """The largest pid this kernel hands out (``/proc/sys/kernel/pid_max``, else ``2**22``)."""
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as f:
            value = int(f.read(32).strip())
    except (OSError, ValueError):
        return _PID_MAX_LIMIT
    return value if 1 < value <= _PID_MAX_LIMIT else _PID_MAX_LIMIT


@functools.lru_cache(maxsize=1)
def boot_id() -> str | None:
    """This kernel's boot id (changes at every boot, differs between machines)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            text = f.read(128).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def pidns() -> int | None:
    """Inode of this process's pid namespace (``/proc/self/ns/pid``), or None without /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def pid_alive(pid: object) -> bool:
    """True if a process with this pid exists on this host (in this pid namespace).

    Never raises and never signals anything: ``pid`` that is not an ``int``,
    is ``<= 0`` (``kill(0, ...)``/``kill(-N, ...)`` address process groups) or
    is above the kernel's ``pid_max`` is reported dead without asking the
    kernel. A live process of another user counts as alive. The one pid
    liveness test of ripresa (temporary-file owners, ledger writers, LOCK).
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid > pid_max():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    except (OSError, OverflowError, ValueError):
        return False
    return True


def _fd_holds_flock(fdinfo: bytes) -> bool | None:
    """From ``/proc/PID/fdinfo/N``: True if it shows an exclusive FLOCK, False if other locks, None if no lock lines."""
    seen = None
    for line in fdinfo.splitlines():
        if not line.startswith(b"lock:"):
            continue
        fields = line.split()
        if b"->" in fields:  # a waiter, not a holder
            seen = seen or False
            continue
        if b"FLOCK" in fields and b"WRITE" in fields:
            return True
        seen = False
    return seen


def proc_locks_holder(pid: int, ino: int) -> bool | None:
    """From ``/proc/locks``: does ``pid`` hold an exclusive FLOCK on inode ``ino``? None if unreadable.

    ``/proc/locks`` is readable by every user; its lines read
    ``1: FLOCK  ADVISORY  WRITE 12345 fe:00:2146372 0 EOF`` (waiters have a
    ``->``). The inode is compared without the device: overlay filesystems
    report the upper layer's device there, and a pid holding an exclusive
    flock on another file with the same inode number is not a realistic
    confusion.
    """
    want_pid, want_ino = str(pid).encode(), str(ino).encode()
    try:
        with open("/proc/locks", "rb") as f:
            for n, line in enumerate(f):
                if n >= _MAX_PROC_LOCKS_LINES:
                    break
                fields = line.split()
                if len(fields) < 6 or fields[1] == b"->":
                    continue
                if (
                    fields[1] == b"FLOCK"
                    and fields[3] == b"WRITE"
                    and fields[4] == want_pid
                    and fields[5].rsplit(b":", 1)[-1] == want_ino
                ):
                    return True
    except OSError:
        return None
    return False


def holds_lock(pid: int, key: tuple[int, int]) -> tuple[bool | None, str]:
    """Does process ``pid`` hold the lock of the ``LOCK`` file identified by ``key``?

    True / False with what was found, or None when this system cannot tell
    (no ``/proc``). See :mod:`ripresa.io.lock`'s doc: ``/proc/PID/fd`` + ``fdinfo`` first,
    ``/proc/locks`` where those cannot be read.
    """
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        if not os.path.isdir("/proc/self/fd"):
            return None, "no /proc on this system"
        return False, f"pid {pid} has exited"
    except OSError:
        # Another user's process, hidepid, a process that made itself non-dumpable:
        # the world-readable lock table still names the holder.
        verdict = proc_locks_holder(pid, key[1])
        if verdict is None:
            return None, f"/proc/{pid}/fd and /proc/locks are not readable"
        return verdict, "" if verdict else f"pid {pid} holds no lock on this LOCK (/proc/locks)"
    matching = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            st = os.stat(f"{fd_dir}/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == key:
            matching.append(name)
    if not matching:
        return False, f"pid {pid} is a live process that does not have this run's LOCK open"
    no_lock_lines = True
    for name in matching:
        try:
            with open(f"/proc/{pid}/fdinfo/{name}", "rb") as f:
                verdict = _fd_holds_flock(f.read(1 << 16))
        except OSError:
            continue
        if verdict:
            return True, ""
        if verdict is False:
            no_lock_lines = False
    if no_lock_lines:
        # A kernel that does not list locks in fdinfo (before Linux 4.1): the lock table decides.
        verdict = proc_locks_holder(pid, key[1])
        if verdict:
            return True, ""
    return False, f"pid {pid} has this run's LOCK open but does not hold its lock"


def pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid`` (raises ProcessLookupError if none), or None where pidfds are missing."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None or not hasattr(signal, "pidfd_send_signal"):
        return None
    try:
        return opener(pid)
    except ProcessLookupError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.EMFILE, errno.ENFILE, errno.ENODEV):
            return None  # no pidfds here (old kernel, seccomp, no descriptors): check right before kill
        raise
