"""The mirror: a run's committed generations copied to a second store, and a resume from it (docs/MIRROR.md).

Upload: a :class:`Mirror`'s background thread (never the training thread) uploads each committed
generation it lacks, every file re-hashed against its local marker, **the marker object last**;
failures are retried with jittered back-off, outages recorded once, pending generations pinned
against local retention (:meth:`Mirror.pinned`). Resume: :func:`pull` lands the newest remote
generation whose marker verifies through the local commit protocol and deep-checks it;
:func:`pull_run` first restores the run's history and sidecars (:func:`restore_run`). Trust (a
marked, locked target; a signed ``mirror.json`` and ``config.json``): docs/MIRROR.md, "Trust".
Generation names and kinds come from the registry (:func:`ripresa.store.kinds.owner_of`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput, CheckFailed, IntegrityError, RipresaError, SaveFailed
from ..formats.generation import Generation
from ..io import auth
from ..io.fsio import (
    StagedFile,
    fsync_dir,
    is_temp_name,
    open_run_file,
    ops,
    parse_sha256sum,
    read_small,
    write_atomic,
)
from ..io.objstore import LocalStore, ObjectStore, RemoteNotFound, RemoteUnavailable, open_store
from ..io.redact import redact_fields, redact_url
from .history import HISTORY_NAME
from .kinds import backend_of, owner_of, spec_of
from .retention import KeepAny, KeepLast, RetentionPolicy
from .store import CheckpointStore

#: The back-off jitter's own stream: drawing from the global ``random`` would change the training's random
#: stream (checkpointed, restored on resume) with every retry, so a store outage would alter the run (the soak's
#: outage kind caught it: a final state that differs from the uninterrupted run).
_JITTER = random.Random()

__all__ = ["Mirror", "MirrorSpec", "MirrorTarget", "RemoteView", "RunManifest", "claim_target", "local_generations",
           "open_mirror", "pull", "pull_config", "pull_run", "record_url", "recorded", "redacting", "restore_run"]

#: The kinds a pull takes by default, and their order at equal steps (any other registered kind after them).
PULL_KINDS = ("bin", "general", "dcp")
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


@dataclass(frozen=True)
class MirrorSpec:
    """Where and how a run mirrors its generations.

    ``url``: ``s3://bucket/prefix``, ``file:///path`` or a path. ``keep``: the
    remote retention (None: twice the local ``keep_last``). ``timeout``: seconds
    per request (connect and read). ``attempts``: tries of one object in a
    round; ``backoff``/``max_backoff``: the first and largest wait between
    tries (exponential, with jitter). ``close_timeout``: how long
    :meth:`Checkpointer.close` waits for pending uploads.
    """

    url: str
    keep: RetentionPolicy | None = None
    timeout: float = 30.0
    attempts: int = 5
    backoff: float = 0.5
    max_backoff: float = 30.0
    close_timeout: float = 600.0

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


def marker_files(main: str, raw: bytes, where: str) -> list[tuple[str, str]]:
    """The (sha256, name) lines of ``main``'s marker, each name one of that generation's own files."""
    parsed = parse_sha256sum(raw, in_folder=True)
    ok = parsed is not None and len(parsed) >= 2 and len({n for _, n in parsed}) == len(parsed)
    if ok:
        folder_kind = spec_of(kind_of(main)).naming.folder
        for _, name in parsed:
            of = main_of(name)
            if of is None or of[0] != main or name.endswith((".sha256", ".hmac")):
                ok = False
            if folder_kind != ("/" in name):
                ok = False
    if not ok:
        raise IntegrityError("malformed commit marker", file=where, expected=f"sha256sum lines naming the files of {main}",
                             found=repr(raw[:160]), hint="this generation cannot be trusted")
    return parsed  # type: ignore[return-value]


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


def default_remote_policy(local: RetentionPolicy) -> RetentionPolicy:
    """Twice the local ``keep_last`` (and whatever else the local policy keeps); the local policy when it has none."""
    parts = local.policies if isinstance(local, KeepAny) else (local,)
    doubled = tuple(KeepLast(2 * p.n) if isinstance(p, KeepLast) else p for p in parts)
    return doubled[0] if len(doubled) == 1 else KeepAny(doubled)


def _safe(event: Callable[..., None] | None) -> Callable[..., None]:
    """A history writer the thread may call at any time (a closed history: the line is dropped)."""

    def write(name: str, **fields: Any) -> None:
        if event is not None:
            try:
                event(name, **fields)
            except (OSError, ValueError):
                pass

    return write


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
_SEGMENT = re.compile(r"history/(\d{12})-(\d{12})\.jsonl")
_FILE_KEY = re.compile(r"files/[0-9a-f]{64}")
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
            m = _SEGMENT.fullmatch(h[0]) if isinstance(h, list) and len(h) == 4 and isinstance(h[0], str) else None
            if m is None or not all(isinstance(x, int) and not isinstance(x, bool) for x in h[1:3]) \
                    or not isinstance(h[3], str) or not _SHA.fullmatch(h[3]):
                raise bad(f"history entry {str(h)[:120]}")
            start, end = int(m.group(1)), int(m.group(2))
            if (start, end) != (h[1], h[2]) or start != pos or not 0 < end - start <= MAX_SEGMENT or end > MAX_HISTORY:
                raise bad(f"history segment {h[0]} does not follow byte {pos}")
            out.append((h[0], start, end, h[3]))
            pos = end
        entries: dict[str, tuple[str, int]] = {}
        for path, v in files.items():
            if not run_path_ok(path) or not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) \
                    or not _SHA.fullmatch(v[0]) or not isinstance(v[1], int) or isinstance(v[1], bool) \
                    or not 0 <= v[1] <= MAX_RUN_FILE:
                raise bad(f"file entry {str(path)[:80]}: {str(v)[:80]}")
            entries[path] = (v[0], v[1])
        return cls(out, entries)


def _read_range(path: Path, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a run file (opened without following a link; shorter if the file is)."""
    from ..io.fsio import CHUNK

    fd = open_run_file(path, "history (.loss.jsonl)", error=IntegrityError)
    try:
        out = bytearray()
        while start + len(out) < end:
            piece = os.pread(fd, min(CHUNK, end - start - len(out)), start + len(out))
            if not piece:
                break
            out += piece
        return bytes(out)
    finally:
        os.close(fd)


def _history_size(path: Path) -> int:
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


def _safe_parent(run_dir: Path, path: str) -> Path:
    """``run_dir/path``'s folder, created inside the run folder (a link or file in the way: IntegrityError)."""
    folder = Path(run_dir)
    for part in path.split("/")[:-1]:
        folder = folder / part
        if os.path.islink(folder) or (os.path.lexists(folder) and not folder.is_dir()):
            raise IntegrityError("a run file's folder is not a folder inside the run", file=folder,
                                 expected="a folder (or nothing yet)", found="a link or a file",
                                 hint="ripresa never follows links inside a run folder; remove it")
        if not os.path.lexists(folder):
            folder.mkdir()
    return folder


