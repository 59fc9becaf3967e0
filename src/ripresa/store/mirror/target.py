"""Which store may be a mirror, and the run's record of it (docs/MIRROR.md, "Trust").

:func:`claim_target` refuses a store that holds something else (a run folder, foreign objects) and marks a new
one; :class:`MirrorTarget` holds its lock; :func:`record_url` / :func:`recorded` write and read ``mirror.json``,
authenticated by the run's key; :func:`redacting` keeps credentials out of the history.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ...errors import BadInput, RipresaError
from ...io import auth
from ...io.fsio import is_temp_name, read_small, write_atomic
from ...io.objstore import ObjectStore
from ...io.redact import redact_fields, redact_url
from .layout import (
    CONFIG_SIG,
    MIRROR_MARKER,
    MIRROR_MARKER_BODY,
    MIRROR_RECORD,
    RUN_MANIFEST,
    RUN_SIGNS,
    SEGMENT_PATTERN,
    main_of,
)

_FILE_KEY = re.compile(r"files/[0-9a-f]{64}")


def redacting(event: Callable[..., None] | None) -> Callable[..., None] | None:
    """``event`` with every string field redacted (:func:`ripresa.io.redact.redact`): no credential reaches the history."""
    if event is None:
        return None

    def write(name: str, **fields: Any) -> None:
        event(name, **redact_fields(fields))

    return write


def release_store(store: Any) -> None:
    release = getattr(store, "release", None)
    if release is not None:
        release()


def _run_record_key(name: str) -> bool:
    """An object of the run's own record (its manifest, history segments, side files), or a folder of them."""
    return name in (RUN_MANIFEST, "history", "files") or bool(SEGMENT_PATTERN.fullmatch(name) or _FILE_KEY.fullmatch(name))


def classify_target(names: Iterable[str]) -> tuple[str, list[str]]:
    """What a folder's or a prefix's entries say it is: ``("mirror" | "empty" | "layout" | "run" | "foreign", examples)``.

    ``mirror``: it holds :data:`MIRROR_MARKER`. ``empty``: nothing (or only temporaries). ``layout``: only objects a
    mirror holds (a mirror written before the marker existed). ``run``: a run folder's own files (``LOCK``, the
    history...). ``foreign``: anything else.
    """
    names = [n.rstrip("/") for n in names]
    if MIRROR_MARKER in names:
        return "mirror", []
    run = [n for n in names if n in RUN_SIGNS]
    if run:
        return "run", run[:4]
    other = [n for n in names if not is_temp_name(n.rsplit("/", 1)[-1]) and not _run_record_key(n)
             and n not in ("config.json", CONFIG_SIG, MIRROR_MARKER + ".lock") and main_of(n) is None]
    if other:
        return "foreign", other[:4]
    return ("layout" if any(not is_temp_name(n.rsplit("/", 1)[-1]) for n in names) else "empty"), []


#: Entries looked at to decide what a target is.
_PROBE = 1000


def claim_target(store: ObjectStore, *, explicit: bool) -> None:
    """Make sure ``store`` is a mirror before anything is written to it, and lock it (a folder's ``flock``).

    An empty target becomes a mirror (its :data:`MIRROR_MARKER` is written); a marked one is used; one that
    holds only a mirror's objects (written before the marker existed) is adopted only when the URL was given
    explicitly (``--mirror``, ``Checkpointer(mirror=...)``, an authenticated ``mirror.json``). A run folder and
    a target holding anything else are refused (:class:`~ripresa.errors.BadInput`, exit 2); nothing is written.
    """
    names = store.entries(_PROBE)  # type: ignore[attr-defined]
    what, examples = classify_target(names)
    url = redact_url(store.url)
    if what == "run":
        raise BadInput("the mirror target is a run folder: refused", file=url,
                       expected=f"a mirror (holding {MIRROR_MARKER}) or an empty folder", found=f"a run folder's {examples}",
                       hint="a mirror is its own folder or prefix; choose another --mirror")
    if what == "foreign":
        raise BadInput("the mirror target holds files that are not a mirror's: refused", file=url,
                       expected=f"a mirror (holding {MIRROR_MARKER}) or an empty folder or prefix",
                       found=f"{len(names)}{'+' if len(names) >= _PROBE else ''} entries, e.g. {examples}",
                       hint="a mirror is its own folder or prefix; choose another --mirror")
    if what == "layout" and not explicit:
        raise BadInput("the mirror target is not marked as a mirror: refused for a URL read from mirror.json",
                       file=url, expected=f"{MIRROR_MARKER} in the mirror", found="mirror objects without the marker",
                       hint="name the mirror explicitly once (`ripresa mirror push RUN --mirror URL`) to adopt it")
    if what != "mirror":
        store.put_bytes(MIRROR_MARKER, MIRROR_MARKER_BODY)
    acquire = getattr(store, "acquire", None)
    if acquire is not None:
        acquire()


