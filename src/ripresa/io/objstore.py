"""A second store for a run's generations (docs/MIRROR.md): :func:`open_store` turns a URL into an :class:`ObjectStore`.

``s3://bucket/prefix`` is an :class:`S3Store` (:mod:`ripresa.io.s3store`, the optional extra ``ripresa[s3]``); a path
or ``file:///path`` is a :class:`LocalStore` (:mod:`ripresa.io.folderstore`). The protocol, its keys, limits and typed
errors live in :mod:`ripresa.io.objstore_base`; this module is the face the mirror and the tests import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse

from ..errors import BadInput
from .folderstore import LocalStore
from .objstore_base import (
    LEASE,
    LOCK_KEY,
    MAX_KEYS,
    MULTIPART_THRESHOLD,
    PART_SIZE,
    ObjectStore,
    RemoteNotFound,
    RemoteUnavailable,
    Writer,
    check_key,
)
from .redact import redact_url
from .s3store import S3Store

__all__ = ["LEASE", "LOCK_KEY", "MAX_KEYS", "MULTIPART_THRESHOLD", "PART_SIZE", "LocalStore", "ObjectStore",
           "RemoteNotFound", "RemoteUnavailable", "S3Store", "Writer", "check_key", "open_store"]


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
