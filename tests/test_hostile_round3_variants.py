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


# ---------------------------------------------------------------- 80 columns: a hash is never cut


def _hashes_whole(text: str, digests: list[str]) -> None:
    for line in text.splitlines():
        assert len(line.rstrip()) <= 80, repr(line)
    for d in digests:
        assert d in text, (d, text)  # on one line, whole


def test_inspect_file_tables_keep_a_sha256_on_one_line(tiny_run, tmp_path):
    """``ripresa inspect FILE`` of a ``.bin``, a general ``.safetensors`` and a ``checkpoint.pt`` at
    80 columns: the key/value box cut every sha256 in its value column (57 characters wide). Now
    a value that does not fit beside its field is on its own line under it."""
    import hashlib

    import torch

    bin_file = tiny_run / "step_000010.bin"
    res = _cli("inspect", bin_file.name, "--no-deep", cwd=tiny_run)
    assert res.returncode == 0, res.stdout + res.stderr
    marker = (tiny_run / "step_000010.bin.sha256").read_text().split()
    _hashes_whole(res.stdout, [w for w in marker if len(w) == 64])
    res = _cli("inspect", bin_file.name, cwd=tiny_run)
    assert res.returncode == 0, res.stdout + res.stderr
    _hashes_whole(res.stdout, [hashlib.sha256(bin_file.read_bytes()).hexdigest()])

    import ripresa

    run = tmp_path / "general"
    model = torch.nn.Linear(3, 2)
    state = ripresa.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with ripresa.Checkpointer(run, state, every=1, asynchronous=False, handle_signals=False) as ck:
        ck.resume()
        ck.step_done(1)
    (gen,) = sorted(run.glob("*.safetensors"))
    res = _cli("inspect", gen.relative_to(tmp_path), cwd=tmp_path)  # a short path: the lines fit
    assert res.returncode == 0, res.stdout + res.stderr
    _hashes_whole(res.stdout, [hashlib.sha256(gen.read_bytes()).hexdigest()])


def test_inspect_checkpoint_pt_keeps_its_sidecar_hash_on_one_line(interrupted_run):
    """The same for ``checkpoint.pt`` (its sidecar's expected sha256 was cut in the box)."""
    import hashlib

    pt = interrupted_run / "checkpoint.pt"
    res = _cli("inspect", pt.name, cwd=interrupted_run)
    assert res.returncode == 0, res.stdout + res.stderr
    _hashes_whole(res.stdout, [hashlib.sha256(pt.read_bytes()).hexdigest()])


# ---------------------------------------------------------------- 3. a variable trusted at start


LOOP = Path(__file__).resolve().parents[1] / "examples" / "loop" / "train.py"


@pytest.mark.slow  # ~10 s: two real script processes (the default tier keeps the in-process steering checks)
def test_a_stale_verify_steering_never_redirects_a_real_training(tmp_path):
    """``RIPRESA_VERIFY`` left in a user's shell (copied from a verify's log, or exported by a verify
    that has ended) steered the next real training: ``python train.py --run runs/real`` trained in the
    old verify's folder, stopped at its ``stop_at`` and exited 0, the user's folder never created.
    Now the steering is bound to the ``ripresa verify`` that set it (pid and start time, an ancestor of
    the process): a stale or copied value is refused in one paragraph, exit 2, nothing touched."""
    from ripresa.session.steer import ENV, Steering

    verify_out = tmp_path / "old-verify"
    helper = subprocess.run(  # a 'verify' process that writes the value and ends
        [PY, "-c", "import json, sys; from pathlib import Path; from ripresa.session.steer import Steering, ENV; "
         f"print(Steering('continuous', Path({str(verify_out / 'run')!r}), Path({str(verify_out)!r}), 2).to_env()[ENV])"],
        capture_output=True, text=True, timeout=60)
    assert helper.returncode == 0, helper.stderr
    stale = helper.stdout.strip()
    real = tmp_path / "real"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", RIPRESA_PROGRESS="0", **{ENV: stale})
    res = subprocess.run([PY, str(LOOP), "--run", str(real), "--steps", "3", "--every", "1"], capture_output=True,
                         text=True, timeout=120, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out and f"unset {ENV}" in out, out
    assert not verify_out.exists(), out  # the old verify's folder is never written
    assert not real.exists(), out  # and the user's folder untouched (refused before anything)

    # the same value in a process the live 'verify' (here: this test's process) started is honoured
    fresh = Steering("continuous", verify_out / "run", verify_out, 2).to_env()[ENV]
    res = subprocess.run([PY, str(LOOP), "--run", str(real), "--steps", "3", "--every", "1"], capture_output=True,
                         text=True, timeout=120, env={**env, ENV: fresh})
    assert res.returncode == 0, res.stdout + res.stderr
    assert (verify_out / "run").is_dir() and not real.exists()
