"""The ``on_staged`` hook (docs/API.md): the committed generation's weights, off the loop; the engine's audit on it."""

from __future__ import annotations

import json
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import ripresa
from ripresa.formats.andrea_bin import read_bin
from ripresa.store.history import read_history


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, ripresa.TrainingState]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, ripresa.TrainingState(model=model, optimizer=opt, config={"toy": 1})


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


def _live(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fmt", ["andrea", "general"])
def test_on_staged_runs_on_the_writer_thread_with_the_committed_weights(tmp_path, fmt):
    model, opt, state = _state()
    calls: list[tuple[int, str, dict[str, torch.Tensor], bool]] = []
    ck = None

    def hook(step, weights):
        buf = ck.writer.buffers.flat if fmt == "andrea" else ck.backend.staging.buffer
        in_staging = buf is not None and all(
            buf.data_ptr() <= w.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size() for w in weights.values())
        calls.append((step, threading.current_thread().name, {n: w.clone() for n, w in weights.items()}, in_staging))

    ck = ripresa.Checkpointer(tmp_path / "run", state, every=3, handle_signals=False, format=fmt, on_staged=hook)
    assert ck.writer is not None
    ck.resume()
    expected = {}
    for step in range(1, 10):
        _step(model, opt)
        if step % 3 == 0:
            expected[step] = _live(model)
        ck.step_done(step)
    ck.close()
    assert [c[0] for c in calls] == [3, 6, 9]
    for step, thread, weights, in_staging in calls:
        assert thread != threading.main_thread().name and thread.startswith("ripresa-save-")
        assert set(weights) == set(expected[step])
        assert all(torch.equal(weights[n], expected[step][n]) for n in weights)
        assert in_staging  # views of the staged copy, not a clone taken on the loop
        if fmt == "andrea":
            flat = torch.cat([weights[n].reshape(-1) for n, _ in model.named_parameters()])
            on_disk = read_bin(tmp_path / "run" / f"step_{step:06d}.bin").weights
            assert np.array_equal(flat.numpy(), np.asarray(on_disk))


def test_on_staged_on_the_loop_with_live_weights_when_synchronous(tmp_path):
    model, opt, state = _state()
    calls = []
    ck = ripresa.Checkpointer(tmp_path / "run", state, every=2, handle_signals=False, asynchronous=False,
                              format="andrea", on_staged=lambda s, w: calls.append(
                                  (s, threading.current_thread() is threading.main_thread(), dict(w))))
    ck.resume()
    for step in range(1, 5):
        _step(model, opt)
        ck.step_done(step)
        if step % 2 == 0:
            s, on_main, w = calls[-1]
            assert s == step and on_main
            live = dict(model.named_parameters())
            assert all(w[n].data_ptr() == live[n].data_ptr() for n in live)  # the live parameters themselves
    ck.close()
    assert [c[0] for c in calls] == [2, 4]


def test_the_stall_excludes_on_staged_but_close_and_save_now_wait_for_it(tmp_path):
    model, opt, state = _state()
    done: list[int] = []

    def slow(step, weights):
        time.sleep(0.5)
        done.append(step)

    ck = ripresa.Checkpointer(tmp_path / "run", state, every=2, handle_signals=False, format="andrea", on_staged=slow)
    ck.resume()
    took = {}
    for step in range(1, 5):
        _step(model, opt)
        t0 = time.perf_counter()
        ck.step_done(step)
        took[step] = time.perf_counter() - t0
        if step == 2:
            assert took[2] < 0.25 and done == []  # the loop does not wait for the hook at its checkpoint
            while len(done) < 1:  # the next save would wait for it (it reads the staging buffers): let it end
                time.sleep(0.02)
    _step(model, opt)
    ck.step_done(5)
    ck.save_now()
    assert done == [2, 4, 5]  # save_now waited for its hook (and the step-4 save's first)
    _step(model, opt)
    ck.step_done(6)  # a cadence save whose hook is still running when close() is called
    ck.close()
    assert done == [2, 4, 5, 6]
    stalls = {e["step"]: e["stall"] for e in read_history(tmp_path / "run" / ".loss.jsonl").events
              if e["event"] == "checkpoint"}
    assert set(stalls) == {2, 4, 5, 6}
    assert stalls[2] < 0.25 and stalls[4] < 0.25  # the staging copy only
    assert stalls[5] >= 0.4  # save_now's staging waited for the step-4 hook: the wait the buffers need

    # The control: the same hook as on_checkpoint runs on the loop, and the measurement sees it.
    model, opt, state = _state()
    ck = ripresa.Checkpointer(tmp_path / "run2", state, every=2, handle_signals=False, format="andrea",
                              on_checkpoint=lambda s: slow(s, None))
    ck.resume()
    _step(model, opt)
    ck.step_done(1)
    _step(model, opt)
    t0 = time.perf_counter()
    ck.step_done(2)
    assert time.perf_counter() - t0 >= 0.5
    ck.close()


def test_a_failing_on_staged_is_reported_never_fatal(tmp_path):
    model, opt, state = _state()

    def broken(step, weights):
        raise RuntimeError(f"audit broke at {step}")

    ck = ripresa.Checkpointer(tmp_path / "run", state, every=2, handle_signals=False, format="andrea", on_staged=broken)
    ck.resume()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 5):
            _step(model, opt)
            ck.step_done(step)
        ck.close()
    assert ck.last_saved_step == 4 and ck.failed_saves == 0
    events = read_history(tmp_path / "run" / ".loss.jsonl").events
    failed = [e for e in events if e["event"] == "on_staged_failed"]
    assert [e["step"] for e in failed] == [2, 4] and "audit broke at 2" in failed[0]["error"]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2, 4]
    assert sum("on_staged hook failed" in str(w.message) for w in caught) == 2


