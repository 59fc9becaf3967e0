"""Lightning's Trainer with ExactResume: a real SIGKILL mid-epoch, the same command again, bitwise (docs/INTEGRATIONS_lightning.md).

Every case runs the unchanged example script, examples/lightning/train.py, in real child processes:
a real ``lightning.Trainer`` on CPU, a tiny model with dropout, a ``DataLoader(shuffle=True,
num_workers=2)`` over a map-style dataset that augments with torch, ``random`` and NumPy, an AdamW
and a per-step LR schedule. ``RIPRESA_EXAMPLE_KILL_AFTER=S`` makes the child SIGKILL itself right
after optimizer step S (mid-epoch, after a checkpoint); the same command run again must end with the
final tensors of an uninterrupted run bit for bit, and Lightning's logged values (its logger's
``log_metrics`` rows: step, loss, lr, epoch) equal at every step.

Default tier: one kill + resume sample. Slow: Lightning's own resume drifting (why the integration
matters), SIGTERM and SIGUSR1 under the Trainer, no save after an exception, and ``ripresa verify
--steer`` of the unchanged script (passes at tolerance 0; fails when the loader is left as it is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
from safetensors.torch import load_file  # noqa: E402

from ripresa.store.history import HISTORY_NAME  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "lightning" / "train.py"
STEPS, EVERY, KILL = 30, 5, 17  # 12 batches an epoch: the kill is mid-epoch 1, two steps after the checkpoint at 15
TIMEOUT = 600  # a hang guard only (the machine may be shared)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RIPRESA_EXAMPLE_", "RIPRESA_VERIFY"))}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _cmd(tmp: Path, name: str, mode: str, steps: int = STEPS, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--run", str(tmp / f"{name}-run"), "--max-steps", str(steps),
            "--every", str(EVERY), "--mode", mode, "--final", str(tmp / f"{name}.safetensors"),
            "--log", str(tmp / f"{name}.jsonl"), *extra]


def _start(cmd: list[str], tmp: Path, tag: str, **env: str) -> subprocess.Popen:
    with open(tmp / f"{tag}.out", "wb") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=tmp, env=_env(**env), stdout=out, stderr=subprocess.STDOUT)


def _wait(p: subprocess.Popen, tmp: Path, tag: str) -> int:
    return p.wait(timeout=TIMEOUT)


def _tail(tmp: Path, tag: str) -> str:
    return (tmp / f"{tag}.out").read_text(errors="replace")[-3000:]


def _run(cmd: list[str], tmp: Path, tag: str, expect: int = 0, **env: str) -> None:
    rc = _wait(_start(cmd, tmp, tag, **env), tmp, tag)
    assert rc == expect, f"{tag}: exit {rc}, expected {expect}\n{_tail(tmp, tag)}"


def _killed_and_resumed(tmp: Path, name: str, mode: str, reference: list[str] | None = None) -> None:
    """``name``: killed at KILL, then the same command again; ``reference`` (if given) runs uninterrupted beside the kill."""
    cmd = _cmd(tmp, name, mode)
    ref = _start(reference, tmp, "reference") if reference is not None else None
    _run(cmd, tmp, f"{name}-killed", expect=-9, RIPRESA_EXAMPLE_KILL_AFTER=str(KILL))
    assert not (tmp / f"{name}.safetensors").exists()
    if ref is not None:
        assert _wait(ref, tmp, "reference") == 0, _tail(tmp, "reference")
    _run(cmd, tmp, f"{name}-resumed")


def _events(run: Path, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in (run / HISTORY_NAME).read_text().splitlines()]
    return [e for e in lines if e.get("event") == kind]


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:11]) for p in run.glob("step_*.safetensors"))


def _gaps(a: Path, b: Path) -> tuple[int, int, float]:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert set(ta) == set(tb)
    differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
    gap = max(((ta[k] - tb[k]).abs().max().item() for k in ta), default=0.0)
    return len(differ), len(ta), gap


def _logged(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _bitwise_and_logs_equal(tmp: Path, ref: str, got: str) -> None:
    differ, total, gap = _gaps(tmp / f"{ref}.safetensors", tmp / f"{got}.safetensors")
    assert differ == 0, f"{differ}/{total} tensors differ (max abs gap {gap})"
    a, b = _logged(tmp / f"{ref}.jsonl"), _logged(tmp / f"{got}.jsonl")
    assert [r["step"] for r in a] == list(range(STEPS)), a[:3]
    assert a == b, [(x, y) for x, y in zip(a, b, strict=False) if x != y][:3]


@pytest.mark.slow  # the default tier keeps one framework kill sample: tests/test_accelerate.py (tests/README.md)
def test_sigkill_mid_epoch_then_same_command_is_bitwise_and_logs_equal(tmp_path):
    _killed_and_resumed(tmp_path, "exact", "ripresa", reference=_cmd(tmp_path, "ref", "ripresa"))
    _bitwise_and_logs_equal(tmp_path, "ref", "exact")
    run = tmp_path / "exact-run"
    # the kill at 17 lost 16 and 17 only — or, when the background writer had not committed step 15 yet
    # (a loaded machine), 11 to 17
    assert [e["from_step"] for e in _events(run, "resume")] in ([15], [10])
    assert _steps(run)[-1] == STEPS and [e["step"] for e in _events(run, "checkpoint")][-1] == STEPS


@pytest.mark.slow
def test_lightnings_own_resume_drifts_where_exact_resume_does_not(tmp_path):
    # The native mode's uninterrupted run is --mode none (ModelCheckpoint draws nothing): the same training.
    _killed_and_resumed(tmp_path, "native", "native", reference=_cmd(tmp_path, "ref", "none"))
    differ, total, gap = _gaps(tmp_path / "ref.safetensors", tmp_path / "native.safetensors")
    assert differ == total and gap > 1e-4, (differ, total, gap)  # every tensor drifted


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["TERM", "USR1"])
def test_sigterm_stops_cleanly_sigusr1_saves_and_goes_on(tmp_path, sig):
    ref = _start(_cmd(tmp_path, "ref", "ripresa"), tmp_path, "reference")
    cmd = _cmd(tmp_path, "sig", "ripresa")
    _run(cmd, tmp_path, "signalled", RIPRESA_EXAMPLE_SIGNAL_AFTER=f"{KILL}:{sig}")
    signalled = _events(tmp_path / "sig-run", "signal")
    # The signal arrived after step 17's hooks: the next step boundary (18) handles it.
    assert [(e["step"], e["action"]) for e in signalled] == [(KILL + 1, "stop" if sig == "TERM" else "checkpoint")]
    saved = [(e["step"], e["reason"]) for e in _events(tmp_path / "sig-run", "checkpoint")]
    assert (KILL + 1, "stop" if sig == "TERM" else "signal") in saved, saved
    if sig == "TERM":  # a clean stop at 18: exit 0, the final model is step 18's, then the same command goes on
        assert _steps(tmp_path / "sig-run")[-1] == KILL + 1
        assert "Traceback" not in _tail(tmp_path, "signalled")
        _run(cmd, tmp_path, "after-stop")
    assert _wait(ref, tmp_path, "reference") == 0, _tail(tmp_path, "reference")
    _bitwise_and_logs_equal(tmp_path, "ref", "sig")


@pytest.mark.slow
def test_an_exception_in_fit_saves_no_half_done_step(tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ripresa.integrations.lightning import ExactResume

    class Boom(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.lin(batch[0]).pow(2).mean()
            if self.trainer.global_step == 7:  # step 8's forward: steps 1..7 are done, 8 is not
                raise RuntimeError("boom")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4, shuffle=True)
    trainer = pl.Trainer(max_steps=20, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ExactResume(tmp_path / "run", every=5)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), loader)
    assert _steps(tmp_path / "run") == [5]  # the cadence save; no final save of a state that may be mid-step


def _verify(tmp: Path, out: str, **env: str) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "ripresa", "verify", "--steer", "--steps", "16", "--cut", "7", "--tolerance", "0",
           "--output", str(tmp / out), "--", *_cmd(tmp, out, "ripresa")]
    p = _start(cmd, tmp, out, **env)
    rc = _wait(p, tmp, out)
    report = tmp / out / "verification.json"
    return rc, (json.loads(report.read_text()) if report.exists() else {"output": _tail(tmp, out)})


@pytest.mark.slow
def test_steered_verify_of_the_unchanged_script_passes_at_tolerance_0(tmp_path):
    rc, report = _verify(tmp_path, "verify")
    assert rc == 0 and report["mode"] == "steered" and report["all_checks_passed"], report
    assert not (tmp_path / "verify-run").exists()  # the script's own run folder is never touched


@pytest.mark.slow
def test_steered_verify_fails_when_the_loader_is_left_as_lightning_built_it(tmp_path):
    rc, report = _verify(tmp_path, "verify", RIPRESA_EXAMPLE_LOADER_AS_IS="1")
    assert rc == 1 and report.get("all_checks_passed") is False, report


@pytest.mark.slow
def test_a_ripresa_generation_wins_over_fit_ckpt_path(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ripresa.integrations.lightning import ExactResume

    class Counting(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(steps, ckpt_path=None):
        pl.seed_everything(0)
        model = Counting()
        loader = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4, shuffle=True)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[
                                 ModelCheckpoint(dirpath=tmp_path / "pl", every_n_train_steps=5, save_top_k=-1),
                                 ExactResume(tmp_path / "run", every=5)])
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return trainer, model

    fit(10)  # ripresa's final generation: step 10; Lightning's checkpoints: steps 5 and 10
    old = next(p for p in (tmp_path / "pl").iterdir() if "step=5" in p.name)
    with pytest.warns(UserWarning, match="is not loaded over it"):
        trainer, model = fit(15, ckpt_path=str(old))
    assert trainer.global_step == 15 and model.calls == 5  # from ripresa's step 10, not Lightning's step 5


@pytest.mark.slow
def test_monitor_mode_save_top_k_keep_the_best_generations_and_the_newest(tmp_path):
    """ModelCheckpoint's monitor/mode/save_top_k on ExactResume: a real fit validating every 3 steps, a generation
    every 2; the generations left are the save_top_k best by the val_loss each was saved with, and the newest."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ripresa.integrations.lightning import ExactResume

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return (self.lin(batch[0]) - batch[1]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", (self.lin(batch[0]) - batch[1]).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Seen(pl.Callback):
        """What ModelCheckpoint would read at each step boundary."""

        def __init__(self):
            self.values: dict[int, float] = {}

        def on_train_batch_end(self, trainer, *args):
            if "val_loss" in trainer.callback_metrics:
                self.values[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    seen = {}
    for mode in ("max", "min"):
        run = tmp_path / mode
        seen[mode] = Seen()
        trainer = pl.Trainer(max_steps=14, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, val_check_interval=3,
                             check_val_every_n_epoch=None, num_sanity_val_steps=0,
                             callbacks=[seen[mode], ExactResume(run, every=2, monitor="val_loss", mode=mode,
                                                                save_top_k=2)])
        trainer.fit(Model(), DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=16))
        values = {s: v for s, v in seen[mode].values.items() if s % 2 == 0}
        assert 2 not in values and len(set(values.values())) >= 3  # step 2 precedes the first validation
        best = sorted(values, key=lambda s: (-values[s] if mode == "max" else values[s], s))[:2]
        assert _steps(run) == sorted({*best, 14}), (mode, values)
    # the loss falls: the highest val_loss are the oldest generations, the lowest the newest
    assert _steps(tmp_path / "max")[:2] == [4, 6] and 4 not in _steps(tmp_path / "min")


def test_save_top_k_and_mode_are_checked_when_the_callback_is_built(tmp_path):
    from ripresa.integrations.lightning import ExactResume
    from ripresa.store.retention import KeepBest, KeepEvery, KeepLast

    assert ExactResume(tmp_path, monitor="val_loss", save_top_k=3, mode="max").options["retention"] == \
        KeepBest("val_loss", k=3, mode="max")
    assert ExactResume(tmp_path, monitor="val_loss", save_top_k=-1).options["retention"] == KeepEvery(1)
    assert ExactResume(tmp_path, monitor="val_loss", save_top_k=0).options["retention"] == KeepLast(1)
    both = ExactResume(tmp_path, monitor="val_loss", retention=KeepLast(2)).options["retention"]
    assert both == KeepLast(2) | KeepBest("val_loss", k=1, mode="min")
    assert "retention" not in ExactResume(tmp_path).options
    with pytest.raises(ValueError, match="save_top_k"):
        ExactResume(tmp_path, monitor="val_loss", save_top_k=-2)
    with pytest.raises(ValueError, match="mode"):
        ExactResume(tmp_path, monitor="val_loss", mode="lowest")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three Lightning processes: a hang guard on a shared machine
def test_accumulate_grad_batches_2_killed_mid_epoch_resumes_bitwise(tmp_path):
    """accumulate_grad_batches=2 (6 optimizer steps an epoch): the checkpoint at step 5 is 10 batches into epoch 0,
    the SIGKILL after step 8 is mid-epoch 1; the same command again ends bitwise, with Lightning's logs equal."""
    steps, kill = 16, 8
    ref = _start(_cmd(tmp_path, "ref", "ripresa", steps, "--accumulate-grad-batches", "2"), tmp_path, "reference")
    cmd = _cmd(tmp_path, "acc", "ripresa", steps, "--accumulate-grad-batches", "2")
    _run(cmd, tmp_path, "acc-killed", expect=-9, RIPRESA_EXAMPLE_KILL_AFTER=str(kill))
    assert _wait(ref, tmp_path, "reference") == 0, _tail(tmp_path, "reference")
    _run(cmd, tmp_path, "acc-resumed")
    differ, total, gap = _gaps(tmp_path / "ref.safetensors", tmp_path / "acc.safetensors")
    assert differ == 0, f"{differ}/{total} tensors differ (max abs gap {gap})"
    a, b = _logged(tmp_path / "ref.jsonl"), _logged(tmp_path / "acc.jsonl")
    assert [r["step"] for r in a] == list(range(steps)) and a == b
    run = tmp_path / "acc-run"
    assert [e["from_step"] for e in _events(run, "resume")] == [5] and _steps(run)[-1] == steps
