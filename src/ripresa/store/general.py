"""General generations: ``step_NNNNNN.safetensors`` + companion + marker, for any model and optimizer (docs/FORMAT.md).

One generation = three files (four with a signature)::

    step_NNNNNN.safetensors          every tensor of the state (safetensors layout)
    step_NNNNNN.safetensors.json     the companion: the rest, each tensor a reference to its key
    step_NNNNNN.safetensors.hmac     optional HMAC signature (as for a .bin generation)
    step_NNNNNN.safetensors.sha256   the commit marker, written last: two sha256sum lines

The same commit protocol as a ``.bin`` generation (:mod:`ripresa.store.store`):
both files streamed through :class:`~ripresa.io.fsio.StagedFile` (hashed
while written, ``fsync``'d), renamed, the folder ``fsync``'d, the signature,
then the marker; retention after the new generation is checked. One
validation path (:func:`validate_general`) with named checks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState, optimizer_record
from ..errors import BadInput, IntegrityError, RipresaError
from ..formats import companion as companion_fmt
from ..formats import general as general_fmt
from ..formats import safetensors_file as st
from ..formats.generation import Check, Checks, Generation, reason_of
from ..io import auth
from ..io.fsio import (
    StagedFile,
    fsync_dir,
    open_run_file,
    ops,
    read_small,
    sidecar_line,
    write_atomic,
)
from .backend import BinBackend, _Base, _load_full_into
from .restore import Loaded, rest_proxy
from .retention import plan_deletions
from .store import (
    CheckpointStore,
    _malformed_companion,
    _validate_state,
    companion_checks,
    marker_checks,
)

SUFFIX = ".safetensors"
_FILE = re.compile(r"^step_(\d{6,})\.safetensors(?:\.json|\.sha256|\.hmac)?$")


def general_name(step: int) -> str:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"bad step {step!r}")
    return f"step_{step:06d}{SUFFIX}"


def general_paths(folder: Path, step: int) -> tuple[Path, Path, Path]:
    """(tensor file, companion, marker) of ``step`` in ``folder``."""
    f = Path(folder) / general_name(step)
    return f, f.with_name(f.name + ".json"), f.with_name(f.name + ".sha256")


def parse_general_name(name: str) -> int | None:
    m = re.fullmatch(r"step_(\d{6,})\.safetensors", name)
    return int(m.group(1)) if m else None


@dataclass
class GeneralValidation:
    generation: Generation
    checks: list[Check]
    state: Any = None
    header: st.Header | None = None  # the tensor file's validated header (reused by a load: docs/FORMAT.md)


def validate_general(folder: Path, step: int, *, deep: bool = False, load: bool = False, key: bytes | None = None,
                     raise_first: bool = False, header: st.Header | None = None) -> GeneralValidation:
    """The one validation of a general generation: named checks, each file read once.

    ``marker present``, ``marker format``, ``signature`` (with ``key``),
    ``tensor header`` (the hostile-safe header checks of
    :func:`~ripresa.formats.safetensors_file.parse_header`), ``tensor step``
    (the header's metadata), ``companion sha256``, ``companion schema``,
    ``companion record`` (the companion's ``tensors`` record against the marker
    and the header); with ``deep`` or ``load``: ``tensor sha256`` (every tensor
    read while hashed) and ``companion state`` (references resolved, the state
    passes :func:`~ripresa.core.state.validate_saved_state`).

    A deep check or a load opens the tensor file once and reads it through that
    descriptor; ``header`` (what an earlier check of this generation parsed) is
    reused only when the file's header bytes are still exactly those, else the
    ``tensor header`` check fails.
    """
    f, c, mk = general_paths(Path(folder), step)
    checks = Checks()
    out = GeneralValidation(Generation(step, "st", f, c, mk, valid=False), checks.items)
    fd: int | None = None
    try:
        f_sha, c_sha = marker_checks(checks, f, c, mk, step, key)
        with checks.run("tensor header") as found:
            if deep or load:
                fd = open_run_file(f, "safetensors file", error=IntegrityError)
                header = st.header_fd(fd, f, header)
            else:
                header = header if header is not None else st.read_header(f)
            out.header = header
            found["found"] = {"tensors": len(header.entries), "size": header.file_size}
        with checks.run("tensor step", expected={"format": general_fmt.FORMAT, "step": str(step)}) as found:
            got = {"format": header.metadata.get("format"), "step": header.metadata.get("step")}
            if got != {"format": general_fmt.FORMAT, "step": str(step)}:
                raise IntegrityError("the safetensors file names another format or step", file=f,
                                     expected={"format": general_fmt.FORMAT, "step": str(step)}, found=got)
            found["found"] = got
        doc = companion_checks(
            checks, c, c_sha, lambda path: read_small(path, "companion", general_fmt.MAX_COMPANION_BYTES, error=IntegrityError),
            general_fmt.FORMAT, general_fmt.validate_envelope)
        want = {"name": f.name, "sha256": f_sha, "size": header.file_size, "step": step, "count": len(header.entries)}
        with checks.run("companion record", expected=want) as found:
            got_rec = {k: doc["tensors"].get(k) for k in want}
            if got_rec != want:
                raise IntegrityError("companion and safetensors file disagree", file=c, expected=want, found=got_rec)
            found["found"] = got_rec
        if fd is not None:
            with checks.run("tensor sha256", expected=f_sha) as found:
                tensors, _ = st.read_fd(fd, f, header, expected_sha256=f_sha)
                found["found"] = f_sha
            with checks.run("companion state"), _malformed_companion(c):
                out.state = general_fmt.join_state(doc, tensors, c)
                _validate_state(out.state, c)
    except RipresaError as exc:
        if raise_first:
            raise
        out.generation = Generation(step, "st", f, c, mk, valid=False, reason=reason_of(exc), checks=tuple(checks))
        return out
    finally:
        if fd is not None:
            os.close(fd)
    out.generation = Generation(step, "st", f, c, mk, valid=True, size=header.file_size, files={f.name: f_sha, c.name: c_sha},
                                deep_checked=deep or load, signature_verified=key is not None, checks=tuple(checks))
    return out


def save_general(folder: Path, step: int, tensors: dict[str, Any], encoded_state: Any, aliases: dict[str, str], *,
                 hmac_key: bytes | None) -> Generation:
    """Write general generation ``step`` durably (files, folder fsync, signature, marker last); return its check."""
    f, c, mk = general_paths(folder, step)
    sig = auth.signature_path(f)
    if os.path.lexists(mk) or os.path.lexists(sig):  # re-saving a step: uncommit the old one first
        for old in (mk, sig):
            if os.path.lexists(old):
                ops.unlink(old)
        fsync_dir(folder)
    meta = {"format": general_fmt.FORMAT, "format_version": str(general_fmt.FORMAT_VERSION), "step": str(step)}
    with StagedFile(f) as ff:
        st.write(ff, tensors, meta)
        f_digest = ff.finish()
        doc = general_fmt.companion_doc(f.name, f_digest.sha256, f_digest.size, step, len(tensors), aliases,
                                        encoded_state)
        with StagedFile(c) as fc:
            fc.write(companion_fmt.dumps(doc))
            c_digest = fc.finish()
            ff.publish()
            fc.publish()
    fsync_dir(folder)
    if hmac_key is not None:
        write_atomic(sig, [auth.signature_line(hmac_key, step, f.name, f_digest.sha256, c.name, c_digest.sha256)])
    write_atomic(mk, [sidecar_line(f_digest, f.name), sidecar_line(c_digest, c.name)])
    gen = validate_general(folder, step).generation
    if not gen.valid:
        raise IntegrityError(f"general generation {step} failed its check right after the save", file=f, found=gen.reason)
    return gen


class GeneralBackend(_Base):
    """``step_NNNNNN.safetensors`` + companion + marker: any model, any optimizer (written by single-process and
    DDP sessions; every mode resumes it, an FSDP2 one loads it whole and shards it)."""

    kind = "st"
    label = ".safetensors generation"
    written_by = ".safetensors ones are written for states a .bin cannot hold (format='general' or 'auto')"
    background = True

    def step_of(self, path: Path) -> int | None:
        return parse_general_name(Path(path).name)

    def steps_on_disk(self) -> list[int]:
        steps = set()
        for entry in os.scandir(self.folder):
            m = _FILE.match(entry.name)
            if m:
                steps.add(int(m.group(1)))
        return sorted(steps)

    def _key(self) -> bytes | None:
        return self.store.hmac_key if self.store.require_signature else None

    def check(self, step: int, *, deep: bool = False) -> Generation:
        return validate_general(self.folder, step, deep=deep, key=self._key()).generation

    def check_to_resume(self, step: int) -> Generation:
        """The resume's check (load() hashes the tensor file while reading it); its parsed header is kept for
        the load, which reuses it only if the file's header bytes are unchanged (one parse per resume)."""
        v = validate_general(self.folder, step, key=self._key())
        self._checked[step] = v.header
        return v.generation

    def at_path(self, path: Path) -> Generation:
        src = Path(path)
        step = self.step_of(src)
        if step is None:
            raise BadInput("not a step_NNNNNN.safetensors", file=src, expected="step_NNNNNN.safetensors", found=src.name)
        gen = validate_general(src.parent, step, key=self._key()).generation
        if not gen.valid:
            raise IntegrityError(f"cannot resume from .safetensors generation {step}: {gen.reason}", file=src,
                                 hint="`ripresa inspect` shows the valid generations")
        return gen

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        known = self._checked.pop(gen.step, None) if gen.path.parent == self.folder else None
        v = validate_general(gen.path.parent, gen.step, load=True, key=self._key(), raise_first=True, header=known)
        return Loaded(v.state, True, _load_full_into, gen.companion, validated=True)  # companion state: validate_saved_state

    def __init__(self, store: CheckpointStore) -> None:
        super().__init__(store)
        self._staging: torch.Tensor | None = None  # reused by background saves (one in flight at most)
        self._checked: dict[int, st.Header | None] = {}  # step -> header parsed by check_to_resume

    def capture(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        """Capture ``state`` now: everything but model and optimizer as a snapshot, their tensors by reference.

        For a background save (``stage`` given: the session's writer, which has
        finished the previous save) every tensor is copied now into one reused
        staging buffer sized from the state (pinned with CUDA) and the commit
        streams the copies; a synchronous save writes the live CPU tensors at
        once, before training goes on (as a ``.bin`` save writes its views).
        """
        snap = rest_proxy(state).snapshot(progress, extra)  # small: copies of scheduler, data, streams, objects
        snap["model"] = dict(state.model.state_dict(keep_vars=True))
        snap["optimizer"] = state.optimizer.state_dict() if state.optimizer is not None else None
        snap["optimizer_params"] = optimizer_record(state.model, state.optimizer)  # what the resume checks it against
        tensors, encoded, aliases = general_fmt.split_state(snap, general_fmt.model_aliases(state.model),
                                                            to_cpu=stage is None)
        if stage is not None:
            tensors = self._stage(tensors)
        folder, key = self.folder, self.store.hmac_key

        def commit() -> Generation:
            gen = save_general(folder, step, tensors, encoded, aliases, hmac_key=key)
            retain_across_kinds(self.store, newest_valid=step)
            return gen

        return commit

    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the staging buffer (in file order, each at a multiple of its item size)."""
        ordered = st.layout(tensors)
        total = sum(t.numel() * t.element_size() for _, t in ordered)
        if self._staging is None or self._staging.numel() < total:
            self._staging = None
            self._staging = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        out: dict[str, torch.Tensor] = {}
        off, on_cuda = 0, False
        for k, t in ordered:
            n = t.numel() * t.element_size()
            dst = self._staging[off : off + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
            on_cuda |= t.device.type == "cuda"
            dst.copy_(t, non_blocking=t.device.type == "cuda")
            out[k] = dst
            off += n
        if on_cuda:
            torch.cuda.synchronize()
        return out

    def delete(self, step: int) -> None:
        """Remove a generation, marker first (it reads as uncommitted if interrupted)."""
        f, c, mk = general_paths(self.folder, step)
        for p in (mk, auth.signature_path(f), f, c):
            try:
                ops.unlink(p)
            except FileNotFoundError:
                pass


def open_general(store: CheckpointStore) -> GeneralBackend:
    return GeneralBackend(store)


def check_general_file(path: Path) -> None:
    """``ripresa inspect --require-signature step_NNNNNN.safetensors``: the generation's deep check with the
    signature required; :class:`~ripresa.io.auth.SignatureError` (exit 1) when it fails."""
    p = Path(path)
    step = parse_general_name(p.name.removesuffix(".json"))
    if step is None:
        raise BadInput("not a general generation's file", file=p, expected="step_NNNNNN.safetensors", found=p.name)
    key = auth.load_key()
    if key is None:
        raise auth.missing_key_error("--require-signature")
    gen = validate_general(p.parent, step, deep=True, key=key).generation
    if not gen.valid:
        raise auth.SignatureError(f"generation {step} is not trusted under --require-signature: {gen.reason}",
                                  file=p, hint="an unsigned, mis-signed or damaged generation is never trusted")


def retain_across_kinds(store: CheckpointStore, *, newest_valid: int) -> list[int]:
    """Apply ``store.retention`` to the valid ``.bin`` and general generations together (docs/FORMAT.md,
    "Retention across kinds"): one sequence of steps; each dropped one is deleted by its own kind, marker
    first; ``.dcp`` folders are not touched, nor a step the store pins (a mirror's pending upload). Returns the
    steps deleted."""
    kinds: dict[int, list[_Base]] = {}
    for backend in (BinBackend(store), GeneralBackend(store)):
        for g in backend.generations():
            if g.valid:
                kinds.setdefault(g.step, []).append(backend)
    doomed = plan_deletions(sorted(kinds), store.retention, newest_valid=newest_valid,
                            protected=store.protected_steps(sorted(kinds)),  # a mirror's pending uploads
                            metrics=store.step_metrics())  # KeepBest's values
    for step in doomed:
        for backend in kinds[step]:
            backend.delete(step)
    if doomed:
        fsync_dir(store.folder)
    return doomed
