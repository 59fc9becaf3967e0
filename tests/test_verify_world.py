"""``ripresa verify --world-sizes``: a run resumed on other numbers of ranks, compared at tolerance 0 with the
uninterrupted one; the negative control is the same change without the world-size-invariant mode (docs/VERIFY.md,
"Across world sizes").

Default tier: the refusals (in-process, and one real ``python -m ripresa`` for the exit code) and the steering's
``invariant`` field. Slow: real torchrun process groups on gloo (tests/fixtures/invariant_ckpt_loop.py), 2 → 1 → 4
passing, and a trainer without the mode (DDP's all-reduce) failing with its first divergence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

from ripresa.cli import main
from ripresa.errors import BadInput
from ripresa.session.steer import ENV, Steering
from ripresa.verify.world import parse_world_sizes, segment_cuts, torchrun_argv

LOOP = FIXTURES / "invariant_ckpt_loop.py"
ENV_RUN = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "COLUMNS": "200"}


@pytest.mark.parametrize("text", ["", "2", "2,2,2", "0,2", "2,-1", "2,1,a", "65,1", "1e3,1", "2,,1", "²,1", "2;1",
                                  " , ", "1,2," + "1," * 20 + "2", "9" * 500, "2,99999999999999999999"])
def test_world_sizes_that_are_not_a_change_of_rank_counts_are_refused(text):
    with pytest.raises(BadInput, match="world-sizes"):
        parse_world_sizes(text)


def test_world_sizes_and_cuts():
    assert parse_world_sizes(" 2, 1 ,4") == (2, 1, 4)
    assert segment_cuts(12, 3) == [4, 8] and segment_cuts(3, 3) == [1, 2] and segment_cuts(8, 3) == [2, 5]
    with pytest.raises(BadInput, match="too few steps"):
        segment_cuts(2, 3)
    argv = torchrun_argv(["python", "train.py", "--folder", "x"], 4)
    assert argv[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--no-python", "--",
                        "python", "train.py", "--folder", "x"]


@pytest.mark.parametrize("args", [
    ["--world-sizes", "2,x"],
    ["--world-sizes", "2,1", "--contract"],
    ["--world-sizes", "2,1", "--cut", "3"],
    ["--world-sizes", "2,1", "--steps", "1"],
    ["--world-sizes", "2,1", "--tolerance", "-1"],
])
def test_bad_requests_are_refused_before_anything_runs(tmp_path, capsys, args):
    out = tmp_path / "V"
    assert main(["verify", "--output", str(out), *args, "--", sys.executable, "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ripresa verify: error: ") and "Traceback" not in err
    assert not out.exists()


def test_a_command_that_is_already_a_torchrun_launch_or_missing_is_refused(tmp_path, capsys):
    out = tmp_path / "V"
    assert main(["verify", "--world-sizes", "2,1", "--output", str(out), "--", sys.executable, "-m",
                 "torch.distributed.run", "--nproc_per_node=2", "train.py"]) == 2
    assert "not a torchrun launch" in capsys.readouterr().err
    assert main(["verify", "--world-sizes", "2,1", "--output", str(out)]) == 2
    assert "needs the trainer command" in capsys.readouterr().err
    assert not out.exists()


def test_the_ripresa_command_exits_2_on_bad_world_sizes_with_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "ripresa", "verify", "--world-sizes", "4,0", "--output", str(tmp_path / "V"),
                          "--", sys.executable, "train.py"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **ENV_RUN})
    assert res.returncode == 2, res.stderr
    assert "rank count out of range" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "V").exists()


def test_the_steering_carries_the_mode_and_refuses_a_value_of_the_wrong_type(tmp_path):
    for keep in (True, False):
        raw = Steering("negative-1", tmp_path / "run", tmp_path, 3, invariant=keep).to_env()[ENV]
        assert Steering.parse(raw).invariant is keep
    doc = json.loads(raw)
    for bad in ("false", 0, None):
        with pytest.raises(BadInput, match="wrong type"):
            Steering.parse(json.dumps({**doc, "invariant": bad}))
    with pytest.raises(BadInput, match="not a ripresa verify steering"):
        Steering.parse(json.dumps({k: v for k, v in doc.items() if k != "invariant"}))


def _verify(tmp_path: Path, sizes: str, steps: int, *loop_args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "V"
    res = subprocess.run([sys.executable, "-m", "ripresa", "verify", "--world-sizes", sizes, "--steps", str(steps),
                          "--output", str(out), "--", sys.executable, "-B", str(LOOP), "--folder", str(tmp_path / "IGNORED"),
                          "--steps", "100", *loop_args], capture_output=True, text=True, timeout=900, env={**os.environ, **ENV_RUN})
    assert (out / "verification.json").exists(), (res.stdout + res.stderr)[-4000:]
    return res, json.loads((out / "verification.json").read_text())


@pytest.mark.slow
def test_a_run_resumed_on_two_then_one_then_four_ranks_is_bitwise_the_uninterrupted_one(tmp_path):
    res, r = _verify(tmp_path, "2,1,4", 12)
    assert r["positive"] is True, r["first_divergence"]
    assert r["negative_divergence_detected"] is True and r["negative_identical_before_first_change"] is True
    assert r["all_checks_passed"] is True and res.returncode == 0, res.stdout[-3000:]
    assert r["tolerance"] == {"absolute": 0.0, "relative": 0.0} and r["cuts"] == [4, 8]
    assert r["table"]["resume"]["max_weight_gap"] == 0 and r["table"]["resume"]["loss_gap"] == 0
    # the negative control leaves the uninterrupted run only after the first change (what diverges is the change)
    # (its weights, hashed each step, differ from the first step on one rank; its losses agree until step 9)
    assert r["first_divergence"]["negative"].startswith("parameters_sha256 step 5 on 1 rank: "), r["first_divergence"]
    # real process groups: each segment ran on its world size, steered, the negative one with invariant=false
    out = tmp_path / "V"
    for k, world in enumerate((2, 1, 4), 1):
        steps = json.loads((out / f"resume-{k}" / "summary.json").read_text())["steps"]
        assert {len(s.get("loss_per_rank", [None])) for s in steps} == {world}  # one rank: a single process's record
        assert json.loads(r["paths"][f"negative-{k}"]["steering"])["invariant"] is False
        assert json.loads(r["paths"][f"resume-{k}"]["steering"])["invariant"] is True
    # the Checkpointers' own words: the mode on (off in the control), each change called exact (changed)
    said = r["checkpointer_said"]
    assert [s["mode"] for s in said["resume"]] == [{"micro_batches": 4, "exact": True}] * 3
    assert [s["change"] for s in said["resume"]] == [None, "exact", "exact"]
    assert [s["mode"]["exact"] for s in said["negative"]] == [False] * 3 and said["negative"][2]["change"] == "changed"
    assert not (tmp_path / "IGNORED").exists()
    assert "agrees within 0" in res.stdout and "not compared (one per rank" in res.stdout
    # the final state in one line: the 2-rank run's last generation and the 4-rank segment's, fingerprinted
    assert r["final_state"]["same"] is True and r["final_state"]["line"].startswith("same state"), r["final_state"]
    assert {"model", "optimizer"} <= set(r["final_state"]["parts"])


@pytest.mark.slow
def test_a_trainer_without_the_mode_fails_with_its_first_divergence_after_the_change(tmp_path):
    res, r = _verify(tmp_path, "2,1,2", 8, "--mode", "ddp")
    assert res.returncode == 1 and r["all_checks_passed"] is False and r["positive"] is False, res.stdout[-3000:]
    # identical before the first change (step 2, same two ranks), not after it: on one rank the loss differs
    first = r["first_divergence"]["resume"]
    assert first.startswith("loss step 3 on 1 rank: "), first
    assert "first divergence of the resumed run: loss step 3 on 1 rank" in res.stdout.replace("\n", " ")
    said = r["checkpointer_said"]["resume"]
    assert said[0]["mode"] is None and said[1]["change"] == "changed" and "does not use world-size-invariant" in said[1]["why"]
    assert "Checkpointer at each change: changed (the run does not use" in res.stdout.replace("\n", " ")


@pytest.mark.slow
def test_a_trainer_whose_mode_the_steering_cannot_switch_off_leaves_the_check_blind(tmp_path):
    """Its own InvariantSteps, not ``ckpt.invariant``: the resumed line agrees, and so does the control: exit 1."""
    res, r = _verify(tmp_path, "2,4", 4, "--mode", "own")
    assert r["positive"] is True and r["negative_divergence_detected"] is False, r["first_divergence"]
    assert res.returncode == 1 and r["all_checks_passed"] is False
    assert "no divergence (check is blind)" in res.stdout


@pytest.mark.slow
def test_a_world_size_the_mode_refuses_ends_the_verification_with_exit_2(tmp_path):
    """G = 4 micro-batches do not divide among 3 ranks: the first launch fails, its log's reason is shown."""
    out = tmp_path / "V"
    res = subprocess.run([sys.executable, "-m", "ripresa", "verify", "--world-sizes", "3,2", "--steps", "4", "--output",
                          str(out), "--", sys.executable, "-B", str(LOOP), "--folder", str(tmp_path / "IGNORED"),
                          "--steps", "100"], capture_output=True, text=True, timeout=600, env={**os.environ, **ENV_RUN})
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "path failed" in res.stderr and "do not divide among the ranks" in res.stderr and "ChildFailedError" not in res.stderr
    assert not (out / "verification.json").exists()


@pytest.mark.slow
def test_an_fsdp2_run_resumed_on_two_then_one_then_four_ranks_is_bitwise_the_uninterrupted_one(tmp_path):
    """FSDP2 (fully_shard): the whole parameters and moments are compared (shards gathered), not a rank's shard."""
    res, r = _verify(tmp_path, "2,1,4", 6, "--mode", "fsdp")
    assert r["positive"] is True, r["first_divergence"]
    assert r["negative_divergence_detected"] is True and r["all_checks_passed"] is True and res.returncode == 0
    final = json.loads((tmp_path / "V" / "resume-3" / "summary.json").read_text())["final"]
    first = next(v for k, v in final["parameters"].items() if k.endswith("0.weight"))
    assert len(first) == 32 and len(first[0]) == 16  # whole, gathered from 4 ranks' shards
    assert [s["change"] for s in r["checkpointer_said"]["resume"]] == [None, "exact", "exact"]
    assert r["final_state"]["same"] is True, r["final_state"]  # a .dcp of 2 ranks and one of 4: one state
