"""A resume from the mirror (docs/MIRROR.md): pulling generations and restoring the run's files.

:func:`pull` lands the newest remote generation that verifies: downloaded into a staging folder, deep-checked
there (the validation a resume gives it), then moved into the run folder, marker last (docs/MIRROR.md, "A pull
lands only what it verified"); :func:`pull_run` first restores the run's history and sidecars (:func:`restore_run`);
:func:`pull_config` fetches ``config.json`` (and its signature, for signed runs).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ...errors import BadInput, CheckFailed, IntegrityError, SaveFailed
from ...formats.generation import Generation
from ...io import auth
from ...io.fsio import StagedFile, fsync_dir, open_run_file, ops, write_atomic
from ...io.objstore import ObjectStore, RemoteNotFound
from ...io.redact import redact_url
from ..history import HISTORY_NAME
from ..kinds import backend_of, generation_files, pull_order, spec_of
from ..kinds import kinds as registered_kinds
from ..store import CheckpointStore
from .layout import (
    CONFIG_SIG,
    MAX_CONFIG,
    MAX_MARKER,
    MAX_RUN_MANIFEST,
    RUN_MANIFEST,
    MirrorSpec,
    RemoteView,
    RunManifest,
    folders_of,
    history_size,
    kind_of,
    local_generations,
)
from .retry import Retry


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


# ---------------------------------------------------------------------------- pulling


_PULL = MirrorSpec("", attempts=4, backoff=0.25, max_backoff=8.0)


def retrying(fn: Callable[[], Any], event: Callable[..., None] | None = None, what: str = "",
             spec: MirrorSpec = _PULL) -> Any:
    """``fn()`` under the mirror's back-off policy (:class:`~ripresa.store.mirror.retry.Retry`) with ``spec``'s
    tries and waits: a :class:`~ripresa.io.objstore.RemoteUnavailable` is retried, a ``mirror_retry`` event
    per retry (when ``event`` is given); the last failure is raised."""
    return Retry.of(spec).call(fn, what=what, event=event)


def fetch_staged(remote: ObjectStore, name: str, target: Path, limit: int, sha: str, event: Callable[..., None],
                 spec: MirrorSpec) -> StagedFile:
    """Object ``name`` streamed into a temporary sibling of ``target`` (at most ``limit`` bytes), fsync'd,
    its sha256 compared with the marker's; the caller publishes it. A failed try starts a new temporary."""

    def once() -> tuple[StagedFile, Any]:
        sf = StagedFile(target)
        try:
            remote.get_into(name, sf, limit=limit)
            return sf, sf.finish()
        except BaseException:
            sf.discard()
            raise

    sf, d = retrying(once, event=event, what=name, spec=spec)
    if d.sha256 != sha:
        sf.discard()
        raise IntegrityError("a remote object differs from its marker", file=f"{remote.url}/{name}",
                             expected=sha, found=d.sha256,
                             hint="it was changed in the store; an older remote generation is used")
    return sf


def _land(remote: ObjectStore, view: RemoteView, run_dir: Path, main: str, step: int, ckpt: CheckpointStore,
          event: Callable[..., None], spec: MirrorSpec) -> Generation:
    """Download ``main`` into ``run_dir`` through the local commit protocol, marker last; deep-check it there."""
    backend = backend_of(kind_of(main), ckpt)
    where = f"{remote.url}/{main}.sha256"
    raw = retrying(lambda: remote.get_bytes(main + ".sha256", limit=MAX_MARKER), event=event, what=main + ".sha256", spec=spec)
    files = generation_files(main, raw, where=where)
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
    # Verify before landing (docs/MIRROR.md, "A pull lands only what it verified"): every object goes into a
    # staging folder beside the run's files (same file system: the landing is renames), the generation is given
    # there the validation a resume gives it (deep: every byte hashed, the state decoded, every shape bounded),
    # and only a generation that passes is moved into the run folder, its marker last. What fails is removed.
    stage = _fresh_stage(run_dir)
    try:
        folders = folders_of(files)  # a folder kind's folder: its kind named the files inside it
        for folder in folders:
            (stage / folder).mkdir()
        for sha, name in files:
            sf = fetch_staged(remote, name, stage / name, view.objects[name], sha, event, spec)
            try:
                sf.publish()
            finally:
                sf.discard()
        if sig_key in view.objects:
            sig = retrying(lambda: remote.get_bytes(sig_key, limit=auth.MAX_SIGNATURE), event=event, what=sig_key,
                           spec=spec)
            write_atomic(stage / sig_key, [sig], sync_dir=False)
        write_atomic(stage / (main + ".sha256"), [raw], sync_dir=False)
        checker = CheckpointStore(stage, writer=False, require_signature=ckpt.require_signature,
                                  hmac_key=ckpt.hmac_key)
        try:
            staged = backend_of(kind_of(main), checker).check(step, deep=True)
        finally:
            checker.close()
        if not staged.valid:
            raise IntegrityError(f"the pulled generation fails its checks: {staged.reason}", file=where,
                                 hint="it is not landed in the run folder; an older remote generation is used")
        for folder in folders:
            fsync_dir(stage / folder)
        fsync_dir(stage)
        # landing: a local generation of that step that failed its checks is replaced (its marker first)
        if os.path.lexists(run_dir / (main + ".sha256")) or os.path.lexists(run_dir / main):
            backend.delete(step)
        for top in dict.fromkeys(name.split("/", 1)[0] for _, name in files):  # the main file or folder, its companion
            ops.rename(stage / top, run_dir / top)
        if sig_key in view.objects:
            ops.rename(stage / sig_key, run_dir / sig_key)
        ops.rename(stage / (main + ".sha256"), run_dir / (main + ".sha256"))  # the commit marker, last
        fsync_dir(run_dir)
    finally:
        _drop_stage(stage)
    gen = backend.check(step)
    if not gen.valid:  # pragma: no cover - the same bytes passed the deep check above
        backend.delete(step)
        fsync_dir(run_dir)
        raise IntegrityError(f"the pulled generation fails its checks: {gen.reason}", file=where,
                             hint="an older remote generation is used")
    return dataclasses.replace(gen, deep_checked=True)