class _Stopped(Exception):
    """The mirror is being closed: leave the round now."""


#: During :meth:`Mirror.close`, the longest wait between two tries of a request (seconds): the close stays short.
CLOSE_RETRY_WAIT = 1.0
#: The shortest pause between two rounds after a failed one (seconds), whatever ``MirrorSpec.backoff`` says.
MIN_ROUND_WAIT = 0.05


def _notice(text: str) -> None:
    """One line on stderr (never raises: a closed or broken stderr drops it)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, OSError, ValueError):
        return False


def _steps_text(steps: list[int], most: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:most])
    return shown + (f" and {len(steps) - most} more" if len(steps) > most else "")


class Mirror:
    """Uploads a run folder's committed generations in the background (see the module doc).

    The session calls :meth:`start`, :meth:`notify` after each commit,
    :meth:`pinned` from retention, and :meth:`close`; :meth:`drain` waits until
    nothing is pending (e.g. before a deadline). :attr:`last_upload_seconds`
    is the measured time of the last generation upload (None before the first).

    Failures: a round that gives up starts an *outage* (one ``mirror_outage``
    history line and one line on stderr); while it lasts, each round tries
    each request once, rounds are spaced by a capped, jittered exponential
    back-off, and nothing more is recorded; the first round that completes
    ends it (one ``mirror_recovered`` line: failed attempts, duration, what
    was uploaded). The history stays O(1) through an outage of any length.
    """

    def __init__(self, spec: MirrorSpec, run_dir: Path, *, local_retention: RetentionPolicy,
                 event: Callable[..., None] | None = None, store: ObjectStore | None = None) -> None:
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.store = store if store is not None else MirrorTarget(open_store(spec.url, timeout=spec.timeout), explicit=True)
        self.policy = spec.keep if spec.keep is not None else default_remote_policy(local_retention)
        #: The metrics recorded with each generation (a ``KeepBest`` policy): the Checkpointer sets it.
        self.metrics: Callable[[], Mapping[int, Mapping[str, float]]] = dict
        self._event = _safe(event)
        self.last_upload_seconds: float | None = None
        self.uploaded: list[int] = []
        self._remote: RemoteView | None = None
        self._pending: set[int] = set()
        self._horizon = -1  # local steps above it were not planned yet: pinned
        self._refused: set[str] = set()
        self._superseded: set[str] = set()
        self._config_sha: str | None = None
        self._lock = threading.Condition()
        self._dirty = True
        self._busy = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._closing = False
        self._rounds = 0  # rounds started by the thread
        self._last_round: tuple[int, bool] = (0, True)  # (number, succeeded) of the last finished round
        self._failed_requests = 0  # every request that failed, this session
        self._outage: dict[str, Any] | None = None
        self._last_error: str | None = None
        self._current: int | None = None  # the step being uploaded now
        self.outages = 0  # outages this session (each recorded once)
        self._run: RunManifest | None = None  # the store's run manifest (history segments, sidecars)
        self._run_checked = False
        self._run_cache: dict[str, tuple[tuple[int, int, int], str, int]] = {}

    # ------------------------------------------------------------------ session hooks
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ripresa-mirror", daemon=True)
            self._thread.start()
            self._wake.set()

    def notify(self, step: int | None = None) -> None:
        """A generation was committed: upload it (in the background)."""
        with self._lock:
            self._dirty = True
        self.start()
        self._wake.set()

    def pinned(self, valid: Iterable[int]) -> set[int]:
        """The steps of ``valid`` local retention must keep: pending, or not planned yet."""
        with self._lock:
            return {s for s in valid if s in self._pending or s > self._horizon}

    @property
    def pending(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    @property
    def in_outage(self) -> bool:
        """True while the store cannot be reached (a round gave up and none has completed since)."""
        return self._outage is not None

    def drain(self, timeout: float) -> bool:
        """Upload what is pending now; wait at most ``timeout`` seconds. True when nothing is pending.

        It wakes the thread once; a failed round is retried by the thread after its back-off, never
        sooner (a drain never turns an outage into a busy loop)."""
        deadline = time.monotonic() + max(0.0, timeout)
        self.notify()
        with self._lock:
            while self._dirty or self._busy or self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    break
                self._lock.wait(min(left, 0.5))
            return not (self._dirty or self._busy or self._pending)

    def close(self, timeout: float | None = None, *, interrupted: Callable[[], bool] | None = None) -> bool:
        """Upload what is pending, then stop the thread. True when nothing was left pending.

        Bounded: at most ``timeout`` seconds (default the spec's ``close_timeout``); at once when
        ``interrupted()`` turns true (a signal received during the close) or on Ctrl-C; and after one
        more round when the store cannot be reached (an outage: each request tried once). On a
        terminal, a progress line on stderr says what is being uploaded and that Ctrl-C leaves it
        pending; elsewhere only a final one-line summary when something was pending. What is left is
        recorded (``mirror_pending``) and named, with ``ripresa mirror push RUN``.
        """
        if self._closed:
            return True
        self._closed = True
        if self._thread is None:
            _release(self.store)  # the mirror's writer lock
            return True
        budget = self.spec.close_timeout if timeout is None else max(0.0, timeout)
        self._closing = True
        with self._lock:
            first = self._rounds  # a round numbered above it started after the close began
        self.notify()  # one round now, whatever the back-off
        t0, uploaded0 = time.monotonic(), len(self.uploaded)
        tty = _isatty()
        why: str | None = None
        waited = False
        last_draw = 0.0
        meter: Any = None  # the progress line (ripresa.console.progress), from the first draw
        task = 0
        planned = len(self._pending)
        ctrl_c: BaseException | None = None
        try:
            while True:
                with self._lock:
                    idle = not (self._dirty or self._busy)
                    done = idle and not self._pending
                    failed = idle and self._last_round[0] > first and not self._last_round[1]
                    pending = sorted(self._pending)
                if done:
                    break
                if self._thread is None or not self._thread.is_alive():
                    why = "the mirror's thread ended"
                    break
                if interrupted is not None and interrupted():
                    why = "interrupted"
                    break
                if failed:
                    why = "the store cannot be reached" + (f" ({self._last_error})" if self._last_error else "")
                    break
                if time.monotonic() - t0 >= budget:
                    why = f"close_timeout ({budget:g} s) reached"
                    break
                if budget > 0:
                    waited = True
                now = time.monotonic()
                if tty and now - last_draw >= 0.25 and budget > 0:
                    last_draw = now
                    meter, task, planned = self._draw(pending, meter, task, planned, len(self.uploaded) - uploaded0)
                with self._lock:
                    self._lock.wait(0.1)
        except KeyboardInterrupt as exc:  # no signal handler installed: Ctrl-C leaves the close at once
            why, ctrl_c = "interrupted", exc
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=0.5 if why is not None else self.spec.timeout + 5)
        _release(self.store)  # the mirror's writer lock
        left = self.pending
        if meter is not None:
            try:
                meter.stop()  # transient: the line is cleared
            except (OSError, ValueError):
                pass
        if why is not None:
            self._event("mirror_pending", steps=left, url=self.spec.url, reason=why,
                        note="not uploaded before the session ended; the next session (or `ripresa mirror push`) uploads them")
            what = f"step(s) {_steps_text(left)} pending" if left else "the run's newest history and sidecars not uploaded"
            _notice(f"ripresa: mirror: left {what} ({why}); they stay in {self.run_dir}; "
                    f"upload them with `ripresa mirror push {self.run_dir}`")
        elif waited and len(self.uploaded) > uploaded0:
            _notice(f"ripresa: mirror: uploaded step(s) {_steps_text(self.uploaded[uploaded0:])} to {self.spec.url} "
                    f"at the close ({time.monotonic() - t0:.1f} s)")
        if ctrl_c is not None:
            raise ctrl_c
        return why is None

    def _draw(self, pending: list[int], meter: Any, task: int, planned: int, done: int) -> tuple[Any, int, int]:
        """The close's progress line (ripresa.console.progress, the CLI's one style): generations uploaded of
        those pending when the close began, what is being done, that Ctrl-C leaves the rest pending."""
        from ..console import progress
        from ..text import escape_markup

        if self._outage is not None:
            what = f"waiting for the store ({self._outage['error'][:60]}), step(s) {_steps_text(pending, 4)} pending"
        else:
            cur = self._current if self._current is not None else (pending[0] if pending else None)
            what = f"uploading step {cur} ({len(pending)} pending)" if cur is not None else "uploading the run's files"
        text = escape_markup(f"ripresa: mirror: {what} — Ctrl-C to leave them pending and exit", newlines=False)
        in_flight = self._current is not None and self._current not in pending  # being uploaded, no longer pending
        planned = max(planned, done + len(pending) + in_flight)
        try:
            if meter is None:
                meter = progress(transient=True)
                meter.start()
                task = meter.add_task(text, total=planned, unit="uploaded")
            meter.update(task, description=text, total=planned, completed=done)
        except (OSError, ValueError):
            pass
        return meter, task, planned

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        failures = 0
        wait: float | None = None
        while not self._stop.is_set():
            self._wake.wait(timeout=wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                self._dirty, self._busy = False, True
                self._rounds += 1
                number = self._rounds
            ok = False
            try:
                self.round()
                ok = self._outage is None
            except _Stopped:
                return
            except Exception as exc:  # noqa: BLE001 - the thread never dies; the round is retried after a back-off
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
                if error != self._last_error:  # recorded once, not once per round
                    self._event("mirror_error", error=error, pending=self.pending,
                                note="an unexpected failure of a mirror round; retried with back-off")
                self._last_error = error
            finally:
                with self._lock:
                    self._busy = False
                    self._current = None
                    self._last_round = (number, ok)
                    self._lock.notify_all()
            failures = 0 if ok else failures + 1
            wait = None if ok else self._backoff(failures)

    def _backoff(self, failures: int) -> float:
        """The pause before the next round after ``failures`` failed rounds in a row: exponential, capped, jittered."""
        s = self.spec
        return max(MIN_ROUND_WAIT, min(s.max_backoff, s.backoff * 2 ** min(failures - 1, 30)) * _JITTER.uniform(0.5, 1.0))

    def _retry(self, step: int | None, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with back-off: ``attempts`` tries normally; one try during an outage (the rounds'
        own back-off spaces them) and for the first listing of a session (an unreachable store says so at once)."""
        s = self.spec
        once = self._outage is not None or (self._remote is None and what == "listing" and not self._closing)
        tries = 1 if once else s.attempts
        for attempt in range(1, tries + 1):
            if self._stop.is_set():
                raise _Stopped
            try:
                return fn()
            except (RemoteUnavailable, RemoteNotFound) as exc:
                self._failed_requests += 1
                if self._outage is not None:
                    self._outage["error"] = exc.message
                if attempt == tries:
                    raise RemoteUnavailable(exc.message, file=exc.file, found=exc.found) from None
                wait = min(s.max_backoff, s.backoff * 2 ** (attempt - 1)) * _JITTER.uniform(0.5, 1.5)
                if self._closing:
                    wait = min(wait, CLOSE_RETRY_WAIT)
                self._event("mirror_retry", step=step, object=what, attempt=attempt, error=exc.message,
                            found=None if exc.found is None else str(exc.found)[:200], wait=round(wait, 3))
                if self._stop.wait(wait):
                    raise _Stopped from None
        raise AssertionError("unreachable")

    def round(self) -> bool:
        """One pass: list the store (first time), clean half uploads, upload what is pending, apply remote
        retention, then the run's own files (:meth:`_push_run`). True when nothing is left pending. Also what ``ripresa mirror push`` runs."""
        failed_before = self._failed_requests
        uploaded_before = len(self.uploaded)
        local = local_generations(self.run_dir)
        self._plan(local)
        try:
            if self._remote is None:
                self._remote = RemoteView(self._retry(None, "listing", self.store.list))
                self._clean_half()
                self._plan(local)
            self._push_config()
            for step, main in self._order():
                self._upload(main, step)
                self._apply_remote_retention()
            pending = set(self.pending)
            for main, step in self._remote.half.items():  # our own cut-short uploads of what is no longer pending
                if step not in pending:
                    self._delete_group(main)
            self._push_run()
        except RemoteUnavailable as exc:
            self._outage_started(exc, failed_before, uploaded_before)
            return False
        self._last_error = None
        if self._outage is not None:
            self._recovered()
        self._plan(local_generations(self.run_dir))
        return not self._pending

    def _outage_started(self, exc: RemoteUnavailable, failed_before: int, uploaded_before: int) -> None:
        self._last_error = exc.message
        if self._outage is not None:
            return  # recorded once per outage: the count is in mirror_recovered
        self.outages += 1
        self._outage = {"t0": time.monotonic(), "since": round(time.time(), 3), "error": exc.message,
                        "first_error": exc.message, "failed_before": failed_before, "uploaded_before": uploaded_before}
        pending = self.pending
        self._event("mirror_outage", error=exc.message, found=None if exc.found is None else str(exc.found)[:200],
                    pending=pending, url=self.spec.url,
                    note="training goes on; the pending generations are kept locally and retried with back-off; "
                         "recorded once (mirror_recovered ends it)")
        if self._thread is None:
            return  # a single round (`ripresa mirror push`): its caller reports the failure
        kept = f"step(s) {_steps_text(pending)} pending are" if pending else "what is saved from now on is"
        _notice(f"ripresa: mirror {self.spec.url} cannot be reached ({exc.message}); training goes on, {kept} kept in "
                f"{self.run_dir} and uploaded when it is back (or with `ripresa mirror push {self.run_dir}`)")

    def _recovered(self) -> None:
        o, self._outage = self._outage, None
        assert o is not None
        seconds = round(time.monotonic() - o["t0"], 3)
        uploaded = self.uploaded[o["uploaded_before"]:]
        self._event("mirror_recovered", failed_attempts=self._failed_requests - o["failed_before"], seconds=seconds,
                    since=o["since"], error=o["first_error"], uploaded=uploaded, pending=self.pending, url=self.spec.url)
        _notice(f"ripresa: mirror {self.spec.url} reachable again after {seconds:.1f} s; uploaded step(s) "
                f"{_steps_text(uploaded) or 'none'}")

    def _plan(self, local: dict[str, int]) -> None:
        """Which local generations the remote still needs (those its policy would keep): pending, pinned locally."""
        remote = self._remote.committed if self._remote is not None else {}
        candidates = {m: s for m, s in local.items() if m not in remote and m not in self._refused}
        every = sorted(set(remote.values()) | set(candidates.values()))
        keep = self.policy.keep_scored(every, self.metrics()) | ({every[-1]} if every else set())
        for m, s in candidates.items():
            if s not in keep and m not in self._superseded:
                self._superseded.add(m)
                self._event("mirror_skipped", step=s, file=m, reason="remote retention would not keep it (newer ones are kept)")
        with self._lock:
            self._pending = {s for m, s in candidates.items() if s in keep}
            self._horizon = max([self._horizon, *local.values()])

    def _order(self) -> list[tuple[int, str]]:
        remote = self._remote.committed if self._remote is not None else {}
        local = local_generations(self.run_dir)
        with self._lock:
            pending = set(self._pending)
        return sorted((s, m) for m, s in local.items() if s in pending and m not in remote and m not in self._refused)

    def _push_config(self) -> None:
        cfg = self.run_dir / "config.json"
        if not os.path.lexists(cfg):
            return
        try:
            raw = read_small(cfg, "config.json", MAX_CONFIG)
            auth.check_run_file(cfg, raw, require=False)  # never re-sign a config.json whose own signature fails
        except RipresaError:
            return
        import hashlib

        sha = hashlib.sha256(raw).hexdigest()
        if sha != self._config_sha:
            key = auth.load_key()
            if key is not None:  # signed runs: its signature first, so a reader never pairs the new one with an old MAC
                sig = auth.file_signature_line(key, "config.json", raw)
                self._retry(None, CONFIG_SIG, lambda: self.store.put_bytes(CONFIG_SIG, sig))
            self._retry(None, "config.json", lambda: self.store.put_bytes("config.json", raw))
            self._config_sha = sha

    def _upload(self, main: str, step: int) -> None:
        t0 = time.perf_counter()
        try:
            raw = read_small(self.run_dir / (main + ".sha256"), "commit marker", MAX_MARKER, error=IntegrityError)
            files = marker_files(main, raw, str(self.run_dir / (main + ".sha256")))
            sig_path = self.run_dir / (main + auth.SUFFIX)
            sig = read_small(sig_path, "signature", auth.MAX_SIGNATURE, error=IntegrityError) if os.path.lexists(sig_path) else None
        except (IntegrityError, BadInput) as exc:
            self._refuse_local(main, step, exc)
            return
        assert self._remote is not None
        if main in self._remote.groups:  # a half upload of ours (an earlier round): its objects are overwritten
            pass
        total, done = 0, []
        self._current = step
        try:
            for sha, name in files:
                n = self._retry(step, name, lambda name=name, sha=sha: self.store.put_file(name, self.run_dir / name, sha256=sha))
                total += n
                done.append((name, n))
            if sig is not None:
                self._retry(step, main + auth.SUFFIX, lambda: self.store.put_bytes(main + auth.SUFFIX, sig))
                done.append((main + auth.SUFFIX, len(sig)))
        except (IntegrityError, BadInput) as exc:  # the local file changed after its commit, or vanished
            self._refuse_local(main, step, exc)
            return
        finally:
            self._remote.add(main, step, done)  # only what the store holds (nothing: the view is unchanged)
        self._retry(step, main + ".sha256", lambda: self.store.put_bytes(main + ".sha256", raw))
        self._remote.add(main, step, [(main + ".sha256", len(raw))])
        self.last_upload_seconds = time.perf_counter() - t0
        self.uploaded.append(step)
        with self._lock:
            self._pending.discard(step)
        self._event("mirror_uploaded", step=step, file=main, bytes=total, objects=len(done) + 1,
                    seconds=round(self.last_upload_seconds, 4), url=self.spec.url)

    def _push_run(self) -> None:
        """Upload the run's own files (docs/MIRROR.md "The run's own files"): the history bytes appended since the
        last segment (up to the last complete line) as new immutable segments, each changed sidecar as
        ``files/<sha256>``, then the manifest ``run.json`` **last**; then delete what it no longer names."""
        import hashlib

        assert self._remote is not None
        if self._run is None:
            self._run = self._load_run()
        old = self._run
        try:
            segments = self._new_segments(old)
        except (IntegrityError, BadInput, OSError):
            segments = list(old.history)  # a link or special file in place of the history: it is not read
        files: dict[str, tuple[str, int]] = {}
        try:
            local = local_run_files(self.run_dir)
        except OSError:
            local = {}
        for path, p in local.items():
            try:
                st = os.stat(p, follow_symlinks=False)
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
                known = self._run_cache.get(path)
                if known is not None and known[0] == stamp:
                    sha, n, raw = known[1], known[2], None
                else:
                    raw = read_small(p, path, MAX_RUN_FILE, error=IntegrityError)
                    sha, n = hashlib.sha256(raw).hexdigest(), len(raw)
            except (RipresaError, OSError):
                continue  # a link, a FIFO, too large, gone: not mirrored
            key = f"files/{sha}"
            if key not in self._remote.objects:
                if raw is None:
                    self._run_cache.pop(path, None)
                    continue  # changed since it was hashed: the next round reads it again
                self._retry(None, path, lambda key=key, raw=raw: self.store.put_bytes(key, raw))
                self._remote.objects[key] = n
            self._run_cache[path] = (stamp, sha, n)
            files[path] = (sha, n)
        man = RunManifest(segments, files)
        if man == old:
            return
        data = man.to_bytes()
        self._retry(None, RUN_MANIFEST, lambda: self.store.put_bytes(RUN_MANIFEST, data))
        self._remote.objects[RUN_MANIFEST] = len(data)
        self._run = man
        for key in sorted(old.keys() - man.keys()):  # replaced segments and sidecar versions: after the manifest
            self._retry(None, f"deletion of {key}", lambda key=key: self.store.delete(key))
            self._remote.objects.pop(key, None)

    def _new_segments(self, old: RunManifest) -> list[tuple[str, int, int, str]]:
        """The store's segments followed by those uploaded now: ``.loss.jsonl``'s bytes since the last one."""
        import hashlib

        assert self._remote is not None
        hist = self.run_dir / HISTORY_NAME
        size = _history_size(hist)
        segments = list(old.history)
        if segments and not self._run_checked:  # once a session: the store's history is this file's beginning
            key, start, end, sha = segments[-1]
            if size < end or hashlib.sha256(_read_range(hist, start, end)).hexdigest() != sha:
                segments = []  # another history (a folder started afresh): uploaded again, whole
        self._run_checked = True
        if len(segments) >= MAX_SEGMENTS:
            segments = []  # merged: the whole history again, in segments of up to MAX_SEGMENT bytes
        pos = segments[-1][2] if segments else 0
        while size > pos:
            data = _read_range(hist, pos, min(size, pos + MAX_SEGMENT))
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                break  # no complete line yet
            data = data[:cut]
            key = segment_key(pos, pos + cut)
            self._retry(None, key, lambda key=key, data=data: self.store.put_bytes(key, data))
            self._remote.objects[key] = cut
            segments.append((key, pos, pos + cut, hashlib.sha256(data).hexdigest()))
            pos += cut
        return segments

    def _load_run(self) -> RunManifest:
        """The store's run manifest (none, or malformed: an empty one, replaced at the next upload); objects under
        ``history/`` and ``files/`` it does not name (an upload cut short) are deleted."""
        assert self._remote is not None
        man = RunManifest([], {})
        where = f"{self.spec.url}/{RUN_MANIFEST}"
        if RUN_MANIFEST in self._remote.objects:
            try:
                raw = self._retry(None, RUN_MANIFEST, lambda: self.store.get_bytes(RUN_MANIFEST, limit=MAX_RUN_MANIFEST))
                man = RunManifest.parse(raw, where)
            except RemoteUnavailable:
                raise
            except IntegrityError as exc:
                self._event("mirror_refused", file=RUN_MANIFEST, url=self.spec.url, reason=exc.message,
                            found=None if exc.found is None else str(exc.found)[:200],
                            note="the run's files are uploaded again under a new manifest")
        named = man.keys()
        orphans = sorted(k for k in self._remote.objects if k.startswith(("history/", "files/")) and k not in named)
        for key in orphans:
            self._retry(None, f"deletion of {key}", lambda key=key: self.store.delete(key))
            self._remote.objects.pop(key, None)
        if orphans:
            self._event("mirror_cleaned", step=None, file="run files", objects=len(orphans),
                        reason="objects no manifest names (an upload cut short): removed by the next writer")
        return man

    def _refuse_local(self, main: str, step: int, exc: RipresaError) -> None:
        self._refused.add(main)
        with self._lock:
            self._pending.discard(step)
        self._event("mirror_skipped", step=step, file=main, reason=f"the local generation cannot be uploaded: {exc.message}",
                    found=None if exc.found is None else str(exc.found)[:200])

    def _delete_group(self, main: str) -> int:
        """Delete a remote generation's objects, its marker first (an interrupted deletion reads as uncommitted)."""
        assert self._remote is not None
        keys = sorted(self._remote.groups.get(main, set()), key=lambda k: (not k.endswith(".sha256"), k))
        for k in keys:
            self._retry(self._remote.steps.get(main), f"deletion of {k}", lambda k=k: self.store.delete(k))
        self._remote.drop(main)
        return len(keys)

    def _clean_half(self) -> None:
        assert self._remote is not None
        for main, step in sorted(self._remote.half.items(), key=lambda x: x[1]):
            n = self._delete_group(main)
            self._event("mirror_cleaned", step=step, file=main, objects=n,
                        reason="objects without a marker (an upload cut short): never used, removed by the next writer")

    def _apply_remote_retention(self) -> None:
        assert self._remote is not None
        committed = self._remote.committed
        steps = sorted(set(committed.values()))
        if not steps:
            return
        keep = self.policy.keep_scored(steps, self.metrics()) | {steps[-1]}
        for main, step in sorted(committed.items(), key=lambda x: x[1]):
            if step not in keep:
                self._delete_group(main)
                self._event("mirror_retention", step=step, file=main, policy=self.policy.spec)


