"""The export bundle kit: write files hashed, commit the manifest last, read it back.

Shared by every kind's export (:mod:`ripresa.tools.export_bin`,
:mod:`ripresa.tools.export_general`); it knows no kind. Layout and protocol:
docs/FORMAT.md ("Export bundles"); refusals: docs/FAULTS.md §7.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..errors import BadInput, IntegrityError, OutputExists, RipresaError
from ..io import auth
from ..io.fsio import (
    Digest,
    StagedFile,
    copy_hashing,
    fsync_dir,
    open_run_file,
    parse_json_bytes,
    read_small,
    sha256_fd,
    sidecar_line,
)
from ..store.store import Generation

#: ``format`` of MANIFEST.json and export.json.
EXPORT_FORMAT = "ripresa.tools.export"
EXPORT_FORMAT_VERSION = 1
MANIFEST_JSON = "MANIFEST.json"
MANIFEST_SHA = "MANIFEST.sha256"
#: Copies and re-hashes of at least this many bytes in all show a progress bar.
PROGRESS_MIN_BYTES = 64 << 20
#: Largest JSON file of a run or a bundle read whole (config, lineage, manifest...).
JSON_MAX = 16 << 20
#: Largest companion read whole.
COMPANION_MAX = 64 << 20
RESUME = "resume"
INFERENCE = "inference"

#: Verifies a just-written bundle (``export.verify_or_uncommit``): (dest, model factory, progress, expected weights).
Verifier = Callable[[Path, Any, bool, Any], dict[str, Any]]


#: The source a bundle's manifest names, when it is not the run folder exported (a store URL: the run folder is a
#: temporary one, docs/MIRROR.md, "Tools on a generation that lives only in the store"); set by ``export_run``.
SOURCE_RUN: ContextVar[str | None] = ContextVar("ripresa_export_source_run", default=None)


def source_run(run: Path) -> str:
    """What the manifest's ``source_run`` says: :data:`SOURCE_RUN`, else the run folder's absolute path."""
    return SOURCE_RUN.get() or str(Path(run).resolve())


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False).encode() + b"\n"


@contextmanager
def meter(total: int, label: str, enabled: bool) -> Iterator[Any]:
    """A progress line in bytes for large jobs (ripresa.console.progress: on stderr, a TTY only); a no-op otherwise."""
    if not enabled or total < PROGRESS_MIN_BYTES:
        yield lambda n, desc=None: None
        return
    from ..console import progress as console_progress

    progress = console_progress("bytes")
    task = progress.add_task(label, total=total)

    def advance(n: int, desc: str | None = None) -> None:
        progress.update(task, advance=n, **({"description": desc} if desc else {}))

    with progress:
        yield advance


def load_json(path: Path, what: str, exc_type: type[RipresaError] = BadInput) -> Any:
    """A small JSON file of a run or bundle (:func:`~ripresa.io.fsio.read_small`: no link, no FIFO, bounded)."""
    return parse_json_bytes(read_small(path, what, JSON_MAX, error=exc_type), path, what, error=exc_type)


def as_dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def size_or_zero(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


class Bundle:
    """Files written into the destination through StagedFile, remembered for the manifest."""

    def __init__(self, dest: Path, advance: Any) -> None:
        self.dest = dest
        self.files: dict[str, Digest] = {}
        self.created_dirs: list[Path] = []
        self.advance = advance

    def _target(self, rel: str) -> Path:
        path = self.dest / rel
        parent = path.parent
        missing = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for d in reversed(missing):
            d.mkdir()
            self.created_dirs.append(d)
            fsync_dir(d.parent)
        return path

    def copy(self, src: Path, rel: str, *, what: str, expected: Digest | str | None = None, keep: bool = False,
             error: type[RipresaError] = BadInput) -> bytes | None:
        """Stream ``src`` into ``DEST/rel``; the copy must hash to ``expected`` if given.

        ``src`` is opened with :func:`~ripresa.io.fsio.open_run_file`: a symlink
        (never followed), FIFO, socket, device or folder is refused with ``error``.
        """
        fd = open_run_file(src, what, error=error)
        try:
            final = self._target(rel)
        except BaseException:
            os.close(fd)
            raise
        kept: list[bytes] = []
        try:
            with StagedFile(final) as out:
                # The size at open: a file that shrinks meanwhile is an IntegrityError, a read error a BadInput.
                def on_chunk(piece: memoryview) -> None:
                    if keep:
                        kept.append(bytes(piece))
                    self.advance(len(piece), f"copy {rel}")

                digest = copy_hashing(fd, out, what=what, path=src, on_chunk=on_chunk, size=os.fstat(fd).st_size)
                if expected is not None:
                    exp_sha = expected if isinstance(expected, str) else expected.sha256
                    exp_size = None if isinstance(expected, str) else expected.size
                    if digest.sha256 != exp_sha or (exp_size is not None and digest.size != exp_size):
                        raise IntegrityError(
                            f"the copy of {what} does not match the source's committed hash", file=src,
                            expected=exp_sha if exp_size is None else f"{exp_sha} ({exp_size} bytes)",
                            found=f"{digest.sha256} ({digest.size} bytes)",
                            hint="the source changed while it was copied (a live run re-saved it, or the disk is failing); "
                                 "export again")
                out.publish()
        finally:
            os.close(fd)
        fsync_dir(final.parent)
        self.files[rel] = digest
        return b"".join(kept) if keep else None

    def write(self, rel: str, data: bytes) -> Digest:
        final = self._target(rel)
        with StagedFile(final) as out:
            out.write(data)
            digest = out.finish()
            out.publish()
        fsync_dir(final.parent)
        self.files[rel] = digest
        return digest

    def commit(self, kind: str, step: int, extra: dict[str, Any]) -> dict[str, Any]:
        """Write MANIFEST.json, then MANIFEST.sha256 (the bundle's commit marker) last."""
        entries = [{"path": rel, "size": d.size, "sha256": d.sha256} for rel, d in sorted(self.files.items())]
        manifest = {
            "format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "kind": kind, "step": step,
            "created": now(), "ripresa": __version__,
            "files": entries, "total_bytes": sum(e["size"] for e in entries), **extra,
        }
        mdig = self.write(MANIFEST_JSON, json_bytes(manifest))
        lines = [sidecar_line(d, rel) for rel, d in sorted(self.files.items()) if rel != MANIFEST_JSON]
        lines.append(sidecar_line(mdig, MANIFEST_JSON))
        self.write(MANIFEST_SHA, b"".join(lines))
        fsync_dir(self.dest)
        return manifest

    def abort(self, dest_created: bool) -> None:
        """Remove what this export wrote (best effort); DEST is left as it was."""
        for rel in list(self.files):
            try:
                os.unlink(self.dest / rel)
            except OSError:
                pass
        for d in reversed(self.created_dirs):
            try:
                d.rmdir()
            except OSError:
                pass
        if dest_created:
            try:
                self.dest.rmdir()
            except OSError:
                pass


def check_dest(dest: Path, run: Path) -> None:
    if os.path.lexists(dest):
        if not dest.is_dir():
            raise OutputExists("export destination exists and is not a folder", file=dest,
                               expected="a new folder or an empty one", found="a file",
                               hint="choose another --to")
        try:
            names = sorted(os.listdir(dest))
        except OSError as exc:
            raise BadInput("export destination cannot be listed", file=dest, found=str(exc)) from exc
        if names:
            raise OutputExists("export destination is not empty", file=dest,
                               expected="a new folder or an empty one", found=f"{len(names)} entries: {names[:5]}",
                               hint="an export never overwrites or merges; choose a new --to folder")
        if dest.resolve() == run.resolve():
            raise OutputExists("export destination is the run folder", file=dest, expected="another folder")


def make_dest(dest: Path) -> bool:
    """Create the (checked) export folder ``dest`` if it is missing, durably; whether it was created here."""
    if os.path.lexists(dest):
        return False
    try:
        dest.mkdir(parents=True)
    except OSError as exc:
        raise BadInput("export destination cannot be created", file=dest, found=str(exc)) from exc
    fsync_dir(dest.parent)
    return True


def copy_signature(bundle: Bundle, gen: Generation, rel_dir: str) -> str | None:
    """Copy the generation's ``.bin.hmac`` (unchanged, its form checked) if it has one; return its path in the bundle.

    A bundle of a signed run so stays signed (``docs/FORMAT.md``); the
    signature is listed in the manifest like every file.
    """
    sig = auth.signature_path(gen.bin)
    if not os.path.lexists(sig):
        return None
    read_small(sig, "the generation's signature", auth.MAX_SIGNATURE, error=IntegrityError)  # no link, no FIFO
    _, sig_step, _ = auth.read_signature(sig)  # one well-formed line
    if sig_step != gen.step:
        raise IntegrityError("the generation's signature names another step", file=sig, expected=gen.step,
                             found=sig_step, hint="the signature was moved or forged; nothing was exported")
    rel = f"{rel_dir}/{sig.name}"
    bundle.copy(sig, rel, what="the generation's signature", error=IntegrityError)
    return rel


def copy_metrics(bundle: Bundle, run: Path, notes: list[str]) -> list[str]:
    """Copy the run's sidecars and archived phases into ``metrics/``; the bundle paths written."""
    metrics: list[str] = []
    for src, rel in ((".loss.jsonl", "metrics/loss.jsonl"), (".samples.json", "metrics/samples.json"),
                     (".state.json", "metrics/state.json")):
        if os.path.lexists(run / src):  # a link or FIFO in its place is refused, never skipped
            bundle.copy(run / src, rel, what=f"the run's {src}")
            metrics.append(rel)
        elif src == ".loss.jsonl":
            notes.append("the run has no .loss.jsonl: no training history exported")
    for phase, src, name in archived_files(run):
        rel = f"metrics/archive/{phase}/{name}"
        bundle.copy(run / "archive" / phase / src, rel, what=f"archived {src}")
        metrics.append(rel)
    return metrics


def archived_files(run: Path) -> list[tuple[str, str, str]]:
    """(phase folder, file, name in the bundle) of every archived ``.samples.json`` / ``.state.json``.

    ``archive/`` and its phase folders are listed without following links: a
    symlink in place of ``archive/``, of a phase folder or of an archived file
    refuses the export (:class:`~ripresa.errors.BadInput`).
    """
    archive = run / "archive"
    if not os.path.lexists(archive):
        return []
    if os.path.islink(archive) or not archive.is_dir():
        raise BadInput("the run's archive/ is not a folder", file=archive, expected="a folder inside the run",
                       found="a symlink" if os.path.islink(archive) else "not a folder",
                       hint="ripresa never follows links inside a run folder; replace the link by the folder")
    out = []
    try:
        entries = sorted(os.scandir(archive), key=lambda e: e.name)
    except OSError as exc:
        raise BadInput("the run's archive/ cannot be listed", file=archive, found=str(exc)) from exc
    for entry in entries:
        if entry.is_symlink():
            raise BadInput("an entry of the run's archive/ is a symlink", file=entry.path, expected="a folder",
                           found="a symlink", hint="ripresa never follows links inside a run folder")
        if not entry.is_dir(follow_symlinks=False):
            continue
        for src, name in ((".samples.json", "samples.json"), (".state.json", "state.json")):
            if os.path.lexists(Path(entry.path) / src):
                out.append((entry.name, src, name))
    return out


def exporter_versions() -> dict[str, Any]:
    import platform

    return {"ripresa": __version__, "python": platform.python_version(), "torch": str(torch.__version__),
            "numpy": str(np.__version__)}


def safe_rel(dest: Path, rel: Any, manifest: Path) -> Path:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel \
            or any(part in ("", ".", "..") for part in rel.split("/")):
        raise IntegrityError("the manifest names a path outside the export", file=manifest,
                             expected="a relative path inside the folder", found=repr(rel))
    path = dest / rel
    for parent in [path, *path.parents]:
        if parent == dest:
            break
        if parent.is_symlink():
            raise IntegrityError("a file of the export is a symbolic link", file=parent,
                                 expected="a regular file", found="a symlink")
    return path


def read_manifest(dest: Path) -> dict[str, Any]:
    """Parse MANIFEST.sha256 and MANIFEST.json and check they agree (both are required)."""
    msha, mjson = dest / MANIFEST_SHA, dest / MANIFEST_JSON
    if not os.path.lexists(msha):
        raise IntegrityError(f"{MANIFEST_SHA} is missing: this is not a complete export", file=msha,
                             expected=f"{MANIFEST_SHA}, written last by ripresa export", found="nothing",
                             hint="the export was interrupted or failed its verification; export again")
    lines: dict[str, str] = {}
    for i, line in enumerate(read_small(msha, MANIFEST_SHA, JSON_MAX, error=IntegrityError)
                             .decode("utf-8", "replace").splitlines(), 1):
        hexd, sep, rel = line.partition("  ")
        if not sep or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd) or rel in lines:
            raise IntegrityError(f"malformed line {i} in {MANIFEST_SHA}", file=msha,
                                 expected="'<sha256>  <relative path>'", found=repr(line[:160]))
        lines[rel] = hexd
    if MANIFEST_JSON not in lines:
        raise IntegrityError(f"{MANIFEST_SHA} does not vouch for {MANIFEST_JSON}", file=msha,
                             expected=f"a line for {MANIFEST_JSON}", found=sorted(lines)[:8])
    drop_page_cache_quiet(mjson)
    raw = read_small(mjson, MANIFEST_JSON, JSON_MAX, error=IntegrityError)  # read once: the bytes hashed are the bytes parsed
    found_sha = hashlib.sha256(raw).hexdigest()
    if found_sha != lines[MANIFEST_JSON]:
        raise IntegrityError(f"sha256 mismatch: {MANIFEST_JSON} changed after the export", file=mjson,
                             expected=lines[MANIFEST_JSON], found=found_sha)
    manifest = parse_json_bytes(raw, mjson, MANIFEST_JSON, error=IntegrityError)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT \
            or type(version) is not int or version != EXPORT_FORMAT_VERSION \
            or manifest.get("kind") not in (RESUME, INFERENCE) or not isinstance(manifest.get("files"), list):
        raise IntegrityError(f"{MANIFEST_JSON} is not a ripresa export manifest of a version this ripresa reads", file=mjson,
                             expected=f"format '{EXPORT_FORMAT}', format_version {EXPORT_FORMAT_VERSION}, "
                                      "kind resume|inference, files [...]",
                             found={k: repr(manifest.get(k))[:40] for k in ("format", "format_version", "kind")}
                             if isinstance(manifest, dict) else type(manifest).__name__)
    listed = {}
    for e in manifest["files"]:
        if not isinstance(e, dict) or not isinstance(e.get("size"), int) or not isinstance(e.get("sha256"), str):
            raise IntegrityError(f"malformed entry in {MANIFEST_JSON}", file=mjson, expected="{path, size, sha256}", found=repr(e)[:160])
        safe_rel(dest, e.get("path"), mjson)
        listed[e["path"]] = e
    others = {k: v for k, v in lines.items() if k != MANIFEST_JSON}
    if set(others) != set(listed) or any(others[k] != listed[k]["sha256"] for k in listed):
        diff = sorted(set(others) ^ set(listed)) or sorted(k for k in listed if others[k] != listed[k]["sha256"])
        raise IntegrityError(f"{MANIFEST_SHA} and {MANIFEST_JSON} disagree", file=msha,
                             expected="the same files and hashes in both", found=diff[:8])
    return manifest


def drop_page_cache_quiet(path: Path) -> bool:
    """Drop ``path``'s cached pages if it is a regular file (no link followed); never raises."""
    try:
        fd = open_run_file(path, "file", error=IntegrityError)
    except RipresaError:
        return False
    try:
        return _fadvise_dontneed(fd)
    finally:
        os.close(fd)


def _fadvise_dontneed(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise") or not hasattr(os, "POSIX_FADV_DONTNEED"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def hash_bundle_file(path: Path, what: str) -> tuple[Digest, bool]:
    """sha256 of a bundle's file, opened with :func:`~ripresa.io.fsio.open_run_file` (a link or FIFO fails, exit 1)."""
    fd = open_run_file(path, what, error=IntegrityError)
    try:
        dropped = _fadvise_dontneed(fd)
        digest = sha256_fd(fd, what=what, path=path)
        _fadvise_dontneed(fd)
    finally:
        os.close(fd)
    return digest, dropped
