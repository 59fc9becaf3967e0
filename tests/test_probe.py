"""The live probe (``Checkpointer(probe_every=k)``; docs/VERIFY.md, "The live probe").

Each seeded resume fault of tests/fixtures/probe_loop.py is caught by a real side process (the
script started again, resuming the committed generation) and named; the exact loop raises no alarm.
The default tier runs the five single-process faults and the exact loop as sessions of this process
(their side processes run ``probe_loop.py``, all at once), and one 2-rank gloo group with the
rank-0 random-state fault, whose ranks start themselves again from their own command line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES

import ripresa
from ripresa.session import probe as probe_mod
from ripresa.session.probe import ProbeMismatchWarning, ProbeOffWarning

LOOP = FIXTURES / "probe_loop.py"
#: What each fault's probe must name first (the warning and the event's ``first``).
NAMED = {
    "moments-bf16": "optimizer state 0.weight.exp_avg (restored)",
    "sampler-epoch": "progress.epoch (after step 11)",
    "worker-rng": "the batch drawn (forward 0 input 0) (after step 11: samples 0, 1, 2, 3 of 4 differ)",
    "scheduler": "scheduler.last_epoch (after step 11)",
    "cursor-perm": "the batch drawn (forward 0 input 0) (after step 11: samples 0, 1, 2, 3 of 4 differ)",
    "rank0-rng": "rank 1: random stream torch_cpu (after step 11)",
}


def _fixture():
    spec = importlib.util.spec_from_file_location("probe_loop", LOOP)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _events(run: Path, name: str) -> list[dict]:
    out = []
    for line in (run / ".loss.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == name:
            out.append(rec)
    return out


def _command(run: Path, fault: str | None) -> list[str]:
    return [sys.executable, "-B", str(LOOP), "--folder", str(run)] + (["--fault", fault] if fault else [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(run: Path, fault: str | None, world: int = 2) -> list[subprocess.CompletedProcess]:
    port = str(_free_port())
    procs = []
    for r in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", WORLD_SIZE=str(world), RANK=str(r),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(_command(run, fault), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    for res in out:
        assert res.returncode == 0, res.stdout[-3000:]
    return out


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _sessions(tmp_path: Path, faults: list[str | None], probe_every: int = 1) -> dict[str | None, tuple[Path, object, list]]:
    """Each fault's loop as a session of this process (closed together: their side processes run at once)."""
    loop = _fixture()
    runs: dict[str | None, tuple[Path, object, list]] = {}
    for fault in faults:
        run = tmp_path / (fault or "exact")
        ckpt = loop.train(str(run), 12, 10, probe_every, fault, probe_command=_command(run, fault),
                          handle_signals=False, close=False)
        runs[fault] = (run, ckpt, [])
    for _fault, (_run, ckpt, caught) in runs.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ckpt.close()
        caught.extend(w for w in seen if issubclass(w.category, ProbeMismatchWarning | ProbeOffWarning))
    return runs


def test_each_single_process_fault_is_caught_and_named_and_the_exact_loop_is_quiet(tmp_path, one_thread):
    faults = ["moments-bf16", "sampler-epoch", "worker-rng", "scheduler", "cursor-perm"]
    runs = _sessions(tmp_path, [*faults, None])
    run, ckpt, caught = runs[None]
    assert caught == [], [str(w.message) for w in caught]  # the exact loop: no alarm
    assert ckpt.probe.confirmed == 10 and not ckpt.probe.mismatches and ckpt.probe.off is None
    assert [e["step"] for e in _events(run, "probe_ok")] == [10]
    ok = _events(run, "probe_ok")[0]["state"]  # one line: the fingerprint of the replayed step's state
    assert ok.startswith("same state (fingerprint ") and len(ok.split()[3].rstrip(":")) == 16
    for fault in faults:
        run, ckpt, caught = runs[fault]
        assert len(caught) == 1 and caught[0].category is ProbeMismatchWarning, (fault, [str(w.message) for w in caught])
        line = str(caught[0].message)
        assert f"probe of generation 10 does not replay the live run bit for bit: {NAMED[fault]} differs" in line, line
        assert "\n" not in line and "no generation of this session was confirmed by a probe" in line
        (event,) = _events(run, "probe_mismatch")
        assert event["first"] == NAMED[fault] and event["step"] == 10 and event["confirmed"] is None, event
        assert ckpt.probe.confirmed is None and not _events(run, "probe_ok")


def test_rank0_random_state_on_every_rank_is_caught_across_two_gloo_ranks(tmp_path):
    run = tmp_path / "ddp"
    out = _ranks(run, "rank0-rng")
    (event,) = _events(run, "probe_mismatch")
    assert event["first"] == NAMED["rank0-rng"], event
    assert event["differences"][0] == NAMED["rank0-rng"] and event["count"] == len(event["differences"]) or \
        event["count"] > len(event["differences"])
    assert f"{NAMED['rank0-rng']} differs" in out[0].stdout and "ProbeMismatchWarning" not in out[1].stdout
    assert NAMED["rank0-rng"] not in out[1].stdout  # said once, by rank 0