# ---------------------------------------------------------------------------- opening


def open_mirror(mirror: Any, run_dir: Path, *, local_retention: RetentionPolicy,
                event: Callable[..., None] | None = None) -> Mirror:
    """A :class:`Mirror` from a URL, a path or a :class:`MirrorSpec` (a bad URL, missing credentials or
    boto3: :class:`~ripresa.errors.BadInput`, exit 2).

    The target must be a mirror (docs/MIRROR.md, "Trust"): a folder is checked and locked here, before the
    session starts (a run folder or a folder of other files: :class:`~ripresa.errors.BadInput`; another
    writer: :class:`~ripresa.errors.LockHeld`); an object store is checked before the first object is written,
    in the background (training never waits for the store). Every event is written redacted.
    """
    spec = mirror if isinstance(mirror, MirrorSpec) else MirrorSpec(os.fspath(mirror))
    target = MirrorTarget(open_store(spec.url, timeout=spec.timeout), explicit=True)
    if isinstance(target.inner, LocalStore):
        try:
            target.claim()
        except RemoteUnavailable:
            pass  # a folder that cannot be reached now (an NFS mount down): checked before the first write instead
    try:
        return Mirror(spec, run_dir, local_retention=local_retention, event=redacting(event), store=target)
    except BaseException:
        target.release()
        raise


