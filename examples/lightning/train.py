"""A plain Lightning script (tiny model, CPU) — with ripresa, one added line.

    python examples/lightning/train.py --run runs/pl --max-steps 30 --every 5 --mode ripresa --final final.safetensors

``--mode ripresa`` adds ``ExactResume`` to the Trainer's callbacks (the line
marked ``# ripresa: the one line``); ``--mode native`` uses Lightning's own
``ModelCheckpoint`` + ``fit(ckpt_path="last")``; ``--mode none`` saves nothing.
Run the same command again after a kill: it goes on from the run folder.
At the end the model's state_dict is written to ``--final`` (safetensors);
``--log FILE`` writes Lightning's logged metrics as JSON lines (one per
logged step, as the Trainer reports them to its logger).

For tests and benchmarks only: ``RIPRESA_EXAMPLE_KILL_AFTER=S`` makes the
script SIGKILL itself right after optimizer step S;
``RIPRESA_EXAMPLE_SIGNAL_AFTER=S:TERM`` (or ``S:USR1``) sends itself that signal there;
``RIPRESA_EXAMPLE_LOADER_AS_IS=1`` (with ``--mode ripresa``) leaves the train
loader as Lightning built it (a resume that is not exact: the negative case).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

from ripresa.integrations.lightning import ExactResume


class NoisyRegression(Dataset):
    """A map-style dataset with random augmentation in __getitem__ (torch, random and NumPy)."""

    def __init__(self, n: int = 96, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn_like(self.x[i])                       # torch
        x = x * (1.0 + 0.1 * (random.random() - 0.5))                            # random
        x = x + torch.from_numpy(np.random.normal(0.0, 0.02, x.shape)).float()   # NumPy
        return x, self.y[i]


class Regressor(pl.LightningModule):
    def __init__(self, dim: int = 8, kill_after: int | None = None, signal_after: str | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))
        self.kill_after = kill_after
        self.signal_after = signal_after  # "S:TERM" or "S:USR1"

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.kill_after is not None and self.trainer.global_step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a real SIGKILL at a deterministic point
        if self.signal_after is not None:
            at, name = self.signal_after.split(":")
            if self.trainer.global_step == int(at):
                os.kill(os.getpid(), getattr(signal, f"SIG{name}"))  # as an operator's `kill -TERM PID` would


class JsonlLogger(Logger):
    """Lightning's logged values, one JSON line per logged step; a process that resumes rewrites from its first step."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = Path(path)
        self._first = True

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self._first:  # keep what an earlier process logged before this step
            old = [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in old if r["step"] < step))
            self._first = False
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="run folder")
    ap.add_argument("--max-steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=10, help="checkpoint cadence (optimizer steps)")
    ap.add_argument("--mode", choices=("ripresa", "native", "none"), default="ripresa")
    ap.add_argument("--final", required=True, help="safetensors file for the final model state")
    ap.add_argument("--log", help="JSON lines of Lightning's logged metrics")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accumulate-grad-batches", type=int, default=1, help="the Trainer's accumulate_grad_batches")
    ap.add_argument("--memory-every", type=int, default=0, help="--mode ripresa: ExactResume's memory_every (0: off)")
    ap.add_argument("--probe-every", type=int, default=0, help="--mode ripresa: ExactResume's probe_every (0: off)")
    args = ap.parse_args()

    pl.seed_everything(args.seed, workers=True)
    kill = os.environ.get("RIPRESA_EXAMPLE_KILL_AFTER")
    model = Regressor(kill_after=int(kill) if kill else None,
                      signal_after=os.environ.get("RIPRESA_EXAMPLE_SIGNAL_AFTER"))
    loader = DataLoader(NoisyRegression(), batch_size=8, shuffle=True, num_workers=2)

    callbacks: list[pl.Callback] = []
    ckpt_path = None
    if args.mode == "ripresa" and os.environ.get("RIPRESA_EXAMPLE_LOADER_AS_IS") == "1":
        callbacks.append(ExactResume(args.run, every=args.every, exact_loader=False))  # the negative case
    elif args.mode == "ripresa":
        callbacks.append(ExactResume(args.run, every=args.every, memory_every=args.memory_every,
                                     probe_every=args.probe_every))  # ripresa: the one line
    elif args.mode == "native":
        callbacks.append(ModelCheckpoint(dirpath=args.run, every_n_train_steps=args.every, save_last=True))
        ckpt_path = "last"

    trainer = pl.Trainer(
        max_steps=args.max_steps, accelerator="cpu", devices=1, callbacks=callbacks,
        accumulate_grad_batches=args.accumulate_grad_batches,
        logger=JsonlLogger(args.log) if args.log else False, log_every_n_steps=1,
        enable_checkpointing=args.mode == "native", enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.run,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, args.final)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
