"""`ripresa plot` / `ripresa compare` on real run folders written by real `ripresa train` processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from rich.console import Console

from ripresa.engine import plots
from ripresa.errors import BadInput
from ripresa.store.history import HISTORY_NAME, History, read_history

FAST = ["--config", "tiny", "--quiet", "--threads", "1", "--no-audit", "--set", "train.batch_size=4"]
HI = ["--set", "train.lr=0.01"]
LO = ["--set", "train.lr=0.0001"]


def train(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.Popen([sys.executable, "-m", "ripresa", "train", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(*procs: subprocess.Popen) -> None:
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, out + err


def wait_for(pred, proc: subprocess.Popen, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"train exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError("timeout")


def last_step(run: Path) -> int:
    h = run / HISTORY_NAME
    return max(read_history(h).steps, default=0) if h.exists() else 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """hi: lr 0.01, 20 steps then resumed for 20 more; lo: lr 1e-4, 40 steps; sig: SIGUSR1 then SIGTERM."""
    base = tmp_path_factory.mktemp("plots")
    hi, lo, sig = base / "hi", base / "lo", base / "sig"
    # Two processes at a time (each on one thread).
    finish(train("--run", hi, *FAST, *HI, "--steps", 20, "--every", 10),
           train("--run", lo, *FAST, *LO, "--steps", 40, "--every", 10))
    resumed = train("--run", hi, *FAST, *HI, "--steps", 40, "--every", 10)  # --steps: the run's end step
    p = train("--run", sig, *FAST, "--steps", 2000, "--every", 0)
    try:
        wait_for(lambda: last_step(sig) >= 8, p)
        p.send_signal(signal.SIGUSR1)
        wait_for(lambda: any(e["event"] == "signal" for e in read_history(sig / HISTORY_NAME).events), p)
        done = last_step(sig)
        wait_for(lambda: last_step(sig) >= done + 3, p)  # it went on training
        p.send_signal(signal.SIGTERM)
        finish(p, resumed)
    finally:
        for proc in (p, resumed):
            if proc.poll() is None:
                proc.kill()
    return {"hi": hi, "lo": lo, "sig": sig}


def check_png(path: Path, min_width: int = 800) -> np.ndarray:
    """A real, non-trivial PNG: magic bytes, decodable, wide enough, many colours, a drawn plot area."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    h, w = img.shape[:2]
    assert w >= min_width and h >= 400, img.shape
    rgb = (img[..., :3] * 255).round().astype(np.uint8)
    colours = np.unique(rgb.reshape(-1, 3), axis=0)
    assert len(colours) > 10, len(colours)
    plot_area = rgb[int(h * 0.15): int(h * 0.85), int(w * 0.1): int(w * 0.8)]
    not_white = (plot_area < 245).any(axis=-1).mean()
    assert not_white > 0.02, not_white  # curves, marks and areas were drawn, not an empty frame
    return img


def independent_ema(losses: list[float], alpha: float) -> float:
    """The bias-corrected EMA at the last value, as a weighted mean (weights alpha**age)."""
    n = len(losses)
    weights = [alpha ** (n - 1 - i) for i in range(n)]
    return sum(w * x for w, x in zip(weights, losses, strict=True)) / sum(weights)


# ---- EMA ------------------------------------------------------------------------------------------


def test_ema_series_math():
    assert plots.ema_series([], 0.9) == []
    assert plots.ema_series([3.0, 1.0, 2.0], 0.0) == [3.0, 1.0, 2.0]  # alpha 0: the raw series
    assert plots.ema_series([2.5] * 50, 0.98) == pytest.approx([2.5] * 50)  # bias-corrected: no drift from 0
    got = plots.ema_series([1.0, 2.0, 3.0], 0.5)
    assert got == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    rng = np.random.default_rng(0)
    xs = list(rng.normal(3.0, 0.5, size=200))
    series = plots.ema_series(xs, 0.98)
    for t in (0, 1, 17, 199):
        assert series[t] == pytest.approx(independent_ema(xs[: t + 1], 0.98), rel=1e-12)
    # A non-finite step leaves the EMA where it was; none yet → NaN.
    got = plots.ema_series([math.nan, 4.0, math.inf, 2.0], 0.5)
    assert math.isnan(got[0]) and got[1] == 4.0 and got[2] == 4.0 and got[3] == pytest.approx(independent_ema([4.0, 2.0], 0.5))
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(BadInput):
            plots.ema_series([1.0], bad)


