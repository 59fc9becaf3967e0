"""A plain ``accelerate`` training loop (tiny GPT-2 on CPU), resumable exactly with ripresa.

    python examples/accelerate/train.py --run runs/acc --max-steps 60 --every 20 --mode ripresa --final final.safetensors

``--mode ripresa``: a ``TrainingState`` over what ``accelerator.prepare`` returns
(model, optimizer, scheduler, and the DataLoader made exact in place by
``ripresa.make_exact``) and a ``Checkpointer`` — the lines marked ``# ripresa``.
``--mode native``: accelerate's own ``save_state``/``load_state`` every K steps
and ``skip_first_batches`` to the saved position. ``--mode none``: no checkpoints.
The same command run again continues the run (ripresa and native modes).
The rest is what an accelerate user writes: a map-style dataset with random
augmentation in ``__getitem__`` (torch, ``random``, NumPy), ``shuffle=True``,
2 workers, dropout, AdamW and a linear schedule with warmup.

``RIPRESA_EXAMPLE_KILL_AFTER=S`` SIGKILLs the process right after optimizer
step S completed (its checkpoint, if one was due, taken);
``RIPRESA_EXAMPLE_LOADER_AS_IS=1`` (with ``--mode ripresa``) leaves the loader
out of the ``TrainingState`` (not made exact, its position and random draws not
captured: a resume that is not exact, the negative case). No download.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator, skip_first_batches  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup  # noqa: E402

VOCAB, LENGTH, ROWS, BATCH, LOG_EVERY = 64, 16, 100, 8, 5


class Tokens(torch.utils.data.Dataset):
    """Fixed random token rows; each read is augmented at random (torch, random, NumPy)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.rows = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i].clone()
        ids = torch.roll(ids, shifts=random.randint(0, LENGTH - 1))
        mask = torch.rand(LENGTH) < 0.15
        noise = torch.from_numpy(np.random.randint(0, VOCAB, LENGTH))
        ids = torch.where(mask, noise, ids)
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--mode", choices=("ripresa", "native", "none"), default="ripresa")
    ap.add_argument("--final", required=True)
    ap.add_argument("--log")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    kill = int(os.environ.get("RIPRESA_EXAMPLE_KILL_AFTER") or 0)

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    np.random.seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 5, a.max_steps)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH, shuffle=True, num_workers=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    log: list[dict] = []
    step = 0
    if a.mode == "ripresa":
        import ripresa  # ripresa

        if os.environ.get("RIPRESA_EXAMPLE_LOADER_AS_IS") == "1":  # the negative case: the loader left out
            state = ripresa.TrainingState(model, optimizer, scheduler, objects={"log": ripresa.ScriptState(log=log)})
        else:
            state = ripresa.TrainingState(model, optimizer, scheduler, data=ripresa.make_exact(loader),  # ripresa
                                          objects={"log": ripresa.ScriptState(log=log)})  # ripresa
        ckpt = ripresa.Checkpointer(a.run, state, every=a.every)  # ripresa
        step = ckpt.resume()  # ripresa
        log = state.objects["log"].log  # ripresa
    elif a.mode == "native":
        ckpt_dir = os.path.join(a.run, "accelerate_state")
        if os.path.isdir(ckpt_dir):
            accelerator.load_state(ckpt_dir)
            with open(os.path.join(a.run, "progress.json")) as f:
                saved = json.load(f)
            step, log = saved["step"], saved["log"]

    per_epoch = len(loader)
    stop = False
    model.train()
    while step < a.max_steps and not stop:
        epoch_loader = loader
        if a.mode == "native" and step % per_epoch:  # the native resume: skip what the epoch already trained on
            epoch_loader = skip_first_batches(loader, step % per_epoch)
        for batch in epoch_loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % LOG_EVERY == 0:
                log.append({"step": step, "loss": loss.item(), "lr": lr, "epoch": step / per_epoch})
            if a.mode == "ripresa":
                stop = ckpt.step_done(step, loss=loss.item())  # ripresa
            elif a.mode == "native" and step % a.every == 0:
                accelerator.save_state(os.path.join(a.run, "accelerate_state"))
                with open(os.path.join(a.run, "progress.json"), "w") as f:
                    json.dump({"step": step, "log": log}, f)
            if kill and step == kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if stop or step >= a.max_steps:
                break
    if a.mode == "ripresa":
        ckpt.close()  # ripresa

    unwrapped = accelerator.unwrap_model(model)
    save_file({k: v.detach().clone().contiguous() for k, v in unwrapped.state_dict().items()}, a.final)
    if a.log:
        with open(a.log, "w") as f:
            for entry in log:
                f.write(json.dumps(entry) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
