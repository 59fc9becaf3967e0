"""Who wrote a checkpoint: versions, code identity and data identity.

* versions — python, torch, numpy, ripresa, platform, torch thread count, device;
* code identity — git commit and dirty flag of the repository holding the
  training code (recorded, informative) and the sha256 of the training code
  files themselves (compared: this is what decides the trajectory);
* data identity — sha256 of the data each source serves.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..io.fsio import sha256_file

#: Version fields that must match for a resume unless explicitly allowed.
COMPARED_VERSIONS = ("python", "torch", "numpy", "ripresa")


def versions(device: str | None = None) -> dict[str, Any]:
    """Versions of everything that can change a trajectory."""
    if device is None:
        device = f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "numpy": str(np.__version__),
        "ripresa": __version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "device": device,
        "cuda": None if torch.version.cuda is None else str(torch.version.cuda),
    }


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_identity(files: Iterable[str | Path]) -> dict[str, Any]:
    """sha256 of the training code files (in the given order) + git commit/dirty.

    ``files_sha256`` hashes each file's name and content, so renaming or
    editing any of them changes it.
    """
    paths = [Path(f).resolve() for f in files]
    h = hashlib.sha256()
    per_file: dict[str, str] = {}
    for p in paths:
        d = sha256_file(p)
        per_file[p.name] = d.sha256
        h.update(p.name.encode() + b"\0" + d.sha256.encode() + b"\n")
    commit = dirty = None
    if paths:
        cwd = paths[0].parent
        commit = _git(["rev-parse", "HEAD"], cwd)
        if commit is not None:
            status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
            dirty = bool(status) if status is not None else None
    return {
        "files_sha256": h.hexdigest(),
        "files": per_file,
        "git_commit": commit,
        "git_dirty": dirty,
    }


def data_identity(sources: Mapping[str, str | Path | bytes]) -> dict[str, str]:
    """sha256 per data source: a file, a folder (sorted files, names included) or bytes."""
    out: dict[str, str] = {}
    for name, src in sources.items():
        if isinstance(src, bytes | bytearray | memoryview):
            out[name] = hashlib.sha256(src).hexdigest()
            continue
        p = Path(src)
        if p.is_dir():
            h = hashlib.sha256()
            for f in sorted(x for x in p.rglob("*") if x.is_file()):
                h.update(str(f.relative_to(p)).encode() + b"\0" + sha256_file(f).sha256.encode() + b"\n")
            out[name] = h.hexdigest()
        else:
            out[name] = sha256_file(p).sha256
    return out


def python_executable() -> str:
    """The interpreter running ripresa (used to start fresh processes)."""
    return sys.executable
