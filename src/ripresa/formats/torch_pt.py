"""The torch-native ``checkpoint.pt`` (docs/FORMAT.md, "``checkpoint.pt``").

A dict of tensors and primitives that loads with ``torch.load(weights_only=True)`` and nothing
else, with ``checkpoint.pt.sha256`` (``sha256sum`` format) as its commit marker, written last.
Writing streams the pickle into a temporary sibling while hashing it, ``fsync``, rename, folder
``fsync``, then the sidecar. Loading checks, in order, the sidecar, the hash, the zip directory
(:func:`check_zip_directory`), the safe unpickler and the schema: nothing is trusted before the step
that checks it, nothing is inflated or allocated from a size the file declares.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from struct import error as struct_error
from typing import Any

import torch

from ..core.schema import validate_checkpoint
from ..errors import IntegrityError, SchemaError
from ..io.fsio import (
    Digest,
    StagedFile,
    clean_temporaries,
    fsync_dir,
    open_regular,
    read_sidecar,
    require_regular_file,
    write_sidecar,
)
from ..io.hashing import read_whole_hashing

#: Leaf types allowed anywhere in a checkpoint (what ``weights_only`` can load
#: without extra globals, minus anything that could smuggle code).
_SAFE_LEAVES = (bool, int, float, str, bytes, type(None), torch.Tensor)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint: where it came from and what it holds."""

    path: Path
    digest: Digest
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["progress"]["step"])