def redacting(event: Callable[..., None] | None) -> Callable[..., None] | None:
    """``event`` with every string field redacted (:func:`ripresa.io.redact.redact`): no credential reaches the history."""
    if event is None:
        return None

    def write(name: str, **fields: Any) -> None:
        event(name, **redact_fields(fields))

    return write


def _release(store: Any) -> None:
    release = getattr(store, "release", None)
    if release is not None:
        release()


def _run_record_key(name: str) -> bool:
    """An object of the run's own record (its manifest, history segments, side files), or a folder of them."""
    return name in (RUN_MANIFEST, "history", "files") or bool(_SEGMENT.fullmatch(name) or _FILE_KEY.fullmatch(name))


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
                _release(self.inner)

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


# ---------------------------------------------------------------------------- pulling


_PULL = MirrorSpec("", attempts=4, backoff=0.25, max_backoff=8.0)


def _retrying(fn: Callable[[], Any], event: Callable[..., None] | None = None, what: str = "",
              spec: MirrorSpec = _PULL) -> Any:
    for attempt in range(1, spec.attempts + 1):
        try:
            return fn()
        except RemoteUnavailable as exc:
            if attempt == spec.attempts:
                raise
            wait = min(spec.max_backoff, spec.backoff * 2 ** (attempt - 1)) * _JITTER.uniform(0.5, 1.5)
            if event is not None:
                event("mirror_retry", step=None, object=what, attempt=attempt, error=exc.message, wait=round(wait, 3))
            time.sleep(wait)
    raise AssertionError("unreachable")


