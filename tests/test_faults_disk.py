"""Fault matrix, family 3: full and failing disks.

* a real small file system (a tmpfs this test mounts, as root) swept over
  free-space sizes so that a save runs out of space in the ``.bin``'s header,
  in its arrays, in the companion, in the signature and in the marker;
* ``RLIMIT_FSIZE`` (a forked child, SIGXFSZ ignored: writes fail with EFBIG);
* EIO injected at each ``fsync``.

Each case: a clear error (``SaveFailed`` naming the errno and a hint), the
previous generation intact and bitwise equal, no temporary file after the next
start, and the next save commits. And a training run survives failed saves:
the Checkpointer warns, records a ``checkpoint_failed`` event, keeps training
and commits at the next cadence (docs/FAULTS.md says why), ending bitwise where
an undisturbed run ends; after ``max_failed_saves`` consecutive failures it
stops with the last valid generation, and a restart resumes exactly.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import same_generation
from faults.common import (
    KEY,
    Tally,
    arrays_for,
    companion_for,
    in_child,
    pick,
    recover_and_check,
    temporaries,
)
from support.ripresa_faults import fault_env

import ripresa
from ripresa.errors import SaveFailed
from ripresa.formats.andrea_bin import read_bin
from ripresa.io import fsio
from ripresa.store.history import read_history
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore

N = 20_000  # a 240 KB .bin: 59 pages of 4 KiB
PAGE = 4096


pytestmark = pytest.mark.usefixtures("clean_fault_ops")  # tests/conftest.py


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(kib) -> Path``: a fresh tmpfs of that size (skipped with the reason when not possible)."""
    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("full-disk tests mount a tmpfs and need root (they run as root in CI); "
                        f"euid is {os.geteuid()}")
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0755", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}); full-disk tests skipped")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def free_pages(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize // PAGE


def fill_leaving(folder: Path, pages: int, name: str = "filler") -> Path:
    """Fill the file system of ``folder`` so that exactly ``pages`` free pages remain."""
    filler = folder / name
    if filler.exists():
        filler.unlink()
    take = free_pages(folder) - pages
    assert take >= 0, "not enough room for this sweep point"
    with open(filler, "wb") as f:
        f.write(b"\0" * (take * PAGE))
    assert free_pages(folder) == pages
    return filler


def _phase_of_failure(attempts: list[tuple[str, str]]) -> str:
    """Where a save failed, from the operations it attempted (the last one failed)."""
    op, path = attempts[-1]
    name = os.path.basename(path)
    if ".sha256" in name:
        return "marker"
    if ".hmac" in name:
        return "signature"
    if ".json" in name:
        return "companion"
    if ".bin" in name:
        writes = [a for a in attempts if a[0] == "write" and ".bin.tmp" in a[1]]
        if op == "write":
            return "header" if len(writes) == 1 else "arrays"
        return f".bin {op}"
    return f"{op} {name}"


@pytest.mark.parametrize("signed", [pytest.param(False, id="unsigned"), pytest.param(True, id="signed", marks=pytest.mark.slow)])
def test_full_disk_sweep_fails_cleanly_in_every_part_of_the_save(tmpfs, signed):
    key = KEY if signed else None
    root = tmpfs(1024)
    run = root / "run"
    with CheckpointStore(run, retention=KeepLast(5), hmac_key=key) as store:
        store.save(1, arrays_for(1, N), companion_for(1))
    bin_pages = -(-(8 + 12 * N) // PAGE)
    sizes = list(range(0, bin_pages + 6))
    sizes = pick(sizes, 10) if not os.environ.get("RIPRESA_FAULTS_FULL") else sizes
    # the boundaries are always in: no room at all, room for the .bin only, + companion, + signature
    sizes = sorted(set(sizes) | {0, 1, bin_pages - 1, bin_pages, bin_pages + 1, bin_pages + 2})
    tally = Tally("full disk (tmpfs sweep)", "ENOSPC in header, arrays, companion, signature, marker; "
                  "previous generation intact, no temporary, next save commits")
    phases: dict[str, int] = {}
    for free in sizes:
        # a running trainer holds the lock (writing LOCK needs a page, so a start on a 100 % full disk
        # is refused with a clear BadInput: tested below)
        store = CheckpointStore(run, retention=KeepLast(5), hmac_key=key)
        filler = fill_leaving(root, free)
        attempts: list[tuple[str, str]] = []
        fsio.ops.hook = lambda op, path, attempts=attempts: attempts.append((op, path))
        saved = False
        try:
            store.save(2, arrays_for(2, N), companion_for(2))
            saved = True
            why = ""
            clear = True
        except SaveFailed as exc:
            text = str(exc)
            clear = "ENOSPC" in text and "disk is full" in text and "previous checkpoint is untouched" in text
            why = text.splitlines()[0]
        finally:
            fsio.ops.hook = None
        phase = "none (saved)" if saved else _phase_of_failure(attempts)
        phases[phase] = phases.get(phase, 0) + 1
        left_now = temporaries(run)
        v = recover_and_check(run, N, floor=2 if saved else 1, newest_possible=2, key=key, exact=2 if saved else 1)
        filler.unlink()
        store.close()
        with CheckpointStore(run, retention=KeepLast(5), hmac_key=key) as store:  # the next start
            left = temporaries(run)
            store.save(3, arrays_for(3, N), companion_for(3))
        after = recover_and_check(run, N, floor=3, newest_possible=3, key=key, exact=3)
        ok = clear and v.ok and after.ok and not left and not left_now
        tally.add(ok, f"{free} free pages ({phase})",
                  f"clear={clear} {why} {v.why} {after.why} temporaries={left_now or left}")
        with CheckpointStore(run, retention=KeepLast(5), hmac_key=key) as store:  # back to generation 1 only
            store.delete(3)
            store.delete(2)
        assert recover_and_check(run, N, floor=1, newest_possible=1, key=key, exact=1).ok
    tally.detail = f"{'signed' if signed else 'unsigned'}: failed in {dict(sorted(phases.items()))}"
    tally.check()
    want = {"header", "arrays", "companion", "marker"} | ({"signature"} if signed else set())
    assert want <= set(phases), phases


@pytest.mark.slow
def test_a_start_on_a_full_disk_is_refused_clearly(tmpfs):
    root = tmpfs(256)
    run = root / "run"
    with CheckpointStore(run) as store:
        store.save(1, arrays_for(1, 2000), companion_for(1))
    filler = fill_leaving(root, 0)
    with pytest.raises(ripresa.BadInput, match="could not write this process's pid") as ei:
        CheckpointStore(run)
    assert "free some space" in (ei.value.hint or "")
    filler.unlink()
    tally = Tally("full disk (tmpfs sweep)", "")
    tally.add(recover_and_check(run, 2000, floor=1, newest_possible=1, exact=1).ok, "start on a 100% full disk")
    tally.check()


# ---------------------------------------------------------------- RLIMIT_FSIZE

def _save_under_limit(run: Path, limit: int, big_companion: bool) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    store = CheckpointStore(run, retention=KeepLast(2))  # the lock is written before the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    comp = companion_for(2)
    if big_companion:
        comp["pad"] = torch.zeros(60_000, dtype=torch.float64)  # a companion larger than the .bin
    try:
        store.save(2, arrays_for(2, N // 10), comp)
    except SaveFailed as exc:
        text = str(exc)
        if "EFBIG" in text and "size limit" in text and "previous checkpoint is untouched" in text:
            os._exit(10 + ("json" in (exc.file or "")))
        print(text, file=sys.stderr)
        os._exit(4)
    os._exit(0)


def test_rlimit_fsize_fails_the_save_cleanly(tmp_path):
    n = N // 10
    bin_size = 8 + 12 * n
    tally = Tally("file-size limit (RLIMIT_FSIZE)", "EFBIG in a forked child (SIGXFSZ ignored) at sizes "
                  "inside the header, the arrays and the companion")
    cases = [(lim, False) for lim in (1, 7, 8, 9, 4096, bin_size // 2, bin_size - 1)] + [(bin_size + 10, True)]
    for k, (limit, big) in enumerate(cases):
        run = tmp_path / f"run{k}"
        with CheckpointStore(run, retention=KeepLast(2)) as store:
            store.save(1, arrays_for(1, n), companion_for(1))
        code = in_child(_save_under_limit, run, limit, big)
        v = recover_and_check(run, n, floor=1, newest_possible=1, exact=1)
        with CheckpointStore(run) as store:
            left = temporaries(run)
            store.save(3, arrays_for(3, n), companion_for(3))
        ok = code == (11 if big else 10) and v.ok and not left
        tally.add(ok, f"limit {limit} bytes{' (big companion)' if big else ''}", f"child exit {code}, {v.why}, {left}")
    tally.check()


# ---------------------------------------------------------------- EIO at fsync

def test_eio_at_every_fsync_fails_once_and_never_retries(tmp_path):
    """EIO at each fsync of a (signed) save: one attempt, a clear error, nothing trusted from it."""
    probe = tmp_path / "probe"
    fsyncs = []
    with CheckpointStore(probe, hmac_key=KEY) as store:
        store.save(1, arrays_for(1, 2000), companion_for(1))
        fsio.ops.hook = lambda op, path: fsyncs.append(path) if op == "fsync" else None
        store.save(2, arrays_for(2, 2000), companion_for(2))
        fsio.ops.hook = None
    tally = Tally("EIO at fsync", "EIO injected at each fsync (.bin, companion, signature, marker): "
                  "never retried, previous generation intact")
    for k, target in enumerate(fsyncs):
        run = tmp_path / f"run{k}"
        with CheckpointStore(run, hmac_key=KEY) as store:
            store.save(1, arrays_for(1, 2000), companion_for(1))
            calls = []
            stem = os.path.basename(target).split(".tmp.")[0]

            def hook(op, path, stem=stem, calls=calls):
                if op == "fsync" and stem in path:
                    calls.append(path)
                    raise OSError(errno.EIO, os.strerror(errno.EIO))

            fsio.ops.hook = hook
            try:
                store.save(2, arrays_for(2, 2000), companion_for(2))
                clear = False
            except SaveFailed as exc:
                clear = "EIO" in str(exc) and "I/O error" in (exc.hint or "")
            finally:
                fsio.ops.hook = None
        v = recover_and_check(run, 2000, floor=1, newest_possible=1, key=KEY, exact=1)
        ok = clear and len(calls) == 1 and v.ok and not temporaries(run)
        tally.add(ok, os.path.basename(target), f"clear={clear} calls={len(calls)} {v.why}")
    tally.check()


# ---------------------------------------------------------------- a training run survives failed saves

def _toy_state(seed: int = 0, width: int = 150):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = np.random.Generator(np.random.PCG64(seed))
    sampler = ripresa.EpochSampler(64, 8, generator=gen)
    return ripresa.TrainingState(model=model, optimizer=opt, data=sampler,
                                 rng=ripresa.RandomStreams(numpy={"g": gen}), config={"toy": True})


XS = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))


def _loop(run: Path, total: int, every: int, *, asynchronous: bool, on_step=None, max_failed_saves: int = 3):
    state = _toy_state()
    ck = ripresa.Checkpointer(run, state, every=every, asynchronous=asynchronous, handle_signals=False,
                              max_failed_saves=max_failed_saves, format="andrea")  # sized for the .bin (~58 KB)
    start = ck.resume()
    try:
        for step in range(start + 1, total + 1):
            ids = state.data.next_batch()
            state.optimizer.zero_grad()
            loss = (state.model(XS[ids]) - XS[ids]).pow(2).mean()
            loss.backward()
            state.optimizer.step()
            if on_step is not None:
                on_step(step, ck)
            ck.step_done(step, loss=loss.item())
        ck.close(final_save=True)
    except BaseException:
        ck.__exit__(*sys.exc_info())
        raise
    return ck


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_training_survives_a_full_disk_and_retries_at_the_next_cadence(tmpfs, tmp_path, asynchronous):
    total, every = 60, 10
    ref = tmp_path / "ref"
    _loop(ref, total, every, asynchronous=False)
    root = tmpfs(4096)
    run = root / "run"
    filler: dict[str, Path] = {}

    def weather(step, ck):
        if step in (15, 35):  # the weather changes between saves, not during one (deterministic counts)
            while ck.writer is not None and ck.writer.in_flight:
                time.sleep(0.005)
        if step == 15:  # disk nearly full: a .bin (~58 KB) no longer fits, history appends still do
            filler["f"] = fill_leaving(root, 6)
        if step == 35:  # space freed: the next cadence (40) commits
            filler.pop("f").unlink()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loop(run, total, every, asynchronous=asynchronous, on_step=weather)
    failed_warnings = [w for w in caught if "failed (training goes on" in str(w.message)]
    events = read_history(run / ".loss.jsonl").events
    failed = [e["step"] for e in events if e["event"] == "checkpoint_failed"]
    committed = [e["step"] for e in events if e["event"] == "checkpoint"]
    a, b = read_bin(ref / f"step_{total:06d}.bin"), read_bin(run / f"step_{total:06d}.bin")
    same = np.array_equal(a.weights, b.weights) and np.array_equal(a.m, b.m) and np.array_equal(a.v, b.v)
    tally = Tally("training survives failed saves", "Checkpointer on a tmpfs that fills up: warn, event, retry "
                  "next cadence; final state bitwise = undisturbed run")
    ok = failed == [20, 30] and committed == [10, 40, 50, 60] and len(failed_warnings) == 2 and same
    ok = ok and not temporaries(run) and "No space left" in next(e["found"] for e in events if e["event"] == "checkpoint_failed")
    tally.add(ok, f"asynchronous={asynchronous}", f"failed {failed} committed {committed} same={same}")
    tally.check()


@pytest.mark.slow
def test_training_stops_after_max_failed_saves_and_resumes_exactly(tmpfs, tmp_path):
    total, every = 50, 10
    ref = tmp_path / "ref"
    _loop(ref, total, every, asynchronous=False)
    root = tmpfs(4096)
    run = root / "run"
    state: dict[str, Path] = {}

    def fill(step, ck):
        if step == 12:
            state["f"] = fill_leaving(root, 6)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SaveFailed) as ei:
            _loop(run, total, every, asynchronous=False, on_step=fill)
    assert "No space left" in str(ei.value) or "ENOSPC" in str(ei.value)
    events = read_history(run / ".loss.jsonl").events
    assert [e["step"] for e in events if e["event"] == "checkpoint_failed"] == [20, 30, 40]
    state.pop("f").unlink()
    gen = CheckpointStore(run, writer=False).latest_valid()
    assert gen.step == 10 and not temporaries(run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loop(run, total, every, asynchronous=False)  # the restart resumes from 10
    a, b = read_bin(ref / f"step_{total:06d}.bin"), read_bin(run / f"step_{total:06d}.bin")
    tally = Tally("training survives failed saves", "")
    tally.add(np.array_equal(a.weights, b.weights) and np.array_equal(a.m, b.m) and np.array_equal(a.v, b.v),
              "stop after 3 failures, restart", "resumed run differs from the undisturbed one")
    tally.family = "stop after max_failed_saves, then resume"
    tally.what = "3 consecutive ENOSPC saves stop the run; last generation intact; restart resumes bitwise"
    tally.check()


LOOP = Path(__file__).resolve().parents[1] / "examples" / "loop" / "train.py"


@pytest.mark.slow
def test_example_loop_survives_eio_at_fsync_end_to_end(tmp_path):
    """examples/loop/train.py in a real process with RIPRESA_FAIL_AT=fsync EIO on its first
    two generations: it warns, keeps training, commits later, exits 0 bitwise equal to an undisturbed run."""
    steps, every = 120, 20
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    ref, run = tmp_path / "ref", tmp_path / "run"
    r1 = subprocess.run([sys.executable, str(LOOP), "--run", str(ref), "--steps", str(steps), "--every", str(every)],
                        capture_output=True, text=True, timeout=600, env=env)
    r2 = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", str(steps), "--every", str(every)],
                        capture_output=True, text=True, timeout=600,
                        env=dict(env, **fault_env(fail_at="fsync:1-2:EIO@.safetensors.tmp")))  # the tensor file
    assert r1.returncode == 0, r1.stderr
    events = read_history(run / ".loss.jsonl").events
    failed = [e["step"] for e in events if e["event"] == "checkpoint_failed"]
    same = same_generation(ref, run, steps)
    tally = Tally("training survives failed saves", "")
    tally.family = "EIO at fsync, end to end (examples/loop)"
    tally.what = "RIPRESA_FAIL_AT=fsync:1-2:EIO in a real trainer: warns, retries, exits 0, bitwise equal"
    ok = r2.returncode == 0 and failed == [20, 40] and "training goes on" in r2.stderr and same
    tally.add(ok, "loop", f"exit {r2.returncode}, failed {failed}: {r2.stderr[-400:]}")
    tally.check()
    shutil.rmtree(ref)
