"""A compact GPT trainer written the way such scripts usually are, with ripresa added.

    python train.py --run runs/gpt --steps 300 --every 50

nanoGPT style: a char-level data set (the source of Python's own ``argparse``
module, no download), batches drawn with ``torch.randint`` on the global
generator, the next batch prefetched while the current one is in flight,
gradient accumulation, an evaluation that draws batches too, AdamW with
decay / no-decay groups, a cosine learning rate, bf16 autocast on CUDA.
The 13 lines marked ``# ripresa`` are all that was added or changed; the
batch prefetched at the end of a step and the early-stopping variables travel
in a ``ScriptState`` (docs/API.md, "State in script variables"). Kill it any
way you like and start the same command again: it goes on bit-exactly.
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import ripresa  # ripresa


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, d: int, dropout: float) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(vocab, d), nn.Embedding(block, d), nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, n_head, dropout) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="run folder")
    ap.add_argument("--steps", type=int, default=300, help="train until this optimizer step")
    ap.add_argument("--every", type=int, default=50, help="checkpoint cadence (steps)")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=32)
    ap.add_argument("--block", type=int, default=32, help="context length")
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-step")
    ap.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--patience", type=int, default=20, help="evaluations without improvement before stopping")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    torch.manual_seed(1337)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()
    text = open(argparse.__file__, encoding="utf-8").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = splits[split]
        ix = torch.randint(len(d) - args.block - 1, (args.batch,))
        x = torch.stack([d[i:i + args.block] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + args.block] for i in ix])
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = []
        for _ in range(2):
            with ctx:
                losses.append(model(*get_batch("val")).item())
        model.train()
        return sum(losses) / len(losses)

    def get_lr(step: int) -> float:
        warmup = max(1, args.steps // 20)
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return 0.1 * args.lr + 0.45 * args.lr * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    model = GPT(len(chars), args.block, args.n_layer, args.n_head, args.n_embd, dropout=0.1).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    best_val, bad_evals, ema_loss = float("inf"), 0, None

    script = ripresa.ScriptState(batch=None, best_val=best_val, bad_evals=bad_evals, ema_loss=ema_loss)  # ripresa
    state = ripresa.TrainingState(model=model, optimizer=optimizer, objects={"script": script},  # ripresa
                                  config=vars(args), code_files=[__file__])  # ripresa
    ckpt = ripresa.Checkpointer(args.run, state, every=args.every)  # ripresa
    start = ckpt.resume()  # ripresa: every object built, nothing drawn yet
    best_val, bad_evals, ema_loss = script.best_val, script.bad_evals, script.ema_loss  # ripresa

    X, Y = script.batch or get_batch("train")  # ripresa: was X, Y = get_batch("train")
    for step in range(start + 1, args.steps + 1):  # ripresa: was range(1, args.steps + 1)
        if bad_evals >= args.patience:  # early stopping
            print(f"early stop: {bad_evals} evaluations without improvement, best val {best_val:.4f}")
            break
        lr = get_lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if step % args.eval_every == 0:
            val = evaluate()
            best_val, bad_evals = (val, 0) if val < best_val else (best_val, bad_evals + 1)
            print(f"step {step}: train {ema_loss or 0:.4f} val {val:.4f}", flush=True)
        for _ in range(args.accum):
            with ctx:
                loss = model(X, Y) / args.accum
            X, Y = get_batch("train")  # prefetch the next batch while this one is in flight
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * args.accum
        ema_loss = lossf if ema_loss is None else 0.9 * ema_loss + 0.1 * lossf
        script.update(batch=(X, Y), best_val=best_val, bad_evals=bad_evals, ema_loss=ema_loss)  # ripresa
        if ckpt.step_done(step, loss=lossf, lr=lr, tokens=args.accum * X.numel()):  # ripresa
            break  # ripresa
    ckpt.close(final_save=True)  # ripresa: the last step is saved too
    print(f"stopped at step {ckpt.progress.step}; run folder {args.run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
