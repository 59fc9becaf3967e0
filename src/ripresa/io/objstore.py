"""A second store for a run's generations: a local folder or an S3-compatible object store (docs/MIRROR.md).

:func:`open_store` turns a URL into an :class:`ObjectStore`:

* ``s3://bucket/prefix`` — :class:`S3Store`, through boto3 (the optional extra
  ``ripresa[s3]``). Endpoint, region and credentials come from the standard
  AWS environment (``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
  ``AWS_DEFAULT_REGION``, profiles). boto3's own retries are switched off:
  the mirror retries, with back-off, and records every retry in the history.
* a path or ``file:///path`` — :class:`LocalStore` (another disk, an NFS mount),
  written with the local commit protocol (temporary name, ``fsync``, rename),
  every name inside it opened relative to the open folder, never through a link.

Each store has a writer lock (``acquire``/``release``: a folder's ``flock``, an
S3 prefix's lease object :data:`LOCK_KEY`) and ``entries`` (the raw names, to
tell a mirror from a run folder); a URL never carries credentials, and every
error text is redacted (:mod:`ripresa.io.redact`; docs/MIRROR.md, "Trust").

Keys are names relative to the prefix: ``config.json``, ``step_000100.bin``,
``step_000100.dcp/__0_0.distcp`` (:func:`check_key`: no ``..``, at most one
``/``, no leading ``.`` but for a ``.dcp`` folder's ``.metadata``). Everything read from the store is hostile:
:meth:`ObjectStore.get_into` streams at most ``limit`` bytes into the
caller's writer (never the whole object in memory), :meth:`ObjectStore.get_bytes`
refuses an object larger than its limit before reading it, and a listing is
bounded (:data:`MAX_KEYS`). :meth:`ObjectStore.put_file` re-hashes the file
as it reads it and completes the object only when the sha256 is the one the
caller expects (a multipart upload above :attr:`ObjectStore.multipart_threshold`
is aborted otherwise).

Failures are typed: :class:`RemoteUnavailable` (network, timeout, reset,
5xx, throttling: retried by the mirror), :class:`RemoteNotFound` (a missing
key), :class:`~ripresa.errors.BadInput` for a bad URL or missing credentials,
:class:`~ripresa.errors.MissingDependency` without boto3.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from ..errors import BadInput, IntegrityError, LockHeld, MissingDependency, SaveFailed
from .fsio import CHUNK, open_run_file, temp_name_for
from .redact import redact, redact_url

__all__ = ["MAX_KEYS", "LocalStore", "ObjectStore", "RemoteNotFound", "RemoteUnavailable", "S3Store", "check_key",
           "open_store"]

#: Most keys a listing returns before it is refused as hostile.
MAX_KEYS = 100_000
#: The writer lock of an S3 mirror (an object; a folder mirror uses an ``flock`` on ``LOCK``).
LOCK_KEY = "RIPRESA_MIRROR.lock"
#: Seconds an S3 writer's lease lasts without renewal (renewed every third of it while the writer lives).
LEASE = 120.0
#: Objects above this size are uploaded in parts (bytes).
MULTIPART_THRESHOLD = 64 * 1024 * 1024
#: Size of one part of a multipart upload (bytes; S3's minimum is 5 MiB).
PART_SIZE = 16 * 1024 * 1024
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}(?:/(?!\.\.?\Z)[A-Za-z0-9_.][A-Za-z0-9._-]{0,254})?")


def _key_ok(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None and ".." not in key


class RemoteUnavailable(SaveFailed):
    """The store could not be reached or refused for now (network, timeout, reset, 5xx, throttling): retry later."""


class RemoteNotFound(IntegrityError):
    """A key the caller expected is not in the store."""


def check_key(key: str) -> str:
    """``key`` if it is a name ripresa writes, else ``ValueError``: at most one ``/`` (a ``.dcp`` folder's file,
    which may start with ``.``: ``.metadata``), no ``..``, no other leading ``.``."""
    if not _key_ok(key):
        raise ValueError(f"not an object key ripresa writes: {key!r:.120}")
    return key


class Writer(Protocol):
    def write(self, data: bytes | bytearray | memoryview) -> int: ...


class ObjectStore(Protocol):
    """What the mirror needs from a second store."""

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


class _Hashed:
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


class _GetBytes:
    """``get_bytes`` for a store: its ``get_into`` into memory (bounded by ``limit``, like every read)."""

    def get_bytes(self, key: str, *, limit: int) -> bytes:
        buf = bytearray()

        class _W:
            def write(self, data: Any) -> int:
                buf.extend(data)
                return len(data)

        self.get_into(key, _W(), limit=limit)  # type: ignore[attr-defined]
        return bytes(buf)


class LocalStore(_GetBytes):
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
        src = _Hashed(path)
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
        try:
            for entry in os.scandir(rfd):
                if entry.is_dir(follow_symlinks=False):
                    try:
                        dfd = self._sub_fd(rfd, entry.name, create=False)
                    except IntegrityError:
                        continue  # swapped for a link since the scan: not listed
                    if dfd is None:
                        continue
                    try:
                        for sub in os.scandir(dfd):
                            k = f"{entry.name}/{sub.name}"
                            if sub.is_file(follow_symlinks=False) and _key_ok(k):
                                out[k] = sub.stat(follow_symlinks=False).st_size
                    finally:
                        os.close(dfd)
                elif entry.is_file(follow_symlinks=False) and _key_ok(entry.name):
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


def _s3_error(exc: BaseException, what: str, url: str) -> Exception:
    """A boto3/botocore failure as a typed error (RemoteUnavailable is retried)."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return _no_credentials(url)
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = err.get("Code", "?")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return RemoteNotFound(f"{what}: not in the mirror", file=url, found=f"HTTP {status} {code}")
        return RemoteUnavailable(f"{what} failed: HTTP {status} {code}", file=url,
                                 found=redact(str(err.get("Message", "")))[:200])
    # the client quotes the endpoint URL (credentials in its userinfo, too) verbatim: redacted where the text is born
    return RemoteUnavailable(f"{what} failed: {type(exc).__name__}", file=url, found=redact(str(exc))[:200])


