#!/usr/bin/env python
"""The memory tier's cost in a real training loop (issue 31, item 2), against its floors.

    .venv/bin/python benchmarks/bench_memory.py                    # the 120M state (andrea-120m), ~4 min
    .venv/bin/python benchmarks/bench_memory.py --size 12m         # andrea-12m, ~1 min
    .venv/bin/python benchmarks/bench_memory.py --size tiny --pairs 1 --block-steps 3 --disk-steps 3   # seconds

One process, the engine's GPT (``--size``: ``tiny``, ``12m``, ``120m``) with
``torch.optim.AdamW``, trained for real (forward, backward, AdamW step) on
``--batch`` × ``--seq`` random bytes. Side by side in the same run:

* **the floors**: a plain ``copy_`` of the same bytes (parameters + AdamW's
  ``exp_avg`` + ``exp_avg_sq``) into a preallocated, touched buffer
  (``floor.memcpy``) and into a preallocated ``/dev/shm`` mapping — the
  tier's real destination (``floor.memcpy_shm``); sha256 of those bytes
  (``floor.sha256``). One sample of each per pair, between the blocks;
* **the step time**: the same loop through ``Checkpointer(every=0,
  memory_every=0)`` (``off``) and ``Checkpointer(every=0, memory_every=1)``
  (``memory``), in alternating blocks of ``--block-steps`` steps (``off``
  first in even pairs, ``memory`` first in odd ones), so a drift of the
  machine falls on both. The first step of each block is left out of every
  figure (the other arm's work may still be draining), and the memory tier
  is settled (its last capture hashed and committed) between blocks;
* **the visible stall**: per step of ``memory``, the seconds the loop
  spent in ``step_done``'s capture (``MemorySession.capture_stalls``) plus
  the seconds the optimizer's step waited for an unfinished copy
  (``step_waits``), against ``floor.memcpy`` (goal ≤ 0.1 ×);
* **the contention** (2 cores shared by the loop's threads, the tier's copy
  and its sha256): the forward + backward time of ``memory`` against
  ``off``, and the tier's copy seconds (``MemoryTier.last_copy_s``) when it
  overlapped the next step against those of each block's last capture, which
  runs alone (the loop waits for it between blocks);
* **the hash**: the tier's sha256 of the slot (``last_hash_s``) against the
  step time, and how long a capture waited for the previous capture's hash
  (``MemoryTier.settle``; 0 when the hash keeps up at ``memory_every=1``);
* **today's alternative**: ``Checkpointer(every=1, asynchronous=True)``
  without the memory tier (``disk``), ``--disk-steps`` steps after the
  pairs: the stall of each save (``save_stalls``), split into the wait for the
  previous save's write (the disk does not keep up at every=1) and the staged
  copy itself.

Before each block the benchmark waits (``--quiet-timeout``) for a moment
when other processes use less than ``--quiet-share`` of the CPU, records
the share they took during the block, and measures a disturbed block again
(``--retries``; the discarded blocks stay in the JSON). Besides the medians
over all counted steps it gives each pair's own overhead (its memory block
against its off block).

Prints a table and writes ``benchmarks/results/bench_memory_<size>.json``
(``_threads<N>`` added with another ``--threads``).
benchmarks/README.md, "Memory tier"; the tier: docs/TIERS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:  # run from a checkout without `pip install -e`
    sys.path.insert(0, str(REPO / "src"))

import json  # noqa: E402

import torch  # noqa: E402

from ripresa import Checkpointer, TrainingState  # noqa: E402
from ripresa.engine.gpt.model import CONFIGS, GPT  # noqa: E402
from ripresa.formats import safetensors_file as st  # noqa: E402
from ripresa.store.memory import MEMORY_ENV  # noqa: E402

SCHEMA = "ripresa-bench-memory/1"
SIZES = {"tiny": "tiny", "12m": "andrea-12m", "120m": "andrea-120m"}
GB = 1e9
DEFAULT_THREADS = torch.get_num_threads()
#: The issue's goals (issue 31, item 2).
GOAL_STALL_OVER_MEMCPY = 0.1
GOAL_OVERHEAD_PCT = 1.0


# ---------------------------------------------------------------------------- small helpers


def stats(xs: list[float]) -> dict[str, Any]:
    """median, min, max and the samples (seconds)."""
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "samples": []}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs),
            "samples": [round(x, 6) for x in xs]}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


class CpuShare:
    """The share of the machine's CPU other processes used between :meth:`start` and :meth:`stop`
    (``/proc/stat`` busy time minus this process's own ``getrusage``); None where ``/proc`` is absent."""

    def __init__(self) -> None:
        self.t0: tuple[float, float, float] | None = None

    @staticmethod
    def _now() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                parts = f.readline().split()[1:]
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        vals = [int(x) for x in parts]
        total = sum(vals[:8]) / ticks
        idle = (vals[3] + vals[4]) / ticks
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return total, total - idle, ru.ru_utime + ru.ru_stime

    def start(self) -> None:
        self.t0 = self._now()

    def stop(self) -> float | None:
        t1 = self._now()
        if self.t0 is None or t1 is None or t1[0] <= self.t0[0]:
            return None
        total, busy, own = (b - a for a, b in zip(self.t0, t1, strict=True))
        return max(0.0, (busy - own) / total)

    def wait_quiet(self, timeout: float, share: float) -> tuple[float, float | None]:
        """Wait (up to ``timeout`` s) for a 0.5 s window in which other processes use less than ``share`` of the
        CPU; (seconds waited, their share in the last window)."""
        t0 = time.perf_counter()
        if timeout <= 0:
            return 0.0, None
        while True:
            self.start()
            time.sleep(0.5)
            got = self.stop()
            waited = time.perf_counter() - t0
            if got is None or got < share or waited >= timeout:
                return waited, got


def machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform(), "git_commit": commit,
            "memory_dir": os.environ.get(MEMORY_ENV) or "/dev/shm"}


