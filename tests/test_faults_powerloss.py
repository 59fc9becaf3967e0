"""Fault matrix, family 2: simulated power loss (ALICE/SQLite-style crash states).

The operations of a real save are recorded through ``fsio.ops.recorder``
(open, each write with offset and bytes, fsync, rename, folder fsync,
unlink). At every crash point — after each operation — the possible disks a
power cut could leave are materialised into fresh folders
(:mod:`faults.powerloss`: only what was fsync'd; everything; folder
operations without their data; data without folder operations; random
subsets with torn writes and trashed blocks), and the real reader recovers:
``CheckpointStore.latest_valid`` + ``load`` must find a committed
generation at least as new as the last durable commit, bitwise equal to what
was saved — never a damaged one — and a writer restarting there cleans up
and saves again.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from faults.common import (
    KEY,
    Tally,
    arrays_for,
    companion_for,
    pick,
    recover_and_check,
    same_tree,
    scale,
    temporaries,
    tiny_pt_state,
)
from faults.powerloss import Replay, materialise, snapshot

from ripresa.errors import RipresaError
from ripresa.formats.torch_pt import load_checkpoint, save_checkpoint
from ripresa.io import fsio
from ripresa.store.history import History, read_history
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore

N = 3000
FIXED_MODES = ("synced", "all", "meta-first", "data-first")


pytestmark = pytest.mark.usefixtures("clean_fault_ops")  # tests/conftest.py


def _record(folder: Path, action) -> list[fsio.RecordedOp]:
    seen: list[fsio.RecordedOp] = []
    fsio.ops.recorder = seen.append
    try:
        action()
    finally:
        fsio.ops.recorder = None
    return seen


def _crash_points(folder: Path, baseline: dict[str, bytes], ops: list[fsio.RecordedOp], points: int):
    """(index, replay after ops[:index]) for a sample of crash points (all in the long run)."""
    chosen = set(pick(list(range(len(ops) + 1)), points))
    replay = Replay(folder, baseline)
    for i in range(len(ops) + 1):
        if i in chosen:
            yield i, replay
        if i < len(ops):
            replay.apply(ops[i])


def _states(replay: Replay, rnd: random.Random, randoms: int):
    for mode in FIXED_MODES:
        yield mode, replay.crash_state(mode)
    if replay.has_pending():
        for r in range(randoms):
            yield f"random{r}", replay.crash_state("random", rnd)


def _durable_floor(replay: Replay) -> int | None:
    """The newest generation whose marker is durable and that the writer has not withdrawn.

    A writer withdraws a generation on purpose: retention unlinks old markers,
    and re-saving a step unlinks that step's marker before writing the new
    files (so no reader pairs the old marker with new files). Once the
    writer has done that, falling back below it is the protocol, not a loss.
    """
    steps = [int(name[5:-11]) for name, ino in replay.durable.items()
             if name.startswith("step_") and name.endswith(".bin.sha256") and replay.live.get(name) == ino]
    return max(steps) if steps else None


@pytest.mark.parametrize("scenario", ["new-generation", "new-generation-signed", "resave-same-step"])
def test_power_cut_at_every_point_of_a_generation_save(tmp_path, scenario):
    signed = scenario.endswith("signed")
    key = KEY if signed else None
    live = tmp_path / "live"
    with CheckpointStore(live, retention=KeepLast(2), hmac_key=key) as store:
        for s in (1, 2):
            store.save(s, arrays_for(s, N), companion_for(s))
        baseline = snapshot(live)
        if scenario == "resave-same-step":  # writer 1 re-saves step 2: the marker is withdrawn first
            target, writer = 2, 1
        else:  # generation 3; retention then deletes generation 1
            target, writer = 3, 0
        ops = _record(live, lambda: store.save(target, arrays_for(target, N, writer), companion_for(target, writer)))
    rnd = random.Random(hash(scenario) & 0xFFFF)
    tally = Tally("power loss: generation save", "crash states after each op: synced only, all, metadata-first, "
                  "data-first, random subsets + torn writes + trashed blocks")
    restarts = 0
    for i, replay in _crash_points(live, baseline, ops, scale(16, 10_000)):
        floor = _durable_floor(replay)
        for mode, state in _states(replay, rnd, scale(3, 30)):
            folder = materialise(state, tmp_path / f"p{i}-{mode}")
            v = recover_and_check(folder, N, floor=floor, newest_possible=max(target, 2), key=key)
            label = f"{scenario} after op {i}/{len(ops)} ({ops[i - 1].op if i else 'start'}), {mode}"
            if v.ok and (restarts < scale(4, 60) and mode in ("all", "random0", "meta-first")):
                restarts += 1  # a writer restarting on this disk cleans up and commits the next generation
                with CheckpointStore(folder, retention=KeepLast(2), hmac_key=key) as store:
                    store.save(10, arrays_for(10, N), companion_for(10))
                    left = temporaries(folder)
                v = recover_and_check(folder, N, floor=10, newest_possible=10, key=key, exact=10)
                if left:
                    v.ok, v.why = False, f"temporaries left: {left}"
            tally.add(v.ok, label, v.why)
            shutil.rmtree(folder)
    tally.check()


STATE = tiny_pt_state()


def test_power_cut_at_every_point_of_a_checkpoint_pt_save(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    ops = _record(live, lambda: save_checkpoint(live / "checkpoint.pt", STATE))
    rnd = random.Random(2)
    tally = Tally("power loss: checkpoint.pt", "crash states of save_checkpoint into a new folder: committed and "
                  "equal, or refused")
    for i, replay in _crash_points(live, {}, ops, scale(12, 10_000)):
        durable = "checkpoint.pt.sha256" in replay.durable
        for mode, state in _states(replay, rnd, scale(3, 20)):
            folder = materialise(state, tmp_path / f"p{i}-{mode}")
            try:
                ck = load_checkpoint(folder / "checkpoint.pt")
            except RipresaError as exc:
                ok, why = not durable, f"durable checkpoint refused: {exc.message}"
            except Exception as exc:
                ok, why = False, f"unclear error {type(exc).__name__}: {exc}"
            else:
                ok, why = same_tree(ck.state, STATE), "a damaged checkpoint loaded"
            tally.add(ok, f"after op {i}, {mode}", why)
            shutil.rmtree(folder)
    tally.check()


def test_power_cut_at_every_point_of_a_sidecar_rewrite(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    old = json.dumps({"version": 1, "pad": "x" * 3000}).encode()
    new = json.dumps({"version": 2, "pad": "y" * 5000}).encode()
    (live / ".state.json").write_bytes(old)
    baseline = snapshot(live)
    ops = _record(live, lambda: fsio.write_atomic(live / ".state.json", [new[:2000], new[2000:]]))
    rnd = random.Random(4)
    tally = Tally("power loss: sidecar rewrite", "crash states of write_atomic over an existing .state.json")
    for i, replay in _crash_points(live, baseline, ops, 100):
        rename_durable = replay.inodes[replay.durable[".state.json"]].synced == new
        for mode, state in _states(replay, rnd, scale(5, 40)):
            got = state.get(".state.json")
            ok = got == new if rename_durable else got in (old, new)
            tally.add(ok, f"after op {i}, {mode}", f"found {'nothing' if got is None else 'a torn file'}")
    tally.check()


def test_power_cut_during_history_appends(tmp_path):
    """``.loss.jsonl`` is fsync'd at each checkpoint: a power cut keeps every line
    up to the last sync; the unsynced tail may be lost, torn or trashed, and the
    reader must still return every committed line and nothing that was never written."""
    path = tmp_path / ".loss.jsonl"
    h = History(path)
    synced_sizes = [0]
    for s in range(1, 41):
        h.step(s, loss=1.0 / s, lr=1e-3, arm="web")
        if s % 10 == 0:
            h.sync()
            h.event("checkpoint", step=s)
            synced_sizes.append(path.stat().st_size)
    h.close()
    full = path.read_bytes()
    written = read_history(path)
    rnd = random.Random(6)
    tally = Tally("power loss: history (.loss.jsonl)", "synced prefix + random unsynced tail (cut, trashed)")
    for synced in synced_sizes:
        tail_end = min(len(full), synced + 2000)
        for k in range(scale(15, 150)):
            cut = rnd.randrange(synced, tail_end + 1)
            data = bytearray(full[:cut])
            if cut > synced and rnd.random() < 0.5:  # a trashed sector in the unsynced tail
                lo = rnd.randrange(synced, cut)
                hi = min(cut, lo + rnd.randrange(1, 512))
                data[lo:hi] = bytes(hi - lo) if rnd.random() < 0.5 else rnd.randbytes(hi - lo)
            p = tmp_path / f"h{synced}-{k}.jsonl"
            p.write_bytes(bytes(data))
            try:
                view = read_history(p)
                committed = read_history_prefix(full[:synced], tmp_path / "prefix.jsonl")
                ok = all(view.steps.get(s) == rec for s, rec in committed.steps.items())
                ok = ok and all(written.steps.get(s) == rec for s, rec in view.steps.items())
                h2 = History(p)
                h2.step(41, loss=0.5)
                h2.close()
                ok = ok and read_history(p).steps[41]["loss"] == 0.5
                why = "committed lines lost or changed"
            except Exception as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            tally.add(ok, f"synced {synced}, cut {cut}", why)
            p.unlink()
    tally.check()


def read_history_prefix(data: bytes, scratch: Path):
    scratch.write_bytes(data)
    return read_history(scratch)