def _lease_alive(held: dict[str, Any]) -> bool:
    """A lease not expired whose writer, when it is of this host, still runs."""
    import socket
    import time

    from .liveness import pid_alive

    try:
        expires = float(held.get("expires", 0))
    except (TypeError, ValueError):
        return False
    if expires <= time.time():
        return False
    return not (held.get("host") == socket.gethostname()[:64] and not pid_alive(held.get("pid")))


def _lock_held(url: str, held: dict[str, Any]) -> LockHeld:
    return LockHeld("another writer holds the mirror", file=url, expected="no other writer of this mirror",
                    found=f"{LOCK_KEY} of host {str(held.get('host', '?'))[:64]!r}, pid {held.get('pid', '?')}, "
                    f"lease until {held.get('expires', '?')} (unix time)",
                    hint="one run writes one mirror; a writer that died frees it when its lease ends")


def _no_credentials(url: str) -> BadInput:
    return BadInput("no credentials for the S3 mirror", file=url,
                    expected="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile, AWS_PROFILE)", found="none",
                    hint="export the credentials (and AWS_ENDPOINT_URL for a non-AWS store) before starting")


_LOADER: Any = None


class S3Store(_GetBytes):
    """``s3://bucket/prefix`` through boto3 (its own retries off: the mirror retries and records them)."""

    multipart_threshold = MULTIPART_THRESHOLD
    part_size = PART_SIZE

    def __init__(self, bucket: str, prefix: str, url: str, *, timeout: float = 30.0) -> None:
        self._lease: tuple[str, Any] | None = None
        self.lock_lost: LockHeld | None = None
        try:
            import boto3
            import botocore.session
            from botocore.config import Config
        except ImportError as exc:
            raise MissingDependency("the S3 mirror needs boto3", file=url, expected="boto3 installed",
                                    found="not installed", hint="pip install 'ripresa[s3]'") from exc
        self.url, self.bucket = url, bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        global _LOADER
        core = botocore.session.get_session()  # a new session: the environment of now (endpoint, credentials)
        if _LOADER is None:
            _LOADER = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _LOADER)  # the service models, parsed once per process
        session = boto3.session.Session(botocore_session=core)
        if session.get_credentials() is None:
            raise _no_credentials(url)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=timeout,
                        read_timeout=timeout, s3={"addressing_style": "path"} if endpoint else {},
                        max_pool_connections=4)
        try:
            self.client = session.client("s3", endpoint_url=endpoint, config=config,
                                         region_name=session.region_name or "us-east-1")
        except Exception as exc:  # noqa: BLE001 - botocore's ValueError for a malformed endpoint quotes it whole
            raise BadInput("the S3 endpoint cannot be used", file=url, expected="AWS_ENDPOINT_URL=http(s)://host[:port]",
                           found=redact(f"{type(exc).__name__}: {exc}")[:200],
                           hint="fix AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3") from None

    def _call(self, what: str, fn: Any, **kw: Any) -> Any:
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as exc:  # botocore's and urllib3's many failures: typed here
            raise _s3_error(exc, what, self.url) from None

    def put_file(self, key: str, path: Path, *, sha256: str) -> int:
        k = self.prefix + check_key(key)
        size = os.stat(path, follow_symlinks=False).st_size
        if size <= self.multipart_threshold:
            data = bytearray()
            src = _Hashed(path)
            for piece in src:
                data.extend(piece)
            src.check(sha256)
            self._call(f"upload of {key}", self.client.put_object, Key=k, Body=bytes(data))
            return len(data)
        up = self._call(f"start of the multipart upload of {key}", self.client.create_multipart_upload, Key=k)
        uid = up["UploadId"]
        try:
            parts: list[dict[str, Any]] = []
            part, total, src = bytearray(), 0, _Hashed(path)

            def send() -> None:
                n = len(parts) + 1
                r = self._call(f"part {n} of {key}", self.client.upload_part, Key=k, UploadId=uid, PartNumber=n,
                               Body=bytes(part))
                parts.append({"ETag": r["ETag"], "PartNumber": n})
                part.clear()

            for piece in src:
                part.extend(piece)
                total += len(piece)
                if len(part) >= self.part_size:
                    send()
            if part or not parts:
                send()
            src.check(sha256)
            self._call(f"completion of {key}", self.client.complete_multipart_upload, Key=k, UploadId=uid,
                       MultipartUpload={"Parts": parts})
            return total
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=uid)
            except Exception:  # noqa: BLE001 - the store's lifecycle rules clean what an abort could not
                pass
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(f"upload of {key}", self.client.put_object, Key=self.prefix + check_key(key), Body=bytes(data))

    def get_into(self, key: str, out: Writer, *, limit: int) -> int:
        r = self._call(f"download of {key}", self.client.get_object, Key=self.prefix + check_key(key))
        body = r["Body"]
        try:
            announced = int(r.get("ContentLength") or 0)
            if announced > limit:
                raise IntegrityError("mirror object is larger than allowed", file=f"{self.url}/{key}",
                                     expected=f"<= {limit} bytes", found=f"{announced} bytes")
            total = 0
            while True:
                try:
                    piece = body.read(min(CHUNK, limit + 1 - total))
                except Exception as exc:  # a reset or timeout in the middle of the body
                    raise _s3_error(exc, f"download of {key}", self.url) from None
                if not piece:
                    return total
                total += len(piece)
                if total > limit:
                    raise IntegrityError("mirror object is larger than it announced", file=f"{self.url}/{key}",
                                         expected=f"<= {limit} bytes")
                out.write(piece)
        finally:
            body.close()

    def list(self) -> dict[str, int]:
        out: dict[str, int] = {}
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Prefix": self.prefix, "MaxKeys": 1000}
            if token:
                kw["ContinuationToken"] = token
            r = self._call("listing", self.client.list_objects_v2, **kw)
            for obj in r.get("Contents", []) or []:
                k = str(obj.get("Key", ""))[len(self.prefix):]
                if _key_ok(k):
                    out[k] = int(obj.get("Size", 0))
            if len(out) > MAX_KEYS:
                raise IntegrityError("the mirror holds too many objects", file=self.url, expected=f"<= {MAX_KEYS}")
            token = r.get("NextContinuationToken") if r.get("IsTruncated") else None
            if not token:
                return out

    def delete(self, key: str) -> None:
        self._call(f"deletion of {key}", self.client.delete_object, Key=self.prefix + check_key(key))

    # -------------------------------------------------------------- the writer lock (a lease object)
    def acquire(self, *, lease: float = LEASE) -> None:
        """Take the prefix's writer lock: the object :data:`LOCK_KEY`, created only if absent (``If-None-Match: *``),
        holding this writer's id and the end of its lease, renewed every ``lease / 3`` seconds by a daemon thread.

        Another writer's unexpired lease: :class:`~ripresa.errors.LockHeld` (exit 2); an expired one (its writer
        died, e.g. the machine was lost) is taken over. A renewal that finds another writer's lease sets
        :attr:`lock_lost` (the mirror stops writing).
        """
        import json
        import socket
        import threading
        import time
        import uuid

        from botocore.exceptions import ClientError

        if self._lease is not None:
            return
        owner = uuid.uuid4().hex
        key = self.prefix + LOCK_KEY

        def body() -> bytes:
            return json.dumps({"owner": owner, "host": socket.gethostname()[:64], "pid": os.getpid(),
                               "expires": round(time.time() + lease, 3)}).encode()

        for _ in range(3):
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=body(), IfNoneMatch="*")
                break
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                code = exc.response.get("Error", {}).get("Code", "")
                if status == 501 or code in ("NotImplemented", "InvalidArgument", "InvalidRequest"):
                    # a store without conditional writes: look, then write (exclusion only as good as the store)
                    held = self._read_lease()
                    if held is not None and _lease_alive(held) and held.get("owner") != owner:
                        raise _lock_held(self.url, held) from None
                    self._call("taking the mirror's lock", self.client.put_object, Key=key, Body=body())
                    break
                if status not in (409, 412):
                    raise _s3_error(exc, "taking the mirror's lock", self.url) from None
            except Exception as exc:  # noqa: BLE001 - typed below
                raise _s3_error(exc, "taking the mirror's lock", self.url) from None
            held = self._read_lease()
            if held is not None and _lease_alive(held):
                raise _lock_held(self.url, held)
            if held is not None:  # expired, or its writer (on this host) is dead: taken over
                self._call("removal of an expired lock", self.client.delete_object, Key=key)
        else:
            raise _lock_held(self.url, self._read_lease() or {})
        stop = threading.Event()
        self._lease = (owner, stop)

        def renew() -> None:
            while not stop.wait(lease / 3):
                try:
                    held = self._read_lease()
                    if held is not None and held.get("owner") != owner:
                        self.lock_lost = _lock_held(self.url, held)
                        return
                    self.client.put_object(Bucket=self.bucket, Key=key, Body=body())
                except Exception:  # noqa: BLE001 - a store unreachable now: renewed at the next tick
                    continue

        threading.Thread(target=renew, name="ripresa-mirror-lease", daemon=True).start()

    def _read_lease(self) -> dict[str, Any] | None:
        import json

        try:
            raw = self.get_bytes(LOCK_KEY, limit=4096)
        except RemoteNotFound:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def release(self) -> None:
        if self._lease is None:
            return
        (owner, stop), self._lease = self._lease, None
        stop.set()
        try:
            held = self._read_lease()
            if held is not None and held.get("owner") == owner:
                self.client.delete_object(Bucket=self.bucket, Key=self.prefix + LOCK_KEY)
        except Exception:  # noqa: BLE001 - the lease expires by itself
            pass

    def entries(self, limit: int) -> list[str]:
        """The keys under the prefix, whatever they are (at most ``limit``), relative to it."""
        r = self._call("listing", self.client.list_objects_v2, Prefix=self.prefix, MaxKeys=max(1, min(limit, 1000)))
        return [str(o.get("Key", ""))[len(self.prefix):] for o in r.get("Contents", []) or []][:limit]


