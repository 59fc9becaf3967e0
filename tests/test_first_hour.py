"""The first hour of a newcomer (issue 23): guard-rails where intent is clear, and the small things that hurt.

A learning rate below the schedule's floor is said (train and fork), ``compare`` says how sure it is before it
names a winner, typos get the nearest valid names, a changed data source is named, ``generate --help`` explains
its options, ``inspect`` lists what it reads, a pivot naming no source is bad input, the engine counts samples.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import REPO, ripresa_cli
from rich.console import Console

import ripresa
from ripresa import cli
from ripresa.engine import plots
from ripresa.engine.gpt.config import apply_sets, named_config, resolve_config, validate
from ripresa.errors import BadInput, IdentityMismatch
from ripresa.store.history import HISTORY_NAME, History, read_history

# ---- typos: the nearest valid names -----------------------------------------------------------------


def test_unknown_config_lists_the_presets_and_the_nearest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as e:
        resolve_config("andrea-12", [], None)
    assert "andrea-12m" in str(e.value.hint) and "tiny" in str(e.value.expected) and "andrea-120m" in str(e.value.expected)
    assert "not found" not in e.value.message  # not "config file not found": it names the presets
    with pytest.raises(BadInput) as e:
        resolve_config("qwerty", [], None)
    assert "andrea-12m, tiny" in str(e.value.expected)
    (tmp_path / "mine.toml").write_text('base = "tiny"\n[train]\nlr = 1e-3\n')  # a file still works
    assert resolve_config("mine.toml", [], None)["train"]["lr"] == 1e-3


@pytest.mark.parametrize(("key", "near"), [
    ("train.lrr", "'train.lr'"), ("lr", "'train.lr'"), ("min_lr", "'train.min_lr'"), ("trian.lr", "'train'"),
    ("model.n_layers", "'model.n_layer'"), ("train.batchsize", "'train.batch_size'"),
])
def test_set_typos_get_the_nearest_key(key, near):
    with pytest.raises(BadInput, match="unknown") as e:
        apply_sets(named_config("tiny"), [f"{key}=1"])
    assert e.value.hint is not None and near in e.value.hint, e.value.hint


def test_a_mistyped_command_names_the_nearest(capsys):
    assert cli.main(["inpsect", "somewhere"]) == 2
    err = capsys.readouterr().err
    assert "unknown command" in err and "did you mean 'inspect'?" in err and "Traceback" not in err


# ---- small things -----------------------------------------------------------------------------------


def test_a_changed_data_source_is_named_alone():
    def state(sources):
        return ripresa.TrainingState(model=torch.nn.Linear(2, 1), data_sources=sources)

    saved = state({"web": b"a", "code": b"b", "docs": b"c", "mine": b"d"}).snapshot(ripresa.Progress())
    with pytest.raises(IdentityMismatch) as e:
        state({"web": b"a", "code": b"CHANGED", "docs": b"c", "mine": b"d"}).restore(saved)
    assert set(e.value.expected) == {"data source 'code'"} == set(e.value.found)
    assert "--allow-data-change" in e.value.hint


def test_generate_help_describes_its_options(capsys):
    from ripresa.engine.ledger import main as ledger_main

    with pytest.raises(SystemExit) as e:
        ledger_main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--inputs FILE the prompts, one per line" in text
    assert "--out OUT.jsonl the ledger" in text and "--step N the generation" in text


def test_inspect_names_every_kind_it_reads(tmp_path):
    from ripresa.tools.inspect import inspect_path

    with pytest.raises(BadInput) as e:
        inspect_path(tmp_path / "missing")
    assert all(k in str(e.value.expected) for k in (".bin", ".safetensors", "checkpoint.pt", ".dcp", "run folder"))


def test_a_policy_for_an_arm_that_is_no_source_is_bad_input(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(named_config("tiny")))
    assert cli.main(["pivot", str(run), "--caps", "web=0.3"]) == 2
    assert "'web', which is not a data source" in capsys.readouterr().err
    cfg = apply_sets(named_config("tiny"), ['mixture.caps={"web": 0.3}'])  # what a fork's --set would write
    with pytest.raises(BadInput, match="not a data source"):
        validate(cfg)


def test_every_session_mode_resumes_every_kind():
    """docs/FORMAT.md, "Who resumes which generation": no built-in kind is ignored in any mode."""
    from ripresa.store.backend import MODES, registered

    kinds = registered()
    assert {"bin", "general", "dcp"} <= set(kinds)
    for spec in kinds.values():
        assert set(spec.modes) == set(MODES), spec.kind
    doc = (REPO / "docs" / "FORMAT.md").read_text()
    assert "are ignored (a warning and an `ignored_generations`" not in doc


# ---- a learning rate below its floor ------------------------------------------------------------------


def test_lr_floor_warning_names_both_values():
    from ripresa.engine.gpt.train import lr_at, lr_floor_warning

    t = dict(named_config("tiny")["train"], lr=1e-4)  # the tiny floor is 3e-4
    assert lr_at(100, t) < lr_at(1000, t)  # what the warning is about: the "decay" rises
    text = lr_floor_warning(t, 100)
    assert text is not None and "train.lr=0.0001" in text and "train.min_lr=0.0003" in text and "rises" in text
    assert lr_floor_warning(named_config("tiny")["train"]) is None
    assert lr_floor_warning(dict(t, lr=3e-4)) is None  # equal to the floor: a constant rate, meant


def test_train_and_fork_warn_once_and_count_samples(tmp_path):
    """A real run with a learning rate below its floor: one clean warning line, an event; samples counted."""
    run = tmp_path / "low"
    res = ripresa_cli("train", "--run", run, "--config", "tiny", "--steps", "2", "--every", "0", "--quiet",
                      "--threads", "1", "--set", "train.lr=1e-4", "--set", "audit.enabled=false")
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "min_lr" in ln]
    assert len(lines) == 1 and lines[0].startswith("ripresa train: warning: train.lr=0.0001"), res.stderr
    assert "Warning:" not in res.stderr and ".py:" not in res.stderr  # not Python's warnings format
    events = [e for e in read_history(run / HISTORY_NAME).events if e["event"] == "lr_below_floor"]
    assert [(e["lr"], e["min_lr"]) for e in events] == [(1e-4, 3e-4)]
    companion = json.loads((run / "step_000002.json").read_text())
    progress = companion["state"]["progress"] if "state" in companion else companion["progress"]
    assert progress["samples_seen"] == 2 * 16  # two steps of batch_size 16 (it stayed 0)
    res = ripresa_cli("fork", run, "--step", "2", "--into", tmp_path / "fork", "--set", "train.lr=2e-4")
    assert res.returncode == 0, res.stderr
    assert "ripresa fork: warning: train.lr=0.0002 is below the schedule's floor train.min_lr=0.0003" in res.stderr


# ---- compare: how sure, before a winner ---------------------------------------------------------------


def _history(folder, losses):
    h = History(folder / HISTORY_NAME)
    for s, x in enumerate(losses, start=1):
        h.step(s, loss=float(x))
    h.close()
    return folder


def test_compare_says_within_noise_before_naming_a_winner(tmp_path):
    rng = np.random.default_rng(0)
    steps = 400
    trend = 3.0 - np.linspace(0, 0.5, steps)
    a = _history(tmp_path / "a", trend + rng.normal(0, 0.2, steps))
    b = _history(tmp_path / "b", trend + 0.004 + rng.normal(0, 0.2, steps))
    far = _history(tmp_path / "far", trend + 0.4 + rng.normal(0, 0.2, steps))

    close = plots.compare_runs([a, b])
    json.dumps(close, allow_nan=False)
    expect = 0.2 * math.sqrt(0.02 / 1.98)  # an EMA's spread over white noise of sd 0.2
    for row in close["runs"]:
        assert row["ema_noise"] == pytest.approx(expect, rel=0.3)
    assert close["noise_window"] == 50 and close["within_noise"] is True and close["gap_over_noise"] < 2
    console = Console(record=True, width=200)
    plots.render_comparison(close, console)
    text = console.export_text()
    assert "within noise" in text and "converges lower" not in text and "★" not in text

    clear = plots.compare_runs([a, far])
    assert clear["within_noise"] is False and clear["winner"] == "a" and clear["gap_over_noise"] > 2
    console = Console(record=True, width=200)
    plots.render_comparison(clear, console)
    text = " ".join(console.export_text().split())
    assert "a converges lower" in text and "the EMAs' noise ±" in text and "within noise" not in text


# ---- the demo's last line: a command that works in the shell that ran it ---------------------------------------


def test_demo_suggests_a_ripresa_command_this_shell_has(monkeypatch, tmp_path):
    import os
    import sys
    from pathlib import Path

    from ripresa.engine.demo import ripresa_command

    script = Path(sys.executable).parent / "ripresa"  # the console script of this installation (.venv/bin/ripresa)
    if not script.is_file():
        pytest.skip("ripresa is not installed as a console script beside this interpreter")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # not on the PATH: the script's path, which works from here
    cmd = ripresa_command()
    assert cmd != "ripresa" and os.path.samefile(cmd, script)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{script.parent}")  # activated: the plain name
    assert ripresa_command() == "ripresa"
    other = tmp_path / "ripresa"  # another ripresa first on the PATH is not this one: the path again
    other.write_text("#!/bin/sh\nexit 3\n")
    other.chmod(0o755)
    assert ripresa_command() != "ripresa"
