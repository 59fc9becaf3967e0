"""Fault matrix, family 5: concurrent writers on one run folder.

Four processes each want to make 20 saves into the same run folder.

* **held**: all four start at once and each opens the folder for its whole
  run of saves: exactly one gets the lock; the other three are refused at
  once with ``LockHeld`` naming the holder's pid, and write nothing.
* **interleaved**: each process takes the lock for one save at a time,
  retrying when refused, and all four re-save the *same* steps (the
  uncommit-then-rewrite path), while a fifth process reads continuously. No
  generation the reader accepts, and none left at the end, is ever a mix of
  two writers: the ``.bin`` always holds the arrays of the writer its
  companion names.
"""

from __future__ import annotations

import json
import os
import random
import time
import warnings
from pathlib import Path

from faults.common import (
    Tally,
    arrays_for,
    companion_for,
    generation_matches,
    latest_valid_quietly,
    quiet_store,
    scale,
)

from ripresa.errors import LockHeld, RipresaError
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore

N = 2000
WRITERS = 4
SAVES = 20


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            warnings.simplefilter("ignore")
            fn(*args)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    return pid


def _wait(pids: list[int]) -> list[int]:
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status))
    return codes


def _held_writer(run: Path, w: int, go: Path, out: Path, done: Path) -> None:
    while not go.exists():
        time.sleep(0.001)
    result = {"writer": w, "pid": os.getpid(), "saves": 0, "refused": None}
    try:
        store = CheckpointStore(run, retention=KeepLast(3))
    except LockHeld as exc:
        result["refused"] = str(exc)
        out.write_text(json.dumps(result))
        return
    out.write_text(json.dumps(result))  # "I hold it", before the saves
    for i in range(SAVES):
        store.save(i + 1, arrays_for(i + 1, N, w), companion_for(i + 1, w))
        result["saves"] += 1
    deadline = time.time() + 60
    while not done.exists() and time.time() < deadline:  # hold until every other writer was refused
        time.sleep(0.005)
    store.close()
    out.write_text(json.dumps(result))


def test_four_writers_at_once_one_wins_three_are_refused(tmp_path):
    tally = Tally("concurrent writers: one holds the lock", "4 processes x 20 saves start at once: one holds "
                  "the lock and saves, the others are refused at once with the holder's pid")
    for trial in range(scale(2, 10)):
        run = tmp_path / f"run{trial}"
        run.mkdir()
        go, done = tmp_path / f"go{trial}", tmp_path / f"done{trial}"
        outs = [tmp_path / f"t{trial}w{w}.json" for w in range(WRITERS)]
        pids = [_fork(_held_writer, run, w, go, outs[w], done) for w in range(WRITERS)]
        go.touch()
        deadline = time.time() + 60
        while time.time() < deadline:
            res = [json.loads(o.read_text()) if o.exists() and o.read_text() else None for o in outs]
            if all(r is not None for r in res) and sum(r["refused"] is not None for r in res) == WRITERS - 1:
                break
            time.sleep(0.01)
        done.touch()
        codes = _wait(pids)
        res = [json.loads(o.read_text()) for o in outs]
        winners = [r for r in res if r["refused"] is None]
        holder = winners[0] if len(winners) == 1 else None
        store = quiet_store(run)
        gens = [g for g in store.generations(deep=True) if g.valid]
        clean = holder is not None and [g.step for g in gens] == [SAVES - 2, SAVES - 1, SAVES]
        for g in gens:
            contents, comp = store.load(g.step)
            clean = clean and comp["writer"] == holder["writer"] and generation_matches(contents, comp, g.step, N)
        for w, r in enumerate(res):
            if r["refused"] is None:
                ok = codes[w] == 0 and r["saves"] == SAVES and clean
                why = f"holder: exit {codes[w]}, {r['saves']} saves, generations {[g.step for g in gens]}"
            else:
                msg = r["refused"]
                ok = (codes[w] == 0 and holder is not None and f"pid {holder['pid']}" in msg
                      and "locked by another writer" in msg and "hint:" in msg and r["saves"] == 0)
                why = f"refusal: {msg[:200]}"
            tally.add(ok, f"trial {trial} writer {w}", why)
        if holder is None:
            tally.add(False, f"trial {trial}", f"{len(winners)} writers held the lock")
    tally.check()


