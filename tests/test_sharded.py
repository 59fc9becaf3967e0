"""Sharded (FSDP2) runs as first-class runs: asynchronous saves, kills, stops, resumes, operations (docs/SHARDED.md).

Real ``torchrun`` process groups (gloo, 2 CPU processes) around a user's own
FSDP2 loop (``tests/fixtures/fsdp_loop.py``). A launch costs ~10 s on this
2-core machine: one quick sample runs in the default tier, the rest is slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import finish, ranks_of
from support.helpers import valid_dcp_steps
from support.ripresa_faults import fault_env

from ripresa.formats import dcp as dcp_fmt
from ripresa.store.history import read_history

LOOP = Path(__file__).resolve().parent / "fixtures" / "fsdp_loop.py"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def launch(run: Path, *args, env=None, extra=()) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=2 [extra] fsdp_loop.py --run RUN ARGS`` as a Popen."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *extra, "--",
           str(LOOP), "--run", str(run), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV, **(env or {})}, start_new_session=True)


def one(run: Path, *args) -> subprocess.CompletedProcess:
    """The same loop in one process (no process group, no sharding)."""
    return subprocess.run([sys.executable, str(LOOP), "--run", str(run), *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **ENV}, timeout=300)


def ok(proc: subprocess.Popen) -> str:
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    return out


def same_shards(a: Path, b: Path) -> None:
    """Two .dcp generations hold the same bytes in every shard file (``.metadata`` holds a random save id)."""
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".distcp")
    assert names == sorted(p.name for p in b.iterdir() if p.suffix == ".distcp") and len(names) == 2
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def losses(run: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_history(run / ".loss.jsonl").steps.items()}


def test_async_sharded_saves_commit_every_ranks_shards(tmp_path):
    """2 ranks, FSDP2, asynchronous saves: every cadence commits a .dcp (deep-valid, every rank's shard listed in
    the marker), recorded once each in the history."""
    run = tmp_path / "run"
    out = ok(launch(run, "--steps", 8, "--every", 4))
    assert valid_dcp_steps(run, deep=True) == [4, 8]
    assert (run / "step_000008.dcp.sha256").read_text().count("step_000008.dcp/") == 4  # .metadata, 2 shards, companion
    view = read_history(run / ".loss.jsonl")
    assert [(e["step"], e["reason"]) for e in view.events if e["event"] == "checkpoint"] == [(4, "cadence"), (8, "cadence")]
    assert sorted(view.steps) == list(range(1, 9)) and "stalls [" in out


@pytest.mark.slow
def test_one_process_resumes_the_newest_dcp_2_to_1_then_back_to_2(tmp_path):
    """The same loop in ONE process resumes the newest .dcp of a 2-rank run (2 → 1: it is the newest valid
    generation), records the world-size change and writes its own kind beside it (its retention never deletes a
    .dcp); then 2 ranks resume that single-process generation (general .safetensors, the default format; 1 → 2)
    and write .dcp generations again."""
    run = tmp_path / "run"
    ok(launch(run, "--steps", 8, "--every", 4))
    res = one(run, "--steps", 10, "--every", 5)
    assert res.returncode == 0, res.stderr[-3000:]
    events = read_history(run / ".loss.jsonl").events
    resume = [e for e in events if e["event"] == "resume"]
    assert resume[-1]["from_step"] == 8 and resume[-1]["file"].endswith("step_000008.dcp")
    change = [e for e in events if e["event"] == "world_size_change"]
    assert change[-1]["saved_world_size"] == 2 and change[-1]["world_size"] == 1
    assert valid_dcp_steps(run, deep=True) == [4, 8]
    assert (run / "step_000010.safetensors.sha256").exists()  # format="auto" in one process: the general format
    ok(launch(run, "--steps", 12, "--every", 4))
    events = read_history(run / ".loss.jsonl").events
    resume = [e for e in events if e["event"] == "resume"][-1]
    assert resume["from_step"] == 10 and resume["file"].endswith("step_000010.safetensors")  # not ignored by FSDP2
    assert not [e for e in events if e["event"] == "ignored_generations"]
    assert [e for e in events if e["event"] == "world_size_change"][-1]["world_size"] == 2
    assert valid_dcp_steps(run, deep=True) == [4, 8, 12] and sorted(read_history(run / ".loss.jsonl").steps) == list(range(1, 13))


@pytest.mark.slow
def test_rank_killed_mid_async_save_leaves_the_previous_generation_then_resume_is_bitwise(tmp_path):
    """Rank 1 SIGKILLed inside the background write of step 8 (its shards written, before DCP gathers every rank's
    result): nothing commits, step 4 stays the newest valid generation. Relaunched, the run resumes from 4 and ends
    bitwise equal (every shard's bytes, every loss) to an uninterrupted run."""
    ref = launch(tmp_path / "ref", "--steps", 12, "--every", 4)
    run = tmp_path / "run"
    killed = launch(run, "--steps", 12, "--every", 4, env=fault_env(dist_fault="shards_written:1:8"))
    out, err = finish(killed)
    assert killed.returncode != 0
    assert valid_dcp_steps(run, deep=True) == [4]
    assert not (run / "step_000008.dcp.sha256").exists()
    ok(launch(run, "--steps", 12, "--every", 4))
    ok(ref)
    resumes = [e for e in read_history(run / ".loss.jsonl").events if e["event"] == "resume"]
    assert [r["from_step"] for r in resumes] == [4]
    assert valid_dcp_steps(run, deep=True) == [4, 8, 12] and not [p for p in run.iterdir() if p.name.endswith(".partial")]
    same_shards(tmp_path / "ref" / "step_000012.dcp", run / "step_000012.dcp")
    assert losses(tmp_path / "ref") == losses(run)


@pytest.mark.slow
def test_sigterm_to_one_rank_writes_a_final_sharded_generation_and_the_resume_is_bitwise(tmp_path):
    """SIGTERM to rank 1 only: every rank saves the same step (asynchronously, then waited for), all exit 0;
    the resumed run ends bitwise equal to an uninterrupted one."""
    total = 40
    ref = launch(tmp_path / "ref", "--steps", total, "--every", 1000, "--step-ms", 30)
    run = tmp_path / "run"
    proc = launch(run, "--steps", total, "--every", 1000, "--step-ms", 30)
    try:
        t0 = time.time()
        while time.time() - t0 < 120:
            h = run / ".loss.jsonl"
            if h.exists() and len(read_history(h).steps) >= 5:
                break
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        os.kill(ranks_of(proc.pid)[1], signal.SIGTERM)
        ok(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    view = read_history(run / ".loss.jsonl")
    stop = max(view.steps)
    assert stop < total and valid_dcp_steps(run, deep=True) == [stop]
    sig = [e for e in view.events if e["event"] == "signal"]
    assert sig[-1]["action"] == "stop" and sig[-1]["ranks_stop"] == [1] and sig[-1]["step"] == stop
    assert [e["reason"] for e in view.events if e["event"] == "checkpoint"] == ["stop"]
    ok(launch(run, "--steps", total, "--every", 1000, "--step-ms", 30))
    ok(ref)
    same_shards(tmp_path / "ref" / f"step_{total:06d}.dcp", run / f"step_{total:06d}.dcp")
    assert losses(tmp_path / "ref") == losses(run)
    doc = json.loads((run / f"step_{total:06d}.dcp" / "ripresa.json").read_text())
    assert doc["world_size"] == 2


# ---------------------------------------------------------------------------------- operations on a sharded run


def _dcp_of_toy(folder: Path, step: int) -> Path:
    """A real .dcp generation of a toy model and AdamW, committed as a 1-rank FSDP2 session commits it."""
    import torch

    from ripresa.core.state import Progress, TrainingState
    from ripresa.store.backend import DcpBackend
    from ripresa.store.store import CheckpointStore

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = TrainingState(model=model, optimizer=opt, config={"toy": True})
    folder.mkdir(parents=True, exist_ok=True)
    with CheckpointStore(folder) as store:
        dcp_fmt.save_shards(model, opt, dcp_fmt.partial_path(folder, step), no_dist=True)
        DcpBackend(store).capture(step, state, Progress(step=step), None)()
    return folder / dcp_fmt.dcp_name(step)


@pytest.mark.slow
def test_inspect_a_dcp_generation_deeply_and_a_flipped_shard_byte_fails(tmp_path):
    from ripresa.tools.inspect import inspect_path

    d = _dcp_of_toy(tmp_path / "run", 3)
    rep = inspect_path(d)
    assert rep["exit_code"] == 0, rep["problems"]
    assert rep["kind"] == "dcp" and rep["dcp"]["valid"] and rep["dcp"]["world_size"] == 1
    assert [c["name"] for c in rep["dcp"]["checks"]][-3:] == ["file sha256", "companion state", "metadata"]
    assert {t["key"] for t in rep["dcp"]["tensors"]} >= {"model.weight", "model.bias"}
    shard = d / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    rep = inspect_path(d)
    assert rep["exit_code"] == 1 and "sha256 mismatch" in rep["problems"][0]
    res = subprocess.run([sys.executable, "-m", "ripresa", "inspect", str(d)], capture_output=True, text=True,
                         timeout=120)  # the command: exit 1, no traceback
    assert res.returncode == 1 and "Traceback" not in res.stderr + res.stdout and "sha256 mismatch" in res.stdout


def _text(tmp_path: Path) -> Path:
    import inspect as pyinspect

    p = tmp_path / "text.txt"
    p.write_text((pyinspect.getsource(json.decoder) + pyinspect.getsource(json.encoder)) * 2)
    (tmp_path / "more.txt").write_text(pyinspect.getsource(json.scanner) * 8)
    return p


def _train_args(text: Path) -> list[str]:
    return ["--config", "tiny", "--quiet", "--threads", "1", "--no-audit", "--set", "train.batch_size=4",
            "--set", f'data.sources=["code={text}", "more={text.parent / "more.txt"}"]']


def _torchrun_train(*args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "--",
           "ripresa", "train", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV}, start_new_session=True)


def _ripresa(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ripresa", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=timeout)


@pytest.mark.slow
def test_fork_pivot_export_inspect_of_a_sharded_run_and_resumes_on_another_world_size(tmp_path):
    """`ripresa train --shard fsdp` on 2 ranks, then as a new user would: inspect (folder and generation), fork
    (a .dcp copied, hash-verified) resumed in ONE process (2 → 1), export (consolidated, verified; --inference:
    safetensors equal to the gathered weights) resumed on 2 ranks, pivot resumed on 2 ranks (the command it
    prints), and a single-process run's fork resumed on 2 ranks (1 → 2)."""
    from ripresa.engine.gpt.factory import GPT_FACTORY
    from ripresa.tools.convert import compare, load

    text = _text(tmp_path)
    common = _train_args(text)
    run = tmp_path / "run"
    single = tmp_path / "single"
    proc_single = subprocess.Popen([sys.executable, "-m", "ripresa", "train", "--run", str(single), "--steps", "4",
                                    "--every", "4", *common], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={**os.environ, **ENV})
    ok(_torchrun_train("--run", run, "--shard", "fsdp", "--every", "4", "--steps", "8", *common))
    assert valid_dcp_steps(run, deep=True) == [4, 8]
    ok(proc_single)

    res = _ripresa("inspect", "--json", run)
    assert res.returncode == 0, res.stdout[-2000:]
    res = _ripresa("inspect", run / "step_000008.dcp")
    assert res.returncode == 0 and "metadata" in res.stdout and "world size 2" in res.stdout, res.stdout[-2000:]

    # fork of the .dcp at step 4, resumed in one process (2 -> 1)
    fork = tmp_path / "fork"
    res = _ripresa("fork", run, "--step", "4", "--into", fork)
    assert res.returncode == 0, res.stderr
    assert "--nproc_per_node=2" in res.stdout and dcp_fmt.check_dcp(fork, 4, deep=True).valid
    lineage = json.loads((fork / "lineage.json").read_text())
    assert lineage["files_sha256"] == dcp_fmt.check_dcp(run, 4).files
    res = _ripresa("train", "--run", fork, "--steps", "6", "--every", "2", *common)  # the end step: 4 + 2
    assert res.returncode == 0, res.stderr[-3000:]
    events = read_history(fork / ".loss.jsonl").events
    assert [e for e in events if e["event"] == "resume"][-1]["from_step"] == 4
    assert [e for e in events if e["event"] == "world_size_change"][-1]["world_size"] == 1

    # export: consolidated, verified; resumed on 2 ranks from its .bin; inference weights = gathered weights
    res = _ripresa("export", run, "--to", tmp_path / "bundle")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "consolidated from the sharded generation step_000008.dcp" in res.stdout
    bundle_bin = tmp_path / "bundle" / "checkpoint" / "step_000008.bin"
    assert compare(load(run / "step_000008.dcp", model_factory=GPT_FACTORY), load(bundle_bin, model_factory=GPT_FACTORY),
                   "moments") == []
    assert _ripresa("export", "--verify", tmp_path / "bundle").returncode == 0
    res = _ripresa("export", run, "--to", tmp_path / "weights", "--inference")
    assert res.returncode == 0, res.stderr[-3000:]
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "weights" / "model.safetensors"))
    full = load(run / "step_000008.dcp", model_factory=GPT_FACTORY).model.state_dict()
    assert all(weights[k].equal(v) for k, v in full.items() if k in weights) and len(weights) > 0
    two = _torchrun_train("--output", tmp_path / "two", "--shard", "fsdp", "--resume", bundle_bin, "--steps", "0", *common)
    ok(two)
    assert compare(load(bundle_bin, model_factory=GPT_FACTORY),
                   load(tmp_path / "two" / "step_000008.dcp", model_factory=GPT_FACTORY), "moments") == []

    # pivot: the newest valid generation is the .dcp; the printed command resumes it on 2 ranks
    res = _ripresa("pivot", run, "--caps", "code=0.7")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "pivot at step 8" in res.stdout and "ripresa.torchrun" in res.stdout and "--shard fsdp" in res.stdout
    assert json.loads((run / "config.json").read_text())["mixture"]["phase"] == 1
    ok(_torchrun_train("--run", run, "--shard", "fsdp", "--every", "4", "--steps", "12", "--quiet", "--threads", "1",
                       "--no-audit"))  # the run's own config.json: the new policy
    events = read_history(run / ".loss.jsonl").events
    assert [e for e in events if e["event"] == "resume"][-1]["from_step"] == 8 and valid_dcp_steps(run, deep=True) == [4, 8, 12]
    assert json.loads((run / "config.json").read_text())["mixture"]["caps"] == {"code": 0.7}

    # 1 -> 2: a single-process run's generation forked, then resumed on 2 ranks (FSDP2)
    sfork = tmp_path / "sfork"
    assert _ripresa("fork", single, "--step", "4", "--into", sfork).returncode == 0
    ok(_torchrun_train("--run", sfork, "--shard", "fsdp", "--every", "2", "--steps", "6", *common))  # end step
    events = read_history(sfork / ".loss.jsonl").events
    assert [e for e in events if e["event"] == "world_size_change"][-1]["world_size"] == 2
    assert valid_dcp_steps(sfork, deep=True) == [6]


@pytest.mark.slow
def test_fork_refuses_a_tampered_dcp_before_writing_anything(tmp_path):
    """A shard byte flipped after the commit: the deep check refuses it (exit 1 error), the fork folder is never made."""
    from ripresa.engine.fork import fork
    from ripresa.errors import IntegrityError

    d = _dcp_of_toy(tmp_path / "run", 3)
    shard = d / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-20] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="not valid") as info:
        fork(tmp_path / "run", 3, tmp_path / "fork")
    assert info.value.exit_code == 1 and not (tmp_path / "fork").exists()
