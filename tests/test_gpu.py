"""The GPU path (marker ``cuda``; ``make test-gpu``): skipped without a CUDA device.

Pinned staging of device tensors in background saves (general and ``.bin``),
every device's CUDA random stream restored exactly in a fresh process, fp16
autocast + GradScaler (scale, growth tracker, skipped found-inf steps) and
bfloat16 runs SIGKILLed and restarted bitwise, a steered ``ripresa verify`` at
tolerance 0, and a 2-process NCCL run (two devices). Real processes, real
SIGKILL, tolerance 0; the loop is tests/fixtures/gpu_loop.py.

``RIPRESA_TEST_DEVICE=cpu`` (read by these tests only) runs the same tests on
the CPU — gloo for NCCL, no pinned memory — to exercise their code where there
is no GPU; it proves nothing about CUDA.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ripresa_cli

DEVICE = os.environ.get("RIPRESA_TEST_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
LOOP = FIXTURES / "gpu_loop.py"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(CUDA and not torch.cuda.is_available(),
                       reason="no CUDA device (RIPRESA_TEST_DEVICE=cpu runs these tests on the CPU)"),
]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")


def _loop(run: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-B", str(LOOP), "--run", str(run), "--device", DEVICE, *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, env=_env())
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def _final(run: Path, rank: int = 0) -> dict:
    return json.loads((run / f"final.rank{rank}.json").read_text())


def _steps(run: Path) -> dict[int, dict]:
    """The canonical (last written) history line of every step, without its wall-clock time."""
    out: dict[int, dict] = {}
    for line in (run / ".loss.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "event" not in rec and "step" in rec:
            rec.pop("time", None)
            out[rec["step"]] = rec
    return out


# ---------------------------------------------------------------------- pinned staging
@pytest.mark.parametrize("fmt", ["general", "andrea", "shards-budget"])
def test_a_background_save_stages_device_tensors_in_pinned_memory(tmp_path, fmt):
    """``shards-budget``: a sharded general generation whose staging budget is half the state: the staged
    tail is in pinned memory, the live head is written from the device tensors while the loop waits."""
    import ripresa

    dev = torch.device(DEVICE)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, ripresa.TrainingState(model=model, optimizer=opt)

    def train_step(model, opt):
        x = torch.randn(64, 32, device=dev)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    model, opt, state = build()
    opts = {}
    if fmt == "shards-budget":
        half = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 // 2
        fmt, opts = "general", {"shard_threshold": 0, "shards": 2, "staging_budget": half}
    ck = ripresa.Checkpointer(tmp_path / "run", state, every=2, format=fmt, handle_signals=False, **opts)
    assert ck.writer is not None  # a background writer
    ck.resume()
    for step in (1, 2):
        train_step(model, opt)
        if step == 2:  # the state the step-2 generation must hold, whatever happens after the capture
            expect = {k: v.detach().clone() for k, v in model.state_dict().items()}
            expect_m = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
        ck.step_done(step)
    for _ in range(3):  # the live tensors change while the write may still be in flight
        train_step(model, opt)
    staging = ck.backend.staging.buffer if fmt == "general" else ck.writer.buffers.flat
    assert staging is not None and staging.device.type == "cpu"
    assert staging.is_pinned() == (dev.type == "cuda")
    ck.close()
    kind = ("shards" if opts else "safetensors") if fmt == "general" else "bin"
    assert (tmp_path / "run" / f"step_000002.{kind}").exists()

    model2, opt2, state2 = build()
    ck2 = ripresa.Checkpointer(tmp_path / "run", state2, every=0, format=fmt, handle_signals=False)
    assert ck2.resume() == 2
    ck2.close()
    for k, v in model2.state_dict().items():
        assert v.device.type == dev.type and torch.equal(v, expect[k]), k
    for p, m in zip(model2.parameters(), expect_m, strict=True):
        assert opt2.state[p]["exp_avg"].device.type == dev.type and torch.equal(opt2.state[p]["exp_avg"], m)


# ---------------------------------------------------------------------- CUDA random streams
def test_every_device_random_stream_is_restored_exactly_in_a_fresh_process(tmp_path):
    ref, run, neg = tmp_path / "ref", tmp_path / "run", tmp_path / "neg"
    _loop(ref, "--steps", 12, "--every", 4)
    _loop(run, "--steps", 6, "--every", 4)  # stops at 6 with a final save
    shutil.copytree(run, neg)
    for p in neg.glob("final.*"):
        p.unlink()
    _loop(run, "--steps", 12, "--every", 4)  # a fresh process resumes from 6
    _loop(neg, "--steps", 12, "--every", 4, "--no-rng")  # the same generation, random streams not restored
    a, b, c = _final(ref), _final(run), _final(neg)
    assert b["rng"] == a["rng"] and b["state"] == a["state"]
    assert c["rng"] != a["rng"] and c["state"] != a["state"]  # the negative path: the check can fail
    assert b["cuda_devices"] == (torch.cuda.device_count() if CUDA else 0)
    assert b["param_device"].startswith(DEVICE)
    assert _steps(run) == _steps(ref)


# ---------------------------------------------------------------------- fp16 + GradScaler, bf16: SIGKILL
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_a_mixed_precision_run_killed_and_restarted_ends_bitwise_equal(tmp_path, amp):
    ref, run = tmp_path / "ref", tmp_path / "run"
    fmt = ["--format", "general"]
    _loop(ref, "--steps", 16, "--every", 2, "--amp", amp, *fmt)
    argv = [sys.executable, "-B", str(LOOP), "--run", str(run), "--device", DEVICE, "--steps", "16", "--every", "2",
            "--amp", amp, *fmt]
    kill_at = random.randint(3, 13)  # SIGKILL at the end of a random step, a background save possibly in flight
    res = subprocess.run([*argv, "--kill-at", str(kill_at)], capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert max(_steps(run)) == kill_at and not (run / "final.rank0.json").exists()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == 0, res.stderr[-4000:]
    a, b = _final(ref), _final(run)
    assert b["state"] == a["state"] and b["rng"] == a["rng"]
    steps_ref, steps_run = _steps(ref), _steps(run)
    assert steps_run == steps_ref  # loss of every step, and for fp16 the scale, skipped, growth tracker
    if amp == "fp16":
        assert b["scaler"] == a["scaler"]
        skipped = [s for s, r in steps_ref.items() if r["skipped"]]
        assert skipped and skipped[0] == 1 and len(skipped) < 16  # backs off from 2^20, then trains
        assert steps_ref[16]["tracker"] > 0 and steps_ref[16]["scale"] < 2.0**20


# ---------------------------------------------------------------------- the memory tier (docs/TIERS.md)
@pytest.mark.parametrize("amp", ["fp32", "fp16"])
def test_the_memory_tier_copies_device_state_on_a_side_stream_and_a_killed_run_resumes_from_it(tmp_path, amp):
    """Pinned device-to-host copies on a side stream, overlapping the next step; a SIGKILL between disk
    generations; the restart resumes from the memory generation (at most one step redone) and ends bitwise."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = ["--steps", "16", "--every", "6", "--memory-every", "1", "--amp", amp, "--format", "general"]
    _loop(ref, *common)
    kill_at = random.randint(8, 11)  # at 7 memory may hold only 6, the disk step too
    argv = [sys.executable, "-B", str(LOOP), "--run", str(run), "--device", DEVICE, *common]
    res = subprocess.run([*argv, "--sync", "--kill-at", str(kill_at)], capture_output=True, text=True, timeout=600,
                         env=_env())
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == 0, res.stderr[-4000:]
    events = [json.loads(line) for line in (run / ".loss.jsonl").read_text().splitlines() if '"memory_resume"' in line]
    assert len(events) == 1 and events[0]["newest_disk"] == 6 and kill_at - 1 <= events[0]["step"] <= kill_at, events
    a, b = _final(ref), _final(run)
    assert b["state"] == a["state"] and b["rng"] == a["rng"]
    assert _steps(run) == _steps(ref)


