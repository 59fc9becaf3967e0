"""Open files and placeholders of the state fingerprint's readers (docs/FORMAT.md, "The state fingerprint").

:class:`OpenFiles` keeps every file a fingerprint reads open until its blocks are hashed; :func:`placeholders`
turns a safetensors file's validated header into tensors: small ones read, the others ``meta`` tensors that stand
for their byte range (hashed straight from the file by :mod:`ripresa.io.merkle`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput, IntegrityError
from ..io.fsio import open_run_file
from ..io.merkle import FileRange
from .safetensors_file import Header, header_fd

#: A tensor of at most this many bytes is read into memory at once (the rest are hashed from the file).
SMALL = 64 * 1024


class OpenFiles(contextlib.ExitStack):
    """The files a fingerprint keeps open until its blocks are hashed (each opened without following a link or
    blocking on a FIFO; closed when the stack closes)."""

    def open(self, path: Path, what: str) -> int:
        fd = open_run_file(path, what, error=IntegrityError)
        self.callback(os.close, fd)
        return fd


def lstat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadInput("the path cannot be read", file=path, found=str(exc)[:160]) from None


def read_range(fd: int, offset: int, n: int, path: Path) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise IntegrityError("a file is shorter than its header says", file=path,
                                 expected=f"{n} bytes at offset {offset}", found=f"{done} bytes",
                                 hint="the file is truncated or changed while read")
        done += got
    return buf


def placeholders(fd: int, path: Path, header: Header, sources: dict[int, list[FileRange]],
                  keep: list[Any]) -> dict[str, torch.Tensor]:
    """key -> tensor of a safetensors file: small ones (and the 1-D ``U8``/``I64`` a companion may decode) read,
    the others meta tensors standing for their byte range (``sources``)."""
    out: dict[str, torch.Tensor] = {}
    for e in header.entries:
        dt, n = e.torch_dtype, e.end - e.begin
        if n <= SMALL or (len(e.shape) == 1 and dt in (torch.uint8, torch.int64)):
            raw = read_range(fd, header.data_start + e.begin, n, path)
            t = torch.frombuffer(raw, dtype=dt).reshape(e.shape) if n else torch.empty(e.shape, dtype=dt)
        else:
            t = torch.empty(e.shape, dtype=dt, device="meta")
            sources[id(t)] = [FileRange(fd, header.data_start + e.begin, n, str(path))]
        keep.append(t)
        out[e.key] = t
    return out


def plain_safetensors(paths: Sequence[Path], files: OpenFiles, sources: dict[int, list[FileRange]],
                       keep: list[Any]) -> dict[str, torch.Tensor]:
    model: dict[str, torch.Tensor] = {}
    for p in paths:
        fd = files.open(p, "safetensors file")
        for k, t in placeholders(fd, p, header_fd(fd, p), sources, keep).items():
            if k in model:
                raise IntegrityError("two files hold the same tensor", file=p, found=k[:120])
            model[k] = t
    return model
