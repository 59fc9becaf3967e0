"""The memory tier through every way in: ``ripresa train --memory-every``, Lightning's and HF's ``ExactResume``.

Each case: a run with disk generations every 10 steps and a memory generation every step is
SIGKILLed (a real SIGKILL) at a step between two disk generations; the same command started
again resumes from the memory tier (history ``memory_resume``, newer than the newest disk
generation, at most one step redone) and ends bitwise equal to an uninterrupted run that had
no memory tier at all. The killed run copies its last captures a second late on purpose
(``RIPRESA_TEST_COPY_DELAY``, tests/support/memory_harness.py): the next optimizer step must
wait for the copy — under Lightning's and the Trainer's optimizer wrappers too — or the
memory generation would hold the next step's weights and the resume would not be bitwise.

Default tier: ``ripresa train`` (tiny config) at a random step between disk generations.
Slow: Lightning, the HF Trainer, and the engine's sidecar written for a promoted generation.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from ripresa.formats.andrea_bin import read_bin
from ripresa.store.history import HISTORY_NAME, read_history
from ripresa.store.memory import MEMORY_ENV, tier_folder

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "support" / "memory_harness.py"
FAST = ["--config", "tiny", "--quiet", "--set", "train.batch_size=4", "--threads", "1", "--no-audit"]
DISK_EVERY = 10
#: Seconds the killed run's tier waits before each copy of the last steps before the kill: the next optimizer
#: step waits for it, or changes the weights first (a step of these models takes milliseconds).
DELAY = "1.0"


def _delayed(kill: int) -> dict[str, str]:
    return {"RIPRESA_TEST_COPY_DELAY": DELAY, "RIPRESA_TEST_COPY_DELAY_FROM": str(kill - 2)}
TIMEOUT = 600  # a hang guard only (the machine may be shared)


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """The memory tier's root: a fresh folder in /dev/shm (a real tmpfs) where there is one, removed after."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    folder = tempfile.mkdtemp(prefix="ripresa-test-", dir=base)
    monkeypatch.setenv(MEMORY_ENV, folder)  # tier_folder() here names the children's folder
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _env(shm: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RIPRESA_EXAMPLE_", "RIPRESA_VERIFY", "RIPRESA_TEST_"))}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env[MEMORY_ENV] = str(shm)
    env.update(extra)
    return env


def _start(cmd: list[str], cwd: Path, tag: str, env: dict[str, str]) -> subprocess.Popen:
    with open(cwd / f"{tag}.out", "wb") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _out(cwd: Path, tag: str) -> str:
    return (cwd / f"{tag}.out").read_text(errors="replace")


def _finish(p: subprocess.Popen, cwd: Path, tag: str, expect: int = 0) -> str:
    rc = p.wait(timeout=TIMEOUT)
    assert rc == expect, f"{tag}: exit {rc}, expected {expect}\n{_out(cwd, tag)[-3000:]}"
    return _out(cwd, tag)


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_history(run / HISTORY_NAME).events if e.get("event") == kind]


def _memory_resumed(run: Path, killed_after: int) -> int:
    """The one memory resume of ``run``: newer than the newest disk generation, at most one step redone."""
    mem = _events(run, "memory_resume")
    assert len(mem) == 1, mem
    step = mem[0]["step"]
    assert step in (killed_after - 1, killed_after), (killed_after, mem)  # step K's copy may have been in flight
    newest_disk = killed_after // DISK_EVERY * DISK_EVERY
    assert mem[0]["newest_disk"] == (newest_disk or None) and step > newest_disk, mem
    assert [e["from_step"] for e in _events(run, "resume")] == [step]
    return step


def _train(run: Path, steps: int, memory: bool) -> list[str]:
    return ["--run", str(run), *FAST, "--steps", str(steps), "--every", str(DISK_EVERY),
            *(["--memory-every", "1"] if memory else [])]


