"""Secrets out of every file and message: one redaction for URLs and error text (docs/MIRROR.md, "Trust").

An endpoint's userinfo (``http://user:secret@host:9000``) and a presigned URL's query
(``X-Amz-Signature=...``) carry credentials, and client libraries quote such URLs in their errors.
Whatever reaches the run's history, ``mirror.json``, an export, an exception's text or the terminal
goes through :func:`redact` first: userinfo and credential-like query values become ``***``, and the
values of the credential environment variables (``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
the HMAC key) are replaced wherever they appear.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "redact", "redact_fields", "redact_url"]

MASK = "***"

#: ``scheme://userinfo@`` anywhere in a text (userinfo: no ``/``, no whitespace, no quote).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]{0,31}://)(?P<userinfo>[^/@\s\"'<>]*)@")
#: A credential-like query parameter's value (presigned URLs, tokens, passwords).
_QUERY_SECRET = re.compile(
    r"(?<=[?&;])(?P<name>(?:X-Amz-(?:Signature|Credential|Security-Token)|Signature|AWSAccessKeyId|"
    r"(?:access_?|secret_?|session_?|api_?)?(?:token|key|password|passwd|secret))=)(?P<value>[^&\s\"'#]+)",
    re.IGNORECASE,
)
#: Environment variables whose values are secrets: never written anywhere.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "RIPRESA_HMAC_KEY")
#: Shortest environment secret replaced verbatim (a shorter value would mask ordinary words).
_MIN_SECRET = 12


def _env_secrets(environ: Mapping[str, str] | None) -> list[str]:
    env = os.environ if environ is None else environ
    return sorted({v for k in SECRET_ENV if len(v := env.get(k, "") or "") >= _MIN_SECRET}, key=len, reverse=True)


def redact(text: Any, *, environ: Mapping[str, str] | None = None) -> str:
    """``text`` (made a string) with every URL's userinfo, credential query value and secret env value masked."""
    s = text if isinstance(text, str) else str(text)
    s = _USERINFO.sub(lambda m: m.group("scheme") + MASK + "@", s)
    s = _QUERY_SECRET.sub(lambda m: m.group("name") + MASK, s)
    for secret in _env_secrets(environ):
        if secret in s:
            s = s.replace(secret, MASK)
    return s


def redact_url(url: Any, *, environ: Mapping[str, str] | None = None) -> str:
    """A URL as it may be shown or written: its userinfo and credential query values masked."""
    return redact(url if isinstance(url, str) else os.fspath(url) if isinstance(url, os.PathLike) else str(url),
                  environ=environ)


def redact_fields(value: Any, *, environ: Mapping[str, str] | None = None, _depth: int = 0) -> Any:
    """``value`` with every string in it (dict values and keys, list items) redacted; other values unchanged."""
    if isinstance(value, str):
        return redact(value, environ=environ)
    if _depth > 16:
        return value
    if isinstance(value, Mapping):
        return {redact_fields(k, environ=environ, _depth=_depth + 1): redact_fields(v, environ=environ, _depth=_depth + 1)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_fields(v, environ=environ, _depth=_depth + 1) for v in value)
    return value