# ---------------------------------------------------------------------------- the state and the step


class Loop:
    """The model, its AdamW and one real training step on random bytes."""

    def __init__(self, config: str, batch: int, seq: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.cfg = CONFIGS[config]
        self.model = GPT(self.cfg)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.seq = min(seq, self.cfg.block_size)
        self.batch = batch
        self.gen = torch.Generator().manual_seed(seed)

    def live(self) -> list[torch.Tensor]:
        """Parameters, exp_avg, exp_avg_sq: the bytes the tier copies on its thread (its ``step`` scalars aside)."""
        out: list[torch.Tensor] = []
        for p in self.model.parameters():
            out.append(p.detach())
            s = self.opt.state.get(p, {})
            out.extend(s[k] for k in ("exp_avg", "exp_avg_sq") if k in s)
        return out

    def step(self, ck: Checkpointer | None, step: int, rec: dict[str, list[float]] | None) -> None:
        """One step: forward + backward, AdamW's step, ``ck.step_done`` (timed into ``rec``)."""
        t0 = time.perf_counter()
        x = torch.randint(0, 256, (self.batch, self.seq + 1), generator=self.gen)
        _, loss = self.model(x[:, :-1], x[:, 1:])
        assert loss is not None
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if ck is not None:
            ck.step_done(step, loss=float(loss.detach()))
        t3 = time.perf_counter()
        if rec is not None:
            rec["iter_s"].append(t3 - t0)
            rec["fwd_bwd_s"].append(t1 - t0)
            rec["opt_s"].append(t2 - t1)
            rec["step_done_s"].append(t3 - t2)


# ---------------------------------------------------------------------------- the floors


class Floors:
    """memcpy of the live bytes into a touched buffer and into a touched ``/dev/shm`` mapping; their sha256."""

    def __init__(self, tensors: list[torch.Tensor], shm_dir: Path) -> None:
        self.srcs = [st.as_bytes(t) for t in tensors]
        self.nbytes = sum(s.numel() for s in self.srcs)
        self.ram = torch.empty(self.nbytes, dtype=torch.uint8)
        self.ram.fill_(1)  # every page touched: a training loop's staging buffer is allocated once
        shm_dir.mkdir(parents=True, exist_ok=True)
        self.path = shm_dir / f"ripresa-bench-memory-{os.getpid()}.floor"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            os.posix_fallocate(fd, 0, self.nbytes)
            self.mm: mmap.mmap | None = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.shm: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.shm.fill_(1)
        self.samples: dict[str, list[float]] = {"floor.memcpy": [], "floor.memcpy_shm": [], "floor.sha256": []}

    @staticmethod
    def _copy(srcs: list[torch.Tensor], dst: torch.Tensor) -> float:
        t0 = time.perf_counter()
        off = 0
        for s in srcs:
            n = s.numel()
            dst[off : off + n].copy_(s)
            off += n
        return time.perf_counter() - t0

    def _sha256(self) -> float:
        assert self.mm is not None
        t0 = time.perf_counter()
        h = hashlib.sha256()
        mv = memoryview(self.mm)
        try:
            for a in range(0, self.nbytes, 16 << 20):  # the tier's piece (store/memory.PIECE)
                h.update(mv[a : a + (16 << 20)])
        finally:
            mv.release()
        h.hexdigest()
        return time.perf_counter() - t0

    def sample(self, reverse: bool, copies: int) -> None:
        """``copies`` samples of each memcpy, alternating their order, and one sha256."""
        assert self.shm is not None
        shm = self.shm
        order: list[tuple[str, Callable[[], float]]] = [
            ("floor.memcpy", lambda: self._copy(self.srcs, self.ram)),
            ("floor.memcpy_shm", lambda: self._copy(self.srcs, shm))]
        for i in range(copies):
            for key, fn in (reversed(order) if (i % 2 == 1) != reverse else order):
                self.samples[key].append(fn())
        self.samples["floor.sha256"].append(self._sha256())

    def close(self) -> None:
        self.shm = None
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
            self.mm = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


# ---------------------------------------------------------------------------- the arms


def new_record() -> dict[str, list[float]]:
    return {k: [] for k in ("iter_s", "fwd_bwd_s", "opt_s", "step_done_s", "capture_stall_s", "step_wait_s",
                            "settle_wait_s")}


class MemoryArm:
    """``Checkpointer(every=0, memory_every=1)`` and what its tier reports; kept for the whole run (its two slots
    are allocated once, as in a training run)."""

    def __init__(self, run: Path, state: TrainingState) -> None:
        self.ck = Checkpointer(run, state, every=0, memory_every=1, handle_signals=False, fresh=True,
                               save_on_close=False)
        self.ck.resume()
        mem = self.ck.memory
        if mem is None or mem.tier is None:
            raise SystemExit(f"the memory tier did not start: {getattr(mem, 'off', None)}")
        self.mem = mem
        self.tier = mem.tier
        self.settles: list[float] = []
        settle = self.tier.settle

        def timed_settle() -> float:  # instrumentation only: what a capture waited for the previous hash
            waited = settle()
            self.settles.append(waited)
            return waited

        self.tier.settle = timed_settle  # type: ignore[method-assign]
        #: capture step -> (copy_s, hash_s, overlapped with the next step)
        self.thread: dict[int, tuple[float, float, bool]] = {}
        self.slot_bytes = 0

    def note_thread(self, steps: list[int], overlapped: bool) -> None:
        """The tier's copy and hash seconds of its newest committed capture, when it is one of ``steps``."""
        t = self.tier
        if t.newest_step in steps and t.newest_step not in self.thread:
            self.thread[t.newest_step] = (t.last_copy_s, t.last_hash_s, overlapped)
            slot = t.slots[t.newest_slot] if t.newest_slot is not None else None
            self.slot_bytes = slot.size if slot is not None else self.slot_bytes

    def block(self, loop: Loop, steps: list[int], rec: dict[str, list[float]], *, count_first: bool = False) -> None:
        mem = self.mem
        for i, s in enumerate(steps):
            nc, nw, ns = len(mem.capture_stalls), len(mem.step_waits), len(self.settles)
            keep = i > 0 or count_first
            loop.step(self.ck, s, rec if keep else None)
            if keep:
                rec["capture_stall_s"].append(sum(mem.capture_stalls[nc:]))
                rec["step_wait_s"].append(sum(mem.step_waits[nw:]))
                rec["settle_wait_s"].append(sum(self.settles[ns:]))
            self.note_thread(steps, overlapped=True)
        self.tier.settle()  # the last capture: copied and hashed while the loop waits (it runs alone)
        self.settles.pop()
        self.note_thread(steps, overlapped=False)
        self.end_block()

    def end_block(self) -> None:
        """Between blocks the ``off`` arm must not run with the tier's optimizer hook (it would only cost a call)."""
        hook = self.mem._hook  # noqa: SLF001 - the benchmark's own arm; re-registered at the next capture
        if hook is not None:
            hook.remove()
            self.mem._hook = None  # noqa: SLF001

    def close(self) -> None:
        self.ck.close(final_save=False)


class DiskArm:
    """``Checkpointer(every=1, asynchronous=True)`` without the memory tier: today's alternative."""

    def __init__(self, run: Path, state: TrainingState) -> None:
        self.ck = Checkpointer(run, state, every=1, asynchronous=True, handle_signals=False, fresh=True,
                               save_on_close=False)
        self.ck.resume()
        writer = self.ck.writer
        if writer is None:
            raise SystemExit("the disk arm has no background writer")
        self.waits: list[float] = []
        wait = writer.wait

        def timed_wait() -> Any:  # instrumentation only: the loop's wait for the previous save's write
            t0 = time.perf_counter()
            try:
                return wait()
            finally:
                self.waits.append(time.perf_counter() - t0)

        writer.wait = timed_wait  # type: ignore[method-assign]

    def block(self, loop: Loop, steps: list[int], rec: dict[str, list[float]],
              after: Callable[[], None] | None = None) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"stall_s": [], "prev_write_wait_s": [], "staging_s": []}
        ck = self.ck
        for i, s in enumerate(steps):
            n_st, n_w = len(ck.save_stalls), len(self.waits)
            loop.step(ck, s, rec if i > 0 else None)
            if i > 0 and len(ck.save_stalls) > n_st:
                stall = ck.save_stalls[-1]
                waited = min(stall, sum(self.waits[n_w:]))
                out["stall_s"].append(stall)
                out["prev_write_wait_s"].append(waited)
                out["staging_s"].append(stall - waited)
            if after is not None:
                after()
        return out

    def write_seconds(self) -> list[float]:
        view = self.ck.history
        path = view.path if hasattr(view, "path") else None
        out: list[float] = []
        if path is None:
            return out
        with contextlib.suppress(OSError), open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    doc = json.loads(line)
                    if doc.get("event") == "checkpoint":
                        out.append(float(doc["seconds"]))
        return out[1:]  # the first save's write is the warm-up's

    def close(self) -> None:
        self.ck.close(final_save=False)


