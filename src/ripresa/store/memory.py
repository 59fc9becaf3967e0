"""The memory tier: a complete generation in shared memory every k steps, copied while the next step runs.

Where it lives: ``/dev/shm/ripresa-<uid>/<key of the run folder>/`` (``RIPRESA_MEMORY_DIR`` moves
``/dev/shm``), a folder of mode 0700 that the OS keeps after a SIGKILL and loses at a reboot. It
holds two slots, so that at most one memory generation and one in flight exist: each slot is a
safetensors file laid out exactly as a general generation's tensor file (``slotK.safetensors``),
the general companion (``slotK.json``) and the slot's marker (``slotK.marker``), written last.

A capture (:meth:`MemoryTier.capture`) takes everything but the model's parameters and the
optimizer's state as copies on the loop; the parameters and moments are read by reference
and copied into the slot's mapping on a thread (on CUDA: on a side stream, into registered
pinned pages) while the next step's forward and backward run. :meth:`MemoryTier.wait_copied`
is what the optimizer's step waits on. The thread then hashes the slot and writes the
companion and the marker (sha256 of both files, the step, the kernel's boot id, the user and
the run's token). A slot without a marker, or whose marker or hashes do not match, is never
used.

:func:`newest` reads the memory generations back for a resume, trusting one only on this
boot, for this user and this run (the token in the run folder's ``.ripresa-memory``); the
session promotes it into the run folder as a general generation (:func:`promote`), through
the one commit protocol. docs/TIERS.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.numbers import checked_number
from ..errors import IntegrityError, RipresaError
from ..formats import general as general_fmt
from ..formats import safetensors_file as st
from ..formats.generation import Generation
from ..io.liveness import boot_id
from ..io.safe_read import read_small
from .general import general_name, save_general

__all__ = ["MEMORY_ENV", "MemoryTier", "MemoryUnusable", "Found", "newest", "peek", "promote", "discard", "tier_folder"]

#: Moves the memory tier's root (default ``/dev/shm``): a tmpfs the OS keeps across a process's death.
MEMORY_ENV = "RIPRESA_MEMORY_DIR"
FORMAT = "ripresa.memory"
FORMAT_VERSION = 1
#: The run folder's file naming the run its memory generations belong to.
TOKEN_NAME = ".ripresa-memory"
MAX_MARKER_BYTES = 64 * 1024
#: Free space left in the memory tier's filesystem beyond the two slots (bytes).
MARGIN = 64 * 1024 * 1024
#: Hashing piece (bytes): the hash releases the GIL for each piece.
PIECE = 16 * 1024 * 1024
SLOTS = 2


class MemoryUnusable(RipresaError):
    """The memory tier cannot run here (too little shared memory, a folder of another user, ...): the session
    turns it off with one warning and the disk tier goes on."""


def root() -> Path:
    """``/dev/shm/ripresa-<uid>`` (or under ``RIPRESA_MEMORY_DIR``)."""
    return Path(os.environ.get(MEMORY_ENV) or "/dev/shm") / f"ripresa-{os.geteuid()}"


def tier_folder(run_dir: str | Path) -> Path:
    """The memory tier's folder of a run folder: one per real path."""
    real = os.path.realpath(os.fspath(run_dir))
    return root() / hashlib.sha256(real.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _owned_folder(path: Path, *, create: bool) -> bool:
    """``path`` is a folder of this user, mode 0700, not a link (created so when ``create``); False when absent."""
    try:
        st_ = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise MemoryUnusable("cannot create the memory tier's folder", file=path, expected="a writable tmpfs",
                                 found=exc.strerror, hint=f"set {MEMORY_ENV} to a tmpfs folder of this user") from exc
        st_ = os.lstat(path)
    if not stat.S_ISDIR(st_.st_mode) or st_.st_uid != os.geteuid() or st_.st_mode & 0o077:
        raise MemoryUnusable("the memory tier's folder is not a private folder of this user", file=path,
                             expected=f"a folder of uid {os.geteuid()}, mode 0700, not a link",
                             found=f"mode {oct(st_.st_mode)}, uid {st_.st_uid}",
                             hint=f"remove it, or set {MEMORY_ENV} to another tmpfs folder")
    return True


def run_token(run_dir: Path, *, create: bool) -> str | None:
    """The run's token (``.ripresa-memory`` in the run folder): which run a memory generation belongs to."""
    path = Path(run_dir) / TOKEN_NAME
    try:
        raw = read_small(path, "memory tier token", 256)
        token = raw.decode("ascii").strip()
        if len(token) == 32 and all(c in "0123456789abcdef" for c in token):
            return token
    except (RipresaError, UnicodeDecodeError):
        if os.path.lexists(path) and not create:
            return None
    if not create:
        return None
    token = secrets.token_hex(16)
    tmp = path.with_name(f"{TOKEN_NAME}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def _write_small(path: Path, data: bytes) -> None:
    """A small file of the tier, whole or absent (a temporary name, then a rename); tmpfs needs no fsync."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


class _Slot:
    """One slot: its tensor file mapped in memory (allocated before it is written), companion and marker paths."""

    def __init__(self, folder: Path, index: int) -> None:
        self.index = index
        self.tensors = folder / f"slot{index}.safetensors"
        self.companion = folder / f"slot{index}.json"
        self.marker = folder / f"slot{index}.marker"
        self.size = 0
        self.mm: mmap.mmap | None = None
        self.view: torch.Tensor | None = None
        self.registered = False

    def ensure(self, size: int) -> None:
        """Allocate the tensor file at ``size`` bytes (every page now: a full tmpfs fails here, not in a copy)."""
        if self.mm is not None and self.size == size:
            return
        self.close()
        fd = os.open(self.tensors, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st_ = os.fstat(fd)
            if not stat.S_ISREG(st_.st_mode) or st_.st_uid != os.geteuid():
                raise MemoryUnusable("a memory slot is not a regular file of this user", file=self.tensors)
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.ftruncate(fd, 0)
                raise MemoryUnusable("the memory tier's filesystem has no room for a slot", file=self.tensors,
                                     expected=f"{size} bytes", found=exc.strerror,
                                     hint=f"enlarge /dev/shm or set {MEMORY_ENV}; the disk tier goes on") from exc
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.view = torch.frombuffer(self.mm, dtype=torch.uint8)

    def register(self) -> None:
        """Pin the mapping for CUDA copies (page-locked: the device copies into it directly, asynchronously)."""
        if self.registered or self.view is None or not torch.cuda.is_available():
            return
        err = torch.cuda.cudart().cudaHostRegister(self.view.data_ptr(), self.size, 0)
        self.registered = int(getattr(err, "value", err)) == 0

    def close(self) -> None:
        if self.registered and self.view is not None:
            torch.cuda.cudart().cudaHostUnregister(self.view.data_ptr())
            self.registered = False
        self.view = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        self.size = 0

    def invalidate(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.marker)


@dataclass
class _Job:
    """One capture in flight: the copy (``copied``), then hash, companion and marker (``done``)."""

    step: int
    slot: _Slot
    copied: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    cuda_done: Any = None  # a torch.cuda.Event recorded after the side stream's copies
    host_live: bool = True  # the thread reads live tensors on the host (else only copies made on the loop)
    error: BaseException | None = None
    copy_s: float = 0.0
    hash_s: float = 0.0


class MemoryTier:
    """The memory generations of one run folder (one process writes them: the session's)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.folder = tier_folder(self.run_dir)
        _owned_folder(root(), create=True)
        _owned_folder(self.folder, create=True)
        self.token = run_token(self.run_dir, create=True)
        self.slots = [_Slot(self.folder, i) for i in range(SLOTS)]
        self.job: _Job | None = None
        self.newest_step: int | None = None
        self.newest_slot: int | None = None
        self.stream: Any = None
        #: The last committed capture's copy and hash seconds (on the tier's thread).
        self.last_copy_s = 0.0
        self.last_hash_s = 0.0

    # ---------------------------------------------------------------- sizing
    @staticmethod
    def layout(tensors: dict[str, torch.Tensor], step: int) -> tuple[list[tuple[str, torch.Tensor]], bytes, int]:
        ordered = st.layout(tensors)
        meta = {"format": general_fmt.FORMAT, "format_version": str(general_fmt.FORMAT_VERSION), "step": str(step)}
        head = st.header_bytes(ordered, meta)
        return ordered, head, len(head) + sum(t.numel() * t.element_size() for _, t in ordered)

    def check_room(self, size: int) -> None:
        """Two slots of ``size`` bytes (less what the slots hold already) fit, with :data:`MARGIN` to spare."""
        vfs = os.statvfs(self.folder)
        free = vfs.f_bavail * vfs.f_frsize + sum(s.size for s in self.slots)
        need = SLOTS * size + MARGIN
        if free < need:
            stale = self.others()
            held = (f"; {sum(stale.values()) / 2**20:.0f} MiB of it hold memory generations of {len(stale)} other "
                    f"run folder(s) in {root()} (runs killed and not started again: remove those you will not "
                    "resume)") if stale else ""
            raise MemoryUnusable("too little shared memory for the memory tier", file=self.folder,
                                 expected=f"{need / 2**20:.0f} MiB free (two slots of {size / 2**20:.0f} MiB and a margin)",
                                 found=f"{free / 2**20:.0f} MiB",
                                 hint="enlarge /dev/shm (mount -o remount,size=...) or set RIPRESA_MEMORY_DIR; "
                                      f"the disk tier goes on{held}")

    def others(self) -> dict[str, int]:
        """Bytes held by the memory folders of other run folders of this user (name -> bytes)."""
        out: dict[str, int] = {}
        try:
            entries = list(os.scandir(root()))
        except OSError:
            return out
        for e in entries:
            if e.name == self.folder.name or not e.is_dir(follow_symlinks=False):
                continue
            total = 0
            with contextlib.suppress(OSError):
                for f in os.scandir(e.path):
                    if f.is_file(follow_symlinks=False):
                        total += f.stat(follow_symlinks=False).st_size
            out[e.name] = total
        return out

    # ---------------------------------------------------------------- capture
    def capture(self, step: int, tensors: dict[str, torch.Tensor], encoded: Any, aliases: dict[str, str],
                live: set[str] | None = None) -> None:
        """Start the capture of ``step``: ``tensors`` are copied into a free slot on a thread; those named in
        ``live`` (default: all) are the live ones, which the loop must not change before :meth:`wait_copied`."""
        self.settle()
        ordered, head, size = self.layout(tensors, step)
        slot = self.slots[1 - self.newest_slot if self.newest_slot is not None else 0]
        if slot.size != size:
            self.check_room(size)
        slot.invalidate()  # the slot's old generation is gone before a byte of it changes
        slot.ensure(size)
        job = _Job(step, slot)
        job.host_live = any(t.device.type != "cuda" and (live is None or k in live) for k, t in ordered)
        cuda = any(t.device.type == "cuda" for _, t in ordered)
        if cuda:
            self._enqueue_cuda(job, ordered, head)
        threading.Thread(target=self._run, args=(job, ordered, head, encoded, aliases, cuda),
                         name=f"ripresa-memory-{step}", daemon=False).start()
        self.job = job

    def _enqueue_cuda(self, job: _Job, ordered: Sequence[tuple[str, torch.Tensor]], head: bytes) -> None:
        """The device-to-host copies on a side stream that waits for the step's work (the loop does not wait)."""
        slot = job.slot
        slot.register()
        assert slot.view is not None
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        ready = torch.cuda.Event()
        ready.record()
        off = len(head)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for _, t in ordered:
                n = t.numel() * t.element_size()
                if n and t.device.type == "cuda":
                    slot.view[off : off + n].copy_(st.as_bytes(t), non_blocking=slot.registered)
                off += n
            job.cuda_done = torch.cuda.Event()
            job.cuda_done.record(self.stream)

    def _run(self, job: _Job, ordered: Sequence[tuple[str, torch.Tensor]], head: bytes, encoded: Any,
             aliases: dict[str, str], cuda: bool) -> None:
        slot = job.slot
        try:
            assert slot.view is not None and slot.mm is not None
            t0 = time.perf_counter()
            slot.mm[: len(head)] = head
            off = len(head)
            for _, t in ordered:
                n = t.numel() * t.element_size()
                if n and t.device.type != "cuda":
                    slot.view[off : off + n].copy_(st.as_bytes(t if t.device.type == "cpu" else t.to("cpu")))
                off += n
            if job.cuda_done is not None:
                job.cuda_done.synchronize()
            job.copy_s = time.perf_counter() - t0
            job.copied.set()  # the live tensors may change from here on
            t1 = time.perf_counter()
            h = hashlib.sha256()
            mv = memoryview(slot.mm)
            try:
                for a in range(0, slot.size, PIECE):
                    h.update(mv[a : a + PIECE])
            finally:
                mv.release()
            sha = h.hexdigest()
            doc = general_fmt.companion_doc(general_name(job.step), sha, slot.size, job.step, len(ordered), aliases, encoded)
            comp = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
            _write_small(slot.companion, comp)
            marker = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": job.step, "boot_id": boot_id(),
                      "uid": os.geteuid(), "run": self.token, "pid": os.getpid(), "time": round(time.time(), 3),
                      "tensors": {"size": slot.size, "sha256": sha},
                      "companion": {"size": len(comp), "sha256": hashlib.sha256(comp).hexdigest()}}
            _write_small(slot.marker, json.dumps(marker, indent=1).encode() + b"\n")
            job.hash_s = time.perf_counter() - t1
        except BaseException as exc:  # reported by settle() on the loop
            job.error = exc
            slot.invalidate()
        finally:
            job.copied.set()
            job.done.set()

    def wait_copied(self) -> float:
        """Block until the in-flight capture no longer reads the live tensors; the seconds waited.
        On CUDA the current stream waits for the side stream instead (the host does not wait)."""
        job = self.job
        if job is None or job.copied.is_set():
            return 0.0
        if job.cuda_done is not None:
            torch.cuda.current_stream().wait_event(job.cuda_done)  # the device's next kernels wait, not the host
            if not job.host_live:
                return 0.0
        t0 = time.perf_counter()
        job.copied.wait()
        return time.perf_counter() - t0

    def settle(self) -> float:
        """Wait for the in-flight capture to end (committed, or failed: raised as :class:`MemoryUnusable`)."""
        job = self.job
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        job.done.wait()
        waited = time.perf_counter() - t0
        self.job = None
        if job.error is not None:
            exc = job.error
            if isinstance(exc, MemoryUnusable):
                raise exc
            raise MemoryUnusable(f"a memory capture failed: {type(exc).__name__}: {exc}"[:300], file=job.slot.tensors,
                                 hint="the disk tier goes on") from exc
        self.newest_step, self.newest_slot = job.step, job.slot.index
        self.last_copy_s, self.last_hash_s = job.copy_s, job.hash_s
        return waited

    def invalidate(self) -> None:
        """Every slot's marker removed (after the in-flight capture ends): no memory generation is left."""
        with contextlib.suppress(RipresaError):
            self.settle()
        for s in self.slots:
            s.invalidate()
        self.newest_step = self.newest_slot = None

    def close(self, *, remove: bool) -> None:
        """Let the in-flight capture end; unmap the slots; with ``remove`` delete the tier's folder (a normal end)."""
        with contextlib.suppress(RipresaError):
            self.settle()
        for s in self.slots:
            s.close()
        if remove:
            discard(self.run_dir)


# -------------------------------------------------------------------- resume side
@dataclass
class Found:
    """A memory generation that passed every check: its step, tensors in file order, companion document."""

    step: int
    ordered: list[tuple[str, torch.Tensor]]
    doc: dict[str, Any]
    slot: Path
    written: float


def _marker(path: Path) -> dict[str, Any]:
    raw = read_small(path, "memory tier marker", MAX_MARKER_BYTES, error=IntegrityError)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError("a memory marker is not JSON", file=path, found=str(exc)[:120]) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise IntegrityError("not a ripresa memory marker", file=path, expected=f"{FORMAT} {FORMAT_VERSION}",
                             found=str(doc)[:120] if not isinstance(doc, dict) else str(doc.get("format"))[:80])
    checked_number(doc.get("step"), file=path, field="step", lo=0, hi=2**62)
    checked_number(doc.get("uid"), file=path, field="uid", lo=0, hi=2**32)
    for part in ("tensors", "companion"):
        rec = doc.get(part)
        if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str) or len(rec["sha256"]) != 64:
            raise IntegrityError(f"a memory marker lacks its {part} record", file=path, expected="{size, sha256}")
        checked_number(rec.get("size"), file=path, field=f"{part}.size", lo=0, hi=2**50)
    return doc


def _trusted(doc: dict[str, Any], token: str | None) -> str | None:
    """Why a marker's generation must not be used here (None: it may be)."""
    if doc.get("uid") != os.geteuid():
        return f"it belongs to another user (uid {doc.get('uid')})"
    mine = boot_id()
    if mine is None or doc.get("boot_id") != mine:
        return "it was written before the machine's last reboot (boot id differs)"
    if token is None or doc.get("run") != token:
        return "it belongs to another run of this folder's path"
    return None


def _markers(run_dir: str | Path) -> tuple[Path, list[tuple[int, dict[str, Any] | None, str | None]]] | None:
    """The tier's folder of ``run_dir`` and each present slot's (index, marker or None, why it is not usable);
    None when the folder is absent. Raises :class:`MemoryUnusable` for a folder of another user."""
    folder = tier_folder(run_dir)
    if not _owned_folder(root(), create=False) or not _owned_folder(folder, create=False):
        return None
    token = run_token(Path(run_dir), create=False)
    out: list[tuple[int, dict[str, Any] | None, str | None]] = []
    for i in range(SLOTS):
        mk = folder / f"slot{i}.marker"
        if not os.path.lexists(mk):
            continue
        try:
            doc = _marker(mk)
        except RipresaError as exc:
            out.append((i, None, exc.message))
            continue
        out.append((i, doc, _trusted(doc, token)))
    return folder, out


def newest(run_dir: str | Path, *, above: int | None) -> tuple[Found | None, list[str]]:
    """The newest trusted, intact memory generation of ``run_dir`` newer than step ``above``; and why others were
    not used (one line each). Reads nothing of another user's folder; never raises for a damaged slot."""
    notes: list[str] = []
    try:
        seen = _markers(run_dir)
    except MemoryUnusable:  # another user's folder: not read (the session said so once, turning the tier off)
        return None, notes
    if seen is None:
        return None, notes
    folder, slots = seen
    candidates: list[tuple[int, int, dict[str, Any]]] = []
    for i, doc, why in slots:
        if doc is None:
            notes.append(f"memory slot {i} not used: {why}")
        elif why is not None:
            notes.append(f"memory generation of step {doc['step']} not used: {why}")
        else:
            candidates.append((doc["step"], i, doc))
    for step, i, doc in sorted(candidates, key=lambda c: c[0], reverse=True):
        if above is not None and step <= above:
            break
        try:
            found = _read_slot(folder, i, doc)
        except RipresaError as exc:
            notes.append(f"memory generation of step {step} not used: {exc.message}")
            continue
        return found, notes
    return None, notes


def peek(run_dir: str | Path) -> list[dict[str, Any]]:
    """The memory generations of ``run_dir`` by their markers alone (no slot read, no hash): for ``ripresa
    inspect``. Each: step, slot, bytes, written (unix time), and ``usable`` or the reason it is not."""
    try:
        seen = _markers(run_dir)
    except MemoryUnusable as exc:
        return [{"step": None, "slot": None, "bytes": None, "written": None, "usable": False, "reason": exc.message}]
    out = []
    for i, doc, why in (seen[1] if seen is not None else []):
        if doc is None:
            out.append({"step": None, "slot": i, "bytes": None, "written": None, "usable": False, "reason": why})
            continue
        written = doc.get("time")
        out.append({"step": doc["step"], "slot": i, "bytes": doc["tensors"]["size"] + doc["companion"]["size"],
                    "written": written if isinstance(written, int | float) else None, "usable": why is None,
                    "reason": why})
    return sorted(out, key=lambda r: -1 if r["step"] is None else r["step"])


def _read_slot(folder: Path, i: int, doc: dict[str, Any]) -> Found:
    f, c = folder / f"slot{i}.safetensors", folder / f"slot{i}.json"
    header, tensors, _sha = st.read(f, expected_sha256=doc["tensors"]["sha256"])
    if header.file_size != doc["tensors"]["size"] or header.metadata.get("step") != str(doc["step"]):
        raise IntegrityError("a memory slot does not hold the step its marker names", file=f,
                             expected=f"step {doc['step']}, {doc['tensors']['size']} bytes",
                             found=f"step {header.metadata.get('step')}, {header.file_size} bytes")
    raw = read_small(c, "memory tier companion", general_fmt.MAX_COMPANION_BYTES, error=IntegrityError)
    if hashlib.sha256(raw).hexdigest() != doc["companion"]["sha256"]:
        raise IntegrityError("a memory companion changed after its marker was written", file=c)
    try:
        comp = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError("a memory companion is not JSON", file=c, found=str(exc)[:120]) from exc
    general_fmt.validate_envelope(comp, c)
    if comp["tensors"]["step"] != doc["step"] or comp["tensors"]["sha256"] != doc["tensors"]["sha256"]:
        raise IntegrityError("a memory companion names another tensor file", file=c)
    ordered = [(e.key, tensors[e.key]) for e in header.entries]
    written = doc.get("time")
    return Found(doc["step"], ordered, comp, f, float(written) if isinstance(written, int | float) else 0.0)


def promote(found: Found, run_dir: Path, *, hmac_key: bytes | None) -> Generation:
    """Commit ``found`` into the run folder as general generation ``found.step`` (files, fsync, signature, marker
    last): the very bytes a disk save of that step writes; the resume then takes it as the newest."""
    return save_general(run_dir, found.step, found.ordered, found.doc["state"], dict(found.doc["aliases"]),
                        hmac_key=hmac_key)


def discard(run_dir: str | Path) -> None:
    """Remove the memory generations of ``run_dir`` (a normal end, a fresh start, a resume from another path);
    only a folder of this user is touched."""
    folder = tier_folder(run_dir)
    try:
        if not _owned_folder(root(), create=False) or not _owned_folder(folder, create=False):
            return
    except MemoryUnusable:
        return
    for i in range(SLOTS):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / f"slot{i}.marker")
    shutil.rmtree(folder, ignore_errors=True)
