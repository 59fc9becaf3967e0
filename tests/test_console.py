"""The CLI's one renderer (docs/FAULTS.md, "Messages: one line each, the same shape everywhere"): warnings as one clean line each, exit
codes true to their meaning, tables that fit 80 and 200 columns without cutting a number, progress only on a TTY."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import pytest
from conftest import ripresa_cli

from ripresa.console import fit_table, one_line, warning_line
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


@pytest.mark.slow  # two trainer starts; the refusal itself: test_consistency (slow tier too)
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


# ---- 80 columns and wider -----------------------------------------------------------------------

NUMBER = r"(?<![\w.+-]){}(?![\w.])"


def _rendered(renderable, width: int) -> str:
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(renderable)
    return console.file.getvalue()


def _fits(text: str, width: int) -> None:
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, "\n".join(too_long)
    assert "…" not in text, text  # nothing cut with an ellipsis


@pytest.mark.parametrize("width", [80, 200])
def test_inspect_statistics_keep_every_number_whole(tiny_run, width):
    """`ripresa inspect` (COLUMNS=80 through the command; 200 in process): each statistic appears whole on one line,
    no line wider than the terminal."""
    import io

    from ripresa.text import safe_console
    from ripresa.tools.inspect import inspect_path, render_report
    from ripresa.tools.report import fmt as _fmt

    report = inspect_path(tiny_run / "step_000002.bin")
    if width == 80:
        res = ripresa_cli("inspect", tiny_run / "step_000002.bin", env={"COLUMNS": str(width)})
        assert res.returncode == 0, res.stderr
        text = res.stdout
    else:
        console = safe_console(width=width, file=io.StringIO(), color_system=None)
        render_report(report, console)
        text = console.file.getvalue()
    _fits(text, width)
    regions = report["bin"]["regions"]
    assert set(regions) == {"weights", "m", "v"}
    for s in regions.values():
        for key in ("count", "min", "max", "mean", "std"):
            value = _fmt(s[key])
            assert re.search(NUMBER.format(re.escape(value)), text), (key, value, text)
    across = re.search(r"│ weights +│ +\d+ +│", text) is not None
    assert across == (width == 200)  # across at 200 columns, down (one value a line) at 80


def test_fit_table_goes_down_rather_than_cut():
    rows = [["weights", "136960", "-0.114368", "1.04623", "0.00236321", "0.054407", "0"],
            ["v", "136960", "0", "0.000627677", "1.44334e-07", "4.81157e-06", "0"]]
    header = ("", "count", "min", "max", "mean", "std", "non-finite")
    for width in (40, 80, 200):
        text = _rendered(fit_table("stats", header, rows, width), width)
        _fits(text, width)
        for row in rows:
            for cell in row:
                assert re.search(NUMBER.format(re.escape(cell)), text), (width, cell, text)


@pytest.mark.parametrize("width", [80, 200])
def test_the_training_progress_line_keeps_its_numbers(width):
    """The `--deadline` progress line: six-digit steps, the stop and the rate whole on one line."""
    from rich.progress import Progress

    from ripresa.engine.gpt.train import progress_columns

    bar = Progress(*progress_columns(width, deadline=True), auto_refresh=False)
    bar.add_task("train", total=200000, completed=123456, loss="3.2145", rate="12.3", next="1234s", stop="259200s")
    text = _rendered(bar.get_renderable(), width)
    _fits(text, width)
    assert len(text.strip().splitlines()) == 1, text
    for number in ("123456/200000", "3.2145", "12.3", "1234s", "259200s"):
        assert number in text, (number, text)
    assert ("planned stop in 259200s" in text) == (width >= 120)


def test_the_demo_event_detail_is_never_cut_mid_value():
    from ripresa.engine.demo import _fields

    reason = "generation 20 not used: " + "x" * 300
    text = _fields({"reason": reason, "step": 20, "file": "step_000020.bin"})
    assert text.startswith(f"reason={reason!r}".replace("'", '"')) and text.endswith("(+2 more)")
    assert _fields({"a": [1, 2], "b": "c d"}) == 'a=[1, 2] b="c d"'


def test_verify_counts_each_path_once():
    from ripresa.verify.verify import PATHS, PathCount

    count = PathCount()
    seen = [count.done(name, 0) for name in ("continuous", "continuous", "interrupted", "resume", "resume",
                                             "resume-without-rng", "resume-without-rng")]
    assert [n for n, _ in seen] == [1, 1, 2, 3, 3, 4, 4] and seen[-1][0] == len(PATHS)
    assert seen[0][1].endswith("the other reference path") and seen[2][1].endswith("resume ∥ resume-without-rng")
    assert seen[-1][1].endswith("comparing")


# ---- progress on a terminal only ------------------------------------------------------------------


def _on_a_pty(argv: list[str], env: dict) -> tuple[int, str, str]:
    """Run ``argv`` with stderr on a pseudo-terminal: (exit code, stdout, what the terminal received)."""
    import os
    import pty
    import subprocess
    import sys

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ripresa", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave, env={**os.environ, **env})
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        try:
            piece = os.read(master, 65536)
        except OSError:  # the child closed its end
            break
        if not piece:
            break
        chunks.append(piece)
    out = proc.communicate(timeout=120)[0]
    os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_mirror_push_and_pull_show_progress_on_a_terminal_only(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    code, out, tty = _on_a_pty(["mirror", "push", str(run), "--mirror", str(tmp_path / "m1")], {"COLUMNS": "80"})
    assert code == 0 and out.startswith("pushed [1, 2]"), (out, tty)
    plain = " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", " ", tty).split())
    assert re.search(r"\d+(\.\d+)?/\? (MB|kB) \d+:\d\d:\d\d mirror push: step_00000[12]\.(bin|json)", plain), plain
    assert "Warning" not in plain
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    res = ripresa_cli("mirror", "pull", fresh, "--mirror", tmp_path / "m1")  # stderr a pipe: no progress at all
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith("pulled step_000002.bin"), res


def test_install_routes_warnings_and_log_records_then_undoes():
    """What the CLI's entry installs: a warning and a library's log record each print as one line; undone after."""
    import contextlib
    import io
    import logging

    from ripresa.console import install

    err = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        before = warnings.showwarning
        had = list(logging.getLogger().handlers)
        logging.getLogger().handlers.clear()  # as in a fresh `ripresa` process: nothing configured logging
        try:
            undo = install("export")
            warnings.warn("generation 7 not used: damaged\n  file:     /r/step_000007.bin", CheckpointWarning,
                          stacklevel=1)
            logging.getLogger("urllib3.connectionpool").warning("Retrying (%d) after %s", 2, "a reset\nconnection")
            undo()
            assert warnings.showwarning is before and not logging.getLogger().handlers
        finally:
            logging.getLogger().handlers[:] = had
    lines = err.getvalue().splitlines()
    assert lines == ["ripresa export: warning: generation 7 not used: damaged; file: /r/step_000007.bin",
                     "ripresa export: warning (urllib3.connectionpool): Retrying (2) after a reset; connection"], lines