# ---------------------------------------------------------------------------- the run


def run(a: argparse.Namespace, console: Any) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    torch.set_num_threads(a.threads)
    config = SIZES[a.size]
    t_start = time.time()
    load0 = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix=".bench-memory-", dir=a.dir or a.out))
    shm_dir = Path(os.environ.get(MEMORY_ENV) or "/dev/shm")
    loop = Loop(config, a.batch, a.seq)
    state = TrainingState(loop.model, loop.opt, config={"benchmark": "bench_memory", "size": a.size})
    arms: list[Any] = []
    floors: Floors | None = None
    rec = {"off": new_record(), "memory": new_record(), "disk": new_record()}
    others: dict[str, list[float]] = {"off": [], "memory": [], "disk": []}
    pairs: list[dict[str, Any]] = []
    share = CpuShare()
    total = 2 + 2 * a.pairs + 1
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False, disable=not console.is_terminal) as prog:
            task = prog.add_task("warm-up: the first steps, the tier's two slots", total=total)

            def note(text: str) -> None:
                prog.update(task, description=text)
                if not console.is_terminal:
                    console.print(f"  {text}")

            step = 0

            def steps(n: int) -> list[int]:
                nonlocal step
                out = list(range(step + 1, step + 1 + n))
                step += n
                return out

            # the warm-up: AdamW's moments exist, the allocator and the tier's two slots are warm
            off_ck = Checkpointer(scratch / "off", state, every=0, handle_signals=False, fresh=True,
                                  save_on_close=False)
            arms.append(off_ck)
            off_ck.resume()
            for s in steps(2):
                loop.step(off_ck, s, None)
            mem = MemoryArm(scratch / "memory", state)
            arms.append(mem)
            first = new_record()
            mem.block(loop, steps(3), first, count_first=True)
            first_captures = first["capture_stall_s"][:2]  # each allocates its slot (fallocate of the tmpfs pages)
            mem.thread.clear()
            floors = Floors(loop.live(), shm_dir)
            floors.sample(False, 1)  # warm-up of the floors (not counted)
            for v in floors.samples.values():
                v.clear()
            prog.advance(task)

            for p in range(a.pairs):
                floors.sample(p % 2 == 1, a.floor_copies)
                pair: dict[str, Any] = {"order": [], "discarded": []}
                for arm in (("off", "memory") if p % 2 == 0 else ("memory", "off")):
                    o: float | None = None
                    for attempt in range(a.retries + 1):
                        note(f"pair {p + 1}/{a.pairs}: {arm}, {a.block_steps} steps"
                             + (f" (again: others took {o or 0:.0%} of the CPU)" if attempt else ""))
                        waited, _ = share.wait_quiet(a.quiet_timeout, a.quiet_share)
                        share.start()
                        r = new_record()
                        block = steps(a.block_steps)
                        if arm == "off":
                            for i, s in enumerate(block):
                                loop.step(off_ck, s, r if i > 0 else None)
                        else:
                            mem.block(loop, block, r)
                        o = share.stop()
                        summary = {"iter_s": statistics.median(r["iter_s"]),
                                   "fwd_bwd_s": statistics.median(r["fwd_bwd_s"]), "others_cpu_share": o,
                                   "quiet_wait_s": round(waited, 3), "attempt": attempt}
                        if o is None or o < a.quiet_share or attempt == a.retries:
                            break
                        pair["discarded"].append({"arm": arm, **summary})  # disturbed: measured again
                        for st_ in block:
                            mem.thread.pop(st_, None)
                    for k, v in r.items():
                        rec[arm][k].extend(v)
                    if o is not None:
                        others[arm].append(o)
                    pair["order"].append(arm)
                    pair[arm] = {**summary, "disturbed": o is not None and o >= a.quiet_share}
                    prog.advance(task)
                pair["overhead_pct"] = 100 * (pair["memory"]["iter_s"] / pair["off"]["iter_s"] - 1)
                pairs.append(pair)

            disk_out: dict[str, list[float]] = {}
            disk_writes: list[float] = []
            if a.disk_steps > 1:
                note(f"disk: Checkpointer(every=1, asynchronous=True), {a.disk_steps} steps")
                disk = DiskArm(scratch / "disk", state)
                arms.append(disk)
                share.wait_quiet(a.quiet_timeout, a.quiet_share)
                share.start()
                disk_out = disk.block(loop, steps(a.disk_steps), rec["disk"])
                o = share.stop()
                if o is not None:
                    others["disk"].append(o)
                disk.ck.pipeline.finish()  # the last write, outside every figure
                disk_writes = disk.write_seconds()
            prog.advance(task)
            floors.sample(a.pairs % 2 == 1, a.floor_copies)  # once more after the blocks
    finally:
        for arm in reversed(arms):
            with contextlib.suppress(Exception):
                arm.close()
        if floors is not None:
            floors.close()
        shutil.rmtree(scratch, ignore_errors=True)

    live_bytes = sum(t.numel() * t.element_size() for t in loop.live())
    doc = summarize(a, config, loop, live_bytes, floors, rec, mem, first_captures, disk_out, disk_writes, others,
                    load0, t_start)
    doc["pairs_detail"] = pairs
    doc["ratios"]["step_overhead_pct_per_pair"] = {
        "median": statistics.median(p["overhead_pct"] for p in pairs),
        "min": min(p["overhead_pct"] for p in pairs),
        "quietest": min(pairs, key=lambda p: max(p["off"]["others_cpu_share"] or 0,
                                                 p["memory"]["others_cpu_share"] or 0))["overhead_pct"]}
    return doc


