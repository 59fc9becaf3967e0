"""Issue 29, the ANDREA engine: precision and CPU threads recorded and compared, the memory of a step
(`ripresa advise`), a typo'd --source on a new run, one line when there is nothing to train, the resumed line,
the demo's progress. Through the real CLI (docs/ENGINE.md, docs/CADENCE.md, "Memory for a step")."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, ripresa_cli, ripresa_train_proc, wait_for_step

from ripresa.engine.gpt.memory import activation_bytes, size_step, step_need
from ripresa.engine.gpt.model import CONFIGS, GPT, GPTConfig

#: The cheap tiny run of these tests (4 crops a step, no audit).
FAST = ["--quiet", "--no-audit", "--set", "train.batch_size=4"]


@pytest.fixture(scope="module")
def begun(tmp_path_factory) -> Path:
    """A tiny run of 2 steps begun with torch's default thread count and the default precision."""
    run = tmp_path_factory.mktemp("round3") / "run"
    res = ripresa_cli("train", "--run", run, "--steps", "2", "--every", "2", *FAST)
    assert res.returncode == 0, res.stderr
    return run


@pytest.fixture
def run_copy(begun, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(begun, run, ignore=shutil.ignore_patterns("LOCK"))
    return run


def _train_cfg(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())["train"]


# ------------------------------------------------------------------ precision and threads (1, 5)


def test_precision_and_threads_are_recorded_in_the_config(begun):
    t = _train_cfg(begun)
    assert t["precision"] == "fp32"  # auto on the CPU
    assert isinstance(t["threads"], int) and t["threads"] >= 1


def test_a_changed_precision_or_thread_count_on_resume_is_refused_naming_each_key(run_copy):
    """Begun with the default threads and precision, resumed with --threads 1 (2 where the default is 1) and
    --precision fp16: refused (exit 2) like any config change, each key named, and the ways on."""
    recorded = _train_cfg(run_copy)["threads"]
    other = 1 if recorded != 1 else 2
    res = ripresa_cli("train", "--run", run_copy, "--steps", "3", "--threads", str(other), "--precision", "fp16", *FAST)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"train.threads ({recorded} -> {other})" in res.stderr
    assert "train.precision ('fp32' -> 'fp16')" in res.stderr
    assert f"--threads {recorded}" in res.stderr and "--allow-config-change" in res.stderr  # the ways on
    assert "Traceback" not in res.stderr and not (run_copy / "step_000003.bin").exists()


def test_a_resume_without_the_flags_takes_the_recorded_ones_and_says_where_it_resumed(run_copy):
    res = ripresa_cli("train", "--run", run_copy, "--steps", "3", *FAST)
    assert res.returncode == 0, res.stderr
    assert f"resumed {run_copy} at step 2 from {run_copy / 'step_000002.bin'}" in res.stdout
    assert (run_copy / "step_000003.bin").exists()


def _sigterm_then_resume(tmp_path: Path, precision: str, name: str, steps: int = 24) -> Path:
    run = tmp_path / name
    proc = ripresa_train_proc("--run", run, "--steps", str(steps), "--every", "1000", "--threads", "1",
                              "--precision", precision, *FAST)
    wait_for_step(run, 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    stopped = max(int(p.name[5:11]) for p in run.glob("step_*.bin"))
    assert stopped < steps
    res = ripresa_cli("train", "--run", run, "--steps", str(steps), "--every", "1000", *FAST)  # no flags: recorded
    assert res.returncode == 0, res.stderr
    assert f"at step {stopped} from" in res.stdout
    return run


@pytest.mark.slow
@pytest.mark.parametrize("precision", [
    "fp16",  # the GradScaler on the CPU (torch.autocast('cpu', float16)): its state saved and restored
    "fp32",
    "bf16",
])
def test_each_precision_resumes_bitwise_after_a_sigterm(tmp_path, precision):
    steps = 24
    whole = tmp_path / "whole"
    res = ripresa_cli("train", "--run", whole, "--steps", str(steps), "--every", "1000", "--threads", "1",
                      "--precision", precision, *FAST)
    assert res.returncode == 0, res.stderr
    cut = _sigterm_then_resume(tmp_path, precision, "cut", steps)
    final = f"step_{steps:06d}"
    assert (cut / f"{final}.bin").read_bytes() == (whole / f"{final}.bin").read_bytes()
    assert _train_cfg(cut)["precision"] == precision
    scaler = json.loads((cut / f"{final}.json").read_text())["state"]["scaler"]
    if precision == "fp16":  # the scaler's counter went on across the stop: restored, not a fresh one
        assert scaler["_growth_tracker"] == steps and scaler["scale"] == 65536.0
    else:
        assert scaler is None


@pytest.mark.slow
def test_the_thread_count_does_change_the_trajectory_here(tmp_path):
    """Why train.threads is compared: a whole-tensor sum splits across threads (docs/ENGINE.md)."""
    if os.cpu_count() is None or os.cpu_count() < 2:
        pytest.skip("one CPU: one thread count only")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = x.sum()
        torch.set_num_threads(1)
        one = x.sum()
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(one, two)
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        assert ripresa_cli("train", "--run", run, "--steps", "10", "--every", "5", "--threads", "2", *FAST).returncode == 0
    res = ripresa_cli("train", "--run", b, "--steps", "20", "--every", "5", "--threads", "1", "--allow-config-change",
                      *FAST)
    assert res.returncode == 0, res.stderr
    assert ripresa_cli("train", "--run", a, "--steps", "20", "--every", "5", *FAST).returncode == 0
    assert (a / "step_000020.bin").read_bytes() != (b / "step_000020.bin").read_bytes()


# ------------------------------------------------------------------ nothing to train (4)


def test_nothing_to_train_is_one_line_with_the_way_on(run_copy):
    res = ripresa_cli("train", "--run", run_copy, "--steps", "1", *FAST)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines == [f"run {run_copy} is already at step 2 (resumed from {run_copy / 'step_000002.bin'}): "
                     f"nothing to train to --steps 1; for more: ripresa train --run {run_copy} --steps 3"], res.stdout
    assert not (run_copy / "step_000003.bin").exists()


# ------------------------------------------------------------------ --source on a new run (6)


def test_a_source_that_does_not_exist_refuses_a_new_run(tmp_path):
    run = tmp_path / "new"
    res = ripresa_cli("train", "--run", run, "--steps", "1", "--source", f"mine={tmp_path / 'typo.txt'}", *FAST)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "data source 'mine' does not exist" in res.stderr
    for fact in ("file:", "expected:", "found:", "hint:"):
        assert fact in res.stderr
    assert "Traceback" not in res.stderr and not run.exists()


@pytest.mark.slow
def test_a_source_that_vanishes_from_a_resumed_run_is_still_a_zombie_arm(tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text("my own text, " * 400)
    run = tmp_path / "run"
    res = ripresa_cli("train", "--run", run, "--steps", "2", "--every", "2", "--source", f"mine={text}", *FAST)
    assert res.returncode == 0, res.stderr
    text.unlink()
    res = ripresa_cli("train", "--run", run, "--steps", "3", *FAST)
    assert res.returncode == 0, res.stderr
    assert "zombie arm" in res.stderr


# ------------------------------------------------------------------ memory for a step (2)


def _saved_bytes(cfg: GPTConfig, batch: int, dtype: torch.dtype | None) -> int:
    """The bytes of the tensors autograd keeps for the backward pass of one forward (unique storages)."""
    torch.manual_seed(0)
    model = GPT(cfg).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    x = torch.randint(0, 256, (batch, cfg.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            model(x, x)
    return sum(seen.values())


@pytest.mark.parametrize("precision,dtype", [("fp32", None), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_the_activation_estimate_is_what_autograd_keeps(one_thread, precision, dtype, dropout):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, dropout=dropout)
    measured = _saved_bytes(cfg, 8, dtype)
    est = activation_bytes(cfg, 8, precision, "cpu")
    assert abs(est - measured) <= 0.01 * measured, (est, measured)  # the documented factor: within 1 %


_RSS = """
import resource, sys, torch
from ripresa.engine.gpt.model import CONFIGS, GPT
torch.set_num_threads(1); torch.manual_seed(0)
cfg = CONFIGS["tiny"]; model = GPT(cfg).train()
def step(b):
    x = torch.randint(0, 256, (b, cfg.block_size)); _, loss = model(x, x); loss.backward()
    model.zero_grad(set_to_none=True)
step(1)  # the allocator's and the kernels' one-time set-up, before the measurement
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
step(int(sys.argv[1]))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) * 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("batch", [16, 64])
def test_the_step_estimate_against_the_peak_rss_of_a_real_forward_and_backward(batch):
    res = subprocess.run([sys.executable, "-c", _RSS, str(batch)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    measured = int(res.stdout.split()[-1])
    need = step_need(CONFIGS["tiny"], batch, "fp32", "cpu")
    est = need["activations"] + need["gradients"] + need["working"]
    assert 0.7 * measured <= est <= 1.5 * measured, (est, measured)  # docs/CADENCE.md: within 1.5x


def _tiny_cfg(batch: int) -> dict:
    from ripresa.engine.gpt.config import resolve_config

    return resolve_config("tiny", [f"train.batch_size={batch}"], None)


def test_the_verdict_and_what_to_change():
    gib = 1 << 30
    plenty = {"device": None, "host": {"available": 8 * gib, "total": 16 * gib}, "shm": {"available": gib, "total": gib}}
    r = size_step(_tiny_cfg(16), precision="fp32", device="cpu", measured=plenty)
    assert r["verdict"] == "fits" and r["change"] is None
    need = r["places"]["host"]
    tight = {**plenty, "host": {"available": int(need / 0.9), "total": 16 * gib}}
    assert size_step(_tiny_cfg(16), precision="fp32", device="cpu", measured=tight)["verdict"] == "tight"
    small = {**plenty, "host": {"available": need // 3, "total": 16 * gib}}
    r = size_step(_tiny_cfg(16), precision="fp32", device="cpu", measured=small)
    assert r["verdict"] == "does not fit"
    best = int(r["change"].split("train.batch_size=")[1].split()[0])
    assert 1 <= best < 16  # and that batch does fit, the next one does not
    assert size_step(_tiny_cfg(best), precision="fp32", device="cpu", measured=small)["verdict"] == "fits"
    assert size_step(_tiny_cfg(best + 1), precision="fp32", device="cpu", measured=small)["verdict"] != "fits"
    gpu = {**plenty, "device": {"available": need // 100, "total": gib}}
    r = size_step(_tiny_cfg(16), precision="bf16", device="cuda", measured=gpu)
    assert r["verdicts"]["device"] == "does not fit" and r["places"]["host"] == r["need"]["state"]


def test_advise_prints_the_memory_of_a_step_of_the_run(begun, capsys):
    from ripresa.cli import main  # the real CLI, in this process (no torch import to pay again)

    assert main(["advise", str(begun), "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory"]
    assert mem["precision"] == "fp32" and mem["device"] == "cpu" and mem["batch_size"] == 4
    assert mem["need"]["activations"] == activation_bytes(CONFIGS["tiny"], 4, "fp32", "cpu")
    assert mem["available"]["host"]["total"] > 0 and mem["verdict"] in ("fits", "tight", "does not fit")
    assert "--memory-every K" in mem["memory_tier"]["note"]
    assert mem["memory_tier"]["need"] == 2 * mem["need"]["state"] + 64 * 1024 * 1024  # two slots and the margin
    assert main(["advise", "--config", "andrea-120m", "--set", "train.batch_size=4096", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "verdict: does not fit" in out and "change: lower the batch: --set train.batch_size=" in out
    assert "memory tier (--memory-every K, off by default): 2 state copies" in out


# ------------------------------------------------------------------ the demo's progress (7)


@pytest.mark.slow
def test_the_demo_shows_progress_and_the_resume(tmp_path):
    """`ripresa demo` on a terminal: a progress line while the engine trains, and the resume's own line."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="400", PYTHONDONTWRITEBYTECODE="1")  # wide: no path folded over two lines
    proc = subprocess.Popen([sys.executable, "-m", "ripresa", "demo", "--output", str(tmp_path / "demo")],
                            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    out = b""
    deadline = time.time() + 600
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")[-3000:]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))  # rich's colours and cursor moves
    assert "training to step 150" in text and "steps" in text  # the progress line of the engine part
    assert "resumed, training to step" in text
    run = tmp_path / "demo" / "gpt"
    assert f"resumed {run} at step " in text and f" from {run}/step_" in text


# ------------------------------------------------------------------ a run's recorded values are input


@pytest.mark.parametrize("key,value", [
    ("precision", "fp8"), ("precision", 16), ("precision", ["fp16"]),
    ("threads", 0), ("threads", 10**9), ("threads", True), ("threads", "2"), ("threads", 1.5),
])
def test_a_hostile_recorded_precision_or_thread_count_is_a_typed_error(one_thread, key, value):
    from ripresa.engine.gpt.config import resolve_config
    from ripresa.engine.gpt.train import resolve_precision, resolve_threads
    from ripresa.errors import BadInput

    cfg = resolve_config("tiny", (), None)
    cfg["train"][key] = value
    where = Path("run/config.json")
    with pytest.raises(BadInput) as err:
        (resolve_precision if key == "precision" else resolve_threads)(None, cfg, None, torch.device("cpu"), where)
    assert err.value.file == str(where) and f"train.{key}" in err.value.message
    assert torch.get_num_threads() == 1  # nothing was set from it


@pytest.mark.slow
def test_a_run_that_predates_the_recorded_keys_resumes_and_records_them(run_copy):
    cfg = json.loads((run_copy / "config.json").read_text())
    del cfg["train"]["precision"], cfg["train"]["threads"]
    (run_copy / "config.json").write_text(json.dumps(cfg, indent=2))
    res = ripresa_cli("train", "--run", run_copy, "--steps", "3", *FAST)
    assert res.returncode == 0, res.stderr
    assert _train_cfg(run_copy)["precision"] == "fp32" and isinstance(_train_cfg(run_copy)["threads"], int)
