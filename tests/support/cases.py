"""The table of training cases of issue 12: one small, real training loop per case, written with the public API.

Each case is what a user would write — a model, an optimizer, its data, a
``ripresa.TrainingState`` and a ``ripresa.Checkpointer`` — and differs from
the others in the one thing it exercises (:data:`CASES`). It is importable
(:func:`train`, :func:`final_state`, :func:`companion_sizes`) and a script::

    python tests/support/cases.py CASE --run DIR --steps N [--every E] [--sleep S] [--final FILE]
    python tests/support/cases.py --sizes DIR          # each case 6 steps (every 3): companion bytes

The script resumes whatever ``DIR`` holds and trains to step ``N``; with
``--final`` it writes every saved tensor and value of the final state (for a
bitwise comparison: :func:`load_final`, :func:`differences`). It uses no
verification contract: ``ripresa verify --steer`` steers its ``Checkpointer``
(docs/VERIFY.md).

Devices and processes: ``RIPRESA_TEST_DEVICE=cuda`` runs it on the GPU
(default ``cpu``; deterministic algorithms are switched on there); under
``torchrun`` (give the folder as ``--run-dir``: torchrun's own parser reads
``--run`` as its ``--run-path``) it initialises gloo (NCCL on CUDA, one device per ``LOCAL_RANK``)
and wraps the model in DDP, for the cases of :data:`DDP_CASES`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before any cuBLAS handle: deterministic GEMMs on CUDA

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ripresa  # noqa: E402

#: Every case, in the order of the table.
CASES = ("bf16", "fp16_scaler", "sgd_nesterov", "amsgrad", "adafactor", "lion", "bn_tied", "loader", "feistel")

#: What each case exercises (the table's first column).
DESCRIPTIONS = {
    "bf16": "bf16 parameters (AdamW, bf16 moments)",
    "fp16_scaler": "fp16 autocast + GradScaler (scale backs off and grows)",
    "sgd_nesterov": "SGD momentum + Nesterov",
    "amsgrad": "AdamW(amsgrad=True)",
    "adafactor": "Adafactor (factored row/col second moments)",
    "lion": "user-written optimizer (Lion: tensor, int64 tensor, float per parameter)",
    "bn_tied": "BatchNorm buffers + tied embedding/head",
    "loader": "StatefulLoader, 2 workers, augmentation drawn in the workers (torch, random, NumPy)",
    "feistel": "EpochSampler over 10^9 rows (Feistel, O(1))",
}

#: The ``format=`` each case passes to its Checkpointer — the one place to change it. ``"auto"``, the
#: default, is the general .safetensors generation for any state (docs/FORMAT.md, "Which format a session
#: writes"); the 10^9-row sampler case asks for the ANDREA ``.bin`` (fp32 AdamW).
FORMATS: dict[str, str] = {case: "auto" for case in CASES} | {"feistel": "andrea"}

#: The cases that run under torchrun with DDP (the data-loader cases draw their data per process).
DDP_CASES = ("bf16", "fp16_scaler", "sgd_nesterov", "amsgrad", "adafactor", "lion", "bn_tied")

#: Rows of the Feistel case.
FEISTEL_ROWS = 10**9


def device() -> torch.device:
    """The device of this process: ``RIPRESA_TEST_DEVICE`` (default cpu); on CUDA under torchrun, ``LOCAL_RANK``'s."""
    name = os.environ.get("RIPRESA_TEST_DEVICE", "cpu")
    if name not in ("cpu", "cuda"):
        raise SystemExit(f"RIPRESA_TEST_DEVICE must be cpu or cuda, got {name!r}")
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------- the cases' parts


class Lion(torch.optim.Optimizer):
    """A user-written optimizer with its own per-parameter state: sign momentum, an int64 step tensor, a float."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    s["momentum"] = torch.zeros_like(p)
                    s["step"] = torch.zeros((), dtype=torch.int64)
                    s["last_norm"] = 0.0
                m = s["momentum"]
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-g["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
                s["step"] += 1
                s["last_norm"] = float(p.grad.norm())


class Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight; a BatchNorm with persistent running statistics."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.bn = torch.nn.BatchNorm1d(dim)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.drop(self.bn(self.emb(x))))


class Augmented(torch.utils.data.Dataset):
    """32 rows (4 batches of 8: a 6-step verify crosses an epoch after its cut at 3, a 12-step run spans three);
    each fetch draws noise from torch, ``random`` and NumPy's global stream (in the loader's workers)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.sin(torch.arange(6, dtype=torch.float32) * (i + 1) * 0.1)
        x = x + 0.05 * torch.randn(6) + 0.01 * random.random() + 0.01 * float(np.random.rand())
        return x, x[:3] * 2 - x[3:]


