"""A generation committed through the store: each node uploads its part, one marker last (docs/DISTRIBUTED.md).

When the nodes of a run have no shared folder, no node ever holds a whole sharded generation: node ``k`` holds
the files its ranks wrote. The generation is committed in the store instead, in the order of a local commit:

1. every node uploads its part (:func:`upload_part`): each file hashed first, then uploaded and re-hashed as
   read (:meth:`~ripresa.io.objstore_base.ObjectStore.put_file` completes an object only with that sha256) —
   all nodes at once, several files at once per node, never through one node;
2. the receipts (name → size, sha256) meet on rank 0 (a collective, :mod:`ripresa.session.nodes`);
3. rank 0 checks that the store lists every object at its receipt's size, uploads the signature, then the
   **marker last** (:func:`commit_marker`): the marker names every object and its sha256, in the very bytes a
   local commit of the whole folder would have written (``sha256sum -c`` works on a pulled copy).

A node that dies before step 3 leaves objects without a marker: the previous generation stays the newest
committed one. No function here knows a kind's files: the caller (the kind's backend, through the session)
says which files are the node's part and how the marker reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ...errors import IntegrityError
from ...io.hashing import sha256_file
from ...io.objstore_base import ObjectStore
from .layout import MirrorSpec
from .pull import fetch_staged, retrying

__all__ = ["Receipt", "commit_marker", "fetch_object", "upload_part", "MAX_PARALLEL_UPLOADS"]

#: Files of one node's part uploaded at once (threads; each streams one file).
MAX_PARALLEL_UPLOADS = 8

_SPEC = MirrorSpec(url="", attempts=5, backoff=0.5, max_backoff=8.0)


@dataclass(frozen=True)
class Receipt:
    """One object a node put in the store: its key, size and sha256 (the marker's line for it)."""

    key: str
    size: int
    sha256: str


def upload_part(remote: ObjectStore, folder: Path, prefix: str, names: Iterable[str], *,
                spec: MirrorSpec = _SPEC, event: Callable[..., None] | None = None) -> list[Receipt]:
    """Upload ``folder/name`` as ``prefix/name`` for each name; the receipts, in name order.

    Each file is hashed, then uploaded and re-hashed as read: a file that changes in between is refused by the
    store (:class:`~ripresa.errors.IntegrityError`), never committed. Up to :data:`MAX_PARALLEL_UPLOADS` files
    at once; an unreachable store is retried with back-off (``spec``), then raised.
    """
    folder = Path(folder)
    todo = sorted(set(names))

    def one(name: str) -> Receipt:
        path = folder / name
        digest = sha256_file(path, what="node part file")
        key = f"{prefix}/{name}"
        size = retrying(lambda: remote.put_file(key, path, sha256=digest.sha256), event, key, spec)
        return Receipt(key, int(size), digest.sha256)

    if len(todo) <= 1:
        return [one(n) for n in todo]
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_UPLOADS, len(todo)), thread_name_prefix="ripresa-part") as ex:
        return list(ex.map(one, todo))


def commit_marker(remote: ObjectStore, marker_key: str, marker: bytes, receipts: Iterable[Receipt], *,
                  signature: tuple[str, bytes] | None = None, spec: MirrorSpec = _SPEC,
                  event: Callable[..., None] | None = None) -> None:
    """Rank 0's last step: every receipt's object listed at its size, then the signature, then the marker.

    An object missing or of another size (a node's upload lost, a store that dropped a write) is an
    :class:`~ripresa.errors.IntegrityError` and no marker is written: the generation does not count.
    """
    listing = retrying(remote.list, event, "listing", spec)
    for r in receipts:
        found = listing.get(r.key)
        if found != r.size:
            raise IntegrityError("an object of the generation is not in the store as its node uploaded it",
                                 file=f"{remote.url}/{r.key}", expected=f"{r.size} bytes", found=found,
                                 hint="a node's upload was lost; the previous generation stays the newest")
    if signature is not None:
        key, data = signature
        retrying(lambda: remote.put_bytes(key, data), event, key, spec)
    retrying(lambda: remote.put_bytes(marker_key, marker), event, marker_key, spec)


def fetch_object(remote: ObjectStore, key: str, target: Path, *, sha256: str, size: int,
                 spec: MirrorSpec = _SPEC, event: Callable[..., None] | None = None) -> int:
    """Object ``key`` landed at ``target`` only if it is at most ``size`` bytes and hashes to ``sha256``.

    Streamed into a temporary sibling, fsync'd, compared, then renamed over ``target`` (the pull's
    :func:`~ripresa.store.mirror.pull.fetch_staged`): two ranks of a node that fetch the same object both land
    the same verified bytes. Returns the bytes pulled.
    """
    sf = fetch_staged(remote, key, target, size, sha256, event or (lambda *a, **k: None), spec)
    sf.publish()
    assert sf.digest is not None
    return sf.digest.size


def read_marker(remote: ObjectStore, key: str, limit: int) -> bytes:
    """The marker object ``key`` (at most ``limit`` bytes), retried while the store is unreachable."""
    return retrying(lambda: remote.get_bytes(key, limit=limit), None, key, _SPEC)


def newest_committed(listing: Mapping[str, int], accept: Callable[[str], int | None]) -> list[tuple[int, str]]:
    """The committed generations of a listing, newest first: ``(step, main)`` for each marker ``main.sha256``
    whose ``main`` ``accept`` gives a step (the kind's name format)."""
    out = []
    for key in listing:
        if key.endswith(".sha256") and "/" not in key:
            main = key[: -len(".sha256")]
            step = accept(main)
            if step is not None:
                out.append((step, main))
    return sorted(out, reverse=True)

