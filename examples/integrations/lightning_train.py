"""Lightning with exact resume: docs/INTEGRATIONS_lightning.md's one line in a whole script.

    python examples/integrations/lightning_train.py [RUN_DIR] [MAX_STEPS]     # defaults: runs/pl 60

Kill it any way you like and run the same command again: fit() goes on from
the newest generation in RUN_DIR and ends bitwise equal to a run never
interrupted (examples/lightning/train.py is the benchmark's fuller version).
"""

import pathlib
import random
import sys

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ripresa.integrations.lightning import ExactResume


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(run_dir: str = "runs/pl", max_steps: int = 60) -> None:
    random.seed(0); np.random.seed(0); torch.manual_seed(0)  # noqa: E702 - every generator a checkpoint saves
    x = torch.randn(256, 8)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(256, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[ExactResume(run_dir, every=20)],  # ripresa: the one line
                         accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), loader)
    print("generations:", sorted(int(p.name[5:11]) for p in pathlib.Path(run_dir).glob("step_*.sha256")))


if __name__ == "__main__":
    main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
