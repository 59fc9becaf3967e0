"""Each framework's own resume against ripresa's, on the unchanged example scripts (docs/INTEGRATIONS.md).

For every framework example (``examples/<fw>/train.py``, the CLI contract of
docs/INTEGRATIONS.md) four runs of the same command line:

1. ``--mode none``: uninterrupted, no checkpointing — the reference of 2;
2. ``--mode native``: the framework's own checkpoint and resume, SIGKILLed by
   the script itself right after optimizer step S (``RIPRESA_EXAMPLE_KILL_AFTER=S``,
   mid-epoch, after a checkpoint), then the same command again;
3. ``--mode ripresa`` uninterrupted — the reference of 4: the one line makes
   the loader exact (each sample's randomness seeded from (seed, epoch,
   index)), so it is a different, equally random run than 1;
4. ``--mode ripresa`` killed at S and run again the same way.

The final model tensors of 2 and 4 are compared with their reference bitwise
(tensors differing / total, the largest absolute gap), and so are the values
the framework logged (the last record of each logged step in ``--log``). The
lines a user adds are the example's code lines marked ``# ripresa: the one line``
or ``# ripresa`` (imports apart; :func:`lines_added`).

    .venv/bin/python benchmarks/bench_frameworks.py                       # every example present
    .venv/bin/python benchmarks/bench_frameworks.py --only lightning --max-steps 40 --every 10 --kill-after 25
    .venv/bin/python benchmarks/bench_frameworks.py --script mine=path/to/train.py   # any script with the same CLI
    .venv/bin/python benchmarks/bench_frameworks.py --only accelerate --keep-rows    # re-measure one, keep the others' rows

Writes ``bench_frameworks.json`` and ``bench_frameworks.md`` under ``--out``
(``benchmarks/results/``). Exit 0 when every run completed (whatever the
gaps: this measures, it does not judge), 2 when a run did not behave as the
contract says (no SIGKILL at S, a non-zero exit, no final file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: The examples the other framework pages describe, by the name the table shows.
EXAMPLES = {
    "lightning": "examples/lightning/train.py",
    "hf_trainer": "examples/hf_trainer/train.py",
    "accelerate": "examples/accelerate/train.py",
}
LABELS = {"lightning": "Lightning", "hf_trainer": "HF Trainer", "accelerate": "accelerate"}
#: A trailing comment that marks a line the user added: ``# ripresa`` or ``# ripresa: ...``.
MARKER = re.compile(r"#\s*ripresa\s*(:.*)?")
KILL_ENV = "RIPRESA_EXAMPLE_KILL_AFTER"


class RunFailed(Exception):
    """A run did not do what the CLI contract says."""


@dataclass
class Gap:
    differing: int
    total: int
    max_abs_gap: float
    missing: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"tensors_differing": self.differing, "tensors_total": self.total,
                "max_abs_gap": self.max_abs_gap, "keys_missing_or_extra": self.missing}


def compare_tensors(reference: Path, other: Path) -> Gap:
    """Bitwise comparison of two safetensors files: tensors whose bytes differ, and the largest |a - b|."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(reference)), load_file(str(other))
    missing = sorted(set(a) ^ set(b))
    differing, gap = len(missing), 0.0
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(
            x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8))
        if not same:
            differing += 1
            if x.shape == y.shape and x.is_floating_point() and y.is_floating_point():
                d = (x.double() - y.double()).abs()
                g = float(d.max()) if d.numel() else 0.0
                gap = max(gap, g) if not math.isnan(g) else math.inf
            else:
                gap = math.inf
    return Gap(differing, len(set(a) | set(b)), gap, missing)


def read_log(path: Path) -> dict[int, dict[str, Any]]:
    """The last record of each logged step of a ``--log`` JSONL (a resumed process may log a step again)."""
    out: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line of the killed process
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out[rec["step"]] = rec
    return out


#: Logged values that measure wall-clock time (the HF Trainer's ``train_runtime``, ``train_samples_per_second``,
#: ``train_steps_per_second``): they differ between any two runs, so they are not compared.
TIMING_SUFFIXES = ("_runtime", "_per_second")


