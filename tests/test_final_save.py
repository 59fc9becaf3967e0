"""A normal end saves the final state; an error path never does; the same command after the end does nothing twice.

In-process for the API (``Checkpointer.close``, ``save_on_close``, ``with``,
``abort``); real ``ripresa train`` processes for the CLI (``--steps`` is the
run's end step: run twice, SIGKILL and the same command). docs/FAULTS.md,
"The end of a run".
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from conftest import ripresa_cli, ripresa_train_proc, valid_steps, wait_for_step
from support.tiny import tiny_state

import ripresa
from ripresa.store.history import read_history
from ripresa.store.store import CheckpointWarning

FAST = ["--config", "tiny", "--quiet", "--set", "train.batch_size=4", "--threads", "1", "--no-audit"]


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, ripresa.TrainingState]:
    state = tiny_state((4, 2), lr=1e-2, config={"toy": 1})  # tests/support/tiny.py
    return state.model, state.optimizer, state


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


def _events(run, name):
    return [e for e in read_history(run / ".loss.jsonl").events if e["event"] == name]


def test_close_saves_the_last_completed_step_and_opts_out(tmp_path):
    model, opt, state = _state()
    ck = ripresa.Checkpointer(tmp_path / "a", state, every=100, handle_signals=False, asynchronous=False)
    start = ck.resume()
    for step in range(start + 1, 8):
        _step(model, opt)
        assert not ck.step_done(step)
    ck.close()  # the default: a final save of step 7 (no cadence point was reached)
    assert valid_steps(tmp_path / "a") == [7]
    assert [e["reason"] for e in _events(tmp_path / "a", "checkpoint")] == ["final"]
    # the saved state is the live one at step 7
    model2, opt2, state2 = _state()
    ck2 = ripresa.Checkpointer(tmp_path / "a", state2, every=100, handle_signals=False)
    assert ck2.resume() == 7
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    ck2.close()  # no step in this process: nothing new is saved
    assert valid_steps(tmp_path / "a") == [7]

    for run, kw, close_kw in ((tmp_path / "b", {"save_on_close": False}, {}), (tmp_path / "c", {}, {"final_save": False})):
        model, opt, state = _state()
        ck = ripresa.Checkpointer(run, state, every=100, handle_signals=False, **kw)
        ck.resume()
        for step in (1, 2, 3):
            _step(model, opt)
            ck.step_done(step)
        ck.close(**close_kw)
        assert valid_steps(run) == []


def test_no_final_save_after_an_exception_with_abort_or_in_a_finally(tmp_path):
    # A `with` block left by an exception: abort(), no save of a possibly half-updated state.
    model, opt, state = _state()
    with pytest.raises(RuntimeError, match="mid-step"):
        with ripresa.Checkpointer(tmp_path / "w", state, every=100, handle_signals=False) as ck:
            ck.resume()
            for step in (1, 2, 3):
                _step(model, opt)
                ck.step_done(step)
            with torch.no_grad():
                model.weight.add_(1.0)  # step 4 half done
            raise RuntimeError("mid-step")
    assert valid_steps(tmp_path / "w") == []

    # close() in a finally while the exception propagates: skipped, said so, recorded.
    model, opt, state = _state()
    ck = ripresa.Checkpointer(tmp_path / "f", state, every=100, handle_signals=False)
    ck.resume()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="in the loop"):
            try:
                for step in (1, 2):
                    _step(model, opt)
                    ck.step_done(step)
                raise ValueError("in the loop")
            finally:
                ck.close()
    assert valid_steps(tmp_path / "f") == []
    assert any(issubclass(w.category, CheckpointWarning) and "no final checkpoint" in str(w.message) for w in caught)
    skipped = _events(tmp_path / "f", "final_save_skipped")
    assert skipped and skipped[0]["step"] == 2

    # abort() never saves either.
    model, opt, state = _state()
    ck = ripresa.Checkpointer(tmp_path / "x", state, every=100, handle_signals=False)
    ck.resume()
    _step(model, opt)
    ck.step_done(1)
    ck.abort()
    assert valid_steps(tmp_path / "x") == []


@pytest.mark.slow
def test_train_twice_saves_the_end_and_does_no_work_twice(tmp_path):
    """The default tier's CLI sample: --every 0 --steps 3 leaves generation 3; the same command again trains 0 steps."""
    run = tmp_path / "run"
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "3", "--every", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    assert valid_steps(run) == [3]
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "3", "--every", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "already at step 3" in res.stdout
    view = read_history(run / ".loss.jsonl")
    assert sorted(view.steps) == [1, 2, 3] and valid_steps(run) == [3]
    assert len(_events(run, "checkpoint")) == 1  # nothing saved twice


@pytest.mark.slow
def test_train_between_cadence_points_then_longer(tmp_path):
    run = tmp_path / "run"
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "15", "--every", "10")
    assert res.returncode == 0, res.stderr[-3000:]
    assert valid_steps(run) == [10, 15] and "done at step 15" in res.stdout
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "15", "--every", "10")
    assert res.returncode == 0 and "already at step 15" in res.stdout
    assert max(read_history(run / ".loss.jsonl").steps) == 15
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "22", "--every", "10")  # a longer run: the end step
    assert res.returncode == 0, res.stderr[-3000:]
    assert valid_steps(run) == [15, 20, 22]  # keep last 3
    assert sorted(read_history(run / ".loss.jsonl").steps) == list(range(1, 23))


@pytest.mark.slow
def test_sigkill_then_the_same_command_ends_where_an_uninterrupted_run_ends(tmp_path):
    from ripresa.formats.andrea_bin import read_bin

    total = 24
    ref = tmp_path / "ref"
    args = [*FAST, "--steps", total, "--every", "5"]
    res = ripresa_cli("train", "--run", ref, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert valid_steps(ref)[-1] == total  # 24 is no multiple of 5: the end is saved
    run = tmp_path / "run"
    proc = ripresa_train_proc("--run", run, *args)
    try:
        wait_for_step(run, random.Random(7).randint(6, 14), proc)
    finally:
        proc.kill()
        proc.wait()
    res = ripresa_cli("train", "--run", run, *args)  # the same command
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed" in res.stdout and valid_steps(run)[-1] == total
    a, b = read_bin(ref / f"step_{total:06d}.bin"), read_bin(run / f"step_{total:06d}.bin")
    assert np.array_equal(a.weights, b.weights) and np.array_equal(a.m, b.m) and np.array_equal(a.v, b.v)
    res = ripresa_cli("train", "--run", run, *args)
    assert res.returncode == 0 and f"already at step {total}" in res.stdout
    assert max(read_history(run / ".loss.jsonl").steps) == total
