#!/usr/bin/env python
"""The live probe's cost in a real training loop (issue 33, item 3): ``probe_every`` = 1, 10 and 100.

    .venv/bin/python benchmarks/bench_probe.py                         # andrea-12m, 3 pairs, ~10 min on 2 busy cores
    .venv/bin/python benchmarks/bench_probe.py --size tiny --pairs 1 --every 5   # a minute

One process, the engine's GPT (``--size``) with ``torch.optim.AdamW`` trained for real on ``--batch`` ×
``--seq`` random bytes (drawn from a generator the ``TrainingState`` saves), checkpointing every ``--every``
steps (asynchronous, as by default). Two arms, in alternating blocks (``off`` first in even pairs):

* ``off``: ``Checkpointer(every=E)``;
* ``probe``: ``Checkpointer(every=E, probe_every=1)``: the generation of step E is replayed by a side
  process — this script started again with ``--replay``, at nice 10, competing with the loop for the
  machine's cores — and compared bitwise at a later ``step_done``.

Each block is a fresh run folder: E steps to the probed generation, then steps until the probe has
answered (``probe``; one probe a block) or 2E - 1 in all (``off``); the first step is not counted. The cost of one probe is the
``probe`` block's time minus its steps at the ``off`` median step time (its pair's, and over all pairs);
the loop's overhead at ``probe_every=k`` is that cost over the k × E steps between two probes (the
generations a probe skips cost nothing: the session only counts them). The loop's own share of it — the
digests' copies on the loop, the start of the side process, the polls — is ``step_done``'s extra time;
the rest is the two cores shared with the side process and the digest thread. Before each block the
benchmark waits (``--quiet-timeout``) for other processes to leave the CPU and records the share they took.

Prints a table and writes ``benchmarks/results/bench_probe_<size>.json``; benchmarks/README.md, "The live probe".
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO / "src") not in sys.path:  # run from a checkout without `pip install -e`
    sys.path.insert(0, str(REPO / "src"))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import json  # noqa: E402

import torch  # noqa: E402
from bench_memory import SIZES, CpuShare, Loop, machine, stats  # noqa: E402

from ripresa import Checkpointer, RandomStreams, TrainingState  # noqa: E402

SCHEMA = "ripresa-bench-probe/1"
GOAL_OVERHEAD_PCT_AT_10 = 1.0
KS = (1, 10, 100)


def build(a: argparse.Namespace) -> tuple[Loop, TrainingState]:
    torch.set_num_threads(a.threads)
    loop = Loop(SIZES[a.size], a.batch, a.seq, seed=a.seed)
    state = TrainingState(loop.model, loop.opt, rng=RandomStreams(torch_generators={"data": loop.gen}),
                          config={"benchmark": "bench_probe", "size": a.size})
    return loop, state


def replay(a: argparse.Namespace) -> int:
    """The probe's side process: the same state, a Checkpointer (steered by RIPRESA_PROBE), the loop."""
    loop, state = build(a)
    ck = Checkpointer(a.dir or tempfile.gettempdir(), state, every=a.every, handle_signals=False)
    start = ck.resume()
    for s in range(start + 1, start + 10):
        loop.step(ck, s, None)  # step_done of the replayed step writes the result and exits
    return 3


def block(a: argparse.Namespace, loop: Loop, state: TrainingState, folder: Path, arm: str, command: list[str]
          ) -> dict[str, Any]:
    """One block of ``arm`` in a fresh run folder; its step times and what the probe did."""
    # the first generation is probed; probe_every=10**6: no second one in the block (one probe measured per block)
    ck = Checkpointer(folder, state, every=a.every, probe_every=10**6 if arm == "probe" else 0, probe_command=command,
                      handle_signals=False, fresh=True, save_on_close=False)
    ck.resume()
    rec: dict[str, list[float]] = {"iter_s": [], "fwd_bwd_s": [], "opt_s": [], "step_done_s": []}
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    share = CpuShare()
    share.start()
    t0 = time.perf_counter()
    step = 0
    while True:
        step += 1
        loop.step(ck, step, rec)
        if arm == "off":
            if step >= 2 * a.every - 1:
                break
            continue
        if step > a.every + 1 and (ck.probe is None or ck.probe.current is None or step >= 20 * a.every):
            break  # the probe of generation E has answered
    wall = time.perf_counter() - t0
    others = share.stop()
    probe = ck.probe
    ck.close()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    counted = rec["iter_s"][1:]
    out: dict[str, Any] = {
        "arm": arm, "steps": step, "counted_s": sum(counted), "wall_s": wall, "others_cpu_share": others,
        "iter": stats(counted), "step_done": stats(rec["step_done_s"][1:]),
        "child_cpu_s": (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime),
    }
    if probe is not None:
        out.update(probes=probe.probed, confirmed=probe.confirmed, mismatches=len(probe.mismatches), off=probe.off)
    shutil.rmtree(folder, ignore_errors=True)
    return out


