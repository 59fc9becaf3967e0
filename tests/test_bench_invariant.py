"""benchmarks/bench_invariant.py (issue 32, item 4) runs end to end at a tiny size on 2 real gloo ranks.

No timing is judged: every arm has its samples, the bytes each arm's collectives carry are the
formulas' (the tree's upper levels by all-to-all + all-gather: 2(W-1)/W·P; DDP's all-reduce: P handed, 2(W-1)/W·P sent in a
ring; the all-to-all path: 2(W-1)/W·P; the local floor: none), the a2a reduction was checked bit-equal to
InvariantSteps' at every step, and the JSON, the PNG and the paper model are written.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, run

BENCH = REPO / "benchmarks" / "bench_invariant.py"


@pytest.mark.slow
def test_the_benchmark_measures_every_arm_and_counts_the_bytes_of_each_path(tmp_path):
    proc = run([sys.executable, str(BENCH), "--worlds", "2", "--width", "64", "--depth", "1", "--dim", "32",
                "--blocks", "2", "--block-steps", "2", "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_invariant.json").read_text())
    assert (tmp_path / "bench_invariant.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["schema"] == "ripresa-bench-invariant/1" and len(doc["runs"]) == 1
    r = doc["runs"][0]
    w, p = r["world"], r["grad_bytes"]
    assert w == 2 and p == 4 * r["params"] and r["checked_a2a_bits"]
    for arm in ("on", "a2a", "off", "accum"):
        samples = r["samples"][arm]
        assert len(samples) == 2 * 2, arm
        assert all(s["step_s"] > 0 for s in samples), arm
    k = -(-r["params"] // w)
    assert {s["sent_bytes"] for s in r["samples"]["on"]} == {2 * (w - 1) * k * 4 + (w - 1) * 8 * r["per_rank"]}  # + losses
    assert {s["sent_bytes"] for s in r["samples"]["off"]} == {2 * (w - 1) / w * p}
    assert {s["sent_bytes"] for s in r["samples"]["a2a"]} == {2 * (w - 1) * k * 4}
    assert {s["sent_bytes"] for s in r["samples"]["accum"]} == {0}
    paper = doc["paper"]
    assert paper["world"] == 64 and paper["on"]["sent"] == pytest.approx(2 * 63 / 64 * paper["grad_bytes"])
    assert paper["on_over_ddp_bytes"] == pytest.approx(1) and paper["first_version"]["sent"] == 63 * paper["grad_bytes"]
    assert "on" in proc.stdout and "a2a" in proc.stdout
