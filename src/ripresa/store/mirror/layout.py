"""What a mirror holds (docs/MIRROR.md): the shared vocabulary of the upload and the pull.

:class:`MirrorSpec` (where and how a run mirrors), the generation keys (:func:`main_of`, :func:`local_generations`;
names, kinds and a generation's files from the registry: :func:`ripresa.store.kinds.owner_of`,
:func:`ripresa.store.kinds.generation_files`), the
:class:`RemoteView` of a listing, and the run record (:class:`RunManifest`: the history segments and sidecars
under ``run.json``). The upload thread is :mod:`ripresa.store.mirror.upload`, the pull :mod:`ripresa.store.mirror.pull`.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ...core.numbers import checked_number
from ...errors import IntegrityError
from ...io import auth
from ...io.fsio import open_run_file
from ..kinds import owner_of
from ..retention import RetentionPolicy

#: The back-off jitter's own stream: drawing from the global ``random`` would change the training's random
#: stream (checkpointed, restored on resume) with every retry, so a store outage would alter the run (the soak's
#: outage kind caught it: a final state that differs from the uninterrupted run).
JITTER = random.Random()

#: Largest marker read (bytes): a ``.dcp`` marker has one line per file.
MAX_MARKER = 1 << 20
#: Largest ``config.json`` pulled (bytes).
MAX_CONFIG = 1 << 20
#: The run folder's record of its mirror URL (read by ``ripresa mirror`` when no --mirror is given).
MIRROR_RECORD = "mirror.json"
#: The object that makes a folder or prefix a mirror (written when ripresa creates one; docs/MIRROR.md, "Trust").
MIRROR_MARKER = "RIPRESA_MIRROR"
MIRROR_MARKER_BODY = b'{"ripresa": "mirror", "version": 1}\n'
#: The signature object of a mirror's ``config.json`` (signed runs).
CONFIG_SIG = "config.json" + auth.SUFFIX
#: Files whose presence makes a folder a run folder, never a mirror.
RUN_SIGNS = ("LOCK", ".loss.jsonl", ".samples.json", ".state.json", "lineage.json", MIRROR_RECORD)


#: How long a close waits for pending uploads by default (seconds): 15 minutes (why: docs/MIRROR.md, "The close").
DEFAULT_CLOSE_TIMEOUT = 900.0


@dataclass(frozen=True)
class MirrorSpec:
    """Where and how a run mirrors its generations.

    ``url``: ``s3://bucket/prefix``, ``file:///path`` or a path. ``keep``: the
    remote retention (None: twice the local ``keep_last``). ``timeout``: seconds
    per request (connect and read). ``attempts``: tries of one object in a
    round; ``backoff``/``max_backoff``: the first and largest wait between
    tries (exponential, with jitter). ``close_timeout``: how long
    :meth:`Checkpointer.close` waits for pending uploads (900 s); at a normal
    end it waits that long also for a store that cannot be reached, after a
    stop (SIGTERM) it leaves after one more failed round (docs/MIRROR.md,
    "The close").
    """

    url: str
    keep: RetentionPolicy | None = None
    timeout: float = 30.0
    attempts: int = 5
    backoff: float = 0.5
    max_backoff: float = 30.0
    close_timeout: float = 900.0  # DEFAULT_CLOSE_TIMEOUT

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.timeout <= 0 or self.backoff < 0 or self.max_backoff < self.backoff:
            raise ValueError(f"bad MirrorSpec: {self}")


def main_of(key: str) -> tuple[str, int] | None:
    """(the generation's main name, its step) that object ``key`` belongs to, or None (the kinds' names)."""
    owner = owner_of(key)
    if owner is None or "/" in key and key.partition("/")[0] != owner.main:  # only main/<file> may hold a slash
        return None
    return owner.main, owner.step


def kind_of(main: str) -> str:
    """The kind of the generation whose main name is ``main``."""
    owner = owner_of(main)
    if owner is None:
        raise ValueError(f"not a generation's name: {main!r}")
    return owner.spec.kind


def local_generations(run_dir: Path) -> dict[str, int]:
    """The committed generations of a run folder (those with a marker): main name → step."""
    out: dict[str, int] = {}
    if not Path(run_dir).is_dir():
        return out
    for entry in os.scandir(run_dir):
        owner = owner_of(entry.name)
        if owner is not None and entry.name == owner.main + ".sha256" and entry.is_file(follow_symlinks=False):
            out[owner.main] = owner.step
    return out


def folders_of(files: Iterable[tuple[str, str]]) -> list[str]:
    """The folders (relative to the run folder) that a generation's files (:func:`ripresa.store.kinds.
    generation_files`) lie in, in order: a folder kind's own folder; none for a kind whose files lie beside
    its marker."""
    return list(dict.fromkeys(name.rpartition("/")[0] for _, name in files if "/" in name))


class RemoteView:
    """What the store holds, grouped by generation: committed (a marker object) and half-uploaded ones."""

    def __init__(self, listing: dict[str, int]) -> None:
        self.objects = dict(listing)
        self.groups: dict[str, set[str]] = {}
        self.steps: dict[str, int] = {}
        for key in listing:
            of = main_of(key)
            if of is not None:
                self.groups.setdefault(of[0], set()).add(key)
                self.steps[of[0]] = of[1]

    @property
    def committed(self) -> dict[str, int]:
        return {m: s for m, s in self.steps.items() if m + ".sha256" in self.groups.get(m, ())}

    @property
    def half(self) -> dict[str, int]:
        return {m: s for m, s in self.steps.items() if m + ".sha256" not in self.groups.get(m, ())}

    def add(self, main: str, step: int, keys: Iterable[tuple[str, int]]) -> None:
        """Record objects the store now holds; a generation exists in the view only with at least one object."""
        for k, size in keys:
            self.objects[k] = size
            self.groups.setdefault(main, set()).add(k)
            self.steps[main] = step

    def drop(self, main: str) -> None:
        for k in self.groups.pop(main, set()):
            self.objects.pop(k, None)
        self.steps.pop(main, None)


# ---------------------------------------------------------------------------- the run's own files


#: The run files' manifest in the store: the commit marker of the history segments and sidecars, uploaded last.
RUN_MANIFEST = "run.json"
RUN_MANIFEST_FORMAT = "ripresa-mirror-run/1"
#: Largest run manifest read (bytes).
MAX_RUN_MANIFEST = 4 << 20
#: Largest sidecar mirrored or pulled (``.samples.json``, ``.state.json``, ``lineage.json``, ``archive/...``; bytes).
MAX_RUN_FILE = 64 << 20
#: Largest history segment (bytes): a longer stretch of history is cut into several.
MAX_SEGMENT = 64 << 20
#: Largest history pulled (bytes).
MAX_HISTORY = 16 << 30
#: Most files under ``archive/`` mirrored; most segments before they are merged again.
MAX_ARCHIVE_FILES = 1000
MAX_SEGMENTS = 512
#: The run files mirrored besides the history (and every regular file under ``archive/``, three levels at most).
RUN_FILES = ("config.json", "lineage.json", ".samples.json", ".state.json")
SEGMENT_PATTERN = re.compile(r"history/(\d{12})-(\d{12})\.jsonl")
_SHA = re.compile(r"[0-9a-f]{64}")
_PART = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9._-]{0,254}")


def run_path_ok(path: object) -> bool:
    """True for a run file the mirror carries: one of :data:`RUN_FILES`, or ``archive/a[/b[/c]]`` (no ``..``, no link)."""
    if not isinstance(path, str):
        return False
    parts = path.split("/")
    if any(p in (".", "..") or not _PART.fullmatch(p) for p in parts):
        return False
    return (len(parts) == 1 and parts[0] in RUN_FILES) or (parts[0] == "archive" and 2 <= len(parts) <= 4)


def segment_key(start: int, end: int) -> str:
    return f"history/{start:012d}-{end:012d}.jsonl"


@dataclass
class RunManifest:
    """What the store holds of the run's own files: history segments (key, start, end, sha256) in order,
    and sidecars (run-relative path → (sha256, size), stored as ``files/<sha256>``)."""

    history: list[tuple[str, int, int, str]]
    files: dict[str, tuple[str, int]]

    @property
    def history_end(self) -> int:
        return self.history[-1][2] if self.history else 0

    def keys(self) -> set[str]:
        return {k for k, *_ in self.history} | {f"files/{sha}" for sha, _ in self.files.values()}

    def to_bytes(self) -> bytes:
        import json

        doc = {"format": RUN_MANIFEST_FORMAT, "history": [list(h) for h in self.history],
               "files": {p: list(v) for p, v in sorted(self.files.items())}}
        return json.dumps(doc, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def parse(cls, raw: bytes, where: str) -> RunManifest:
        """A manifest read from the store (hostile): every key, path, offset and hash checked; the history
        segments must follow each other from byte 0."""
        import json

        def bad(found: str) -> IntegrityError:
            return IntegrityError("malformed run manifest", file=where, expected=f"a {RUN_MANIFEST_FORMAT} document",
                                  found=found[:200], hint="the run's history and sidecars in the mirror are not used")

        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            raise bad(repr(raw[:120])) from None
        if not isinstance(doc, dict) or doc.get("format") != RUN_MANIFEST_FORMAT:
            raise bad("another format")
        hist, files = doc.get("history"), doc.get("files")
        if not isinstance(hist, list) or not isinstance(files, dict) or len(hist) > 4 * MAX_SEGMENTS \
                or len(files) > MAX_ARCHIVE_FILES + len(RUN_FILES):
            raise bad("history or files missing, or too many")
        out: list[tuple[str, int, int, str]] = []
        pos = 0
        for h in hist:
            m = SEGMENT_PATTERN.fullmatch(h[0]) if isinstance(h, list) and len(h) == 4 and isinstance(h[0], str) else None
            if m is None or not isinstance(h[3], str) or not _SHA.fullmatch(h[3]):
                raise bad(f"history entry {str(h)[:120]}")
            for x in h[1:3]:  # the one checked conversion (docs/FAULTS.md, "Numbers read from files")
                checked_number(x, file=where, field="history segment bytes", lo=0, hi=MAX_HISTORY)
            start, end = (checked_number(g, file=where, field="history segment name", lo=0, hi=MAX_HISTORY, text=True)
                          for g in (m.group(1), m.group(2)))
            if (start, end) != (h[1], h[2]) or start != pos or not 0 < end - start <= MAX_SEGMENT or end > MAX_HISTORY:
                raise bad(f"history segment {h[0]} does not follow byte {pos}")
            out.append((h[0], start, end, h[3]))
            pos = end
        entries: dict[str, tuple[str, int]] = {}
        for path, v in files.items():
            if not run_path_ok(path) or not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) \
                    or not _SHA.fullmatch(v[0]):
                raise bad(f"file entry {str(path)[:80]}: {str(v)[:80]}")
            checked_number(v[1], file=where, field=f"file entry {str(path)[:80]}: size", lo=0, hi=MAX_RUN_FILE)
            entries[path] = (v[0], v[1])
        return cls(out, entries)


def history_size(path: Path) -> int:
    if not os.path.lexists(path):
        return 0
    fd = open_run_file(path, "history (.loss.jsonl)", error=IntegrityError)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def local_run_files(run_dir: Path) -> dict[str, Path]:
    """The run files the mirror carries that exist in ``run_dir`` (regular files only; links are not followed)."""
    run_dir = Path(run_dir)
    out: dict[str, Path] = {}
    for name in RUN_FILES:
        p = run_dir / name
        if os.path.lexists(p) and not os.path.islink(p) and p.is_file():
            out[name] = p
    archive = run_dir / "archive"
    if os.path.islink(archive) or not archive.is_dir():
        return out
    stack = [(archive, "archive", 1)]
    while stack and len(out) < MAX_ARCHIVE_FILES + len(RUN_FILES):
        folder, rel, depth = stack.pop()
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            path = f"{rel}/{entry.name}"
            if entry.is_dir(follow_symlinks=False) and depth < 3:
                stack.append((Path(entry.path), path, depth + 1))
            elif entry.is_file(follow_symlinks=False) and run_path_ok(path):
                out[path] = Path(entry.path)
    return out
