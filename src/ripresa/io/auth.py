"""Authenticated checkpoints: an HMAC-SHA256 signature per generation.

A sha256 marker detects that a file changed, not who wrote it. With a secret
key (``RIPRESA_HMAC_KEY`` or ``RIPRESA_HMAC_KEY_FILE``), each committed
generation gets a ``.hmac`` line whose MAC binds the step, the file names and
their sha256s, so an edited, renamed or re-paired generation fails; with
``require_signature`` an unsigned or mis-signed one is invalid. Formats of the
line and of the signed message: docs/FORMAT.md ("Commit marker", "Signature
step_NNNNNN.dcp.hmac"); threat model: docs/OPERATIONS.md "Authenticated checkpoints" and
docs/FAULTS.md.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path

from ..core.numbers import checked_number
from ..errors import BadInput, IntegrityError

ENV_KEY = "RIPRESA_HMAC_KEY"
ENV_KEY_FILE = "RIPRESA_HMAC_KEY_FILE"
ENV_REQUIRE = "RIPRESA_REQUIRE_SIGNATURE"
#: Shortest key accepted (bytes): 128 bits.
MIN_KEY_BYTES = 16
#: Largest key file read (bytes).
MAX_KEY_FILE = 4096
#: The signature file's suffix, after the ``.bin``'s name.
SUFFIX = ".hmac"
#: Largest signature file read (bytes); a valid line is about 130.
MAX_SIGNATURE = 512

_LINE_RE = re.compile(
    r"ripresa-hmac-sha256 v1 key=(?P<key>[0-9a-f]{16}) step=(?P<step>0|[1-9][0-9]{0,9}) mac=(?P<mac>[0-9a-f]{64})\n?\Z"
)
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class SignatureError(IntegrityError):
    """A generation is unsigned, signed with another key, or its signature does not match."""


def signature_path(bin_path: str | os.PathLike[str]) -> Path:
    """``.../step_000100.bin`` → ``.../step_000100.bin.hmac``."""
    p = Path(bin_path)
    return p.with_name(p.name + SUFFIX)


def require_signature_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``RIPRESA_REQUIRE_SIGNATURE`` is set to 1/true/yes/on."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_REQUIRE, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise BadInput(f"invalid {ENV_REQUIRE}", expected="1 or 0", found=raw[:40])


def _check_key(key: bytes, source: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise BadInput(
            "HMAC key too short",
            file=source if source.startswith("/") else None,
            expected=f"at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`)",
            found=f"{len(key)} bytes from {source}",
            hint="a short key can be guessed offline from one signature",
        )
    return key


def _read_key_file(path: Path) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise BadInput(
            f"cannot open the HMAC key file ({ENV_KEY_FILE})",
            file=path,
            expected="a readable regular file holding the key",
            found=f"[errno {exc.errno} {errno.errorcode.get(exc.errno or 0, '?')}] {exc.strerror}",
            hint=f"fix {ENV_KEY_FILE} or unset it",
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput("the HMAC key file is not a regular file", file=path, expected="a regular file",
                           found="a folder, FIFO or device")
        if st.st_mode & 0o077:
            warnings.warn(f"HMAC key file {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                          "chmod 600 it", stacklevel=3)
        raw = os.read(fd, MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_KEY_FILE:
        raise BadInput("the HMAC key file is too large", file=path, expected=f"<= {MAX_KEY_FILE} bytes",
                       found=f"more than {MAX_KEY_FILE} bytes")
    if raw.endswith(b"\n"):
        raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
    return _check_key(raw, str(path))


def load_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The HMAC key from ``RIPRESA_HMAC_KEY`` or ``RIPRESA_HMAC_KEY_FILE``; ``None`` if neither is set."""
    env = os.environ if environ is None else environ
    inline = env.get(ENV_KEY)
    path = env.get(ENV_KEY_FILE)
    if inline and path:
        raise BadInput(
            f"both {ENV_KEY} and {ENV_KEY_FILE} are set",
            expected="one source for the HMAC key",
            found="both",
            hint="unset one of them",
        )
    if inline:
        return _check_key(inline.encode(), ENV_KEY)
    if path:
        return _read_key_file(Path(path))
    return None


