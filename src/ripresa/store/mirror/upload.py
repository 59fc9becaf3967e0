"""The mirror's upload thread (docs/MIRROR.md).

A :class:`Mirror`'s background thread (never the training thread) uploads each committed generation it lacks,
every file re-hashed against its local marker, **the marker object last**, then the run record; failures are
retried with jittered back-off, outages recorded once, pending generations pinned against local retention
(:meth:`Mirror.pinned`). :func:`open_mirror` is how a session starts one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ...console import joined
from ...errors import BadInput, IntegrityError, RipresaError
from ...formats.generation import Generation
from ...io import auth
from ...io.fsio import open_run_file, read_small
from ...io.objstore import LocalStore, ObjectStore, RemoteNotFound, RemoteUnavailable, open_store
from ..history import HISTORY_NAME
from ..kinds import generation_files
from ..retention import KeepAny, KeepLast, RetentionPolicy
from ..store import CheckpointStore
from .contract import MirrorContract
from .layout import (
    CONFIG_SIG,
    JITTER,
    MAX_CONFIG,
    MAX_MARKER,
    MAX_RUN_FILE,
    MAX_RUN_MANIFEST,
    MAX_SEGMENT,
    MAX_SEGMENTS,
    RUN_MANIFEST,
    MirrorSpec,
    RemoteView,
    RunManifest,
    history_size,
    local_generations,
    local_run_files,
    segment_key,
)
from .plan import LocalGeneration, UploadPlan, duration_text, plan_upload, size_text
from .pull import pull
from .retry import Retry, Stopped
from .target import MirrorTarget, redacting, release_store


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


def _read_range(path: Path, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a run file (opened without following a link; shorter if the file is)."""
    from ...io.fsio import CHUNK

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


class _Stopped(Exception):
    """The mirror is being closed: leave the round now."""


#: During :meth:`Mirror.close`, the longest wait between two tries of a request (seconds): the close stays short.
CLOSE_RETRY_WAIT = 1.0
#: The shortest pause between two rounds after a failed one (seconds), whatever ``MirrorSpec.backoff`` says.
MIN_ROUND_WAIT = 0.05
#: While a normal end waits for a store that cannot be reached (``close(wait=True)``), the longest pause between
#: two rounds (seconds): a store that comes back is noticed within it (docs/MIRROR.md, "The close").
FINAL_ROUND_WAIT = 5.0
#: While a normal end waits, off a terminal, a line on stderr this often (seconds): a log shows the wait.
WAIT_NOTICE_EVERY = 60.0


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
    return joined(steps, limit=most)  # the first ``most``, then "... N more" (ripresa.console.capped)