def check_safe_tree(obj: Any, where: str = "checkpoint") -> None:
    """Raise :class:`SchemaError` if ``obj`` holds anything but safe primitives.

    Dict keys must be ``str`` or ``int`` (optimizer states are keyed by index).
    NumPy arrays and custom classes are refused: they need ``weights_only=False``.
    """
    stack: list[tuple[str, Any]] = [(where, obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, Mapping):
            if type(v) is not dict:
                raise SchemaError(f"{path} is a {type(v).__name__}, not a plain dict", hint="convert with dict(...)")
            for k, x in v.items():
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise SchemaError(f"{path} has a key of type {type(k).__name__}", expected="str or int keys", found=repr(k))
                stack.append((f"{path}.{k}", x))
        elif isinstance(v, list | tuple):
            if type(v) not in (list, tuple):
                raise SchemaError(f"{path} is a {type(v).__name__}", expected="a plain list or tuple")
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
        elif isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                raise SchemaError(f"{path} is a tensor subclass {type(v).__name__}", hint="save plain tensors (.detach())")
        elif type(v) not in _SAFE_LEAVES:
            raise SchemaError(
                f"{path} holds a {type(v).__module__}.{type(v).__name__}, which weights_only loading refuses",
                expected="ints, floats, strings, lists, dicts, tensors",
                found=type(v).__name__,
                hint="convert numpy arrays with .tolist() or torch.from_numpy(...), objects with state_dict()",
            )


def _path_argument(path: object) -> Path:
    """``path`` as a :class:`Path`; ``TypeError`` (API misuse) for anything but ``str`` or ``os.PathLike``."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    return Path(path)


def save_checkpoint(path: str | Path, state: Mapping[str, Any]) -> Digest:
    """Write ``state`` durably to ``path`` + ``path.sha256``; return the digest.

    The previous file at ``path`` (if any) is replaced only by the atomic
    rename of a complete, ``fsync``'d new file; until the sidecar is written
    the old sidecar no longer matches, so a crash in that window leaves a
    generation a reader refuses (never a damaged one it trusts). Use the
    run-folder store for multiple generations.
    """
    path = _path_argument(path)
    if not isinstance(state, Mapping):
        raise TypeError(f"save_checkpoint needs a mapping state (TrainingState.snapshot(...)), not {type(state).__name__}")
    validate_checkpoint(state, path)
    check_safe_tree(dict(state))
    clean_temporaries(path.parent)
    with StagedFile(path) as f:
        torch.save(dict(state), f)
        digest = f.finish()
        f.publish()
    fsync_dir(path.parent)
    write_sidecar(path, digest)  # the commit marker, last
    return digest


def load_checkpoint(path: str | Path, *, require_signature: bool | None = None) -> Checkpoint:
    """Verify and load a ``checkpoint.pt``.

    Order: the file exists and is regular → the sidecar is well-formed → the
    sha256 matches → ``torch.load(weights_only=True)`` → the schema. Any
    failure raises a typed error naming the file, expected, found and a hint.
    A ``checkpoint.pt`` carries no signature: under ``require_signature``
    (``None``: ``RIPRESA_REQUIRE_SIGNATURE``) it is refused before it is read.
    """
    path = _path_argument(path)
    if require_signature is not None and not isinstance(require_signature, bool):
        raise TypeError(f"require_signature must be a bool or None, not {type(require_signature).__name__}")
    refuse_unsigned(path, require_signature)
    raw, digest = _read_verified(path)  # one read: the bytes checked and loaded are the bytes hashed
    check_zip_directory(path, raw)
    try:
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise IntegrityError(
            "checkpoint refused by the safe loader (weights_only=True)",
            file=path,
            expected="only tensors and primitives",
            found=_unpickler_reason(exc),
            hint="the file names a global the safe loader does not allow; it was not written by ripresa "
            "and was not executed. Never load it with weights_only=False",
        ) from exc
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError) as exc:
        raise IntegrityError(
            "checkpoint could not be read", file=path, expected="a readable torch archive",
            found=f"{type(exc).__name__}: {str(exc)[:300]}", hint="the file is damaged",
        ) from exc
    validate_checkpoint(state, path)
    return Checkpoint(path=path, digest=digest, state=state)


def _read_verified(path: Path) -> tuple[bytearray, Digest]:
    """The whole file, read once (one descriptor, checked regular: a FIFO never blocks) while hashed, and its
    digest checked against the ``.sha256`` sidecar; never a second open of the path."""
    p = require_regular_file(path)
    expected = read_sidecar(p)
    fd = open_regular(p, "checkpoint")
    try:
        raw, digest, grew = read_whole_hashing(fd, os.fstat(fd).st_size, path=p, what="checkpoint")
    finally:
        os.close(fd)
    found = digest.sha256
    if grew or found != expected:
        raise IntegrityError(
            "sha256 mismatch: the file changed after it was committed",
            file=p,
            expected=expected,
            found="a file that grew while read" if grew else found,
            hint="the file is damaged (truncated, bit rot, or edited); use an earlier generation",
        )
    return raw, digest


def refuse_unsigned(path: Path, require_signature: bool | None = None) -> None:
    """Raise :class:`~ripresa.io.auth.SignatureError` when signatures are required: ``checkpoint.pt`` has none."""
    from ..io import auth

    if auth.require_signature_from_env() if require_signature is None else require_signature:
        raise auth.unsigned_error("a checkpoint.pt", path, "the torch-native format carries no HMAC signature")


#: Most members a checkpoint.pt may have (torch writes one per storage plus ~6).
MAX_ZIP_MEMBERS = 1_000_000


def check_zip_directory(path: str | Path, data: bytes | bytearray) -> None:
    """Refuse, from the zip's directory and before ``torch.load``, a ``checkpoint.pt`` torch never writes.

    ``data`` is the file's bytes as read and hashed once (``path`` only names it in errors).

    ``torch.save`` stores every member uncompressed in one top folder. A
    compressed (deflated) member, a member whose declared size exceeds the
    file or whose data lies outside it, more than :data:`MAX_ZIP_MEMBERS`
    members (counted from the end record, before the directory is parsed),
    a name with ``..``, a backslash or a leading ``/``, or members in more
    than one top folder: each is an :class:`IntegrityError`. A 1 MB file can
    therefore never make the loader inflate or allocate gigabytes.
    """
    p = Path(path)

    def bad(message: str, expected: Any, found: Any) -> IntegrityError:
        return IntegrityError(message, file=p, expected=expected, found=found,
                              hint="torch.save never writes this; the file was not written by ripresa and is not loaded")

    try:
        file_size = len(data)
        f = io.BytesIO(data)
        end = zipfile._EndRecData(f)  # the end record only: entry count and directory size, nothing allocated
        if not end:
            raise bad("checkpoint is not a torch zip archive", "a torch.save zip archive (end-of-central-directory record)",
                      "no zip directory")
        entries, cd_size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]
        if entries > MAX_ZIP_MEMBERS or cd_size > file_size:
            raise bad("checkpoint's zip directory is implausibly large", f"<= {MAX_ZIP_MEMBERS} members within the file",
                      f"{entries} members, a {cd_size}-byte directory in a {file_size}-byte file")
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except IntegrityError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct_error, UnicodeDecodeError) as exc:
        raise bad("checkpoint's zip directory cannot be read", "a torch.save zip archive",
                  f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    if not infos:
        raise bad("checkpoint's zip archive is empty", "data.pkl and its storages", "no member")
    tops = set()
    total = 0
    for info in infos:
        name = info.filename
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or ".." in parts or len(parts) < 2 or not parts[0]:
            raise bad("checkpoint's zip member name is outside the archive's folder", "ARCHIVE/member", repr(name)[:120])
        tops.add(parts[0])
        if info.compress_type != zipfile.ZIP_STORED:
            raise bad("checkpoint's zip member is compressed", "stored (uncompressed) members, as torch.save writes",
                      f"{name[:80]}: compression method {info.compress_type}")
        if (info.file_size != info.compress_size or info.file_size > file_size
                or info.header_offset + info.compress_size > file_size):
            raise bad("checkpoint's zip member declares a size beyond the file",
                      f"stored sizes within the {file_size}-byte file",
                      f"{name[:80]}: {info.file_size} bytes declared, {info.compress_size} stored at {info.header_offset}")
        total += info.compress_size
    if len(tops) != 1:
        raise bad("checkpoint's zip members are in more than one folder", "one archive folder", sorted(tops)[:5])
    if total > file_size:
        raise bad("checkpoint's zip members declare more bytes than the file holds", f"<= {file_size} bytes", total)


def _unpickler_reason(exc: Exception) -> str:
    """The one informative line of torch's weights_only refusal."""
    for line in str(exc).splitlines():
        if "WeightsUnpickler error" in line:
            return line.strip()[:300]
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
