"""A plain Hugging Face ``Trainer`` script (tiny GPT-2 on CPU), resumable exactly by adding one line.

    python examples/hf_trainer/train.py --run runs/hf --max-steps 60 --every 20 --mode ripresa --final final.safetensors

``--mode ripresa`` adds the one line (marked below): ``callbacks=[ExactResume(run, every=K)]``.
``--mode native`` uses the Trainer's own checkpoints (``save_steps``) and
``train(resume_from_checkpoint=True)``; ``--mode none`` does not checkpoint.
The same command run again continues the run (ripresa and native modes).
Everything else is what a Trainer user writes: a map-style dataset with random
augmentation in ``__getitem__`` (torch, ``random`` and NumPy), ``shuffle`` by
the Trainer's own RandomSampler, 2 loader workers, dropout in the model.

``RIPRESA_EXAMPLE_KILL_AFTER=S`` (for tests and benchmarks) SIGKILLs the
process right after optimizer step S completed (its log and checkpoint done);
``RIPRESA_EXAMPLE_LOADER_AS_IS=1`` (with ``--mode ripresa``) leaves the train
loader as the Trainer built it (a resume that is not exact: the negative case).
No download: the model is built from a config (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

VOCAB, LENGTH, ROWS = 64, 16, 100


class Tokens(torch.utils.data.Dataset):
    """Fixed random token rows; each read is augmented at random (torch, random, NumPy)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.rows = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i].clone()
        ids = torch.roll(ids, shifts=random.randint(0, LENGTH - 1))          # Python's random
        mask = torch.rand(LENGTH) < 0.15                                     # torch
        noise = torch.from_numpy(np.random.randint(0, VOCAB, LENGTH))        # NumPy
        ids = torch.where(mask, noise, ids)
        return {"input_ids": ids, "labels": ids.clone()}


class KillAfter(TrainerCallback):
    """SIGKILL right after optimizer step S (at the next step's start: its log and checkpoint are done)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--mode", choices=("ripresa", "native", "none"), default="ripresa")
    ap.add_argument("--final", required=True)
    ap.add_argument("--log")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-every", type=int, default=0, help="--mode ripresa: ExactResume's memory_every (0: off)")
    ap.add_argument("--probe-every", type=int, default=0, help="--mode ripresa: ExactResume's probe_every (0: off)")
    a = ap.parse_args(argv)

    scratch = tempfile.TemporaryDirectory(prefix="hf_trainer_out_")  # removed at exit
    torch.manual_seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(
        # Only native mode writes the Trainer's own checkpoints; the other modes give it a scratch folder.
        output_dir=a.run if a.mode == "native" else scratch.name,
        max_steps=a.max_steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=5,
        lr_scheduler_type="linear",
        logging_steps=5,
        save_strategy="steps" if a.mode == "native" else "no",
        save_steps=a.every,
        dataloader_num_workers=2,
        seed=a.seed,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = []
    if a.mode == "ripresa":
        from ripresa.integrations.transformers import ExactResume

        if os.environ.get("RIPRESA_EXAMPLE_LOADER_AS_IS") == "1":  # the negative case: the loader not made exact
            callbacks.append(ExactResume(a.run, every=a.every, exact_loader=False))
        else:
            callbacks.append(ExactResume(a.run, every=a.every, memory_every=a.memory_every,
                                         probe_every=a.probe_every))  # ripresa: the one line
    kill = os.environ.get("RIPRESA_EXAMPLE_KILL_AFTER")
    if kill:
        callbacks.append(KillAfter(int(kill)))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    resume = None
    if a.mode == "native" and os.path.isdir(a.run) and get_last_checkpoint(a.run) is not None:
        resume = True
    trainer.train(resume_from_checkpoint=resume)

    # Tied weights (lm_head = wte) are saved once each: safetensors refuses shared storage.
    save_file({k: v.detach().clone().contiguous() for k, v in trainer.model.state_dict().items()}, a.final)
    if a.log:
        with open(a.log, "w") as f:
            for entry in trainer.state.log_history:
                f.write(json.dumps({"step": entry.get("step"), **entry}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
