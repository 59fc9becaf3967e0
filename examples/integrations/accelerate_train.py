"""An accelerate loop with exact resume: docs/INTEGRATIONS.md's lines in a whole script.

    python examples/integrations/accelerate_train.py [RUN_DIR] [MAX_STEPS]    # defaults: runs/acc 60

accelerate has no callbacks: the loop is yours, and ripresa's lines are those
of README "Your own loop" on what accelerator.prepare(...) returned. Kill it
and run the same command again: it ends bitwise equal to a run never
interrupted (examples/accelerate/train.py is the benchmark's fuller version).
"""

import pathlib
import random
import sys

import numpy as np
import torch
from accelerate import Accelerator

import ripresa


def main(run_dir: str = "runs/acc", max_steps: int = 60) -> None:
    accelerator = Accelerator(cpu=True)
    random.seed(0); np.random.seed(0); torch.manual_seed(0)  # noqa: E702 - every generator a checkpoint saves
    x = torch.randn(256, 8)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(256, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=max_steps)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    state = ripresa.TrainingState(model=model, optimizer=optimizer, scheduler=scheduler,
                                  data=ripresa.make_exact(loader))             # ripresa
    ckpt = ripresa.Checkpointer(run_dir, state, every=20)                      # ripresa
    step = ckpt.resume()                                                       # ripresa
    stop = False
    model.train()
    while step < max_steps and not stop:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            stop = ckpt.step_done(step, loss=loss.item())                      # ripresa: True on SIGTERM
            if stop or step >= max_steps:
                break
    ckpt.close()                                                               # ripresa
    print("generations:", sorted(int(p.name[5:11]) for p in pathlib.Path(run_dir).glob("step_*.sha256")))


if __name__ == "__main__":
    main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