#: The staging folder of a pull inside the run folder (docs/MIRROR.md): never a generation's name, removed by
#: every pull before and after it is used.
STAGE_NAME = ".ripresa-pull.partial"


def _drop_stage(stage: Path) -> None:
    if os.path.islink(stage) or (os.path.lexists(stage) and not stage.is_dir()):
        ops.unlink(stage)
    elif os.path.lexists(stage):
        ops.rmtree(stage)


def _fresh_stage(run_dir: Path) -> Path:
    stage = Path(run_dir) / STAGE_NAME
    _drop_stage(stage)
    stage.mkdir()
    return stage


def pull(remote: ObjectStore, run_dir: Path, ckpt: CheckpointStore, *, step: int | None = None,
         kinds: Iterable[str] | None = None, event: Callable[..., None] | None = None,
         spec: MirrorSpec = _PULL) -> Generation | None:
    """Land the newest remote generation (or ``step``'s) whose marker verifies; None when the store holds none.

    ``kinds``: the kinds considered (None: every registered kind), ordered at equal steps by the registry of
    kinds (:func:`ripresa.store.kinds.pull_order`: each kind's ``pull_rank``).

    Each one that fails (a flipped byte, a bad or missing signature under
    require-signature, a malformed marker) is recorded as ``mirror_refused``
    and the previous one is tried; when committed remote generations exist but
    none verifies: :class:`~ripresa.errors.CheckFailed` (exit 1).
    """
    ev = event or (lambda name, **kw: None)
    kinds = tuple(spec_of(k).kind for k in kinds) if kinds is not None else tuple(s.kind for s in registered_kinds())
    view = RemoteView(retrying(remote.list, event=ev, what="listing", spec=spec))
    cands = sorted(((s, m) for m, s in view.committed.items() if kind_of(m) in kinds and (step is None or s == step)),
                   key=lambda x: (-x[0], pull_order(kind_of(x[1]))))
    refused: list[str] = []
    for s, main in cands:
        try:
            gen = _land(remote, view, Path(run_dir), main, s, ckpt, ev, spec)
        except IntegrityError as exc:
            obj = str(exc.file or "").removeprefix(remote.url + "/")  # the object at fault: a rank's shard, say
            msg = f"{obj if obj.startswith(main + '/') else main}: {exc.message}" \
                + (f" (found {str(exc.found)[:80]})" if exc.found is not None else "")
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
        raw = retrying(lambda: remote.get_bytes(RUN_MANIFEST, limit=MAX_RUN_MANIFEST), event=ev, what=RUN_MANIFEST,
                        spec=spec)
        man = RunManifest.parse(raw, where)
    except RemoteNotFound:
        return None
    except IntegrityError as exc:  # too large, malformed
        ev("mirror_refused", file=RUN_MANIFEST, url=remote.url, reason=exc.message,
           found=None if exc.found is None else str(exc.found)[:200])
        return None

    def fetch(key: str, size: int, sha: str) -> bytes:
        data = retrying(lambda: remote.get_bytes(key, limit=size), event=ev, what=key, spec=spec)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise IntegrityError("a remote run file differs from its manifest", file=f"{remote.url}/{key}",
                                 expected=f"{size} bytes, sha256 {sha}",
                                 found=f"{len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
        return data

    done: dict[str, Any] = {"history_bytes": 0, "segments": 0, "through_step": None, "files": [], "refused": []}
    hist = run_dir / HISTORY_NAME
    if man.history and history_size(hist) == 0:
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
             kinds: Iterable[str] | None = None, event: Callable[..., None] | None = None,
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
        raw = retrying(lambda: remote.get_bytes("config.json", limit=MAX_CONFIG), what="config.json")
    except RemoteNotFound:
        return False
    try:
        sig: bytes | None = retrying(lambda: remote.get_bytes(CONFIG_SIG, limit=auth.MAX_SIGNATURE), what=CONFIG_SIG)
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
