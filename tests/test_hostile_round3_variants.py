"""Issue 29's classes, variants the first fixes missed (the red team's pass; docs/FAULTS.md, "Round three").

Each test is one variant tried on the real CLI (or the public API) that broke before its fix:

1. many bounded pieces: a sparse ledger cut into lines each under the record bound (their sum was
   read whole into memory: 2.4 GB of RSS for a 1 GiB file that is 256 KB on disk);
2. ... (see each test's docstring).

Every case must end in exit 1 or 2 with one typed paragraph (no "bug" report, no traceback).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PY = sys.executable


def _cli(*args: str, cwd: Path | None = None, env: dict | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="80", RIPRESA_PROGRESS="0")
    full.pop("RIPRESA_DEBUG", None)
    if env:
        full.update(env)
    return subprocess.run([PY, "-m", "ripresa", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full)


def _typed(res: subprocess.CompletedProcess, codes: tuple[int, ...] = (1, 2)) -> str:
    out = res.stdout + res.stderr
    assert res.returncode in codes, out
    assert "Traceback" not in out and "bug" not in out.lower(), out
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A real ``ripresa train`` run of the tiny model: one generation at step 10."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    res = _cli("train", "--run", run, "--config", "tiny", "--quiet", "--threads", "1",
               "--set", "train.batch_size=4", "--steps", "10", "--every", "10", "--no-audit", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return run


# ---------------------------------------------------------------- 1. many bounded pieces adding up


def test_a_sparse_ledger_of_many_short_lines_is_refused_in_bounded_memory(tiny_run, tmp_path):
    """``ripresa generate`` on a 1 GiB ledger (sparse: 256 KB on disk) cut by a newline every 16 MiB:
    each line is under the record bound, their sum is not. Before: the whole GiB was read into one
    bytes object before any line was parsed (2.4 GB peak RSS, 6 s). Now the ledger is streamed,
    the first line that is not a record stops it, and memory stays that of the model."""
    inputs = tmp_path / "in.txt"
    inputs.write_text("hello\nworld\n")
    out = tmp_path / "out.jsonl"
    with open(out, "wb") as f:
        for i in range(64):
            f.seek((i + 1) * (16 << 20) - 1)
            f.write(b"\n")
    probe = textwrap.dedent("""
        import resource, subprocess, sys
        res = subprocess.run(sys.argv[1:], capture_output=True, text=True)
        sys.stdout.write(res.stdout + res.stderr)
        print("RC", res.returncode)
        print("MAXRSS_KIB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    """)
    res = subprocess.run([PY, "-c", probe, PY, "-m", "ripresa", "generate", str(tiny_run), "--inputs", str(inputs),
                          "--out", str(out)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, RIPRESA_PROGRESS="0"))
    text = res.stdout
    assert "RC 1" in text, text
    assert "Traceback" not in text, text
    assert "ledger line 1: not a JSON object" in text, text
    rss_kib = int(text.split("MAXRSS_KIB")[1])
    assert rss_kib < 1024 * 1024, text  # the model and torch (~0.4 GB), never the GiB of the ledger
    assert os.path.getsize(out) == 1 << 30  # the refused ledger is left as it was
