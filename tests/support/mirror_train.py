"""A small training loop with a mirror, for tests/test_mirror.py (run in-process or as a fresh process).

    python mirror_train.py --run DIR --steps N --every K [--mirror URL] [--format general|andrea]
        [--timeout S] [--attempts N] [--backoff S] [--close-timeout S] [--sleep S]

Prints one JSON line: the step reached, where it resumed from, and ``digest``,
the sha256 of the weights, the optimizer state and the next draws of every
random stream (equal digests: bitwise the same state).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ripresa
from ripresa.store.mirror import MirrorSpec
from ripresa.store.retention import KeepLast


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, gen: np.random.Generator) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    for pid, st in sorted(optimizer.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}/{k}".encode())
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    h.update(torch.rand(4).numpy().tobytes())  # the next draws: the streams were restored too
    h.update(gen.random(4).tobytes())
    return h.hexdigest()


def train(run: str | Path, steps: int, every: int, *, mirror: Any = None, fmt: str = "general", keep: int = 3,
          sleep: float = 0.0, handle_signals: bool = False, after_step: Any = None,
          checkpointer: dict[str, Any] | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    gen = np.random.default_rng(0)
    X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    Y = X @ torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = ripresa.EpochSampler(len(X), 16, generator=gen)
    state = ripresa.TrainingState(model=model, optimizer=optimizer, data=sampler,
                                  rng=ripresa.RandomStreams(numpy={"data": gen}), config={"steps": steps},
                                  code_files=[__file__])
    ckpt = ripresa.Checkpointer(run, state, every=every, mirror=mirror, format=fmt, retention=KeepLast(keep),
                                handle_signals=handle_signals, **(checkpointer or {}))
    try:
        start = ckpt.resume()
        resumed = ckpt.resumed_from.path.name if ckpt.resumed_from is not None else None
        for step in range(start + 1, steps + 1):
            ids = sampler.next_batch()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(X[ids]), Y[ids])
            loss.backward()
            optimizer.step()
            if sleep:
                import time

                time.sleep(sleep)
            if ckpt.step_done(step, loss=loss.item()):
                break
            if after_step is not None:
                after_step(step)  # a test's hook: e.g. hold the loop until the mirror has seen an outage
    except BaseException:
        ckpt.abort()
        raise
    ckpt.close(final_save=True)
    return {"step": ckpt.progress.step, "start": start, "resumed": resumed, "digest": digest(model, optimizer, gen),
            "last_upload_seconds": ckpt.mirror.last_upload_seconds if ckpt.mirror is not None else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--mirror")
    ap.add_argument("--format", default="general")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--attempts", type=int, default=5)
    ap.add_argument("--backoff", type=float, default=0.05)
    ap.add_argument("--close-timeout", type=float, default=60.0)
    ap.add_argument("--sleep", type=float, default=0.0)
    a = ap.parse_args()
    mirror = None
    if a.mirror:
        mirror = MirrorSpec(a.mirror, timeout=a.timeout, attempts=a.attempts, backoff=a.backoff,
                            max_backoff=max(a.backoff, 1.0), close_timeout=a.close_timeout)
    print(json.dumps(train(a.run, a.steps, a.every, mirror=mirror, fmt=a.format, sleep=a.sleep, handle_signals=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
