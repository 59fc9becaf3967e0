"""Your own training loop with ripresa's Checkpointer: five added lines.

    python train.py --run runs/loop --steps 2000 --every 100

Kill it any way you like — Ctrl-C / SIGTERM (checkpoint, exit 0), SIGUSR1
(checkpoint, continue), SIGKILL, a power cut — and start the same command
again: it resumes from the newest valid generation, bit-exactly, and stops
at step --steps.
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np
import torch

import ripresa


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="run folder")
    ap.add_argument("--steps", type=int, default=2000, help="train until this global step")
    ap.add_argument("--every", type=int, default=100, help="checkpoint cadence (steps)")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to watch signals)")
    args = ap.parse_args()

    random.seed(0)  # every generator a checkpoint saves: two runs, interrupted or not, end with the same bytes
    np.random.seed(0)
    torch.manual_seed(0)
    gen = np.random.default_rng(0)  # draws the epoch permutations
    X = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    Y = X @ torch.randn(8, 1, generator=torch.Generator().manual_seed(2)) + 0.1 * torch.randn(512, 1, generator=torch.Generator().manual_seed(3))
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    sampler = ripresa.EpochSampler(len(X), 32, generator=gen)

    # --- ripresa: describe the state, open the session, resume -------------------
    state = ripresa.TrainingState(model=model, optimizer=optimizer, scheduler=scheduler, data=sampler,
                                  rng=ripresa.RandomStreams(numpy={"data": gen}), config=vars(args),
                                  code_files=[__file__])
    ckpt = ripresa.Checkpointer(args.run, state, every=args.every)
    start = ckpt.resume()
    # ------------------------------------------------------------------------------

    for step in range(start + 1, args.steps + 1):
        ids = sampler.next_batch()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(X[ids]), Y[ids])
        loss.backward()
        optimizer.step()
        scheduler.step()
        if args.sleep:
            import time

            time.sleep(args.sleep)
        if ckpt.step_done(step, loss=loss.item(), lr=scheduler.get_last_lr()[0], samples=len(ids)):  # ripresa
            break
    ckpt.close(final_save=True)  # ripresa: the last step is saved too
    print(f"stopped at step {ckpt.progress.step}; run folder {args.run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
