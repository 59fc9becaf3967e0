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

from ..core.state import Progress, TrainingState
from ..errors import IntegrityError, RipresaError
from ..formats import general as general_fmt
from ..formats import safetensors_file as st
from ..formats.generation import Check, Checks, Generation, reason_of
from ..formats.naming import NameFormat
from ..io import auth
from ..io.fsio import open_run_file, read_small
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
from .restore import Loaded
from .shards import ShardsBackend, capture_tensors
from .tensor_writer import StagingArea, TensorFileWriter, run_writers

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


def save_general(folder: Path, step: int, tensors: dict[str, Any] | list[tuple[str, Any]], encoded_state: Any,
                 aliases: dict[str, str], *, hmac_key: bytes | None, writer: TensorFileWriter | None = None) -> Generation:
    """Write general generation ``step`` durably (files, folder fsync, signature, marker last); return its check.

    ``writer``: the tensor file's writer when a save with a staging budget started it already (its live
    head written while the loop waited); else one is run here on ``tensors``.
    """
    f, c, mk = general_paths(folder, step)
    meta = {"format": general_fmt.FORMAT, "format_version": str(general_fmt.FORMAT_VERSION), "step": str(step)}
    if writer is None:
        ordered = st.layout(tensors) if isinstance(tensors, dict) else list(tensors)
        writer = TensorFileWriter(f, ordered, meta)

    def write() -> Written:
        (f_digest,) = run_writers([writer])
        assert writer.file is not None
        with writer.file as ff:
            doc = general_fmt.companion_doc(f.name, f_digest.sha256, f_digest.size, step, len(writer.tensors), aliases,
                                            encoded_state)
            return with_companion(step, ff, f_digest, c, doc)

    try:
        return commit_generation(folder, step, marker=mk, signature=auth.signature_path(f), key=hmac_key, write=write,
                                 check=lambda: validate_general(folder, step).generation, what="general generation", file=f)
    except BaseException:
        writer.discard()
        raise


class GeneralBackend(BackendBase):
    """``step_NNNNNN.safetensors`` + companion + marker: any model, any optimizer (written by single-process and
    DDP sessions; every mode resumes it, an FSDP2 one loads it whole and shards it)."""

    kind = KIND
    label = ".safetensors generation"
    written_by = ".safetensors ones are written for states a .bin cannot hold (format='general' or 'auto')"
    background = True
    names = GENERAL_NAMES
    #: the kinds its saves write: a state of ``SaveOptions.shard_threshold`` bytes or more goes to ``.shards``
    writes = (KIND, "shards")

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
        return self.checked_at(path, lambda folder, step: validate_general(folder, step, key=self._key()).generation)

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        known = self._checked.pop(gen.step, None) if gen.path.parent == self.folder else None
        v = validate_general(gen.path.parent, gen.step, load=True, key=self._key(), raise_first=True, header=known)
        return Loaded(v.state, True, load_full_into, gen.companion, validated=True)  # companion state: validate_saved_state

    def __init__(self, store: RunFolder) -> None:
        super().__init__(store)
        self.staging = StagingArea()  # reused by background saves (one in flight at most), shared with the shards
        self.shards = ShardsBackend(store, self.staging)
        self._checked: dict[int, st.Header | None] = {}  # step -> header parsed by check_to_resume
        self._last_model: dict[str, torch.Tensor] | None = None

    def commit_for(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                   stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        """Capture ``state`` now: everything but model and optimizer as a snapshot, their tensors by reference.

        Tensors of ``SaveOptions.shard_threshold`` bytes or more go to a
        sharded generation (:mod:`ripresa.store.shards`). For a background
        save (``stage`` given: the session's writer, which has finished the
        previous save) the tensors are copied now into one reused staging
        buffer, at most ``SaveOptions.staging_budget`` bytes of them (the rest
        is written before this returns) and the commit streams the copies; a
        synchronous save writes the live CPU tensors at once, before training
        goes on (as a ``.bin`` save writes its views).
        """
        opts = self.store.save_options
        tensors, encoded, aliases = capture_tensors(state, progress, extra, to_cpu=stage is None, plain_model_keys=False)
        count = opts.shard_count(sum(t.numel() * t.element_size() for t in tensors.values()))
        key_of = general_fmt.plain_key_of if count else general_fmt.key_of
        model_aliases = general_fmt.model_aliases(state.model)
        names = {n: key_of(("model", model_aliases.get(n, n))) for n, _ in state.model.named_parameters()}
        if count:  # a sharded generation keys model tensors by their own names (Hugging Face loaders)
            tensors, encoded, aliases = capture_tensors(state, progress, extra, to_cpu=stage is None, plain_model_keys=True)
            commit = self.shards.commit_tensors(step, tensors, encoded, aliases, count, background=stage is not None)
            self._last_model = self._staged_model(state, names) if stage is not None else None
            return commit
        folder, key = self.folder, self.store.hmac_key
        ordered = st.layout(tensors)
        writer = None
        if stage is not None:
            (ordered,), (live,) = self.staging.stage([ordered], opts.staging_budget)
            if live:  # the part beyond the staging budget is written now, while the loop waits
                meta = {"format": general_fmt.FORMAT, "format_version": str(general_fmt.FORMAT_VERSION), "step": str(step)}
                writer = TensorFileWriter(general_paths(folder, step)[0], ordered, meta, live=live).start()
                writer.wait_live()
        self._last_model = self._staged_model(state, names) if stage is not None else None

        def commit() -> Generation:
            return save_general(folder, step, ordered, encoded, aliases, hmac_key=key, writer=writer)

        return commit

    def staged_model(self) -> dict[str, torch.Tensor] | None:
        """The model's parameters of the last background capture, as views of the staged copy (valid until the
        next save stages), by parameter name (``on_staged``'s weights, docs/API.md); None when the last capture
        staged none, or not all of them."""
        return self._last_model

    def _staged_model(self, state: TrainingState, names: dict[str, str]) -> dict[str, torch.Tensor] | None:
        staged = self.staging.take(names)
        if staged is None:
            return None
        if any(staged[n].dtype != p.dtype or staged[n].shape != p.shape for n, p in state.model.named_parameters()):
            return None  # a dtype stored as its raw bytes: not the model's tensor as such
        return staged

    def clean(self) -> list[Path]:
        return self.shards.clean()  # a sharded save's partial folder (its files' temporaries go with it)

    def delete(self, step: int) -> None:
        """Remove a generation, marker first (it reads as uncommitted if interrupted)."""
        f, c, mk = general_paths(self.folder, step)
        delete_files(mk, auth.signature_path(f), f, c)