# ---- ripresa plot ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_plot_of_a_resumed_run(runs):
    out = plots.plot_run(runs["hi"])
    assert out == runs["hi"] / "plot.png" and out.is_file()
    check_png(out)
    info = plots.last_plot_info
    assert info["path"] == str(out) and info["steps"] == 40 and (info["first_step"], info["last_step"]) == (1, 40)
    assert info["events"]["resume"] == 1 and info["events"]["checkpoint"] == 4  # 10, 20, 30, 40
    assert "resume ← 20" in info["labels"]
    assert set(info["arms"]) == {"stdlib-code", "stdlib-docstrings", "pydoc-topics"}
    view = read_history(runs["hi"] / HISTORY_NAME)
    assert info["last_loss"] == view.steps[40]["loss"]
    assert info["last_ema"] == pytest.approx(independent_ema([view.steps[s]["loss"] for s in range(1, 41)], plots.EMA_ALPHA))


@pytest.mark.slow
def test_plot_of_a_signalled_run(runs, tmp_path):
    png = tmp_path / "sig.png"
    assert plots.plot_run(runs["sig"], png) == png
    check_png(png)
    info = plots.last_plot_info
    events = read_history(runs["sig"] / HISTORY_NAME).events
    signals = [e for e in events if e["event"] == "signal"]
    assert [e["signals"] for e in signals] == [["SIGUSR1"], ["SIGTERM"]]
    assert info["events"]["signal"] == 2 and info["events"]["checkpoint"] == 2  # one per signal (--every 0)
    assert f"SIGUSR1 @{signals[0]['step']} → checkpoint" in info["labels"]
    assert f"SIGTERM @{signals[1]['step']} → stop" in info["labels"]
    assert info["last_step"] == signals[1]["step"]


@pytest.mark.slow
def test_plot_marks_every_event_kind_and_survives_a_torn_line(runs, tmp_path):
    """A copy of a real history, with the events of a crash, a pivot, a fork and a zombie arm appended."""
    run = tmp_path / "copy"
    run.mkdir()
    shutil.copy(runs["lo"] / HISTORY_NAME, run / HISTORY_NAME)
    shutil.copy(runs["lo"] / "config.json", run / "config.json")
    h = History(run / HISTORY_NAME)
    for s in range(41, 46):  # logged by a process that then died (last checkpoint: 40)
        h.step(s, loss=3.0, lr=1e-4, arm="stdlib-code", tokens=256)
    h.event("resume", from_step=40, file="step_000040.bin")
    h.event("zombie_arm", arm="repo-docstrings", pulls=12, ema_reward=1.546)
    h.event("pivot", step=40, reason="new caps and floors")
    h.event("bandit_fresh", reason="pivot", saved_phase=0, phase=1)
    for s in range(41, 61):
        h.step(s, loss=2.9 + 0.001 * s, lr=1e-4, arm="stdlib-docstrings", tokens=256)
    h.event("signal", step=48, signals=["SIGUSR1"], action="checkpoint")
    h.event("checkpoint_failed", step=50, error="disk full")
    h.event("fork", parent="elsewhere", parent_step=55)
    h.close()
    with open(run / HISTORY_NAME, "ab") as f:
        f.write(b'{"step": 61, "loss": 2.')  # torn by a kill mid-write
    png = plots.plot_run(run, tmp_path / "all.png")
    check_png(png)
    info = plots.last_plot_info
    assert info["steps"] == 60 and info["skipped_lines"] == 1
    assert {k: info["events"][k] for k in plots.MARKED_EVENTS} == dict.fromkeys(plots.MARKED_EVENTS, 1)
    assert info["redone"] == 5 and "resume ← 40, 5 steps redone" in info["labels"]
    assert "zombie arm repo-docstrings" in info["labels"] and "fork of 55" in info["labels"]
    # Events without a step sit where their process started: right before its first step.
    at = {e.kind: e.step for e in plots.load_run(run).events}
    assert at["zombie_arm"] == 40 and at["bandit_fresh"] == 40 and at["pivot"] == 40 and at["fork"] == 55
    # The canonical line of a redone step is the last one written.
    assert plots.load_run(run).losses[40] == pytest.approx(2.9 + 0.041)


def test_plot_of_a_history_without_arms(tmp_path):
    run = tmp_path / "bare"
    h = History(run / HISTORY_NAME)
    for s in range(1, 31):
        h.step(s, loss=4.0 / s**0.3)
    h.close()
    check_png(plots.plot_run(run))
    assert plots.last_plot_info["arms"] == [] and plots.last_plot_info["events"]["checkpoint"] == 0


# ---- ripresa compare ------------------------------------------------------------------------------