def _engine_killed_and_resumed(tmp: Path, shm: Path, steps: int, kill: int) -> tuple[Path, Path, int, str]:
    """An uninterrupted reference (no memory tier) beside a run SIGKILLed after step ``kill`` and started again."""
    ref, run = tmp / "ref", tmp / "run"
    reference = _start([sys.executable, "-m", "ripresa", "train", *_train(ref, steps, False)], tmp, "ref", _env(shm))
    same = _train(run, steps, True)  # the command, run twice
    killed = _start([sys.executable, str(HARNESS), "-m", "ripresa", "train", *same], tmp, "killed",
                    _env(shm, RIPRESA_TEST_KILL_AFTER_STEP=str(kill), **_delayed(kill)))
    _finish(killed, tmp, "killed", expect=-9)
    assert any(tier_folder(run).glob("slot*.marker")), "the killed run left no memory generation"
    _finish(reference, tmp, "ref")
    out = _finish(_start([sys.executable, "-m", "ripresa", "train", *same], tmp, "resumed", _env(shm)), tmp, "resumed")
    return ref, run, _memory_resumed(run, kill), out


def test_ripresa_train_sigkilled_between_disk_generations_resumes_from_memory_bitwise(tmp_path, shm):
    steps = 24
    # a random step between the disk generations 10 and 20, whose step before (the newest memory generation when
    # the kill lands while the kill step's copy is in flight) is newer than 10 (RIPRESA_TEST_KILL_STEP: replay one)
    kill = int(os.environ.get("RIPRESA_TEST_KILL_STEP") or random.randrange(DISK_EVERY + 2, 2 * DISK_EVERY))
    ref, run, step, out = _engine_killed_and_resumed(tmp_path, shm, steps, kill)
    assert f"at step {step} from the memory tier (step_{step:06d}.safetensors)" in out, (kill, out)
    a, b = read_bin(ref / f"step_{steps:06d}.bin"), read_bin(run / f"step_{steps:06d}.bin")
    assert np.array_equal(a.weights, b.weights) and np.array_equal(a.m, b.m) and np.array_equal(a.v, b.v), kill
    ha, hb = read_history(ref / HISTORY_NAME), read_history(run / HISTORY_NAME)
    assert [ha.steps[s]["loss"] for s in range(1, steps + 1)] == [hb.steps[s]["loss"] for s in range(1, steps + 1)]
    assert [ha.steps[s]["arm"] for s in range(1, steps + 1)] == [hb.steps[s]["arm"] for s in range(1, steps + 1)]
    assert json.loads((ref / ".state.json").read_text()) == json.loads((run / ".state.json").read_text())
    assert not tier_folder(run).exists()  # a normal end removes the memory generations
    launch = _events(run, "launch")
    assert [e["options"]["memory_every"] for e in launch] == [1, 1]  # what `pivot --restart` replays


@pytest.mark.slow
def test_ripresa_train_sidecar_of_a_promoted_generation_is_its_step(tmp_path, shm):
    """.state.json (the bandit) is written beside every generation: after a resume from memory step M it holds
    step M's bandit, not the older disk generation's (a second SIGKILL right after shows what is left)."""
    run = tmp_path / "run"
    same = _train(run, 24, True)
    _finish(_start([sys.executable, str(HARNESS), "-m", "ripresa", "train", *same], tmp_path, "first",
                   _env(shm, RIPRESA_TEST_KILL_AFTER_STEP="15")), tmp_path, "first", expect=-9)
    # started again, and killed again before the next disk generation (20)
    _finish(_start([sys.executable, str(HARNESS), "-m", "ripresa", "train", *same], tmp_path, "second",
                   _env(shm, RIPRESA_TEST_KILL_AFTER_STEP="17")), tmp_path, "second", expect=-9)
    step = _memory_resumed(run, 15)
    assert f"at step {step} from the memory tier" in _out(tmp_path, "second")
    bandit = json.loads((run / ".state.json").read_text())
    assert sum(s["pulls"] for s in bandit["stats"].values()) == step  # one pull a step


