"""An S3-compatible object store as a mirror's second store, through boto3 (docs/MIRROR.md): :class:`S3Store`.

Endpoint, region and credentials come from the standard AWS environment; boto3's own retries are off (the mirror
retries, with back-off, and records every retry); every error text is redacted (:mod:`ripresa.io.redact`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..core.numbers import checked_number
from ..errors import BadInput, IntegrityError, LockHeld, MissingDependency
from .fsio import CHUNK
from .objstore_base import (
    LEASE,
    LOCK_KEY,
    MAX_KEYS,
    MAX_LISTED,
    MULTIPART_THRESHOLD,
    PART_SIZE,
    GetBytes,
    HashedFile,
    RemoteNotFound,
    RemoteUnavailable,
    Writer,
    check_key,
    key_ok,
)
from .pieces import PieceBudget
from .redact import redact


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


class S3Store(GetBytes):
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
                        max_pool_connections=10)  # a node's part goes up 8 files at once (store/mirror/commit.py)
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
            src = HashedFile(path)
            for piece in src:
                data.extend(piece)
            src.check(sha256)
            self._call(f"upload of {key}", self.client.put_object, Key=k, Body=bytes(data))
            return len(data)
        up = self._call(f"start of the multipart upload of {key}", self.client.create_multipart_upload, Key=k)
        uid = up["UploadId"]
        try:
            parts: list[dict[str, Any]] = []
            part, total, src = bytearray(), 0, HashedFile(path)

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
        seen = PieceBudget("the mirror's listing", MAX_LISTED, unit="entries",
                           hint="a bucket prefix ripresa writes holds far fewer objects; it was filled by something else")
        while True:
            kw: dict[str, Any] = {"Prefix": self.prefix, "MaxKeys": 1000}
            if token:
                kw["ContinuationToken"] = token
            r = self._call("listing", self.client.list_objects_v2, **kw)
            page = r.get("Contents", []) or []
            seen.take(max(1, len(page)), self.url)  # every page counts, an empty one too
            for obj in page:
                k = str(obj.get("Key", ""))[len(self.prefix):]
                if key_ok(k):
                    out[k] = checked_number(obj.get("Size", 0), file=f"{self.url}/{k}", field="listing: Size", lo=0,
                                            hi=2**63 - 1)
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