def key_id(key: bytes) -> str:
    """A short, non-secret identifier of ``key`` (16 hex): names the key, reveals nothing usable."""
    return hmac.new(key, b"ripresa key id v1", hashlib.sha256).hexdigest()[:16]


def message(step: int, bin_name: str, bin_sha256: str, companion_name: str, companion_sha256: str) -> bytes:
    """The canonical bytes a generation's MAC covers."""
    for h in (bin_sha256, companion_sha256):
        if not isinstance(h, str) or not _HEX64.match(h):
            raise ValueError(f"not a sha256 hex digest: {h!r}")
    return (
        "ripresa generation signature v1\n"
        f"step={int(step)}\n"
        f"bin={bin_name} {bin_sha256}\n"
        f"companion={companion_name} {companion_sha256}\n"
    ).encode()


def dcp_message(step: int, folder_name: str, files: Mapping[str, str]) -> bytes:
    """The canonical bytes a ``.dcp`` generation's MAC covers: its step, its folder's
    name and every file of the folder (shards, ``.metadata``, companion) with its sha256."""
    lines = ["ripresa dcp generation signature v1", f"step={int(step)}", f"folder={folder_name}"]
    for name in sorted(files):
        h = files[name]
        if not isinstance(h, str) or not _HEX64.match(h) or "\n" in name or "/" in name:
            raise ValueError(f"not a file name and sha256 hex digest: {name!r} {h!r}")
        lines.append(f"file={name} {h}")
    return ("\n".join(lines) + "\n").encode()


def dcp_signature_line(key: bytes, step: int, folder_name: str, files: Mapping[str, str]) -> bytes:
    """The content of ``step_NNNNNN.dcp.hmac`` (the same line format as a ``.bin.hmac``)."""
    m = mac(key, dcp_message(step, folder_name, files))
    return f"ripresa-hmac-sha256 v1 key={key_id(key)} step={int(step)} mac={m}\n".encode()


def verify_dcp(key: bytes, sig_path: Path, step: int, folder_name: str, files: Mapping[str, str]) -> None:
    """Raise :class:`SignatureError` unless ``sig_path`` signs exactly this ``.dcp`` generation with ``key``."""
    _check_mac(key, sig_path, step, mac(key, dcp_message(step, folder_name, files)),
               f"the HMAC of step {step}, {folder_name} and its {len(files)} files as committed")


def _check_mac(key: bytes, sig_path: Path, step: int, want: str, what: str) -> None:
    kid, sig_step, got = read_signature(sig_path)
    if kid != key_id(key):
        raise SignatureError(
            "generation was signed with another key",
            file=sig_path,
            expected=f"key id {key_id(key)} (the configured key)",
            found=f"key id {kid}",
            hint="set the key this run was saved with, or treat the generation as untrusted",
        )
    if not hmac.compare_digest(want.encode(), got.encode()) or sig_step != step:
        raise SignatureError(
            "signature does not match the generation",
            file=sig_path,
            expected=what,
            found="another MAC" + (f" (for step {sig_step})" if sig_step != step else ""),
            hint="the files, the marker or the signature were changed by someone without the key",
        )


def mac(key: bytes, msg: bytes) -> str:
    """HMAC-SHA256 of ``msg`` (hex)."""
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def signature_line(key: bytes, step: int, bin_name: str, bin_sha256: str, companion_name: str,
                   companion_sha256: str) -> bytes:
    """The content of ``step_NNNNNN.bin.hmac``."""
    m = mac(key, message(step, bin_name, bin_sha256, companion_name, companion_sha256))
    return f"ripresa-hmac-sha256 v1 key={key_id(key)} step={int(step)} mac={m}\n".encode()


def read_signature(path: Path) -> tuple[str, int, str]:
    """Parse a signature file; return ``(key id, step, mac)``.

    Opened without following symlinks and without blocking (a FIFO never
    hangs the reader), checked on the open descriptor, at most
    :data:`MAX_SIGNATURE` + 1 bytes read.
    """
    from .fsio import read_small

    if not os.path.lexists(path):
        raise SignatureError(
            "generation is not signed",
            file=path,
            expected=f"a signature {path.name} (a key was configured when it was saved)",
            found="nothing",
            hint="--require-signature refuses unsigned generations; save with RIPRESA_HMAC_KEY set",
        )
    raw = read_small(path, "signature file", MAX_SIGNATURE, error=SignatureError)  # no link, no FIFO, bounded
    return parse_signature(raw, path)


