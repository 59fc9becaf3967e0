#!/usr/bin/env python
"""Side-by-side checkpoint benchmark: ripresa against the floor and the libraries.

One process, one AdamW-shaped float32 state of ``--params`` parameters
(weights + ``exp_avg`` + ``exp_avg_sq`` = 12·N bytes, as per-parameter tensors
of a real ``torch.optim.AdamW`` after one step). Four figures:

1. **durable save**: ripresa ``CheckpointStore.save`` (companion and commit
   marker included) vs a raw ``write`` + ``fsync`` of the same bytes (the
   floor), ``torch.save`` + ``fsync``, safetensors ``save_file`` + ``fsync``,
   and ``torch.distributed.checkpoint.save`` (``FileSystemWriter(sync_files=True)``).
2. **blocking stall** of an asynchronous save: ``AsyncCheckpointWriter.save``
   vs ``torch.distributed.checkpoint.async_save`` vs a plain memcpy of the
   same bytes into a preallocated buffer (and vs the synchronous save of 1.).
3. **cold resume**: ``CheckpointStore.load`` (read + full sha256 check) vs
   ``np.fromfile`` of the same file, the page cache dropped before each.
4. **write amplification and CPU cost**: ``/proc/self/io`` ``write_bytes``
   per logical byte, and CPU-seconds (user + sys) per GB, for every method.

The general generation format (``step_NNNNNN.safetensors``, docs/FORMAT.md)
is measured the same way through ``GeneralBackend`` (``save``; ``capture`` with
staging = the background save's stall; ``load`` of a committed generation,
cold), against max(raw write, sha256 of the same bytes), memcpy and
max(cold read, sha256) — the targets of issue 12, item 8. ``--dtype bf16``
measures bfloat16 parameters and moments (the .bin rows need float32 and are
left out).

Sharded general generations (issue 24): ``save.shards_K`` (``GeneralBackend.save`` with
``SaveOptions(shard_threshold=0, shards=K)``, K = ``--shards``, default 1,2,4) against
max(raw write, sha256 / K), and ``resume.shards_K`` (``ShardsBackend`` check_to_resume + load,
cold) against max(cold read, sha256 / K), in a "shard scaling" table with, under it, a model
(not a measurement) of an 84 GB state on a 64-core host. ``stall.general_budget``: a background
save's capture with ``staging_budget`` = ``--budget-fraction`` of the state (default 0.25): the
loop's wait, beside ``stall.general_async`` and ``stall.memcpy``.

Methods of a group run alternately forward and backward within each pair;
figures are the median of ``--pairs`` pairs (min and max kept too). Every
output is deleted right after its measurement; the scratch folder is removed
at the end, also on error or SIGTERM.

    .venv/bin/python benchmarks/bench_checkpoint.py                 # 120M (ANDREA-120M)
    .venv/bin/python benchmarks/bench_checkpoint.py --params 12800000 --pairs 5
    .venv/bin/python benchmarks/bench_checkpoint.py --device cuda     # the state on the GPU

``--device cuda`` keeps the parameters and AdamW moments on the GPU: the
"memcpy" row becomes a device-to-host copy of the same bytes into the pinned
staging buffer, the figure the async stall is held against; the raw-write and
sha256 floors work on a host copy of the same bytes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:  # run from a checkout without `pip install -e`
    sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ripresa  # noqa: E402
from ripresa.formats import safetensors_file as st  # noqa: E402
from ripresa.formats.andrea_bin import read_bin  # noqa: E402
from ripresa.formats.bin_state import bin_arrays, companion_snapshot  # noqa: E402
from ripresa.io.fsio import fsync_dir, read_exact_hashing  # noqa: E402
from ripresa.store.async_save import AsyncCheckpointWriter  # noqa: E402
from ripresa.store.backend import backend_of  # noqa: E402
from ripresa.store.folder import SaveOptions  # noqa: E402
from ripresa.store.general import GeneralBackend, general_paths  # noqa: E402
from ripresa.store.shards import ShardsBackend  # noqa: E402
from ripresa.store.store import CheckpointStore, generation_paths  # noqa: E402

SCHEMA = "ripresa-bench-checkpoint/1"
DEFAULT_PARAMS = 120_000_000  # ANDREA-120M
GB = 1e9

#: A comparator: a method key, or ("max" | "min" | "sum", (comparator, ...)) of the medians (and,
#: for the "ratio of mins", of the minimums) of several methods, e.g. max(raw write, sha256) — the
#: floor of a save that writes and hashes the same bytes — or ("div", (comparator, K)) /
#: ("mul", (comparator, F)): a comparator divided by K (sha256 spread over K workers) or times F.
Comparator = str | tuple[str, tuple[Any, ...]]
SAVE_FLOOR: Comparator = ("max", ("save.raw", "hash.sha256"))
COLD_READ: Comparator = ("min", ("resume.general_fromfile", "resume.general_read_nohash"))
LOAD_FLOOR: Comparator = ("max", (COLD_READ, "hash.sha256"))

#: --shards: the shard counts K measured by default (save.shards_K, resume.shards_K)
DEFAULT_SHARDS = (1, 2, 4)
#: --budget-fraction: the staging budget of stall.general_budget, as a share of the state
DEFAULT_BUDGET_FRACTION = 0.25
#: the "on paper" model: a 7B-parameter fp32 + AdamW state (12 bytes a parameter), on a 64-core host
MODEL_STATE_BYTES = 84 * GB
MODEL_CORES = 64
MODEL_SHARDS = (8, 16, 32, 64)
#: a staging budget's layout is one file (never sharded), as stall.general_async's: the two stalls compare
ONE_FILE = 1 << 62


def save_floor_k(k: int) -> Comparator:
    """max(raw write, sha256 / K): the floor of a save whose hashing is spread over K workers."""
    return ("max", ("save.raw", ("div", ("hash.sha256", k))))


def load_floor_k(k: int) -> Comparator:
    """max(cold read, sha256 / K): the floor of a load whose hashing is spread over K workers."""
    return ("max", (COLD_READ, ("div", ("hash.sha256", k))))


def budget_floor(fraction: float) -> Comparator:
    """What a budgeted capture must at least do in the loop's thread: write and hash the part beyond
    the budget, (1 - f) · max(raw write, sha256), and copy the rest, f · memcpy."""
    return ("sum", (("mul", (SAVE_FLOOR, round(1.0 - fraction, 6))), ("mul", ("stall.memcpy", round(fraction, 6)))))

#: (key, figure, comparator or None, target operator, target value, explanation).
#: The general format's targets are issue 24's (at the floor: 1.1 x the floor, the stall 1.2 x memcpy); the
#: .bin ones are fp32 only.
TARGETS: list[tuple[str, str, Comparator | None, str, float, str]] = [
    ("general_save_over_safetensors", "save.general", "save.safetensors", "<=", 1.0,
     "general format durable save (GeneralBackend.save: marker, fsyncs) vs safetensors save_file + fsync"),
    ("general_save_over_floor", "save.general", SAVE_FLOOR, "<=", 1.1,
     "general format durable save vs max(raw write+fsync, sha256 in memory) of the same bytes"),
    ("general_stall_over_memcpy", "stall.general_async", "stall.memcpy", "<=", 1.2,
     "general format background-save stall (GeneralBackend.capture with staging) vs memcpy"),
    ("general_load_over_floor", "resume.general_load", LOAD_FLOOR, "<=", 1.1,
     "general format cold load + sha256 check vs max(cold read, sha256 in memory) of the same file"),
    ("write_amplification_general", "save.general", None, "<=", 1.02,
     "bytes written (/proc/self/io write_bytes) / logical bytes, general format save"),
    ("save_ripresa_over_raw", "save.ripresa", "save.raw", "<=", 1.15,
     "durable save vs raw write+fsync of the same bytes (the floor)"),
    ("save_ripresa_over_floor", "save.ripresa", SAVE_FLOOR, "<=", 1.1,
     "ANDREA .bin durable save vs max(raw write+fsync, sha256 in memory) of the same bytes"),
    ("save_ripresa_over_torch_save", "save.ripresa", "save.torch_save", "<", 1.0,
     "durable save vs torch.save + fsync"),
    ("save_ripresa_over_safetensors", "save.ripresa", "save.safetensors", "<", 1.0,
     "durable save vs safetensors save_file + fsync"),
    ("save_ripresa_over_dcp", "save.ripresa", "save.dcp", "<", 1.0,
     "durable save vs torch.distributed.checkpoint.save (sync_files=True)"),
    ("stall_ripresa_over_memcpy", "stall.ripresa_async", "stall.memcpy", "<=", 1.5,
     "async save stall (last_stall_s) vs memcpy into a preallocated buffer"),
    ("stall_ripresa_over_sync_save", "stall.ripresa_async", "save.ripresa", "<=", 0.1,
     "async save stall vs the synchronous ripresa save"),
    ("stall_ripresa_over_dcp_async", "stall.ripresa_async", "stall.dcp_async", "<", 1.0,
     "async save stall vs torch.distributed.checkpoint.async_save stall"),
    ("resume_ripresa_over_fromfile", "resume.ripresa_load", "resume.np_fromfile", "<=", 1.3,
     "cold load + full sha256 check vs np.fromfile of the same file, cold"),
    ("write_amplification_ripresa", "save.ripresa", None, "<=", 1.02,
     "bytes written (/proc/self/io write_bytes) / logical bytes, ripresa save"),
]

#: (key, figure, comparator, target (<=), table label, explanation): shown, not counted in targets_met
INFO_RATIOS: list[tuple[str, str, Comparator, float, str, str]] = [
    ("general_copy_over_memcpy", "stall.general_copy", "stall.memcpy", 1.3,
     "general staging copy alone (info)",
     "info: the staging copy inside the general stall (GeneralBackend._stage) vs memcpy"),
    ("general_save_over_raw", "save.general", "save.raw", 1.2, "general save vs raw write (info)",
     "info: general format durable save vs raw write+fsync alone"),
    ("general_load_over_read_nohash", "resume.general_load", "resume.general_read_nohash", 1.2,
     "general load vs read w/o hash (info)",
     "info: general cold load + sha256 vs reading the same file into tensors without the hash"),
    ("stall_caller_over_memcpy", "stall.ripresa_async_caller", "stall.memcpy", 1.5,
     "stall incl. snapshot (info)",
     "info: stall as the training loop sees it (bin_arrays + companion_snapshot + save()) vs memcpy"),
    ("stall_caller_over_ripresa", "stall.ripresa_async_caller", "save.ripresa", 0.1,
     "stall incl. snapshot (info)",
     "info: stall as the training loop sees it vs the synchronous save"),
    ("resume_over_read_nohash", "resume.ripresa_load", "resume.read_bin_nohash", 1.3,
     "resume vs read w/o hash (info)",
     "info: cold load + sha256 vs the same reader without the hash (the faster read floor here)"),
]

#: method key -> (group, label, what the primary figure is)
METHODS: dict[str, tuple[str, str, str]] = {
    "save.raw": ("save", "raw write+fsync", "seconds to durable"),
    "hash.sha256": ("hash", "sha256 in memory", "seconds (hashlib over the same tensors)"),
    "save.general": ("save", "general GeneralBackend.save", "seconds to durable (companion + marker)"),
    "save.ripresa": ("save", "ripresa CheckpointStore.save", "seconds to durable (companion + marker)"),
    "save.torch_save": ("save", "torch.save + fsync", "seconds to durable"),
    "save.safetensors": ("save", "safetensors save_file + fsync", "seconds to durable"),
    "save.dcp": ("save", "DCP save (sync_files)", "seconds to durable"),
    "stall.ripresa_async": ("stall", "ripresa AsyncCheckpointWriter.save", "last_stall_s"),
    "stall.ripresa_async_caller": ("stall", "ripresa async incl. snapshot", "bin_arrays + companion_snapshot + save()"),
    "stall.dcp_async": ("stall", "DCP async_save", "seconds until async_save returns"),
    "stall.memcpy": ("stall", "memcpy to preallocated buffer", "seconds"),
    "stall.general_async": ("stall", "general capture (background save)", "seconds capture() blocks"),
    "stall.general_copy": ("stall", "general staging copy", "seconds of _stage() inside capture()"),
    "complete.ripresa_async": ("complete", "ripresa async, until committed", "seconds until wait() returns"),
    "complete.dcp_async": ("complete", "DCP async_save, until done", "seconds until the future resolves"),
    "complete.general_async": ("complete", "general background save, until committed", "capture + commit seconds"),
    "stall.general_budget": ("stall", "general capture, staging budget",
                             "seconds capture() blocks: the part beyond the budget written by the loop, the rest copied"),
    "complete.general_budget": ("complete", "general budget save, until committed", "capture + commit seconds"),
    "resume.ripresa_load": ("resume", "ripresa CheckpointStore.load (sha256)", "seconds, cold cache"),
    "resume.np_fromfile": ("resume", "np.fromfile", "seconds, cold cache"),
    "resume.read_bin_nohash": ("resume", "ripresa read_bin, no hash", "seconds, cold cache (diagnostic)"),
    "resume.general_load": ("resume", "general load + sha256", "seconds, cold cache (validate_general load=True)"),
    "resume.general_fromfile": ("resume", "np.fromfile (general file)", "seconds, cold cache"),
    "resume.general_read_nohash": ("resume", "read general file, no hash", "seconds, cold cache (readv 8 MiB)"),
}
#: methods of the ANDREA .bin path (float32 + Adam only: measured with --dtype fp32)
BIN_METHODS = {"save.ripresa", "stall.ripresa_async", "stall.ripresa_async_caller", "complete.ripresa_async",
               "resume.ripresa_load", "resume.np_fromfile", "resume.read_bin_nohash"}


def shard_keys(k: int) -> tuple[str, str]:
    """The save and the load method of K shards."""
    return f"save.shards_{k}", f"resume.shards_{k}"


def register_shards(shards: tuple[int, ...] | list[int]) -> None:
    """Add save.shards_K and resume.shards_K to METHODS (and their chart labels) for every K."""
    for k in shards:
        save, load = shard_keys(k)
        METHODS[save] = ("save", f"sharded save, K={k} (GeneralBackend.save)",
                         "seconds to durable (K shard files, index, companion, one marker)")
        METHODS[load] = ("resume", f"sharded load + sha256, K={k}",
                         "seconds, cold cache (ShardsBackend check_to_resume + load)")
        PLOT_LABELS[save] = f"sharded\nsave K={k}"
        PLOT_LABELS[load] = f"sharded load\nK={k}"


#: the measured methods by group, in the order each pair runs them (the shard methods: groups_for)
GROUPS: list[tuple[str, list[str]]] = [
    ("save", ["save.raw", "hash.sha256", "save.general", "save.ripresa", "save.torch_save",
              "save.safetensors", "save.dcp"]),
    ("stall", ["stall.memcpy", "stall.general_async", "stall.general_budget", "stall.ripresa_async",
               "stall.dcp_async"]),
    ("resume", ["resume.general_fromfile", "resume.general_read_nohash", "resume.general_load",
                "resume.np_fromfile", "resume.ripresa_load", "resume.read_bin_nohash"]),
]


def groups_for(dtype: str, shards: tuple[int, ...] | list[int] = DEFAULT_SHARDS) -> list[tuple[str, list[str]]]:
    """GROUPS with save.shards_K after save.general and resume.shards_K after resume.general_load for
    each K of ``shards``; without the .bin methods for a dtype the .bin cannot hold."""
    out: list[tuple[str, list[str]]] = []
    for g, keys in GROUPS:
        keys = [k for k in keys if dtype == "fp32" or k not in BIN_METHODS]
        after, pick = {"save": ("save.general", 0), "resume": ("resume.general_load", 1)}.get(g, (None, 0))
        if after is not None:
            i = keys.index(after) + 1
            keys[i:i] = [shard_keys(k)[pick] for k in shards]
        out.append((g, keys))
    return out


#: short x-axis labels of the chart
PLOT_LABELS = {
    "save.raw": "raw write\n+ fsync", "save.ripresa": "ripresa\nsave", "save.torch_save": "torch.save\n+ fsync",
    "save.safetensors": "safetensors\n+ fsync", "save.dcp": "DCP save\n(sync_files)",
    "stall.memcpy": "memcpy", "stall.ripresa_async": "ripresa\nasync stall",
    "stall.ripresa_async_caller": "ripresa async\n+ snapshot", "stall.dcp_async": "DCP\nasync_save",
    "resume.np_fromfile": "np.fromfile", "resume.read_bin_nohash": "ripresa read\n(no hash)",
    "resume.ripresa_load": "ripresa load\n(+ sha256)",
    "hash.sha256": "sha256\n(in memory)", "save.general": "general\nsave",
    "stall.general_async": "general\ncapture stall", "stall.general_copy": "general\nstaging copy",
    "resume.general_load": "general load\n(+ sha256)", "resume.general_fromfile": "np.fromfile\n(general)",
    "resume.general_read_nohash": "general read\n(no hash)",
    "stall.general_budget": "general\nbudget stall",
}
register_shards(DEFAULT_SHARDS)


# ---------------------------------------------------------------------------- machine facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(flags & {"sha_ni", "avx2", "avx512f", "aes"})
    except OSError:
        pass
    return []


def _mount_of(path: Path) -> dict[str, str]:
    """Filesystem type, device and mount point of ``path`` (from /proc/self/mountinfo)."""
    best: dict[str, str] = {"fstype": "unknown", "source": "unknown", "mount_point": "/"}
    try:
        real = os.path.realpath(path)
        best_len = -1
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            fields = left.split()
            mnt = fields[4].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
                rf = right.split()
                best_len = len(mnt)
                best = {"fstype": rf[0], "source": rf[1] if len(rf) > 1 else "?", "mount_point": mnt}
    except OSError:
        pass
    return best


def _block_stat_path(path: Path) -> Path | None:
    st = os.stat(path)
    p = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return p if p.exists() else None


def pressure() -> dict[str, float]:
    """Linux PSI: % of the last 60 s some task waited for CPU / for I/O (contention)."""
    out: dict[str, float] = {}
    for res in ("cpu", "io"):
        try:
            for line in Path(f"/proc/pressure/{res}").read_text().splitlines():
                if line.startswith("some"):
                    out[f"{res}_some_avg60"] = float(line.split("avg60=")[1].split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine_facts(scratch: Path) -> dict[str, Any]:
    import safetensors

    mem_total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    dirty = {}
    for knob in ("dirty_ratio", "dirty_background_ratio", "dirty_expire_centisecs"):
        try:
            dirty[knob] = int(Path(f"/proc/sys/vm/{knob}").read_text())
        except (OSError, ValueError):
            pass
    st = os.stat(scratch)
    rotational = None
    try:
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        q = dev / "queue" / "rotational"
        if not q.exists():
            q = dev.parent / "queue" / "rotational"
        rotational = int(q.read_text()) if q.exists() else None
    except (OSError, ValueError):
        pass
    dirty_src = _git("status", "--porcelain", "--", "src")
    # the code measured, file by file: src/ may differ from git_commit while others edit it
    sources = {}
    for mod in ("io.fsio", "store.store", "store.async_save", "formats.bin_state", "formats.andrea_bin",
                "store.general", "formats.general", "formats.safetensors_file", "store.folder", "store.shards"):
        path = Path(sys.modules[f"ripresa.{mod}"].__file__)
        sources[str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)] = (
            hashlib.sha256(path.read_bytes()).hexdigest())
    return {
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem_total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "safetensors": safetensors.__version__,
        "ripresa": ripresa.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_src_modified": bool(dirty_src),
        "source_sha256": sources,
        "scratch_dir": str(scratch),
        "filesystem": _mount_of(scratch),
        "device_rotational": rotational,
        "vm": dirty,
    }


# ---------------------------------------------------------------------------- meters


def _proc_io() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    except (OSError, ValueError):
        pass
    return out


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float | None:
    """CPU-seconds all processes of the machine spent busy (from /proc/stat), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / _CLK_TCK


