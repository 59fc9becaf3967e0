"""A real ``transformers.Trainer`` (tiny GPT-2, CPU, 2 loader workers, augmentation, dropout) SIGKILLed
mid-epoch after a checkpoint and run again with the same command: ``ExactResume`` ends bitwise equal to
the uninterrupted run, with the same ``log_history``; the Trainer's own resume drifts
(docs/INTEGRATIONS_transformers.md). Default tier: one kill + resume; the rest is slow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, ripresa_cli

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from safetensors.torch import load_file  # noqa: E402

HF = EXAMPLES / "hf_trainer" / "train.py"
STEPS, EVERY, KILL = 16, 5, 12  # 13 batches an epoch: the kill is mid-epoch, after the checkpoint at 10
LOGGED = ("step", "loss", "learning_rate", "epoch", "grad_norm", "train_loss")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RIPRESA_EXAMPLE_KILL_AFTER", "RIPRESA_VERIFY")}
    env.update(HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", OMP_NUM_THREADS="1", **extra)
    return env


def train(run: Path, mode: str, final: Path, *, kill: int | None = None, steps: int = STEPS,
          extra: tuple[str, ...] = (), expect: int | None = None) -> subprocess.CompletedProcess:
    env = _env(**({"RIPRESA_EXAMPLE_KILL_AFTER": str(kill)} if kill else {}))
    res = subprocess.run([sys.executable, "-B", str(HF), "--run", str(run), "--max-steps", str(steps), "--every",
                          str(EVERY), "--mode", mode, "--final", str(final), "--log", str(final) + ".jsonl", *extra],
                         env=env, capture_output=True, text=True, timeout=900)
    want = (-signal.SIGKILL if kill else 0) if expect is None else expect
    assert res.returncode == want, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def logged(final: Path) -> list[dict]:
    return [{k: e.get(k) for k in LOGGED} for e in map(json.loads, Path(str(final) + ".jsonl").read_text().splitlines())]


def differing(a: Path, b: Path) -> tuple[int, int, float]:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert set(ta) == set(tb)
    bits = [k for k in ta if not torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))]
    gap = max(float((ta[k].double() - tb[k].double()).abs().max()) for k in ta)
    return len(bits), len(ta), gap


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference: the same ripresa-mode command, never interrupted."""
    d = tmp_path_factory.mktemp("hf_ref")
    train(d / "run", "ripresa", d / "final.safetensors")
    return d


