"""``ripresa verify -- torchrun ...``: the four paths of an unchanged distributed script, each a fresh process group.

Every rank takes the steering; rank 0 records the whole parameters and moments (FSDP2 shards gathered with
``DTensor.full_tensor()``), every rank's data position and next draws, and each step's ``loss_per_rank``
(docs/SHARDED.md, docs/VERIFY.md). Four torchrun launches: slow tier only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


@pytest.mark.slow
@pytest.mark.parametrize("script", ["fsdp_loop.py", "dist_loop.py"])
def test_verify_steers_every_rank_of_an_unchanged_torchrun_script_at_tolerance_0(tmp_path, script):
    out = tmp_path / "V"
    cmd = [sys.executable, "-m", "ripresa", "verify", "--steer", "--steps", "8", "--cut", "4", "--tolerance", "0",
           "--output", str(out), "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "--", str(FIXTURES / script), "--run", str(tmp_path / "IGNORED"), "--steps", "100",
           "--every", "1000"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600)
    report = json.loads((out / "verification.json").read_text())
    assert report["positive"] is True, (res.stdout + res.stderr)[-4000:]  # the full resume agrees at tolerance 0
    summary = json.loads((out / "resume" / "summary.json").read_text())
    assert len(summary["start"]["data"]) == 2 and {k.split("/")[0] for k in summary["start"]["next_draws"]} == {"rank0", "rank1"}
    assert [len(s["loss_per_rank"]) for s in summary["steps"]] == [2, 2, 2, 2]
    assert summary["start"]["progress"]["step"] == 4 and summary["final"]["progress"]["step"] == 8
    assert not (tmp_path / "IGNORED").exists()  # every path used the verifier's own run folder
    if script == "fsdp_loop.py":  # whole tensors, not one rank's shard: 8*32 weights of the first layer
        first = next(v for k, v in summary["final"]["parameters"].items() if k.endswith("0.weight"))
        assert len(first) == 32 and len(first[0]) == 8
        assert report["negative_divergence_detected"] is True  # each rank's input noise: its own torch stream
        assert report["all_checks_passed"] is True and res.returncode == 0, res.stdout[-3000:]
