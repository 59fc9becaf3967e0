"""CheckpointStore: commit protocol, fallback, retention, single writer, crash and fault survival."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from support.helpers import arrays_for, small_companion

import ripresa
from ripresa.formats.bin_state import bin_arrays, companion_snapshot, join_state
from ripresa.io import fsio
from ripresa.store.async_save import AsyncCheckpointWriter
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore, CheckpointWarning, generation_paths


def assert_contents(contents, step, n):
    exp = arrays_for(step, n)
    assert contents.step == step
    assert np.array_equal(contents.weights, exp.weights[0])
    assert np.array_equal(contents.m, exp.m[0])
    assert np.array_equal(contents.v, exp.v[0])


def test_save_writes_three_files_and_sha256sum_checks_both(tmp_path):
    with CheckpointStore(tmp_path) as store:
        gen = store.save(100, arrays_for(100, 1000), small_companion(100))
    assert gen.valid and gen.size == 8 + 12 * 1000
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LOCK", "step_000100.bin", "step_000100.bin.sha256", "step_000100.json"]
    res = subprocess.run(["sha256sum", "-c", "step_000100.bin.sha256"], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step_000100.bin: OK" in res.stdout and "step_000100.json: OK" in res.stdout
    reader = CheckpointStore(tmp_path, writer=False)
    contents, comp = reader.load(100)
    assert_contents(contents, 100, 1000)
    assert comp["note"] == "generation 100" and torch.equal(comp["t"], torch.arange(3))


def test_commit_order_marker_last(tmp_path):
    events = []
    fsio.ops.hook = lambda op, path: events.append((op, os.path.basename(path)))
    try:
        with CheckpointStore(tmp_path) as store:
            store.save(1, arrays_for(1, 100), small_companion(1))
    finally:
        fsio.ops.hook = None
    renames = [n for op, n in events if op == "rename"]
    assert renames == ["step_000001.bin", "step_000001.json", "step_000001.bin.sha256"]
    ops_seq = [op for op, _ in events]
    first_rename = ops_seq.index("rename")
    assert ops_seq[:first_rename].count("fsync") == 2  # both data files fsync'd before any rename
    assert ops_seq[-1] == "fsync_dir"


@pytest.mark.parametrize("damage", ["flip-bin", "truncate-bin", "missing-marker", "flip-companion", "bad-marker", "missing-bin"])
def test_damaged_newest_generation_falls_back_with_a_warning(tmp_path, damage):
    with CheckpointStore(tmp_path, retention=KeepLast(5)) as store:
        store.save(1, arrays_for(1, 500), small_companion(1))
        store.save(2, arrays_for(2, 500), small_companion(2))
    b, c, mk = generation_paths(tmp_path, 2)
    if damage == "flip-bin":
        data = bytearray(b.read_bytes())
        data[100] ^= 0x10
        b.write_bytes(bytes(data))
    elif damage == "truncate-bin":
        b.write_bytes(b.read_bytes()[:-4])
    elif damage == "missing-marker":
        mk.unlink()
    elif damage == "flip-companion":
        c.write_bytes(c.read_bytes().replace(b"generation 2", b"generation X"))
    elif damage == "bad-marker":
        mk.write_text("garbage\n")
    elif damage == "missing-bin":
        b.unlink()
    store = CheckpointStore(tmp_path, writer=False)
    with pytest.warns(CheckpointWarning) as rec:
        gen = store.latest_valid()
    assert gen is not None and gen.step == 1
    msg = str(rec[0].message)
    assert "generation 2 not used" in msg and "step_000002" in msg
    contents, _ = store.load(1)
    assert_contents(contents, 1, 500)


def test_retention_keeps_last_n_and_never_the_newest_valid(tmp_path):
    with CheckpointStore(tmp_path, retention=KeepLast(2)) as store:
        for s in range(1, 6):
            store.save(s * 10, arrays_for(s, 50), small_companion(s))
        assert [g.step for g in store.generations()] == [40, 50]
        # Damage the newest: retention at the next save must not count it as valid.
        b, _, _ = generation_paths(tmp_path, 50)
        b.write_bytes(b.read_bytes()[:-1])
        store.save(60, arrays_for(6, 50), small_companion(6))
        valid = [g.step for g in store.generations() if g.valid]
        assert valid == [40, 60]


def test_second_writer_is_refused(tmp_path):
    code = (
        "import sys, time; from ripresa.store.store import CheckpointStore;"
        "s = CheckpointStore(sys.argv[1]); print('locked', flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(ripresa.errors.LockHeld) as ei:
            CheckpointStore(tmp_path)
        assert str(child.pid) in str(ei.value)
    finally:
        child.kill()
        child.wait()
    CheckpointStore(tmp_path).close()  # the dead holder's lock is gone


# ------------------------------------------------------------------ injected OSErrors

def _count_ops(tmp_path):
    counts: dict[str, int] = {}
    fsio.ops.hook = lambda op, path: counts.__setitem__(op, counts.get(op, 0) + 1)
    try:
        with CheckpointStore(tmp_path / "probe") as store:
            store.save(1, arrays_for(1, 300_000), small_companion(1))
    finally:
        fsio.ops.hook = None
    return counts


def test_oserror_at_every_write_fsync_rename_and_folder_fsync(tmp_path):
    counts = _count_ops(tmp_path)
    assert counts["write"] >= 4 and counts["fsync"] >= 3 and counts["rename"] == 3 and counts["fsync_dir"] >= 2
    cases = [(op, k, err) for op in ("write", "fsync", "rename", "fsync_dir", "open") for k in range(1, counts[op] + 1)
             for err in ((errno.ENOSPC, errno.EIO) if op in ("write", "fsync") else (errno.EIO,))]
    for op, k, err in cases:
        folder = tmp_path / f"{op}-{k}-{err}"
        with CheckpointStore(folder) as store:
            store.save(1, arrays_for(1, 300_000), small_companion(1))
        seen = {"n": 0}

        def hook(name, path, op=op, k=k, err=err, seen=seen):
            if name == op:
                seen["n"] += 1
                if seen["n"] == k:
                    raise OSError(err, os.strerror(err))

        with CheckpointStore(folder) as store:
            fsio.ops.hook = hook
            try:
                with pytest.raises(ripresa.SaveFailed) as ei:
                    store.save(2, arrays_for(2, 300_000), small_companion(2))
            finally:
                fsio.ops.hook = None
            assert f"errno {err}" in str(ei.value), (op, k)
            latest = store.latest_valid(warn=False)
            # Either generation 1 (failure before the commit) or, when only the
            # folder fsync after the marker failed, a complete generation 2.
            assert latest is not None and latest.step in (1, 2), (op, k)
            contents, _ = store.load(1 if latest.step == 1 else 2)
            assert_contents(contents, latest.step, 300_000)
            contents1, _ = store.load(1)
            assert_contents(contents1, 1, 300_000)
        with CheckpointStore(folder):  # the next start cleans up
            pass
        leftovers = [p.name for p in folder.iterdir() if fsio.is_temp_name(p.name)]
        assert leftovers == [], (op, k, leftovers)


# ------------------------------------------------------------------ SIGKILL at random moments

N_KILL = 750_000  # 9 MB per generation


def _saver(folder, ready_fd, start_step):
    os.environ.pop("RIPRESA_CRASH_AT", None)
    store = CheckpointStore(folder, retention=KeepLast(2))
    step = start_step
    while True:
        store.save(step, arrays_for(step, N_KILL), small_companion(step))
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
            ready_fd = None
        step += 1


def kill_random_moments(tmp_path, kills: int, seed: int = 0):
    folder = tmp_path / "run"
    ctx = multiprocessing.get_context("fork")
    rnd = random.Random(seed)
    start = 1
    outcomes = set()
    for _ in range(kills):
        r, w = os.pipe()
        proc = ctx.Process(target=_saver, args=(folder, w, start))
        proc.start()
        os.close(w)
        assert os.read(r, 1) == b"1"  # at least one generation committed by this child
        os.close(r)
        time.sleep(rnd.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        store = CheckpointStore(folder, writer=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            gen = store.latest_valid(deep=True)
        assert gen is not None and gen.step >= start
        contents, comp = store.load(gen.step)
        assert_contents(contents, gen.step, N_KILL)
        assert comp["progress"]["step"] == gen.step
        # Did this kill land inside a save? Then temporaries or an uncommitted newest generation remain.
        mid_save = any(fsio.is_temp_name(p.name) for p in folder.iterdir()) or max(store.steps_on_disk()) != gen.step
        outcomes.add(not mid_save)
        start = max(store.steps_on_disk()) + 1
    return outcomes


@pytest.mark.slow
def test_sigkill_at_12_random_moments_of_the_save(tmp_path):
    outcomes = kill_random_moments(tmp_path, 12)
    # The child does nothing but save, so kills land inside saves (temporaries or an
    # uncommitted newest generation left behind) — and recovery was exact every time.
    assert False in outcomes


@pytest.mark.slow
def test_sigkill_at_500_random_moments_of_the_save(tmp_path):
    kill_random_moments(tmp_path, 500, seed=1)


# ------------------------------------------------------------------ a real model through the store

def _toy(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.7)
    gen = np.random.Generator(np.random.PCG64(seed))
    sampler = ripresa.EpochSampler(40, 8, generator=gen)
    state = ripresa.TrainingState(model=model, optimizer=opt, scheduler=sched, data=sampler,
                                  rng=ripresa.RandomStreams(numpy={"g": gen}), config={"toy": True})
    return state


XS = torch.randn(40, 6, generator=torch.Generator().manual_seed(3))
YS = torch.randn(40, 2, generator=torch.Generator().manual_seed(4))


def _train(state, progress, n):
    for _ in range(n):
        ids = state.data.next_batch()
        state.optimizer.zero_grad()
        x = XS[ids] + 0.05 * torch.randn(len(ids), 6)
        torch.nn.functional.mse_loss(state.model(x), YS[ids]).backward()
        state.optimizer.step()
        state.scheduler.step()
        progress.step += 1


@pytest.mark.parametrize("asynchronous", [False, True])
def test_model_resume_through_the_store_is_bit_exact(tmp_path, asynchronous):
    ref = _toy()
    _train(ref, ripresa.Progress(), 13)

    st = _toy()
    progress = ripresa.Progress()
    _train(st, progress, 6)
    with CheckpointStore(tmp_path) as store:
        if asynchronous:
            writer = AsyncCheckpointWriter(store)
            writer.save(progress.step, bin_arrays(st), companion_snapshot(st, progress))
            _train(st, progress, 2)  # training goes on while the save is written
            assert writer.wait().step == 6
        else:
            store.save(progress.step, bin_arrays(st), companion_snapshot(st, progress))

    fresh = _toy(seed=99)
    reader = CheckpointStore(tmp_path, writer=False)
    gen = reader.latest_valid()
    contents, comp = reader.load(gen.step, expected_n=sum(p.numel() for p in fresh.model.parameters()))
    progress2 = fresh.restore(join_state(fresh, contents, comp))
    assert progress2.step == 6
    _train(fresh, progress2, 7)
    for a, b in zip(ref.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for s1, s2 in zip(ref.optimizer.state.values(), fresh.optimizer.state.values(), strict=True):
        assert torch.equal(s1["exp_avg"], s2["exp_avg"]) and torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])


def test_async_failure_surfaces_at_next_call_and_previous_generation_stays(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save(1, arrays_for(1, 1000), small_companion(1))
        writer = AsyncCheckpointWriter(store)

        def hook(op, path):
            if op == "fsync" and "step_000002" in path:
                raise OSError(errno.EIO, "Input/output error")

        fsio.ops.hook = hook
        try:
            writer.save(2, arrays_for(2, 1000), small_companion(2))
            while writer.in_flight:
                time.sleep(0.01)
        finally:
            fsio.ops.hook = None
        with pytest.raises(ripresa.SaveFailed, match="background save of step 2 failed"):
            writer.poll()
        writer.poll()  # raised once, then cleared
        assert store.latest_valid().step == 1
        writer.save(3, arrays_for(3, 1000), small_companion(3))
        assert writer.wait().step == 3


def test_async_stall_is_only_the_copy(tmp_path):
    """The caller returns while the write is still running (the stall excludes the write)."""
    with CheckpointStore(tmp_path) as store:
        writer = AsyncCheckpointWriter(store)
        slow = {"on": True}

        def hook(op, path):
            if op == "fsync" and slow["on"]:
                time.sleep(0.3)

        fsio.ops.hook = hook
        try:
            t0 = time.perf_counter()
            writer.save(1, arrays_for(1, 10_000), small_companion(1))
            returned = time.perf_counter() - t0
            assert writer.in_flight
            gen = writer.wait()
        finally:
            fsio.ops.hook = None
        assert gen.step == 1 and returned < 0.3 <= writer.last_write_s


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"retention": "last=3"}, TypeError, "parse_retention"),
        ({"retention": 3}, TypeError, "RetentionPolicy"),
        ({"hmac_key": "a-text-key-that-is-long-enough"}, TypeError, "bytes"),
        ({"hmac_key": b"short"}, ValueError, "at least 16 bytes"),
        ({"require_signature": "yes"}, TypeError, "bool"),
    ],
)
def test_store_constructor_misuse_is_a_type_or_value_error(tmp_path, kwargs, error, match):
    """Refused before the folder is created or locked; a missing folder for a reader stays BadInput."""
    with pytest.raises(error, match=match):
        CheckpointStore(tmp_path / "run", **kwargs)
    with pytest.raises(TypeError, match="path"):
        CheckpointStore(3)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
    with pytest.raises(ripresa.errors.BadInput, match="run folder not found"):
        CheckpointStore(tmp_path / "missing", writer=False)