@pytest.mark.slow  # the default tier keeps one framework kill sample: tests/test_accelerate.py (tests/README.md)
def test_killed_trainer_resumes_bitwise_with_the_same_log_history(tmp_path):
    """The default tier's sample: the uninterrupted reference runs beside the run that is killed."""
    ref = tmp_path / "ref.safetensors"
    reference = subprocess.Popen(
        [sys.executable, "-B", str(HF), "--run", str(tmp_path / "ref"), "--max-steps", str(STEPS), "--every",
         str(EVERY), "--mode", "ripresa", "--final", str(ref), "--log", str(ref) + ".jsonl"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        final = tmp_path / "final.safetensors"
        train(tmp_path / "run", "ripresa", final, kill=KILL)
    finally:
        out, _ = reference.communicate(timeout=900)
    assert reference.returncode == 0, out[-3000:]
    assert not final.exists()
    # The Checkpointer writes in the background: on a loaded machine step 10's generation may not have
    # committed yet when the SIGKILL after step 12 lands; then the resume is from step 5 (mid-epoch too).
    saved = sorted(p.name for p in (tmp_path / "run").glob("step_*.safetensors"))
    assert saved in (["step_000005.safetensors"], ["step_000005.safetensors", "step_000010.safetensors"]), saved
    train(tmp_path / "run", "ripresa", final)  # the same command again
    assert differing(ref, final)[0] == 0
    want, got = logged(ref), logged(final)
    assert got == want  # loss, lr, grad_norm, epoch, step at every logged step, and the final train_loss
    assert [e["step"] for e in got if e["loss"] is not None] == [5, 10, 15]
    assert got[-1]["train_loss"] is not None and got[-1]["step"] == STEPS


@pytest.mark.slow
def test_native_resume_drifts_where_ripresa_does_not(tmp_path):
    """The Trainer's own save_steps + resume_from_checkpoint=True, same kill: the final tensors differ."""
    train(tmp_path / "none", "none", tmp_path / "none.safetensors")
    train(tmp_path / "native", "native", tmp_path / "native.safetensors", kill=KILL)
    assert (tmp_path / "native" / "checkpoint-10").is_dir()
    train(tmp_path / "native", "native", tmp_path / "native.safetensors")
    n, total, gap = differing(tmp_path / "none.safetensors", tmp_path / "native.safetensors")
    assert n > total // 2 and gap > 0, (n, total, gap)


@pytest.mark.slow
def test_sigterm_saves_and_stops_and_the_same_command_goes_on_exactly(uninterrupted, tmp_path):
    run, final = tmp_path / "run", tmp_path / "final.safetensors"
    cmd = [sys.executable, "-B", str(HF), "--run", str(run), "--max-steps", str(STEPS), "--every", "100",
           "--mode", "ripresa", "--final", str(final), "--log", str(final) + ".jsonl"]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    history = run / ".loss.jsonl"  # created before the Checkpointer installs its handlers; its first event after
    while not (history.exists() and history.stat().st_size > 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    saved = sorted(run.glob("step_*.safetensors"))
    assert saved, out[-3000:]
    step = int(saved[-1].name[5:11])
    if step < STEPS:  # stopped early: the same command goes on from the saved step
        train(run, "ripresa", final)
    assert differing(uninterrupted / "final.safetensors", final)[0] == 0
    assert logged(final) == logged(uninterrupted / "final.safetensors")


@pytest.mark.slow
def test_resume_from_checkpoint_with_exact_resume_is_refused(tmp_path):
    """Both resumes at once would skip batches on top of the exact position: refused, naming the fix."""
    train(tmp_path / "native", "native", tmp_path / "native.safetensors", steps=EVERY)  # a Trainer checkpoint
    hf_checkpoint = tmp_path / "native" / f"checkpoint-{EVERY}"
    assert hf_checkpoint.is_dir()
    script = tmp_path / "both.py"
    script.write_text(HF.read_text().replace("trainer.train(resume_from_checkpoint=resume)",
                                             f"trainer.train(resume_from_checkpoint={str(hf_checkpoint)!r})"))
    res = subprocess.run([sys.executable, "-B", str(script), "--run", str(tmp_path / "run"), "--max-steps", "8",
                          "--mode", "ripresa", "--final", str(tmp_path / "f")], env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode != 0
    assert "drop resume_from_checkpoint" in res.stderr, res.stderr[-3000:]
    assert not list((tmp_path / "run").glob("step_*"))


@pytest.mark.slow
def test_export_inference_loads_with_from_pretrained_bitwise(uninterrupted, tmp_path):
    from transformers import AutoModelForCausalLM

    dest = tmp_path / "hf"
    res = ripresa_cli("export", uninterrupted / "run", "--to", dest, "--inference")
    assert res.returncode == 0, res.stdout + res.stderr
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["n_layer"] == 2
    model = AutoModelForCausalLM.from_pretrained(dest)  # no ripresa involved
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied again
    want, got = load_file(str(uninterrupted / "final.safetensors")), model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def verify_steered(script: Path, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``ripresa verify --steer`` of an unchanged example script at tolerance 0 (its own run folder never touched)."""
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--steer", "--steps", "8", "--cut", "4", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-B", script, "--run", tmp_path / "IGNORED", "--max-steps", "20", "--every", "50",
                      "--mode", "ripresa", "--final", tmp_path / "IGNORED.safetensors", timeout=1800, env=_env(**env))
    assert not (tmp_path / "IGNORED").exists()
    assert (out / "verification.json").is_file(), res.stdout[-3000:] + res.stderr[-3000:]
    return res, json.loads((out / "verification.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four paths of real Trainer/accelerate processes: a hang guard on a shared machine
def test_steered_verify_of_the_unchanged_hf_example_passes_at_tolerance_zero(tmp_path):
    res, report = verify_steered(HF, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert report["mode"] == "steered" and report["positive"] is True, report
    assert report["negative_divergence_detected"] is True


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four paths of real Trainer/accelerate processes: a hang guard on a shared machine
def test_steered_verify_fails_when_the_loader_is_left_as_the_trainer_built_it(tmp_path):
    """The negative variant: ExactResume(exact_loader=False): the loader's order and random draws left out."""
    res, report = verify_steered(HF, tmp_path, RIPRESA_EXAMPLE_LOADER_AS_IS="1")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert report["mode"] == "steered" and report["positive"] is False and report["all_checks_passed"] is False
    assert report["determinism_before_cut"]["passed"], report  # the same up to the cut: the resume is what differs
    assert report["first_divergence"]["resume"] is not None


ACC = EXAMPLES / "accelerate" / "train.py"


def accelerate_run(run: Path, mode: str, final: Path, *, kill: int | None = None) -> None:
    env = _env(**({"RIPRESA_EXAMPLE_KILL_AFTER": str(kill)} if kill else {}))
    res = subprocess.run([sys.executable, "-B", str(ACC), "--run", str(run), "--max-steps", str(STEPS), "--every",
                          str(EVERY), "--mode", mode, "--final", str(final), "--log", str(final) + ".jsonl"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == (-signal.SIGKILL if kill else 0), res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_accelerate_loop_killed_resumes_bitwise_and_its_native_resume_drifts(tmp_path):
    """TrainingState over what accelerator.prepare returns (the loader made exact): bitwise after a SIGKILL;
    save_state/load_state + skip_first_batches, same kill: the tensors differ."""
    accelerate_run(tmp_path / "ref", "ripresa", tmp_path / "ref.safetensors")
    accelerate_run(tmp_path / "rip", "ripresa", tmp_path / "rip.safetensors", kill=KILL)
    accelerate_run(tmp_path / "rip", "ripresa", tmp_path / "rip.safetensors")
    assert differing(tmp_path / "ref.safetensors", tmp_path / "rip.safetensors")[0] == 0
    assert Path(str(tmp_path / "ref.safetensors") + ".jsonl").read_text() == \
        Path(str(tmp_path / "rip.safetensors") + ".jsonl").read_text()
    accelerate_run(tmp_path / "none", "none", tmp_path / "none.safetensors")
    accelerate_run(tmp_path / "nat", "native", tmp_path / "nat.safetensors", kill=KILL)
    accelerate_run(tmp_path / "nat", "native", tmp_path / "nat.safetensors")
    n, total, gap = differing(tmp_path / "none.safetensors", tmp_path / "nat.safetensors")
    assert n > total // 2 and gap > 0, (n, total, gap)


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.lin(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


@pytest.mark.slow
@pytest.mark.parametrize("greater", [True, False])
def test_retention_follows_metric_for_best_model_and_save_total_limit(tmp_path, greater):
    """A real Trainer evaluating every 3 steps, a generation every 2: the generations left are the one with the
    best eval_loss it was saved with (greater_is_better decides which), the save_total_limit newest, and no other."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ripresa.integrations.transformers import ExactResume

    class Seen(TrainerCallback):
        def __init__(self) -> None:
            self.evals: dict[int, float] = {}

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.evals[state.global_step] = metrics["eval_loss"]

    seen = Seen()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=14, per_device_train_batch_size=4,
                             learning_rate=0.05, eval_strategy="steps", eval_steps=3, save_strategy="no",
                             metric_for_best_model="loss", greater_is_better=greater, save_total_limit=1,
                             use_cpu=True, report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                             logging_steps=1)
    torch.manual_seed(0)
    trainer = Trainer(model=_Linear(), args=args, train_dataset=_Pairs(), eval_dataset=_Pairs(16),
                      callbacks=[seen, ExactResume(tmp_path / "run", every=2)])
    trainer.train()
    # each generation's value: the latest evaluation at or before its step (none before step 3)
    values = {s: seen.evals[max(e for e in seen.evals if e <= s)] for s in range(4, 15, 2)}
    assert len(set(values.values())) >= 3, seen.evals
    best = sorted(values, key=lambda s: (-values[s] if greater else values[s], s))[0]
    steps = sorted(int(p.name[5:11]) for p in (tmp_path / "run").glob("step_*.safetensors"))
    assert steps == sorted({best, 14}), (values, steps)
    assert (best < 10) if greater else (best >= 12)  # the loss falls: the worst is old, the best is new


def test_retention_arguments_map_onto_keep_best(tmp_path):
    from transformers import TrainingArguments

    from ripresa.integrations.transformers import ExactResume
    from ripresa.store.retention import DEFAULT_RETENTION, KeepBest, KeepLast

    def policy(cb, **kw):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)
        return cb._retention(args, cb.kwargs.get("retention"))

    assert policy(ExactResume(tmp_path)) is None
    assert policy(ExactResume(tmp_path), save_total_limit=2) == KeepLast(2)
    assert policy(ExactResume(tmp_path), metric_for_best_model="accuracy", save_total_limit=1) == \
        KeepLast(1) | KeepBest("eval_accuracy", k=1, mode="max")
    assert policy(ExactResume(tmp_path), metric_for_best_model="eval_loss") == \
        DEFAULT_RETENTION | KeepBest("eval_loss", k=1, mode="min")
    explicit = ExactResume(tmp_path, metric_for_best_model="bleu", greater_is_better=False, save_total_limit=3,
                           retention=KeepLast(5))
    assert policy(explicit, metric_for_best_model="loss", save_total_limit=1) == \
        KeepLast(5) | (KeepLast(3) | KeepBest("eval_bleu", k=1, mode="min"))
    from ripresa.errors import BadInput

    with pytest.raises(BadInput, match="save_total_limit"):
        policy(ExactResume(tmp_path, save_total_limit=0))
