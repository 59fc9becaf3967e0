"""A tiny plain-torch "framework" script following the examples' CLI contract (docs/INTEGRATIONS.md).

It stands in for examples/<fw>/train.py in tests of benchmarks/bench_frameworks.py:
``--mode none`` trains uninterrupted; ``--mode native`` saves model + optimizer +
step with torch.save every K steps and on a rerun loads them and skips the
batches already seen (what most frameworks' own resume does: the random
streams of dropout and augmentation are not restored, so it drifts);
``--mode ripresa`` adds ripresa's Checkpointer (the marked lines).
``RIPRESA_EXAMPLE_KILL_AFTER=S`` SIGKILLs the process right after step S.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import ripresa


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--max-steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--mode", choices=("ripresa", "native", "none"), default="ripresa")
    ap.add_argument("--final", required=True)
    ap.add_argument("--log")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kill = int(os.environ.get("RIPRESA_EXAMPLE_KILL_AFTER", "0"))

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    X = torch.randn(96, 4, generator=torch.Generator().manual_seed(1))
    Y = X.sum(1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = np.random.default_rng(args.seed)
    sampler = ripresa.EpochSampler(len(X), 8, generator=gen)

    start = 0
    native = Path(args.run) / "native.pt"
    if args.mode == "native":
        Path(args.run).mkdir(parents=True, exist_ok=True)
        if native.exists():
            saved = torch.load(native, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = int(saved["step"])
            for _ in range(start):  # skip the batches already seen
                sampler.next_batch()
    ckpt = None
    if args.mode == "ripresa":
        state = ripresa.TrainingState(model=model, optimizer=opt, data=sampler, rng=ripresa.RandomStreams(numpy={"data": gen}))  # ripresa: the one line
        ckpt = ripresa.Checkpointer(args.run, state, every=args.every, handle_signals=False)  # ripresa: the one line
        start = ckpt.resume()

    log = open(args.log, "a") if args.log else None
    for step in range(start + 1, args.max_steps + 1):
        ids = sampler.next_batch()
        x = X[ids] + 0.01 * torch.randn(len(ids), 4) * random.random() + float(np.random.rand()) * 1e-3  # augmentation
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), Y[ids])
        loss.backward()
        opt.step()
        if log is not None:
            log.write(json.dumps({"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"]}) + "\n")
            log.flush()
        if ckpt is not None:
            ckpt.step_done(step, loss=loss.item())
        elif args.mode == "native" and step % args.every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, str(native) + ".tmp")
            os.replace(str(native) + ".tmp", native)
        if step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    if ckpt is not None:
        ckpt.close()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
