"""The cost of world-size-invariant steps (docs/ARCHITECTURE.md, "World-size changes"): step time and bytes, on and off.

    .venv/bin/python benchmarks/bench_invariant.py                          # 2 and 4 gloo ranks, 5.8M params
    .venv/bin/python benchmarks/bench_invariant.py --worlds 2 --width 256 --blocks 1 --block-steps 2   # a smoke run

For each world size, one real ``torchrun`` process group on gloo (CPU) trains the same model on the
same global batches (``G`` micro-batches of ``b`` samples a step) in alternating blocks of steps:

* ``on``: :class:`ripresa.session.invariant.InvariantSteps` — one backward per micro-batch of the
  rank, each gradient merged into the rank's subtree as it comes, then the tree's upper levels over
  the ``W`` partial sums: an all-to-all of their ``W`` slices (rank ``r`` sums slice ``r`` of every
  partial) and an all-gather of the summed slices — the traffic of a ring all-reduce. (Until issue
  32's benchmark showed the cost, ``on`` all-gathered the ``W`` whole partial sums: ``(W−1)·P`` sent.)
* ``a2a``: the same reduction written out in the benchmark itself, every gradient bit checked equal
  to ``on``'s at each step (the reference the change was measured against);
* ``off``: ``DistributedDataParallel`` over the rank's share of the global batch (one backward),
  its bucketed all-reduce overlapping the backward;
* ``accum``: the rank's micro-batches, one backward each accumulated into ``.grad``, no reduction —
  the compute floor of ``on``'s local part (``on``'s local time less this is the cost of keeping the
  micro-batch gradients apart: a fresh gradient and a flattened copy of ``P`` per micro-batch).

Blocks alternate (``on a2a off accum``, then ``accum off a2a on``, ...); a sample is one step, timed on every rank
between two barriers, the slowest rank's time kept. Bytes a rank sends per step: for ``on`` and
``a2a`` what their collectives carry (``InvariantSteps.bytes_sent``: ``2(W−1)/W·P`` for ``P``
gradient bytes, the slices padded to a multiple of ``W``); for ``off`` the bytes DDP's comm hook hands to the
all-reduce (``P``), times ``2(W−1)/W`` for a ring all-reduce; beside them the loopback interface's
bytes per step divided by ``W`` (what gloo really put on the wire, every process of the host
included — a shared host adds its noise).

**On paper, at 64 ranks.** ``P`` gradient bytes, ``G`` micro-batches a step (a multiple of every world
size used; ``G ≥ W``), ``W = 64``. Each rank computes the same forward and backward FLOPs as under
DDP (its ``G/W`` micro-batches), but as ``G/W`` separate backwards (smaller matrix products) and
flattens each gradient (``G/W`` copies of ``P``). What it sends and holds:

======================  =====================  ==============================  ==========================
path                    sent per rank          held beyond the gradients       adds of P elements a rank
======================  =====================  ==============================  ==========================
DDP ring all-reduce     2(W−1)/W·P ≈ 1.97 P    buckets ≈ P                     (W−1)/W ≈ 1
on, G, W powers of 2    2(W−1)/W·P ≈ 1.97 P    2 P (the slices, the gathered)  G/W − 1 + (W−1)/W
on, otherwise           (G/W)(W−1)·P           G·P (every micro-batch)         G − 1
first version of on     (W−1)·P = 63 P         W·P = 64 P (all partial sums)   G/W − 1 + W − 1 (63)
======================  =====================  ==============================  ==========================

plus, on the power-of-two path, at most ``log2(G/W) + 1`` flattened micro-batch gradients held while
the rank's subtree is merged (``InvariantSteps`` merges them as they come).

The first version all-gathered the partial sums: 63/1.97 = 32× DDP's bytes at 64 ranks (``W/2``), and
64 P of memory — for a 1B-parameter model with fp32 gradients (P = 4 GB) 252 GB sent and 256 GB
held per rank per step, which does not fit. The tree needs neither: its upper levels are
elementwise, so any slicing of the partial sums gives the same bits; ``on`` now sends what a ring
all-reduce sends, holds 2 P, and adds one all-to-all's latency (``W−1`` messages, like the ring's
``2(W−1)`` steps). Left against DDP: no overlap of the reduction with the backward (DDP starts a
bucket's all-reduce while the backward runs; the tree waits for the rank's last micro-batch — a
bucketed all-to-all could overlap, the sum of a bucket being elementwise too), the ``G/W`` separate
backwards, and the ``G/W`` copies. The non-power-of-two path still all-gathers every micro-batch's
gradient. The loss all-gather is ``G`` floats.

Writes ``benchmarks/results/bench_invariant.json`` (every sample, the medians and minimums, the
paper model) and ``bench_invariant.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARMS = ("on", "a2a", "off", "accum")
SCHEMA = "ripresa-bench-invariant/1"


# ---------------------------------------------------------------------------- the worker (one rank, under torchrun)


def _lo_bytes() -> int:
    """Bytes sent on the loopback interface since boot (every process of the host), 0 where unreadable."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _model(width: int, depth: int, dim: int):
    import torch

    torch.manual_seed(0)
    layers: list[Any] = [torch.nn.Linear(dim, width), torch.nn.GELU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, dim))
    return torch.nn.Sequential(*layers)


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ripresa.session.invariant import InvariantSteps, tree_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    G, b, dim = args.micro, args.batch, args.dim
    models = {arm: _model(args.width, args.depth, dim) for arm in ARMS}
    opts = {arm: torch.optim.SGD(m.parameters(), lr=1e-3) for arm, m in models.items()}
    steps = {arm: InvariantSteps(models[arm], micro_batches=G, seed=0) for arm in ("on", "a2a")}
    hooked = {"bytes": 0}

    def count_hook(state, bucket):  # unannotated: DDP checks the annotations of a comm hook
        hooked["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world))

    ddp = DistributedDataParallel(models["off"])
    ddp.register_comm_hook(None, count_hook)
    params = sum(p.numel() for p in models["on"].parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in models["on"].parameters())
    gen = torch.Generator().manual_seed(1)
    pool = [(torch.randn(G * b, dim, generator=gen), torch.randn(G * b, dim, generator=gen)) for _ in range(4)]
    mine = list(steps["on"].indices())
    a2a_sent = {"bytes": 0}

    def a2a_reduce(partial: torch.Tensor) -> torch.Tensor:
        """The fixed tree, its upper levels summed slice by slice after an all-to-all (module doc)."""
        n = partial.numel()
        k = -(-n // world)  # W equal slices (zero padding: its sums are zeros, cut off below)
        padded = torch.cat([partial, partial.new_zeros(k * world - n)])
        recv = torch.empty_like(padded)
        dist.all_to_all_single(recv, padded)  # slice r of every rank's partial sum, by rank
        summed = tree_sum(list(recv.view(world, k).unbind(0)))  # the tree's upper levels, elementwise
        out = [torch.empty(k) for _ in range(world)]
        dist.all_gather(out, summed)
        a2a_sent["bytes"] += 2 * (world - 1) * k * padded.element_size()
        return torch.cat(out)[:n].div_(G)

    def one_step(arm: str, step: int) -> dict[str, float]:
        x, y = pool[step % len(pool)]
        kept = None
        t0 = time.perf_counter()
        if arm == "accum":  # the rank's micro-batches, accumulated into .grad: no reduction, nothing kept apart
            opts[arm].zero_grad()
            for i in mine:
                (torch.nn.functional.mse_loss(models[arm](x[i * b:(i + 1) * b]), y[i * b:(i + 1) * b]) / G).backward()
            t1 = time.perf_counter()
        elif arm == "off":
            share = G * b // world
            xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            loss = torch.nn.functional.mse_loss(ddp(xs), ys)
            opts[arm].zero_grad()
            loss.backward()
            t1 = time.perf_counter()
        elif arm == "on":
            s = steps[arm]
            for i in mine:
                with s.micro_batch(step, i):
                    s.backward(torch.nn.functional.mse_loss(models[arm](x[i * b:(i + 1) * b]), y[i * b:(i + 1) * b]))
            t1 = time.perf_counter()
            s.reduce()
        else:  # a2a: the same micro-batches and streams, each gradient flattened apart, the rank's subtree summed
            s, pend, ps = steps[arm], [], list(models[arm].parameters())
            for i in mine:
                with s.micro_batch(step, i):
                    for p in ps:
                        p.grad = None
                    torch.nn.functional.mse_loss(models[arm](x[i * b:(i + 1) * b]), y[i * b:(i + 1) * b]).backward()
                    pend.append((1, torch.cat([p.grad.reshape(-1) for p in ps])))
                # merged as they come, as InvariantSteps does: the rank's block is a subtree (G, W powers of two)
                while len(pend) >= 2 and pend[-1][0] == pend[-2][0]:
                    (n, right), (_, left) = pend.pop(), pend.pop()
                    pend.append((2 * n, left.add_(right)))
            partial = pend[0][1]
            t1 = time.perf_counter()
            kept = partial.clone() if args.check else None
            total = a2a_reduce(partial)
            off = 0
            for p in ps:
                p.grad = total[off:off + p.numel()].view_as(p).clone()
                off += p.numel()
        opts[arm].step()
        t2 = time.perf_counter()
        if kept is not None:
            pending.append((kept, total, step))
        return {"step_s": t2 - t0, "local_s": t1 - t0, "reduce_s": t2 - t1}

    pending: list[Any] = []

    def check_a2a() -> None:
        """After the measurement: the a2a step's gradient has the bits of the all-gather tree (InvariantSteps'
        reduction: the W partial sums gathered, the upper levels summed, divided by G)."""
        for partial, total, step in pending:
            gathered = [torch.empty_like(partial) for _ in range(world)]
            dist.all_gather(gathered, partial)
            if not torch.equal(total, tree_sum(gathered).div_(G)):
                raise SystemExit(f"bench_invariant: the a2a reduction differs from the all-gather tree at step {step}")
        pending.clear()

    plan: list[str] = []
    for k in range(args.blocks):
        plan += list(ARMS) if k % 2 == 0 else list(reversed(ARMS))
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    step = 0
    for arm in ARMS:  # warm-up, not counted: one step each
        dist.barrier()
        one_step(arm, 0)
    check_a2a()
    for blk, arm in enumerate(plan):
        for _ in range(args.block_steps):
            step += 1
            sent0 = {"on": steps["on"].bytes_sent, "a2a": a2a_sent["bytes"], "off": hooked["bytes"]}.get(arm, 0)
            dist.barrier()
            lo0 = _lo_bytes()
            t = one_step(arm, step)
            lo1 = _lo_bytes()
            check_a2a()
            sent1 = {"on": steps["on"].bytes_sent, "a2a": a2a_sent["bytes"], "off": hooked["bytes"]}.get(arm, 0)
            slow = torch.tensor([t["step_s"], t["local_s"], t["reduce_s"]], dtype=torch.float64)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            handed = sent1 - sent0
            rec = {"step_s": float(slow[0]), "local_s": float(slow[1]), "reduce_s": float(slow[2]),
                   "sent_bytes": handed * 2 * (world - 1) / world if arm == "off" else handed,
                   "handed_bytes": handed, "lo_bytes_per_rank": (lo1 - lo0) / world, "block": blk}
            samples[arm].append(rec)
        if rank == 0:
            print(json.dumps({"progress": blk + 1, "of": len(plan), "arm": arm}), flush=True)
    if rank == 0:
        doc = {"world": world, "params": params, "grad_bytes": grad_bytes, "micro_batches": G, "batch": b,
               "per_rank": len(mine), "samples": samples, "checked_a2a_bits": bool(args.check)}
        Path(args.result).write_text(json.dumps(doc))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's worker threads can abort a finalizing interpreter (docs/ARCHITECTURE.md)


# ---------------------------------------------------------------------------- the parent


def stats(xs: list[float]) -> dict[str, Any]:
    return {"n": len(xs), "median": statistics.median(xs) if xs else None, "min": min(xs) if xs else None,
            "max": max(xs) if xs else None}


def paper(world: int, micro: int, p: float) -> dict[str, Any]:
    """Bytes a rank sends and holds per step at ``world`` ranks for ``p`` gradient bytes (module doc's table)."""
    per = micro // world
    pow2 = world & (world - 1) == 0 and micro & (micro - 1) == 0
    ring = 2 * (world - 1) / world * p
    on_sent = ring if pow2 else per * (world - 1) * p
    return {
        "world": world, "micro_batches": micro, "grad_bytes": p,
        "ddp_ring": {"sent": ring, "held": p},
        "on": {"sent": on_sent, "held_gathered": 2 * p if pow2 else micro * p, "held_micro": per * p,
               "adds": (per - 1 + (world - 1) / world) if pow2 else micro - 1, "power_of_two_path": pow2},
        "first_version": {"sent": (world - 1) * p, "held_gathered": world * p},
        "a2a": {"sent": 2 * (world - 1) / world * p, "held_gathered": 2 * p, "held_micro": per * p},
        "on_over_ddp_bytes": on_sent / (2 * (world - 1) / world * p),
    }


def run_world(world: int, args: argparse.Namespace, progress: Any, task: Any, scratch: Path) -> dict[str, Any]:
    result = scratch / f"w{world}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(Path(__file__)),
           "--worker", "--result", str(result), "--micro", str(args.micro), "--batch", str(args.batch),
           "--width", str(args.width), "--depth", str(args.depth), "--dim", str(args.dim), "--blocks", str(args.blocks),
           "--block-steps", str(args.block_steps)] + ([] if args.check else ["--no-check"])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if line.startswith("{\"progress\""):
            msg = json.loads(line)
            progress.update(task, advance=1, description=f"{world} ranks: block {msg['progress']}/{msg['of']} "
                                                         f"({msg['arm']})")
    if proc.wait() != 0 or not result.exists():
        raise SystemExit(f"bench_invariant: the {world}-rank run failed:\n" + "".join(tail))
    doc = json.loads(result.read_text())
    doc["summary"] = {arm: {k: stats([s[k] for s in doc["samples"][arm]])
                            for k in ("step_s", "local_s", "reduce_s", "sent_bytes", "lo_bytes_per_rank")}
                      for arm in ARMS}
    return doc


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    worlds = [r["world"] for r in doc["runs"]]
    width = 0.2
    for j, arm in enumerate(ARMS):
        med = [r["summary"][arm]["step_s"]["median"] * 1e3 for r in doc["runs"]]
        lo = [r["summary"][arm]["step_s"]["min"] * 1e3 for r in doc["runs"]]
        xs = [k + (j - 1.5) * width for k in range(len(worlds))]
        ax1.bar(xs, med, width, label=f"{arm} (median)")
        ax1.scatter(xs, lo, color="black", marker="_", s=200, zorder=3, label="minimum" if j == 0 else None)
        ax2.bar(xs, [r["summary"][arm]["sent_bytes"]["median"] / 1e6 for r in doc["runs"]], width, label=arm)
    for ax, title in ((ax1, "step time (ms), slowest rank"), (ax2, "MB sent per rank per step")):
        ax.set_xticks(range(len(worlds)), [f"{w} ranks" for w in worlds])
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"world-size-invariant steps: {doc['params'] / 1e6:.1f}M params, G={doc['micro_batches']}, "
                 f"gloo on {doc['host']['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--micro", type=int, default=8, help="G: micro-batches a step (a multiple of every world size)")
    ap.add_argument("--batch", type=int, default=8, help="b: samples a micro-batch")
    ap.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default 1024: 5.8M params)")
    ap.add_argument("--depth", type=int, default=6, help="hidden layers")
    ap.add_argument("--dim", type=int, default=256, help="input and output features")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per arm, alternating")
    ap.add_argument("--block-steps", type=int, default=4, help="steps a block")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the a2a == on bit check")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="where the JSON and PNG go")
    ap.add_argument("--paper-world", type=int, default=64)
    ap.add_argument("--paper-params", type=float, default=1e9, help="parameters of the paper model (fp32 gradients)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        ap.error(f"--worlds takes integers, got {args.worlds!r}")
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    bad = [w for w in worlds if not pow2(w) or args.micro % w or not pow2(args.micro)]
    if bad or args.micro < 1 or min(args.batch, args.width, args.depth, args.dim, args.blocks, args.block_steps) < 1:
        ap.error(f"--micro {args.micro} and the world sizes must be powers of two, --micro a multiple of each "
                 f"({bad}); sizes must be >= 1")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(stderr=True)
    load = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_invariant.") as tmp, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console) as progress:
        task = progress.add_task("starting", total=len(worlds) * args.blocks * len(ARMS))
        for w in worlds:
            runs.append(run_world(w, args, progress, task, Path(tmp)))
    p = runs[0]["grad_bytes"]
    doc = {"schema": SCHEMA, "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": load,
                    "loadavg_after": os.getloadavg()},
           "params": runs[0]["params"], "grad_bytes": p, "micro_batches": args.micro, "batch": args.batch,
           "runs": runs,
           "paper": paper(args.paper_world, max(args.paper_world, args.micro), 4 * args.paper_params)}
    table = Table(title=f"world-size-invariant steps, {doc['params'] / 1e6:.2f}M params ({p / 1e6:.1f} MB of "
                        f"gradients), G={args.micro}, b={args.batch}; load {load[0]:.1f} before, "
                        f"{doc['host']['loadavg_after'][0]:.1f} after")
    for col in ("ranks", "mode", "step ms (median)", "step ms (min)", "local ms", "reduce ms", "MB sent/rank",
                "lo MB/rank", "vs off"):
        table.add_column(col, justify="right")
    for r in runs:
        off = r["summary"]["off"]["step_s"]["median"]
        for arm in ARMS:
            s = r["summary"][arm]
            table.add_row(str(r["world"]), arm, f"{s['step_s']['median'] * 1e3:.1f}", f"{s['step_s']['min'] * 1e3:.1f}",
                          f"{s['local_s']['median'] * 1e3:.1f}" if arm != "off" else "-",
                          f"{s['reduce_s']['median'] * 1e3:.1f}" if arm in ("on", "a2a") else "-",
                          f"{s['sent_bytes']['median'] / 1e6:.1f}", f"{s['lo_bytes_per_rank']['median'] / 1e6:.1f}",
                          f"{s['step_s']['median'] / off:.2f}x")
    Console(width=max(Console().width, 120)).print(table)
    pp = doc["paper"]
    gb = pp["grad_bytes"] / 1e9
    console.print(f"on paper, {pp['world']} ranks, G={pp['micro_batches']}, P={gb:.1f} GB of gradients: sent per rank "
                  f"DDP {pp['ddp_ring']['sent'] / 1e9:.1f} GB, on {pp['on']['sent'] / 1e9:.0f} GB "
                  f"({pp['on_over_ddp_bytes']:.0f}x; holds {pp['on']['held_gathered'] / 1e9:.0f} GB), a2a "
                  f"{pp['a2a']['sent'] / 1e9:.1f} GB (holds {pp['a2a']['held_gathered'] / 1e9:.0f} GB)")
    (out / "bench_invariant.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / "bench_invariant.png")
    console.print(f"wrote {out / 'bench_invariant.json'} and {out / 'bench_invariant.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
