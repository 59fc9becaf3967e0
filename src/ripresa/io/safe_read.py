"""Safe opening and reading of files ripresa did not necessarily write (every one may be hostile).

Open first (non-blocking, no link followed), then ``fstat`` the descriptor,
so what is read is what was checked and a FIFO never hangs the reader; reads
are bounded (size, JSON parse cost) and :func:`read_exact_hashing` reads and
hashes in one pass. Refusals and their errors: docs/FAULTS.md.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import BadInput, IntegrityError, RipresaError
from .fileops import CHUNK, describe_oserror

#: Buffers of one ``readv`` (Linux's IOV_MAX is 1024).
_MAX_IOV = 512


def _kind_of(mode: int) -> str:
    """A file type in words, for error messages."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "a special file"


class Refused(Exception):
    """Why :func:`open_checked` refused a path (mapped to a public error by the caller).

    ``kind``: ``missing``, ``symlink``, ``folder``, ``special``, ``unreadable``
    or ``error``; ``found``: what is there, in words.
    """

    def __init__(self, kind: str, found: str) -> None:
        super().__init__(kind, found)
        self.kind = kind
        self.found = found


def open_checked(
    path: Path, *, follow_symlinks: bool = True, access: int = os.O_RDONLY, create_mode: int = 0o644,
    dir_fd: int | None = None,
) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only and return ``(fd, fstat)`` if it is a regular file.

    ``O_NONBLOCK`` makes the open of a FIFO (or of a FIFO swapped in for a
    file) return at once instead of waiting for a writer; ``fstat`` on the
    *open descriptor* then decides, so there is no window between a check of
    the path and the open. ``O_NONBLOCK`` is cleared again before returning.
    Without ``follow_symlinks`` a symlink is refused (``O_NOFOLLOW``).
    Reads do not go through :data:`ops` (its hook counts the save protocol's
    operations).
    """
    flags = access | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, create_mode, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise Refused("missing", "nothing at this path") from exc
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise Refused("folder", "a folder") from exc
        if exc.errno == errno.ELOOP:
            if not follow_symlinks and _is_link(path, dir_fd):
                raise Refused("symlink", "a symlink") from exc
            raise Refused("special", "a symlink loop") from exc
        if exc.errno == errno.ENXIO:  # a socket, or a device with nothing behind it
            raise Refused("special", "a socket or device") from exc
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise Refused("unreadable", describe_oserror(exc)) from exc
        raise Refused("error", describe_oserror(exc)) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise Refused("folder", "a folder")
        if not stat.S_ISREG(st.st_mode):
            raise Refused("special", _kind_of(st.st_mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


_FOLDER_HINT = (
    "give the path of a file inside the folder (e.g. RUN/checkpoint.pt); "
    "`ripresa inspect RUN` lists a run folder's generations"
)
#: For each kind of refused open: what is wrong with the file, what was expected, the hint.
_OPEN_ERRORS = {
    "missing": ("not found", "an existing file", "check the path; `ripresa inspect RUN` lists the valid generations"),
    "folder": ("is a folder", "a regular file", _FOLDER_HINT),
    "special": ("is not a regular file", "a regular file", "ripresa never reads from special files"),
    "symlink": ("is not a regular file", "a regular file", "ripresa never reads from special files"),
    "unreadable": ("is not readable", "read permission", "check the file's permissions and owner"),
}
_OPEN_FAILED = ("could not be opened", "a readable regular file", "check the disk and the path")


def open_error(path: Path, what: str, refused: Refused) -> BadInput:
    """The :class:`BadInput` for a refused open of ``path``."""
    problem, expected, hint = _OPEN_ERRORS.get(refused.kind, _OPEN_FAILED)
    return BadInput(f"{what} {problem}", file=path, expected=expected, found=refused.found, hint=hint)


def open_regular(path: str | Path, what: str = "checkpoint") -> int:
    """Open an existing regular file read-only; return the descriptor (caller closes).

    The file is opened first (``O_RDONLY | O_NONBLOCK | O_CLOEXEC``) and the
    *descriptor* is checked with ``fstat``, so what is read is exactly what
    was checked, and a FIFO never blocks. ``O_NONBLOCK`` is cleared before
    returning. A symlink to a regular file is followed.

    Raises :class:`~ripresa.errors.BadInput` (naming file, expected, found and
    a hint) for a missing path, a folder, a FIFO, socket or device, and a file
    that cannot be opened (permissions, I/O error). ``what`` names the file in
    the message (``"checkpoint"``, ``"ANDREA .bin"``, ...).
    """
    p = Path(path)
    try:
        fd, _ = open_checked(p)
    except Refused as refused:
        raise open_error(p, what, refused) from refused.__cause__
    return fd


_RUN_FILE_ACCESS = {
    "read": os.O_RDONLY,
    "append": os.O_RDWR | os.O_APPEND,
    "create_append": os.O_RDWR | os.O_APPEND | os.O_CREAT,
}


def open_run_file(
    path: str | Path, what: str, *, mode: str = "read", error: type[RipresaError] = BadInput,
    dir_fd: int | None = None,
) -> int:
    """Open a file of a run folder, a bundle or a ledger; return the descriptor (caller closes).

    The one way ripresa opens such a file (``docs/FAULTS.md``, hostile run
    folders): ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``, then ``fstat`` on the
    *descriptor*, so a symlink is refused (never followed out of the folder),
    a FIFO never blocks (neither for reading nor for writing), and a folder,
    socket or device is refused. ``O_NONBLOCK`` is cleared before returning.

    ``mode``: ``"read"`` (read-only), ``"append"`` (read-write, every write
    appended, the file must exist; the descriptor can ``pread`` the very file
    it appends to, e.g. to repair a torn last line) or ``"create_append"`` (the same, created ``0o644`` if
    missing; a dangling symlink is refused, not followed to create its target).

    Every refusal is an ``error`` (:class:`~ripresa.errors.BadInput` by
    default; a caller reading an integrity-covered file passes
    :class:`~ripresa.errors.IntegrityError`) naming file, expected, found and
    a hint. ``dir_fd``: ``path`` is a name relative to that open folder
    (``openat``), so no component above it is resolved again.
    """
    try:
        access = _RUN_FILE_ACCESS[mode]
    except KeyError:
        raise ValueError(f"open_run_file: unknown mode {mode!r}") from None
    p = Path(path)
    try:
        fd, _ = open_checked(p, follow_symlinks=False, access=access, dir_fd=dir_fd)
    except Refused as refused:
        raise _run_file_error(p, what, refused, error) from None
    return fd


def _is_link(path: Path, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _run_file_error(path: Path, what: str, refused: Refused, error: type[RipresaError]) -> RipresaError:
    base = open_error(path, what, refused)
    if refused.kind == "symlink":
        return error(
            f"{what} is a symlink",
            file=path,
            expected="a regular file inside the folder",
            found="a symlink",
            hint="ripresa never follows links inside a run folder, bundle or ledger; "
            "replace the link by the file itself",
        )
    return error(base.message, file=path, expected=base.expected, found=base.found, hint=base.hint)


def read_small(
    path: str | Path, what: str, limit: int, *, error: type[RipresaError] = BadInput
) -> bytes:
    """Read a whole small file of a run folder, a bundle or a ledger, bounded by ``limit`` bytes.

    The one bounded small-file reader: opened with :func:`open_run_file` (no
    symlink, no FIFO, a regular file), its size checked on the descriptor
    *before* any buffer is allocated, then at most ``limit + 1`` bytes read
    (a file that grew past ``limit`` while read is refused too). Refusals are
    ``error`` (:class:`~ripresa.errors.BadInput` by default).
    """
    p = Path(path)
    fd = open_run_file(p, what, error=error)
    try:
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:  # pragma: no cover - fstat of an open fd
            raise read_error(p, what, exc, "a readable file") from exc
        if size > limit:
            raise _too_large(error, p, what, limit, f"{size} bytes", "this is not a file ripresa wrote; remove or replace it")
        chunks: list[bytes] = []
        got_total = 0
        while got_total <= limit:
            try:
                got = os.read(fd, min(CHUNK, limit + 1 - got_total))
            except OSError as exc:
                raise read_error(p, what, exc, f"at most {limit} bytes") from exc
            if not got:
                break
            chunks.append(got)
            got_total += len(got)
    finally:
        os.close(fd)
    if got_total > limit:
        raise _too_large(error, p, what, limit, f"more than {limit} bytes (it grew while read)",
                         "another process is writing this file")
    return b"".join(chunks)


def _too_large(error: type[RipresaError], path: Path, what: str, limit: int, found: str, hint: str) -> RipresaError:
    return error(f"{what} is too large", file=path, expected=f"at most {limit} bytes", found=found, hint=hint)


#: The most memory (bytes, :func:`json_parse_cost`'s upper estimate) parsing one JSON file of a
#: run folder may take (docs/FAULTS.md, "Memory"). A companion of real float buffers costs
#: ~3.5 bytes per file byte (a 36 MiB one fits); a file of tiny containers (``[{},{},...]``)
#: costs ~80 and is refused before ``json.loads`` allocates anything.
MAX_JSON_COST = 128 * 1024 * 1024
# Upper bounds (bytes, CPython 3.11-3.13, 64-bit) of what json.loads allocates per token; measured
# with tracemalloc: a dict ~200 with a few keys, a list ~64, a number ~32 plus its slot, a
# string ~49 plus its text, a key's entry in its dict ~40.
_COST_DICT, _COST_LIST, _COST_VALUE, _COST_STRING, _COST_KEY = 232, 96, 48, 64, 48


def json_parse_cost(raw: bytes | str) -> int:
    """An upper estimate of the memory ``json.loads(raw)`` allocates, from a bounded pre-scan.

    Counts the structural bytes (``{``, ``[``, ``,``, ``:`` and ``"``) with
    ``bytes.count`` (C speed, no allocation): every container, value, string
    and key of the document is announced by one of them, so the estimate
    bounds the parse whatever the document's shape (a brace inside a string
    is counted too: the estimate errs high, never low). Valid ripresa files
    cost 2-10 bytes per file byte; hostile ones of empty containers ~80.
    """
    b = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    return (2 * len(b)  # the decoded text and the strings' characters
            + _COST_DICT * b.count(b"{") + _COST_LIST * b.count(b"[")
            + _COST_VALUE * (b.count(b",") + 1) + _COST_KEY * b.count(b":")
            + _COST_STRING * (b.count(b'"') // 2 + 1))


def check_json_cost(
    raw: bytes | str, path: str | Path | None, what: str, *, limit: int = MAX_JSON_COST,
    error: type[RipresaError] = BadInput,
) -> int:
    """Refuse, before parsing, a JSON document whose :func:`json_parse_cost` exceeds ``limit``; return the cost."""
    cost = json_parse_cost(raw)
    if cost > limit:
        raise error(
            f"{what} would take too much memory to parse",
            file=path,
            expected=f"a JSON document whose parse takes at most {limit >> 20} MiB",
            found=f"{len(raw)} bytes whose structure would take ~{cost >> 20} MiB",
            hint="the file is made of far more containers, keys or strings than ripresa writes; "
            "it was not written by ripresa and is not parsed (docs/FAULTS.md, \"Memory\")",
        )
    return cost


def parse_json_bytes(
    raw: bytes, path: str | Path | None, what: str, *, error: type[RipresaError] = BadInput,
    max_cost: int = MAX_JSON_COST,
) -> Any:
    """``json.loads`` of bytes read from a file, every failure mapped to ``error``.

    The document's parse cost is bounded first (:func:`check_json_cost`, at
    most ``max_cost`` bytes of parsed objects). Invalid UTF-8, invalid JSON,
    deep nesting (``RecursionError``) and numbers the parser cannot hold are all
    refused with file, expected, found and hint; nothing else escapes.
    """
    import json

    check_json_cost(raw, path, what, limit=max_cost, error=error)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        found = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RecursionError) else "nesting too deep"
        raise error(
            f"{what} is not valid JSON",
            file=path,
            expected="a JSON document as ripresa writes it",
            found=found[:300],
            hint="the file is damaged or was not written by ripresa",
        ) from None


def read_json_small(
    path: str | Path, what: str, limit: int, *, error: type[RipresaError] = BadInput,
    max_cost: int = MAX_JSON_COST,
) -> Any:
    """:func:`read_small` then :func:`parse_json_bytes` (parse cost bounded); every failure is an ``error``."""
    return parse_json_bytes(read_small(path, what, limit, error=error), path, what, error=error, max_cost=max_cost)


def read_error(path: str | Path | None, what: str, exc: OSError, expected: str) -> BadInput:
    return BadInput(
        f"{what} could not be read",
        file=path,
        expected=expected,
        found=describe_oserror(exc),
        hint="check the disk and the file's permissions",
    )


def read_exact_hashing(
    fd: int,
    views: Sequence[memoryview | bytearray],
    hasher: Any | None = None,
    *,
    path: str | Path | None = None,
    what: str = "file",
    piece: int = CHUNK,
    overlap: bool = True,
) -> int:
    """Fill every buffer in ``views``, in order, from ``fd``, hashing as it reads.

    One pass: each piece (at most ``piece`` bytes; consecutive small buffers are
    gathered into one piece, one ``os.readv``) is read straight into the caller's
    buffers (no intermediate copy) and then fed to ``hasher``
    (anything with ``update``, e.g. ``hashlib.sha256()``; ``None`` to only
    read). A reader can so read a 1.4 GB file into preallocated arrays *and*
    verify its sha256 with one read of the disk. With ``overlap`` (and more
    than two pieces) the hashing runs in one helper thread behind the reads,
    in file order (``hashlib`` releases the GIL), never holding them back:
    the buffers are the caller's and never reused within a call.

    Returns the number of bytes read (the total length of ``views``). A file
    that ends early raises :class:`~ripresa.errors.IntegrityError` (it shrank
    while it was read); a read error raises :class:`~ripresa.errors.BadInput`.
    ``path`` and ``what`` name the file in these errors.
    """
    flat = [v if isinstance(v, memoryview) else memoryview(v) for v in views]
    flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in flat]
    for v in flat:
        if v.readonly:
            raise ValueError("read_exact_hashing needs writable buffers")
    total = sum(len(v) for v in flat)
    if piece < 1:
        raise ValueError("piece must be >= 1")
    use_thread = hasher is not None and overlap and total > 2 * piece
    done = 0

    def groups() -> Iterator[list[memoryview]]:
        """Pieces of at most ``piece`` bytes, each one ``readv`` over consecutive buffers (small tensors gathered)."""
        group: list[memoryview] = []
        size = 0
        for v in flat:
            for start in range(0, len(v), piece):
                seg = v[start : start + piece]
                if group and (size + len(seg) > piece or len(group) >= _MAX_IOV):
                    yield group
                    group, size = [], 0
                group.append(seg)
                size += len(seg)
        if group:
            yield group

    def fill(group: list[memoryview]) -> None:
        nonlocal done
        want = sum(len(b) for b in group)
        got_here, i, bufs = 0, 0, list(group)
        while got_here < want:
            try:
                got = os.readv(fd, bufs[i:])
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
            except OSError as exc:
                raise read_error(path, what, exc, f"{total} bytes") from exc
            if got == 0:
                raise IntegrityError(
                    f"{what} ended early: it shrank while it was read",
                    file=path,
                    expected=f"{total} bytes",
                    found=f"{done + got_here} bytes, then end of file",
                    hint="another process is writing this file; read a committed generation",
                )
            got_here += got
            while got and i < len(bufs):  # skip what this read filled; go on inside a partly filled buffer
                if got >= len(bufs[i]):
                    got -= len(bufs[i])
                    i += 1
                else:
                    bufs[i] = bufs[i][got:]
                    got = 0
        done += want

    def digest(group: list[memoryview]) -> None:
        for b in group:
            hasher.update(b)

    if not use_thread:
        for group in groups():
            fill(group)
            if hasher is not None:
                digest(group)
        return done

    # Every piece is its own slice of the caller's buffers (never reused within a call), so the reader never
    # waits for the hasher: it reads on at the disk's pace while the one helper thread hashes behind it, in file
    # order (a FIFO of one worker). Everything queued is hashed (or abandoned on an error) before this returns.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ripresa-hash") as pool:
        pending: list[Future[None]] = []
        try:
            for group in groups():
                fill(group)
                pending.append(pool.submit(digest, group))
        except BaseException:
            for f in pending:
                f.cancel()
            raise
        finally:
            for f in pending:
                if not f.cancelled():
                    f.result()
    return done


def iter_chunks(fd: int, *, what: str = "file", path: str | Path | None = None) -> Iterator[memoryview]:
    """The bytes ``fd`` reads from its current offset to EOF, as views of one reused buffer.

    Each view is valid until the next one is asked for (copy it to keep it).
    A read error is :class:`~ripresa.errors.BadInput` naming ``path``.
    """
    view = memoryview(bytearray(CHUNK))
    while True:
        try:
            n = os.readv(fd, [view])
        except OSError as exc:
            raise read_error(path, what, exc, "a readable file") from exc
        if not n:
            return
        yield view[:n]


def match_ascii(pattern: re.Pattern[str], raw: bytes | bytearray) -> re.Match[str] | None:
    """``pattern.fullmatch`` of ``raw`` read as ASCII: None when it does not match or is not ASCII.

    How a one-line file (a sha256 sidecar, an HMAC signature) is parsed.
    """
    try:
        return pattern.fullmatch(raw.decode("ascii"))
    except UnicodeDecodeError:
        return None


def require_regular_file(path: str | Path, what: str = "checkpoint") -> Path:
    """Return ``path`` if it is an existing, readable regular file, else a clear error.

    A check of the *path* for early, friendly errors; whoever then reads the
    file must open it with :func:`open_regular` (which re-checks the open
    descriptor), never trust this check alone.
    """
    p = Path(path)
    if not os.path.lexists(p):
        raise BadInput(
            f"{what} not found",
            file=p,
            expected="an existing file",
            found="nothing at this path",
            hint="check the path; `ripresa inspect RUN` lists the valid generations",
        )
    if p.is_dir():
        raise BadInput(
            f"{what} is a folder", file=p, expected="a regular file", found="a folder", hint=_FOLDER_HINT
        )
    if not p.is_file():
        try:
            found = _kind_of(os.stat(p).st_mode)
        except OSError:
            found = "a dangling symlink"
        raise BadInput(
            f"{what} is not a regular file",
            file=p,
            expected="a regular file",
            found=found,
            hint="ripresa never reads from special files",
        )
    if not os.access(p, os.R_OK):
        raise BadInput(f"{what} is not readable", file=p, expected="read permission", found="none")
    return p
