"""The CLI's one renderer (docs/FAULTS.md, "Messages and exit codes"): warnings as one clean line each, exit
codes true to their meaning, tables that fit 80 and 200 columns without cutting a number, progress only on a TTY."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import pytest
from conftest import ripresa_cli

from ripresa.console import one_line, warning_line
from ripresa.store.store import CheckpointWarning

#: Python's own warning format: ``path.py:123: SomeWarning: text`` (and the source line under it).
PY_WARNING = re.compile(r"\.py:\d+: \w*Warning:")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _assert_clean(stderr: str) -> None:
    assert not PY_WARNING.search(stderr), stderr
    assert "Traceback" not in stderr and "warnings.warn" not in stderr and "return self." not in stderr, stderr


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """Two generations (steps 1 and 2) of the tiny GPT, as small as a real run gets."""
    run = tmp_path_factory.mktemp("console") / "run"
    res = ripresa_cli("train", "--run", run, "--steps", "2", "--every", "1", "--no-audit", "--quiet", "--threads", "1",
                      "--sync", "--set", "train.batch_size=2", "--set", "train.max_steps=2", timeout=240)
    assert res.returncode == 0, res.stderr
    return run


def test_flipped_bytes_print_one_clean_line_per_generation(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for step in (1, 2):
        _flip(run / f"step_{step:06d}.bin")
    res = ripresa_cli("train", "--run", run, "--steps", "3", "--no-audit", "--quiet", "--threads", "1",
                      env={"COLUMNS": "80"}, timeout=240)
    assert res.returncode == 1, res.stderr  # no generation verifies: a check failed
    _assert_clean(res.stderr)
    lines = [line for line in res.stderr.splitlines() if ": warning" in line]
    assert len(lines) == 2, res.stderr  # one line per damaged generation, newest first
    for line, step in zip(lines, (2, 1), strict=True):
        assert line.startswith(f"ripresa train: warning: generation {step} not used: sha256 mismatch"), line
        assert f"({run / f'step_{step:06d}.bin'})" in line and line.endswith("an older one is tried"), line
    assert "skipping" not in res.stderr
    assert "ripresa train: error: sha256 mismatch" in res.stderr


def test_a_changed_config_on_resume_is_bad_input_naming_the_key(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    res = ripresa_cli("train", "--run", run, "--steps", "3", "--no-audit", "--quiet", "--threads", "1",
                      "--set", "train.batch_size=4", timeout=240)
    assert res.returncode == 2, res.stderr  # bad input, not a failed check
    _assert_clean(res.stderr)
    assert ": warning" not in res.stderr and "not used" not in res.stderr, res.stderr  # healthy generations untouched
    first = res.stderr.splitlines()[0]
    assert first.startswith("ripresa train: error: the experiment config differs") and "train.batch_size (2 -> 4)" in first
    assert "--allow-config-change" in res.stderr and "ripresa fork" in res.stderr


def test_warning_line_is_one_terminal_safe_line():
    text = "checkpoint at step 5 failed (training goes on):\nsave failed\n  file:     /r/x\x1b[2J\n  hint:     free space"
    line = warning_line(text, UserWarning, __file__, "train")
    assert "\n" not in line and "\x1b" not in line
    assert line == ("ripresa train: warning (UserWarning, test_console.py): checkpoint at step 5 failed (training "
                    "goes on): save failed; file: /r/x\\x1b[2J; hint: free space")
    import ripresa.store.store as store

    own = warning_line("generation 3 not used: x", CheckpointWarning, store.__file__, "verify")
    assert own == "ripresa verify: warning: generation 3 not used: x"
    assert one_line("a\n\n  b  c\n") == "a; b c"


def test_the_library_keeps_python_warnings():
    """The renderer is the CLI's: importing ripresa changes nothing about how warnings are shown."""
    import ripresa.cli  # noqa: F401 - importing the CLI installs nothing

    shown = warnings.showwarning
    assert shown.__module__ == "warnings"