def compare_logs(reference: Path, other: Path) -> dict[str, Any]:
    """Whether every logged step's values equal the reference's (exact equality; NaN equals NaN).

    Wall-clock values (:data:`TIMING_SUFFIXES`) are left out and listed under ``not_compared``.
    """
    ref, got = read_log(reference), read_log(other)
    timing = sorted({k for rec in (*ref.values(), *got.values()) for k in rec if k.endswith(TIMING_SUFFIXES)})
    ref = {s: {k: v for k, v in r.items() if k not in timing} for s, r in ref.items()}
    got = {s: {k: v for k, v in r.items() if k not in timing} for s, r in got.items()}

    def same(u: Any, v: Any) -> bool:
        if isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v):
            return True
        return u == v

    differ = []
    for step in sorted(set(ref) | set(got)):
        r, g = ref.get(step), got.get(step)
        if r is None or g is None:
            differ.append({"step": step, "key": None, "reference": r is not None, "resumed": g is not None})
            continue
        for key in sorted(set(r) | set(g)):
            if not same(r.get(key), g.get(key)):
                differ.append({"step": step, "key": key, "reference": r.get(key), "resumed": g.get(key)})
    return {"steps_logged": len(ref), "equal": bool(ref) and not differ, "differences": len(differ),
            "first_difference": differ[0] if differ else None, "not_compared": timing}


def lines_added(script: Path) -> int:
    """Lines the user adds for ripresa: code lines whose trailing comment is a ripresa marker, imports apart.

    The marker is ``# ripresa: the one line`` (Lightning, HF Trainer: a callback) or ``# ripresa``
    (an ``accelerate`` loop has no callbacks: its TrainingState/Checkpointer lines, the resume,
    ``step_done`` and ``close``). ``import`` lines are not counted (each framework needs one), and a
    docstring or comment that merely quotes a marker is not a line of code.
    """
    rows: dict[int, list[tokenize.TokenInfo]] = {}
    with open(script, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            rows.setdefault(tok.start[0], []).append(tok)
    count = 0
    for toks in rows.values():
        marked = any(t.type == tokenize.COMMENT and MARKER.fullmatch(t.string.strip()) for t in toks)
        code = [t for t in toks if t.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER)]
        if marked and code and code[0].string not in ("import", "from"):
            count += 1
    return count


def _run(argv: list[str], *, env: dict[str, str], log: Path, timeout: float) -> int:
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(argv)}  ({', '.join(f'{k}={v}' for k, v in env.items() if k == KILL_ENV)})\n".encode())
        f.flush()
        try:
            proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env={**os.environ, **env}, timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"{argv[1]} {' '.join(argv[2:])} ran past --timeout {timeout:g} s (the hang guard; "
                            f"on a loaded machine raise it; see {log})") from None
    return proc.returncode


def _tail(log: Path, n: int = 12) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_mode(script: Path, mode: str, work: Path, *, python: str, max_steps: int, every: int, kill_after: int | None,
             seed: int, timeout: float) -> dict[str, Any]:
    """One mode of one example: uninterrupted (``kill_after`` None) or killed at S and run again. Returns its files."""
    folder = work / (mode if kill_after is None or mode == "native" else f"{mode}-killed")
    folder.mkdir(parents=True)
    final, logf, out = folder / "final.safetensors", folder / "log.jsonl", folder / "output.log"
    argv = [python, str(script), "--run", str(folder / "run"), "--max-steps", str(max_steps), "--every", str(every),
            "--mode", mode, "--final", str(final), "--log", str(logf), "--seed", str(seed)]
    env = {"PYTHONHASHSEED": "0"}
    t0 = time.perf_counter()
    runs = []
    if kill_after is not None:
        rc = _run(argv, env={**env, KILL_ENV: str(kill_after)}, log=out, timeout=timeout)
        runs.append(rc)
        if rc != -signal.SIGKILL:
            raise RunFailed(f"{script} --mode {mode} with {KILL_ENV}={kill_after} exited {rc}, not by SIGKILL "
                            f"(see {out}):\n{_tail(out)}")
        if final.exists():
            raise RunFailed(f"{script} --mode {mode} wrote --final before its SIGKILL at step {kill_after}")
    rc = _run(argv, env=env, log=out, timeout=timeout)
    runs.append(rc)
    if rc != 0 or not final.is_file():
        raise RunFailed(f"{script} --mode {mode} exited {rc} (final file: {final.is_file()}; see {out}):\n{_tail(out)}")
    return {"final": final, "log": logf, "output": out, "exit_codes": runs, "seconds": time.perf_counter() - t0}