@pytest.mark.slow  # the default tier samples the family with the cheaper tests of this file
def test_the_engine_audit_off_the_loop_equals_the_synchronous_one(tmp_path):
    """`ripresa train`: the audit sampled on the writer's thread from the staged weights (two torch threads, the
    loop training meanwhile) is the one a synchronous run samples on the loop, and the one the committed
    generation's weights give."""
    import subprocess
    import sys

    from ripresa.engine.gpt.model import CONFIGS, GPT
    from ripresa.engine.gpt.train import audit_samples

    args = ["--config", "tiny", "--quiet", "--set", "train.batch_size=4", "--set", "audit.max_new_tokens=24",
            "--threads", "2", "--steps", "8", "--every", "4"]
    for mode in ("async", "sync"):
        res = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(tmp_path / mode), *args,
                              *(["--sync"] if mode == "sync" else [])], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    docs = {mode: json.loads((tmp_path / mode / ".samples.json").read_text()) for mode in ("async", "sync")}
    assert [a["step"] for a in docs["async"]["audits"]] == [4, 8]
    assert docs["async"] == docs["sync"]
    events = read_history(tmp_path / "async" / ".loss.jsonl").events
    assert all(e["background"] for e in events if e["event"] == "checkpoint")
    assert not [e for e in events if e["event"] == "on_staged_failed"]
    # The reference: a fresh model holding generation 8's weights, sampled here.
    cfg = json.loads((tmp_path / "async" / "config.json").read_text())
    net = GPT(CONFIGS["tiny"])
    flat = torch.from_numpy(np.asarray(read_bin(tmp_path / "async" / "step_000008.bin").weights).copy())
    torch.nn.utils.vector_to_parameters(flat, net.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ref = audit_samples(net, cfg["audit"], int(cfg["train"]["seed"]), 8, torch.device("cpu"), None)
    finally:
        torch.set_num_threads(threads)
    assert docs["async"]["audits"][-1]["samples"] == ref


def test_sigterm_waits_for_the_pending_audit(tmp_path):
    """A stop: the stop save's audit is written to .samples.json before the process exits."""
    import signal
    import subprocess
    import sys

    from conftest import wait_for_step

    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "ripresa", "train", "--run", str(run_dir), "--config", "tiny", "--quiet",
                          "--set", "train.batch_size=4", "--threads", "1", "--steps", "2000", "--every", "1000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(run_dir, 5, p, timeout=60)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    stop = [e for e in read_history(run_dir / ".loss.jsonl").events if e["event"] == "checkpoint"][-1]
    assert stop["reason"] == "stop"
    audits = json.loads((run_dir / ".samples.json").read_text())["audits"]
    assert [a["step"] for a in audits] == [stop["step"]]

