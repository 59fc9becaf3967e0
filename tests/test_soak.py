"""The soak (tests/soak/soak.py, ``make soak``): a sample in the default tier, and the soak failing when it must (long tier).

The sample is 20 real interruptions of two real training loops (general format
with Adafactor, ANDREA ``.bin`` with AdamW over 10^9 rows): SIGKILL (some
during the start), SIGTERM, SIGUSR1 + SIGKILL, SIGUSR1 from the first line and
a full tmpfs, each final state compared bitwise with an uninterrupted run; and
4 of the s3 lane: store outages (in training, in the close) and SIGUSR1 at the
start of a trainer that mirrors to a real S3 server behind a fault proxy. The sabotage run breaks each lane on
purpose — the newest generation deleted before each restart, a resume without
the random streams — and the soak must report lost generations and a final
state that differs, and exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent / "soak" / "soak.py"


def _soak(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="160")
    res = subprocess.run([sys.executable, str(SOAK), "--out", str(out), "--fresh-share", "0", "--total", "100", *args],
                         capture_output=True, text=True, timeout=600, env=env)
    return res, json.loads((out / "soak.json").read_text())


def test_soak_sample_survives_twenty_interruptions_and_ends_bitwise_equal(tmp_path):
    res, rec = _soak(tmp_path, "--seed", "14", "--interruptions", "20", "--lanes", "general,andrea")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert rec["delivered"] == rec["survived"] == 20
    assert rec["lost"] == 0 and rec["diverged_steps"] == 0 and rec["equal_laps"] == rec["laps"] >= 2
    kinds = {k for lane in rec["lanes"].values() for k in lane["delivered"]}
    assert len(kinds) >= 3, kinds
    assert rec["generations"] > 0 and "replay: python tests/soak/soak.py --seed 14" in " ".join(res.stdout.split())


@pytest.mark.slow
def test_soak_sample_of_store_outages_and_sigusr1_from_the_first_line(tmp_path):
    """The s3 lane: outages (proxy down/stall/reset, server restart) in training and in the close, SIGUSR1 at start."""
    res, rec = _soak(tmp_path, "--seed", "16", "--interruptions", "4", "--lanes", "s3",
                     "--kinds", "outage,outage-close,sigusr1-start")
    s3 = rec["lanes"]["s3"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert rec["delivered"] == rec["survived"] == 4 and rec["lost"] == 0 and rec["equal_laps"] == rec["laps"] >= 1
    assert len(s3["delivered"]) >= 2, s3
    assert s3["max_mirror_lines"] <= 60, s3  # a few lines per outage, never one per wake-up
    assert all(t < 90 for t in s3["close_s"]), s3


@pytest.mark.slow  # the default tier keeps the 20-interruption sample; this proves the soak can fail
def test_soak_reports_lost_generations_and_a_different_final_state(tmp_path):
    res, rec = _soak(tmp_path, "--seed", "15", "--interruptions", "4", "--lanes", "general,andrea",
                     "--kinds", "sigkill", "--sabotage", "general=lose,andrea=rng")
    assert res.returncode == 1, res.stdout[-3000:]
    general, andrea = rec["lanes"]["general"], rec["lanes"]["andrea"]
    assert general["lost"] > 0 and any("was committed" in x for x in general["lost_detail"]), general
    assert andrea["equal_laps"] < andrea["laps"] and andrea["diverged_steps"] > 0, andrea
    assert "FAIL" in res.stdout and not rec["ok"]
