#!/usr/bin/env python
"""Where the general save's CPU goes, beyond a raw durable write and sha256 of the same bytes.

One process, the same AdamW state as ``bench_checkpoint.py`` (``--params`` N,
12·N bytes in fp32). ``--repeat`` times each, alternating:

* ``raw``: the tensors' bytes ``write`` n + ``fsync`` (the write floor);
* ``sha256``: hashlib over the same bytes in memory (the hash floor);
* ``general``: ``GeneralBackend.save`` (snapshot, split, header, the tensor
  file streamed and hashed, companion, fsyncs, renames, marker, the check
  after the save).

CPU is counted per thread with ``pthread_getcpuclockid`` (the training
thread, ripresa's sha256 helper thread) and for the whole process
(``getrusage``), so the helper thread's hashing is separated from the writing
done by the caller. Then one more general save runs under
``cProfile.Profile(timer=time.thread_time)``: CPU seconds (not wall) of the
calling thread per function, grouped into buckets (``write`` syscalls,
``fsync``, page-cache write-back hints, hash hand-off, snapshot/split,
header/companion, the check after the save, other).

    .venv/bin/python benchmarks/profile_general_save.py --params 20000000 --repeat 3

Prints a table and writes ``benchmarks/results/profile_general_save_<N>.json``
(``--out``). It measures CPU time, which another process's load changes far
less than wall time; the machine's load average is recorded with the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import importlib.util
import json
import os
import pstats
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

import ripresa  # noqa: E402
from ripresa.io.fsio import fsync_dir  # noqa: E402
from ripresa.store.general import GeneralBackend  # noqa: E402
from ripresa.store.store import CheckpointStore  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_checkpoint", Path(__file__).with_name("bench_checkpoint.py"))
assert _spec is not None and _spec.loader is not None
bc = importlib.util.module_from_spec(_spec)
sys.modules["bench_checkpoint"] = bc
_spec.loader.exec_module(bc)

GB = 1e9

#: cProfile bucket -> substrings of "file:function" (first match wins, in this order)
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("write syscalls (os.write: copy into the page cache)", ("<built-in method posix.write>",)),
    ("fsync (file and folder)", ("<built-in method posix.fsync>",)),
    ("write-back hint (sync_file_range)", ("_ctypes", "CFuncPtr", "sync_file_range")),
    ("hash hand-off to the helper thread (submit, wait)", ("thread.py", "threading.py", "_base.py",
                                                           "<method 'acquire'", "<method 'put'")),
    ("sha256 on the calling thread (small pieces)", ("<method 'update' of '_hashlib",
                                                     "<built-in method _hashlib")),
    ("tensor views (memoryview, numpy, view)", ("<method 'numpy'", "<method 'view'", "<method 'reshape'",
                                                "<method 'cast'", "memoryview")),
    ("snapshot, state_dict, split", ("state_dict", "split_state", "snapshot", "optimizer_record",
                                     "model_aliases", "formats/general.py", "core/")),
    ("header and companion (json)", ("json", "header_bytes", "companion")),
    ("the check after the save (validate_general)", ("validate_general", "marker_checks", "parse_header")),
]


def thread_cpu(t: threading.Thread) -> float:
    """CPU seconds of a live thread (pthread_getcpuclockid)."""
    assert t.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def hasher_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name.startswith("ripresa-sha256")), None)


def process_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure(fn) -> dict[str, float]:
    gc.collect()
    os.sync()
    main, helper = threading.current_thread(), hasher_thread()
    m0, h0 = thread_cpu(main), (thread_cpu(helper) if helper else 0.0)
    p0, w0 = process_cpu(), time.perf_counter()
    fn()
    wall = time.perf_counter() - w0
    p1, m1 = process_cpu(), thread_cpu(main)
    h1 = thread_cpu(helper) if helper else 0.0
    return {"wall_s": wall, "process_cpu_s": p1 - p0, "caller_cpu_s": m1 - m0, "hasher_cpu_s": h1 - h0,
            "loadavg_1min": os.getloadavg()[0]}


def bucket_of(name: str) -> str:
    for bucket, needles in BUCKETS:
        if any(n in name for n in needles):
            return bucket
    return "other Python (the save's own code)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=20_000_000, help="parameters N (12·N bytes); default 20,000,000")
    ap.add_argument("--repeat", type=int, default=3, help="samples of each method (median); default 3")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder on the disk to measure (default: --out)")
    ap.add_argument("--top", type=int, default=15, help="functions listed by CPU on the calling thread")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".profile-scratch-", dir=args.dir or args.out))
    load_start = os.getloadavg()
    try:
        model, opt = bc.build_state(args.params)
        state = ripresa.TrainingState(model, opt)
        host = bc.flat_tensors(model, opt)
        logical = sum(t.numel() * t.element_size() for t in host)
        store = CheckpointStore(scratch / "general")
        backend = GeneralBackend(store)
        step = [0]

        def set_step(s: int) -> ripresa.Progress:
            for pst in opt.state.values():
                if torch.is_tensor(pst.get("step")):
                    pst["step"].fill_(s)
            return ripresa.Progress(step=s)

        def raw() -> None:
            path = scratch / "raw.bin"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in host:
                    bc._write_all(fd, bc.tbytes(t))
                os.fsync(fd)
            finally:
                os.close(fd)
            path.unlink()

        def sha() -> None:
            h = hashlib.sha256()
            for t in host:
                h.update(bc.tbytes(t))
            h.digest()

        def general() -> None:
            step[0] += 1
            backend.save(step[0], state, set_step(step[0]))
            backend.delete(step[0])
            fsync_dir(backend.folder)

        general()  # warm-up: the hasher thread, imports, first allocations
        samples: dict[str, list[dict[str, float]]] = {"raw": [], "sha256": [], "general": []}
        fns = {"raw": raw, "sha256": sha, "general": general}
        for i in range(args.repeat):
            order = list(fns) if i % 2 == 0 else list(reversed(fns))
            for k in order:
                samples[k].append(measure(fns[k]))
                s = samples[k][-1]
                print(f"{k:<8} wall {s['wall_s']:.3f} s  process CPU {s['process_cpu_s']:.3f} s  "
                      f"caller {s['caller_cpu_s']:.3f} s  sha256 thread {s['hasher_cpu_s']:.3f} s  "
                      f"load {s['loadavg_1min']:.1f}", flush=True)
        gbs = logical / GB
        med = {k: {f: statistics.median(s[f] for s in v) / (gbs if f != "loadavg_1min" and f != "wall_s" else 1)
                   for f in v[0]} for k, v in samples.items()}

        # one more general save under cProfile, CPU time of the calling thread
        prof = cProfile.Profile(timer=time.thread_time)
        step[0] += 1
        s_prog = set_step(step[0])
        gc.collect()
        os.sync()
        prof.enable()
        backend.save(step[0], state, s_prog)
        prof.disable()
        backend.delete(step[0])
        stats = pstats.Stats(prof)
        buckets: dict[str, float] = {}
        rows = []
        for (file, line, func), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            name = f"{file}:{line}:{func}" if line else func
            rows.append((tt, nc, name))
            b = bucket_of(f"{file}:{func}" if line else func)
            buckets[b] = buckets.get(b, 0.0) + tt
        rows.sort(reverse=True)
        total_caller = sum(buckets.values())

        extra = med["general"]["process_cpu_s"] - med["raw"]["process_cpu_s"] - med["sha256"]["process_cpu_s"]
        print(f"\n{args.params:,} params, {gbs:.3f} GB; medians of {args.repeat}, CPU-s per GB "
              f"(load average at start {load_start[0]:.1f}, now {os.getloadavg()[0]:.1f})")
        print(f"{'':<10}{'process':>9}{'caller':>9}{'sha256 thr':>11}{'wall s':>9}")
        for k in fns:
            m = med[k]
            print(f"{k:<10}{m['process_cpu_s']:9.3f}{m['caller_cpu_s']:9.3f}{m['hasher_cpu_s']:11.3f}{m['wall_s']:9.3f}")
        print(f"general - raw - sha256 = {extra:+.3f} CPU-s/GB")
        print(f"\ncalling thread of one general save under cProfile(timer=thread_time): {total_caller:.3f} CPU-s "
              f"({total_caller / gbs:.3f} CPU-s/GB)")
        for b, v in sorted(buckets.items(), key=lambda kv: -kv[1]):
            print(f"  {v / gbs:7.3f} CPU-s/GB  {b}")
        print(f"\ntop {args.top} functions by own CPU on the calling thread:")
        for tt, nc, name in rows[: args.top]:
            print(f"  {tt:8.4f} s  {nc:7d} calls  {name[-110:]}")
        result: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "params": args.params, "bytes": logical, "repeat": args.repeat,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "cores": os.cpu_count(),
            "cpu_model": bc._cpu_model(), "git_commit": bc._git("rev-parse", "HEAD"),
            "samples": samples,
            "median_cpu_s_per_gb": med,
            "general_minus_raw_minus_sha256_cpu_s_per_gb": extra,
            "caller_profile_cpu_s_per_gb": {b: v / gbs for b, v in buckets.items()},
            "caller_profile_top": [{"own_cpu_s": tt, "calls": nc, "function": name} for tt, nc, name in rows[:40]],
        }
        path = args.out / f"profile_general_save_{args.params}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {path}")
        store.close()
        return 0
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
