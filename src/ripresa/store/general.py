"""The general kind: ``step_NNNNNN.safetensors`` + companion + marker, for any model and optimizer.

Files, checks and byte layout: docs/FORMAT.md ("The general format"),
:mod:`ripresa.formats.safetensors_file` and :mod:`ripresa.formats.general`. It commits through
the one protocol of every kind (:func:`~ripresa.store.commit.commit_generation`) and validates
through :func:`validate_general` (named checks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState, optimizer_record
from ..errors import BadInput, IntegrityError, RipresaError
from ..formats import general as general_fmt
from ..formats import safetensors_file as st
from ..formats.generation import Check, Checks, Generation, reason_of
from ..formats.naming import NameFormat
from ..io import auth
from ..io.fsio import StagedFile, open_run_file, read_small
from .base import BackendBase, load_full_into
from .commit import (
    Written,
    commit_generation,
    companion_checks,
    delete_files,
    malformed_companion,
    marker_checks,
    validate_state,
    with_companion,
)
from .folder import RunFolder
from .restore import Loaded, rest_proxy

#: The kind's one name (``Generation.kind``, the registry, ``format=``); ``st`` is its old name, still read.
KIND = "general"
SUFFIX = ".safetensors"
#: How general generations are named: ``step_NNNNNN.safetensors`` and ``.json``, ``.hmac``, ``.sha256`` beside it.
GENERAL_NAMES = NameFormat(SUFFIX, companion="+.json", canonical=False)


def general_name(step: int) -> str:
    return GENERAL_NAMES.name(step)


def general_paths(folder: Path, step: int) -> tuple[Path, Path, Path]:
    """(tensor file, companion, marker) of ``step`` in ``folder``."""
    f, c, mk = GENERAL_NAMES.paths(folder, step)
    assert c is not None
    return f, c, mk


def parse_general_name(name: str) -> int | None:
    return GENERAL_NAMES.parse(name) if "/" not in name else None


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
    out = GeneralValidation(Generation(step, KIND, f, c, mk, valid=False), checks.items)
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
            with checks.run("companion state"), malformed_companion(c):
                out.state = general_fmt.join_state(doc, tensors, c)
                validate_state(out.state, c)
    except RipresaError as exc:
        if raise_first:
            raise
        out.generation = Generation(step, KIND, f, c, mk, valid=False, reason=reason_of(exc), checks=tuple(checks))
        return out
    finally:
        if fd is not None:
            os.close(fd)
    out.generation = Generation(step, KIND, f, c, mk, valid=True, size=header.file_size, files={f.name: f_sha, c.name: c_sha},
                                deep_checked=deep or load, signature_verified=key is not None, checks=tuple(checks))
    return out


def save_general(folder: Path, step: int, tensors: dict[str, Any], encoded_state: Any, aliases: dict[str, str], *,
                 hmac_key: bytes | None) -> Generation:
    """Write general generation ``step`` durably (files, folder fsync, signature, marker last); return its check."""
    f, c, mk = general_paths(folder, step)
    meta = {"format": general_fmt.FORMAT, "format_version": str(general_fmt.FORMAT_VERSION), "step": str(step)}

    def write() -> Written:
        with StagedFile(f) as ff:
            st.write(ff, tensors, meta)
            f_digest = ff.finish()
            doc = general_fmt.companion_doc(f.name, f_digest.sha256, f_digest.size, step, len(tensors), aliases,
                                            encoded_state)
            return with_companion(step, ff, f_digest, c, doc)

    return commit_generation(folder, step, marker=mk, signature=auth.signature_path(f), key=hmac_key, write=write,
                             check=lambda: validate_general(folder, step).generation, what="general generation", file=f)


class GeneralBackend(BackendBase):
    """``step_NNNNNN.safetensors`` + companion + marker: any model, any optimizer (written by single-process and
    DDP sessions; every mode resumes it, an FSDP2 one loads it whole and shards it)."""

    kind = KIND
    label = ".safetensors generation"
    written_by = ".safetensors ones are written for states a .bin cannot hold (format='general' or 'auto')"
    background = True
    names = GENERAL_NAMES

    def _key(self) -> bytes | None:
        return self.store.signature_key()

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
        return Loaded(v.state, True, load_full_into, gen.companion, validated=True)  # companion state: validate_saved_state

    def __init__(self, store: RunFolder) -> None:
        super().__init__(store)
        self._staging: torch.Tensor | None = None  # reused by background saves (one in flight at most)
        self._checked: dict[int, st.Header | None] = {}  # step -> header parsed by check_to_resume

    def commit_for(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
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
            return save_general(folder, step, tensors, encoded, aliases, hmac_key=key)

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
        delete_files(mk, auth.signature_path(f), f, c)
