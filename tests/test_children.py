"""Every child process ripresa starts runs ripresa's own code (issue 19, class 1; docs/FAULTS.md, "Child processes").

A hostile folder holds a ``ripresa/`` package that writes a marker file when
imported; the caller's ``PYTHONPATH`` has an empty entry (which Python turns
into the working folder). Each test runs real processes *from that folder*
and checks that the marker is never written — and that plain ``python -m
ripresa`` from the same folder does write it (the attack is real).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run

from ripresa.io.child import child_env, ripresa_argv
from ripresa.io.lock import read_lock_holder


def plant(folder: Path) -> Path:
    """A folder whose ``ripresa/`` writes ``MARKER`` (beside the folder) and exits 97 when imported."""
    marker = folder.parent / "MARKER"
    pkg = folder / "ripresa"
    pkg.mkdir(parents=True)
    code = f"open({str(marker)!r}, 'a').write('planted code ran\\n'); raise SystemExit(97)\n"
    for name in ("__init__.py", "__main__.py", "torchrun.py"):
        (pkg / name).write_text(code)
    return marker


def wait_until_finished(runf: Path, timeout: float = 180) -> None:
    """Until the restarted trainer (detached) has resumed and ended (its lock is free)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        log = (runf / "train.log").read_text() if (runf / "train.log").exists() else ""
        if "resumed" in log and read_lock_holder(runf) is None:
            return
        time.sleep(0.2)
    raise AssertionError(f"the restarted trainer did not finish: {log[-2000:]}")


def hostile_env() -> dict[str, str]:
    """The caller's environment with an empty PYTHONPATH entry first (``export PYTHONPATH=$PYTHONPATH:/x`` style)."""
    return dict(os.environ, PYTHONPATH=os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture
def hostile(tmp_path) -> tuple[Path, Path]:
    folder = tmp_path / "hostile"
    return folder, plant(folder)


def test_plain_python_m_runs_the_planted_package(hostile):
    """The attack: what ``pivot --restart`` and ``demo`` used to start runs the planted code."""
    folder, marker = hostile
    res = subprocess.run([sys.executable, "-m", "ripresa", "--version"], cwd=folder, capture_output=True, text=True,
                         env=dict(os.environ), timeout=60)
    assert res.returncode == 97 and marker.read_text() == "planted code ran\n"


def test_a_ripresa_child_runs_ripresas_code(hostile):
    """``ripresa_argv`` + ``child_env``: neither the working folder nor an empty PYTHONPATH entry is imported from."""
    folder, marker = hostile
    res = subprocess.run(ripresa_argv("--version"), cwd=folder, capture_output=True, text=True,
                         env=child_env(hostile_env()), timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("ripresa "), res.stdout + res.stderr
    assert not marker.exists()
    # and a grandchild started with `python -m` by that child (as torchrun starts its ranks) too
    grand = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-u', '-m', 'ripresa', '--version']))"
    res = subprocess.run([sys.executable, "-P", "-c", grand], cwd=folder, capture_output=True, text=True,
                         env=child_env(hostile_env()), timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("ripresa "), res.stdout + res.stderr
    assert not marker.exists()


def test_child_env_keeps_absolute_entries_and_drops_the_working_folder(tmp_path):
    env = child_env({"PYTHONPATH": os.pathsep.join(["", ".", "rel/dir", "/abs/one", "/abs/two"])})
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert "/abs/one" in entries and "/abs/two" in entries and entries.index("/abs/one") < entries.index("/abs/two")
    assert all(os.path.isabs(e) for e in entries) and env["PYTHONSAFEPATH"] == "1"


@pytest.mark.slow
def test_torchrun_ranks_run_ripresas_code(hostile, tmp_path):
    """``ripresa.torchrun ... -m ripresa``: torchrun starts each rank as ``python -u -m ripresa``.

    The launcher itself started safely (``-P``, as ``pivot --restart`` does,
    or the way a user's console script runs) but with no PYTHONSAFEPATH of its
    own and an empty PYTHONPATH entry: it gives ripresa's ranks a safe
    environment, so none imports the planted package.
    """
    folder, marker = hostile
    env = {k: v for k, v in hostile_env().items() if k != "PYTHONSAFEPATH"}
    launcher = (f"import sys; sys.path = [p for p in sys.path if p not in ('', {str(folder)!r})]; "
                "from ripresa.torchrun import main; sys.exit(main())")
    argv = [sys.executable, "-P", "-c", launcher, "--standalone", "--nproc_per_node=2", "-m", "ripresa", "--version"]
    res = run(argv, cwd=folder, env=env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("ripresa ") == 2 and not marker.exists(), res.stdout


@pytest.mark.slow
def test_pivot_restart_and_demo_from_a_hostile_folder(hostile, tmp_path):
    """The two commands of the issue, run from the planted folder: the marker is never written."""
    folder, marker = hostile
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # the caller's own process is clean
    runf = tmp_path / "run"
    cli = [sys.executable, "-P", "-m", "ripresa"]  # the caller itself: as the `ripresa` console script runs
    res = run([*cli, "train", "--run", runf, "--config", "tiny", "--quiet", "--threads", "1", "--steps", "10",
               "--every", "10", "--no-audit", "--set", "train.batch_size=4"], cwd=folder, env=env)
    assert res.returncode == 0, res.stderr
    res = run([*cli, "pivot", runf, "--caps", "stdlib-docstrings=0.5", "--restart"], cwd=folder, env=env)
    assert res.returncode == 0, res.stderr
    wait_until_finished(runf)
    assert "resumed" in (runf / "train.log").read_text()
    assert not marker.exists()
    res = run([*cli, "demo", "--output", tmp_path / "demo"], cwd=folder, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "started again on the same folder: resumed" in res.stdout
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("plant_log", [
    pytest.param(lambda log, outside: os.symlink(outside, log), id="symlink"),
    pytest.param(lambda log, outside: os.mkfifo(log), id="fifo", marks=pytest.mark.slow),
])
def test_demo_refuses_a_planted_log(tmp_path, plant_log):
    """``demo --output DIR`` opens DIR/train.log without following a link or waiting on a FIFO: exit 2 first."""
    out, outside = tmp_path / "demo", tmp_path / "outside.txt"
    out.mkdir()
    outside.write_text("keep")
    plant_log(out / "train.log", outside)
    res = run([sys.executable, "-m", "ripresa", "demo", "--output", out], timeout=120)
    assert res.returncode == 2 and "train.log" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert outside.read_text() == "keep" and not (out / "verify").exists()  # refused before anything ran