def _fetch(remote: ObjectStore, name: str, target: Path, limit: int, sha: str, event: Callable[..., None],
           spec: MirrorSpec) -> StagedFile:
    """Object ``name`` streamed into a temporary sibling of ``target`` (at most ``limit`` bytes), fsync'd,
    its sha256 compared with the marker's; the caller publishes it. A failed try starts a new temporary."""
    for attempt in range(1, spec.attempts + 1):
        sf = StagedFile(target)
        try:
            remote.get_into(name, sf, limit=limit)
            d = sf.finish()
        except RemoteUnavailable as exc:
            sf.discard()
            if attempt == spec.attempts:
                raise
            wait = min(spec.max_backoff, spec.backoff * 2 ** (attempt - 1)) * _JITTER.uniform(0.5, 1.5)
            event("mirror_retry", step=None, object=name, attempt=attempt, error=exc.message, wait=round(wait, 3))
            time.sleep(wait)
            continue
        except BaseException:
            sf.discard()
            raise
        if d.sha256 != sha:
            sf.discard()
            raise IntegrityError("a remote object differs from its marker", file=f"{remote.url}/{name}",
                                 expected=sha, found=d.sha256,
                                 hint="it was changed in the store; an older remote generation is used")
        return sf
    raise AssertionError("unreachable")


