"""``every="auto"`` (Young–Daly from measurements), ``ripresa advise`` and ``deadline=`` (docs/CADENCE.md).

The policy is checked on several parameter sets; a real loop (synthetic step
time by sleep, a save cost injected at the tensor file's fsync by the test fault
hooks, real files and fsync) must choose an interval within 10 % of
√(2·C·MTBF)/step; a deadline run stops through the stop path, commits, and
writes a real export bundle that verifies, before the deadline.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
import torch
from conftest import ripresa_cli
from support.ripresa_faults import install_delay_hook
from support.tiny import tiny_state

import ripresa
from ripresa.cli import main as cli_main
from ripresa.engine.gpt.factory import GPT_FACTORY
from ripresa.errors import BadInput
from ripresa.session.cadence import (
    AutoCadence,
    advise,
    choose_every,
    parse_duration,
    parse_max_redo,
)
from ripresa.session.deadline import Deadline, deadline_time
from ripresa.store.history import read_history
from ripresa.tools.export import export_run, verify_export


@pytest.mark.parametrize(("step", "cost", "mtbf", "max_redo", "write", "every", "bound"), [
    (1.0, 10.0, 86400.0, None, None, 1315, "young_daly"),           # √(2·10·86400) = 1314.5 s
    (0.05, 0.5, 10.0, None, None, 63, "young_daly"),                # 3.162 s / 0.05 s
    (1.0, 10.0, 86400.0, ("steps", 500.0), None, 500, "max_redo"),
    (2.0, 10.0, 86400.0, ("seconds", 600.0), None, 300, "max_redo"),  # 10 min of 2 s steps
    (2.0, 10.0, 86400.0, ("seconds", 7200.0), None, 657, "young_daly"),  # the bound is not reached
    (0.1, 0.001, 60.0, None, 2.0, 20, "write_time"),               # background: not shorter than the write
    (0.1, 0.01, 3600.0, ("steps", 5.0), 2.0, 20, "write_time"),    # the write wins over max_redo
    (10.0, 0.001, 3600.0, None, None, 1, "one_step"),              # τ < one step: every step
])
def test_young_daly_choice_for_several_parameter_sets(step, cost, mtbf, max_redo, write, every, bound):
    d = choose_every(step, cost, mtbf, max_redo=max_redo, write_s=write)
    assert (d.every, d.bound) == (every, bound)
    assert d.young_daly_steps == pytest.approx(math.sqrt(2 * cost * mtbf) / step)
    e = d.expected()
    assert e["lost_per_failure_s"] == pytest.approx(every * step / 2 + (write or 0.0))
    assert e["overhead"] == pytest.approx(cost / (every * step + cost))


def test_auto_cadence_warms_up_then_records_only_changes_over_5_percent():
    c = AutoCadence(mtbf_s=10.0, background=False, warmup=10)
    due = []
    for s in range(1, 11):
        c.step_time(0.05)
        due.append(c.due(s))
    assert due == [False] * 9 + [True]  # the warm-up save measures C
    assert c.reevaluate(10) is None  # nothing measured about the save yet
    c.saved(10, 0.5)
    first = c.reevaluate(10, force=True)
    assert first is not None and (first["every"], first["previous"], first["bound"]) == (63, None, "young_daly")
    assert c.steps_to_next(20) == 53 and not c.due(72) and c.due(73)
    c.saved(73, 0.54)  # median 0.52: √ratio 1.02 → 64 steps, under 5 %: no event, the interval still follows
    assert c.reevaluate(73, force=True) is None and c.every == 64
    assert c.reevaluate(80) is None  # not 50 steps since the last evaluation, not forced
    for s in (0.9, 0.9):
        c.saved(200, s)  # median of 0.5, 0.54, 0.9, 0.9 → 0.72: 76 steps, +19 %
    ev = c.reevaluate(200, force=True)
    assert ev is not None and ev["previous"] == 63 and ev["every"] == round(math.sqrt(2 * 0.72 * 10) / 0.05)
    slow = AutoCadence(mtbf_s=86400.0, max_redo=("seconds", 30.0), background=False)  # 10 s steps, 30 s of work
    slow.step_time(10.0)
    assert [slow.due(s) for s in (1, 2, 3)] == [False, False, True]  # the warm-up save within max_redo too
    # background saves: no decision before a write time is known; then not shorter than the write
    b = AutoCadence(mtbf_s=60.0, background=True, warmup=10)
    for _ in range(5):
        b.step_time(0.1)
    b.saved(10, 0.001)
    assert b.reevaluate(10, force=True) is None and b.every == 10
    b.written(2.0)
    ev = b.reevaluate(10, force=True)
    assert ev is not None and (ev["every"], ev["bound"], ev["write_s"]) == (20, "write_time", 2.0)


def test_durations_deadlines_and_their_typed_errors():
    assert [parse_duration(x) for x in ("90s", "30m", "24h", "7d", "1.5h", "3600", 12)] == \
        [90, 1800, 86400, 604800, 5400, 3600, 12]
    assert parse_max_redo("500") == ("steps", 500.0) and parse_max_redo("30m") == ("seconds", 1800.0)
    assert deadline_time("72h", now=1000.0) == 1000.0 + 72 * 3600
    assert deadline_time("2026-12-24T18:00Z") == datetime(2026, 12, 24, 18, tzinfo=UTC).timestamp()
    assert deadline_time("2026-12-24T19:00+01:00") == datetime(2026, 12, 24, 18, tzinfo=UTC).timestamp()
    for bad in ("abc", "-5m", "0", "1e999", "5 weeks", "9" * 100, "9" * 40 + "d", "101000000h", True):
        with pytest.raises(BadInput):
            parse_duration(bad)
    for bad in ("0", "x", "-3"):
        with pytest.raises(BadInput):
            parse_max_redo(bad)
    for bad in ("2026-13-45T99:00Z", "2026-12-24T18:00", "tomorrow-ish"):
        with pytest.raises(BadInput):
            deadline_time(bad)
    with pytest.raises(BadInput, match="passed"):
        Deadline(datetime(2020, 1, 1, tzinfo=UTC))
    with pytest.raises(BadInput, match="100 years"):
        Deadline(datetime(9999, 1, 1, tzinfo=UTC))
    with pytest.raises(BadInput, match="time zone"):
        Deadline(datetime(2030, 1, 1))


def test_deadline_plan_reserves_save_upload_export_and_a_reported_margin():
    d = Deadline(100.0, now=0.0)  # 100 s from t=0
    plan = d.replan(None, None, now=1.0)
    assert plan is not None and set(plan["estimated"]) == {"step", "save", "export"}
    assert d.plan.stop_at == pytest.approx(100 - 2.0 - 5.0)  # nothing measured: the export's base and the 5 s margin
    d.saved(2.0)
    plan = d.replan(0.5, None, now=1.0)
    # tail = save 2 + upload 0 (no mirror) + export 3·2+2 = 10; margin = max(3·0.5, 10 % of 10, 5 s) = 5
    assert plan is not None and plan["estimated"] == ["export"] and plan["margin_s"] == 5.0
    assert d.plan.stop_at == pytest.approx(85.0)
    assert not d.due(84.4) and d.due(84.5)  # the next 0.5 s step would end past the planned stop
    assert d.replan(0.5, None, now=2.0) is None  # unchanged: no new deadline_plan event
    big = Deadline(10_000.0, now=0.0)
    big.saved(100.0)
    big.replan(20.0, None, now=0.0)  # tail 100 + 302 = 402: margin max(60, 40.2, 5) = 60
    assert big.plan.margin_s == 60.0 and big.plan.stop_at == pytest.approx(10_000 - 462.0)


def _tiny_state():
    state = tiny_state((8, 8))  # tests/support/tiny.py
    return state.model, state


def test_checkpointer_refuses_bad_cadence_and_deadline_arguments_before_locking(tmp_path):
    _, state = _tiny_state()
    run = tmp_path / "run"
    for kw, exc in (({"every": "auto", "mtbf": "soon"}, BadInput), ({"every": "auto", "max_redo": 0}, BadInput),
                    ({"every": "sometimes"}, TypeError), ({"every": 10, "mtbf": "1h"}, ValueError),
                    ({"deadline": "2000-01-01T00:00Z"}, BadInput), ({"deadline": "later"}, BadInput),
                    ({"deadline": 1e300}, BadInput)):
        with pytest.raises(exc):
            ripresa.Checkpointer(run, state, handle_signals=False, **kw)
        assert not run.exists()  # nothing created, nothing locked


def test_auto_every_matches_young_daly_in_a_real_loop(tmp_path):
    """Synthetic 0.04 s steps, 1 s saves (at the .safetensors file's fsync), MTBF 1 s: every ≈ √(2·1·1)/0.04 = 35.4.

    ``step`` in the bound is the loop's own step time as this test measures it
    (a loaded machine oversleeps), ``C`` the injected save cost.
    """
    step_s, cost_s, mtbf_s = 0.04, 1.0, 1.0  # the injected cost dwarfs the real save's (tens of ms)
    durations = []
    model, state = _tiny_state()
    x = torch.ones(4, 8)
    run = tmp_path / "run"
    uninstall = install_delay_hook(f"fsync:{cost_s}@.safetensors.tmp")
    try:
        ckpt = ripresa.Checkpointer(run, state, every="auto", mtbf=mtbf_s, asynchronous=False, handle_signals=False)
        assert ckpt.resume() == 0
        step = 0
        while step < 80:
            step += 1
            t0 = time.perf_counter()
            time.sleep(step_s)
            state.optimizer.zero_grad()
            model(x).square().mean().backward()
            state.optimizer.step()
            durations.append(time.perf_counter() - t0)
            ckpt.step_done(step)
            if len(ckpt.save_stalls) == 2:
                break
        ckpt.close()
    finally:
        uninstall()
    expected = math.sqrt(2 * cost_s * mtbf_s) / statistics.median(durations[1:10])  # steps 2-10, as the session saw them
    events = read_history(run / ".loss.jsonl").events
    first = next(e for e in events if e["event"] == "cadence")
    assert first["previous"] is None and first["step"] == 10  # decided after the warm-up save
    assert first["cost_s"] >= cost_s and first["step_s"] >= step_s  # the injected costs were measured
    print(f"chosen every {first['every']} for √(2·C·MTBF)/step = {expected:.1f}; measured {first}")
    assert abs(first["every"] - expected) <= 0.10 * expected, first
    assert first["every"] == round(math.sqrt(2 * first["cost_s"] * mtbf_s) / first["step_s"])
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [10, 10 + first["every"]]
    # ripresa advise reads the same from the history alone
    report = advise(run, ["1s"])
    last = [e for e in events if e["event"] == "cadence"][-1]
    assert report["measured"]["checkpoints"] == 2 and report["measured"]["every_now"] == last["every"]
    assert abs(report["choices"][0]["every"] - expected) <= 0.15 * expected  # its step time includes step_done


def test_auto_every_with_background_saves_is_not_shorter_than_the_write(tmp_path):
    """Background saves: a tiny stall but a 0.3 s write (at the fsync, in the writer thread) bounds the interval."""
    model, state = _tiny_state()
    run = tmp_path / "run"
    uninstall = install_delay_hook("fsync:0.3@.safetensors.tmp")
    try:
        ckpt = ripresa.Checkpointer(run, state, every="auto", mtbf=1.0, handle_signals=False)
        assert ckpt.writer is not None
        ckpt.resume()
        for step in range(1, 60):
            time.sleep(0.02)
            ckpt.step_done(step)
            if len(ckpt.save_stalls) == 3:
                break
        ckpt.close()
    finally:
        uninstall()
    events = read_history(run / ".loss.jsonl").events
    decisions = [e for e in events if e["event"] == "cadence"]
    first = decisions[0]
    assert first["write_s"] >= 0.3 and first["bound"] == "write_time", first
    assert first["young_daly_steps"] < first["every"] == math.ceil(first["write_s"] / first["step_s"])
    for d in decisions:  # never shorter than the write
        assert d["every"] * d["step_s"] >= d["write_s"]
    ck = [e for e in events if e["event"] == "checkpoint"]
    assert all(e["background"] and e["stall"] < e["seconds"] for e in ck), ck


def _advise(*args: str) -> subprocess.CompletedProcess:
    return ripresa_cli("advise", *args, timeout=60)


def _history(path, lines) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / ".loss.jsonl").write_bytes(b"".join(
        (x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))


def test_advise_reads_a_history_and_refuses_hostile_ones_with_typed_errors(tmp_path, capsys):
    good = tmp_path / "good"
    t0 = 1_800_000_000.0
    lines: list = [{"event": "start", "step": 0, "time": t0}]
    for s in range(1, 201):
        lines.append({"step": s, "loss": 1.0, "time": t0 + s * 0.5})
        if s % 50 == 0:
            lines.append({"event": "checkpoint", "step": s, "reason": "cadence", "seconds": 3.0, "stall": 0.2,
                          "background": True, "time": t0 + s * 0.5})
    # hostile lines among them are skipped: torn, not an object, wrong types, out of range, NaN
    lines += [b'{"step": 201, "time": ', b"[1,2]", {"step": "x", "time": 1}, {"step": 2**70, "time": 1},
              {"event": "checkpoint", "reason": "cadence", "seconds": "NaN"}, b'{"step": 300, "time": NaN}']
    _history(good, lines)
    assert cli_main(["advise", str(good), "--mtbf", "1h,24h", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"]["step_s"] == 0.5 and report["measured"]["cost_s"] == 0.2
    assert report["measured"]["write_s"] == 3.0 and report["measured"]["every_now"] == 50
    assert [r["every"] for r in report["choices"]] == [round(math.sqrt(2 * 0.2 * 3600) / 0.5),
                                                       round(math.sqrt(2 * 0.2 * 86400) / 0.5)]
    assert cli_main(["advise", str(good)]) == 0
    assert "24h" in capsys.readouterr().out

    no_ckpt = tmp_path / "no_ckpt"
    _history(no_ckpt, [{"step": s, "time": t0 + s} for s in range(1, 20)])
    garbage = tmp_path / "garbage"
    _history(garbage, [b"\xff\xfe", b"{" * 100_000, {"step": -1, "time": -5}, {"step": 1, "time": 1e300}])
    too_fast = tmp_path / "too_fast"  # steps under the history's millisecond clock: no step time to advise on
    _history(too_fast, [{"step": s, "time": t0} for s in range(1, 20)] +
             [{"event": "checkpoint", "step": 10, "reason": "cadence", "seconds": 0.1}])
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".loss.jsonl")
    link = tmp_path / "link"
    link.mkdir()
    (link / ".loss.jsonl").symlink_to(good / ".loss.jsonl")
    cases = [(no_ckpt, ()), (garbage, ()), (too_fast, ()), (fifo, ()), (link, ()), (tmp_path / "missing", ()),
             (good, ("--mtbf", "soon")), (good, ("--mtbf", "0")), (good, ("--max-redo", "0"))]
    for run, extra in cases:
        assert cli_main(["advise", str(run), *extra]) == 2, (run, extra)
        assert "error:" in capsys.readouterr().err
    res = _advise(str(fifo))  # a real process: refused at once, no hang, no traceback
    assert res.returncode == 2 and "Traceback" not in res.stderr and "error:" in res.stderr, res.stderr


def test_deadline_stops_commits_and_exports_before_it(tmp_path):
    """A 9 s deadline: the session plans its stop, stops through the stop path, then exports (real bundle)."""
    cfg = GPT_FACTORY.config("tiny")
    model, opt = GPT_FACTORY.build(cfg)
    state = ripresa.TrainingState(model=model, optimizer=opt, config=cfg)
    run = tmp_path / "run"
    exported = []

    def export(step: int) -> dict:
        report = export_run(run, run / "exports" / f"deadline-step_{step:06d}", model_factory=GPT_FACTORY, step=step,
                            show_progress=False)
        exported.append(report)
        return report

    deadline = time.time() + 9.0
    ckpt = ripresa.Checkpointer(run, state, every=0, deadline=datetime.fromtimestamp(deadline, UTC), format="andrea",
                                on_deadline=export, handle_signals=False)
    ckpt.resume()
    stopped, step = False, 0
    while not stopped and step < 2000:
        step += 1
        time.sleep(0.02)  # the synthetic step
        stopped = ckpt.step_done(step)
    ckpt.close()
    finished = time.time()
    assert stopped and ckpt.deadline.stopped_at_step == step
    events = read_history(run / ".loss.jsonl").events
    names = [e["event"] for e in events]
    assert names.index("deadline_plan") < names.index("deadline_stop") < names.index("deadline_done")
    assert "signal" not in names
    ck = [e for e in events if e["event"] == "checkpoint"]
    assert ck[0]["step"] == 10 and ck[0]["reason"] == "cadence"  # the measuring save (every=0 otherwise)
    assert ck[-1] == {**ck[-1], "step": step, "reason": "stop"}
    stop = next(e for e in events if e["event"] == "deadline_stop")
    assert stop["step"] == step and stop["margin_s"] >= 5.0 and "save" not in stop["estimated"]
    done = next(e for e in events if e["event"] == "deadline_done")
    assert done["step"] == step and done["export"] == str(run / "exports" / f"deadline-step_{step:06d}")
    assert done["met"] is True and done["seconds_before_deadline"] > 0 and finished < deadline
    assert exported[0]["step"] == step and exported[0]["verified"]
    assert verify_export(run / "exports" / f"deadline-step_{step:06d}", model_factory=GPT_FACTORY)["verified"]


@pytest.mark.slow
def test_ripresa_train_deadline_in_a_real_process_stops_saves_exports_in_time(tmp_path):
    """`ripresa train --deadline <now+40 s>`: stops, saves, exports a bundle that verifies, exits before the deadline."""
    run = tmp_path / "run"
    t0 = time.time()
    deadline = datetime.now(UTC) + timedelta(seconds=40)  # on a loaded 2-core machine the start alone can take 20 s
    text = deadline.isoformat(timespec="seconds").replace("+00:00", "Z")
    res = ripresa_cli("train", "--run", run, "--config", "tiny", "--threads", "1", "--set", "train.batch_size=4",
                      "--no-audit", "--quiet", "--steps", "10000000", "--every", "auto", "--mtbf", "1h", "--deadline", text, timeout=120)
    finished = datetime.now(UTC)
    assert res.returncode == 0, res.stderr
    assert "stopped for the deadline" in res.stdout
    events = read_history(run / ".loss.jsonl").events
    stop = next(e for e in events if e["event"] == "deadline_stop")
    done = next(e for e in events if e["event"] == "deadline_done")
    started = next(e for e in events if e["event"] == "start")
    print(f"started {started['time'] - t0:.1f} s after the launch, stopped at step {stop['step']}: {stop}; {done}")
    assert done["met"] is True and done["step"] == stop["step"]
    assert finished < deadline.replace(microsecond=0), "the process exited after the deadline"
    assert any(e["event"] == "cadence" for e in events)
    bundle = run / "exports" / f"deadline-step_{stop['step']:06d}"
    check = ripresa_cli("export", "--verify", bundle, "--json", timeout=120)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["reload"]["step"] == stop["step"]


@pytest.mark.slow
def test_auto_every_under_torchrun_keeps_every_rank_on_one_schedule(tmp_path):
    """DDP on 2 gloo ranks: rank 0 decides, every rank adopts it at a save; no rank waits for a save the other skips."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "--", "ripresa",
           "train", "--run", str(run), "--config", "tiny", "--threads", "1", "--set", "train.batch_size=4",
           "--no-audit", "--quiet", "--steps", "50", "--every", "auto", "--mtbf", "30"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    events = read_history(run / ".loss.jsonl").events
    saves = [e["step"] for e in events if e["event"] == "checkpoint" and e["reason"] == "cadence"]
    assert saves[0] == 10 and len(saves) >= 2
    adopted = 10  # the warm-up, then the latest proposal at each save
    for a, b in zip(saves, saves[1:], strict=False):
        proposals = [e["every"] for e in events if e["event"] == "cadence" and e["step"] <= a]
        adopted = proposals[-1] if proposals else adopted
        # a proposal within 5 % of the last recorded one is adopted without an event
        assert abs(b - a - adopted) <= max(1, 0.05 * adopted), (saves, proposals)