def parse_signature(raw: bytes, where: str | os.PathLike[str]) -> tuple[str, int, str]:
    """Parse the bytes of a signature line (a file's, or an object's of a mirror); ``(key id, step, mac)``."""
    from .fsio import match_ascii

    m = match_ascii(_LINE_RE, raw[: MAX_SIGNATURE + 1]) if len(raw) <= MAX_SIGNATURE else None
    if m is None:
        raise SignatureError(
            "malformed signature file",
            file=where,
            expected="one line 'ripresa-hmac-sha256 v1 key=<16 hex> step=<N> mac=<64 hex>'",
            found=repr(raw[:120]),
            hint="the signature is damaged or forged; this generation cannot be trusted",
        )
    return m.group("key"), checked_number(m.group("step"), file=where, field="signature step", lo=0, hi=2**63 - 1,
                                          text=True, error=SignatureError), m.group("mac")


def verify(key: bytes, sig_path: Path, step: int, bin_name: str, bin_sha256: str, companion_name: str,
           companion_sha256: str) -> None:
    """Raise :class:`SignatureError` unless ``sig_path`` signs exactly this generation with ``key``."""
    _check_mac(key, sig_path, step, mac(key, message(step, bin_name, bin_sha256, companion_name, companion_sha256)),
               f"the HMAC of step {step}, {bin_name} and {companion_name} as committed")


def file_message(name: str, sha256: str) -> bytes:
    """The canonical bytes a signed run file's MAC covers (``config.json`` in a mirror): its name and sha256."""
    if not _HEX64.match(sha256) or "\n" in name:
        raise ValueError(f"not a file name and sha256 hex digest: {name!r} {sha256!r}")
    return f"ripresa file signature v1\nname={name}\nsha256={sha256}\n".encode()


def file_signature_line(key: bytes, name: str, data: bytes) -> bytes:
    """The signature of a run file (``config.json.hmac`` in a mirror; the same line format as a ``.bin.hmac``, step 0)."""
    m = mac(key, file_message(name, hashlib.sha256(data).hexdigest()))
    return f"ripresa-hmac-sha256 v1 key={key_id(key)} step=0 mac={m}\n".encode()


def verify_file(key: bytes, sig: bytes, name: str, data: bytes, where: str | os.PathLike[str]) -> None:
    """Raise :class:`SignatureError` unless ``sig`` (the bytes of a signature line) signs ``data`` as ``name``."""
    kid, step, got = parse_signature(sig, where)
    if kid != key_id(key):
        raise SignatureError(f"{name} was signed with another key", file=where,
                             expected=f"key id {key_id(key)} (the configured key)", found=f"key id {kid}",
                             hint=f"set the key this run was saved with, or do not trust this {name}")
    want = mac(key, file_message(name, hashlib.sha256(data).hexdigest()))
    if step != 0 or not hmac.compare_digest(want.encode(), got.encode()):
        raise SignatureError(f"the signature does not match {name}", file=where,
                             expected=f"the HMAC of {name} as its writer uploaded it", found="another MAC",
                             hint=f"{name} or its signature was changed by someone without the key")