# ------------------------------------------------------------------ the frameworks' ExactResume
def _example_killed_and_resumed(tmp: Path, shm: Path, script: Path, steps: int, kill: int) -> Path:
    """The unchanged example script: a reference without the memory tier, a run with it SIGKILLed after step
    ``kill`` (its own RIPRESA_EXAMPLE_KILL_AFTER), the same command again; the final models compared bitwise."""
    from safetensors.torch import load_file

    def cmd(name: str, memory: bool) -> list[str]:
        return [str(script), "--run", str(tmp / f"{name}-run"), "--max-steps", str(steps), "--every", str(DISK_EVERY),
                "--mode", "ripresa", "--final", str(tmp / f"{name}.safetensors"),
                *(["--memory-every", "1"] if memory else [])]

    reference = _start([sys.executable, *cmd("ref", False)], tmp, "ref", _env(shm))
    same = cmd("mem", True)
    _finish(_start([sys.executable, str(HARNESS), *same], tmp, "killed",
                   _env(shm, RIPRESA_EXAMPLE_KILL_AFTER=str(kill), **_delayed(kill))),
            tmp, "killed", expect=-9)
    run = tmp / "mem-run"
    assert any(tier_folder(run).glob("slot*.marker")), "the killed run left no memory generation"
    _finish(reference, tmp, "ref")
    _finish(_start([sys.executable, *same], tmp, "resumed", _env(shm)), tmp, "resumed")
    _memory_resumed(run, kill)
    a, b = load_file(str(tmp / "ref.safetensors")), load_file(str(tmp / "mem.safetensors"))
    assert set(a) == set(b) and a
    differ = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                   and a[k].numpy().tobytes() == b[k].numpy().tobytes())]  # bit for bit
    assert not differ, f"{len(differ)}/{len(a)} tensors differ: {differ[:5]}"
    assert not tier_folder(run).exists()  # a normal end removes the memory generations
    return run


@pytest.mark.slow
def test_lightning_exact_resume_memory_every(tmp_path, shm):
    pytest.importorskip("lightning")
    # 12 batches an epoch: the kill after step 17 is mid-epoch 1, between the disk generations 10 and 20
    _example_killed_and_resumed(tmp_path, shm, ROOT / "examples" / "lightning" / "train.py", 30, 17)


@pytest.mark.slow
def test_hf_trainer_exact_resume_memory_every(tmp_path, shm):
    pytest.importorskip("transformers")
    _example_killed_and_resumed(tmp_path, shm, ROOT / "examples" / "hf_trainer" / "train.py", 30, 17)


def test_memory_every_is_checked_and_replayed_by_pivot_restart(tmp_path, capsys):
    """``--memory-every -1`` is bad input (exit 2, nothing created); a recorded ``memory_every`` is replayed by
    ``pivot --restart`` (0, the default, is not); ExactResume refuses a bad ``memory_every`` at construction."""
    from ripresa.cli import main
    from ripresa.engine.pivot import restart_command

    run = tmp_path / "run"
    assert main(["train", "--run", str(run), *FAST, "--memory-every", "-1"]) == 2
    assert "--memory-every must be >= 0" in capsys.readouterr().err and not run.exists()
    launch = {"command": "ripresa train", "options": {"steps": 20, "memory_every": 2}, "world_size": 1}
    assert restart_command(run, launch, None)[-2:] == ["--steps=20", "--memory-every=2"]
    launch["options"]["memory_every"] = 0
    assert restart_command(run, launch, None)[-1] == "--steps=20"
    for module in ("lightning", "transformers"):
        pytest.importorskip(module)
        integration = __import__(f"ripresa.integrations.{module}", fromlist=["ExactResume"])
        with pytest.raises(ValueError, match="memory_every must be an int >= 0"):
            integration.ExactResume(tmp_path / module, every=10, memory_every=-1)
