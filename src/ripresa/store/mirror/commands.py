"""The mirror's commands: ``ripresa mirror status|push|pull`` (:func:`cli_status`, :func:`cli_push`,
:func:`cli_pull`), :func:`prefetch` for ``train --resume``, and :func:`status`, the plan ``mirror status`` prints
(docs/MIRROR.md). The public names are the package's (:mod:`ripresa.store.mirror`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import BadInput, CheckFailed, SaveFailed
from ...formats.generation import Generation
from ...io import auth
from ...io.objstore import ObjectStore, open_store
from ...io.redact import redact_url
from ..retention import RetentionPolicy
from ..store import CheckpointStore
from .layout import (
    MIRROR_MARKER,
    MIRROR_RECORD,
    RUN_MANIFEST,
    SEGMENT_PATTERN,
    MirrorSpec,
    RemoteView,
    local_generations,
)
from .plan import plan_upload
from .pull import has_local_generation, pull_config, pull_run, retrying
from .target import MirrorTarget, recorded, redacting
from .upload import Mirror, default_remote_policy


def push_policy(keep: RetentionPolicy | None) -> RetentionPolicy:
    """The remote retention of ``ripresa mirror push`` and ``status`` (``--keep``, else twice the default local
    ``keep_last``): one policy, so both plan the same upload."""
    from ..retention import DEFAULT_RETENTION

    return keep if keep is not None else default_remote_policy(DEFAULT_RETENTION)


def status(remote: ObjectStore, run_dir: Path, keep: RetentionPolicy | None = None) -> dict[str, Any]:
    """What is where: local committed generations, remote committed and half-uploaded ones, and the plan of the
    next upload (:func:`~ripresa.store.mirror.plan.plan_upload`, the very plan ``ripresa mirror push`` carries out):
    what it uploads (``pending``), what the remote retention does not need, what is damaged locally."""
    from ...console import progress
    from ...io.lock import is_locked
    from ...text import escape_markup

    local = local_generations(run_dir)
    view = RemoteView(remote.list())
    committed = view.committed
    with progress("bytes", transient=True) as bar:  # hashing what push would upload: a line on a terminal
        task = bar.add_task("mirror status: checking the local generations", total=None)

        def hashed(name: str, n: int) -> None:
            bar.update(task, description=escape_markup(f"mirror status: checking {name}", newlines=False), advance=n)

        plan = plan_upload(Path(run_dir), view, push_policy(keep), deep=True, local=local, hashed=hashed)
    running = Path(run_dir).is_dir() and is_locked(run_dir)
    return {
        "run": str(run_dir), "url": remote.url,
        "local": sorted(local.values()),
        "remote": sorted(committed.values()),
        "remote_files": {m: sorted(view.groups[m]) for m in sorted(committed, key=committed.get)},
        "half_uploaded": sorted(view.half.values()),
        "pending": plan.steps,
        "pending_bytes": plan.pending_bytes,
        "partial": sorted(plan.partial.values()),
        "not_needed": sorted(plan.not_needed.values()),
        "damaged": [{"step": st, "file": m, "reason": why} for m, (st, why) in sorted(plan.damaged.items(), key=lambda x: x[1])],
        "trainer_running": running,
        "config_remote": "config.json" in view.objects,
        "run_manifest": RUN_MANIFEST in view.objects,
        "history_bytes": sum(n for k, n in view.objects.items() if SEGMENT_PATTERN.fullmatch(k)),
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


def resolve_url(run_dir: Path, url: str | None, *, write: bool = False) -> tuple[str, bool]:
    """(the mirror URL, whether it is explicit): ``url``, else ``RUN/mirror.json``'s, under the rules of
    docs/MIRROR.md, "Trust" (``write``: a record the configured key does not authenticate is refused).
    ``ripresa rehearse`` follows them like ``push`` (it writes beside the mirror)."""
    return _resolve_url(run_dir, url, write=write)


class _Metered:
    """An object store whose transfers move a progress line (``ripresa mirror push``/``pull`` on a terminal:
    ripresa.console.progress): bytes moved so far, and the object being moved. Everything else passes through."""

    def __init__(self, inner: Any, verb: str) -> None:
        from ...console import progress

        self._inner, self._verb = inner, verb
        self._bar = progress("bytes", transient=True)
        self._task = self._bar.add_task(f"mirror {verb}: listing {redact_url(inner.url)}", total=None)

    def __enter__(self) -> _Metered:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.__exit__(*exc)

    def _show(self, key: str) -> None:
        from ...text import escape_markup

        self._bar.update(self._task, description=escape_markup(f"mirror {self._verb}: {key}", newlines=False))

    def hashed(self, name: str, n: int) -> None:
        """A piece of a local file hashed before the upload (the plan's check): the line says so."""
        self._show(f"checking {name}")
        self._bar.advance(self._task, n)

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


def _pull_into(run_dir: Path, remote: ObjectStore, step: int | None,
               also: Callable[..., None] | None = None) -> tuple[Generation | None, bool]:
    """Land a remote generation (and config.json when missing) in ``run_dir`` under its writer lock (``also``:
    told each event of this pull too, redacted)."""
    from ..history import HISTORY_NAME, History

    store = CheckpointStore(run_dir, writer=True)
    try:
        hist = History(Path(run_dir) / HISTORY_NAME)
        try:
            event = redacting(hist.event if also is None else _both(hist.event, also))
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


def _both(a: Callable[..., None], b: Callable[..., None]) -> Callable[..., None]:
    def event(name: str, **kw: Any) -> None:
        a(name, **kw)
        b(name, **kw)

    return event


def pull_generation(run_dir: Path, remote: ObjectStore, step: int | None = None,
                    event: Callable[..., None] | None = None) -> tuple[Generation | None, bool]:
    """The newest (or ``step``'s) remote generation that verifies, landed in ``run_dir`` (created; its writer lock
    held meanwhile) with the run's files and ``config.json``, a progress line on a terminal: the pull of
    ``ripresa mirror pull`` for the tools that read a store (docs/MIRROR.md, "Tools on a generation that lives
    only in the store"). ``event``: told each event of the pull (``mirror_refused``: a generation that failed its
    checks), redacted. Returns (the generation or None when the store holds no committed one, config pulled)."""
    with _Metered(remote, "pull") as metered:
        return _pull_into(Path(run_dir), metered, step, also=event)  # type: ignore[arg-type]


def cli_status(run_dir: Path, url: str | None, keep: RetentionPolicy | None = None) -> dict[str, Any]:
    """``ripresa mirror status``."""
    r = status(open_store(_resolve_url(run_dir, url)[0]), Path(run_dir), keep)
    return {**r, "url": redact_url(r["url"])}


def cli_push(run_dir: Path, url: str | None, keep: RetentionPolicy | None = None) -> dict[str, Any]:
    """``ripresa mirror push``: upload what the mirror lacks (under the run's writer lock), one round."""
    from ..history import HISTORY_NAME, History
    from ..retention import DEFAULT_RETENTION

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
                retrying(target.claim, what=MIRROR_MARKER)  # a mirror, locked, before anything is written
                hist = History(run_dir / HISTORY_NAME)
                try:
                    m = Mirror(spec, run_dir, local_retention=DEFAULT_RETENTION, event=redacting(hist.event),
                               store=target)
                    m.policy = push_policy(keep)  # the policy `mirror status` plans with
                    m.deep = True  # the plan `mirror status` prints: every file to upload hashed first
                    m.hashed = metered.hashed
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
