"""The table of cases of issue 12 (tests/support/cases.py), real processes, tolerance 0.

For every case: (a) a run SIGKILLed at a random step (seeded, printed) and
started again with the same command ends bitwise equal to a run never
interrupted; (b) ``ripresa verify --steer`` (no contract code in the script)
passes at tolerance 0 while its negative path, the resume without the random
streams, diverges; (c) every generation's JSON companion is under 64 KB.
Plus the refusals at construction: a plain ``DataLoader`` as ``data=``, an
object that is not ``Stateful``, ``format="andrea"`` for a bf16 or an amsgrad
state — each a typed error naming the object and the fix, the run folder
left free.

The default tier runs the fp16 + GradScaler kill-and-restart and the
refusals; the rest is the long tier (``make test-long``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import zlib
from pathlib import Path

import pytest
import torch
from conftest import popen, ripresa_cli, run, wait_for_step
from support import cases

import ripresa
from ripresa.errors import BadInput

SCRIPT = Path(cases.__file__)
ENV = {"OMP_NUM_THREADS": "1"}
#: The base of every case's kill step (each case mixes in its name); set RIPRESA_CASES_SEED to draw others.
SEED = int(os.environ.get("RIPRESA_CASES_SEED", "12"))
COMPANION_LIMIT = 64 * 1024
STEPS, EVERY = 12, 3


def script(case: str, folder: Path, *args: str) -> list[str]:
    return [sys.executable, "-B", str(SCRIPT), case, "--run", str(folder), *args]


def assert_small_companions(folder: Path) -> dict[str, int]:
    sizes = cases.companion_sizes(folder)
    assert sizes, f"no companion in {folder}"
    big = {k: v for k, v in sizes.items() if v >= COMPANION_LIMIT}
    assert not big, big
    return sizes


def kill_and_restart(tmp_path: Path, case: str) -> None:
    kill_at = random.Random(SEED ^ zlib.crc32(case.encode())).randrange(5, STEPS - 1)
    print(f"{case}: SIGKILL at step {kill_at} (RIPRESA_CASES_SEED={SEED})")
    ref_dir, folder = tmp_path / "ref", tmp_path / "run"
    # the uninterrupted reference and the run to kill, side by side
    ref = popen(script(case, ref_dir, "--steps", str(STEPS), "--every", str(EVERY), "--final", str(tmp_path / "ref.pt")))
    victim = popen(script(case, folder, "--steps", str(STEPS), "--every", str(EVERY), "--sleep", "0.1"))
    try:
        wait_for_step(folder, kill_at, victim)
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        victim.wait(timeout=60)
        out, err = ref.communicate(timeout=300)
    assert victim.returncode == -signal.SIGKILL
    assert ref.returncode == 0, err[-3000:]
    again = run(script(case, folder, "--steps", str(STEPS), "--every", str(EVERY), "--final", str(tmp_path / "run.pt")),
                env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    info = json.loads(again.stdout.strip().splitlines()[-1])
    assert info["resumed_from"] is not None, (kill_at, info)  # it did resume from a generation the kill left
    assert info["backend"] == ("bin" if cases.FORMATS[case] == "andrea" else "general"), info
    assert cases.differences(cases.load_final(tmp_path / "ref.pt"), cases.load_final(tmp_path / "run.pt")) == []
    sizes = assert_small_companions(folder)
    print(f"{case}: resumed from {Path(info['resumed_from']).name}; companions {sizes}")


def test_fp16_gradscaler_sigkill_at_a_random_step_then_restart_is_bitwise_equal(tmp_path):
    kill_and_restart(tmp_path, "fp16_scaler")
    # the scale backed off (found inf: steps skipped) and grew again, on both sides of the kill
    hist = [json.loads(x) for x in (tmp_path / "ref" / ".loss.jsonl").read_text().splitlines()]
    scales = [h["scale"] for h in hist if "scale" in h]
    assert len(scales) == STEPS
    moves = [b - a for a, b in zip(scales, scales[1:], strict=False)]
    assert min(moves) < 0 < max(moves), scales


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in cases.CASES if c != "fp16_scaler"])
def test_sigkill_at_a_random_step_then_restart_is_bitwise_equal(tmp_path, case):
    kill_and_restart(tmp_path, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", cases.CASES)
def test_verify_steered_passes_at_tolerance_zero_and_its_negative_diverges(tmp_path, case):
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--steer", "--steps", "6", "--cut", "3", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-B", SCRIPT, case, "--run", tmp_path / "IGNORED", "--steps", "100",
                      env=ENV, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads((out / "verification.json").read_text())
    assert r["mode"] == "steered" and r["tolerance"] == {"absolute": 0.0, "relative": 0.0}
    assert r["all_checks_passed"] and r["positive"] and r["negative_divergence_detected"], r["first_divergence"]
    checks = {c["name"]: c for c in r["checks"]["resume"]}
    for name in ("loss", "parameters", "optimizer", "next_draws"):
        assert checks[name]["passed"] and checks[name]["max_abs_gap"] == 0.0 and checks[name]["values_compared"] > 0
    if case in ("loader", "feistel"):  # the data position, compared per step and at the end
        assert checks["data"]["passed"] and checks["data"]["values_compared"] > 0
    if case == "loader":  # the resumed path crosses into the loader's second epoch (4 batches an epoch)
        epochs = [s["data"]["sampler"]["epoch"] for s in json.loads((out / "resume" / "summary.json").read_text())["steps"]]
        assert epochs == [0, 1, 1], epochs
    if case == "fp16_scaler":
        assert checks["scaler"]["passed"] and checks["scaler"]["values_compared"] > 0
    assert r["first_divergence"]["resume"] is None and r["first_divergence"]["resume-without-rng"]
    negative = {c["name"]: c for c in r["checks"]["resume-without-rng"]}
    assert not negative["next_draws"]["passed"] and not negative["loss"]["passed"]  # the training itself differs
    assert not (tmp_path / "IGNORED").exists()
    for path in ("continuous", "interrupted", "resume", "resume-without-rng"):
        sizes = assert_small_companions(out / path / "run")
    print(f"{case}: first divergence without RNG: {r['first_divergence']['resume-without-rng'][:120]}")
    print(f"{case}: companion after 6 steps: {assert_small_companions(out / 'continuous' / 'run')}")
    assert sizes


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp16_scaler", "bn_tied"])
def test_ddp_under_torchrun_stops_and_restarts_bitwise_equal_on_every_rank(tmp_path, case):
    """Two gloo ranks: a run stopped at step 6 and started again ends, on each rank, with the bytes of a run never
    stopped (weights, optimizer, scaler or BatchNorm buffers, each rank's own random streams)."""

    def torchrun(folder: Path, steps: int, final: Path) -> None:
        res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT), case,
                   "--run-dir", str(folder), "--steps", str(steps), "--every", str(EVERY), "--final", str(final)],
                  env=ENV, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]

    torchrun(tmp_path / "ref", STEPS, tmp_path / "ref.pt")
    torchrun(tmp_path / "run", 6, tmp_path / "half.pt")
    torchrun(tmp_path / "run", STEPS, tmp_path / "run.pt")
    for suffix in ("", ".rank1"):
        ref, got = (cases.load_final(tmp_path / f"{n}.pt{suffix}") for n in ("ref", "run"))
        assert cases.differences(ref, got) == [], suffix
    r0, r1 = cases.load_final(tmp_path / "ref.pt"), cases.load_final(tmp_path / "ref.pt.rank1")
    assert not torch.equal(r0["rng/torch_cpu"], r1["rng/torch_cpu"])  # each rank its own stream, each restored
    assert_small_companions(tmp_path / "run")