class Mirror(MirrorContract):
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
        #: False on a run whose generations are committed in the store by the nodes themselves
        #: (docs/DISTRIBUTED.md): the thread then keeps only the run's own files (history, config) in the store.
        self.generations = True
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
        self._refused: dict[str, str] = {}  # main -> why it cannot be uploaded (recorded once)
        self._superseded: set[str] = set()
        self._checked: dict[str, LocalGeneration] = {}  # the plan's cache of local markers
        self._last_plan = UploadPlan()
        self._plan_bytes: dict[int, int] = {}  # step -> bytes to upload, from the last plan
        #: Hash every file against its marker when planning (``ripresa mirror push``: the plan ``mirror status``
        #: prints); the trainer's thread leaves it to the upload, which hashes as it reads.
        self.deep = False
        #: Told ``(name, bytes)`` of each piece a deep plan hashes (``mirror push``'s progress line), or None.
        self.hashed: Callable[[str, int], None] | None = None
        self._waiting = False  # a normal end waits for the store (close(wait=True))
        self._failure: str | None = None  # what ended the last failed round: "store" (an outage) or "error"
        #: After :meth:`close`: why something was left pending (None: nothing was), and the seconds the close took.
        self.close_reason: str | None = None
        self.close_seconds = 0.0
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
        if not self.generations:
            return set()
        with self._lock:
            return {s for s in valid if s in self._pending or s > self._horizon}

    @property
    def pending(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    @property
    def pending_bytes(self) -> int:
        """The bytes of the pending generations (files, signatures, markers), from the last plan."""
        with self._lock:
            return sum(n for s, n in self._plan_bytes.items() if s in self._pending)

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

    def close(self, timeout: float | None = None, *, interrupted: Callable[[], bool] | None = None,
              wait: bool = False, label: str = "close_timeout") -> bool:
        """Upload what is pending, then stop the thread. True when nothing was left pending.

        Bounded: at most ``timeout`` seconds (default the spec's ``close_timeout``); at once when
        ``interrupted()`` turns true (a signal received during the close) or on Ctrl-C. When the store
        cannot be reached: with ``wait`` (a normal end: the final state must get off the machine) it is
        waited for while generations are pending, rounds retried at most :data:`FINAL_ROUND_WAIT` apart,
        up to ``timeout`` (``label`` names that bound in the messages); without it (after a stop:
        SIGTERM, a preemption) one more round is given (each request tried once) and the close leaves.
        On a terminal, a progress line on stderr says what is being uploaded or waited for and that
        Ctrl-C leaves it pending; elsewhere a line when a wait for the store begins, one a minute while
        it lasts, and a final one-line summary. What is left is recorded (``mirror_pending``) and named,
        with ``ripresa mirror push RUN`` (:attr:`close_reason` says why; :attr:`close_seconds` how long).
        """
        if self._closed:
            return True
        self._closed = True
        if self._thread is None:
            release_store(self.store)  # the mirror's writer lock
            return True
        budget = self.spec.close_timeout if timeout is None else max(0.0, timeout)
        self._closing = True
        self._waiting = bool(wait) and budget > 0
        with self._lock:
            first = self._rounds  # a round numbered above it started after the close began
        self.notify()  # one round now, whatever the back-off
        t0, uploaded0 = time.monotonic(), len(self.uploaded)
        tty = _isatty()
        why: str | None = None
        waited = False
        waiting_since: float | None = None  # when the wait for an unreachable store began
        last_notice = 0.0
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
                now = time.monotonic()
                if failed and not (self._waiting and pending and self._failure == "store"):
                    why = "the store cannot be reached" + (f" ({self._last_error})" if self._last_error else "")
                    break
                if failed and waiting_since is None:  # a normal end waits for the store: said once, then each minute
                    waiting_since = last_notice = now
                    self._wait_notice(pending, budget, 0.0, first=True)
                    self._event("mirror_final_wait", steps=pending, bytes=self.pending_bytes, url=self.spec.url,
                                error=self._last_error, bound_s=round(budget, 3), bound=label,
                                note="a normal end waits for the store before it ends; SIGTERM or Ctrl-C leaves the "
                                     "generations pending")
                elif waiting_since is not None and not tty and now - last_notice >= WAIT_NOTICE_EVERY:
                    last_notice = now
                    self._wait_notice(pending, budget, now - t0, first=False)
                if now - t0 >= budget:
                    why = (f"the store could not be reached within {label} ({budget:g} s)" if waiting_since is not None
                           else f"{label} ({budget:g} s) reached")
                    break
                if budget > 0:
                    waited = True
                if tty and now - last_draw >= 0.25 and budget > 0:
                    last_draw = now
                    meter, task, planned = self._draw(pending, meter, task, planned, len(self.uploaded) - uploaded0,
                                                      left=budget - (now - t0) if waiting_since is not None else None)
                with self._lock:
                    self._lock.wait(0.1)
        except KeyboardInterrupt as exc:  # no signal handler installed: Ctrl-C leaves the close at once
            why, ctrl_c = "interrupted", exc
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=0.5 if why is not None else self.spec.timeout + 5)
        release_store(self.store)  # the mirror's writer lock
        left = self.pending
        self.close_reason, self.close_seconds = why, time.monotonic() - t0
        if meter is not None:
            try:
                meter.stop()  # transient: the line is cleared
            except (OSError, ValueError):
                pass
        if why is not None:
            self._event("mirror_pending", steps=left, url=self.spec.url, reason=why, bytes=self.pending_bytes,
                        seconds=round(self.close_seconds, 3),
                        note="not uploaded before the session ended; the next session (or `ripresa mirror push`) uploads them")
            what = f"step(s) {_steps_text(left)} pending" if left else "the run's newest history and sidecars not uploaded"
            _notice(f"ripresa: mirror: left {what} ({why}); they stay in {self.run_dir}; "
                    f"upload them with `{self.push_command()}`")
        elif waited and len(self.uploaded) > uploaded0:
            _notice(f"ripresa: mirror: uploaded step(s) {_steps_text(self.uploaded[uploaded0:])} to {self.spec.url} "
                    f"at the close ({time.monotonic() - t0:.1f} s)")
        if ctrl_c is not None:
            raise ctrl_c
        return why is None

    def push_command(self) -> str:
        """The command that uploads what this mirror left pending, as a person types it (quoted for a shell)."""
        import shlex

        return f"ripresa mirror push {shlex.quote(str(self.run_dir))} --mirror {shlex.quote(self.spec.url)}"

    def _wait_notice(self, pending: list[int], budget: float, waited: float, *, first: bool) -> None:
        """A line on stderr while a normal end waits for the store (the start, then one a minute off a terminal)."""
        what = f"step(s) {_steps_text(pending)} ({size_text(self.pending_bytes)})"
        error = f" ({self._last_error[:80]})" if self._last_error else ""
        if first:
            _notice(f"ripresa: mirror: {self.spec.url} cannot be reached{error}; waiting up to {duration_text(budget)} "
                    f"to upload {what} before the run ends — SIGTERM or Ctrl-C leaves them pending")
        else:
            _notice(f"ripresa: mirror: still waiting for {self.spec.url}{error}: {duration_text(waited)} of "
                    f"{duration_text(budget)}, {what} pending")

    def _draw(self, pending: list[int], meter: Any, task: int, planned: int, done: int, *,
              left: float | None = None) -> tuple[Any, int, int]:
        """The close's progress line (ripresa.console.progress, the CLI's one style): generations uploaded of
        those pending when the close began, what is being done (or waited for: the store, the bytes pending, the
        time left), that Ctrl-C leaves the rest pending. The time waited is the line's elapsed time."""
        from ...console import progress
        from ...text import escape_markup

        if self._outage is not None:
            bound = f", {duration_text(left)} left" if left is not None else ""
            what = (f"waiting for the store {self.spec.url} ({self._outage['error'][:60]}), step(s) "
                    f"{_steps_text(pending, 4)} pending ({size_text(self.pending_bytes)}){bound}")
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
                self._failure = None if ok else "store"
            except _Stopped:
                return
            except Exception as exc:  # noqa: BLE001 - the thread never dies; the round is retried after a back-off
                self._failure = "error"
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
        cap = min(s.max_backoff, FINAL_ROUND_WAIT) if self._waiting else s.max_backoff  # a normal end's wait
        return max(MIN_ROUND_WAIT, min(cap, s.backoff * 2 ** min(failures - 1, 30)) * JITTER.uniform(0.5, 1.0))

    def _retry(self, step: int | None, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried by the mirror's back-off policy (:class:`~ripresa.store.mirror.retry.Retry`):
        ``attempts`` tries normally; one try during an outage (the rounds' own back-off spaces them) and for the
        first listing of a session (an unreachable store says so at once); a close's waits capped; a stop ends it."""
        once = self._outage is not None or (self._remote is None and what == "listing" and not self._closing)

        def failed(exc: RipresaError) -> None:
            self._failed_requests += 1
            if self._outage is not None:
                self._outage["error"] = exc.message

        try:
            return Retry.of(self.spec).call(fn, what=what, step=step, event=self._event, once=once,
                                            retry_on=(RemoteUnavailable, RemoteNotFound), failed=failed,
                                            stop=self._stop, cap=lambda: CLOSE_RETRY_WAIT if self._closing else None)
        except Stopped:
            raise _Stopped from None
        except (RemoteUnavailable, RemoteNotFound) as exc:
            raise RemoteUnavailable(exc.message, file=exc.file, found=exc.found) from None

    def round(self) -> bool:
        """One pass: list the store (first time), clean half uploads, upload what is pending, apply remote
        retention, then the run's own files (:meth:`_push_run`). True when nothing is left pending. Also what ``ripresa mirror push`` runs."""
        failed_before = self._failed_requests
        uploaded_before = len(self.uploaded)
        local = local_generations(self.run_dir) if self.generations else {}
        if self._remote is not None or not self.deep:  # (a deep plan hashes: only against the store's listing)
            self.plan(local)
        try:
            if self._remote is None:
                self._remote = RemoteView(self._retry(None, "listing", self.store.list))
                if self.generations:
                    self._clean_half()
                self.plan(local)
            self._push_config()
            for step, main in self._order():
                self.upload(main, step)
                self._apply_remote_retention()
            pending = set(self.pending)
            for main, step in self._remote.half.items() if self.generations else ():
                if step not in pending:  # our own cut-short uploads of what is no longer pending
                    self._delete_group(main)
            self._push_run()
        except RemoteUnavailable as exc:
            self._outage_started(exc, failed_before, uploaded_before)
            return False
        self._last_error = None
        if self._outage is not None:
            self._recovered()
        self.plan(local_generations(self.run_dir) if self.generations else {})
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
        if self._thread is None or self._closing:
            return  # a single round (`ripresa mirror push`), or the close: their callers report the failure
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

    def plan(self, local: Mapping[str, int] | None = None) -> UploadPlan:
        """Which local generations the remote still needs (:func:`~ripresa.store.mirror.plan.plan_upload`, the plan
        ``mirror status`` prints): pending, pinned locally. One not needed (remote retention) or damaged is recorded
        once (``mirror_skipped``). ``local``: the committed local generations (None: the run folder's)."""
        local = local_generations(self.run_dir) if local is None else local
        view = self._remote if self._remote is not None else RemoteView({})
        plan = plan_upload(self.run_dir, view, self.policy, self.metrics(), deep=self.deep, refused=self._refused,
                           local=local, checked=self._checked, hashed=self.hashed)
        for m, s in plan.not_needed.items():
            if m not in self._superseded:
                self._superseded.add(m)
                self._event("mirror_skipped", step=s, file=m, reason="remote retention would not keep it (newer ones are kept)")
        for m, (s, why) in plan.damaged.items():
            if m not in self._refused:
                self._refused[m] = why
                self._event("mirror_skipped", step=s, file=m, reason=f"the local generation cannot be uploaded: {why}")
        with self._lock:
            self._pending = set(plan.steps)
            self._plan_bytes = dict(plan.bytes)
            self._horizon = max([self._horizon, *local.values()])
        self._last_plan = plan
        return plan

    def _order(self) -> list[tuple[int, str]]:
        """The generations to upload now, in step order (the last plan's, still pending and local)."""
        remote = self._remote.committed if self._remote is not None else {}
        local = local_generations(self.run_dir)
        with self._lock:
            pending = set(self._pending)
        return [(s, m) for s, m in self._last_plan.upload
                if s in pending and m in local and m not in self._refused
                and not (m in remote and m in self._last_plan.in_store)]

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

    def committed(self) -> dict[str, int]:
        """The committed generations the store holds now (a fresh listing): main name → step."""
        return RemoteView(self._retry(None, "listing", self.store.list)).committed

    def pull(self, ckpt: CheckpointStore, *, step: int | None = None) -> Generation | None:
        """Land the newest verified remote generation (or ``step``'s) in this mirror's run folder, whose store
        ``ckpt`` is (:func:`~ripresa.store.mirror.pull.pull`, its events in this mirror's history)."""
        if os.path.realpath(ckpt.folder) != os.path.realpath(self.run_dir):
            raise ValueError(f"a mirror of {self.run_dir} pulls into its own run folder, not {ckpt.folder}")
        return pull(self.store, self.run_dir, ckpt, step=step, event=self._event)

    def upload(self, main: str, step: int) -> None:
        """Upload committed generation ``main``: the files of its marker (named by its kind:
        :func:`~ripresa.store.kinds.generation_files`), each checked against the marker's sha256 as it is read,
        its signature, then the marker object **last** (docs/MIRROR.md)."""
        t0 = time.perf_counter()
        try:
            raw = read_small(self.run_dir / (main + ".sha256"), "commit marker", MAX_MARKER, error=IntegrityError)
            files = generation_files(main, raw, where=str(self.run_dir / (main + ".sha256")))
            sig_path = self.run_dir / (main + auth.SUFFIX)
            sig = read_small(sig_path, "signature", auth.MAX_SIGNATURE, error=IntegrityError) if os.path.lexists(sig_path) else None
        except (IntegrityError, BadInput) as exc:
            self._refuse_local(main, step, exc)
            return
        if self._remote is None:  # called before any round: the store's listing first
            self._remote = RemoteView(self._retry(None, "listing", self.store.list))
        if main in self._remote.committed:  # its marker is in the store but an object is missing or of another size:
            self._delete_group(main)  # marker first, so it reads as a half upload until it is whole again
        # (a half upload of ours, from an earlier round: its objects are overwritten)
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
        size = history_size(hist)
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
        self._refused[main] = exc.message
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