def summarize(a: argparse.Namespace, config: str, loop: Loop, live_bytes: int, floors: Floors | None,
              rec: dict[str, dict[str, list[float]]], mem: MemoryArm, first_captures: list[float],
              disk_out: dict[str, list[float]], disk_writes: list[float], others: dict[str, list[float]],
              load0: tuple[float, float, float], t_start: float) -> dict[str, Any]:
    assert floors is not None
    fl = {k: stats(v) for k, v in floors.samples.items()}
    m = rec["memory"]
    visible = [c + w for c, w in zip(m["capture_stall_s"], m["step_wait_s"], strict=True)]
    over = [c for c, _, o in mem.thread.values() if o]
    alone = [c for c, _, o in mem.thread.values() if not o]
    h_over = [h for _, h, o in mem.thread.values() if o]
    h_alone = [h for _, h, o in mem.thread.values() if not o]
    busy = [c + h for c, h, o in mem.thread.values() if o]
    memory = {
        "visible_stall_s": stats(visible),
        "capture_stall_s": stats(m["capture_stall_s"]),
        "step_wait_s": stats(m["step_wait_s"]),
        "settle_wait_s": stats(m["settle_wait_s"]),
        "first_capture_stall_s": [round(x, 6) for x in first_captures],
        "copy_s_overlapped": stats(over),
        "copy_s_alone": stats(alone),
        "hash_s_overlapped": stats(h_over),
        "hash_s_alone": stats(h_alone),
        "thread_busy_s": stats(busy),
        "slot_bytes": mem.slot_bytes,
        "captures": mem.mem.captures,
    }
    steps_ = {arm: {k: stats(v) for k, v in r.items() if v} for arm, r in rec.items()}
    med = {arm: (steps_[arm].get("iter_s") or {}).get("median") for arm in rec}
    mins = {arm: (steps_[arm].get("iter_s") or {}).get("min") for arm in rec}
    memcpy = fl["floor.memcpy"]
    disk = {k: stats(v) for k, v in disk_out.items()}
    disk["write_s"] = stats(disk_writes)
    step_med = med["memory"]
    hash_med = memory["hash_s_overlapped"]["median"]
    ratios = {
        "visible_stall_over_memcpy": {
            "median": ratio(memory["visible_stall_s"]["median"], memcpy["median"]),
            "min": ratio(memory["visible_stall_s"]["min"], memcpy["min"]),
            "goal": f"<= {GOAL_STALL_OVER_MEMCPY}"},
        "visible_stall_over_memcpy_shm": {
            "median": ratio(memory["visible_stall_s"]["median"], fl["floor.memcpy_shm"]["median"]),
            "min": ratio(memory["visible_stall_s"]["min"], fl["floor.memcpy_shm"]["min"])},
        "step_overhead_pct": {
            "median": None if not med["off"] or med["memory"] is None else 100 * (med["memory"] / med["off"] - 1),
            "min": None if not mins["off"] or mins["memory"] is None else 100 * (mins["memory"] / mins["off"] - 1),
            "goal": f"<= {GOAL_OVERHEAD_PCT}"},
        "fwd_bwd_slowdown_pct": {
            "median": 100 * (steps_["memory"]["fwd_bwd_s"]["median"] / steps_["off"]["fwd_bwd_s"]["median"] - 1),
            "min": 100 * (steps_["memory"]["fwd_bwd_s"]["min"] / steps_["off"]["fwd_bwd_s"]["min"] - 1)},
        "copy_overlapped_over_alone": {
            "median": ratio(memory["copy_s_overlapped"]["median"], memory["copy_s_alone"]["median"]),
            "min": ratio(memory["copy_s_overlapped"]["min"], memory["copy_s_alone"]["min"])},
        "copy_alone_over_memcpy_shm": {
            "median": ratio(memory["copy_s_alone"]["median"], fl["floor.memcpy_shm"]["median"]),
            "min": ratio(memory["copy_s_alone"]["min"], fl["floor.memcpy_shm"]["min"])},
        "hash_over_step": {"median": ratio(hash_med, step_med),
                           "min": ratio(memory["hash_s_overlapped"]["min"], mins["memory"])},
        "thread_busy_over_step": {"median": ratio(memory["thread_busy_s"]["median"], step_med),
                                  "min": ratio(memory["thread_busy_s"]["min"], mins["memory"])},
        "disk_stall_over_memcpy": {"median": ratio(disk.get("stall_s", {}).get("median"), memcpy["median"]),
                                   "min": ratio(disk.get("stall_s", {}).get("min"), memcpy["min"])},
        "disk_staging_over_memcpy": {"median": ratio(disk.get("staging_s", {}).get("median"), memcpy["median"]),
                                     "min": ratio(disk.get("staging_s", {}).get("min"), memcpy["min"])},
        "memory_stall_over_disk_stall": {
            "median": ratio(memory["visible_stall_s"]["median"], disk.get("stall_s", {}).get("median")),
            "min": ratio(memory["visible_stall_s"]["min"], disk.get("stall_s", {}).get("min"))},
    }
    keeps_up = (memory["settle_wait_s"]["median"] is not None and step_med is not None
                and memory["settle_wait_s"]["median"] <= 0.01 * step_med)
    goals = {
        "visible_stall_over_memcpy": {
            "median": ratios["visible_stall_over_memcpy"]["median"] is not None
            and ratios["visible_stall_over_memcpy"]["median"] <= GOAL_STALL_OVER_MEMCPY,
            "min": ratios["visible_stall_over_memcpy"]["min"] is not None
            and ratios["visible_stall_over_memcpy"]["min"] <= GOAL_STALL_OVER_MEMCPY},
        "step_overhead_pct": {
            "median": ratios["step_overhead_pct"]["median"] is not None
            and ratios["step_overhead_pct"]["median"] <= GOAL_OVERHEAD_PCT,
            "min": ratios["step_overhead_pct"]["min"] is not None
            and ratios["step_overhead_pct"]["min"] <= GOAL_OVERHEAD_PCT},
    }
    return {
        "benchmark": "bench_memory", "schema": SCHEMA,
        "command": "benchmarks/bench_memory.py " + " ".join(sys.argv[1:]),
        "size": a.size, "config": config, "params": sum(p.numel() for p in loop.model.parameters()),
        "live_bytes": live_bytes, "batch": loop.batch, "seq": loop.seq, "pairs": a.pairs,
        "block_steps": a.block_steps, "disk_steps": a.disk_steps, "floor_copies": a.floor_copies,
        "quiet_timeout": a.quiet_timeout, "quiet_share": a.quiet_share, "retries": a.retries, "memory_every": 1,
        "floors": fl, "steps": steps_, "memory": memory, "disk": disk, "ratios": ratios, "goals_met": goals,
        "hash_keeps_up": keeps_up,
        "others_cpu_share": {arm: stats(v) for arm, v in others.items()},
        "machine": {**machine(), "load_average_start": [round(x, 2) for x in load0],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()],
                    "wall_s": round(time.time() - t_start, 1)},
    }