@pytest.mark.slow
def test_compare_names_the_run_that_converges_lower(runs, tmp_path):
    png = tmp_path / "cmp.png"
    res = plots.compare_runs([runs["lo"], runs["hi"]], png)
    json.dumps(res, allow_nan=False)  # JSON-able, strictly
    # The expected answer, straight from the histories.
    expect = {}
    for name in ("lo", "hi"):
        v = read_history(runs[name] / HISTORY_NAME)
        losses = [v.steps[s]["loss"] for s in range(1, 41)]
        expect[name] = {"ema": independent_ema(losses, 0.98), "final": losses[-1], "best": min(losses)}
    lower = min(expect, key=lambda n: expect[n]["ema"])
    assert res["winner"] == lower and res["tie"] is False
    assert res["from_step"] == 1 and res["last_common_step"] == 40 and res["common_steps"] == 40
    assert res["png"] == str(png)
    rows = {r["run"]: r for r in res["runs"]}
    for name in ("lo", "hi"):
        assert rows[name]["ema_loss"] == pytest.approx(expect[name]["ema"], rel=1e-12)
        assert rows[name]["final_loss"] == expect[name]["final"] and rows[name]["best_loss"] == expect[name]["best"]
        assert rows[name]["steps"] == 40 and rows[name]["winner"] == (name == lower)
    assert res["margin"] == pytest.approx(abs(expect["lo"]["ema"] - expect["hi"]["ema"]))
    check_png(png)
    console = Console(record=True, width=160)
    plots.render_comparison(res, console)
    text = console.export_text()
    assert "EMA loss" in text and "hi" in text and "lo" in text
    # A winner is named only when the gap is above the noise (docs/ENGINE.md, "Pictures, comparisons, ...").
    assert (f"{lower} converges lower" in text) == (res["within_noise"] is False), (res["gap_over_noise"], text)
    assert ("within noise" in text) == (res["within_noise"] is True)
    # Without --png nothing is drawn; another alpha changes the EMAs, not the raw numbers.
    res2 = plots.compare_runs([runs["lo"], runs["hi"]], ema=0.5)
    assert res2["png"] is None and res2["ema_alpha"] == 0.5
    assert {r["run"]: r["final_loss"] for r in res2["runs"]} == {n: expect[n]["final"] for n in expect}


@pytest.mark.slow
def test_compare_from_the_fork_point(runs, tmp_path):
    """A fork recorded at step 20 of hi: the comparison starts there, whatever came before."""
    fork = tmp_path / "fork"
    h = History(fork / HISTORY_NAME)
    h.event("fork", parent=str(runs["hi"]), parent_step=20)
    view = read_history(runs["hi"] / HISTORY_NAME)
    for s in range(21, 36):
        h.step(s, loss=view.steps[s]["loss"] - 0.25, arm=view.steps[s]["arm"])
    h.close()
    res = plots.compare_runs([runs["hi"], fork], tmp_path / "fork.png")
    assert res["from_step"] == 20 and res["forked"] and res["last_common_step"] == 35 and res["common_steps"] == 15
    rows = {r["run"]: r for r in res["runs"]}
    assert res["winner"] == "fork" and rows["fork"]["fork_step"] == 20 and rows["hi"]["fork_step"] is None
    hi_losses = [view.steps[s]["loss"] for s in range(20, 36)]  # hi's EMA starts at the fork point
    assert rows["hi"]["ema_loss"] == pytest.approx(independent_ema(hi_losses, 0.98))
    assert rows["hi"]["last_step"] == 40 and rows["hi"]["last_loss"] == view.steps[40]["loss"]
    check_png(tmp_path / "fork.png")
    # A run compared with an identical copy: a tie, no winner.
    twin = tmp_path / "twin"
    twin.mkdir()
    shutil.copy(runs["hi"] / HISTORY_NAME, twin / HISTORY_NAME)
    tie = plots.compare_runs([runs["hi"], twin])
    assert tie["tie"] is True and tie["winner"] is None and tie["margin"] == 0.0
    console = Console(record=True, width=160)
    plots.render_comparison(tie, console)
    assert "a tie" in console.export_text()


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_input(runs, tmp_path):
    with pytest.raises(BadInput, match="not found"):
        plots.plot_run(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInput, match="no history") as info:
        plots.plot_run(empty)
    assert info.value.exit_code == 2 and info.value.hint
    only_events = tmp_path / "events"
    History(only_events / HISTORY_NAME).event("start", step=0)
    with pytest.raises(BadInput, match="no step lines"):
        plots.plot_run(only_events)
    with pytest.raises(BadInput, match="at least two"):
        plots.compare_runs([runs["hi"]])
    with pytest.raises(BadInput, match="no history"):
        plots.compare_runs([runs["hi"], empty])
    early, late = tmp_path / "early", tmp_path / "late"
    for folder, steps in ((early, range(1, 11)), (late, range(11, 21))):
        h = History(folder / HISTORY_NAME)
        for s in steps:
            h.step(s, loss=1.0)
        h.close()
    with pytest.raises(BadInput, match="no steps in common") as info:
        plots.compare_runs([early, late])
    assert "1–10" in str(info.value) and "11–20" in str(info.value)
    with pytest.raises(BadInput, match="alpha"):
        plots.compare_runs([runs["hi"], runs["lo"]], ema=1.0)
    with pytest.raises(BadInput, match="folder does not exist"):
        plots.plot_run(runs["hi"], tmp_path / "no" / "such" / "dir.png")