# ---------------------------------------------------------------------- ripresa verify, steered
def test_a_steered_verify_on_the_device_passes_at_tolerance_zero(tmp_path):
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--steer", "--steps", "8", "--cut", "4", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-B", str(LOOP), "--run", tmp_path / "never", "--steps", "2000",
                      "--device", DEVICE, "--amp", "fp16", "--format", "general", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads((out / "verification.json").read_text())
    assert r["all_checks_passed"] and r["mode"] == "steered"
    neg = {c["name"]: c for c in r["checks"]["resume-without-rng"]}
    assert not neg["loss"]["passed"]  # without the device's stream the batches differ
    assert not (tmp_path / "never").exists()


# ---------------------------------------------------------------------- two processes, NCCL
@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="a 2-process NCCL run needs two CUDA devices")
def test_a_two_process_nccl_run_killed_and_restarted_ends_bitwise_equal(tmp_path):
    def torchrun(run: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "ripresa.torchrun", "--standalone", "--nproc_per_node=2", str(LOOP),
                "--run", str(run), "--device", DEVICE, "--steps", "12", "--every", "2", *extra]

    ref, run = tmp_path / "ref", tmp_path / "run"
    res = subprocess.run(torchrun(ref), capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == 0, res.stderr[-4000:]
    kill_at = random.randint(3, 11)  # rank 0 SIGKILLs the launcher and both ranks at the end of this step
    res = subprocess.run(torchrun(run, "--kill-at", str(kill_at)), capture_output=True, text=True, timeout=600,
                         env=_env(), start_new_session=True)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert max(_steps(run)) == kill_at and not (run / "final.rank0.json").exists()
    res = subprocess.run(torchrun(run), capture_output=True, text=True, timeout=600, env=_env())
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 1):
        assert _final(run, rank)["state"] == _final(ref, rank)["state"]
        assert _final(run, rank)["rng"] == _final(ref, rank)["rng"]
    assert _steps(run) == _steps(ref)
