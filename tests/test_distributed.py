"""Distributed runs: real `torchrun` process groups (gloo, 2 CPU processes), plus the pure parts.

Each torchrun launch costs ~10 s on a busy 2-core machine (torch imports in
the launcher and in each rank), so the launches are few and each one checks
several things.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import finish, ranks_of, valid_steps
from support.helpers import valid_dcp_steps
from support.ripresa_faults import fault_env

from ripresa.core.data import DistributedEpochSampler
from ripresa.engine.gpt.factory import GPT_FACTORY
from ripresa.formats import dcp as dcp_fmt
from ripresa.formats.andrea_bin import read_bin
from ripresa.formats.generation import Generation
from ripresa.session.distributed import DistContext, NullHistory, rank_generator, rank_seed
from ripresa.store import dcp as store_dcp
from ripresa.store.backend import latest_valid_any
from ripresa.store.history import read_history
from ripresa.store.store import CheckpointStore, CheckpointWarning
from ripresa.tools.convert import compare, load

ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """A small data source (60 KB of Python), so that no rank spends seconds building the stdlib sources."""
    p = tmp_path_factory.mktemp("data") / "text.txt"
    p.write_text((inspect.getsource(json.decoder) + inspect.getsource(json.encoder)) * 2)
    return p


def common(text: Path) -> list[str]:
    return ["--config", "tiny", "--quiet", "--threads", "1", "--no-audit", "--set", "train.batch_size=4",
            "--set", f'data.sources=["text={text}"]']


def torchrun(*args, nproc: int = 2, launcher: tuple[str, ...] = ("-m", "torch.distributed.run"), extra=(), env=None):
    """``torchrun --standalone --nproc_per_node=N [extra] -m -- ripresa train ARGS`` as a Popen."""
    cmd = [sys.executable, *launcher, "--standalone", f"--nproc_per_node={nproc}", *extra,
           "-m", "--", "ripresa", "train", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV, **(env or {})}, start_new_session=True)


def single(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ripresa", "train", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=300)


def wait_history(run: Path, proc: subprocess.Popen, cond, timeout: float = 120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"torchrun exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        h = run / ".loss.jsonl"
        if h.exists():
            view = read_history(h)
            if cond(view):
                return view
        time.sleep(0.05)
    raise AssertionError("timeout waiting for the history")


def valid_bins(run: Path) -> list[int]:
    return [g.step for g in CheckpointStore(run, writer=False).generations() if g.valid]


def same_moments(a: Path, b: Path) -> list[str]:
    """Differences of weights, m, v (and step) between two checkpoints of any kind."""
    return compare(load(a, model_factory=GPT_FACTORY), load(b, model_factory=GPT_FACTORY), "moments")


# ---------------------------------------------------------------------------------- DDP


@pytest.mark.slow
def test_ddp_signals_to_one_rank_then_exact_resume_and_2_to_1(tmp_path, text):
    """SIGUSR1 to rank 1: both ranks save the same step and continue; SIGTERM to rank 1: both save and exit 0;
    resuming that generation on 2 ranks reaches bit-identical parameters to an uninterrupted 2-rank run;
    resuming it in one process restores weights, m and v exactly (2 → 1) and records the world-size change."""
    total = 160
    ref = torchrun("--output", tmp_path / "ref", "--steps", total, *common(text))  # uninterrupted, concurrently
    run = tmp_path / "run"
    proc = torchrun("--run", run, "--every", "1000", *common(text))
    try:
        wait_history(run, proc, lambda v: v.steps and max(v.steps) >= 3)
        pids = ranks_of(proc.pid)
        assert set(pids) == {0, 1}
        os.kill(pids[1], signal.SIGUSR1)  # one rank only
        t0 = time.time()
        while not valid_bins(run) and time.time() - t0 < 60:
            time.sleep(0.05)
        first = valid_bins(run)
        assert len(first) == 1
        wait_history(run, proc, lambda v: max(v.steps) >= first[0] + 3)  # both ranks went on
        os.kill(pids[1], signal.SIGTERM)
        out, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by signal" in out
    view = read_history(run / ".loss.jsonl")
    stop = max(view.steps)
    assert stop < total and valid_bins(run) == [first[0], stop]
    sig = [e for e in view.events if e["event"] == "signal"]
    assert sig[0]["action"] == "checkpoint" and sig[0]["ranks_checkpoint"] == [1] and sig[0]["step"] == first[0]
    assert sig[-1]["action"] == "stop" and sig[-1]["ranks_stop"] == [1] and sig[-1]["step"] == stop
    comp = json.loads((run / f"step_{stop:06d}.json").read_text())["state"]["extra"]["distributed"]
    assert comp["world_size"] == 2 and [r["rank"] for r in comp["ranks"]] == [0, 1]  # every rank's state, one step

    # Same world size: resume the SIGTERM generation and run to `total`.
    res = torchrun("--output", tmp_path / "res", "--resume", run / f"step_{stop:06d}.bin", "--steps", total - stop, *common(text))
    # 2 → 1 meanwhile: one process, no process group, zero steps, then the final save.
    one = single("--output", tmp_path / "one", "--resume", run / f"step_{stop:06d}.bin", "--steps", "0", *common(text))
    out, err = finish(res)
    assert res.returncode == 0, err[-3000:]
    out, err = finish(ref)
    assert ref.returncode == 0, err[-3000:]
    a, b = read_bin(tmp_path / "ref" / f"step_{total:06d}.bin"), read_bin(tmp_path / "res" / f"step_{total:06d}.bin")
    assert np.array_equal(a.weights, b.weights) and np.array_equal(a.m, b.m) and np.array_equal(a.v, b.v)
    h_ref, h_res = read_history(tmp_path / "ref" / ".loss.jsonl"), read_history(tmp_path / "res" / ".loss.jsonl")
    losses = {**view.steps, **h_res.steps}
    assert [h_ref.steps[s]["loss"] for s in range(1, total + 1)] == [losses[s]["loss"] for s in range(1, total + 1)]

    assert one.returncode == 0, one.stderr
    assert same_moments(run / f"step_{stop:06d}.bin", tmp_path / "one" / f"step_{stop:06d}.bin") == []
    change = [e for e in read_history(tmp_path / "one" / ".loss.jsonl").events if e["event"] == "world_size_change"]
    assert change and change[0]["saved_world_size"] == 2 and change[0]["world_size"] == 1 and change[0]["dropped_ranks"] == [1]


# ---------------------------------------------------------------------------------- FSDP2


@pytest.mark.slow
def test_fsdp_rank_killed_mid_save_keeps_previous_then_restart_resumes_and_reshards(tmp_path, text):
    """FSDP2 with --max-restarts=1: rank 1 dies after writing its shards of step 8 (asynchronous save), before DCP gathers every rank's result.
    No marker is written, so step 4 stays the newest valid generation; the restarted group resumes from it,
    cleans the partial folder and finishes. Then 2 → 1 (.dcp into one process) and 1 → 2 (.bin into FSDP2)
    restore weights, m and v exactly."""
    run = tmp_path / "run"
    proc = torchrun("--run", run, "--shard", "fsdp", "--every", "4", "--set", "train.max_steps=12", *common(text),
                    extra=("--max-restarts=1",), env=fault_env(dist_fault="shards_written:1:8"))
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert valid_dcp_steps(run) == [4, 8, 12] and valid_bins(run) == []
    assert not [p for p in run.iterdir() if p.name.endswith(".partial")]
    assert (run / "step_000012.dcp.sha256").read_text().count("step_000012.dcp/") == 4  # .metadata, 2 shards, ripresa.json
    view = read_history(run / ".loss.jsonl")
    resumes = [e for e in view.events if e["event"] == "resume"]
    assert [r["from_step"] for r in resumes] == [4]  # the save of step 8 never counted
    ck = [e["step"] for e in view.events if e["event"] == "checkpoint"]
    assert ck == [4, 8, 12]  # 8 once: only the committed one is logged
    assert sorted(view.steps) == list(range(1, 13))
    doc = dcp_fmt.read_dcp_companion(run / "step_000012.dcp")
    assert doc["world_size"] == 2 and len(doc["state"]["extra"]["distributed"]["ranks"]) == 2

    # 2 → 1: the .dcp of 2 ranks into a single process (which writes a .bin).
    one = single("--output", tmp_path / "one", "--resume", run / "step_000012.dcp", "--steps", "0", *common(text))
    assert one.returncode == 0, one.stderr
    assert same_moments(run / "step_000012.dcp", tmp_path / "one" / "step_000012.bin") == []
    # 1 → 2: that single-process .bin into FSDP2 on 2 ranks (which write a .dcp).
    two = torchrun("--output", tmp_path / "two", "--shard", "fsdp", "--resume", tmp_path / "one" / "step_000012.bin",
                   "--steps", "0", *common(text))
    out, err = finish(two)
    assert two.returncode == 0, err[-3000:]
    assert same_moments(tmp_path / "one" / "step_000012.bin", tmp_path / "two" / "step_000012.dcp") == []
    change = [e for e in read_history(tmp_path / "two" / ".loss.jsonl").events if e["event"] == "world_size_change"]
    assert change[0]["saved_world_size"] == 1 and change[0]["world_size"] == 2 and change[0]["fresh_stream_ranks"] == [1]


# ---------------------------------------------------------------------------------- slow: launcher, more matrices


@pytest.mark.slow
def test_ddp_1_to_2_and_rank_killed_before_handing_over(tmp_path, text):
    """DDP: a single-process generation resumed on 2 ranks (weights, m, v exact); then rank 1 killed as it
    hands over its state at step 6: rank 0 writes nothing, step 3 stays the newest valid generation."""
    assert single("--run", tmp_path / "one", "--steps", "5", "--every", "5", *common(text)).returncode == 0
    two = torchrun("--output", tmp_path / "two", "--resume", tmp_path / "one" / "step_000005.bin", "--steps", "0", *common(text))
    out, err = finish(two)
    assert two.returncode == 0, err[-3000:]
    assert same_moments(tmp_path / "one" / "step_000005.bin", tmp_path / "two" / "step_000005.bin") == []
    run = tmp_path / "run"
    proc = torchrun("--run", run, "--every", "3", "--steps", "9", *common(text), env=fault_env(dist_fault="before_gather:1:6"))
    out, err = finish(proc)
    assert proc.returncode != 0
    assert valid_bins(run) == [3]


@pytest.mark.slow
def test_ripresa_torchrun_forwards_sigusr1_and_sigterm_to_every_rank(tmp_path, text):
    """`python -m ripresa.torchrun`: SIGUSR1 to the launcher → all ranks save and continue; SIGTERM → all save,
    all exit 0, and so does the launcher."""
    run = tmp_path / "run"
    proc = torchrun("--run", run, "--every", "1000", *common(text), launcher=("-m", "ripresa.torchrun"))
    try:
        wait_history(run, proc, lambda v: v.steps and max(v.steps) >= 3)
        proc.send_signal(signal.SIGUSR1)
        t0 = time.time()
        while not valid_bins(run) and time.time() - t0 < 60:
            time.sleep(0.05)
        first = valid_bins(run)
        wait_history(run, proc, lambda v: max(v.steps) >= first[0] + 3)
        proc.send_signal(signal.SIGTERM)
        out, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    view = read_history(run / ".loss.jsonl")
    assert valid_bins(run) == [first[0], max(view.steps)]
    sig = [e for e in view.events if e["event"] == "signal"]
    assert sig[0]["ranks_checkpoint"] == [0, 1] and sig[-1]["ranks_stop"] == [0, 1]


@pytest.mark.slow
def test_fsdp_same_world_resume_is_bit_identical(tmp_path, text):
    ref = torchrun("--run", tmp_path / "ref", "--shard", "fsdp", "--every", "5", "--steps", "15", *common(text))
    assert finish(ref) and ref.returncode == 0
    for steps in (10, 15):  # --steps: the run's end step
        p = torchrun("--run", tmp_path / "run", "--shard", "fsdp", "--every", "5", "--steps", steps, *common(text))
        out, err = finish(p)
        assert p.returncode == 0, err[-3000:]
    a, b = tmp_path / "ref" / "step_000015.dcp", tmp_path / "run" / "step_000015.dcp"
    assert compare(load(a, model_factory=GPT_FACTORY), load(b, model_factory=GPT_FACTORY), "moments") == []
    for name in ("__0_0.distcp", "__1_0.distcp"):  # .metadata holds a random save id
        assert (a / name).read_bytes() == (b / name).read_bytes()


@pytest.mark.slow
def test_fsdp_signed_generations_save_resume_and_refuse_a_forged_newest(tmp_path, text):
    """An FSDP2 run under RIPRESA_REQUIRE_SIGNATURE signs every .dcp generation and resumes from
    them; a newest generation whose signature was removed is skipped for the older signed one."""
    key = {"RIPRESA_HMAC_KEY": "k" * 32, "RIPRESA_REQUIRE_SIGNATURE": "1"}
    run = tmp_path / "run"
    p = torchrun("--run", run, "--shard", "fsdp", "--every", "4", "--steps", "8", *common(text), env=key)
    out, err = finish(p)
    assert p.returncode == 0, err[-3000:]
    assert (run / "step_000004.dcp.hmac").is_file() and (run / "step_000008.dcp.hmac").is_file()
    (run / "step_000008.dcp.hmac").unlink()  # the newest is now unsigned: refused under the requirement
    p = torchrun("--run", run, "--shard", "fsdp", "--every", "4", "--steps", "8", *common(text), env=key)
    out, err = finish(p)
    assert p.returncode == 0, err[-3000:]
    resumes = [e for e in read_history(run / ".loss.jsonl").events if e.get("event") == "resume"]
    assert resumes and resumes[-1]["from_step"] == 4, resumes
    assert (run / "step_000008.dcp.hmac").is_file()  # step 8 saved again, signed
    assert dcp_fmt.check_dcp(run, 8, deep=True, require_signature=True, hmac_key=b"k" * 32).valid


# ---------------------------------------------------------------------------------- no processes


def test_single_process_is_not_distributed():
    import torch

    assert DistContext.detect(torch.nn.Linear(2, 2)) is None
    h = NullHistory()
    h.step(1, loss=1.0)
    h.event("x")
    h.sync()
    h.close()


def test_rank_streams_rank_0_is_the_single_process_stream():
    a = np.random.Generator(np.random.PCG64(1337)).integers(0, 10**9, 8)
    assert np.array_equal(rank_generator(1337, 0).integers(0, 10**9, 8), a)
    b = rank_generator(1337, 1).integers(0, 10**9, 8)
    assert not np.array_equal(a, b)
    assert rank_seed(5, 0) == 5 and rank_seed(5, 1) != rank_seed(5, 2) != 5


@pytest.mark.parametrize("world,cut,new_world", [(2, 3, 2), (2, 3, 1), (3, 2, 2), (1, 4, 2)])
def test_distributed_epoch_sampler_no_overlap_no_gap_resume_and_reshard(world, cut, new_world):
    n = 61
    ranks = [DistributedEpochSampler(n, 4, rank=r, world_size=world, seed=11) for r in range(world)]
    seen: list[int] = []
    for _ in range(cut):
        batches = [s.next_batch() for s in ranks]
        assert all(not set(x) & set(y) for i, x in enumerate(batches) for y in batches[i + 1:])
        seen += sum(batches, [])
    state = ranks[0].state_dict()
    assert all(s.state_dict()["cursor"] == state["cursor"] for s in ranks)  # the position is global
    resumed = [DistributedEpochSampler(n, 4, rank=r, world_size=new_world, seed=999) for r in range(new_world)]
    for s in resumed:
        s.load_state_dict(state)
        assert s.resharded_from == (world if world != new_world else None)
    while len(seen) < n:
        seen += sum((s.next_batch() for s in resumed), [])
    assert sorted(seen) == list(range(n))  # every row of the epoch exactly once, across the resume
    # The next epoch's permutation is the one the unresumed run draws.
    ref = DistributedEpochSampler(n, 4, rank=0, world_size=1, seed=11)
    rows = []
    while len(rows) < 2 * n:
        rows += ref.next_batch()
    nxt = sum((s.next_batch() for s in resumed), [])
    assert len(nxt) == 4 * new_world and sorted(nxt) == sorted(rows[n:n + len(nxt)])


def test_distributed_epoch_sampler_refuses_other_batch_or_plain_state():
    from ripresa import EpochSampler
    from ripresa.errors import SchemaError

    s = DistributedEpochSampler(20, 2, rank=0, world_size=2, seed=1)
    s.next_batch()
    with pytest.raises(SchemaError):
        DistributedEpochSampler(20, 3, rank=0, world_size=2, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(SchemaError):
        s.load_state_dict(EpochSampler(20, 4, seed=1).state_dict())
    with pytest.raises(ValueError):
        DistributedEpochSampler(20, 2, rank=2, world_size=2)


def _fake_dcp(folder: Path, step: int) -> Generation:
    """A real (tiny) DCP save committed as generation ``step`` (a deep check reads its .metadata)."""
    part = dcp_fmt.partial_path(folder, step)
    dcp_fmt.save_shards(torch.nn.Linear(1, 3, bias=False), None, part, no_dist=True)
    return store_dcp.commit_dcp(folder, step, part, world_size=1, n_params=3, state={"progress": {"step": step}})


def test_dcp_generations_validate_and_fall_back(tmp_path):
    for s in (2, 4, 6):
        assert _fake_dcp(tmp_path, s).valid
    assert [g.step for g in dcp_fmt.dcp_generations(tmp_path) if g.valid] == [2, 4, 6]
    res = subprocess.run(["sha256sum", "-c", "step_000006.dcp.sha256"], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout
    shard = tmp_path / "step_000006.dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-5] + b"xxxxx")  # same size, new bytes
    assert dcp_fmt.check_dcp(tmp_path, 6).valid and not dcp_fmt.check_dcp(tmp_path, 6, deep=True).valid
    (tmp_path / "step_000004.dcp.sha256").unlink()  # never committed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = latest_valid_any(tmp_path, deep=True)
    assert gen.step == 2 and gen.kind == "dcp"
    msgs = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert "6" in msgs[0] and "sha256 mismatch" in msgs[0] and "missing commit marker" in msgs[1]
    (tmp_path / ".step_000008.dcp.partial").mkdir()
    assert store_dcp.clean_partials(tmp_path) and not (tmp_path / ".step_000008.dcp.partial").exists()
    store_dcp.delete_dcp(tmp_path, 2)
    assert dcp_fmt.dcp_steps_on_disk(tmp_path) == [4, 6]


# ---------------------------------------------------------------------------------- a user's own loop

LOOP = Path(__file__).resolve().parent / "fixtures" / "dist_loop.py"


def test_checkpointer_in_a_users_ddp_loop_then_resumed_on_one_process(tmp_path):
    """The five Checkpointer lines in a user's DDP loop: generations with both ranks' data positions; resumed
    on one process, the DistributedEpochSampler goes on with the epoch's remaining rows: none twice, none skipped."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "--", str(LOOP), "--run", str(run), "--steps", "7", "--every", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert valid_steps(run) == [4, 7]  # the cadence, and close(final_save=True): general generations (format="auto")
    assert (run / "step_000007.safetensors").is_file() and not list(run.glob("*.bin"))
    ranks = json.loads((run / "step_000007.safetensors.json").read_text())["state"]["extra"]["distributed"]["ranks"]
    assert [r["data"]["world_size"] for r in ranks] == [2, 2] and ranks[0]["data"]["cursor"] == ranks[1]["data"]["cursor"] == 56
    res = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", "18"], capture_output=True, text=True,
                         env={**os.environ, **ENV}, timeout=300)
    assert res.returncode == 0, res.stderr
    view = read_history(run / ".loss.jsonl")
    assert [e for e in view.events if e["event"] == "world_size_change"][0]["dropped_ranks"] == [1]
    epoch0 = [row for s in sorted(view.steps) if view.steps[s]["epoch"] == 0 for rows in view.steps[s]["rows"] for row in rows]
    assert sorted(epoch0) == list(range(96))  # 7 steps x 8 rows on 2 ranks, then 10 steps x 4 rows on 1
    assert [view.steps[s]["world"] for s in range(1, 19)] == [2] * 7 + [1] * 11
    assert view.steps[18]["epoch"] == 1 and len(view.steps[18]["rows"][0]) == 4
