"""The one commit protocol of every kind of generation, and the checks every kind shares (docs/FORMAT.md).

:func:`commit_generation`: uncommit an older generation of the step, write the data durably,
``fsync`` the folder, the signature, **the commit marker last**, then re-check. :func:`delete_files`
removes a generation marker first. The shared named checks: :func:`marker_checks`,
:func:`companion_checks`; :func:`newest_valid` picks the newest valid generation.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.schema import validate_saved_state
from ..errors import IntegrityError, RipresaError
from ..formats import companion as companion_fmt
from ..formats.generation import Checks, Generation
from ..formats.naming import NameFormat
from ..io import auth
from ..io.fsio import (
    Digest,
    StagedFile,
    fsync_dir,
    ops,
    parse_sha256sum,
    read_small,
    sidecar_line,
    write_atomic,
)

__all__ = ["CheckpointWarning", "Written", "clean_partials", "commit_generation", "companion_checks", "delete_files",
           "malformed_companion", "marker_checks", "newest_valid", "read_marker", "uncommit", "validate_state"]


class CheckpointWarning(UserWarning):
    """A generation was skipped (damaged or uncommitted) in favour of an older one."""


@dataclass(frozen=True)
class Written:
    """What a kind's write step returns to :func:`commit_generation`: the marker's ``sha256sum`` lines
    and, given the key, the signature's line."""

    marker_lines: list[bytes]
    signature_line: Callable[[bytes], bytes]


def with_companion(step: int, main: StagedFile, main_digest: Digest, companion: Path, doc: Any) -> Written:
    """The tail of a kind whose generation is a main file plus a JSON companion: stage the companion, publish
    both, and hand :func:`commit_generation` their marker lines and signature line (``.bin`` and general)."""
    with StagedFile(companion) as fc:
        fc.write(companion_fmt.dumps(doc))
        comp_digest = fc.finish()
        main.publish()
        fc.publish()
    m, c = main.final.name, companion.name
    return Written([sidecar_line(main_digest, m), sidecar_line(comp_digest, c)],
                   lambda k: auth.signature_line(k, step, m, main_digest.sha256, c, comp_digest.sha256))


def uncommit(folder: Path, *paths: Path) -> None:
    """Re-saving a step: remove its old marker (and signature) first, so no reader ever pairs the old marker
    (or signature) with new files; ``fsync`` the folder when anything was removed."""
    if any(os.path.lexists(p) for p in paths):
        for old in paths:
            if os.path.lexists(old):
                ops.unlink(old)
        fsync_dir(folder)


def commit_generation(folder: Path, step: int, *, marker: Path, signature: Path, key: bytes | None,
                      write: Callable[[], Written], check: Callable[[], Generation], what: str, file: Path,
                      before: Callable[[], None] | None = None,
                      sync: Callable[[Path], None] = fsync_dir) -> Generation:
    """Commit generation ``step`` of ``folder``: the one protocol of every kind.

    1. ``before()`` (default: :func:`uncommit` the step's old ``marker`` and ``signature``);
    2. ``write()``: the kind's files, durable (each ``fsync``'d and renamed into place);
    3. ``sync`` the folder (``fsync``);
    4. with ``key``: the signature (durable before the marker);
    5. the marker, written atomically, last: **its rename is the commit**;
    6. ``check()`` re-reads what was committed; an invalid result raises
       :class:`~ripresa.errors.IntegrityError` ("<what> <step> failed its check right after the save").

    On a failure the temporaries are removed, the error is raised, and every earlier
    generation is untouched. Retention is not part of a commit (:meth:`RunFolder.retain`).
    """
    if before is None:
        uncommit(folder, marker, signature)
    else:
        before()
    written = write()
    sync(folder)
    if key is not None:  # the signature is durable before the marker commits the generation
        write_atomic(signature, [written.signature_line(key)])
    write_atomic(marker, written.marker_lines)
    gen = check()  # re-read marker, header, companion: durable and consistent
    if not gen.valid:
        raise IntegrityError(f"{what} {step} failed its check right after the save", file=file, found=gen.reason)
    return gen