# ---- refusals at construction ----------------------------------------------------------------------------


class NotStateful:
    """An object a user might register that has no state_dict()/load_state_dict()."""


def _free(folder: Path) -> None:
    """The folder is free: a session can open it at once (and nothing was committed in it)."""
    state = cases.build("sgd_nesterov").state
    with ripresa.Checkpointer(folder, state, every=0, handle_signals=False, format="general") as ck:
        assert ck.resume() == 0


def test_a_plain_dataloader_as_data_is_refused_at_construction_naming_the_fix(tmp_path):
    loader = torch.utils.data.DataLoader(cases.Augmented(), batch_size=8, shuffle=True)
    model = torch.nn.Linear(6, 3)
    with pytest.raises(TypeError, match=r"data=<torch\.utils\.data\.dataloader\.DataLoader object .*plain "
                                        r"torch DataLoader, not made exact.*ripresa\.make_exact\(loader\)"):
        ripresa.TrainingState(model=model, data=loader)
    state = ripresa.TrainingState(model=model)
    state.data = loader  # swapped in after the state was built: the Checkpointer refuses it before any lock
    with pytest.raises(TypeError, match="plain torch DataLoader, not made exact"):
        ripresa.Checkpointer(tmp_path / "run", state, every=1, handle_signals=False)
    assert not (tmp_path / "run").exists()
    _free(tmp_path / "run")


