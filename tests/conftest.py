"""Shared helpers: the repository root, running the CLI and scripts in real subprocesses."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRAIN = EXAMPLES / "regression" / "train.py"


def run(argv: list[str], *, cwd: Path | None = None, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command in a fresh process; capture text output."""
    full_env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="200")
    if env:
        full_env.update(env)
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def ripresa_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "ripresa", *map(str, args)], **kw)


def train(*args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-B", str(TRAIN), *map(str, args)], **kw)


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (to prove nothing was changed)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def interrupted_run(tmp_path_factory) -> Path:
    """A real 5-step run of the reference exercise (checkpoint at the cut)."""
    out = tmp_path_factory.mktemp("exercise") / "interrupted"
    res = train("--steps", "5", "--output", out)
    assert res.returncode == 0, res.stderr
    return out