def _land(remote: ObjectStore, view: RemoteView, run_dir: Path, main: str, step: int, ckpt: CheckpointStore,
          event: Callable[..., None], spec: MirrorSpec) -> Generation:
    """Download ``main`` into ``run_dir`` through the local commit protocol, marker last; deep-check it there."""
    names = spec_of(kind_of(main)).naming
    backend = backend_of(kind_of(main), ckpt)
    where = f"{remote.url}/{main}.sha256"
    raw = _retrying(lambda: remote.get_bytes(main + ".sha256", limit=MAX_MARKER), event=event, what=main + ".sha256", spec=spec)
    files = marker_files(main, raw, where)
    missing = [n for _, n in files if n not in view.objects]
    if missing:
        raise IntegrityError("the marker names objects the mirror does not hold", file=where, expected=missing[:4],
                             found="missing")
    sig_key = main + auth.SUFFIX
    if ckpt.require_signature and sig_key not in view.objects:
        raise auth.SignatureError("the remote generation is not signed, and signatures are required", file=where,
                                  expected=f"{sig_key} beside the marker", found="nothing",
                                  hint="only generations saved with the key are trusted")
    need = sum(view.objects[n] for _, n in files)
    free = shutil.disk_usage(run_dir).free
    if need > free:
        raise SaveFailed("not enough disk space to pull the generation", file=run_dir, expected=f"{need} bytes free",
                         found=f"{free} bytes free")
    if os.path.lexists(run_dir / (main + ".sha256")):
        local = backend.check(step, deep=True)
        if local.valid:
            return local  # already here and intact: nothing to download
    if os.path.lexists(run_dir / (main + ".sha256")) or os.path.lexists(run_dir / main):
        backend.delete(step)  # a local generation of that step that failed its checks: replaced (marker first)
    partial = run_dir / names.partial_name(step) if names.folder else None
    if partial is not None:
        if partial.exists():
            ops.rmtree(partial)
        partial.mkdir()
    staged: list[StagedFile] = []
    try:
        for sha, name in files:
            target = run_dir / name if partial is None else partial / name.split("/", 1)[1]
            staged.append(_fetch(remote, name, target, view.objects[name], sha, event, spec))
        for sf in staged:
            sf.publish()
        if partial is not None:
            fsync_dir(partial)
            ops.rename(partial, run_dir / main)
            partial = None
        fsync_dir(run_dir)
    finally:
        for sf in staged:
            sf.discard()
        if partial is not None and partial.exists():
            ops.rmtree(partial)
    if sig_key in view.objects:
        sig = _retrying(lambda: remote.get_bytes(sig_key, limit=auth.MAX_SIGNATURE), event=event, what=sig_key, spec=spec)
        write_atomic(run_dir / sig_key, [sig])
    write_atomic(run_dir / (main + ".sha256"), [raw])  # the commit marker, last
    gen = backend.check(step, deep=True)
    if not gen.valid:
        backend.delete(step)
        fsync_dir(run_dir)
        raise IntegrityError(f"the pulled generation fails its checks: {gen.reason}", file=where,
                             hint="an older remote generation is used")
    return gen


def pull(remote: ObjectStore, run_dir: Path, ckpt: CheckpointStore, *, step: int | None = None,
         kinds: Iterable[str] = PULL_KINDS, event: Callable[..., None] | None = None,
         spec: MirrorSpec = _PULL) -> Generation | None:
    """Land the newest remote generation (or ``step``'s) whose marker verifies; None when the store holds none.

    Each one that fails (a flipped byte, a bad or missing signature under
    require-signature, a malformed marker) is recorded as ``mirror_refused``
    and the previous one is tried; when committed remote generations exist but
    none verifies: :class:`~ripresa.errors.CheckFailed` (exit 1).
    """
    ev = event or (lambda name, **kw: None)
    kinds = tuple(spec_of(k).kind for k in kinds)  # an old name ("st") reads as its kind's
    view = RemoteView(_retrying(remote.list, event=ev, what="listing", spec=spec))

    def order(kind: str) -> int:
        return PULL_KINDS.index(kind) if kind in PULL_KINDS else len(PULL_KINDS)

    cands = sorted(((s, m) for m, s in view.committed.items() if kind_of(m) in kinds and (step is None or s == step)),
                   key=lambda x: (-x[0], order(kind_of(x[1]))))
    refused: list[str] = []
    for s, main in cands:
        try:
            gen = _land(remote, view, Path(run_dir), main, s, ckpt, ev, spec)
        except IntegrityError as exc:
            msg = f"{main}: {exc.message}" + (f" (found {str(exc.found)[:80]})" if exc.found is not None else "")
            refused.append(msg)
            ev("mirror_refused", step=s, file=main, reason=msg, url=remote.url)
            continue
        ev("mirror_pulled", step=s, file=main, url=remote.url)
        return gen
    if refused:
        raise CheckFailed(f"none of the {len(refused)} remote generation(s) verifies", file=remote.url,
                          expected="a generation whose objects match its marker (and signature, when required)",
                          found="; ".join(refused[:3])[:600], hint="`ripresa mirror status RUN --mirror URL` lists them")
    if step is not None:
        raise BadInput(f"the mirror holds no committed generation of step {step}", file=remote.url,
                       expected=sorted(view.committed.values())[-8:], found=step)
    return None


def _last_step(data: bytes) -> int | None:
    """The step of the last step line (not an event) in ``data`` (whole lines of a history)."""
    import json

    for line in reversed(data.splitlines()[-4096:]):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and "event" not in obj and isinstance(obj.get("step"), int) \
                and not isinstance(obj["step"], bool):
            return obj["step"]
    return None


