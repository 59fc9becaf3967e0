"""End-to-end cost of ripresa in the ANDREA engine, measured side by side.

    .venv/bin/python benchmarks/bench_engine.py [--configs tiny andrea-12m] [--pairs 3]

1. Checkpoint overhead at the default cadence: the same run (same seed, same
   steps) with checkpoints every 100 steps (asynchronous saves) and with no
   checkpoints at all, alternated A/B, median of the pairs. Wall time is taken
   from the run's own history (first to last step line), so process start-up
   and imports are excluded. Reported with and without the sample audit
   (which the default cadence also runs).
2. History append cost: the mean time of one ``History.step`` append on an
   empty ``.loss.jsonl`` and on one that already holds 200,000 lines.
3. Steps/s of each config on this machine.

Writes ``benchmarks/results/bench_engine.json`` and prints a table.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ripresa.store.history import History, read_history  # noqa: E402

SETTINGS = {
    # steps, extra args: tiny runs its defaults; andrea-12m a short CPU-sized run.
    "tiny": (600, ["--set", "train.batch_size=16"]),
    "andrea-12m": (200, ["--set", "train.batch_size=1"]),
}


def run_once(config: str, steps: int, extra: list[str], every: int, audit: bool, workdir: Path) -> float:
    run = Path(tempfile.mkdtemp(dir=workdir)) / "run"
    cmd = [sys.executable, "-m", "ripresa", "train", "--run", str(run), "--config", config, "--quiet", "--threads", "1",
           "--steps", str(steps), "--every", str(every), *extra] + ([] if audit else ["--no-audit"])
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"train failed: {res.stderr[-2000:]}")
    view = read_history(run / ".loss.jsonl")
    times = [view.steps[s]["time"] for s in sorted(view.steps)]
    # the last step's line is written before its (possible) final checkpoint: add the tail
    # of events after it, so a blocking save at the end would be counted.
    last_event = max((e["time"] for e in view.events), default=times[-1])
    return max(times[-1], last_event) - times[0]


def overhead(config: str, pairs: int, workdir: Path, console: Console) -> dict:
    steps, extra = SETTINGS[config]
    rows = {"none": [], "ckpt": [], "ckpt+audit": []}
    for i in range(pairs):
        order = ["none", "ckpt", "ckpt+audit"] if i % 2 == 0 else ["ckpt+audit", "ckpt", "none"]
        for kind in order:
            every = 0 if kind == "none" else 100
            rows[kind].append(run_once(config, steps, extra, every, audit=kind == "ckpt+audit", workdir=workdir))
            console.print(f"  {config} pair {i + 1}/{pairs} {kind}: {rows[kind][-1]:.2f} s")
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "steps": steps, "samples": rows, "median_s": med,
        "steps_per_s": steps / med["none"],
        "overhead_ckpt_pct": 100 * (med["ckpt"] / med["none"] - 1),
        "overhead_ckpt_audit_pct": 100 * (med["ckpt+audit"] / med["none"] - 1),
    }


def history_append(n_lines: int, appends: int, workdir: Path) -> dict:
    def timed(prefill: int) -> float:
        path = Path(tempfile.mkdtemp(dir=workdir)) / ".loss.jsonl"
        if prefill:
            line = json.dumps({"step": 0, "loss": 3.14159, "lr": 3e-4, "arm": "stdlib-code", "tokens": 16384, "time": 0.0})
            with open(path, "w") as f:
                for s in range(prefill):
                    f.write(line.replace('"step": 0', f'"step": {s}') + "\n")
        h = History(path)
        t0 = time.perf_counter()
        for s in range(appends):
            h.step(prefill + s, loss=3.14159, lr=3e-4, arm="stdlib-code", tokens=16384)
        dt = (time.perf_counter() - t0) / appends
        h.close()
        return dt

    empty, full = [], []
    for i in range(5):
        for kind in (("empty", "full") if i % 2 == 0 else ("full", "empty")):
            (empty if kind == "empty" else full).append(timed(0 if kind == "empty" else n_lines))
    e, f = statistics.median(empty), statistics.median(full)
    return {"lines": n_lines, "appends": appends, "empty_us": e * 1e6, "full_us": f * 1e6, "ratio": f / e}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "andrea-12m"], choices=sorted(SETTINGS))
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "bench_engine.json")
    ap.add_argument("--history-lines", type=int, default=200_000)
    args = ap.parse_args()
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="ripresa-bench-engine-", dir=HERE.parent))
    try:
        result = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
                  "overhead": {}, "history": None}
        for config in args.configs:
            console.print(f"[bold]{config}[/]: checkpoint overhead, {args.pairs} A/B pairs")
            result["overhead"][config] = overhead(config, args.pairs, workdir, console)
        console.print("[bold]history append[/]")
        result["history"] = history_append(args.history_lines, 2000, workdir)
    finally:
        subprocess.run(["rm", "-rf", str(workdir)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    t = Table(title="ripresa in the engine (median of A/B pairs)")
    for c in ("measure", "value", "target", "met"):
        t.add_column(c)
    for config, r in result["overhead"].items():
        t.add_row(f"{config}: steps/s (no checkpoints)", f"{r['steps_per_s']:.2f}", "", "")
        t.add_row(f"{config}: overhead, checkpoints every 100 (async)", f"{r['overhead_ckpt_pct']:+.2f} %", "<= 2 %",
                  "yes" if r["overhead_ckpt_pct"] <= 2 else "NO")
        t.add_row(f"{config}: overhead, checkpoints + sample audit", f"{r['overhead_ckpt_audit_pct']:+.2f} %", "", "")
    h = result["history"]
    t.add_row(f"history append at {h['lines']:,} lines vs 0", f"{h['full_us']:.1f} µs vs {h['empty_us']:.1f} µs = {h['ratio']:.2f}x",
              "<= 1.2x", "yes" if h["ratio"] <= 1.2 else "NO")
    console.print(t)
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