def run(a: argparse.Namespace, console: Any) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    loop, state = build(a)
    scratch = Path(tempfile.mkdtemp(prefix="ripresa-bench-probe-", dir=a.dir))
    command = [sys.executable, str(Path(__file__).resolve()), "--replay", "--size", a.size, "--batch", str(a.batch),
               "--seq", str(a.seq), "--every", str(a.every), "--threads", str(a.threads), "--seed", str(a.seed),
               "--dir", str(scratch / "replay")]
    load0 = os.getloadavg()
    t_start = time.time()
    pairs: list[dict[str, Any]] = []
    share = CpuShare()
    try:
        for s in range(1, 3):  # warm-up: AdamW's moments exist, the allocator is warm
            loop.step(None, s, None)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=False, disable=not console.is_terminal) as prog:
            task = prog.add_task("blocks", total=2 * a.pairs)
            n = 0
            for i in range(a.pairs):
                pair: dict[str, Any] = {}
                for arm in (("off", "probe") if i % 2 == 0 else ("probe", "off")):
                    waited, _ = share.wait_quiet(a.quiet_timeout, a.quiet_share)
                    n += 1
                    pair[arm] = {**block(a, loop, state, scratch / f"{arm}{n}", arm, command), "quiet_wait_s": waited}
                    prog.update(task, advance=1, description=f"pair {i + 1}/{a.pairs}: {arm} "
                                f"{pair[arm]['iter']['median']:.3f} s/step")
                    if not console.is_terminal:
                        console.print(f"  pair {i + 1} {arm}: {pair[arm]['steps']} steps, "
                                      f"median {pair[arm]['iter']['median']:.4f} s/step, others "
                                      f"{(pair[arm]['others_cpu_share'] or 0):.0%}")
                pairs.append(pair)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summarize(a, pairs, load0, t_start)


def summarize(a: argparse.Namespace, pairs: list[dict[str, Any]], load0: Any, t_start: float) -> dict[str, Any]:
    off_median = statistics.median(x for p in pairs for x in p["off"]["iter"]["samples"])
    costs, own, per_pair = [], [], []
    for p in pairs:
        pr, off = p["probe"], p["off"]
        cost = pr["counted_s"] - (pr["steps"] - 1) * off_median
        costs.append(cost)
        own.append(sum(pr["step_done"]["samples"]) - (pr["steps"] - 1) * (off["step_done"]["median"] or 0))
        pair_cost = pr["counted_s"] - (pr["steps"] - 1) * off["iter"]["median"]
        per_pair.append(pair_cost)
    step = off_median
    overhead = {str(k): {"median_pct": 100 * statistics.median(costs) / (k * a.every * step),
                         "min_pct": 100 * min(costs) / (k * a.every * step),
                         "min_pair_pct": 100 * min(per_pair) / (k * a.every * step),
                         "loop_share_pct": 100 * statistics.median(own) / (k * a.every * step)} for k in KS}
    return {
        "schema": SCHEMA,
        "machine": {**machine(), "loadavg_before": load0, "loadavg_after": os.getloadavg(),
                    "wall_s": time.time() - t_start},
        "config": {"size": a.size, "batch": a.batch, "seq": a.seq, "every": a.every, "pairs": a.pairs,
                   "threads": a.threads, "quiet_timeout": a.quiet_timeout, "quiet_share": a.quiet_share},
        "off_step_s": {"median": off_median,
                       "min": min(x for p in pairs for x in p["off"]["iter"]["samples"])},
        "probe_cost_s": {"median": statistics.median(costs), "min": min(costs), "samples": costs,
                         "per_pair": per_pair},
        "loop_share_s": {"median": statistics.median(own), "min": min(own), "samples": own},
        "child": {"cpu_s": stats([p["probe"]["child_cpu_s"] for p in pairs]),
                  "confirmed": [p["probe"].get("confirmed") for p in pairs],
                  "mismatches": sum(p["probe"].get("mismatches", 0) for p in pairs)},
        "overhead": overhead,
        "goal_pct_at_10": GOAL_OVERHEAD_PCT_AT_10,
        "pairs": pairs,
    }


def report(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    c = doc["config"]
    t = Table(title=f"the live probe on {c['size']} (batch {c['batch']} × {c['seq']}, checkpoint every {c['every']} "
                    f"steps, {c['threads']} thread(s), {doc['machine']['cpus']} cores)")
    for col in ("probe_every", "probes per step", "overhead median", "overhead min", "of it on the loop"):
        t.add_column(col, justify="right")
    for k in KS:
        o = doc["overhead"][str(k)]
        t.add_row(str(k), f"1 / {k * c['every']}", f"{o['median_pct']:.2f} %", f"{o['min_pct']:.2f} %",
                  f"{o['loop_share_pct']:.2f} %")
    console.print(t)
    pc = doc["probe_cost_s"]
    console.print(f"one probe costs the loop {pc['median']:.2f} s (median; min {pc['min']:.2f} s) at "
                  f"{doc['off_step_s']['median']:.3f} s/step; its side process used {doc['child']['cpu_s']['median']:.1f} "
                  f"CPU s; confirmed {doc['child']['confirmed']}, mismatches {doc['child']['mismatches']}; "
                  f"load {doc['machine']['loadavg_before'][0]:.1f} before, {doc['machine']['loadavg_after'][0]:.1f} after")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="12m", help="the engine's GPT: tiny, 12m or 120m")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    ap.add_argument("--every", type=int, default=20, help="checkpoint cadence in steps (each block probes one)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of the loop")
    ap.add_argument("--pairs", type=int, default=3, help="pairs of blocks (off, probe), alternating their order")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-timeout", type=float, default=20.0,
                    help="before each block, wait up to S seconds for other processes to leave the CPU (0: never)")
    ap.add_argument("--quiet-share", type=float, default=0.10, help="the share of the CPU others may use")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: the system's temporary folder)")
    ap.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)  # the probe's side process
    a = ap.parse_args()
    if a.replay:
        return replay(a)
    if a.every < 2 or a.pairs < 1 or a.batch < 1 or a.seq < 1 or a.threads < 1:
        ap.error("need --every >= 2, --pairs/--batch/--seq/--threads >= 1")
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 110)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the finally blocks clean up
    a.out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        doc = run(a, console)
    path = a.out / f"bench_probe_{a.size}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    report(doc, console)
    console.print(f"wrote {path} ({doc['machine']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