def restore_run(remote: ObjectStore, run_dir: Path, *, event: Callable[..., None] | None = None,
                spec: MirrorSpec = _PULL) -> dict[str, Any] | None:
    """On a blank machine: the run's history and sidecars as the store last held them (docs/MIRROR.md).

    The history is restored only into an empty (or missing) ``.loss.jsonl``:
    its segments are downloaded in order, each bounded by its manifest size
    and compared with its sha256 before it is appended; the first that fails
    ends the restore there (what was appended is whole lines). Each sidecar is
    written (atomically, inside the run folder, never through a link) only
    when the folder lacks it, and only when its bytes have the manifest's
    sha256. A missing manifest: None; a malformed one: recorded
    (``mirror_refused``) and nothing restored. Returns what was restored.
    """
    import hashlib

    ev = event or (lambda name, **kw: None)
    run_dir = Path(run_dir)
    where = f"{remote.url}/{RUN_MANIFEST}"
    try:
        raw = _retrying(lambda: remote.get_bytes(RUN_MANIFEST, limit=MAX_RUN_MANIFEST), event=ev, what=RUN_MANIFEST,
                        spec=spec)
        man = RunManifest.parse(raw, where)
    except RemoteNotFound:
        return None
    except IntegrityError as exc:  # too large, malformed
        ev("mirror_refused", file=RUN_MANIFEST, url=remote.url, reason=exc.message,
           found=None if exc.found is None else str(exc.found)[:200])
        return None

    def fetch(key: str, size: int, sha: str) -> bytes:
        data = _retrying(lambda: remote.get_bytes(key, limit=size), event=ev, what=key, spec=spec)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise IntegrityError("a remote run file differs from its manifest", file=f"{remote.url}/{key}",
                                 expected=f"{size} bytes, sha256 {sha}",
                                 found=f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
        return data

    done: dict[str, Any] = {"history_bytes": 0, "segments": 0, "through_step": None, "files": [], "refused": []}
    hist = run_dir / HISTORY_NAME
    if man.history and _history_size(hist) == 0:
        free = shutil.disk_usage(run_dir).free
        if man.history_end > free:
            raise SaveFailed("not enough disk space to pull the run's history", file=run_dir,
                             expected=f"{man.history_end} bytes free", found=f"{free} bytes free")
        fd = open_run_file(hist, "history (.loss.jsonl)", mode="create_append")
        try:
            for key, start, end, sha in man.history:
                try:
                    data = fetch(key, end - start, sha)
                except (IntegrityError, RemoteNotFound) as exc:
                    done["refused"].append(key)
                    ev("mirror_refused", file=key, url=remote.url, reason=exc.message,
                       note="the history is restored up to the segment before it")
                    break
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                done["history_bytes"] += len(data)
                done["segments"] += 1
                done["through_step"] = _last_step(data) if _last_step(data) is not None else done["through_step"]
            os.fsync(fd)
        finally:
            os.close(fd)
    for path, (sha, size) in sorted(man.files.items()):
        target = run_dir / path
        if os.path.lexists(target) or path == "config.json":
            continue  # the folder's own copy stays; config.json lands only through pull_config (its signature)
        try:
            data = fetch(f"files/{sha}", size, sha)
            _safe_parent(run_dir, path)
            write_atomic(target, [data])
        except (IntegrityError, RemoteNotFound) as exc:
            done["refused"].append(path)
            ev("mirror_refused", file=path, url=remote.url, reason=exc.message)
            continue
        done["files"].append(path)
    if not done["segments"] and not done["files"]:
        return None
    return done


def pull_run(remote: ObjectStore, run_dir: Path, ckpt: CheckpointStore, *, step: int | None = None,
             kinds: Iterable[str] = PULL_KINDS, event: Callable[..., None] | None = None,
             spec: MirrorSpec = _PULL) -> Generation | None:
    """A blank machine's resume from the mirror: :func:`restore_run` (history, sidecars, config.json), then
    :func:`pull` (the newest verified generation); a ``history_restored`` event says what came back and from
    which step training goes on."""
    ev = event or (lambda name, **kw: None)
    restored = restore_run(remote, Path(run_dir), event=ev, spec=spec)
    gen = pull(remote, Path(run_dir), ckpt, step=step, kinds=kinds, event=ev, spec=spec)
    if restored is not None:
        ev("history_restored", url=remote.url, bytes=restored["history_bytes"], segments=restored["segments"],
           through_step=restored["through_step"], pulled_step=None if gen is None else gen.step,
           files=restored["files"], refused=restored["refused"],
           note="the run's history as the mirror held it; steps after the pulled generation are trained again and "
                "their new lines (the last line per step) are canonical")
    return gen


def pull_config(remote: ObjectStore, run_dir: Path, *, require: bool | None = None) -> bool:
    """Fetch ``config.json`` into ``run_dir`` when it has none (a blank machine); True when fetched.

    With the run's key configured, a signed one (``config.json.hmac`` beside it) must verify
    (:class:`~ripresa.io.auth.SignatureError` otherwise, exit 1); under require-signature (``require``, by
    default ``RIPRESA_REQUIRE_SIGNATURE``) an unsigned one is refused too, and nothing is written.
    """
    dst = Path(run_dir) / "config.json"
    if os.path.lexists(dst):
        return False
    try:
        raw = _retrying(lambda: remote.get_bytes("config.json", limit=MAX_CONFIG), what="config.json")
    except RemoteNotFound:
        return False
    try:
        sig: bytes | None = _retrying(lambda: remote.get_bytes(CONFIG_SIG, limit=auth.MAX_SIGNATURE), what=CONFIG_SIG)
    except RemoteNotFound:
        sig = None
    key = auth.load_key()
    require = auth.require_signature_from_env() if require is None else require
    where = f"{redact_url(remote.url)}/config.json"
    if sig is not None and key is not None:
        auth.verify_file(key, sig, "config.json", raw, where + auth.SUFFIX)
    elif require:
        raise auth.SignatureError(
            "the mirror's config.json is not signed, and signatures are required", file=where,
            expected=f"{CONFIG_SIG} beside it, made with the run's key" if key is not None else "the run's key configured",
            found="no signature" if sig is None else "no key to check its signature",
            hint="give the config explicitly (`ripresa train --config FILE`), or drop --require-signature to use it "
            "knowingly")
    if sig is not None:  # the run folder's copy stays signed (a resume checks it: docs/FAULTS.md, "Trust model")
        write_atomic(dst.with_name(dst.name + auth.SUFFIX), [sig])
    write_atomic(dst, [raw])
    return True


def has_local_generation(run_dir: Path) -> bool:
    """True when the run folder holds a committed generation (any kind) that passes its checks."""
    if not Path(run_dir).is_dir():
        return False
    store = CheckpointStore(run_dir, writer=False)
    for main, step in local_generations(run_dir).items():
        if backend_of(kind_of(main), store).check(step).valid:
            return True
    return False


def status(remote: ObjectStore, run_dir: Path) -> dict[str, Any]:
    """What is where: local committed generations, remote committed and half-uploaded ones, what is missing."""
    from ..io.lock import is_locked

    local = local_generations(run_dir)
    view = RemoteView(remote.list())
    committed = view.committed
    missing = sorted(s for m, s in local.items() if m not in committed)
    running = Path(run_dir).is_dir() and is_locked(run_dir)
    return {
        "run": str(run_dir), "url": remote.url,
        "local": sorted(local.values()),
        "remote": sorted(committed.values()),
        "remote_files": {m: sorted(view.groups[m]) for m in sorted(committed, key=committed.get)},
        "half_uploaded": sorted(view.half.values()),
        "pending": missing,
        "trainer_running": running,
        "config_remote": "config.json" in view.objects,
        "run_manifest": RUN_MANIFEST in view.objects,
        "history_bytes": sum(n for k, n in view.objects.items() if _SEGMENT.fullmatch(k)),
    }


# ---------------------------------------------------------------------------- ripresa train / ripresa mirror


def _resolve_url(run_dir: Path, url: str | None, *, write: bool = False) -> tuple[str, bool]:
    """(the mirror URL, whether it is explicit): ``--mirror``, else ``RUN/mirror.json``'s (docs/MIRROR.md, "Trust").

    A recorded URL is explicit when the record is authenticated by the configured key. With a key, a writing
    command (``push``) refuses a record that is not; without one, the URL is used only for a target that is
    already a mirror (:func:`claim_target`).
    """
    if url:
        return url, True
    rec, authentic = recorded(run_dir)
    if not rec:
        raise BadInput("no mirror URL", file=Path(run_dir) / MIRROR_RECORD, expected="--mirror URL",
                       found="no --mirror and no mirror.json in the run folder",
                       hint="ripresa mirror status RUN --mirror s3://bucket/prefix")
    if write and not authentic and auth.load_key() is not None:
        raise BadInput("the run's mirror.json is not authenticated by the run's key: not followed", file=Path(run_dir) / MIRROR_RECORD,
                       expected="a record written by a session holding the key (its MAC)", found=f"a record naming {redact_url(rec)}",
                       hint="name the mirror explicitly: ripresa mirror push RUN --mirror URL")
    return rec, authentic


class _Metered:
    """An object store whose transfers move a progress line (``ripresa mirror push``/``pull`` on a terminal:
    ripresa.console.progress): bytes moved so far, and the object being moved. Everything else passes through."""

    def __init__(self, inner: Any, verb: str) -> None:
        from ..console import progress

        self._inner, self._verb = inner, verb
        self._bar = progress("bytes", transient=True)
        self._task = self._bar.add_task(f"mirror {verb}: listing {redact_url(inner.url)}", total=None)

    def __enter__(self) -> _Metered:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.__exit__(*exc)

    def _show(self, key: str) -> None:
        from ..text import escape_markup

        self._bar.update(self._task, description=escape_markup(f"mirror {self._verb}: {key}", newlines=False))

    def put_file(self, key: str, path: Path, *, sha256: str) -> int:
        self._show(key)
        n = self._inner.put_file(key, path, sha256=sha256)
        self._bar.advance(self._task, os.stat(path, follow_symlinks=False).st_size)
        return n

    def get_into(self, key: str, out: Any, *, limit: int) -> int:
        self._show(key)
        bar, task = self._bar, self._task

        class Counted:
            def write(self, data: Any) -> Any:
                n = out.write(data)
                bar.advance(task, len(data))
                return n

            def __getattr__(self, name: str) -> Any:
                return getattr(out, name)

        return self._inner.get_into(key, Counted(), limit=limit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _pull_into(run_dir: Path, remote: ObjectStore, step: int | None) -> tuple[Generation | None, bool]:
    """Land a remote generation (and config.json when missing) in ``run_dir`` under its writer lock."""
    from .history import HISTORY_NAME, History

    store = CheckpointStore(run_dir, writer=True)
    try:
        hist = History(Path(run_dir) / HISTORY_NAME)
        try:
            event = redacting(hist.event)
            gen = pull_run(remote, Path(run_dir), store, step=step, event=event)
            config = pull_config(remote, Path(run_dir), require=store.require_signature) if gen is not None else False
        finally:
            hist.close()
    finally:
        store.close()
    return gen, config


def prefetch(run_dir: Path, url: Any) -> Generation | None:
    """``ripresa train --run DIR --mirror URL``: on a blank machine (no local generation that passes its checks),
    pull the newest verified remote generation and ``config.json`` before the config is resolved."""
    if has_local_generation(Path(run_dir)):
        return None
    spec = url if isinstance(url, MirrorSpec) else MirrorSpec(os.fspath(url))
    with _Metered(open_store(spec.url, timeout=spec.timeout), "pull") as remote:  # progress on a terminal
        gen, _ = _pull_into(Path(run_dir), remote, None)  # type: ignore[arg-type]
    return gen


def cli_status(run_dir: Path, url: str | None) -> dict[str, Any]:
    """``ripresa mirror status``."""
    r = status(open_store(_resolve_url(run_dir, url)[0]), Path(run_dir))
    return {**r, "url": redact_url(r["url"])}


def cli_push(run_dir: Path, url: str | None, keep: RetentionPolicy | None = None) -> dict[str, Any]:
    """``ripresa mirror push``: upload what the mirror lacks (under the run's writer lock), one round."""
    from .history import HISTORY_NAME, History
    from .retention import DEFAULT_RETENTION

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BadInput("run folder not found", file=run_dir, expected="an existing run folder", found="nothing")
    resolved, explicit = _resolve_url(run_dir, url, write=True)
    spec = MirrorSpec(resolved, keep=keep)
    store = CheckpointStore(run_dir, writer=True)
    try:
        with _Metered(open_store(spec.url, timeout=spec.timeout), "push") as metered:  # progress on a terminal
            target = MirrorTarget(metered, explicit=explicit)  # type: ignore[arg-type]
            try:
                _retrying(target.claim, what=MIRROR_MARKER)  # a mirror, locked, before anything is written
                hist = History(run_dir / HISTORY_NAME)
                try:
                    m = Mirror(spec, run_dir, local_retention=DEFAULT_RETENTION, event=redacting(hist.event),
                               store=target)
                    ok = m.round()
                finally:
                    hist.close()
            finally:
                target.release()
    finally:
        store.close()
    if not ok:
        raise SaveFailed("the push did not complete: the mirror could not be reached (retries in RUN/.loss.jsonl)",
                         file=redact_url(spec.url), expected="every missing generation uploaded", found=f"pending {m.pending}",
                         hint="run `ripresa mirror push` again when the store is reachable")
    return {"run": str(run_dir), "url": redact_url(spec.url), "uploaded": m.uploaded, "pending": m.pending}


def cli_pull(run_dir: Path, url: str | None, step: int | None = None) -> dict[str, Any]:
    """``ripresa mirror pull``: land a verified remote generation in RUN (for inspection or export)."""
    url = _resolve_url(run_dir, url)[0]
    with _Metered(open_store(url), "pull") as remote:  # progress on a terminal
        gen, config = _pull_into(Path(run_dir), remote, step)  # type: ignore[arg-type]
    if gen is None:
        raise CheckFailed("the mirror holds no committed generation", file=redact_url(url),
                          expected="at least one marker object", found="none")
    return {"run": str(run_dir), "url": redact_url(url), "step": gen.step, "file": gen.path.name, "config": config}