def test_a_non_stateful_object_is_refused_at_construction_naming_it_and_the_fix(tmp_path):
    model = torch.nn.Linear(6, 3)
    with pytest.raises(TypeError, match=r"object 'ema' \(NotStateful\) lacks state_dict\(\)/load_state_dict\(\).*"
                                        r"Stateful protocol.*ripresa\.ScriptState"):
        ripresa.TrainingState(model=model, objects={"ema": NotStateful()})
    with pytest.raises(TypeError, match=r"data=NotStateful lacks state_dict\(\)/load_state_dict\(\).*EpochSampler"):
        ripresa.TrainingState(model=model, data=NotStateful())
    state = ripresa.TrainingState(model=model)
    state.objects["ema"] = NotStateful()
    with pytest.raises(TypeError, match=r"object 'ema' \(NotStateful\)"):
        ripresa.Checkpointer(tmp_path / "run", state, every=1, handle_signals=False)
    assert not (tmp_path / "run").exists()
    _free(tmp_path / "run")


@pytest.mark.parametrize("case, what", [("bf16", r"parameter '0\.weight' is not float32 \(found torch\.bfloat16\)"),
                                        ("amsgrad", "amsgrad")])
def test_format_andrea_is_refused_at_construction_for_a_state_it_cannot_hold(tmp_path, case, what):
    state = cases.build(case).state
    with pytest.raises(BadInput, match=f"format='andrea' cannot hold this training state: .*{what}") as ei:
        ripresa.Checkpointer(tmp_path / "run", state, every=1, handle_signals=False, format="andrea")
    assert "format='auto'" in ei.value.hint
    assert not list(tmp_path.glob("run/step_*"))
    _free(tmp_path / "run")


# ---- the data position of a sampler that owns its generator ------------------------------------------------


@pytest.mark.parametrize("kind", ["numpy", "feistel"])
def test_a_seeded_epoch_sampler_resumes_the_epochs_after_the_current_one_too(tmp_path, kind):
    """``EpochSampler(seed=...)`` makes its own generator, which no random stream holds: its state is in the data
    position, so the epochs drawn after a resume are those of an uninterrupted run (they were not, before)."""

    def session(folder: Path) -> tuple[ripresa.EpochSampler, ripresa.Checkpointer]:
        sampler = ripresa.EpochSampler(24, 5, seed=3, permutation=kind)
        state = ripresa.TrainingState(model=torch.nn.Linear(1, 1), data=sampler)
        return sampler, ripresa.Checkpointer(folder, state, every=0, handle_signals=False, asynchronous=False,
                                             format="general")

    straight = ripresa.EpochSampler(24, 5, seed=3, permutation=kind)
    want = [straight.next_batch() for _ in range(20)]  # four epochs
    sampler, ck = session(tmp_path)
    assert ck.resume() == 0
    got = [sampler.next_batch() for _ in range(7)]  # into the second epoch
    ck.step_done(7)
    ck.close(final_save=True)
    sampler, ck = session(tmp_path)
    assert ck.resume() == 7 and "generator" in sampler.state_dict()
    got += [sampler.next_batch() for _ in range(13)]
    ck.close()
    assert got == want
