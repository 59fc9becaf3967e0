"""What an upload to the mirror would do: ONE plan for ``mirror status``, ``mirror push`` and the trainer's thread.

:func:`plan_upload` compares the run folder's committed generations with a listing of the store and says,
for each local generation, whether it is **in the store** (its marker object and every file its local
marker names, listed at the local sizes), to be **uploaded** (kept by the remote retention, intact), **not
needed** (the remote retention would not keep it: newer ones are kept) or **damaged** (it cannot be
uploaded: a malformed marker, a file missing, a link, a FIFO, and with ``deep`` a file whose sha256 is not
its marker's). ``ripresa mirror status`` prints the plan that ``ripresa mirror push`` then carries out, so
the two cannot disagree (docs/MIRROR.md, "Commands").
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import IntegrityError, RipresaError
from ...io import auth
from ...io.fsio import read_small
from ...io.objstore_base import HashedFile
from ..kinds import generation_files
from ..retention import RetentionPolicy
from .layout import MAX_MARKER, RemoteView, folders_of, local_generations


@dataclass
class LocalGeneration:
    """A committed local generation as the plan sees it: its marker's files (name → size) and the signature's size."""

    main: str
    step: int
    marker: bytes
    files: list[tuple[str, str]]  # (sha256, name), the marker's order
    sizes: dict[str, int]
    signature: bytes | None
    stamp: tuple[int, int, int] = (0, 0, 0)  # the marker's (inode, size, mtime_ns) when read
    verified: bool = False  # every file hashed against the marker (``deep``)

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values()) + len(self.marker) + (len(self.signature) if self.signature is not None else 0)

    def objects(self) -> dict[str, int]:
        """Every object the store holds of this generation once uploaded, with its size."""
        out = dict(self.sizes)
        if self.signature is not None:
            out[self.main + auth.SUFFIX] = len(self.signature)
        out[self.main + ".sha256"] = len(self.marker)
        return out


@dataclass
class UploadPlan:
    """The outcome of :func:`plan_upload`: steps by what happens to them (each list in step order)."""

    upload: list[tuple[int, str]] = field(default_factory=list)  # (step, main): what an upload round uploads, in order
    in_store: dict[str, int] = field(default_factory=dict)  # main -> step
    partial: dict[str, int] = field(default_factory=dict)  # to upload, with objects in the store already (no marker, or missing files)
    not_needed: dict[str, int] = field(default_factory=dict)  # main -> step: the remote retention would not keep it
    damaged: dict[str, tuple[int, str]] = field(default_factory=dict)  # main -> (step, why)
    bytes: dict[int, int] = field(default_factory=dict)  # step -> bytes to upload (files, signature, marker)

    @property
    def steps(self) -> list[int]:
        """The steps an upload round would upload, in order."""
        return [s for s, _ in self.upload]

    @property
    def pending_bytes(self) -> int:
        return sum(self.bytes.values())


def read_local(run_dir: Path, main: str, step: int, *, deep: bool = False,
               hashed: Callable[[str, int], None] | None = None) -> LocalGeneration:
    """A committed local generation's marker, files and signature, checked as an upload would need them.

    Raises :class:`~ripresa.errors.IntegrityError` or :class:`~ripresa.errors.BadInput` for a generation that
    cannot be uploaded: a malformed marker, a file missing or not a regular file (a link, a FIFO), a folder
    kind's folder that is a link, an unreadable signature; with ``deep``, a file whose sha256 is not the marker's
    (``hashed(name, n)`` is told of each piece hashed: a progress line).
    """
    run_dir = Path(run_dir)
    stamp = _stamp(run_dir / (main + ".sha256"))
    raw = read_small(run_dir / (main + ".sha256"), "commit marker", MAX_MARKER, error=IntegrityError)
    files = generation_files(main, raw, where=str(run_dir / (main + ".sha256")))
    for folder in folders_of(files):  # a folder kind's folder (its kind named the files inside it)
        try:
            st = os.lstat(run_dir / folder)
        except OSError as exc:
            raise IntegrityError("the generation's folder is missing", file=run_dir / folder, expected="a folder",
                                 found=type(exc).__name__) from None
        if not stat.S_ISDIR(st.st_mode):
            raise IntegrityError("the generation's folder is not a folder", file=run_dir / folder,
                                 expected="a folder (never a link)", found=stat.filemode(st.st_mode))
    sizes: dict[str, int] = {}
    for sha, name in files:
        p = run_dir / name
        try:
            st = os.lstat(p)
        except OSError as exc:
            raise IntegrityError("a file of the generation is missing", file=p, expected="the file its marker names",
                                 found=type(exc).__name__) from None
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError("a file of the generation is not a regular file", file=p,
                                 expected="a regular file (never a link or a FIFO)", found=stat.filemode(st.st_mode))
        if deep:
            src = HashedFile(p)
            for piece in src:
                if hashed is not None:
                    hashed(name, len(piece))
            src.check(sha)
        sizes[name] = st.st_size
    sig_path = run_dir / (main + auth.SUFFIX)
    sig = read_small(sig_path, "signature", auth.MAX_SIGNATURE, error=IntegrityError) if os.path.lexists(sig_path) else None
    return LocalGeneration(main, step, raw, files, sizes, sig, stamp, verified=deep)


def _stamp(path: Path) -> tuple[int, int, int]:
    try:
        st = os.lstat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def plan_upload(run_dir: Path, view: RemoteView, policy: RetentionPolicy,
                metrics: Mapping[int, Mapping[str, float]] | None = None, *, deep: bool = False,
                refused: Mapping[str, str] | None = None, local: Mapping[str, int] | None = None,
                checked: dict[str, LocalGeneration] | None = None,
                hashed: Callable[[str, int], None] | None = None) -> UploadPlan:
    """The plan of an upload round (see the module doc).

    ``view``: the store's listing. ``policy`` and ``metrics``: the remote retention. ``deep``: hash every
    file to upload against its marker (``mirror status`` and ``mirror push``: what push would refuse, status
    names; the trainer's thread leaves it to the upload, which hashes as it reads). ``refused``: main → why,
    generations an earlier upload found damaged (the thread remembers them). ``local``: the committed local
    generations (default: the run folder's). ``checked``: a cache main → :class:`LocalGeneration`, kept by
    the caller between plans (a marker is read once). ``hashed(name, n)``: told of each piece ``deep`` hashes.
    """
    run_dir = Path(run_dir)
    local = local_generations(run_dir) if local is None else local
    refused = refused or {}
    plan = UploadPlan()
    committed = view.committed
    candidates: dict[str, LocalGeneration] = {}
    for main, step in sorted(local.items(), key=lambda x: (x[1], x[0])):
        if main in refused:
            plan.damaged[main] = (step, refused[main])
            continue
        gen = checked.get(main) if checked is not None else None
        try:
            if gen is None or gen.stamp != _stamp(run_dir / (main + ".sha256")):
                gen = read_local(run_dir, main, step)
            if checked is not None:
                checked[main] = gen
            if main in committed and _complete(gen, view.objects):
                plan.in_store[main] = step
                continue
            if deep and not gen.verified:  # only what would be uploaded is hashed
                gen = read_local(run_dir, main, step, deep=True, hashed=hashed)
                if checked is not None:
                    checked[main] = gen
        except RipresaError as exc:  # a marker, a file or a signature an upload would refuse
            if not os.path.lexists(run_dir / (main + ".sha256")):
                continue  # deleted meanwhile (local retention): no longer a local generation
            plan.damaged[main] = (step, exc.message)
            continue
        candidates[main] = gen
    every = sorted({*committed.values(), *(g.step for g in candidates.values())})
    keep = policy.keep_scored(every, metrics or {}) | ({every[-1]} if every else set())
    for main, gen in candidates.items():
        if gen.step not in keep:
            plan.not_needed[main] = gen.step
            continue
        plan.upload.append((gen.step, main))
        plan.bytes[gen.step] = plan.bytes.get(gen.step, 0) + gen.bytes
        if main in view.groups:
            plan.partial[main] = gen.step
    plan.upload.sort()
    return plan


def _complete(gen: LocalGeneration, objects: Mapping[str, int]) -> bool:
    """True when the store lists every object of ``gen`` at its local size."""
    return all(objects.get(k) == n for k, n in gen.objects().items())



def size_text(n: int) -> str:
    """Bytes for a person: ``512 B``, ``12.3 MB``, ``4.1 GB`` (decimal units)."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


def duration_text(seconds: float) -> str:
    """``0:42``, ``14:05``, ``1:02:03``."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