def _features(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the 10^9-row data set, computed from their ids (nothing is materialised)."""
    t = torch.tensor(ids, dtype=torch.float64)[:, None]
    x = torch.sin(t * torch.arange(1, 7, dtype=torch.float64) * 1e-3).float()
    return x, x[:, :3] * 2 - x[:, 3:]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))


@dataclass
class Case:
    """One case, built: its TrainingState and what a step needs."""

    name: str
    state: ripresa.TrainingState
    dev: torch.device
    scaler: Any = None
    data: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    batches: Any = None  # the loader case's endless batch iterator (made after the resume)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's batch: from the global torch stream, the StatefulLoader or the Feistel sampler."""
        if self.name == "loader":
            if self.batches is None:
                self.batches = (b for _ in iter(int, 1) for b in self.data)  # epoch after epoch
            x, y = next(self.batches)
        elif self.name == "feistel":
            x, y = _features(self.data.next_batch())
        elif self.name == "bn_tied":
            x, y = torch.randint(0, 16, (12,)), torch.randint(0, 16, (12,))
        else:
            x = torch.randn(12, 6)
            y = torch.randn(12, 3)
        return x.to(self.dev), y.to(self.dev)

    def step(self) -> float:
        """One optimizer step (and scheduler step); the loss as a float."""
        s = self.state
        model, opt = s.model, s.optimizer
        x, y = self.batch()
        opt.zero_grad(set_to_none=True)
        if self.name == "bn_tied":
            loss = torch.nn.functional.cross_entropy(model(x), y)
        elif self.name == "fp16_scaler":
            with torch.autocast(self.dev.type, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
        else:
            dtype = next(model.parameters()).dtype
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(opt)
            self.scaler.update()
        else:
            loss.backward()
            opt.step()
        s.scheduler.step()
        return float(loss.detach())


def build(name: str, *, ddp: bool = False) -> Case:
    """The case ``name``, built as a fresh process builds it (same seeds: same initial state)."""
    if name not in CASES:
        raise SystemExit(f"unknown case {name!r}; cases: {', '.join(CASES)}")
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model: torch.nn.Module = Tied() if name == "bn_tied" else _mlp()
    if name == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(dev)
    params = model.parameters()
    if name == "sgd_nesterov":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)
    elif name == "amsgrad":
        opt = torch.optim.AdamW(params, lr=1e-2, amsgrad=True)
    elif name == "adafactor":
        opt = torch.optim.Adafactor(params, lr=1e-2)
    elif name == "lion":
        opt = Lion(params, lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    scaler = None
    if name == "fp16_scaler":
        # Every 2 good steps the scale grows; at 2^18 the fp16 gradients overflow (found inf): the step is skipped
        # and the scale backs off. Measured on CPU: 65536, 131072, 131072, 262144, 131072, ... (a 12-step run).
        scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**16, growth_interval=2)
    data: Any = None
    rng = ripresa.RandomStreams()
    if name == "loader":
        data = ripresa.StatefulLoader(Augmented(), batch_size=8, shuffle=True, num_workers=2, seed=7)
    elif name == "feistel":
        gen = np.random.default_rng(0)
        data = ripresa.EpochSampler(FEISTEL_ROWS, 8, generator=gen, permutation="feistel")
        rng = ripresa.RandomStreams(numpy={"data": gen})
    if ddp:
        if name not in DDP_CASES:
            raise SystemExit(f"case {name!r} runs in one process (DDP cases: {', '.join(DDP_CASES)})")
        ids = [dev.index] if dev.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    rank = torch.distributed.get_rank() if ddp else 0
    torch.manual_seed(1000 + rank)  # the data and dropout streams: each rank its own
    random.seed(rank)  # seeded, as scripts do, though no case draws from them in the main process: the final
    np.random.seed(rank)  # states of two processes then compare equal (ripresa verify reports unseeded ones "not used")
    state = ripresa.TrainingState(model=model, optimizer=opt, scheduler=sched, scaler=scaler, data=data, rng=rng,
                                  config={"case": name}, device=dev.type)
    return Case(name, state, dev, scaler=scaler, data=data)


def train(name: str, run: str | Path, steps: int, every: int = 3, *, sleep: float = 0.0, ddp: bool = False,
          format: str | None = None) -> Case:
    """Resume ``run`` (if it holds a generation) and train case ``name`` to step ``steps``; the final save included."""
    case = build(name, ddp=ddp)
    ckpt = ripresa.Checkpointer(run, case.state, every=every, format=format or FORMATS[name])
    start = ckpt.resume()
    for step in range(start + 1, steps + 1):
        loss = case.step()
        if sleep:
            time.sleep(sleep)
        metrics = {"loss": loss, "lr": case.state.scheduler.get_last_lr()[0]}
        if case.scaler is not None:
            metrics["scale"] = case.scaler.get_scale()  # its back-offs and growths, in the history
        if ckpt.step_done(step, **metrics):
            break
    ckpt.close(final_save=True)
    case.extra["ckpt"] = {"backend": ckpt.backend.kind, "resumed_from": str(ckpt.resumed_from.path)
                          if ckpt.resumed_from is not None else None, "step": ckpt.progress.step}
    return case


# ---------------------------------------------------------------------------------------- the final state


#: The parts of a snapshot that must be bitwise equal after a resume (identities and lineage are not training state).
COMPARED = ("progress", "model", "optimizer", "scheduler", "scaler", "data", "objects", "rng")


def final_state(case: Case) -> dict[str, torch.Tensor]:
    """Every tensor of the state's compared parts by key, plus ``__rest__``: the rest as canonical JSON bytes."""
    from ripresa.formats import general

    snap = case.state.snapshot(ripresa.Progress(step=case.extra.get("ckpt", {}).get("step", 0)))
    model = case.state.model.module if hasattr(case.state.model, "module") else case.state.model
    tensors, encoded, _ = general.split_state({k: snap[k] for k in COMPARED}, general.model_aliases(model))
    rest = json.dumps(encoded, sort_keys=True, default=repr).encode()
    return {**tensors, "__rest__": torch.tensor(list(rest), dtype=torch.uint8)}


def save_final(case: Case, path: str | Path) -> None:
    torch.save(final_state(case), path)


def load_final(path: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose dtype, shape or bytes differ (empty: bitwise equal)."""
    out = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bytes(x), _bytes(y)):
            out.append(k)
    return out


def companion_sizes(run: str | Path) -> dict[str, int]:
    """Bytes of each generation's JSON companion in ``run`` (``.bin``: ``step_N.json``; general: ``.safetensors.json``)."""
    return {p.name: p.stat().st_size for p in sorted(Path(run).glob("step_*.json"))}


# ---------------------------------------------------------------------------------------- the script


def _sizes(folder: Path) -> int:
    print(f"{'case':<14} {'format':<8} {'companion bytes (6 steps, every 3)':<40}")
    for name in CASES:
        run = folder / name
        if run.exists():
            raise SystemExit(f"{run} exists; give an empty folder")
        train(name, run, 6, 3)
        sizes = companion_sizes(run)
        print(f"{name:<14} {FORMATS[name]:<8} {' '.join(f'{k}={v}' for k, v in sizes.items())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", nargs="?", choices=CASES)
    ap.add_argument("--run", "--run-dir", dest="run",  # --run-dir under torchrun (its parser takes --run for --run-path)
                    help="run folder (resumed when it holds a generation)")
    ap.add_argument("--steps", type=int, default=12, help="train to this step")
    ap.add_argument("--every", type=int, default=3, help="checkpoint cadence")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to kill it mid-run)")
    ap.add_argument("--final", help="write the final state here (rank r > 0: FILE.rank<r>)")
    ap.add_argument("--format", help="override the case's format= (default: FORMATS[case])")
    ap.add_argument("--sizes", metavar="DIR", help="run every case 6 steps under DIR and print its companion sizes")
    args = ap.parse_args(argv)
    # one intra-op thread in every process of a comparison: a CPU reduction's order (BatchNorm statistics, an
    # embedding's gradient) may depend on the thread count, and a restart must not differ from its reference
    torch.set_num_threads(1)
    if args.sizes:
        return _sizes(Path(args.sizes))
    if args.case is None or args.run is None:
        ap.error("need CASE and --run (or --sizes DIR)")
    ddp = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp:
        backend = "nccl" if device().type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device())
        torch.distributed.init_process_group(backend)
    case = train(args.case, args.run, args.steps, args.every, sleep=args.sleep, ddp=ddp, format=args.format)
    if args.final:
        rank = torch.distributed.get_rank() if ddp else 0
        save_final(case, args.final if rank == 0 else f"{args.final}.rank{rank}")
    print(json.dumps({"case": args.case, **case.extra["ckpt"]}), flush=True)
    if ddp:
        torch.distributed.barrier()
        from ripresa.session.distributed import exit_rank

        exit_rank(0)  # not interpreter finalization: gloo can abort there (docs/ARCHITECTURE.md, "Distributed runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
