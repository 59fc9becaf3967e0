"""benchmarks/bench_memory.py (issue 31, item 2) runs end to end at the tiny size and reports every figure.

No timing is judged: the figures are checked present, of the right kind and positive where a duration
cannot be zero; the memory tier's folder, the floor's shared-memory file and the scratch run folders are
gone after the run.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from conftest import REPO, run

BENCH = REPO / "benchmarks" / "bench_memory.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_memory")
    out, shm = tmp / "out", tmp / "shm"
    shm.mkdir()
    proc = run([sys.executable, str(BENCH), "--size", "tiny", "--pairs", "1", "--block-steps", "3",
                "--disk-steps", "3", "--floor-copies", "1", "--quiet-timeout", "0", "--retries", "0",
                "--out", str(out)],
               env={"RIPRESA_MEMORY_DIR": str(shm)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, shm, proc, json.loads((out / "bench_memory_tiny.json").read_text())


def positive(s: dict, what: str, *, zero_ok: bool = False) -> None:
    """A stats block of at least one sample; every sample a finite duration, > 0 unless ``zero_ok``."""
    assert s["n"] >= 1 and len(s["samples"]) == s["n"], what
    assert s["min"] <= s["median"] <= s["max"], what
    for x in s["samples"]:
        assert math.isfinite(x) and (x >= 0 if zero_ok else x > 0), (what, s["samples"])


def test_every_measured_quantity_is_there_and_positive(tiny):
    _, _, _, doc = tiny
    assert doc["schema"] == "ripresa-bench-memory/1" and doc["config"] == "tiny" and doc["memory_every"] == 1
    assert doc["params"] > 100_000 and doc["live_bytes"] == 12 * doc["params"]  # fp32 weights + exp_avg + exp_avg_sq
    for key in ("floor.memcpy", "floor.memcpy_shm", "floor.sha256"):
        positive(doc["floors"][key], key)
    for arm in ("off", "memory", "disk"):
        for k in ("iter_s", "fwd_bwd_s", "opt_s", "step_done_s"):
            positive(doc["steps"][arm][k], f"{arm}.{k}")
    assert doc["steps"]["off"]["iter_s"]["n"] == doc["steps"]["memory"]["iter_s"]["n"] == 2  # the first not counted
    mem = doc["memory"]
    for k in ("visible_stall_s", "capture_stall_s", "settle_wait_s", "copy_s_overlapped", "copy_s_alone",
              "hash_s_overlapped", "hash_s_alone", "thread_busy_s"):
        positive(mem[k], f"memory.{k}")
    positive(mem["step_wait_s"], "memory.step_wait_s", zero_ok=True)  # 0 when the copy was done in time
    assert mem["visible_stall_s"]["n"] == 2 and mem["copy_s_alone"]["n"] == 1 and mem["copy_s_overlapped"]["n"] == 2
    assert mem["visible_stall_s"]["samples"] == pytest.approx(
        [c + w for c, w in zip(mem["capture_stall_s"]["samples"], mem["step_wait_s"]["samples"], strict=True)],
        abs=2e-6)
    assert len(mem["first_capture_stall_s"]) == 2 and all(x > 0 for x in mem["first_capture_stall_s"])
    assert mem["slot_bytes"] > doc["live_bytes"] and mem["captures"] == 3 + 3  # the warm-up block, then one block of 3
    disk = doc["disk"]
    for k in ("stall_s", "staging_s", "write_s"):
        positive(disk[k], f"disk.{k}")
    positive(disk["prev_write_wait_s"], "disk.prev_write_wait_s", zero_ok=True)
    for key, r in doc["ratios"].items():
        for m in ("median", "min"):
            assert isinstance(r[m], float) and math.isfinite(r[m]), (key, r)
    for key in ("visible_stall_over_memcpy", "step_overhead_pct"):
        assert set(doc["goals_met"][key]) == {"median", "min"}
        assert all(isinstance(v, bool) for v in doc["goals_met"][key].values())
    assert isinstance(doc["hash_keeps_up"], bool)
    (pair,) = doc["pairs_detail"]  # one pair: off, then memory
    assert pair["order"] == ["off", "memory"] and pair["memory"]["quiet_wait_s"] == 0.0  # --quiet-timeout 0
    assert pair["discarded"] == [] and isinstance(pair["off"]["disturbed"], bool)  # --retries 0: every block kept
    assert pair["overhead_pct"] == pytest.approx(100 * (pair["memory"]["iter_s"] / pair["off"]["iter_s"] - 1))
    assert doc["machine"]["torch_threads"] >= 1 and doc["machine"]["wall_s"] > 0


def test_prints_the_tables_and_leaves_nothing_behind(tiny):
    out, shm, proc, _ = tiny
    assert "visible stall / memcpy" in proc.stdout and "step-time overhead %" in proc.stdout
    assert "hash keeps up at memory_every=1" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["bench_memory_tiny.json"]  # scratch run folders removed
    tier_root = shm / f"ripresa-{os.geteuid()}"
    assert sorted(p.name for p in shm.iterdir()) == [tier_root.name]  # the floor's mapping removed
    assert list(tier_root.iterdir()) == []  # the memory tier's slots removed at the normal end
