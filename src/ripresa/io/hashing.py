"""sha256 of files and the ``sha256sum`` sidecars that vouch for them.

One parser of the ``sha256sum`` lines ripresa writes (sidecars, generation
and ``.dcp`` markers), a sidecar reader that trusts only its neighbour, and
streamed hashing with one reused buffer. Formats: docs/FORMAT.md.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ..errors import IntegrityError
from .fileops import Digest
from .safe_read import (
    Refused,
    iter_chunks,
    open_checked,
    open_error,
    open_regular,
    read_error,
    read_exact_hashing,
    require_regular_file,
)

#: One ``sha256sum`` line; matched with ``fullmatch`` (``\Z``, not ``$``, so a
#: second newline is refused). No control characters (``\r``, NUL, ...) in the
#: name, and at most one ``/`` (a ``.dcp`` marker names ``FOLDER/FILE``);
#: :func:`parse_sha256sum_line` refuses the ``/`` unless asked.
_SHA_LINE_RE = re.compile(r"(?P<hex>[0-9a-f]{64}) [ *](?P<name>[^/\x00-\x1f\x7f]+(?:/[^/\x00-\x1f\x7f]+)?)\n?\Z")
#: Largest sidecar accepted (bytes). A valid line is at most 64 + 2 + 255 + 1.
SIDECAR_MAX = 4096


def sidecar_path(path: str | Path) -> Path:
    """``X`` → ``X.sha256``."""
    p = Path(path)
    return p.with_name(p.name + ".sha256")


def parse_sha256sum_line(line: str, *, in_folder: bool = False) -> tuple[str, str] | None:
    """``"<64 hex>  NAME"`` (one ``sha256sum`` line, text or binary mode) → ``(hex, NAME)``; None if malformed.

    The one parser of the ``sha256sum`` lines ripresa writes (sidecars,
    generation markers, ``.dcp`` markers). ``NAME`` holds no control
    character and no ``/`` — except, with ``in_folder``, exactly one
    (``FOLDER/FILE``, a ``.dcp`` marker's lines). One trailing newline is
    accepted, nothing after it.
    """
    m = _SHA_LINE_RE.fullmatch(line)
    if m is None:
        return None
    name = m.group("name")
    if "/" in name and not in_folder:
        return None
    return m.group("hex"), name


def parse_sha256sum(raw: bytes, *, in_folder: bool = False) -> list[tuple[str, str]] | None:
    """Every line of a ``sha256sum`` file (:func:`parse_sha256sum_line`); None if any is malformed or not ASCII."""
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        return None
    out = []
    for line in lines:
        parsed = parse_sha256sum_line(line, in_folder=in_folder)
        if parsed is None:
            return None
        out.append(parsed)
    return out


def sidecar_line(digest: Digest | str, name: str) -> bytes:
    """One ``sha256sum`` line: ``<hex>  <name>\\n`` (two spaces: text mode)."""
    hexd = digest.sha256 if isinstance(digest, Digest) else digest
    return f"{hexd}  {name}\n".encode()


def sha256_fd(fd: int, *, what: str = "file", path: str | Path | None = None) -> Digest:
    """sha256 and size of everything ``fd`` reads from its current offset to EOF.

    For a freshly opened descriptor (e.g. from :func:`open_regular`) that is
    the whole file. One reused buffer; the descriptor is left open at EOF.
    """
    h = hashlib.sha256()
    size = 0
    for piece in iter_chunks(fd, what=what, path=path):
        h.update(piece)
        size += len(piece)
    return Digest(h.hexdigest(), size)


def read_whole_hashing(fd: int, size: int, *, what: str = "file", path: str | Path | None = None,
                       ) -> tuple[bytearray, Digest, bool]:
    """``size`` bytes of the open file ``fd``, read into one new buffer while hashed (one pass).

    Returns the buffer, its digest and whether the file held more (one more
    byte is tried: a file that grew while read). The caller compares the
    digest with the one it trusts before using any of the bytes, so what it
    uses is exactly what was verified (a ``checkpoint.pt``, a ``.dcp`` file).
    """
    buf = bytearray(size)
    h = hashlib.sha256()
    read_exact_hashing(fd, [memoryview(buf)], h, path=path, what=what)
    grew = bool(os.read(fd, 1))
    return buf, Digest(h.hexdigest(), size), grew


def _fadvise(fd: int, advice_name: str) -> bool:
    advice = getattr(os, advice_name, None)
    if advice is None or not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except OSError:
        return False
    return True


def sha256_file(path: str | Path, *, drop_cache: bool = False, what: str = "file") -> Digest:
    """Stream a regular file through sha256 with one reused buffer; return its digest.

    Opened with :func:`open_regular` (a FIFO, folder or device is refused
    with :class:`~ripresa.errors.BadInput`, never read or waited on). With
    ``drop_cache`` the file's clean pages are dropped from the page cache
    afterwards.
    """
    p = Path(path)
    fd = open_regular(p, what)
    try:
        _fadvise(fd, "POSIX_FADV_SEQUENTIAL")
        digest = sha256_fd(fd, what=what, path=p)
        if drop_cache:
            _fadvise(fd, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)
    return digest


def drop_page_cache(path: str | Path) -> bool:
    """Ask the kernel to drop ``path``'s cached pages (``POSIX_FADV_DONTNEED``).

    For benchmarks of cold reads. No ``fsync`` is done: dirty pages (a file
    written but not yet synced) stay cached; files published through
    :class:`StagedFile` are already synced. Returns ``False`` where the
    platform has no ``posix_fadvise`` or the advice failed. Refuses a path
    that is not a regular file (:class:`~ripresa.errors.BadInput`).
    """
    fd = open_regular(path, "file")
    try:
        return _fadvise(fd, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


def read_sidecar(path: str | Path) -> str:
    """Read and validate ``path.sha256``; return the expected sha256 (hex).

    Refuses (:class:`~ripresa.errors.IntegrityError`) a missing marker,
    anything that is not a regular file (a symlink, folder or FIFO — opened
    without following links and without blocking, and checked on the open
    descriptor), more than :data:`SIDECAR_MAX` bytes (at most
    ``SIDECAR_MAX + 1`` are ever read), more than one line, bad hex, wrong
    length, and a file name other than ``path``'s own (no ``../`` or absolute
    paths: the sidecar can only vouch for its neighbour). A sidecar that
    cannot be read (permissions, I/O error) is :class:`~ripresa.errors.BadInput`.
    """
    p = Path(path)
    side = sidecar_path(p)
    try:
        fd, _ = open_checked(side, follow_symlinks=False)
    except Refused as refused:
        if refused.kind == "missing":
            raise IntegrityError(
                "missing commit marker (sha256 sidecar): the save did not complete",
                file=side,
                expected=f"a file '{side.name}' written after '{p.name}'",
                found="nothing",
                hint="this generation is uncommitted; use an earlier one",
            ) from None
        if refused.kind in ("symlink", "folder", "special"):
            raise IntegrityError(
                "sha256 sidecar is not a regular file",
                file=side,
                expected="a regular file",
                found=refused.found,
                hint="remove it; only ripresa's own sidecars are trusted",
            ) from None
        raise open_error(side, "sha256 sidecar", refused) from refused.__cause__
    try:
        raw = bytearray()
        while len(raw) <= SIDECAR_MAX:
            try:
                got = os.read(fd, SIDECAR_MAX + 1 - len(raw))
            except OSError as exc:
                raise read_error(side, "sha256 sidecar", exc, "one sha256sum line") from exc
            if not got:
                break
            raw += got
    finally:
        os.close(fd)
    if len(raw) > SIDECAR_MAX:
        raise IntegrityError(
            "malformed sha256 sidecar: too large",
            file=side,
            expected=f"one line '<64 lowercase hex>  <file name>' (at most {SIDECAR_MAX} bytes)",
            found=f"more than {SIDECAR_MAX} bytes, starting {bytes(raw[:60])!r}",
            hint="the commit marker is damaged; this generation cannot be trusted",
        )
    try:
        text: str | None = raw.decode("ascii")
    except UnicodeDecodeError:
        text = None
    parsed = parse_sha256sum_line(text) if text is not None else None
    if parsed is None:
        raise IntegrityError(
            "malformed sha256 sidecar",
            file=side,
            expected="one line '<64 lowercase hex>  <file name>'",
            found=repr(bytes(raw[:120])),
            hint="the commit marker is damaged; this generation cannot be trusted",
        )
    digest, name = parsed
    if name != p.name:
        raise IntegrityError(
            "sha256 sidecar names another file",
            file=side,
            expected=p.name,
            found=name,
            hint="a sidecar only vouches for the file beside it",
        )
    return digest


def verify_against_sidecar(path: str | Path) -> Digest:
    """Check ``path`` against ``path.sha256``; return its digest or raise."""
    p = require_regular_file(path)
    expected = read_sidecar(p)
    digest = sha256_file(p, what="checkpoint")
    if digest.sha256 != expected:
        raise IntegrityError(
            "sha256 mismatch: the file changed after it was committed",
            file=p,
            expected=expected,
            found=digest.sha256,
            hint="the file is damaged (truncated, bit rot, or edited); use an earlier generation",
        )
    return digest
