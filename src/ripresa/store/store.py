"""A run folder of checkpoint generations, with the commit protocol of docs/FORMAT.md.

One generation = three files:

    step_NNNNNN.bin          weights, m, v (ANDREA format, docs/FORMAT.md)
    step_NNNNNN.json         the companion: everything else an exact resume needs
    step_NNNNNN.bin.sha256   the commit marker, written last: two sha256sum lines,
                             one for the .bin and one for the .json
                             (``sha256sum -c step_NNNNNN.bin.sha256`` checks both)

Save: the ``.bin`` is streamed to a temporary sibling while hashed, then the
companion (which records the ``.bin``'s sha256 and size); both are ``fsync``'d,
renamed, the folder is ``fsync``'d, then the marker is written the same way.
Only after the new generation is durable and re-checked does retention delete
older ones — never the newest valid one, marker first (so a half-deleted
generation reads as uncommitted, never as valid).

With an HMAC key configured (``RIPRESA_HMAC_KEY`` / ``RIPRESA_HMAC_KEY_FILE``,
see :mod:`ripresa.io.auth`), a fourth file ``step_NNNNNN.bin.hmac`` signs the
generation; it is written right before the marker. A store with
``require_signature`` (or ``RIPRESA_REQUIRE_SIGNATURE=1``) treats an unsigned
or mis-signed generation as invalid.

A reader trusts only committed generations: :meth:`CheckpointStore.latest_valid`
skips a damaged newest generation with a warning that names the file and the
reason, and returns the previous valid one. One writer per folder, enforced by
:class:`~ripresa.io.lock.RunLock`; leftover temporary files are removed when the
writer opens the folder.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.schema import validate_saved_state
from ..errors import BadInput, IntegrityError, RipresaError
from ..formats import companion as companion_fmt
from ..formats.andrea_bin import (
    BinArrays,
    BinContents,
    bin_name,
    parse_bin_name,
    read_bin,
    read_header,
    write_bin,
)
from ..formats.generation import Check, Checks, Generation, reason_of
from ..io import auth
from ..io.fsio import (
    StagedFile,
    clean_temporaries,
    fsync_dir,
    ops,
    parse_sha256sum,
    read_small,
    sha256_file,
    sidecar_line,
    write_atomic,
)
from ..io.lock import RunLock
from .retention import DEFAULT_RETENTION, RetentionPolicy, plan_deletions

_STEP_FILE = re.compile(r"^step_(\d{6,})\.(bin|json|bin\.sha256|bin\.hmac)$")


class CheckpointWarning(UserWarning):
    """A generation was skipped (damaged or uncommitted) in favour of an older one."""


def generation_paths(folder: Path, step: int) -> tuple[Path, Path, Path]:
    """(.bin, companion .json, marker) of ``step`` in ``folder``."""
    b = folder / bin_name(step)
    return b, b.with_suffix(".json"), b.with_name(b.name + ".sha256")


def read_marker(marker: Path, bin_path: Path, companion: Path) -> tuple[str, str]:
    """Parse a two-line marker; return (bin sha256, companion sha256)."""
    if not os.path.lexists(marker):
        raise IntegrityError("missing commit marker: the generation was never committed", file=marker,
                             expected=f"{marker.name} written last", found="nothing", hint="an older generation will be used")
    raw = read_small(marker, "commit marker", 4096, error=IntegrityError)  # no link, no FIFO, bounded
    parsed = parse_sha256sum(raw)
    if len(raw) > 4096 or parsed is None or len(parsed) != 2:
        raise IntegrityError("malformed commit marker", file=marker,
                             expected=f"two lines '<sha256>  {bin_path.name}' and '<sha256>  {companion.name}'",
                             found=repr(raw[:160]), hint="the marker is damaged; this generation cannot be trusted")
    names = {name: digest for digest, name in parsed}
    if set(names) != {bin_path.name, companion.name}:
        raise IntegrityError("commit marker names other files", file=marker,
                             expected=[bin_path.name, companion.name], found=sorted(names),
                             hint="a marker only vouches for its own generation")
    return names[bin_path.name], names[companion.name]


class CheckpointStore:
    """Generations of a run folder: save (commit protocol + retention), list, verify, load.

    Args:
        folder: the run folder (created for a writer).
        retention: which generations to keep (applied after each durable save).
        writer: take the folder's writer lock and clean leftover temporaries.
            Readers (``ripresa inspect``) pass ``writer=False``.
        require_signature: treat unsigned or mis-signed generations as invalid
            (``None``: from ``RIPRESA_REQUIRE_SIGNATURE``). Needs a key.
        hmac_key: the key that signs saves and verifies signatures (``None``:
            from ``RIPRESA_HMAC_KEY`` / ``RIPRESA_HMAC_KEY_FILE``; a writer
            with a key signs every generation it saves).
    """

    def __init__(self, folder: str | Path, *, retention: RetentionPolicy = DEFAULT_RETENTION, writer: bool = True,
                 require_signature: bool | None = None, hmac_key: bytes | None = None) -> None:
        if not isinstance(folder, str | os.PathLike):
            raise TypeError(f"folder must be a path (str or os.PathLike), not {type(folder).__name__}")
        if not isinstance(retention, RetentionPolicy):
            raise TypeError(f"retention must be a RetentionPolicy (e.g. KeepLast(3)), not {retention!r:.80}; "
                            "parse a text spec with ripresa.store.retention.parse_retention")
        if require_signature is not None and not isinstance(require_signature, bool):
            raise TypeError(f"require_signature must be a bool or None, not {type(require_signature).__name__}")
        if hmac_key is not None:
            if not isinstance(hmac_key, bytes):
                raise TypeError(f"hmac_key must be bytes or None, not {type(hmac_key).__name__}")
            if len(hmac_key) < auth.MIN_KEY_BYTES:
                raise ValueError(f"hmac_key must hold at least {auth.MIN_KEY_BYTES} bytes, got {len(hmac_key)}")
        self.folder = Path(folder)
        self.retention = retention
        self.lock: RunLock | None = None
        #: steps retention must keep besides its policy (a mirror's pending uploads: docs/MIRROR.md), or None
        self.pinned: Callable[[Iterable[int]], Iterable[int]] | None = None
        #: The metrics recorded with each generation, for a metric retention policy (``KeepBest``): set by the
        #: ``Checkpointer``; None: none known.
        self.metrics: Callable[[], Mapping[int, Mapping[str, float]]] | None = None
        self.removed_temporaries: list[Path] = []
        self.require_signature = auth.require_signature_from_env() if require_signature is None else bool(require_signature)
        # A writer loads the key now (a misconfigured key fails at start, not at the
        # first save); a reader only when it must verify.
        self.hmac_key = hmac_key if hmac_key is not None else (
            auth.load_key() if writer or self.require_signature else None)
        if self.require_signature and self.hmac_key is None:
            raise auth.missing_key_error("require_signature (RIPRESA_REQUIRE_SIGNATURE)")
        if writer:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock(self.folder).acquire()
            self.removed_temporaries = clean_temporaries(self.folder, only_dead=False)
        elif not self.folder.is_dir():
            raise BadInput("run folder not found", file=self.folder, expected="an existing run folder", found="nothing")

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- listing
    def steps_on_disk(self) -> list[int]:
        """Steps that have any generation file (committed or not), ascending."""
        steps = set()
        for entry in os.scandir(self.folder):
            m = _STEP_FILE.match(entry.name)
            if m and (m.group(2) != "bin" or parse_bin_name(entry.name) is not None):
                steps.add(int(m.group(1)))
        return sorted(steps)

    def check(self, step: int, *, deep: bool = False) -> Generation:
        """Validate one generation (:func:`validate_generation`); ``deep`` re-hashes the whole ``.bin``."""
        return validate_generation(self.folder, step, deep=deep, key=self._signature_key()).generation

    def _signature_key(self) -> bytes | None:
        """The key signatures are verified with, or None when they are not required."""
        if not self.require_signature:
            return None
        assert self.hmac_key is not None
        return self.hmac_key

    def generations(self, *, deep: bool = False) -> list[Generation]:
        """Every generation on disk, ascending, each with its validity."""
        return [self.check(s, deep=deep) for s in self.steps_on_disk()]

    def latest_valid(self, *, deep: bool = True, warn: bool = True) -> Generation | None:
        """The newest committed, verified generation; warn about each newer one skipped."""
        return newest_valid((("generation", self.check(s, deep=deep)) for s in reversed(self.steps_on_disk())), warn=warn)

    # ----------------------------------------------------------------- saving
    def save(self, step: int, arrays: BinArrays, companion_state: dict[str, Any]) -> Generation:
        """Write generation ``step`` durably, then apply retention. Synchronous.

        ``arrays`` are the ``.bin``'s regions (views or staging buffers);
        ``companion_state`` is ``TrainingState.snapshot(include_parameters=False)``.
        On any failure the temporaries are removed, the error is raised, and
        every earlier generation is untouched.
        """
        self._require_writer()
        b, c, mk = generation_paths(self.folder, step)
        encoded_state = companion_fmt.encode_tree(companion_state)
        sig = auth.signature_path(b)
        if os.path.lexists(mk) or os.path.lexists(sig):
            # Re-saving a step: uncommit the old generation first, so no reader
            # ever pairs the old marker (or signature) with new files.
            for old in (mk, sig):
                if os.path.lexists(old):
                    ops.unlink(old)
            fsync_dir(self.folder)
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
            with StagedFile(c) as fc:
                fc.write(companion_fmt.dumps(doc))
                comp_digest = fc.finish()
                fb.publish()
                fc.publish()
        fsync_dir(self.folder)
        if self.hmac_key is not None:  # the signature is durable before the marker commits the generation
            write_atomic(sig, [auth.signature_line(self.hmac_key, step, b.name, bin_digest.sha256, c.name,
                                                   comp_digest.sha256)])
        write_atomic(mk, [sidecar_line(bin_digest, b.name), sidecar_line(comp_digest, c.name)])
        gen = self.check(step, deep=False)  # re-read marker, header, companion: durable and consistent
        if not gen.valid:
            raise IntegrityError(f"generation {step} failed its check right after the save", file=b, found=gen.reason)
        self.apply_retention(newest_valid=step)
        return gen

    def protected_steps(self, valid: Iterable[int]) -> set[int]:
        """The steps of ``valid`` that :attr:`pinned` keeps (a mirror's pending uploads)."""
        return set(self.pinned(list(valid))) if self.pinned is not None else set()

    def step_metrics(self) -> Mapping[int, Mapping[str, float]]:
        """The metrics recorded with each generation (:attr:`metrics`), or an empty mapping."""
        return self.metrics() if self.metrics is not None else {}

    def apply_retention(self, *, newest_valid: int, protected: tuple[int, ...] = ()) -> list[int]:
        """Delete generations the policy drops (never ``newest_valid``, nor a pinned one); return their steps."""
        self._require_writer()
        valid = [g.step for g in self.generations() if g.valid]
        doomed = plan_deletions(valid, self.retention, newest_valid=newest_valid,
                                protected=(*protected, *self.protected_steps(valid)), metrics=self.step_metrics())
        for step in doomed:
            self.delete(step)
        if doomed:
            fsync_dir(self.folder)
        return doomed

    def delete(self, step: int) -> None:
        """Remove a generation, marker first (it reads as uncommitted if interrupted)."""
        self._require_writer()
        b, c, mk = generation_paths(self.folder, step)
        for p in (mk, auth.signature_path(b), b, c):
            try:
                ops.unlink(p)
            except FileNotFoundError:
                pass

    def _require_writer(self) -> None:
        if self.lock is None:
            raise BadInput("this store was opened read-only", file=self.folder, hint="open with writer=True")

    # ----------------------------------------------------------------- loading
    def load(self, step: int, *, expected_n: int | None = None, check_finite: bool = False) -> tuple[BinContents, dict[str, Any]]:
        """Read and verify generation ``step``: (.bin contents, decoded companion state).

        The same named checks as :meth:`check` (:func:`validate_generation`),
        the ``.bin`` hashed while it is read into memory (one pass) and the
        companion state decoded and validated. Raises on the first failure.
        """
        v = validate_generation(self.folder, step, load=True, expected_n=expected_n, check_finite=check_finite,
                                key=self._signature_key(), raise_first=True)
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


def marker_checks(checks: Checks, main: Path, companion: Path, marker: Path, step: int,
                  key: bytes | None) -> tuple[str, str]:
    """The first named checks of a two-file generation (``.bin`` or general): ``marker present``,
    ``marker format`` and, with a key, ``signature`` — authenticated before anything else is parsed.
    Returns the sha256 the marker records for the main file and the companion."""
    with checks.run("marker present", expected=marker.name) as f:
        if not os.path.lexists(marker):
            read_marker(marker, main, companion)  # raises: missing commit marker
        f["found"] = marker.name
    with checks.run("marker format", expected=[main.name, companion.name]):
        main_sha, comp_sha = read_marker(marker, main, companion)
    if key is not None:
        with checks.run("signature", expected=auth.signature_path(main).name):
            auth.verify(key, auth.signature_path(main), step, main.name, main_sha, companion.name, comp_sha)
    return main_sha, comp_sha


def companion_checks(checks: Checks, companion: Path, sha: str, read: Callable[[Path], bytes], fmt: str,
                     validate_envelope: Callable[[Any, Path], None]) -> Any:
    """The ``companion sha256`` and ``companion schema`` checks of a two-file generation, on one read of
    the companion (``read``, size-bounded by the caller's format); returns the parsed document."""
    with checks.run("companion sha256", expected=sha) as f:
        raw = read(companion)
        found = hashlib.sha256(raw).hexdigest()
        if found != sha:
            raise IntegrityError("companion sha256 mismatch", file=companion, expected=sha, found=found,
                                 hint="the companion changed after the commit")
        f["found"] = found
    with checks.run("companion schema", expected=fmt), _malformed_companion(companion):
        doc = companion_fmt.loads_bounded(raw, file=companion)
        validate_envelope(doc, companion)
    return doc


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
        doc = companion_checks(checks, c, comp_sha, _read_companion_bytes, companion_fmt.FORMAT,
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
            with checks.run("companion state"), _malformed_companion(c):
                out.state = companion_fmt.decode_tree(doc["state"])
                _validate_state(out.state, c)  # one progress instant, schema, identity (what a resume restores)
    except RipresaError as exc:
        if raise_first:
            raise
        out.generation = Generation(step, "bin", b, c, mk, valid=False, reason=reason_of(exc), checks=tuple(checks))
        return out
    out.generation = Generation(step, "bin", b, c, mk, valid=True, size=header.file_size,
                                files={b.name: bin_sha, c.name: comp_sha}, deep_checked=deep or load,
                                signature_verified=key is not None, checks=tuple(checks))
    return out


#: What parsing or decoding a hostile companion can raise besides ripresa's own errors.
_MALFORMED = (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError)


@contextmanager
def _malformed_companion(c: Path) -> Iterator[None]:
    """Turn a parser's crash on a hostile companion (deep nesting, bad tagged nodes) into an IntegrityError."""
    try:
        yield
    except RipresaError:
        raise
    except _MALFORMED as exc:
        raise IntegrityError("companion is malformed: its state cannot be decoded", file=c,
                             expected="a ripresa companion (tagged tensors, tuples, dicts)",
                             found=f"{type(exc).__name__}: {str(exc)[:160]}",
                             hint="it was not written by ripresa (or was edited); this generation cannot be trusted") from exc


def _validate_state(state: Any, c: Path) -> None:
    """:func:`~ripresa.core.state.validate_saved_state` for a training state.

    A companion state that declares a ``format`` is a training state
    (``TrainingState.snapshot``) and must pass the whole check; one without is
    a plain state stored through the low-level API, which a resume refuses
    anyway (:meth:`TrainingState.restore` runs the same check).
    """
    if isinstance(state, dict) and "format" in state:
        validate_saved_state(state, where=c)


def _read_companion_bytes(c: Path) -> bytes:
    """The companion's bytes: a regular file (never a symlink, FIFO or folder), bounded in size before reading."""
    return read_small(c, "companion", companion_fmt.MAX_COMPANION_BYTES, error=IntegrityError)


def not_used(label: str, step: int, reason: Any, file: Any = None, then: str = "an older one is tried") -> str:
    """The one-line text of a generation passed over: ``generation 20 not used: WHY (FILE); an older one is
    tried`` — why it is not used, which file, what happens instead (docs/FAULTS.md, "Messages and exit codes")."""
    where = f" ({file})" if file is not None and str(file) not in str(reason) else ""
    return f"{label} {step} not used: {reason}{where}; {then}"


def newest_valid(checked: Iterable[tuple[str, Generation]], *, warn: bool) -> Generation | None:
    """The first valid generation of ``checked`` ((label, generation), newest first, checked lazily).

    Each invalid one before it is passed over with a :class:`CheckpointWarning`
    naming it (``<label> <step> not used: <reason> (<file>); ...``, :func:`not_used`).
    """
    for label, g in checked:
        if g.valid:
            return g
        if warn:
            warnings.warn(not_used(label, g.step, g.reason, g.path), CheckpointWarning, stacklevel=3)
    return None


# ---- signature checks of one file ----------------------------------------------------


def check_generation_file(path: str | os.PathLike[str]) -> None:
    """Verify the signature of the generation whose ``.bin`` (or companion) is ``path``.

    For ``ripresa inspect --require-signature FILE``. Raises
    :class:`~ripresa.io.auth.SignatureError` (exit 1) for an unsigned, mis-signed or invalid
    generation and :class:`~ripresa.errors.BadInput` (exit 2) for a path that
    is not a generation's file.
    """
    p = Path(path)
    from .general import check_general_file, parse_general_name

    if parse_general_name(p.name.removesuffix(".json")) is not None:  # a general generation (docs/FORMAT.md)
        check_general_file(p)
        return
    name = p.name[: -len(".json")] + ".bin" if p.name.endswith(".json") else p.name
    step = parse_bin_name(name)
    if step is None:
        raise BadInput(
            "--require-signature checks a run folder or a generation's step_NNNNNN.bin or .safetensors",
            file=p,
            expected="a run folder, step_NNNNNN.bin or step_NNNNNN.safetensors",
            found=p.name,
            hint="checkpoint.pt files are not signed; sign generations of a run folder",
        )
    gen = CheckpointStore(p.parent, writer=False, require_signature=True).check(step, deep=True)
    if not gen.valid:
        raise auth.SignatureError(f"generation {step} is not trusted under --require-signature: {gen.reason}",
                             file=p, hint="an unsigned, mis-signed or damaged generation is never trusted")
