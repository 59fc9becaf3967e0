"""A folder (another disk, an NFS mount) as a mirror's second store (docs/MIRROR.md): :class:`LocalStore`."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from .fsio import CHUNK, open_run_file, temp_name_for
from .objstore_base import (
    MAX_KEYS,
    MAX_LISTED,
    MULTIPART_THRESHOLD,
    GetBytes,
    HashedFile,
    RemoteNotFound,
    RemoteUnavailable,
    Writer,
    check_key,
    key_ok,
)
from .pieces import PieceBudget


class LocalStore(GetBytes):
    """A folder (another disk, an NFS mount) as a second store, written with the local commit protocol.

    Every operation goes through descriptors: the root folder is opened once per
    operation (as named: a link to it is the user's choice), and every name below
    it — a ``step_N.dcp`` folder, an object, a temporary — is opened, created,
    renamed or removed relative to that descriptor without following a symlink
    (``O_NOFOLLOW``, ``openat``-style ``dir_fd``), so a planted link
    (``step_N.dcp -> elsewhere``) is refused, never written, read or deleted
    through. :meth:`acquire` takes the folder's writer lock (``flock``, the run
    folder's :class:`~ripresa.io.lock.RunLock`), held until :meth:`release`.
    """

    multipart_threshold = MULTIPART_THRESHOLD

    def __init__(self, root: Path, url: str) -> None:
        self.root = Path(root)
        self.url = url
        self._lock: Any = None

    # -------------------------------------------------------------- descriptors
    def _root_fd(self, *, create: bool) -> int | None:
        """The root folder, open (``None`` when it does not exist and ``create`` is false)."""
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RemoteUnavailable(f"cannot create the mirror folder: {_describe(exc)}", file=self.root) from None
        try:
            return os.open(self.root, os.O_RDONLY | _DIR | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            if create:
                raise RemoteUnavailable("the mirror folder vanished", file=self.root) from None
            return None
        except OSError as exc:
            raise RemoteUnavailable(f"cannot open the mirror folder: {_describe(exc)}", file=self.root) from None

    def _sub_fd(self, root_fd: int, sub: str, *, create: bool) -> int | None:
        """``sub`` (a ``step_N.dcp`` folder) under the root, never through a symlink; None when absent."""
        if create:
            try:
                os.mkdir(sub, 0o755, dir_fd=root_fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise RemoteUnavailable(f"cannot create a mirror folder: {_describe(exc)}", file=self.root / sub) from None
        try:
            return os.open(sub, os.O_RDONLY | _DIR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=root_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _planted(self.root / sub) from None
            raise RemoteUnavailable(f"cannot open a mirror folder: {_describe(exc)}", file=self.root / sub) from None

    def _at(self, key: str, *, create: bool) -> tuple[int | None, int | None, str]:
        """(root fd, fd of the folder holding ``key``, ``key``'s last name); fds None when absent. Caller closes."""
        check_key(key)
        rfd = self._root_fd(create=create)
        if rfd is None or "/" not in key:
            return rfd, rfd, key
        sub, name = key.split("/", 1)
        try:
            dfd = self._sub_fd(rfd, sub, create=create)
        except BaseException:
            os.close(rfd)
            raise
        return rfd, dfd, name

    @staticmethod
    def _close(rfd: int | None, dfd: int | None) -> None:
        for fd in {rfd, dfd} - {None}:
            os.close(fd)  # type: ignore[arg-type]

    def _write(self, key: str, pieces: Iterator[bytes | memoryview], check: Any = None) -> int:
        """Stream ``pieces`` into a temporary beside ``key`` (created with O_EXCL|O_NOFOLLOW), fsync, check, rename."""
        rfd, dfd, name = self._at(key, create=True)
        assert dfd is not None
        temp = temp_name_for(Path(name)).name
        fd: int | None = None
        size = 0
        try:
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                             0o644, dir_fd=dfd)
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    done = 0
                    while done < len(view):
                        done += os.write(fd, view[done:])
                    size += len(view)
                if check is not None:
                    check()
                os.fsync(fd)
                os.close(fd)
                fd = None
                os.replace(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # a planted link at ``name`` is replaced, not followed
                os.fsync(dfd)
                if dfd != rfd:
                    os.fsync(rfd)
            except OSError as exc:
                raise RemoteUnavailable(f"writing to the mirror folder failed: {_describe(exc)}",
                                        file=self.root / key) from None
        except BaseException:
            if fd is not None:
                os.close(fd)
            try:
                os.unlink(temp, dir_fd=dfd)
            except OSError:
                pass
            raise
        finally:
            self._close(rfd, dfd)
        return size

    # -------------------------------------------------------------- the store
    def put_file(self, key: str, path: Path, *, sha256: str) -> int:
        src = HashedFile(path)
        return self._write(key, iter(src), check=lambda: src.check(sha256))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(key, iter([data]))

    def get_into(self, key: str, out: Writer, *, limit: int) -> int:
        p = self.root / key
        rfd, dfd, name = self._at(key, create=False)
        try:
            if dfd is None:
                raise RemoteNotFound("object not in the mirror", file=p)
            try:
                os.lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                raise RemoteNotFound("object not in the mirror", file=p) from None
            except OSError as exc:
                raise RemoteUnavailable(f"cannot read the mirror folder: {_describe(exc)}", file=p) from None
            try:
                fd = open_run_file(name, "mirror object", error=IntegrityError, dir_fd=dfd)
            except IntegrityError as exc:
                raise IntegrityError(exc.message, file=p, expected=exc.expected, found=exc.found, hint=exc.hint) from None
        finally:
            self._close(rfd, dfd)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise IntegrityError("mirror object is larger than allowed", file=p, expected=f"<= {limit} bytes",
                                     found=f"{size} bytes")
            total = 0
            while True:
                piece = os.read(fd, min(CHUNK, limit + 1 - total))
                if not piece:
                    return total
                total += len(piece)
                if total > limit:
                    raise IntegrityError("mirror object grew while read", file=p, expected=f"<= {limit} bytes")
                out.write(piece)
        finally:
            os.close(fd)

    def list(self) -> dict[str, int]:
        out: dict[str, int] = {}
        rfd = self._root_fd(create=False)
        if rfd is None:
            return out
        seen = PieceBudget("the mirror folder's listing", MAX_LISTED, unit="entries",
                           hint="a mirror ripresa writes holds far fewer entries; it was filled by something else")
        try:
            for entry in os.scandir(rfd):
                seen.take(1, self.root)
                if entry.is_dir(follow_symlinks=False):
                    try:
                        dfd = self._sub_fd(rfd, entry.name, create=False)
                    except IntegrityError:
                        continue  # swapped for a link since the scan: not listed
                    if dfd is None:
                        continue
                    try:
                        for sub in os.scandir(dfd):
                            seen.take(1, self.root)
                            k = f"{entry.name}/{sub.name}"
                            if sub.is_file(follow_symlinks=False) and key_ok(k):
                                out[k] = sub.stat(follow_symlinks=False).st_size
                    finally:
                        os.close(dfd)
                elif entry.is_file(follow_symlinks=False) and key_ok(entry.name):
                    out[entry.name] = entry.stat(follow_symlinks=False).st_size
                if len(out) > MAX_KEYS:
                    raise IntegrityError("the mirror folder holds too many files", file=self.root,
                                         expected=f"<= {MAX_KEYS}")
        finally:
            os.close(rfd)
        return out

    def entries(self, limit: int) -> list[str]:
        """The names at the top of the folder, whatever they are (at most ``limit``; ``[]`` when it does not exist)."""
        rfd = self._root_fd(create=False)
        if rfd is None:
            return []
        try:
            names: list[str] = []
            for entry in os.scandir(rfd):
                names.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
                if len(names) >= limit:
                    break
            return names
        except OSError as exc:
            raise RemoteUnavailable(f"cannot list the mirror folder: {_describe(exc)}", file=self.root) from None
        finally:
            os.close(rfd)

    def delete(self, key: str) -> None:
        rfd, dfd, name = self._at(key, create=False)
        try:
            if dfd is None:
                return
            try:
                os.unlink(name, dir_fd=dfd)  # a link is removed itself, never its target
            except FileNotFoundError:
                return
            except OSError as exc:
                raise RemoteUnavailable(f"deleting from the mirror folder failed: {_describe(exc)}",
                                        file=self.root / key) from None
            if "/" in key:
                try:
                    os.rmdir(key.split("/", 1)[0], dir_fd=rfd)  # the last file of a .dcp folder's objects
                except OSError:
                    pass
        finally:
            self._close(rfd, dfd)

    # -------------------------------------------------------------- the writer lock
    def acquire(self) -> None:
        """Take the folder's writer lock (:class:`~ripresa.errors.LockHeld` while another writer holds it)."""
        from .lock import RunLock

        if self._lock is None:
            self._lock = RunLock(self.root).acquire()

    def release(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()


_DIR = getattr(os, "O_DIRECTORY", 0)


def _describe(exc: OSError) -> str:
    return f"[errno {exc.errno} {errno.errorcode.get(exc.errno or 0, '?')}] {exc.strerror}"


def _planted(path: Path) -> IntegrityError:
    return IntegrityError("the mirror folder holds a symlink (or a file) where a folder of objects belongs", file=path,
                          expected="a folder inside the mirror", found="a symlink or a file",
                          hint="ripresa never writes, reads or deletes through a link in a mirror; remove it")