def clean_partials(folder: Path, names: NameFormat) -> list[Path]:
    """Remove a folder kind's ``.step_NNNNNN<suffix>.partial`` folders left by interrupted saves (the writer, at
    start); return them."""
    removed: list[Path] = []
    if not Path(folder).is_dir():
        return removed
    for entry in os.scandir(folder):
        if names.is_partial(entry.name) and entry.is_dir(follow_symlinks=False):
            ops.rmtree(Path(entry.path))
            removed.append(Path(entry.path))
    return removed


def delete_files(*paths: Path) -> None:
    """Remove a generation's files in the order given: its marker first (it reads as uncommitted if
    interrupted), then its signature and data."""
    for p in paths:
        try:
            ops.unlink(p)
        except FileNotFoundError:
            pass


def read_marker(marker: Path, bin_path: Path, companion: Path) -> tuple[str, str]:
    """Parse a two-line marker; return (main file sha256, companion sha256)."""
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
    with checks.run("companion schema", expected=fmt), malformed_companion(companion):
        doc = companion_fmt.loads_bounded(raw, file=companion)
        validate_envelope(doc, companion)
    return doc


#: What parsing or decoding a hostile companion can raise besides ripresa's own errors.
MALFORMED = (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError)


@contextmanager
def malformed_companion(c: Path) -> Iterator[None]:
    """Turn a parser's crash on a hostile companion (deep nesting, bad tagged nodes) into an IntegrityError."""
    try:
        yield
    except RipresaError:
        raise
    except MALFORMED as exc:
        raise IntegrityError("companion is malformed: its state cannot be decoded", file=c,
                             expected="a ripresa companion (tagged tensors, tuples, dicts)",
                             found=f"{type(exc).__name__}: {str(exc)[:160]}",
                             hint="it was not written by ripresa (or was edited); this generation cannot be trusted") from exc


def validate_state(state: Any, c: Path) -> None:
    """:func:`~ripresa.core.state.validate_saved_state` for a training state.

    A companion state that declares a ``format`` is a training state
    (``TrainingState.snapshot``) and must pass the whole check; one without is
    a plain state stored through the low-level API, which a resume refuses
    anyway (:meth:`TrainingState.restore` runs the same check).
    """
    if isinstance(state, dict) and "format" in state:
        validate_saved_state(state, where=c)


def not_used(label: str, step: int, reason: Any, file: Any = None, then: str = "an older one is tried") -> str:
    """The one-line text of a generation passed over: ``generation 20 not used: WHY (FILE); an older one is
    tried`` — why it is not used, which file, what happens instead (docs/FAULTS.md, "Messages: one line each, the same shape everywhere")."""
    where = f" ({file})" if file is not None and str(file) not in str(reason) else ""
    return f"{label} {step} not used: {reason}{where}; {then}"


def newest_valid(checked: Iterable[tuple[str, Generation]], *, warn: bool) -> Generation | None:
    """The first valid generation of ``checked`` ((label, generation), newest first, checked lazily).

    Each invalid one before it is passed over with a :class:`CheckpointWarning`
    naming it (``<label> <step> not used: <reason> (<file>); ...``, :func:`not_used`): the first
    ``ripresa.console.MAX_LISTED``, then one counting the rest (docs/INSPECT.md, "Long lists").
    """
    from ..console import MAX_LISTED, more_line

    passed, label, found = 0, "generation", None
    for label, g in checked:
        if g.valid:
            found = g
            break
        passed += 1
        if warn and passed <= MAX_LISTED:  # capped: thousands of damaged generations are not thousands of lines
            warnings.warn(not_used(label, g.step, g.reason, g.path), CheckpointWarning, stacklevel=3)
    if warn and passed > MAX_LISTED:
        warnings.warn(more_line(passed - MAX_LISTED, f"{label}s not used (older ones were tried)"), CheckpointWarning,
                      stacklevel=3)
    return found
