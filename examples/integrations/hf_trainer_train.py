"""The Hugging Face Trainer with exact resume: docs/INTEGRATIONS_transformers.md's one line in a whole script.

    python examples/integrations/hf_trainer_train.py [RUN_DIR] [MAX_STEPS]    # defaults: runs/hf 60

A tiny GPT-2 (built from a config: nothing is downloaded) on random tokens.
Kill it and run the same command again: train() goes on from RUN_DIR's newest
generation and ends bitwise equal to a run never interrupted
(examples/hf_trainer/train.py is the benchmark's fuller version).
"""

import os
import pathlib
import random
import sys
import tempfile

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ripresa.integrations.transformers import ExactResume


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rows = torch.randint(0, 64, (128, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(run_dir: str = "runs/hf", max_steps: int = 60) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    random.seed(0); np.random.seed(0); torch.manual_seed(0)  # noqa: E702 - every generator a checkpoint saves
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    with tempfile.TemporaryDirectory() as scratch:  # the Trainer's own output folder: ripresa saves in RUN_DIR
        args = TrainingArguments(output_dir=scratch, max_steps=max_steps, per_device_train_batch_size=8,
                                 learning_rate=3e-3, warmup_steps=5, logging_steps=10, save_strategy="no",
                                 use_cpu=True, report_to="none", disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                          callbacks=[ExactResume(run_dir, every=20)])  # ripresa: the one line
        trainer.train()
    print("generations:", sorted(int(p.name[5:11]) for p in pathlib.Path(run_dir).glob("step_*.sha256")))


if __name__ == "__main__":
    main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