class MirrorTarget:
    """The store a :class:`Mirror` writes: :func:`claim_target` runs before its first write or deletion."""

    def __init__(self, inner: ObjectStore, *, explicit: bool) -> None:
        self.inner = inner
        self.url = inner.url
        self.multipart_threshold = inner.multipart_threshold
        self.explicit = explicit
        self._claimed = False
        self._claim_lock = threading.Lock()

    def claim(self) -> None:
        with self._claim_lock:
            if not self._claimed:
                claim_target(self.inner, explicit=self.explicit)
                self._claimed = True
        lost = getattr(self.inner, "lock_lost", None)
        if lost is not None:  # another writer took the mirror over (our lease ran out): nothing more is written
            raise lost

    def release(self) -> None:
        with self._claim_lock:
            if self._claimed:
                self._claimed = False
                release_store(self.inner)

    def put_file(self, key: str, path: Path, *, sha256: str) -> int:
        self.claim()
        return self.inner.put_file(key, path, sha256=sha256)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.claim()
        self.inner.put_bytes(key, data)

    def delete(self, key: str) -> None:
        self.claim()
        self.inner.delete(key)

    def get_into(self, key: str, out: Any, *, limit: int) -> int:
        return self.inner.get_into(key, out, limit=limit)

    def get_bytes(self, key: str, *, limit: int) -> bytes:
        return self.inner.get_bytes(key, limit=limit)

    def list(self) -> dict[str, int]:
        return self.inner.list()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _record_mac(key: bytes, run_dir: Path, url: str) -> str:
    return auth.mac(key, auth.record_message(os.path.realpath(run_dir), url))


def record_url(run_dir: Path, url: str) -> None:
    """Write ``RUN/mirror.json``: the URL (redacted), so ``ripresa mirror status RUN`` needs no --mirror.

    With a key (``RIPRESA_HMAC_KEY``), the record carries the key's MAC of the run folder's real path and the
    URL: ``ripresa mirror push RUN`` follows an authenticated record only (docs/MIRROR.md, "Trust").
    """
    import json

    shown = redact_url(url)
    doc: dict[str, Any] = {"url": shown}
    key = auth.load_key()
    if key is not None and shown == url:
        doc.update(key=auth.key_id(key), mac=_record_mac(key, Path(run_dir), url))
    path = Path(run_dir) / MIRROR_RECORD
    data = json.dumps(doc).encode() + b"\n"
    if os.path.lexists(path):
        try:
            if read_small(path, MIRROR_RECORD, 1 << 16) == data:
                return
        except RipresaError:
            pass
    write_atomic(path, [data])


def recorded(run_dir: Path) -> tuple[str | None, bool]:
    """(the URL of ``RUN/mirror.json`` or None, whether the record is authenticated by the configured key)."""
    import hmac as _hmac
    import json

    path = Path(run_dir) / MIRROR_RECORD
    if not os.path.lexists(path):
        return None, False
    try:
        doc = json.loads(read_small(path, MIRROR_RECORD, 1 << 16))
    except (ValueError, RipresaError):
        return None, False
    url = doc.get("url") if isinstance(doc, dict) else None
    if not isinstance(url, str) or "\n" in url:
        return None, False
    key = auth.load_key()
    mac = doc.get("mac")
    ok = (key is not None and isinstance(mac, str)
          and _hmac.compare_digest(mac.encode(), _record_mac(key, Path(run_dir), url).encode()))
    return url, ok


def recorded_url(run_dir: Path) -> str | None:
    return recorded(run_dir)[0]