def open_store(url: str | os.PathLike[str], *, timeout: float = 30.0) -> ObjectStore:
    """The store a mirror URL names: ``s3://bucket/prefix``, ``file:///path`` or a path."""
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if not isinstance(text, str) or not text.strip():
        raise BadInput("empty mirror URL", expected="s3://bucket/prefix, file:///path or a path", found=repr(text))
    shown = redact_url(text)  # what an error may say of it
    if shown != text and "://" in text:
        raise BadInput("a mirror URL never carries credentials", expected="s3://bucket/prefix, file:///path or a path",
                       found=shown, hint="credentials come from the environment (AWS_ACCESS_KEY_ID, "
                       "AWS_SECRET_ACCESS_KEY, a profile), never from the URL")
    if "://" not in text:
        return LocalStore(Path(text).expanduser().absolute(), text)
    u = urlparse(text)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path:
            raise BadInput("bad file:// mirror URL", expected="file:///absolute/path", found=shown)
        return LocalStore(Path(u.path), text)
    if u.scheme == "s3":
        bucket = u.netloc
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket or "") or u.query or u.fragment:
            raise BadInput("bad S3 mirror URL", expected="s3://bucket/prefix (a valid bucket name)", found=shown)
        prefix = u.path.strip("/")
        if prefix and any(not p or p in (".", "..") for p in prefix.split("/")):
            raise BadInput("bad S3 mirror prefix", expected="s3://bucket/a/b", found=shown)
        return S3Store(bucket, prefix, text, timeout=timeout)
    raise BadInput("unknown mirror URL scheme", expected="s3://bucket/prefix, file:///path or a path", found=shown,
                   hint="an S3-compatible store (MinIO, R2, Ceph...) is s3:// with AWS_ENDPOINT_URL set")
