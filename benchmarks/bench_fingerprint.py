"""The state fingerprint against the parallel hash floor (docs/INSPECT.md, "The state fingerprint").

One state (weights + AdamW moments, 12 bytes a parameter) is written as a general ``.safetensors`` generation, an
ANDREA ``.bin`` and a ``.shards`` folder; then, alternating in one process, for each layout:

* ``floor``: the same files' bytes read in the fingerprint's blocks (``pread``) and hashed with sha256 over the
  same number of threads — what any parallel hash of those bytes costs;
* ``fingerprint``: ``fingerprint_path`` of the generation (headers, companion, canonical names, Merkle tree).

and in memory: ``fingerprint_state`` of the live tensors against sha256 of their bytes over the same threads (what
the probe and ``verify`` pay). Prints median and minimum of each, their ratios, and the median of the ratios of
each pair (the two samples of a pair run back to back: the figure least moved by other processes' load); writes
JSON and a PNG.

    .venv/bin/python benchmarks/bench_fingerprint.py                   # 25M parameters (300 MB), 7 pairs
    .venv/bin/python benchmarks/bench_fingerprint.py --params 12800000 --threads 2 --pairs 9
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import ripresa
from ripresa.formats.fingerprint import fingerprint_state, live_items
from ripresa.formats.fingerprint_read import fingerprint_path
from ripresa.io.merkle import BLOCK, default_threads


def build_state(n_params: int, width: int = 1024) -> ripresa.TrainingState:
    """Square linear layers of ``width`` totalling about ``n_params`` parameters, AdamW after one step."""
    torch.manual_seed(0)
    layers = max(1, n_params // (width * width + width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return ripresa.TrainingState(model=model, optimizer=opt)


def floor_files(paths: list[Path], threads: int) -> float:
    """Seconds to read ``paths`` in BLOCK pieces and sha256 each piece, over ``threads`` threads."""
    tasks = []
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        for fd in fds:
            size = os.fstat(fd).st_size
            tasks += [(fd, off, min(BLOCK, size - off)) for off in range(0, size, BLOCK)]

        def one(task: tuple[int, int, int]) -> bytes:
            fd, off, n = task
            buf = bytearray(n)
            os.preadv(fd, [buf], off)
            return hashlib.sha256(buf).digest()

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, tasks))
        return time.perf_counter() - t
    finally:
        for fd in fds:
            os.close(fd)


def floor_memory(state: ripresa.TrainingState, threads: int) -> float:
    """Seconds to sha256 the live tensors' bytes in BLOCK pieces over ``threads`` threads."""
    views = []
    for t in [*state.model.state_dict().values(),
              *(v for s in state.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]:
        raw = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
        views += [raw[off:off + BLOCK] for off in range(0, raw.nbytes, BLOCK)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda v: hashlib.sha256(v).digest(), views))
    return time.perf_counter() - t0


