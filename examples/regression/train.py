"""The 33-parameter reference exercise: train, checkpoint, resume — exactly.

A synthetic set of 24 rows (two inputs, one target), a network 2 → 8 → 1 with
dropout 0.25 (2·8 + 8 + 8·1 + 1 = 33 parameters), batches of 4, Adam lr 0.03,
StepLR(step_size=3, gamma=0.5) stepped after every update, float64, one torch
thread, CPU forced. Three random streams decide the trajectory:

* Python ``random``   — a light gain on the inputs of each batch;
* NumPy PCG64         — the noise added to each batch's targets, and the
                        epoch permutations of the rows;
* torch (CPU)         — the dropout masks.

Usage (OUTPUT must not exist yet; --steps counts the steps *this* process runs):

    python -B train.py --steps 10 --output runs/continuous
    python -B train.py --steps 5  --output runs/interrupted
    python -B train.py --steps 5  --output runs/resume --resume runs/interrupted/checkpoint.pt
    python -B train.py --steps 5  --output runs/no-rng --resume runs/interrupted/checkpoint.pt --omit-rng-restore

Each run writes OUTPUT/checkpoint.pt (+ .sha256) and OUTPUT/summary.json (the
trajectory the verifier compares). Exit codes: 0 ok, 1 a check failed on the
checkpoint, 2 bad input.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import ripresa

HERE = Path(__file__).resolve().parent
DATA = HERE / "data.csv"

CONFIG = {
    "seed": 1234,
    "rows": 24,
    "inputs": 2,
    "hidden": 8,
    "dropout": 0.25,
    "batch_size": 4,
    "lr": 0.03,
    "step_size": 3,  # StepLR: halve the LR every 3 updates
    "gamma": 0.5,
    "input_gain": 0.05,  # inputs are scaled by 1 ± U(0, 0.05) per batch
    "target_noise": 0.01,  # std of the Gaussian noise on targets
    "dtype": "float64",
    "threads": 1,
    "device": "cpu",
}


def load_rows(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """data.csv → X (24, 2) and Y (24, 1), float64, row i = id i."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if [int(r["id"]) for r in rows] != list(range(CONFIG["rows"])):
        sys.exit(f"error: {path}: expected ids 0..{CONFIG['rows'] - 1} in order")
    X = torch.tensor([[float(r["x1"]), float(r["x2"])] for r in rows], dtype=torch.float64)
    Y = torch.tensor([[float(r["y"])] for r in rows], dtype=torch.float64)
    return X, Y


def build_model() -> torch.nn.Module:
    c = CONFIG
    return torch.nn.Sequential(
        torch.nn.Linear(c["inputs"], c["hidden"]),
        torch.nn.Tanh(),
        torch.nn.Dropout(c["dropout"]),
        torch.nn.Linear(c["hidden"], 1),
    )


def build_optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    # The scheduler is built here, before any optimizer.load_state_dict():
    # constructing a scheduler rewrites the optimizer's LRs.
    optimizer = torch.optim.Adam(model.parameters(), lr=CONFIG["lr"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=CONFIG["step_size"], gamma=CONFIG["gamma"])
    return optimizer, scheduler


def restore(state: ripresa.TrainingState, path: str, omit_rng_restore: bool, **allow: bool) -> ripresa.Progress:
    """Verify and load the checkpoint; random streams restored last (unless omitted)."""
    checkpoint = ripresa.load_checkpoint(path)
    return state.restore(checkpoint, restore_rng=not omit_rng_restore, **allow)


def train_step(model, optimizer, scheduler, X, Y, ids, noise_gen) -> tuple[float, float]:
    """One complete update on the rows ``ids``; returns (loss, lr used)."""
    gain = 1.0 + random.uniform(-CONFIG["input_gain"], CONFIG["input_gain"])  # Python random
    noise = noise_gen.normal(0.0, CONFIG["target_noise"], size=(len(ids), 1))  # NumPy PCG64
    x = X[ids] * gain
    y = Y[ids] + torch.from_numpy(noise)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), y)  # dropout draws from torch's CPU generator
    loss.backward()
    optimizer.step()
    scheduler.step()  # stepped after every update
    return float(loss.item()), float(lr)


def evaluate(model: torch.nn.Module, X: torch.Tensor, Y: torch.Tensor) -> float:
    """MSE on all 24 rows, without dropout, gain or noise."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        mse = float(F.mse_loss(model(X), Y).item())
    model.train(was_training)
    return mse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, required=True, help="updates to run in this process")
    p.add_argument("--output", type=Path, required=True, help="folder to create (must not exist)")
    p.add_argument("--resume", help="checkpoint.pt to resume from")
    p.add_argument("--omit-rng-restore", action="store_true", help="negative case: do not restore random streams")
    p.add_argument("--allow-version-change", action="store_true", help="accept other python/torch/numpy/ripresa versions (recorded)")
    p.add_argument("--allow-code-change", action="store_true", help="accept edited training code (recorded)")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
    if args.output.exists():
        print(f"error: output folder already exists: {args.output}\n  hint: choose a new folder; runs are never overwritten", file=sys.stderr)
        return 2

    torch.set_num_threads(CONFIG["threads"])
    torch.set_default_dtype(torch.float64)
    X, Y = load_rows(DATA)

    # Seed everything; a resume then *restores* the streams (re-seeding is not restoring).
    random.seed(CONFIG["seed"])
    np.random.seed(CONFIG["seed"])
    torch.manual_seed(CONFIG["seed"])
    pcg = np.random.Generator(np.random.PCG64(CONFIG["seed"]))

    model = build_model()
    optimizer, scheduler = build_optimizer(model)
    sampler = ripresa.EpochSampler(CONFIG["rows"], CONFIG["batch_size"], generator=pcg)
    state = ripresa.TrainingState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=sampler,
        rng=ripresa.RandomStreams(numpy={"pcg64": pcg}),
        config=CONFIG,
        code_files=[__file__],
        data_sources={"rows": DATA},
    )
    progress = ripresa.Progress()
    if args.resume:
        try:
            allow = {}
            if args.allow_version_change:
                allow["allow_version_change"] = True
            if args.allow_code_change:
                allow["allow_code_change"] = True
            progress = restore(state, args.resume, args.omit_rng_restore, **allow)
        except ripresa.RipresaError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
    model.train()

    trajectory = ripresa.Trajectory(state, resumed_from=args.resume, rng_restored=not args.omit_rng_restore)
    trajectory.start(progress, {"mse": evaluate(model, X, Y)})
    for _ in range(args.steps):
        ids = sampler.next_batch()
        loss, lr = train_step(model, optimizer, scheduler, X, Y, ids, pcg)
        progress.step += 1
        progress.samples_seen += len(ids)
        progress.epoch = sampler.epoch
        trajectory.step(progress.step, rows=ids, lr=lr, loss=loss)

    # A step boundary: the update is complete and no gradient is pending.
    args.output.mkdir(parents=True)
    trajectory.finish(progress, {"mse": evaluate(model, X, Y)})
    trajectory.write(args.output / "summary.json")
    try:
        ripresa.save_checkpoint(args.output / "checkpoint.pt", state.snapshot(progress))
    except ripresa.RipresaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"step {progress.step}: cursor {sampler.cursor}/{sampler.n_rows}, epoch {sampler.epoch}, "
          f"next lr {optimizer.param_groups[0]['lr']:g} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