def _interleaved_writer(run: Path, w: int, go: Path, out: Path) -> None:
    rnd = random.Random(w)
    while not go.exists():
        time.sleep(0.001)
    saves = refused = 0
    messages = []
    while saves < SAVES:
        try:
            store = CheckpointStore(run, retention=KeepLast(3))
        except LockHeld as exc:
            refused += 1
            if len(messages) < 2:
                messages.append(str(exc).splitlines()[0])
            time.sleep(rnd.uniform(0, 0.01))
            continue
        with store:
            step = saves + 1  # every writer re-saves the same steps: the uncommit path under contention
            store.save(step, arrays_for(step, N, w), companion_for(step, w))
            saves += 1
        time.sleep(rnd.uniform(0, 0.003))
    out.write_text(json.dumps({"saves": saves, "refused": refused, "messages": messages}))


def _reader(run: Path, stop: Path, out: Path) -> None:
    reads = mixes = transient = 0
    bad = []
    while not stop.exists():
        try:
            store = quiet_store(run)
            g = latest_valid_quietly(store, deep=False)
            if g is None:
                continue
            contents, comp = store.load(g.step, expected_n=N)
        except RipresaError:
            transient += 1  # a generation being re-saved right now: refused, never trusted
            continue
        reads += 1
        if not generation_matches(contents, comp, g.step, N):
            mixes += 1
            bad.append(g.step)
    out.write_text(json.dumps({"reads": reads, "mixes": mixes, "transient": transient, "bad": bad[:5]}))


def test_interleaved_writers_never_mix_a_generation(tmp_path):
    tally = Tally("concurrent writers: interleaved + reader", "4 processes x 20 saves of the same steps, one lock "
                  "per save, and a live reader: no generation is ever a mix of two writers")
    for trial in range(scale(1, 5)):
        run = tmp_path / f"run{trial}"
        run.mkdir()
        go, stop = tmp_path / f"go{trial}", tmp_path / f"stop{trial}"
        outs = [tmp_path / f"t{trial}w{w}.json" for w in range(WRITERS)]
        reader_out = tmp_path / f"t{trial}reader.json"
        pids = [_fork(_interleaved_writer, run, w, go, outs[w]) for w in range(WRITERS)]
        reader = _fork(_reader, run, stop, reader_out)
        go.touch()
        codes = _wait(pids)
        stop.touch()
        codes += _wait([reader])
        res = [json.loads(o.read_text()) for o in outs]
        seen = json.loads(reader_out.read_text())
        store = quiet_store(run)
        final_ok = True
        for g in store.generations(deep=True):
            if g.valid:
                contents, comp = store.load(g.step)
                final_ok = final_ok and generation_matches(contents, comp, g.step, N)
        latest = latest_valid_quietly(store)
        for w, r in enumerate(res):  # each save of each writer is a case
            good = codes[w] == 0 and all("locked by another writer" in m for m in r["messages"])
            for k in range(SAVES):
                tally.add(good and k < r["saves"], f"trial {trial} writer {w} save {k + 1}", f"exit {codes[w]} {r}")
        for k in range(seen["reads"]):  # each load the reader accepted is a case
            tally.add(k >= seen["mixes"], f"trial {trial} read {k}", f"mixed generations {seen['bad']}")
        tally.add(codes[-1] == 0 and seen["reads"] > 0 and final_ok and latest is not None and latest.step == SAVES,
                  f"trial {trial} final folder", f"reader exit {codes[-1]}, final_ok {final_ok}, latest {latest}")
        tally.detail = (f"{WRITERS}x{SAVES} interleaved saves: {sum(r['refused'] for r in res)} refusals, "
                        f"reader {seen['reads']} loads, {seen['transient']} refused mid-rewrite, {seen['mixes']} mixes")
    tally.check()