def files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file())
    if path.suffix == ".bin":
        return [path, path.with_name(path.stem + ".json")]
    return [path, path.with_name(path.name + ".json")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=25_000_000)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024, help="layer width: tensors of width^2 elements")
    ap.add_argument("--dcp", action="store_true", help="also a .dcp (loaded into memory before it is hashed)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench_fp_", dir=args.dir))
    try:
        state = build_state(args.params, args.width)
        n = sum(p.numel() for p in state.model.parameters())
        gens = {}
        for name, kw in [("general", dict(format="general", shard_threshold=None)), ("bin", dict(format="andrea")),
                         (f"shards{args.shards}", dict(shard_threshold=1, shards=args.shards))]:
            with ripresa.Checkpointer(scratch / name, state, every=1, asynchronous=False, handle_signals=False,
                                      save_on_close=False, **kw) as ck:
                ck.step_done(1)
            gens[name] = next(p for p in (scratch / name).iterdir()
                              if p.name.startswith("step_") and p.suffix in (".safetensors", ".bin", ".shards"))
        if args.dcp:  # a .dcp written in this process (one rank), as an FSDP2 session commits it
            from ripresa.core.state import Progress
            from ripresa.formats import dcp as dcp_fmt
            from ripresa.store import dcp as store_dcp
            from ripresa.store.restore import rest_proxy

            (scratch / "dcp").mkdir()
            part = dcp_fmt.partial_path(scratch / "dcp", 1)
            dcp_fmt.save_shards(state.model, state.optimizer, part, no_dist=True)
            rest = rest_proxy(state).snapshot(Progress(step=1), None, include_parameters=False)
            gens["dcp"] = store_dcp.commit_dcp(scratch / "dcp", 1, part, world_size=1, n_params=n, state=rest,
                                               hmac_key=None).path
        roots = {name: fingerprint_path(p, threads=args.threads).root for name, p in gens.items()}  # also warms the cache
        results: dict[str, dict[str, list[float]]] = {k: {"floor": [], "fingerprint": []} for k in [*gens, "memory"]}
        for i in range(args.pairs):
            for name, p in gens.items():
                order = ("floor", "fingerprint") if i % 2 == 0 else ("fingerprint", "floor")  # alternate
                for what in order:
                    if what == "floor":
                        results[name]["floor"].append(floor_files(files_of(p), args.threads))
                    else:
                        t = time.perf_counter()
                        fingerprint_path(p, threads=args.threads)
                        results[name]["fingerprint"].append(time.perf_counter() - t)
            for what in (("floor", "fingerprint") if i % 2 == 0 else ("fingerprint", "floor")):
                if what == "floor":
                    results["memory"]["floor"].append(floor_memory(state, args.threads))
                else:
                    t = time.perf_counter()
                    fingerprint_state(live_items(state.model, state.optimizer), threads=args.threads)
                    results["memory"]["fingerprint"].append(time.perf_counter() - t)
        summary = {}
        print(f"{n:,} parameters ({12 * n / 1e6:.0f} MB of weights and moments), {args.threads} threads, "
              f"{args.pairs} pairs, load {os.getloadavg()[0]:.2f}")
        print(f"{'layout':<10} {'floor med':>10} {'fp med':>10} {'floor min':>10} {'fp min':>10} {'ratio med':>10} {'ratio min':>10} {'paired med':>10}")
        for name, r in results.items():
            fm, pm = statistics.median(r["floor"]), statistics.median(r["fingerprint"])
            fn, pn = min(r["floor"]), min(r["fingerprint"])
            paired = statistics.median(b / a for a, b in zip(r["floor"], r["fingerprint"], strict=True))
            summary[name] = {"floor_median_s": fm, "fingerprint_median_s": pm, "floor_min_s": fn, "fingerprint_min_s": pn,
                             "ratio_median": pm / fm, "ratio_min": pn / fn, "ratio_paired_median": paired, "samples": r}
            print(f"{name:<10} {fm:>10.3f} {pm:>10.3f} {fn:>10.3f} {pn:>10.3f} {pm / fm:>10.3f} {pn / fn:>10.3f} "
                  f"{paired:>10.3f}")
        same = len({r for k, r in roots.items() if k != "dcp"}) == 1  # a .dcp's companion holds another progress
        print(f"one root for every layout: {same} ({next(iter(roots.values()))[:16]}...)")
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"bench_fingerprint_{args.params}_t{args.threads}{'' if args.width == 1024 else f'_w{args.width}'}"
        doc = {"params": n, "bytes": 12 * n, "width": args.width, "threads": args.threads, "pairs": args.pairs, "block": BLOCK,
               "load_before": os.getloadavg(), "cpus": os.cpu_count(), "same_root": same, "results": summary,
               "command": " ".join([Path(sys.executable).name, *sys.argv])}
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=2))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            names = list(summary)
            x = range(len(names))
            fig, ax = plt.subplots(figsize=(7, 3.5))
            ax.bar([i - 0.2 for i in x], [summary[k]["floor_median_s"] for k in names], 0.4, label="sha256 floor (median)")
            ax.bar([i + 0.2 for i in x], [summary[k]["fingerprint_median_s"] for k in names], 0.4, label="fingerprint (median)")
            for i, k in enumerate(names):
                ax.text(i + 0.2, summary[k]["fingerprint_median_s"], f"{summary[k]['ratio_median']:.2f}x", ha="center",
                        va="bottom", fontsize=8)
            ax.set_xticks(list(x), names)
            ax.set_ylabel("seconds")
            ax.set_title(f"fingerprint vs parallel sha256 floor: {12 * n / 1e6:.0f} MB, {args.threads} threads")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(stem.with_suffix(".png"), dpi=110)
        except ImportError:
            pass
        print(f"wrote {stem.with_suffix('.json')}")
        return 0 if same else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