def test_a_probe_that_cannot_run_says_so_once_and_turns_itself_off(tmp_path, one_thread):
    loop = _fixture()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # this process is a test runner: no command line to start again, and none given
        ckpt = loop.train(str(tmp_path / "a"), 12, 5, 1, None, handle_signals=False)
        # a command that ends before it replays the step: said once, off, training goes on to its end
        bad = [sys.executable, "-c", "import sys; sys.exit(5)"]
        ckpt2 = loop.train(str(tmp_path / "b"), 12, 2, 1, None, probe_command=bad, handle_signals=False)
    off = [str(w.message) for w in seen if w.category is ProbeOffWarning]
    # pytest itself: "a test runner"; a pytest-xdist worker (python -c, no script): "interactive"
    assert len(off) == 2 and ("test runner" in off[0] or "interactive" in off[0]) and "exit code 5" in off[1], off
    assert ckpt.probe.off and ckpt2.probe.off and ckpt2.probe.probed == 1  # one try, then off
    assert len(_events(tmp_path / "b", "probe_off")) == 1 and ckpt2.last_saved_step == 12
    assert not [w for w in seen if w.category is ProbeMismatchWarning]


def test_probe_every_is_checked(tmp_path):
    model = torch.nn.Linear(2, 2)
    state = ripresa.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="probe_every"):
            ripresa.Checkpointer(tmp_path / "r", state, probe_every=bad, handle_signals=False)


def test_a_stray_probe_variable_is_refused_before_anything_is_touched(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    state = ripresa.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for raw in ("{", json.dumps({"schema": probe_mod.SCHEMA}),
                json.dumps(
                    {"schema": probe_mod.SCHEMA, "generation": "/x/step_000001.safetensors", "step": 1, "steps": 1,
                     "output": str(tmp_path / "o"), "rank": 0, "parent": "999999999:1"})):
        monkeypatch.setenv(probe_mod.ENV, raw)
        with pytest.raises(ripresa.errors.BadInput):
            ripresa.Checkpointer(tmp_path / "r", state, handle_signals=False)
        assert not (tmp_path / "r").exists() and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_exact_loop_raises_no_alarm_on_two_gloo_ranks_and_at_every_generation(tmp_path):
    run = tmp_path / "ddp"
    out = _ranks(run, None)
    assert [e["step"] for e in _events(run, "probe_ok")] == [10]
    assert not _events(run, "probe_mismatch") and "warning" not in out[0].stdout + out[1].stdout
    single = tmp_path / "one"
    res = subprocess.run([*_command(single, None), "--steps", "30", "--every", "3", "--probe-every", "2"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr[-2000:]
    ok = [e["step"] for e in _events(single, "probe_ok")]
    assert ok and set(ok) <= {3, 9, 15, 21, 27} and not _events(single, "probe_mismatch")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["moments-bf16", "sampler-epoch", "worker-rng", "scheduler", "cursor-perm"])
def test_each_fault_is_caught_by_the_script_started_again_from_its_own_command_line(tmp_path, fault):
    run = tmp_path / "r"
    res = subprocess.run(_command(run, fault), capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"{NAMED[fault]} differs" in res.stderr
    (event,) = _events(run, "probe_mismatch")
    assert event["first"] == NAMED[fault]


@pytest.mark.slow
def test_without_the_probe_no_fault_is_seen(tmp_path, one_thread):
    """The control: the same faulty loops with probe_every=0 say nothing (the probe is what catches them)."""
    runs = _sessions(tmp_path, ["moments-bf16", "scheduler", "cursor-perm"], probe_every=0)
    for _fault, (run, ckpt, caught) in runs.items():
        assert caught == [] and ckpt.probe is None and not _events(run, "probe_mismatch")


@pytest.mark.slow
@pytest.mark.parametrize("example", ["lightning", "hf_trainer"])
def test_the_framework_integrations_offer_the_probe_and_the_exact_fit_raises_no_alarm(tmp_path, example):
    pytest.importorskip("lightning" if example == "lightning" else "transformers")
    script = FIXTURES.parent.parent / "examples" / example / "train.py"
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-B", str(script), "--run", str(run), "--max-steps", "14", "--every", "5",
                          "--final", str(tmp_path / "final.safetensors"), "--probe-every", "1"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [e["step"] for e in _events(run, "probe_ok")] == [5], res.stderr[-3000:]
    assert not _events(run, "probe_mismatch") and not _events(run, "probe_off")


@pytest.mark.slow
def test_ripresa_train_probe_every_confirms_the_engine_and_pivot_replays_the_flag(tmp_path):
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(run), "--config", "tiny", "--steps", "12",
                          "--every", "5", "--probe-every", "1", "--quiet"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [e["step"] for e in _events(run, "probe_ok")] == [5] and not _events(run, "probe_mismatch")
    (launch,) = _events(run, "launch")
    assert launch["options"]["probe_every"] == 1
    from ripresa.engine.pivot import _replayed_flags

    assert "--probe-every=1" in _replayed_flags(launch, run)
    bad = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(tmp_path / "x"), "--probe-every", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--probe-every must be >= 0" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_bench_probe_measures_one_confirmed_probe_per_block(tmp_path):
    bench = FIXTURES.parent.parent / "benchmarks" / "bench_probe.py"
    res = subprocess.run([sys.executable, str(bench), "--size", "tiny", "--pairs", "1", "--every", "3",
                          "--quiet-timeout", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_probe_tiny.json").read_text())
    assert doc["child"]["confirmed"] == [3] and doc["child"]["mismatches"] == 0
    assert set(doc["overhead"]) == {"1", "10", "100"} and doc["probe_cost_s"]["samples"]
