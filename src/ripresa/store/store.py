"""The ``.bin`` kind (``step_NNNNNN.bin`` + companion + marker) and :class:`CheckpointStore`, its public face.

A :class:`CheckpointStore` is a run folder (:class:`~ripresa.store.folder.RunFolder`: lock, key,
signature policy, retention, pins) plus the ``.bin`` generations' save, list, check and load;
the other kinds live beside it (:mod:`ripresa.store.general`, :mod:`ripresa.store.dcp`) and all
commit through :func:`~ripresa.store.commit.commit_generation`. Files, commit protocol and
checks: docs/FORMAT.md; the kinds and the registry: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, RipresaError
from ..formats import companion as companion_fmt
from ..formats.andrea_bin import BIN_NAMES, BinArrays, BinContents, read_bin, read_header, write_bin
from ..formats.generation import Check, Checks, Generation, reason_of
from ..io import auth
from ..io.fsio import StagedFile, read_small, sha256_file
from .commit import (
    CheckpointWarning,
    Written,
    commit_generation,
    companion_checks,
    delete_files,
    malformed_companion,
    marker_checks,
    newest_valid,
    not_used,
    read_marker,
    validate_state,
    with_companion,
)
from .folder import RunFolder

__all__ = ["BIN_NAMES", "CheckpointStore", "CheckpointWarning", "Generation", "Validation", "companion_checks",
           "delete_bin", "generation_paths", "marker_checks", "newest_valid", "not_used", "read_marker", "save_bin",
           "validate_generation"]


def generation_paths(folder: Path, step: int) -> tuple[Path, Path, Path]:
    """(.bin, companion .json, marker) of ``step`` in ``folder``."""
    b, c, mk = BIN_NAMES.paths(folder, step)
    assert c is not None
    return b, c, mk


def save_bin(folder: Path, step: int, arrays: BinArrays, companion_state: dict[str, Any], *,
             hmac_key: bytes | None, key: bytes | None) -> Generation:
    """Write ``.bin`` generation ``step`` durably through the one commit protocol; return its check.

    ``hmac_key`` signs it; ``key`` (the run's signature policy) verifies the re-check.
    """
    b, c, mk = generation_paths(folder, step)
    encoded_state = companion_fmt.encode_tree(companion_state)

    def write() -> Written:
        with StagedFile(b) as fb:
            header = write_bin(fb, step, *arrays)
            bin_digest = fb.finish()
            doc = {
                "format": companion_fmt.FORMAT,
                "format_version": companion_fmt.FORMAT_VERSION,
                "bin": {"name": b.name, "sha256": bin_digest.sha256, "size": bin_digest.size,
                        "step": header.step, "n_params": header.n_params},
                "state": encoded_state,
            }
            return with_companion(step, fb, bin_digest, c, doc)

    return commit_generation(folder, step, marker=mk, signature=auth.signature_path(b), key=hmac_key, write=write,
                             check=lambda: validate_generation(folder, step, key=key).generation,
                             what="generation", file=b)


def delete_bin(folder: Path, step: int) -> None:
    """Remove a ``.bin`` generation, marker first (it reads as uncommitted if interrupted)."""
    b, c, mk = generation_paths(folder, step)
    delete_files(mk, auth.signature_path(b), b, c)


class CheckpointStore(RunFolder):
    """Generations of a run folder: save (commit protocol + retention), list, verify, load.

    The run folder (:class:`~ripresa.store.folder.RunFolder`: its arguments, the same here) and its ``.bin``
    generations.
    """

    def __enter__(self) -> CheckpointStore:
        return self

    # ----------------------------------------------------------------- listing
    def steps_on_disk(self) -> list[int]:
        """Steps that have any ``.bin`` generation file (committed or not), ascending."""
        return BIN_NAMES.steps(self.folder)

    def check(self, step: int, *, deep: bool = False) -> Generation:
        """Validate one generation (:func:`validate_generation`); ``deep`` re-hashes the whole ``.bin``."""
        return validate_generation(self.folder, step, deep=deep, key=self.signature_key()).generation

    def generations(self, *, deep: bool = False) -> list[Generation]:
        """Every generation on disk, ascending, each with its validity."""
        return [self.check(s, deep=deep) for s in self.steps_on_disk()]

    def latest_valid(self, *, deep: bool = True, warn: bool = True) -> Generation | None:
        """The newest committed, verified generation; warn about each newer one skipped."""
        return newest_valid((("generation", self.check(s, deep=deep)) for s in reversed(self.steps_on_disk())), warn=warn)

    # ----------------------------------------------------------------- saving
    def save(self, step: int, arrays: BinArrays, companion_state: dict[str, Any]) -> Generation:
        """Write generation ``step`` durably, then apply retention to the ``.bin`` ones. Synchronous.

        ``arrays`` are the ``.bin``'s regions (views or staging buffers);
        ``companion_state`` is ``TrainingState.snapshot(include_parameters=False)``.
        On any failure the temporaries are removed, the error is raised, and
        every earlier generation is untouched.
        """
        self.require_writer()
        gen = save_bin(self.folder, step, arrays, companion_state, hmac_key=self.hmac_key, key=self.signature_key())
        self.apply_retention(newest_valid=step)
        return gen

    def apply_retention(self, *, newest_valid: int, protected: tuple[int, ...] = ()) -> list[int]:
        """Delete ``.bin`` generations the policy drops (never ``newest_valid``, nor a pinned one); return their
        steps (:meth:`RunFolder.retain` over this kind)."""
        return self.retain([self], newest_valid=newest_valid, protected=protected)

    def delete(self, step: int) -> None:
        """Remove a generation, marker first (it reads as uncommitted if interrupted)."""
        self.require_writer()
        delete_bin(self.folder, step)

    # ----------------------------------------------------------------- loading
    def load(self, step: int, *, expected_n: int | None = None, check_finite: bool = False) -> tuple[BinContents, dict[str, Any]]:
        """Read and verify generation ``step``: (.bin contents, decoded companion state).

        The same named checks as :meth:`check` (:func:`validate_generation`),
        the ``.bin`` hashed while it is read into memory (one pass) and the
        companion state decoded and validated. Raises on the first failure.
        """
        v = validate_generation(self.folder, step, load=True, expected_n=expected_n, check_finite=check_finite,
                                key=self.signature_key(), raise_first=True)
        assert v.contents is not None
        return v.contents, v.state


@dataclass
class Validation:
    """What :func:`validate_generation` found: the named checks, the record, and what it read."""

    generation: Generation
    checks: list[Check]
    doc: dict[str, Any] | None = None
    contents: BinContents | None = None
    state: Any = None


def validate_generation(folder: Path, step: int, *, deep: bool = False, load: bool = False, key: bytes | None = None,
                        expected_n: int | None = None, check_finite: bool = False,
                        raise_first: bool = False) -> Validation:
    """The one validation of a ``.bin`` generation: named checks, each file read once.

    In order: ``marker present``, ``marker format`` (two ``sha256sum`` lines
    naming this generation's files), ``signature`` (only with ``key``: before
    anything else is parsed), ``bin header`` (size against ``n_params``),
    ``bin step``, ``companion sha256``, ``companion schema`` (the envelope,
    parsed from the same bytes that were hashed), ``companion record`` (the
    companion's ``bin`` record against the marker and the header); with
    ``deep`` or ``load``: ``bin sha256`` (``load`` reads the ``.bin`` into
    memory while hashing it) and ``companion state`` (the decoded state
    passes :func:`~ripresa.core.state.validate_saved_state`: one progress
    instant, schema, identity fields). The first failure ends the validation:
    the generation is invalid with that check's reason, or, with
    ``raise_first``, its error is raised. ``CheckpointStore.check``,
    ``CheckpointStore.load`` and ``ripresa inspect`` all call this.
    """
    b, c, mk = generation_paths(Path(folder), step)
    checks = Checks()
    out = Validation(Generation(step, "bin", b, c, mk, valid=False), checks.items)
    try:
        bin_sha, comp_sha = marker_checks(checks, b, c, mk, step, key)
        with checks.run("bin header") as f:
            header = read_header(b, expected_n=expected_n)
            f["found"] = {"step": header.step, "n_params": header.n_params, "size": header.file_size}
        with checks.run("bin step", expected=step) as f:
            if header.step != step:
                raise IntegrityError("the .bin's header names another step", file=b, expected=step, found=header.step)
            f["found"] = header.step
        doc = companion_checks(checks, c, comp_sha, read_companion_bytes, companion_fmt.FORMAT,
                               companion_fmt.validate_envelope)
        out.doc = doc
        rec = doc["bin"]
        want = {"name": b.name, "sha256": bin_sha, "size": header.file_size, "step": step}
        with checks.run("companion record", expected=want) as f:
            got = {k: rec.get(k) for k in want}
            if got != want:
                raise IntegrityError("companion and .bin disagree", file=c, expected=want, found=got)
            f["found"] = got
        if deep or load:
            with checks.run("bin sha256", expected=bin_sha) as f:
                if load:
                    out.contents = read_bin(b, expected_n=expected_n, check_finite=check_finite, expected_sha256=bin_sha)
                    if out.contents.step != step or out.contents.header.file_size != header.file_size:
                        raise IntegrityError("the .bin changed while it was read", file=b,
                                             expected={"step": step, "size": header.file_size},
                                             found={"header step": out.contents.step, "size": out.contents.header.file_size})
                    f["found"] = bin_sha
                else:
                    d = sha256_file(b)
                    if d.sha256 != bin_sha:
                        raise IntegrityError("sha256 mismatch: the .bin changed after it was committed", file=b,
                                             expected=bin_sha, found=d.sha256,
                                             hint="bit rot or an edit; an older generation will be used")
                    f["found"] = d.sha256
            with checks.run("companion state"), malformed_companion(c):
                out.state = companion_fmt.decode_tree(doc["state"])
                validate_state(out.state, c)  # one progress instant, schema, identity (what a resume restores)
    except RipresaError as exc:
        if raise_first:
            raise
        out.generation = Generation(step, "bin", b, c, mk, valid=False, reason=reason_of(exc), checks=tuple(checks))
        return out
    out.generation = Generation(step, "bin", b, c, mk, valid=True, size=header.file_size,
                                files={b.name: bin_sha, c.name: comp_sha}, deep_checked=deep or load,
                                signature_verified=key is not None, checks=tuple(checks))
    return out


def read_companion_bytes(c: Path) -> bytes:
    """The companion's bytes: a regular file (never a symlink, FIFO or folder), bounded in size before reading."""
    return read_small(c, "companion", companion_fmt.MAX_COMPANION_BYTES, error=IntegrityError)