def write_signed_run_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a run file a resume trusts (``config.json``) atomically, and its signature ``NAME.hmac`` beside it
    when the run key is configured; written without a key, a signature left from before is removed (it would no
    longer match). docs/FAULTS.md, "Trust model"."""
    from .fsio import ops, read_small, write_atomic

    p = Path(path)
    sig = p.with_name(p.name + SUFFIX)
    key = load_key()
    if key is None:
        write_atomic(p, [data])
        if os.path.lexists(sig):
            ops.unlink(sig)
        return
    # Crash-safe in three renames: the signature of the new bytes joins the old one, the file is replaced, the
    # old signature leaves. A kill between any two leaves a signature file with a line matching the file.
    new = file_signature_line(key, p.name, data)
    old = b""
    if os.path.lexists(p):
        try:
            old = file_signature_line(key, p.name, read_small(p, p.name, 1 << 24, error=IntegrityError))
        except IntegrityError:
            old = b""
    if old and old != new:
        write_atomic(sig, [new, old])
    write_atomic(p, [data])
    write_atomic(sig, [new])


def check_run_file(path: str | os.PathLike[str], data: bytes, *, require: bool | None = None) -> None:
    """Check the bytes of a run file a resume trusts (``config.json``) against ``NAME.hmac`` beside it.

    With the run key configured and a signature present, it must verify (:class:`SignatureError`, exit 1);
    under require-signature (``require``, by default ``RIPRESA_REQUIRE_SIGNATURE``) an unsigned one, or one
    that cannot be checked for want of the key, is refused too. Without either, an unsigned file is used as
    it is (a run written before its files were signed).
    """
    from .fsio import read_small

    p = Path(path)
    sig_path = p.with_name(p.name + SUFFIX)
    sig = read_small(sig_path, f"{p.name} signature", 2 * MAX_SIGNATURE, error=IntegrityError) \
        if os.path.lexists(sig_path) else None
    key = load_key()
    require = require_signature_from_env() if require is None else require
    if sig is not None and key is not None:
        lines = sig.splitlines(keepends=True)
        if not 1 <= len(lines) <= 2:  # two while a writer replaces the file (write_signed_run_file)
            raise SignatureError(f"malformed signature of {p.name}", file=sig_path, expected="one or two lines",
                                 found=f"{len(lines)} lines")
        for i, line in enumerate(lines):
            try:
                verify_file(key, line, p.name, data, sig_path)
                break
            except SignatureError:
                if i == len(lines) - 1:
                    raise
    elif require:
        raise SignatureError(f"{p.name} is not signed, and signatures are required", file=p,
                             expected=f"{sig_path.name} beside it, made with the run's key" if key is not None
                             else "the run's key configured",
                             found="no signature" if sig is None else "no key to check its signature",
                             hint=f"a run's {p.name} is signed when ripresa writes it with the key configured; "
                             "give the settings explicitly, or drop --require-signature to use it knowingly")


def record_message(run: str, url: str) -> bytes:
    """The canonical bytes the MAC of a run's ``mirror.json`` covers: the run folder's real path and the URL."""
    if "\n" in run or "\n" in url:
        raise ValueError("a run path or URL with a newline")
    return f"ripresa mirror record v1\nrun={run}\nurl={url}\n".encode()


def missing_key_error(what: str) -> BadInput:
    """The error for a required signature with no key configured."""
    return BadInput(
        f"{what} needs the HMAC key",
        expected=f"{ENV_KEY} or {ENV_KEY_FILE} set",
        found="neither",
        hint=f"export {ENV_KEY_FILE}=/path/to/key (chmod 600), or drop --require-signature",
    )


__all__ = [
    "ENV_KEY",
    "ENV_KEY_FILE",
    "ENV_REQUIRE",
    "MIN_KEY_BYTES",
    "dcp_message",
    "dcp_signature_line",
    "file_message",
    "file_signature_line",
    "parse_signature",
    "record_message",
    "verify_file",
    "check_run_file",
    "write_signed_run_file",
    "verify_dcp",
    "unsigned_error",
    "SignatureError",
    "key_id",
    "load_key",
    "message",
    "missing_key_error",
    "read_signature",
    "require_signature_from_env",
    "signature_line",
    "signature_path",
    "verify",
]


def require_from_cli(what: str) -> bytes:
    """``--require-signature``: check a key is configured, then set ``RIPRESA_REQUIRE_SIGNATURE=1``.

    Set in the environment, so that every store the command opens (the
    trainer's :class:`~ripresa.store.store.CheckpointStore`, a ``--resume`` reader,
    ``ripresa inspect``'s reader) refuses unsigned or mis-signed generations.
    Returns the key.
    """
    key = load_key()
    if key is None:
        raise missing_key_error(what)
    os.environ[ENV_REQUIRE] = "1"
    return key


def unsigned_error(what: str, path: str | os.PathLike[str], missing: str) -> SignatureError:
    """The error for a file that cannot carry a signature, refused under require-signature."""
    return SignatureError(
        f"{what} is not signed, and signatures are required",
        file=path,
        expected=f"a signed generation of a run folder ({ENV_REQUIRE} / --require-signature is set)",
        found=f"{what}: {missing}",
        hint="only step_NNNNNN.bin and step_NNNNNN.dcp generations saved with the key are trusted; "
        f"unset {ENV_REQUIRE} (drop --require-signature) to load it knowingly",
    )