# ---------------------------------------------------------------------------- printing


def f3(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def f2(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def report(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    fl, mem, st_, dk, r = doc["floors"], doc["memory"], doc["steps"], doc["disk"], doc["ratios"]
    t = Table(title=f"memory tier, {doc['size']} ({doc['params'] / 1e6:.1f}M params, "
                    f"{doc['live_bytes'] / GB:.2f} GB), memory_every=1 (seconds)")
    for c in ("figure", "median", "min", "n"):
        t.add_column(c, justify="left" if c == "figure" else "right")

    def row(name: str, s: dict[str, Any]) -> None:
        t.add_row(name, f3(s.get("median")), f3(s.get("min")), str(s.get("n", 0)))

    row("floor: memcpy, RAM buffer", fl["floor.memcpy"])
    row("floor: memcpy, /dev/shm mapping", fl["floor.memcpy_shm"])
    row("floor: sha256 of the same bytes", fl["floor.sha256"])
    row("memory: visible stall per step", mem["visible_stall_s"])
    row("  in step_done's capture", mem["capture_stall_s"])
    row("    of it: waiting for the last hash", mem["settle_wait_s"])
    row("  optimizer step waiting for the copy", mem["step_wait_s"])
    row("step: off (memory_every=0)", st_["off"]["iter_s"])
    row("step: memory (memory_every=1)", st_["memory"]["iter_s"])
    row("fwd+bwd: off", st_["off"]["fwd_bwd_s"])
    row("fwd+bwd: memory (a copy running)", st_["memory"]["fwd_bwd_s"])
    row("tier copy, overlapping a step", mem["copy_s_overlapped"])
    row("tier copy, alone", mem["copy_s_alone"])
    row("tier sha256, overlapping", mem["hash_s_overlapped"])
    row("tier sha256, alone", mem["hash_s_alone"])
    if dk.get("stall_s"):
        row("disk every=1 async: stall per save", dk["stall_s"])
        row("  waiting for the previous write", dk["prev_write_wait_s"])
        row("  the staged copy", dk["staging_s"])
        row("  write + commit (background)", dk["write_s"])
        row("  the loop in step_done (save, commit)", st_["disk"]["step_done_s"])
        row("step: disk every=1 async", st_["disk"]["iter_s"])
        row("fwd+bwd: disk (a write running)", st_["disk"]["fwd_bwd_s"])
    console.print(t)

    g = Table(title="ratios (medians / minimums)")
    for c in ("ratio", "median", "min", "goal"):
        g.add_column(c, justify="left" if c == "ratio" else "right")
    for key, label in (("visible_stall_over_memcpy", "visible stall / memcpy"),
                       ("visible_stall_over_memcpy_shm", "visible stall / memcpy to shm"),
                       ("step_overhead_pct", "step-time overhead %"),
                       ("step_overhead_pct_per_pair", "overhead % per pair (median/min)"),
                       ("fwd_bwd_slowdown_pct", "fwd+bwd slowdown % (contention)"),
                       ("copy_overlapped_over_alone", "tier copy overlapped / alone"),
                       ("copy_alone_over_memcpy_shm", "tier copy alone / memcpy to shm"),
                       ("hash_over_step", "tier sha256 / step"),
                       ("thread_busy_over_step", "tier copy+sha256 / step"),
                       ("disk_stall_over_memcpy", "disk every=1 stall / memcpy"),
                       ("disk_staging_over_memcpy", "disk staged copy / memcpy"),
                       ("memory_stall_over_disk_stall", "memory stall / disk stall")):
        v = r[key]
        met = doc["goals_met"].get(key)
        goal = v.get("goal", "")
        if met is not None:
            goal += " " + "/".join("PASS" if met[k] else "MISS" for k in ("median", "min"))
        g.add_row(label, f2(v["median"]), f2(v["min"]), goal)
    console.print(g)
    o = doc["others_cpu_share"]
    for i, p in enumerate(doc["pairs_detail"]):
        console.print(f"pair {i + 1}: step off {p['off']['iter_s']:.3f} s, memory {p['memory']['iter_s']:.3f} s: "
                      f"{p['overhead_pct']:+.1f} % (others' CPU {f2(p['off']['others_cpu_share'])} / "
                      f"{f2(p['memory']['others_cpu_share'])})")
    console.print(f"hash keeps up at memory_every=1: {'yes' if doc['hash_keeps_up'] else 'no'} "
                  f"(a capture waited a median {f3(mem['settle_wait_s']['median'])} s for the last hash)")
    console.print("other processes' CPU share during the blocks (median): "
                  + ", ".join(f"{k} {f2(v['median'])}" for k, v in o.items() if v["n"])
                  + f"; load {doc['machine']['load_average_start']} -> {doc['machine']['load_average_end']}")
    console.print("first two captures (each allocates its slot): "
                  + ", ".join(f"{x:.3f} s" for x in mem["first_capture_stall_s"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="120m",
                    help="the engine's GPT: tiny, 12m (andrea-12m) or 120m (andrea-120m: 1.46 GB of weights+m+v)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence (at most the config's block size)")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                    help="torch threads of the loop (default: torch's, one per core); another number adds "
                         "_threads<N> to the JSON's name")
    ap.add_argument("--pairs", type=int, default=4, help="pairs of blocks (off, memory), alternating their order")
    ap.add_argument("--block-steps", type=int, default=8, help="steps per block (the first is not counted)")
    ap.add_argument("--disk-steps", type=int, default=6,
                    help="steps of the asynchronous disk save at every=1 (the first is not counted; 0: skip)")
    ap.add_argument("--floor-copies", type=int, default=3,
                    help="samples of each memcpy floor per pair (and after the blocks); sha256 once each time")
    ap.add_argument("--quiet-timeout", type=float, default=20.0,
                    help="before each block, wait up to S seconds for other processes to leave the CPU (0: never)")
    ap.add_argument("--quiet-share", type=float, default=0.10,
                    help="the share of the CPU other processes may use for a block to start")
    ap.add_argument("--retries", type=int, default=1,
                    help="redo a block during which other processes took >= --quiet-share of the CPU, at most R "
                         "times (0: keep every block); the discarded blocks stay in the JSON")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder for the run folders (default: --out)")
    a = ap.parse_args()
    if a.block_steps < 2 or a.pairs < 1 or a.batch < 1 or a.seq < 1 or a.threads < 1 or a.disk_steps < 0 \
            or a.floor_copies < 1 or a.retries < 0:
        ap.error("need --block-steps >= 2, --pairs >= 1, --batch/--seq/--threads/--floor-copies >= 1, "
                 "--disk-steps >= 0")

    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 100)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the finally blocks clean up
    a.out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        doc = run(a, console)
    threads = "" if a.threads == DEFAULT_THREADS else f"_threads{a.threads}"
    path = a.out / f"bench_memory_{a.size}{threads}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    report(doc, console)
    console.print(f"wrote {path} ({doc['machine']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