def bench_one(name: str, script: Path, work: Path, *, python: str, max_steps: int, every: int, kill_after: int,
              seed: int, timeout: float, jobs: int, tick: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The four runs of one example (``jobs`` of them at a time); each killed run against its uninterrupted reference."""
    plans = {"none": ("none", None), "native": ("native", kill_after),
             "ripresa-uninterrupted": ("ripresa", None), "ripresa": ("ripresa", kill_after)}
    reference = {"native": "none", "ripresa": "ripresa-uninterrupted"}

    def go(key: str) -> dict[str, Any]:
        mode, kill = plans[key]
        r = run_mode(script, mode, work / name, python=python, max_steps=max_steps, every=every,
                     kill_after=kill, seed=seed, timeout=timeout)
        tick(f"{name}: {key} done")
        return r

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = dict(zip(plans, pool.map(go, plans), strict=True))
    row: dict[str, Any] = {"framework": name, "script": str(script), "lines_added": lines_added(script),
                           "date": time.strftime("%Y-%m-%d"),
                           "seconds": {m: round(r["seconds"], 1) for m, r in results.items()}}
    for mode, ref in reference.items():
        row[mode] = {"reference": ref, **compare_tensors(results[ref]["final"], results[mode]["final"]).as_dict(),
                     "logged": compare_logs(results[ref]["log"], results[mode]["log"])}
    return row


def _gap(v: float) -> str:
    return "0" if v == 0 else "inf" if math.isinf(v) else f"{v:.2g}"


def _logged(row: dict[str, Any], mode: str) -> str:
    lg = row[mode]["logged"]
    if not lg["steps_logged"]:
        return "no log"
    return "equal" if lg["equal"] else f"{lg['differences']} differ"


TABLE_HEAD = ("framework", "its own resume: tensors differing", "max abs gap", "with ripresa: tensors differing",
              "max abs gap", "logged values equal (native / ripresa)", "lines the user adds")


def table_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    out = []
    for r in rows:
        n, p = r["native"], r["ripresa"]
        out.append((LABELS.get(r["framework"], r["framework"]),
                    f"{n['tensors_differing']} / {n['tensors_total']}", _gap(n["max_abs_gap"]),
                    f"{p['tensors_differing']} / {p['tensors_total']}", _gap(p["max_abs_gap"]),
                    f"{_logged(r, 'native')} / {_logged(r, 'ripresa')}", str(r["lines_added"])))
    return out


def markdown(report: dict[str, Any]) -> str:
    rows = table_rows(report["rows"])
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    s = report["settings"]
    dates = {r.get("date", report["date"]) for r in report["rows"]}
    when = (f"Measured {report['date']}" if dates <= {report["date"]} else "Measured " + ", ".join(
        f"{LABELS.get(r['framework'], r['framework'])} {r.get('date', report['date'])}" for r in report["rows"]))
    lines += ["", f"Each example: `--max-steps {s['max_steps']} --every {s['every']} --seed {s['seed']}`; the native "
              f"and ripresa runs SIGKILLed right after step {s['kill_after']} and run again with the same command; "
              f"each compared with the same mode run uninterrupted (native: `--mode none`). {s['versions']}. "
              f"{when} by `benchmarks/bench_frameworks.py`."]
    if report["not_measured"]:
        lines.append(f"Not measured (example missing): {', '.join(report['not_measured'])}.")
    return "\n".join(lines) + "\n"


def _kept_rows(path: Path, rows: list[dict[str, Any]], not_measured: list[str],
               settings: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """``--keep-rows``: the earlier report's rows for the frameworks not measured now, in EXAMPLES order."""
    try:
        old = json.loads(path.read_text())
        same = {k: old["settings"][k] for k in ("max_steps", "every", "kill_after", "seed")}
        kept = [r for r in old["rows"] if isinstance(r, dict) and isinstance(r.get("framework"), str)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"bench_frameworks: --keep-rows: cannot read {path}: {exc}") from None
    if same != {k: settings[k] for k in same}:
        raise SystemExit(f"bench_frameworks: --keep-rows: {path} was measured with {same}, not these settings")
    now = {r["framework"] for r in rows}
    for r in kept:
        r.setdefault("date", old.get("date"))
    merged = [r for r in kept if r["framework"] not in now] + rows
    order = list(EXAMPLES)
    merged.sort(key=lambda r: order.index(r["framework"]) if r["framework"] in order else len(order))
    return merged, [n for n in not_measured if n not in {r["framework"] for r in merged}]


def _versions() -> str:
    out = []
    for mod in ("torch", "lightning", "transformers", "accelerate"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - a framework not installed is simply not named
            pass
    return ", ".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=sorted(EXAMPLES), help="a framework (repeatable; default: every example present)")
    ap.add_argument("--script", action="append", default=[], metavar="NAME=PATH", help="another script with the same CLI")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--kill-after", type=int, default=25, help="SIGKILL right after this optimizer step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="modes run at the same time (default 2)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per process (a hang guard)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (kept); default a temporary one, removed")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--keep-rows", action="store_true",
                    help="keep the rows of the existing --out/bench_frameworks.json for frameworks not run now "
                         "(each row keeps its date; the settings must be the same)")
    args = ap.parse_args(argv)
    if not 0 < args.every <= args.kill_after < args.max_steps:
        ap.error("need 0 < --every <= --kill-after < --max-steps (the kill comes after a checkpoint, before the end)")
    scripts: dict[str, Path] = {}
    not_measured = []
    for name in args.only or sorted(EXAMPLES, key=list(EXAMPLES).index):
        path = REPO / EXAMPLES[name]
        if path.is_file():
            scripts[name] = path
        else:
            not_measured.append(name)
    if args.script and not args.only:
        scripts, not_measured = {}, []
    for spec in args.script:
        name, _, path = spec.partition("=")
        if not name or not path or not Path(path).is_file():
            ap.error(f"--script {spec!r}: need NAME=PATH of an existing script")
        scripts[name] = Path(path).resolve()
    if not scripts:
        print("no example script to run", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_frameworks_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        from rich.console import Console
        from rich.progress import Progress
        from rich.table import Table

        console = Console(quiet=args.quiet)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("runs", total=4 * len(scripts))
            for name, script in scripts.items():
                progress.update(task, description=f"{name}: none, native, ripresa (uninterrupted, killed)")
                rows.append(bench_one(name, script, work, python=args.python, max_steps=args.max_steps, every=args.every,
                                      kill_after=args.kill_after, seed=args.seed, timeout=args.timeout, jobs=args.jobs,
                                      tick=lambda what: progress.update(task, advance=1, description=what)))
    except RunFailed as exc:
        print(f"bench_frameworks: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    settings = {"max_steps": args.max_steps, "every": args.every, "kill_after": args.kill_after,
                "seed": args.seed, "versions": _versions()}
    if args.keep_rows:
        rows, not_measured = _kept_rows(args.out / "bench_frameworks.json", rows, not_measured, settings)
    report = {"schema": "ripresa.bench_frameworks/1", "date": time.strftime("%Y-%m-%d"),
              "settings": settings, "rows": rows, "not_measured": not_measured}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_frameworks.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "bench_frameworks.md").write_text(markdown(report))
    table = Table(*TABLE_HEAD, title="the framework's own resume vs ripresa's (bitwise against an uninterrupted run)")
    for r in table_rows(rows):
        table.add_row(*r)
    console.print(table)
    if not_measured:
        console.print(f"not measured (example missing): {', '.join(not_measured)}")
    console.print(f"wrote {args.out / 'bench_frameworks.json'} and {args.out / 'bench_frameworks.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