class OthersMeter:
    """What *other* processes did over a window: their share of the machine's CPU
    (0..1) and the bytes they moved on the scratch folder's block device."""

    def __init__(self, block_stat: Path | None) -> None:
        self.cores = os.cpu_count() or 1
        self.block_stat = block_stat
        self._t = self._busy = self._own = 0.0
        self._dev = self._own_io = 0

    def _device_bytes(self) -> int | None:
        """Sectors read + written by the whole device, in bytes."""
        if self.block_stat is None:
            return None
        try:
            f = self.block_stat.read_text().split()
            return (int(f[2]) + int(f[6])) * 512
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _own_io_bytes() -> int:
        io = _proc_io()
        return io.get("read_bytes", 0) + io.get("write_bytes", 0)

    def start(self) -> None:
        self._t, self._busy, self._own = time.perf_counter(), _machine_busy_s() or 0.0, _cpu_seconds()
        self._dev, self._own_io = self._device_bytes() or 0, self._own_io_bytes()

    def cpu_share(self) -> float | None:
        busy = _machine_busy_s()
        if busy is None:
            return None
        wall = time.perf_counter() - self._t
        others = (busy - self._busy) - (_cpu_seconds() - self._own)
        return max(0.0, others) / max(wall * self.cores, 1e-9)

    def io_bytes(self) -> float | None:
        """Device bytes not explained by this process's own reads and writes (approximate:
        the filesystem's journal and metadata of our own writes count as others')."""
        dev = self._device_bytes()
        if dev is None:
            return None
        return float(max(0, (dev - self._dev) - (self._own_io_bytes() - self._own_io)))


class Meter:
    """Wall time, CPU time, /proc/self/io and device bytes around one measurement.

    On a shared machine other processes can take the CPU or the disk in the
    middle of a sample. So, with ``quiet_timeout > 0``, before each
    measurement it waits (at most ``quiet_timeout`` seconds) for a 0.5 s
    window in which other processes use less than ``quiet_share`` of the CPU
    and move less than ``quiet_io_bytes`` on the disk; and it records what
    they did *during* the measurement (``others_cpu_share``,
    ``others_io_bytes``), so that :meth:`Bench.measure` can discard and redo
    a disturbed sample.
    """

    def __init__(self, block_stat: Path | None, *, quiet_timeout: float = 0.0, quiet_share: float = 0.1,
                 quiet_io_bytes: float = 8e6, on_wait: Callable[[str], None] | None = None) -> None:
        self.block_stat = block_stat
        self.quiet_timeout = quiet_timeout
        self.quiet_share = quiet_share
        self.quiet_io_bytes = quiet_io_bytes
        self.on_wait = on_wait

    def wait_quiet(self) -> tuple[float, float | None]:
        """(seconds waited, others' CPU share in the last window)."""
        t0 = time.perf_counter()
        if self.quiet_timeout <= 0:
            return 0.0, None
        om = OthersMeter(self.block_stat)
        while True:
            om.start()
            time.sleep(0.5)
            cpu, io = om.cpu_share(), om.io_bytes()
            waited = time.perf_counter() - t0
            quiet = (cpu is None or cpu < self.quiet_share) and (io is None or io < self.quiet_io_bytes)
            if quiet or waited >= self.quiet_timeout:
                return waited, cpu
            if self.on_wait is not None:
                self.on_wait(f"waiting for quiet (others: CPU {cpu or 0:.0%}, disk {(io or 0) / 1e6:.0f} MB)")

    def _dev_written(self) -> int | None:
        if self.block_stat is None:
            return None
        try:
            return int(self.block_stat.read_text().split()[6]) * 512
        except (OSError, ValueError, IndexError):
            return None

    def run(self, fn: Callable[[], dict[str, float] | None]) -> dict[str, float]:
        gc.collect()
        os.sync()  # nothing of an earlier measurement is still being written back
        waited, before = self.wait_quiet()
        om = OthersMeter(self.block_stat)
        io0, dev0, cpu0 = _proc_io(), self._dev_written(), _cpu_seconds()
        om.start()
        t0 = time.perf_counter()
        extra = fn() or {}
        wall = time.perf_counter() - t0
        others, others_io = om.cpu_share(), om.io_bytes()
        cpu1, io1, dev1 = _cpu_seconds(), _proc_io(), self._dev_written()
        sample = {
            "quiet_wait_s": waited,
            "others_cpu_share_before": before,
            "others_cpu_share": others,
            "others_io_bytes": others_io,
            "wall_s": wall,
            "cpu_s": cpu1 - cpu0,
            "write_bytes": float(io1.get("write_bytes", 0) - io0.get("write_bytes", 0)),
            "cancelled_write_bytes": float(
                io1.get("cancelled_write_bytes", 0) - io0.get("cancelled_write_bytes", 0)
            ),
            "read_bytes": float(io1.get("read_bytes", 0) - io0.get("read_bytes", 0)),
            "loadavg_1min": os.getloadavg()[0],
        }
        if dev0 is not None and dev1 is not None:
            sample["device_write_bytes"] = float(dev1 - dev0)
        sample.update(extra)
        return sample

    def disturbed(self, sample: dict[str, Any], logical: int) -> bool:
        """Did other processes take a real share of the CPU or the disk during ``sample``?"""
        cpu, io = sample.get("others_cpu_share"), sample.get("others_io_bytes")
        if cpu is not None and cpu >= self.quiet_share:
            return True
        # own journal/metadata is counted as others' I/O: allow 2% of the payload on top
        return io is not None and io >= self.quiet_io_bytes * 4 + 0.02 * logical


def _status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status, in bytes (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (``5`` into
    /proc/self/clear_refs, Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def drop_cache(path: Path) -> None:
    """fsync, then POSIX_FADV_DONTNEED: the next read of ``path`` comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _staging_owner(backend: Any) -> tuple[Any, str, str]:
    """(object, stage method, buffer attribute) of a general backend's staging: its StagingArea
    (``staging.stage`` / ``staging.buffer``) or, in older code, the backend's ``_stage`` / ``_staging``."""
    area = getattr(backend, "staging", None)
    if area is not None and hasattr(area, "stage") and hasattr(area, "buffer"):
        return area, "stage", "buffer"
    return backend, "_stage", "_staging"


def staging_buffer(backend: Any) -> torch.Tensor | None:
    """The reused staging buffer of a general backend (None before its first background save)."""
    owner, _, attr = _staging_owner(backend)
    return getattr(owner, attr, None)


def free_staging(backend: Any) -> None:
    owner, _, attr = _staging_owner(backend)
    setattr(owner, attr, None)


def time_staging(backend: Any, report: Callable[[float], None]) -> None:
    """Wrap a general backend's staging copy so that each call reports its seconds (the copy inside
    capture(), the stall.general_copy figure)."""
    owner, name, _ = _staging_owner(backend)
    stage = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = stage(*args, **kwargs)
        report(time.perf_counter() - t0)
        return out
    setattr(owner, name, timed)


def _step_prefix(step: int) -> str:
    return f"step_{step:06d}."


def remove_shards(store: CheckpointStore, step: int) -> None:
    """Remove sharded generation ``step`` (ShardsBackend.delete: marker first), then anything of it
    that is left (``step_NNNNNN.shards*``), and fsync the folder."""
    ShardsBackend(store).delete(step)
    for p in store.folder.glob(f"{_step_prefix(step)}shards*"):
        remove(p)
    fsync_dir(store.folder)


# ---------------------------------------------------------------------------- the state


class BenchModel(torch.nn.Module):
    """A GPT-like parameter layout summing to exactly ``n`` float32 elements."""

    def __init__(self, n: int) -> None:
        super().__init__()
        d = 768 if n >= 50_000_000 else 256 if n >= 5_000_000 else 64
        per_layer = 12 * d * d + 13 * d
        layers = min(12, (n // 2) // per_layer)
        shapes: list[tuple[str, tuple[int, ...]]] = []
        for i in range(layers):
            shapes += [
                (f"h{i}_ln1_w", (d,)), (f"h{i}_ln1_b", (d,)),
                (f"h{i}_qkv_w", (3 * d, d)), (f"h{i}_qkv_b", (3 * d,)),
                (f"h{i}_proj_w", (d, d)), (f"h{i}_proj_b", (d,)),
                (f"h{i}_ln2_w", (d,)), (f"h{i}_ln2_b", (d,)),
                (f"h{i}_fc_w", (4 * d, d)), (f"h{i}_fc_b", (4 * d,)),
                (f"h{i}_fc2_w", (d, 4 * d)), (f"h{i}_fc2_b", (d,)),
            ]
        used = layers * per_layer + 2 * d
        rows = (n - used) // d
        if rows < 1:
            raise SystemExit(f"--params {n} is too small (at least {used + d})")
        shapes += [("wte", (rows, d)), ("lnf_w", (d,)), ("lnf_b", (d,))]
        rest = n - used - rows * d
        if rest:
            shapes.append(("head_b", (rest,)))
        for name, shape in shapes:
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape)))
        assert sum(p.numel() for p in self.parameters()) == n
        self.d_model, self.n_layers = d, layers


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_state(n: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> tuple[BenchModel, torch.optim.AdamW]:
    """Model + AdamW after one real step (so exp_avg/exp_avg_sq/step exist).

    With bfloat16 parameters, torch's AdamW keeps ``exp_avg`` and
    ``exp_avg_sq`` in bfloat16 too (``zeros_like`` of the parameter): the
    state is 6·N bytes plus the float32 ``step`` scalars.
    """
    torch.manual_seed(seed)
    model = BenchModel(n).to(dtype=dtype, device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None
    gc.collect()
    return model, opt


def flat_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """weights..., exp_avg..., exp_avg_sq... as a list of per-parameter tensors."""
    params = list(model.parameters())
    return (
        [p.detach() for p in params]
        + [opt.state[p]["exp_avg"] for p in params]
        + [opt.state[p]["exp_avg_sq"] for p in params]
    )


def torch_state_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def safetensors_dict(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        out[f"model.{name}"] = p.detach()
        out[f"optim.{name}.exp_avg"] = st["exp_avg"]
        out[f"optim.{name}.exp_avg_sq"] = st["exp_avg_sq"]
        out[f"optim.{name}.step"] = st["step"].reshape(1)
    return out


def tbytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (any dtype, bfloat16 included), no copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def sha256_throughput(nbytes: int) -> float:
    """GB/s of hashlib.sha256 over in-memory data (best of 3, no disk)."""
    size = max(1 << 20, min(nbytes, 512 << 20))
    buf = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        hashlib.sha256(memoryview(buf)).digest()
        best = min(best, time.perf_counter() - t0)
    return size / best / GB


# ---------------------------------------------------------------------------- the benchmark


class Bench:
    def __init__(self, n: int, pairs: int, scratch: Path, log: Callable[[str], None], meter: Meter,
                 retries: int = 0, dtype: str = "fp32", device: str = "cpu",
                 shards: tuple[int, ...] | list[int] = DEFAULT_SHARDS,
                 budget_fraction: float = DEFAULT_BUDGET_FRACTION) -> None:
        self.n, self.pairs, self.scratch, self.log, self.retries = n, pairs, scratch, log, retries
        self.dtype = dtype
        self.shards = tuple(shards)
        self.budget_fraction = budget_fraction
        register_shards(self.shards)
        self.meter = meter
        self.samples: dict[str, list[dict[str, float]]] = {k: [] for k in METHODS}
        self.step = 0
        self.device = device
        self.model, self.opt = build_state(n, dtype=DTYPES[dtype], device=device)
        self.state = ripresa.TrainingState(self.model, self.opt)
        self.tensors = flat_tensors(self.model, self.opt)
        #: the same bytes in host memory: what the raw-write and sha256 floors read (the tensors themselves on CPU)
        self.host = self.tensors if device == "cpu" else [t.cpu() for t in self.tensors]
        assert sum(t.numel() for t in self.tensors) == 3 * n
        #: weights + m + v (the per-parameter float32 step scalars are a few bytes more)
        self.logical = sum(t.numel() * t.element_size() for t in self.tensors)
        self.with_bin = dtype == "fp32"  # the ANDREA .bin holds float32 + Adam only
        self.store = CheckpointStore(scratch / "store")
        self.async_store = CheckpointStore(scratch / "async")
        pin = None if device == "cuda" else False  # pinned staging for device tensors (the default on CUDA)
        self.writer = AsyncCheckpointWriter(self.async_store, pin_memory=pin) if self.with_bin else None
        # the general format, through its backend as the registry opens it for Checkpointer(format="general")
        # (its retention after each commit included)
        self.general_store = CheckpointStore(scratch / "general")
        self.general = backend_of("general", self.general_store)
        self.general_resume_store = CheckpointStore(scratch / "general_resume")
        self.general_resume = GeneralBackend(self.general_resume_store)
        # sharded generations (issue 24): saved through GeneralBackend, the layout from store.save_options
        self.shards_store = CheckpointStore(scratch / "shards")
        self.shards_writer = GeneralBackend(self.shards_store)
        self.shards_resume_store = CheckpointStore(scratch / "shards_resume")
        self.shards_resume_writer = GeneralBackend(self.shards_resume_store)
        self.shards_resume = ShardsBackend(self.shards_resume_store)
        self.shards_resume_steps: dict[int, int] = {}
        # a background save with a staging budget: the loop writes the part beyond it before capture returns
        self.budget_bytes = int(budget_fraction * self.logical)
        self.budget_store = CheckpointStore(scratch / "budget")
        self.budget_store.save_options = SaveOptions(shard_threshold=ONE_FILE, staging_budget=self.budget_bytes)
        self.budget = backend_of("general", self.budget_store)
        self._stage_s = 0.0

        def on_stage(seconds: float) -> None:
            self._stage_s = seconds
        time_staging(self.general, on_stage)  # times the copy inside capture()
        time_staging(self.budget, on_stage)
        self.copy_buffer: torch.Tensor | None = None
        self.resume_step: int | None = None
        self.general_resume_step: int | None = None

    def close(self) -> None:
        try:
            if self.writer is not None:
                self.writer.wait()
        except Exception:  # noqa: BLE001 - cleanup path; the error was already raised
            pass
        for store in (self.store, self.async_store, self.general_store, self.general_resume_store,
                      self.shards_store, self.shards_resume_store, self.budget_store):
            store.close()

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def set_step(self, step: int) -> ripresa.Progress:
        """The optimizer's per-parameter steps are set to ``step``, so the saved state is one
        instant (a store refuses optimizer state and progress that disagree)."""
        for pst in self.opt.state.values():
            if torch.is_tensor(pst.get("step")):
                pst["step"].fill_(step)
        return ripresa.Progress(step=step)

    def companion(self, step: int) -> dict:
        """The companion of .bin generation ``step`` (see :meth:`set_step`)."""
        return companion_snapshot(self.state, self.set_step(step))

    # ---- 1. durable saves ------------------------------------------------------------
    def save_raw(self) -> Callable[[], None]:
        path = self.scratch / "raw.bin"

        def run() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in self.host:
                    _write_all(fd, tbytes(t))
                os.fsync(fd)
            finally:
                os.close(fd)
        return self._then_remove(run, path)

    def hash_sha256(self) -> Callable[[], None]:
        """sha256 of the same bytes in memory (the other half of a checksummed save's floor)."""
        def run() -> None:
            h = hashlib.sha256()
            for t in self.host:
                h.update(tbytes(t))
            h.digest()
        return run

    def save_general(self) -> Callable[[], None]:
        """GeneralBackend.save: snapshot + split, tensor file and companion streamed (hashed while
        written) and fsync'd, renamed, folder fsync'd, commit marker, check after the save."""
        step = self.next_step()

        def run() -> None:
            self.general.save(step, self.state, self.set_step(step))

        def cleanup() -> None:
            self.general.delete(step)
            fsync_dir(self.general.folder)
        return self._then(run, cleanup)

    def save_shards(self, k: int) -> Callable[[], Callable[[], dict[str, float]]]:
        """The maker of save.shards_K: GeneralBackend.save with SaveOptions(shard_threshold=0, shards=K):
        K shard files, each written and hashed by its own worker, index, companion, one marker last."""
        def make() -> Callable[[], dict[str, float]]:
            step = self.next_step()

            def run() -> dict[str, float]:
                self.shards_store.save_options = SaveOptions(shard_threshold=0, shards=k)
                gen = self.shards_writer.save(step, self.state, self.set_step(step))
                assert gen.kind == "shards", f"save.shards_{k}: a {gen.kind!r} generation, not a sharded one"
                return {"shard_files": float(len(list(gen.path.glob("*.safetensors"))))}

            def cleanup() -> None:
                remove_shards(self.shards_store, step)
            return self._then(run, cleanup)
        return make

    def save_ripresa(self) -> Callable[[], None]:
        step = self.next_step()

        def run() -> None:
            self.store.save(step, bin_arrays(self.state), self.companion(step))

        def cleanup() -> None:
            self.store.delete(step)
            fsync_dir(self.store.folder)
        return self._then(run, cleanup)

    def save_torch(self) -> Callable[[], None]:
        path = self.scratch / "torch.pt"

        def run() -> None:
            with open(path, "wb") as f:
                torch.save(torch_state_dict(self.model, self.opt), f)
                f.flush()
                os.fsync(f.fileno())
        return self._then_remove(run, path)

    def save_safetensors(self) -> Callable[[], None]:
        from safetensors.torch import save_file

        path = self.scratch / "model.safetensors"

        def run() -> None:
            save_file(safetensors_dict(self.model, self.opt), str(path))
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return self._then_remove(run, path)

    def save_dcp(self) -> Callable[[], None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        path = self.scratch / "dcp"

        def run() -> None:
            writer = FileSystemWriter(str(path), sync_files=True)
            dcp.save(torch_state_dict(self.model, self.opt), storage_writer=writer, no_dist=True)
        return self._then_remove(run, path)

    # ---- 2. async stall ----------------------------------------------------------------
    def stall_ripresa(self) -> Callable[[], dict[str, float]]:
        step = self.next_step()

        def run() -> dict[str, float]:
            t0 = time.perf_counter()
            self.writer.save(step, bin_arrays(self.state), self.companion(step))
            t1 = time.perf_counter()
            self.writer.wait()
            t2 = time.perf_counter()
            return {"stall_s": self.writer.last_stall_s, "caller_stall_s": t1 - t0, "complete_s": t2 - t0}

        def cleanup() -> None:
            self.async_store.delete(step)
            fsync_dir(self.async_store.folder)
        return self._then(run, cleanup)

    def stall_dcp(self) -> Callable[[], dict[str, float]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        path = self.scratch / "dcp_async"

        def run() -> dict[str, float]:
            t0 = time.perf_counter()
            writer = FileSystemWriter(str(path), sync_files=True)
            fut = dcp.async_save(torch_state_dict(self.model, self.opt), storage_writer=writer, no_dist=True)
            t1 = time.perf_counter()
            upload = getattr(fut, "upload_completion", fut)
            upload.result()
            t2 = time.perf_counter()
            return {"stall_s": t1 - t0, "complete_s": t2 - t0}
        return self._then_remove(run, path)

    def stall_general(self) -> Callable[[], dict[str, float]]:
        """What a Checkpointer(format="general") background save blocks the loop for: capture()
        with staging (snapshot, split, copy of every tensor into the reused staging buffer);
        then the commit (run here in this thread, after the stall: nothing else is running)."""
        step = self.next_step()

        def run() -> dict[str, float]:
            progress = self.set_step(step)
            t0 = time.perf_counter()
            commit = self.general.capture(step, self.state, progress, None, stage=lambda x: x)
            t1 = time.perf_counter()
            commit()
            t2 = time.perf_counter()
            return {"stall_s": t1 - t0, "copy_s": self._stage_s, "complete_s": t2 - t0}

        def cleanup() -> None:
            self.general.delete(step)
            fsync_dir(self.general.folder)
        return self._then(run, cleanup)

    def stall_budget(self) -> Callable[[], dict[str, float]]:
        """A background save with ``staging_budget`` = --budget-fraction of the state: capture() copies
        the last ≤ budget bytes into staging and writes the part beyond it itself before it returns
        (the loop's wait); then the commit writes the staged part (here in this thread, after the stall)."""
        step = self.next_step()

        def run() -> dict[str, float]:
            progress = self.set_step(step)
            io0 = _proc_io()
            self._stage_s = 0.0
            t0 = time.perf_counter()
            commit = self.budget.capture(step, self.state, progress, None, stage=lambda x: x)
            t1 = time.perf_counter()
            io1 = _proc_io()
            copy_s = self._stage_s
            commit()
            t2 = time.perf_counter()
            staging = staging_buffer(self.budget)
            return {"stall_s": t1 - t0, "complete_s": t2 - t0, "copy_s": copy_s,
                    # what the loop's thread wrote during capture (the part beyond the budget)
                    "stall_write_bytes": float(io1.get("write_bytes", 0) - io0.get("write_bytes", 0)),
                    "budget_bytes": float(self.budget_bytes),
                    "staging_bytes": float(staging.numel() * staging.element_size()) if torch.is_tensor(staging)
                    else -1.0}

        def cleanup() -> None:
            self.budget.delete(step)
            fsync_dir(self.budget.folder)
        return self._then(run, cleanup)

    def stall_memcpy(self) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            assert self.copy_buffer is not None
            t0 = time.perf_counter()
            off = 0
            for t in self.tensors:
                k = t.numel() * t.element_size()
                self.copy_buffer[off : off + k].view(t.dtype).view(t.shape).copy_(t)
                off += k
            if self.device == "cuda":  # a device-to-host copy counts once it has landed
                torch.cuda.synchronize()
            return {"stall_s": time.perf_counter() - t0}
        return run

    # ---- 3. cold resume ----------------------------------------------------------------
    def _resume_files(self) -> list[Path]:
        assert self.resume_step is not None
        return list(generation_paths(self.store.folder, self.resume_step))

    def resume_ripresa(self) -> Callable[[], None]:
        def run() -> None:
            contents, _ = self.store.load(self.resume_step, expected_n=self.n)
            assert contents.digest is not None and contents.n_params == self.n
            del contents
        return self._cold(run)

    def resume_fromfile(self) -> Callable[[], None]:
        path = self._resume_files()[0]

        def run() -> None:
            a = np.fromfile(path, dtype="<f4", offset=8)
            assert a.size == 3 * self.n
            del a
        return self._cold(run)

    def resume_nohash(self) -> Callable[[], None]:
        path = self._resume_files()[0]

        def run() -> None:
            contents = read_bin(path, expected_n=self.n)
            del contents
        return self._cold(run)

    def _general_files(self) -> list[Path]:
        assert self.general_resume_step is not None
        return list(general_paths(self.general_resume.folder, self.general_resume_step))

    def resume_general(self) -> Callable[[], None]:
        """GeneralBackend.load: marker, header, companion checks, the tensor file read into fresh
        tensors while hashed and compared with the marker, the state rebuilt and validated."""
        def run() -> None:
            gen = self.general_resume.check_to_resume(self.general_resume_step)
            loaded = self.general_resume.load(gen, self.state)
            assert loaded.saved["model"]
            del loaded
        return self._cold(run, self._general_files())

    def resume_general_fromfile(self) -> Callable[[], None]:
        path = self._general_files()[0]

        def run() -> None:
            a = np.fromfile(path, dtype=np.uint8)
            assert a.size >= self.logical
            del a
        return self._cold(run, self._general_files())

    def resume_general_nohash(self) -> Callable[[], None]:
        """The general file read into preallocated-per-call tensors (as the load does), no hash."""
        path = self._general_files()[0]

        def run() -> None:
            header = st.read_header(path)
            tensors = [torch.empty(e.shape, dtype=e.torch_dtype) for e in header.entries]
            fd = os.open(path, os.O_RDONLY)
            try:
                os.lseek(fd, header.data_start, os.SEEK_SET)
                read_exact_hashing(fd, [tbytes(t) for t in tensors if t.numel()], None, path=path)
            finally:
                os.close(fd)
            del tensors
        return self._cold(run, self._general_files())

    def _shards_files(self, k: int) -> list[Path]:
        """Every file of sharded generation K of the resume store (the shard files, index, companion,
        marker)."""
        step = self.shards_resume_steps[k]
        return sorted(p for p in self.shards_resume.folder.rglob(f"{_step_prefix(step)}*") if p.is_file())

    def resume_shards(self, k: int) -> Callable[[], Callable[[], None]]:
        """The maker of resume.shards_K: ShardsBackend check_to_resume + load of a committed K-shard
        generation, the page cache of all its files dropped first (each shard read and verified by
        its own worker)."""
        def make() -> Callable[[], None]:
            step = self.shards_resume_steps[k]

            def run() -> None:
                gen = self.shards_resume.check_to_resume(step)
                loaded = self.shards_resume.load(gen, self.state)
                assert loaded.saved["model"]
                del loaded
            return self._cold(run, self._shards_files(k))
        return make

    def _cold(self, run: Callable[[], None], files: list[Path] | None = None) -> Callable[[], None]:
        for p in files if files is not None else self._resume_files():
            drop_cache(p)
        return run

    # ---- helpers -----------------------------------------------------------------------
    def _then_remove(self, run: Callable[[], Any], path: Path) -> Callable[[], Any]:
        return self._then(run, lambda: remove(path))

    def _then(self, run: Callable[[], Any], cleanup: Callable[[], None]) -> Callable[[], Any]:
        self._pending_cleanup = cleanup
        return run

    def measure(self, key: str, make: Callable[[], Callable[[], Any]]) -> dict[str, Any]:
        """One sample of ``key``; redone (up to ``retries`` times) while other processes
        disturbed it. Discarded attempts are kept in the sample's ``discarded``."""
        discarded: list[dict[str, Any]] = []
        while True:
            self._pending_cleanup = None
            run = make()
            try:
                sample = self.meter.run(run)
            finally:
                if self._pending_cleanup is not None:
                    self._pending_cleanup()
                    self._pending_cleanup = None
            sample["disturbed"] = self.meter.disturbed(sample, self.logical)
            if not sample["disturbed"] or len(discarded) >= self.retries:
                sample["discarded"] = discarded
                return sample
            discarded.append({k: sample[k] for k in ("wall_s", "others_cpu_share", "others_io_bytes")})
            self.log(f"{key:<28} {sample['wall_s']:9.4f} s  discarded: other processes used "
                     f"{(sample['others_cpu_share'] or 0):.0%} of the CPU and "
                     f"{(sample['others_io_bytes'] or 0) / 1e6:.0f} MB of disk I/O; measuring again")

    def record(self, key: str, sample: dict[str, float], primary: str = "wall_s") -> None:
        s = dict(sample)
        s["value"] = s[primary]
        self.samples[key].append(s)
        parts = []
        if s.get("others_cpu_share") is not None:
            parts.append(f"others: CPU {s['others_cpu_share']:.0%}")
        if s.get("others_io_bytes") is not None:
            parts.append(f"disk {s['others_io_bytes'] / 1e6:.0f} MB")
        if s.get("quiet_wait_s"):
            parts.append(f"waited {s['quiet_wait_s']:.1f} s")
        if s.get("disturbed"):
            parts.append("DISTURBED (kept: retries exhausted)")
        self.log(f"{key:<28} {s['value']:9.4f} s  " + (f"({', '.join(parts)})" if parts else ""))

    def makers(self) -> dict[str, Callable[[], Callable[[], Any]]]:
        """method key -> the maker of one sample's run."""
        return {
            "save.raw": self.save_raw, "save.ripresa": self.save_ripresa,
            "save.torch_save": self.save_torch, "save.safetensors": self.save_safetensors,
            "save.dcp": self.save_dcp, "stall.memcpy": self.stall_memcpy,
            "stall.ripresa_async": self.stall_ripresa, "stall.dcp_async": self.stall_dcp,
            "resume.np_fromfile": self.resume_fromfile, "resume.ripresa_load": self.resume_ripresa,
            "resume.read_bin_nohash": self.resume_nohash,
            "hash.sha256": self.hash_sha256, "save.general": self.save_general,
            "stall.general_async": self.stall_general, "resume.general_load": self.resume_general,
            "resume.general_fromfile": self.resume_general_fromfile,
            "resume.general_read_nohash": self.resume_general_nohash,
            "stall.general_budget": self.stall_budget,
            **{shard_keys(k)[0]: self.save_shards(k) for k in self.shards},
            **{shard_keys(k)[1]: self.resume_shards(k) for k in self.shards},
        }

    def record_sample(self, key: str, sample: dict[str, Any]) -> None:
        """Record one sample of ``key`` and the figures derived from it (the caller's stall,
        the staging copy, the time until committed)."""
        if key == "stall.ripresa_async":
            self.record(key, sample, "stall_s")
            self.samples["stall.ripresa_async_caller"].append(dict(sample, value=sample["caller_stall_s"]))
            self.samples["complete.ripresa_async"].append(dict(sample, value=sample["complete_s"]))
        elif key == "stall.general_async":
            self.record(key, sample, "stall_s")
            self.samples["stall.general_copy"].append(dict(sample, value=sample["copy_s"]))
            self.samples["complete.general_async"].append(dict(sample, value=sample["complete_s"]))
        elif key == "stall.general_budget":
            self.record(key, sample, "stall_s")
            self.samples["complete.general_budget"].append(dict(sample, value=sample["complete_s"]))
        elif key == "stall.dcp_async":
            self.record(key, sample, "stall_s")
            self.samples["complete.dcp_async"].append(dict(sample, value=sample["complete_s"]))
        elif key == "stall.memcpy":
            self.record(key, sample, "stall_s")
        else:
            self.record(key, sample)

    # ---- warm-up (outside every figure) --------------------------------------------------
    def warmup(self, keys: set[str] | None = None) -> None:
        """Load each library's code paths on a tiny state; allocate the async/memcpy buffers
        (with ``keys``: only the libraries and buffers those methods use, as ``--isolate``'s children do)."""
        tiny = {"a": torch.ones(16), "b": torch.zeros(4, 4)}
        w = self.scratch / "warm"
        w.mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if keys is None or "save.torch_save" in keys:
                torch.save(tiny, w / "t.pt")
            if keys is None or "save.safetensors" in keys:
                from safetensors.torch import save_file

                save_file(tiny, str(w / "t.safetensors"))
            if keys is None or keys & {"save.dcp", "stall.dcp_async"}:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint import FileSystemWriter
            if keys is None or "save.dcp" in keys:
                dcp.save(tiny, storage_writer=FileSystemWriter(str(w / "d"), sync_files=True), no_dist=True)
            if keys is None or "stall.dcp_async" in keys:
                f = dcp.async_save(tiny, storage_writer=FileSystemWriter(str(w / "e"), sync_files=True),
                                   no_dist=True)
                getattr(f, "upload_completion", f).result()
        shutil.rmtree(w)
        # The async writers allocate their staging buffers at their first save; a
        # training loop pays that once, so it is paid here, outside the figures.
        if self.writer is not None and (keys is None or "stall.ripresa_async" in keys):
            step = self.next_step()
            self.writer.save(step, bin_arrays(self.state), self.companion(step))
            self.writer.wait()
            self.async_store.delete(step)
        if keys is None or "stall.general_budget" in keys:
            # the budgeted backend's staging buffer (at most the budget) is allocated once, as in a loop
            step = self.next_step()
            self.budget.capture(step, self.state, self.set_step(step), None, stage=lambda x: x)()
            self.budget.delete(step)
        if keys is None or keys & {shard_keys(k)[0] for k in self.shards}:
            # the shard workers' code paths, on the real state (a K-shard save per K, outside the figures)
            for k in self.shards:
                if keys is None or shard_keys(k)[0] in keys:
                    step = self.next_step()
                    self.shards_store.save_options = SaveOptions(shard_threshold=0, shards=k)
                    self.shards_writer.save(step, self.state, self.set_step(step))
                    remove_shards(self.shards_store, step)
        if keys is not None and not keys & {"stall.general_async", "stall.memcpy"}:
            return
        step = self.next_step()
        self.general.capture(step, self.state, self.set_step(step), None, stage=lambda x: x)()
        self.general.delete(step)
        # memcpy's preallocated, touched destination: the general backend's staging buffer
        # itself (the same pages its capture copies into; one copy of the state less in RAM)
        self.copy_buffer = staging_buffer(self.general)
        assert self.copy_buffer is not None and self.copy_buffer.numel() >= self.logical

    def prepare_resume(self, keys: set[str] | None = None) -> None:
        """Commit the generations the loads read (with ``keys``: those these methods read; the one-file
        general generation always: the cold-read floors read it)."""
        if self.with_bin and (keys is None or keys & BIN_METHODS):
            step = self.next_step()
            self.store.save(step, bin_arrays(self.state), self.companion(step))
            self.resume_step = step
        step = self.next_step()
        self.general_resume.save(step, self.state, self.set_step(step))
        self.general_resume_step = step
        for k in self.shards:
            if keys is None or shard_keys(k)[1] in keys:
                step = self.next_step()
                self.shards_resume_store.save_options = SaveOptions(shard_threshold=0, shards=k)
                gen = self.shards_resume_writer.save(step, self.state, self.set_step(step))
                assert gen.kind == "shards", gen.kind
                self.shards_resume_steps[k] = step


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ok(value: float, op: str, target: float) -> bool:
    return value <= target if op == "<=" else value < target


def extra_info_ratios(shards: tuple[int, ...] | list[int],
                      budget_fraction: float) -> list[tuple[str, str, Comparator, float, str, str]]:
    """The info rows of the shard methods (each against its floor) and of the staging budget."""
    rows: list[tuple[str, str, Comparator, float, str, str]] = []
    for k in shards:
        save, load = shard_keys(k)
        rows += [
            (f"shards_{k}_save_over_floor", save, save_floor_k(k), 1.2, f"sharded save K={k} vs its floor (info)",
             f"info: sharded durable save, K={k} shard files, vs max(raw write+fsync, sha256 / {k})"),
            (f"shards_{k}_save_over_one_file_floor", save, SAVE_FLOOR, 1.0,
             f"sharded save K={k} vs the one-file floor (info)",
             f"info: sharded durable save, K={k}, vs max(raw write+fsync, sha256): below 1 is past the "
             "floor of any one-file checksummed save"),
            (f"shards_{k}_load_over_floor", load, load_floor_k(k), 1.2, f"sharded load K={k} vs its floor (info)",
             f"info: sharded cold load + verify, K={k}, vs max(cold read, sha256 / {k})"),
        ]
    rows += [
        ("general_budget_stall_over_memcpy", "stall.general_budget", "stall.memcpy", 1.3,
         "general budget stall vs memcpy (info)",
         f"info: background save with staging_budget = {budget_fraction:g} of the state: the loop's wait "
         "(capture) vs memcpy of the whole state"),
        ("general_budget_stall_over_async", "stall.general_budget", "stall.general_async", 1.0,
         "general budget stall vs unbudgeted stall (info)",
         "info: the loop's wait with the staging budget vs the unbudgeted background save's stall"),
        ("general_budget_stall_over_floor", "stall.general_budget", budget_floor(budget_fraction), 1.2,
         "general budget stall vs its floor (info)",
         f"info: the loop's wait vs {1 - budget_fraction:g} × max(raw write+fsync, sha256) + "
         f"{budget_fraction:g} × memcpy (write and hash the part beyond the budget, copy the rest)"),
    ]
    return rows


def compute(bench: Bench) -> tuple[dict[str, Any], dict[str, Any]]:
    methods: dict[str, Any] = {}
    for key, runs in bench.samples.items():
        if not runs:
            continue
        group, label, what = METHODS[key]
        vals = [r["value"] for r in runs]
        entry = {"group": group, "label": label, "figure": what, "samples": vals, **_summary(vals),
                 "runs": runs}
        cpu = [r["cpu_s"] / (bench.logical / GB) for r in runs]
        entry["cpu_s_per_gb"] = statistics.median(cpu)
        shares = [r["others_cpu_share"] for r in runs if r.get("others_cpu_share") is not None]
        if shares:
            entry["others_cpu_share_median"] = statistics.median(shares)
            entry["others_cpu_share_max"] = max(shares)
        if group in ("save", "complete"):
            entry["write_amplification"] = statistics.median(r["write_bytes"] / bench.logical for r in runs)
            if all("device_write_bytes" in r for r in runs):
                entry["device_write_amplification"] = statistics.median(
                    r["device_write_bytes"] / bench.logical for r in runs)
            entry["throughput_gbps"] = bench.logical / entry["median"] / GB
        if group in ("resume", "hash"):
            entry["throughput_gbps"] = bench.logical / entry["median"] / GB
        methods[key] = entry
    ratios: dict[str, Any] = {}
    for name, fig, comp, op, target, text in TARGETS:
        if fig not in methods:
            continue
        if comp is None:
            value = methods[fig]["write_amplification"]
            ratios[name] = {"value": value, "figure": fig, "comparator": None, "target": f"{op} {target}",
                            "met": "yes" if _ok(value, op, target) else "no", "what": text}
            continue
        c = resolve(methods, comp)
        if c is None:
            continue
        ratios[name] = _ratio(methods[fig], fig, c, op, target, text)
    # info rows: the same targets against a stricter reading (not counted in targets_met)
    extra = extra_info_ratios(getattr(bench, "shards", DEFAULT_SHARDS),
                              getattr(bench, "budget_fraction", DEFAULT_BUDGET_FRACTION))
    for name, fig, comp, target, label, text in INFO_RATIOS + extra:
        c = resolve(methods, comp)
        if fig in methods and c is not None:
            ratios[name] = dict(_ratio(methods[fig], fig, c, "<=", target, text), info=True, label=label)
    return methods, ratios


def resolve(methods: dict[str, Any], comp: Comparator) -> dict[str, Any] | None:
    """A comparator's median, min, key (a name like ``max(save.raw, hash.sha256)``) and label,
    or None when one of its methods was not measured."""
    if isinstance(comp, str):
        if comp not in methods:
            return None
        return {"key": comp, "median": methods[comp]["median"], "min": methods[comp]["min"],
                "label": methods[comp]["label"]}
    op, parts = comp
    if op in ("div", "mul"):  # (comparator, number)
        inner, x = parts
        g = resolve(methods, inner)
        if g is None:
            return None
        f = 1.0 / x if op == "div" else float(x)
        sign = "/" if op == "div" else "*"
        return {"key": f"{g['key']}{sign}{x:g}" if op == "div" else f"{x:g}*{g['key']}",
                "median": g["median"] * f, "min": g["min"] * f,
                "label": f"{g['label']} {sign} {x:g}" if op == "div" else f"{x:g} × {g['label']}"}
    got = [resolve(methods, p) for p in parts]
    if any(g is None for g in got):
        return None
    pick = {"max": max, "min": min, "sum": sum}[op]
    return {"key": f"{op}({', '.join(g['key'] for g in got)})",
            "median": pick(g["median"] for g in got), "min": pick(g["min"] for g in got),
            "label": f"{op}({', '.join(g['label'] for g in got)})"}


def shard_scaling(methods: dict[str, Any], facts: dict[str, Any], shards: tuple[int, ...] | list[int],
                  cores: int, nbytes: int) -> dict[str, Any] | None:
    """The shard scaling table (a row per K: save and load seconds, their floors and ratios) and the
    "on paper" model of a 64-core host, from the measured per-core sha256 and raw-write throughputs."""
    rows = []
    for k in shards:
        save, load = shard_keys(k)
        row: dict[str, Any] = {"shards": k}
        for what, key, comp in (("save", save, save_floor_k(k)), ("load", load, load_floor_k(k))):
            floor = resolve(methods, comp)
            if key not in methods or floor is None:
                continue
            row[f"{what}_s"] = methods[key]["median"]
            row[f"{what}_floor_s"] = floor["median"]
            row[f"{what}_floor"] = floor["key"]
            row[f"{what}_ratio"] = methods[key]["median"] / floor["median"]
        if len(row) > 1:
            rows.append(row)
    if not rows:
        return None
    sha, write = facts.get("sha256_gbps"), facts.get("raw_write_gbps")
    model = None
    if sha and write:
        model_rows = []
        for k in (1, *MODEL_SHARDS):
            hash_s = MODEL_STATE_BYTES / (min(k, MODEL_CORES) * sha * GB)
            write_s = MODEL_STATE_BYTES / (write * GB)
            model_rows.append({"shards": k, "hash_s": hash_s, "write_s": write_s, "save_s": max(hash_s, write_s),
                               "bound_by": "disk" if write_s >= hash_s else "sha256"})
        model = {
            "what": "a model, not a measurement",
            "state_bytes": MODEL_STATE_BYTES,
            "state": "7B parameters, fp32 weights + AdamW exp_avg + exp_avg_sq (12 bytes a parameter)",
            "cores": MODEL_CORES,
            "sha256_gbps_per_core": sha,
            "write_gbps": write,
            "formula": "save_s = max(state_bytes / (min(K, cores) * sha256_gbps_per_core), "
                       "state_bytes / write_gbps)",
            "assumes": "sha256 scales linearly with the workers up to the cores, each core hashes at the "
                       "rate measured here on one, and the disk writes at this host's measured raw "
                       "write+fsync rate whatever the number of files",
            "rows": model_rows,
        }
    return {"shards": list(shards), "cores": cores, "bytes": nbytes, "rows": rows, "model": model,
            "note": "floors: save max(save.raw, hash.sha256 / K); load max(cold read, hash.sha256 / K). "
                    f"With K above this host's {cores} cores the hash part of the floor is not reachable here."}


def budget_summary(methods: dict[str, Any], bench_bytes: int, fraction: float) -> dict[str, Any] | None:
    """The staging budget's figures: the loop's wait beside the unbudgeted stall and memcpy, what the
    loop wrote during it, and (with --isolate) the peak RSS over the state against the budget."""
    m = methods.get("stall.general_budget")
    if m is None:
        return None
    runs = m["runs"]
    out: dict[str, Any] = {
        "fraction": fraction,
        "budget_bytes": int(runs[0].get("budget_bytes", fraction * bench_bytes)),
        "stall_s": m["median"],
        "stall_general_async_s": methods.get("stall.general_async", {}).get("median"),
        "stall_memcpy_s": methods.get("stall.memcpy", {}).get("median"),
        "complete_s": methods.get("complete.general_budget", {}).get("median"),
        "stall_write_bytes": statistics.median(r.get("stall_write_bytes", 0.0) for r in runs),
        "staging_bytes": max(r.get("staging_bytes", -1.0) for r in runs),
    }
    floor = resolve(methods, budget_floor(fraction))
    if floor is not None:
        out["stall_floor_s"] = floor["median"]
    rss = m.get("rss")
    if rss and rss.get("method_peak_over_state_bytes") is not None:
        out["peak_over_state_bytes"] = rss["method_peak_over_state_bytes"]
        out["peak_over_state_over_budget"] = rss["method_peak_over_state_bytes"] / max(out["budget_bytes"], 1)
        full = methods.get("stall.general_async", {}).get("rss", {}).get("method_peak_over_state_bytes")
        if full is not None:
            out["general_async_peak_over_state_bytes"] = full
    return out


def _ratio(fig_m: dict[str, Any], fig: str, c: dict[str, Any], op: str, target: float, text: str) -> dict[str, Any]:
    value = fig_m["median"] / c["median"]
    # the same ratio of the best samples: robust to a comparator's unlucky samples
    best = fig_m["min"] / c["min"]
    return {"value": value, "figure": fig, "comparator": c["key"], "comparator_label": c["label"],
            "comparator_median": c["median"], "comparator_min": c["min"], "target": f"{op} {target}",
            "met": "yes" if _ok(value, op, target) else "no", "ratio_of_minimums": best,
            "met_by_minimums": "yes" if _ok(best, op, target) else "no", "what": text}


# ---------------------------------------------------------------------------- output


def render_table(result: dict[str, Any]):
    from rich.table import Table

    methods, ratios = result["methods"], result["ratios"]
    n, nbytes = result["params"], result["bytes"]
    t1 = Table(title=f"ripresa checkpoint benchmark — {n:,} params, {result.get('dtype', 'fp32')} "
               f"(moments {result.get('moments_dtype', 'fp32')}), {nbytes / GB:.2f} GB, "
               f"median of {result['pairs']} pairs", title_justify="left")
    for col, just in (("figure", "left"), ("ripresa", "right"), ("vs", "left"), ("other", "right"),
                      ("ratio", "right"), ("target", "right"), ("result", "center"),
                      ("ratio of mins", "right"), ("by mins", "center")):
        t1.add_column(col, justify=just)

    def verdict(met: str | None) -> str:
        return "" if met is None else "[green]PASS[/]" if met == "yes" else "[red]MISS[/]"

    for r in ratios.values():
        fig = methods[r["figure"]]
        if r["comparator"] is None:
            t1.add_row(f"write amplification: {fig['label']}", f"{r['value']:.4f}", "logical bytes", "", f"{r['value']:.4f}",
                       r["target"], verdict(r["met"]), "", "")
            continue
        t1.add_row(
            r.get("label") or f"{fig['group']}: {fig['label']}",
            f"{fig['median']:.3f} s", r["comparator_label"], f"{r['comparator_median']:.3f} s", f"{r['value']:.3f}",
            r["target"], verdict(r["met"]),
            f"{r['ratio_of_minimums']:.3f}" if "ratio_of_minimums" in r else "",
            verdict(r.get("met_by_minimums")),
        )
    isolated = bool(result.get("isolated"))
    t2 = Table(title="per method (seconds: median, min – max; CPU-s per GB; write amplification"
               + ("; peak RSS of the method's own process, MB" if isolated else "") + ")",
               title_justify="left")
    cols = [("method", "left"), ("median s", "right"), ("min – max", "right"),
            ("GB/s", "right"), ("CPU-s/GB", "right"), ("write amp", "right"),
            ("device amp", "right"), ("others' CPU", "right")]
    if isolated:
        cols += [("peak RSS", "right"), ("while measured", "right"), ("over state", "right")]
    for col, just in cols:
        t2.add_column(col, justify=just)

    def mb(x: float | None) -> str:
        return "" if x is None else f"{x / 1e6:,.0f}"
    for key, m in methods.items():
        row = [
            key, f"{m['median']:.4f}", f"{m['min']:.4f} – {m['max']:.4f}",
            f"{m['throughput_gbps']:.2f}" if "throughput_gbps" in m else "",
            f"{m['cpu_s_per_gb']:.2f}",
            f"{m['write_amplification']:.4f}" if "write_amplification" in m else "",
            f"{m['device_write_amplification']:.3f}" if "device_write_amplification" in m else "",
            f"{m['others_cpu_share_median']:.0%}" if "others_cpu_share_median" in m else "",
        ]
        if isolated:
            r = m.get("rss", {})
            row += [mb(r.get("child_maxrss_bytes")), mb(r.get("method_peak_rss_bytes")),
                    mb(r.get("method_peak_over_state_bytes"))]
        t2.add_row(*row)
    f = result["facts"]
    warm = f" · warm read: {f['warm_read_gbps']:.2f} GB/s" if f.get("warm_read_gbps") else ""
    cold_txt = (f" · cold read ({f.get('cold_read_method', 'np.fromfile')}): {f['cold_read_gbps']:.2f} GB/s"
                if f.get("cold_read_gbps") else "")
    facts = (f"sha256 in memory: {f['sha256_gbps']:.2f} GB/s · raw durable write: {f['raw_write_gbps']:.2f} GB/s"
             f"{cold_txt}{warm} · memcpy: {f['memcpy_gbps']:.2f} GB/s\n"
             f"load average (1, 5, 15 min) at start {_fmt_load(result['machine']['loadavg_start'])}, "
             f"at end {_fmt_load(result['machine']['loadavg_end'])} on {result['machine']['cores']} cores; "
             f"CPU/IO pressure (PSI some avg60, %) at end: "
             f"{result['machine']['pressure_end'].get('cpu_some_avg60', float('nan')):.0f}/"
             f"{result['machine']['pressure_end'].get('io_some_avg60', float('nan')):.0f}")
    if "others_cpu_share_median" in f:
        facts += (f"\nother processes used a median {f['others_cpu_share_median']:.0%} (max "
                  f"{f['others_cpu_share_max']:.0%}) of the machine's CPU during the samples; "
                  f"{f['samples_with_others_over_quiet_share']} of {f['samples']} samples above "
                  f"{f['quiet_share']:.0%}; waited {f['quiet_wait_total_s']:.0f} s in all for quiet; "
                  f"{f['discarded_samples']} disturbed samples discarded and redone, "
                  f"{f['disturbed_samples_kept']} kept after {f['retries']} retries")
    return (t1, t2, facts, *render_shards(result), *render_budget(result))


def render_shards(result: dict[str, Any]) -> list[Any]:
    """The shard scaling table and the "on paper" lines of a 64-core host (nothing without shards)."""
    from rich.table import Table

    sc = result.get("shard_scaling")
    if not sc:
        return []
    t = Table(title="shard scaling: sharded general save and cold load + verify, each against its floor "
              "(save: max(raw write+fsync, sha256 / K); load: max(cold read, sha256 / K))", title_justify="left")
    for col in ("K", "save s", "floor s", "ratio", "load s", "floor s", "ratio"):
        t.add_column(col, justify="right")

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else ""
    for row in sc["rows"]:
        t.add_row(str(row["shards"]), cell(row, "save_s", ".3f"), cell(row, "save_floor_s", ".3f"),
                  cell(row, "save_ratio", ".2f"), cell(row, "load_s", ".3f"), cell(row, "load_floor_s", ".3f"),
                  cell(row, "load_ratio", ".2f"))
    out: list[Any] = [t]
    if any(row["shards"] > sc["cores"] for row in sc["rows"]):
        out.append(f"(this host has {sc['cores']} cores: for K above that the sha256 / K part of the floor "
                   "is out of reach here)")
    m = sc.get("model")
    if m:
        lines = [f"on paper for a {m['cores']}-core host — a model, not a measurement: "
                 f"{m['state_bytes'] / GB:.0f} GB state ({m['state']}), sha256 at the "
                 f"{m['sha256_gbps_per_core']:.2f} GB/s per core measured here, the disk at the "
                 f"{m['write_gbps']:.2f} GB/s raw write+fsync measured here; save = max(state / "
                 f"(min(K, {m['cores']}) × sha256 per core), state / write)"]
        for r in m["rows"]:
            lines.append(f"  K={r['shards']:>2}: hash {r['hash_s']:7.1f} s, write {r['write_s']:7.1f} s "
                         f"-> save {r['save_s']:7.1f} s ({r['bound_by']}-bound)")
        out.append("\n".join(lines))
    return out


def render_budget(result: dict[str, Any]) -> list[str]:
    """One paragraph on the staging budget: the loop's wait beside the stalls, and its memory."""
    b = result.get("budget")
    if not b:
        return []

    def s_(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f} s"
    text = (f"staging budget {b['fraction']:g} of the state ({b['budget_bytes'] / 1e6:,.1f} MB): the loop "
            f"waits {s_(b['stall_s'])} (unbudgeted background stall {s_(b.get('stall_general_async_s'))}, "
            f"memcpy {s_(b.get('stall_memcpy_s'))}, floor {s_(b.get('stall_floor_s'))}); it wrote "
            f"{b['stall_write_bytes'] / 1e6:,.1f} MB itself during the wait; committed after "
            f"{s_(b.get('complete_s'))}; staging buffer {b['staging_bytes'] / 1e6:,.1f} MB")
    if "peak_over_state_bytes" in b:
        text += (f"\npeak RSS over the state while measured: {b['peak_over_state_bytes'] / 1e6:,.1f} MB = "
                 f"{b['peak_over_state_over_budget']:.2f} × the budget")
        if b.get("general_async_peak_over_state_bytes") is not None:
            text += f" (unbudgeted background save: {b['general_async_peak_over_state_bytes'] / 1e6:,.1f} MB)"
    return [text]


def _fmt_load(load: list[float] | tuple[float, ...]) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    panels = [
        ("durable save (s)", ["save.raw", "hash.sha256", "save.general", "save.ripresa", "save.torch_save",
                              "save.safetensors", "save.dcp"]),
        ("blocking stall (s, log scale)", ["stall.memcpy", "stall.general_copy", "stall.general_async",
                                           "stall.general_budget", "stall.ripresa_async", "stall.ripresa_async_caller",
                                           "stall.dcp_async", "save.general", "save.ripresa"]),
        ("cold resume (s)", ["resume.general_fromfile", "resume.general_read_nohash", "hash.sha256",
                             "resume.general_load", "resume.np_fromfile", "resume.read_bin_nohash",
                             "resume.ripresa_load"]),
    ]
    floors = ("save.raw", "stall.memcpy", "resume.np_fromfile", "hash.sha256", "resume.general_fromfile",
              "resume.general_read_nohash")
    isolated = bool(result.get("isolated"))
    sc = result.get("shard_scaling")
    ncols = 3 + bool(sc) + isolated
    fig, axes = plt.subplots(1, ncols, figsize=(6.7 * ncols, 5.6))
    axes = list(axes)
    if sc:  # the shard scaling table: each K's save and load beside its floor
        ax = axes.pop(3)
        ks = [r["shards"] for r in sc["rows"]]
        x = np.arange(len(ks))
        width = 0.2
        for j, (field, label, color) in enumerate((
                ("save_s", "sharded save", "#9467bd"), ("save_floor_s", "save floor", "#7f7f7f"),
                ("load_s", "sharded load", "#c5b0d5"), ("load_floor_s", "load floor", "#c7c7c7"))):
            vals = [r.get(field, 0.0) for r in sc["rows"]]
            bars = ax.bar(x + (j - 1.5) * width, vals, width, label=label, color=color)
            for b, v in zip(bars, vals, strict=True):
                ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(x, [f"K = {k}" for k in ks])
        ax.set_title(f"shard scaling (s); floors max(write | cold read, sha256 / K); {sc['cores']} cores")
        ax.set_ylabel("seconds (median)")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if isolated:  # --isolate: each method's memory beyond the state, in its own process
        ax = axes.pop(3)
        keys = [k for _, ks in groups_for(result.get("dtype", "fp32"), (sc or {}).get("shards", DEFAULT_SHARDS))
                for k in ks if k in methods]
        over = [(methods[k]["rss"].get("method_peak_over_state_bytes") or 0) / 1e6 for k in keys]
        bars = ax.bar(range(len(keys)), over, color=["#7f7f7f" if k in floors else "#9467bd" if "general" in k or "shards" in k
                                                     else "#d62728" if "ripresa" in k else "#1f77b4" for k in keys])
        for b, v in zip(bars, over, strict=True):
            ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(keys)), [PLOT_LABELS.get(k, k) for k in keys], fontsize=6, rotation=90)
        ax.set_title("peak RSS over the state (MB), each method in its own process")
        ax.axhline(result["bytes"] / 1e6, color="#7f7f7f", linestyle="--", linewidth=1)
        ax.annotate("one copy of the state", (0, result["bytes"] / 1e6), fontsize=7, xytext=(2, 3),
                    textcoords="offset points")
        if result.get("budget"):  # the staging budget of stall.general_budget
            ax.axhline(result["budget"]["budget_bytes"] / 1e6, color="#9467bd", linestyle=":", linewidth=1)
            ax.annotate("staging budget", (0, result["budget"]["budget_bytes"] / 1e6), fontsize=7, xytext=(2, 3),
                        textcoords="offset points", color="#9467bd")
        ax.grid(axis="y", alpha=0.3)
    for ax, (title, keys) in zip(axes, panels, strict=True):
        keys = [k for k in keys if k in methods]
        med = [methods[k]["median"] for k in keys]
        lo = [methods[k]["median"] - methods[k]["min"] for k in keys]
        hi = [methods[k]["max"] - methods[k]["median"] for k in keys]
        # the general format in purple, the .bin path in red, the floors in grey, the libraries in blue
        colors = ["#9467bd" if ("general" in k or "shards" in k) and k not in floors else "#d62728" if "ripresa" in k
                  else "#7f7f7f" if k in floors else "#1f77b4" for k in keys]
        for light in ("save.ripresa", "resume.read_bin_nohash", "stall.ripresa_async_caller"):
            if light in keys and (light != "save.ripresa" or title.startswith("blocking")):
                colors[keys.index(light)] = "#ff9896"
        for light in ("save.general", "stall.general_copy"):
            if light in keys and (light != "save.general" or title.startswith("blocking")):
                colors[keys.index(light)] = "#c5b0d5"
        sync = {"save.ripresa": "ripresa\nsync save", "save.general": "general\nsync save"}
        labels = [(sync[k] if k in sync and title.startswith("blocking")
                   else PLOT_LABELS.get(k, textwrap.fill(methods[k]["label"], 14))) for k in keys]
        bars = ax.bar(range(len(keys)), med, yerr=[lo, hi], capsize=4, color=colors)
        for b, v in zip(bars, med, strict=True):
            ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(range(len(keys)), labels, fontsize=7 if len(keys) <= 8 else 6)
        ax.set_title(title)
        ax.set_ylabel("seconds (median, bars: min–max)")
        if title.startswith("blocking"):
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"ripresa checkpoint benchmark: {result['params']:,} params, {result.get('dtype', 'fp32')} "
                 f"({result['bytes'] / GB:.2f} GB), median of {result['pairs']} pairs — "
                 f"{result['machine']['cpu_model']}, {result['machine']['filesystem']['fstype']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- --isolate


#: a derived figure -> the method whose samples it comes from (the same child under --isolate)
DERIVED_FROM = {
    "stall.ripresa_async_caller": "stall.ripresa_async", "complete.ripresa_async": "stall.ripresa_async",
    "stall.general_copy": "stall.general_async", "complete.general_async": "stall.general_async",
    "complete.dcp_async": "stall.dcp_async", "complete.general_budget": "stall.general_budget",
}


def run_child(args: argparse.Namespace) -> int:
    """``--child KEY``: one method's ``--pairs`` samples in this (fresh) process, with its memory.

    The state is built, the libraries warmed up and the buffers this method uses allocated
    (a loop pays those once); then the peak RSS is reset (/proc/self/clear_refs) and the
    samples run, so ``method_peak_rss_bytes`` is the most this process held while the method
    ran: the state, what the method allocates, and nothing another method left behind.
    """
    key = args.child
    group = METHODS[key][0]
    base = args.dir if args.dir is not None else args.out
    scratch = Path(tempfile.mkdtemp(prefix=".bench-child-", dir=base))
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    bench: Bench | None = None

    def log(text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)
    try:
        meter = Meter(_block_stat_path(scratch), quiet_timeout=args.quiet_timeout, quiet_share=args.quiet_share)
        bench = Bench(args.params, args.pairs, scratch, log, meter, retries=max(0, args.retries),
                      dtype=args.dtype, device=args.device, shards=args.shards,
                      budget_fraction=args.budget_fraction)
        gc.collect()
        build_peak, state_rss = _status_bytes("VmHWM"), _status_bytes("VmRSS")
        bench.warmup({key})
        if group == "resume":
            bench.prepare_resume({key})
        gc.collect()
        reset = reset_peak_rss()
        ready_rss = _status_bytes("VmRSS")
        makers = bench.makers()
        for _ in range(args.pairs):
            bench.record_sample(key, bench.measure(key, makers[key]))
        peak = _status_bytes("VmHWM") if reset else None
        moments = bench.opt.state[next(iter(bench.model.parameters()))]["exp_avg"].dtype
        out = {
            "key": key,
            "samples": {k: v for k, v in bench.samples.items() if v},
            "logical": bench.logical,
            "model": {"d_model": bench.model.d_model, "layers": bench.model.n_layers,
                      "tensors_per_region": len(list(bench.model.parameters()))},
            "moments_dtype": {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(moments, str(moments)),
            "rss": {
                "build_peak_rss_bytes": build_peak,
                "state_rss_bytes": state_rss,
                "ready_rss_bytes": ready_rss,
                "method_peak_rss_bytes": peak,
                "method_peak_over_state_bytes": (peak - state_rss) if peak is not None and state_rss else None,
                "peak_reset": reset,
            },
        }
        args.child_out.write_text(json.dumps(out) + "\n")
        return 0
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(scratch, ignore_errors=True)


class _Collected:
    """What :func:`compute` reads from a :class:`Bench`: the samples and the state's size."""

    def __init__(self, shards: tuple[int, ...], budget_fraction: float) -> None:
        self.samples: dict[str, list[dict[str, Any]]] = {k: [] for k in METHODS}
        self.logical = 0
        self.shards, self.budget_fraction = shards, budget_fraction


def run_isolated(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """``--isolate``: every method in its own fresh subprocess (``--child``), one after the other,
    in this one run; the ratios are computed over all children's samples as in one process, and
    each method gets its child's peak RSS (``os.wait4``'s ``ru_maxrss``, and ``VmHWM`` over the
    samples alone)."""
    base = args.dir if args.dir is not None else args.out
    scratch = Path(tempfile.mkdtemp(prefix=".bench-scratch-", dir=base))
    started = time.time()
    load_start, pressure_start = os.getloadavg(), pressure()
    facts_at_start = machine_facts(scratch)
    collected = _Collected(args.shards, args.budget_fraction)
    rss: dict[str, dict[str, Any]] = {}
    child_meta: dict[str, Any] = {}
    proc: subprocess.Popen | None = None
    try:
        keys = [k for _, ks in groups_for(args.dtype, args.shards) for k in ks]
        for i, key in enumerate(keys, 1):
            out = scratch / f"{key}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--child-out", str(out),
                   "--params", str(args.params), "--dtype", args.dtype, "--pairs", str(args.pairs),
                   "--device", args.device, "--dir", str(scratch), "--quiet-timeout", str(args.quiet_timeout),
                   "--quiet-share", str(args.quiet_share), "--retries", str(args.retries),
                   "--shards", ",".join(map(str, args.shards)), "--budget-fraction", str(args.budget_fraction)]
            log(f"[{i}/{len(keys)}] {key}: a fresh process")
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                raise SystemExit(f"{key}: the child process failed (exit {proc.returncode})")
            proc = None
            child = json.loads(out.read_text())
            for k, runs in child["samples"].items():
                collected.samples[k].extend(runs)
            collected.logical = child["logical"]
            child_meta = child
            rss[key] = dict(child["rss"], child_maxrss_bytes=usage.ru_maxrss * 1024,
                            child_wall_s=time.perf_counter() - t0)
            r = rss[key]
            log(f"{key:<28} peak RSS {r['child_maxrss_bytes'] / 1e6:8.0f} MB (process), "
                f"{(r['method_peak_rss_bytes'] or 0) / 1e6:8.0f} MB while measured, state "
                f"{(r['state_rss_bytes'] or 0) / 1e6:.0f} MB")
    finally:
        if proc is not None and proc.returncode is None:
            proc.terminate()
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    methods, ratios = compute(collected)  # type: ignore[arg-type]
    for k, m in methods.items():
        m["rss"] = rss[DERIVED_FROM.get(k, k)]
    cold = resolve(methods, COLD_READ)
    logical = collected.logical
    facts: dict[str, Any] = {
        "sha256_gbps": methods["hash.sha256"]["throughput_gbps"],
        "sha256_same_bytes_gbps": methods["hash.sha256"]["throughput_gbps"],
        "raw_write_gbps": methods["save.raw"]["throughput_gbps"],
        "cold_read_gbps": logical / cold["median"] / GB if cold else None,
        "cold_read_method": cold["key"] if cold else None,
        "memcpy_gbps": logical / methods["stall.memcpy"]["median"] / GB,
        "save_lower_bound_s": max(methods["hash.sha256"]["median"], methods["save.raw"]["median"]),
    }
    if cold:
        facts["resume_lower_bound_s"] = max(methods["hash.sha256"]["median"], cold["median"])
    all_runs = [r for key in METHODS if key not in DERIVED_FROM for r in collected.samples[key]]
    shares = [r["others_cpu_share"] for r in all_runs if r.get("others_cpu_share") is not None]
    if shares:
        facts["others_cpu_share_median"] = statistics.median(shares)
        facts["others_cpu_share_max"] = max(shares)
        facts["samples_with_others_over_quiet_share"] = sum(x >= args.quiet_share for x in shares)
        facts["samples"] = len(shares)
    facts["quiet_wait_total_s"] = sum(r.get("quiet_wait_s", 0.0) for r in all_runs)
    facts["quiet_timeout_s"], facts["quiet_share"] = args.quiet_timeout, args.quiet_share
    facts["retries"] = args.retries
    facts["discarded_samples"] = sum(len(r.get("discarded", [])) for r in all_runs)
    facts["disturbed_samples_kept"] = sum(bool(r.get("disturbed")) for r in all_runs)
    return {
        "schema": SCHEMA,
        "isolated": True,
        "shard_scaling": shard_scaling(methods, facts, args.shards, os.cpu_count() or 1, logical),
        "budget": budget_summary(methods, logical, args.budget_fraction),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": _dt.datetime.fromtimestamp(started, _dt.UTC).isoformat(timespec="seconds"),
        "duration_s": time.time() - started,
        "params": args.params,
        "dtype": args.dtype,
        "device": args.device if args.device == "cpu" else f"cuda:{torch.cuda.get_device_name(0)}",
        "moments_dtype": child_meta.get("moments_dtype"),
        "bytes": logical,
        "pairs": args.pairs,
        "model": dict(child_meta.get("model", {}), optimizer="torch.optim.AdamW after one step"),
        "machine": dict(facts_at_start, loadavg_start=load_start, loadavg_end=os.getloadavg(),
                        pressure_start=pressure_start, pressure_end=pressure()),
        "notes": [
            "--isolate: every method ran in its own fresh process (state built, libraries and the "
            "method's buffers warmed up, then its --pairs samples), the methods one after the other.",
            "rss.child_maxrss_bytes: the child's ru_maxrss (os.wait4), building the state included "
            "(AdamW's first step holds the gradients too); rss.method_peak_rss_bytes: VmHWM reset "
            "(/proc/self/clear_refs) after the warm-up, read after the samples: the state, the "
            "method's buffers and what it allocated while measured; method_peak_over_state_bytes: that "
            "minus the RSS right after the state was built.",
            "save.*: seconds from the call until the bytes are fsync'd; stall.*: seconds the caller "
            "blocks; resume.*: page cache dropped before each read. See bench_checkpoint.py's docstring.",
        ],
        "facts": facts,
        "methods": methods,
        "ratios": ratios,
        "targets_met": {k: v["met"] for k, v in ratios.items() if not v.get("info")},
    }


# ---------------------------------------------------------------------------- main


def _shard_list(text: str) -> tuple[int, ...]:
    """--shards 1,2,4 -> (1, 2, 4): distinct counts >= 1, in the order given."""
    try:
        ks = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of shard counts: {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"shard counts must be >= 1: {text!r}")
    return ks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=DEFAULT_PARAMS,
                    help="parameters N (state = 12·N bytes in fp32, 6·N in bf16); default 120,000,000 (ANDREA-120M)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="parameter dtype; AdamW keeps m and v in the same dtype. The ANDREA .bin path "
                         "(float32 only) is measured with fp32 only; default fp32")
    ap.add_argument("--pairs", type=int, default=5, help="pairs per method (median of these); default 5")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the parameters and moments live; with cuda the memcpy row is a device-to-host "
                         "copy of the same bytes into pinned memory; default cpu")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                    help="folder for bench_checkpoint_<N>.json and .png")
    ap.add_argument("--dir", type=Path, default=None,
                    help="scratch folder on the disk to measure (default: --out); emptied at the end")
    ap.add_argument("--quiet-timeout", type=float, default=60.0,
                    help="before each sample, wait up to this many seconds until other processes use "
                         "less than --quiet-share of the CPU and almost no disk (0: never wait); default 60")
    ap.add_argument("--quiet-share", type=float, default=0.10,
                    help="share of the machine's CPU (0..1) other processes may use for a sample to "
                         "start and count; default 0.10")
    ap.add_argument("--retries", type=int, default=3,
                    help="redo a sample during which other processes used >= --quiet-share of the CPU "
                         "or real disk I/O, at most this many times (0: keep every sample); default 3")
    ap.add_argument("--shards", type=_shard_list, default=DEFAULT_SHARDS, metavar="K,K,...",
                    help="shard counts K of the sharded general save and load (save.shards_K, "
                         "resume.shards_K); default 1,2,4")
    ap.add_argument("--budget-fraction", type=float, default=DEFAULT_BUDGET_FRACTION, metavar="F",
                    help="staging budget of stall.general_budget as a share of the state (0 < F < 1); "
                         "default 0.25")
    ap.add_argument("--isolate", action="store_true",
                    help="measure every method in its own fresh subprocess, one after the other, and "
                         "report each one's peak RSS beside the usual ratios (outputs "
                         "bench_checkpoint_<N>[_bf16]_isolated.json/.png)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one method in this process (what --isolate runs)
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--from-json", type=Path, default=None, metavar="JSON",
                    help="measure nothing: redraw the PNG and reprint the tables of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    if not 0.0 < args.budget_fraction < 1.0:
        ap.error("--budget-fraction must be between 0 and 1")
    register_shards(args.shards)
    if args.child is not None and (args.child not in METHODS or args.child in DERIVED_FROM):
        ap.error(f"--child: no method {args.child!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available here")
    if args.device == "cuda":
        METHODS["stall.memcpy"] = ("stall", "device-to-host copy into pinned buffer", "seconds (synchronized)")

    if args.child is not None:
        if args.child_out is None:
            ap.error("--child needs --child-out")
        return run_child(args)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=None if sys.stdout.isatty() else 180)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        png_path = args.from_json.with_suffix(".png")
        plot(result, png_path)
        for part in render_table(result):
            console.print(part)
        console.print(f"command: {result['command']}")
        console.print(f"wrote {png_path}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.dir if args.dir is not None else args.out
    base.mkdir(parents=True, exist_ok=True)
    if args.isolate:
        def on_term_isolated(signum, frame):  # noqa: ARG001 - stop the child and clean up on SIGTERM
            raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, on_term_isolated)
        result = run_isolated(args, lambda text: console.print(f"{time.strftime('%H:%M:%S')} {text}",
                                                              markup=False, highlight=False))
        stem = (f"bench_checkpoint_{args.params}" + ("" if args.dtype == "fp32" else f"_{args.dtype}")
                + ("" if args.device == "cpu" else f"_{args.device}") + "_isolated")
        json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, png_path)
        for part in render_table(result):
            console.print(part)
        console.print(f"wrote {json_path} and {png_path}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix=".bench-scratch-", dir=base))

    def on_term(signum, frame):  # noqa: ARG001 - run the finally blocks (cleanup) on SIGTERM
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)

    bench: Bench | None = None
    started = time.time()
    load_start = os.getloadavg()
    pressure_start = pressure()
    facts_at_start = machine_facts(scratch)  # source hashes of the code as imported now
    try:
        n = args.params
        groups = groups_for(args.dtype, args.shards)
        total = sum(len(keys) for _, keys in groups) * args.pairs + 5
        with Progress(TextColumn("[bold]{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=False) as prog:
            task = prog.add_task(f"building state ({n:,} params)", total=total)
            log = (lambda s: prog.console.print(f"{time.strftime('%H:%M:%S')} {s}", markup=False, highlight=False)) if not console.is_terminal else (lambda s: None)
            meter = Meter(_block_stat_path(scratch), quiet_timeout=args.quiet_timeout,
                          quiet_share=args.quiet_share,
                          on_wait=lambda text: prog.update(task, description=text))
            bench = Bench(n, args.pairs, scratch, log, meter, retries=max(0, args.retries), dtype=args.dtype,
                          device=args.device, shards=args.shards, budget_fraction=args.budget_fraction)
            prog.advance(task)
            prog.update(task, description="warm-up")
            bench.warmup()
            prog.advance(task)
            prog.update(task, description="sha256 in memory")
            meter.wait_quiet()
            sha_gbps = sha256_throughput(bench.logical)
            moments = bench.opt.state[next(iter(bench.model.parameters()))]["exp_avg"].dtype
            prog.advance(task)

            makers = bench.makers()
            for group, keys in groups:
                if group == "resume":
                    prog.update(task, description="committing a generation to resume")
                    bench.prepare_resume()
                    # free what the stall group held, before loads allocate their arrays
                    if bench.writer is not None:
                        bench.writer.buffers = None
                    bench.copy_buffer = None
                    free_staging(bench.general)
                    free_staging(bench.budget)
                    gc.collect()
                for pair in range(args.pairs):
                    order = keys if pair % 2 == 0 else list(reversed(keys))
                    for key in order:
                        prog.update(task, description=f"pair {pair + 1}/{args.pairs} {key}")
                        bench.record_sample(key, bench.measure(key, makers[key]))
                        prog.advance(task)
            prog.update(task, description="warm read (page cache)")
            resume_file = bench._general_files()[0]
            np.fromfile(resume_file, dtype=np.uint8)  # page it in
            t0 = time.perf_counter()
            np.fromfile(resume_file, dtype=np.uint8)
            warm_s = time.perf_counter() - t0
            prog.advance(task)
            prog.update(task, description="done")
            prog.advance(task)

        methods, ratios = compute(bench)
        cold = resolve(methods, COLD_READ)
        assert cold is not None
        facts = {
            "sha256_gbps": sha_gbps,
            "sha256_same_bytes_gbps": methods["hash.sha256"]["throughput_gbps"],
            "raw_write_gbps": methods["save.raw"]["throughput_gbps"],
            "cold_read_gbps": bench.logical / cold["median"] / GB,
            "cold_read_method": cold["key"],
            "warm_read_gbps": bench.logical / warm_s / GB,
            "memcpy_gbps": bench.logical / methods["stall.memcpy"]["median"] / GB,
            "sha256_seconds_for_state": bench.logical / (sha_gbps * GB),
            "resume_lower_bound_s": max(methods["hash.sha256"]["median"], cold["median"]),
            "save_lower_bound_s": max(methods["hash.sha256"]["median"], methods["save.raw"]["median"]),
        }
        all_runs = [r for key in METHODS if key not in DERIVED_FROM for r in bench.samples[key]]
        shares = [r["others_cpu_share"] for r in all_runs if r.get("others_cpu_share") is not None]
        if shares:
            facts["others_cpu_share_median"] = statistics.median(shares)
            facts["others_cpu_share_max"] = max(shares)
            facts["samples_with_others_over_quiet_share"] = sum(x >= args.quiet_share for x in shares)
            facts["samples"] = len(shares)
        facts["quiet_wait_total_s"] = sum(r.get("quiet_wait_s", 0.0) for r in all_runs)
        facts["quiet_timeout_s"], facts["quiet_share"] = args.quiet_timeout, args.quiet_share
        facts["retries"] = args.retries
        facts["discarded_samples"] = sum(len(r.get("discarded", [])) for r in all_runs)
        facts["disturbed_samples_kept"] = sum(bool(r.get("disturbed")) for r in all_runs)
        result = {
            "schema": SCHEMA,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": _dt.datetime.fromtimestamp(started, _dt.UTC).isoformat(timespec="seconds"),
            "duration_s": time.time() - started,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "params": n,
            "dtype": args.dtype,
            "device": args.device if args.device == "cpu" else f"cuda:{torch.cuda.get_device_name(0)}",
            "moments_dtype": {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(moments, str(moments)),
            "bytes": bench.logical,
            "pairs": args.pairs,
            "model": {"d_model": bench.model.d_model, "layers": bench.model.n_layers,
                      "tensors_per_region": len(list(bench.model.parameters())),
                      "optimizer": "torch.optim.AdamW after one step"},
            "machine": dict(facts_at_start, loadavg_start=load_start, loadavg_end=os.getloadavg(),
                            pressure_start=pressure_start, pressure_end=pressure()),
            "notes": [
                "Medians of --pairs samples; each group alternates method order per pair.",
                "save.*: seconds from the call until the bytes are fsync'd. Library saves fsync the file only "
                "(not the folder); ripresa also renames, fsyncs the folder twice and writes a commit marker.",
                "stall.ripresa_async is AsyncCheckpointWriter.last_stall_s; stall.ripresa_async_caller adds "
                "bin_arrays() and companion_snapshot(); every async save is waited for before the next figure.",
                "resume.*: page cache dropped with fsync + POSIX_FADV_DONTNEED before each read.",
                "save.general / stall.general_async / resume.general_load: the general format through "
                "GeneralBackend (save(); capture() with staging, then the commit; load() of a committed "
                "generation). hash.sha256: hashlib over the same tensors in memory.",
                "write_amplification: /proc/self/io write_bytes delta / bytes (weights + m + v); device_write_amplification: "
                "sectors written by the whole block device in the same window (includes journal and other processes).",
            ],
            "facts": facts,
            "shard_scaling": shard_scaling(methods, facts, args.shards, os.cpu_count() or 1, bench.logical),
            "budget": budget_summary(methods, bench.logical, args.budget_fraction),
            "methods": methods,
            "ratios": ratios,
            "targets_met": {k: v["met"] for k, v in ratios.items() if not v.get("info")},
        }
        if args.device == "cuda":
            result["notes"].append("--device cuda: the state lives on the GPU; stall.memcpy is a synchronized "
                                   "device-to-host copy of the same bytes into the pinned staging buffer; the "
                                   "save.raw and hash.sha256 floors read a host copy of the same bytes.")
        stem = (f"bench_checkpoint_{n}" + ("" if args.dtype == "fp32" else f"_{args.dtype}")
                + ("" if args.device == "cpu" else f"_{args.device}"))
        json_path = args.out / f"{stem}.json"
        png_path = args.out / f"{stem}.png"
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, png_path)
        for part in render_table(result):
            console.print(part)
        console.print(f"wrote {json_path} and {png_path}")
        return 0
    finally:
        if bench is not None:
            bench.close()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
