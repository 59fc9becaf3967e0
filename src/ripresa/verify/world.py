"""A resume across world sizes, proved at tolerance 0 (docs/VERIFY.md, "Across world sizes").

``ripresa verify --world-sizes 2,1,4 --steps 12 --output DIR -- python train.py`` runs the command, unchanged and
steered (:mod:`ripresa.session.steer`), under torchrun (``python -m torch.distributed.run --standalone
--nproc_per_node=W --no-python -- COMMAND``: gloo on CPU), in two lines of fresh process groups:

* ``continuous``: the whole run on the first world size; ``resume-1 … resume-n``: segment k on world size
  ``W_k``, from the previous segment's cut to its own, each a fresh torchrun resuming the previous segment's
  generation (a copy of its run folder). The cuts are evenly spaced: ``k · steps // n``.
* the negative control: ``continuous-without-mode`` and ``negative-1 … negative-n``, the same runs steered with
  ``invariant=False`` — a ``Checkpointer(world_size_invariant=G)`` then reduces the ordinary way, with an
  all-reduce whose order follows the rank count.

What is compared (bitwise by default) is what does not depend on the number of ranks: each step's global loss and
learning rates; the parameters, optimizer state, scheduler, scaler, progress and next learning rates at the start,
at every change (the state saved = the state resumed) and at the end. What a trajectory holds per rank — data
positions, ``Stateful`` objects, random streams, ``loss_per_rank`` — has as many entries as ranks and is not
compared (:data:`NOT_COMPARED`). The verdict passes only when the resumed line agrees with ``continuous`` **and**
the negative line, identical to its own continuous run before the first change, diverges after it. Exit codes as
the four-path protocol: 0 pass, 1 a comparison failed, 2 the verification could not be completed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape as rich_escape

from ..core.identity import versions
from ..errors import BadInput, OutputExists
from ..io.fsio import write_atomic
from ..session.steer import ENV as STEER_ENV
from ..store.history import HISTORY_NAME, read_history
from .compare import Comparison, Difference, compare_trees
from .paths import PathRun, log_tail, run_wave, steered_path
from .state_line import final_state
from .trajectory import read_trajectory
from .verify import CheckResult, PathComparison, Verdict, check_named

#: The most ranks one world size may ask for: a verification starts them all on this host.
MAX_WORLD = 64
#: The most world sizes (segments) one verification may chain.
MAX_SEGMENTS = 16
#: State parts that do not depend on the number of ranks, in the order a divergence is looked for.
STATE_PARTS = ("progress", "parameters", "optimizer", "scheduler", "scaler", "next_lr")
#: Step parts that do not depend on the number of ranks (the loss as the script passes it: the step's global loss;
#: the digest of the whole weights after the step, which names the step where they first differ).
STEP_PARTS = ("loss", "lr", "parameters_sha256")
#: What a trajectory holds per rank: as many entries as ranks, never equal across world sizes.
NOT_COMPARED = {
    "data": "each rank's data position",
    "objects": "each rank's Stateful objects",
    "next_draws": "each rank's random streams",
    "loss_per_rank": "each rank's loss (every step)",
}
#: The two lines of runs: name → whether the steering keeps the mode.
LINES = {"resume": True, "negative": False}
REFERENCES = {"resume": "continuous", "negative": "continuous-without-mode"}
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def parse_world_sizes(text: Any) -> tuple[int, ...]:
    """``"2,1,4"`` → ``(2, 1, 4)``; a BadInput unless it is 2 to :data:`MAX_SEGMENTS` whole numbers from 1 to
    :data:`MAX_WORLD` with at least one change between neighbours."""
    raw = text if isinstance(text, str) else repr(text)
    want = f"2 to {MAX_SEGMENTS} rank counts from 1 to {MAX_WORLD}, comma-separated, with a change (e.g. 2,1,4)"
    parts = [p.strip() for p in raw.split(",")] if len(raw) <= 400 else []
    if not (2 <= len(parts) <= MAX_SEGMENTS) or not all(re.fullmatch(r"[0-9]{1,3}", p) for p in parts):
        raise BadInput("--world-sizes is not a list of rank counts", expected=want, found=repr(raw[:80]),
                       hint="ripresa verify --world-sizes 2,1,4 --steps 12 --output DIR -- python train.py")
    sizes = tuple(int(p) for p in parts)
    bad = [w for w in sizes if not 1 <= w <= MAX_WORLD]
    if bad:
        raise BadInput("--world-sizes asks for a rank count out of range", expected=want, found=f"{bad[0]}",
                       hint=f"every segment starts its ranks on this host: at most {MAX_WORLD}")
    if len(set(sizes)) == 1:
        raise BadInput("--world-sizes never changes the world size", expected=want, found=raw[:80],
                       hint="the four-path protocol (without --world-sizes) verifies a resume on the same world size")
    return sizes


def segment_cuts(steps: int, segments: int) -> list[int]:
    """The cuts between ``segments`` evenly spaced segments of ``steps`` steps (each at least one step)."""
    if type(steps) is not int or not segments <= steps < 2**31:
        raise BadInput("too few steps for the world sizes", expected=f"--steps of at least {segments} (one per segment)",
                       found=f"--steps {steps}")
    return [k * steps // segments for k in range(1, segments)]


def torchrun_argv(command: Sequence[str], world: int) -> list[str]:
    """``command`` run on ``world`` ranks of one host (torchrun ``--no-python``: the command as written, per rank)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "--no-python",
            "--", *command]


def _refuse_launcher(command: Sequence[str]) -> None:
    for tok in command:
        if tok in _LAUNCHERS or Path(tok).name == "torchrun":
            raise BadInput("with --world-sizes the command is the script, not a torchrun launch", found=" ".join(command)[:200],
                           expected="python train.py ARGS (ripresa verify starts torchrun with each world size)",
                           hint="drop the torchrun part: ripresa verify --world-sizes 2,1,4 ... -- python train.py")


def _world_path(name: str, command: Sequence[str], world: int, output: Path, stop_at: int, invariant: bool) -> PathRun:
    """One steered torchrun launch on ``world`` ranks; one intra-op thread per rank unless the environment says
    otherwise (torchrun's own default for several ranks, kept for one: the same arithmetic on every world size)."""
    run = steered_path(name, command, output, stop_at, invariant=invariant)
    run.argv = torchrun_argv(command, world)
    run.env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return run


#: The first line of torchrun's own report on a failed launch (its agent stopping the ranks, then its traceback
#: and summary).
_AGENT_LINE = re.compile(r"^[WEI]\d{4} [0-9:.]+ +\d+ .*torch/distributed/elastic/.*(closing signal|failed \(exitcode)")


def ranks_tail(log: Path, n: int = 15) -> str:
    """The last ``n`` lines the ranks wrote before torchrun's own report of the failure (the reason, not the
    agent's summary); the log's last lines when there is no such report."""
    lines = log_tail(log, 2000).splitlines()
    cut = next((i for i, line in enumerate(lines) if _AGENT_LINE.match(line)), None)
    return "\n".join(lines[:cut][-n:] if cut else lines[-n:])


def _check_reached(run: PathRun, want: int) -> dict[str, Any]:
    """A path exited 0 and its steered Checkpointer stopped at ``want``: its trajectory."""
    summary = run.output / "summary.json"
    how = (f"the launch was: {' '.join(run.argv)} (steered through {STEER_ENV}, which only this verification may "
           "set: fix the script and run ripresa verify again)")
    if run.returncode != 0:
        raise BadInput(f"the {run.name} path failed (exit {run.returncode}); the verification could not be completed",
                       file=run.log, expected="exit code 0", found=f"exit code {run.returncode}; the ranks' last lines:\n{ranks_tail(run.log)}",
                       hint=how[:2000])
    if not os.path.lexists(summary):
        raise BadInput(f"the steered {run.name} path wrote no summary.json", file=summary,
                       expected="a script that builds a ripresa Checkpointer and calls its resume()",
                       found=f"no trajectory; the ranks' last lines:\n{ranks_tail(run.log)}",
                       hint="--world-sizes steers scripts that use ripresa.Checkpointer under torchrun (docs/VERIFY.md)")
    doc = read_trajectory(summary)
    got = (doc.get("final") or {}).get("progress", {}).get("step")
    if got != want:
        raise BadInput(f"the steered {run.name} path stopped at step {got}, not {want}", file=summary,
                       expected=f"the script's loop reaching step {want}", found=f"step {got}",
                       hint="the script's own step count must reach --steps; ripresa verify stops it at each cut")
    return doc


def run_world_paths(command: Sequence[str], *, world_sizes: Sequence[int], steps: int, output: Path,
                    progress_cb=None) -> tuple[dict[str, PathRun], dict[str, dict[str, Any]]]:
    """Run both lines, two launches at a time (the two continuous runs, then segment k of each line): the runs and
    their trajectories. Any launch that fails or stops short ends the verification (BadInput, exit 2)."""
    cuts = segment_cuts(steps, len(world_sizes))
    ends = [*cuts, steps]
    runs: dict[str, PathRun] = {}
    docs: dict[str, dict[str, Any]] = {}
    for line, keep in LINES.items():
        name = REFERENCES[line]
        runs[name] = _world_path(name, command, world_sizes[0], output, steps, keep)
    run_wave(runs, list(REFERENCES.values()), progress_cb)
    for name in REFERENCES.values():
        docs[name] = _check_reached(runs[name], steps)
    for k, (world, end) in enumerate(zip(world_sizes, ends, strict=True), 1):
        wave = []
        for line, keep in LINES.items():
            name = f"{line}-{k}"
            runs[name] = _world_path(name, command, world, output, end, keep)
            if k > 1:
                before = runs[f"{line}-{k - 1}"].output / "run"
                if not before.is_dir():
                    raise BadInput(f"the {line}-{k - 1} path left no run folder", file=before)
                shutil.copytree(before, runs[name].output / "run", symlinks=True)
            wave.append(name)
        run_wave(runs, wave, progress_cb)
        for name in wave:
            docs[name] = _check_reached(runs[name], end)
    return runs, docs


def checkpointer_said(run: PathRun) -> dict[str, Any]:
    """What the launch's own Checkpointer recorded in its history (its ``world_size_invariant`` and
    ``world_size_change`` events, after its ``verify_steered``): the mode it ran in and whether it called its
    resume on another world size exact. A report for the reader; the verdict rests on the comparison alone."""
    said: dict[str, Any] = {"mode": None, "change": None, "why": None}
    try:
        events = read_history(run.output / "run" / HISTORY_NAME).events
    except (BadInput, OSError):
        return said
    mine = False
    for ev in events:
        if ev.get("event") == "verify_steered":
            mine = ev.get("path") == run.name
        elif mine and ev.get("event") == "world_size_invariant":
            said["mode"] = {"micro_batches": ev.get("micro_batches"), "exact": ev.get("exact")}
        elif mine and ev.get("event") == "world_size_change":
            said["change"], said["why"] = ev.get("trajectory"), ev.get("why")
    return said


def _where(step: int, world: int) -> str:
    return f"step {step} on {world} rank{'s' if world != 1 else ''}"


def compare_line(reference: dict[str, Any], segments: Sequence[dict[str, Any]], world_sizes: Sequence[int],
                 cuts: Sequence[int], steps: int, *, atol: float, rtol: float = 0.0) -> tuple[PathComparison, CheckResult]:
    """One line of segments against its continuous run: (every check, the checks up to the first cut alone).

    At the start, segment 1 against the reference; at each change, what the next segment holds before its first
    step against what the previous one saved; each step's :data:`STEP_PARTS` against the reference's; at the end,
    the last segment's state against the reference's. Only the parts that do not depend on the rank count.
    """
    checks: dict[str, CheckResult] = {}
    before = CheckResult("identical before the first change")
    first: str | None = None

    def note(check: str, where: str, cmp: Comparison, *, early: bool = False) -> None:
        nonlocal first
        check_named(checks, check).add(where, cmp)
        if early:
            before.add(f"{check} {where}", cmp)
        if first is None and cmp.differences:
            first = f"{check} {where}: {cmp.differences[0].describe()}"

    def state(part: str, a: dict[str, Any], b: dict[str, Any], where: str, early: bool = False) -> None:
        note(part, where, compare_trees(a.get(part), b.get(part), atol=atol, rtol=rtol, path=part), early=early)

    for part in STATE_PARTS:
        state(part, reference["start"], segments[0]["start"], "at the start", early=True)
    ref_steps = {s["step"]: s for s in reference["steps"]}
    lo = 0
    for k, (seg, world) in enumerate(zip(segments, world_sizes, strict=True)):
        hi = cuts[k] if k < len(cuts) else steps
        if k:
            where = f"at the change {world_sizes[k - 1]} → {world} ranks (step {lo})"
            for part in STATE_PARTS:
                state(part, segments[k - 1]["final"], seg["start"], where)
        ran = set()
        for s in seg["steps"]:
            n = s["step"]
            ran.add(n)
            ref = ref_steps.get(n)
            if ref is None or not lo < n <= hi:
                note("progress", _where(n, world), Comparison(differences=[
                    Difference(f"step {n}", "structure", f"steps {lo + 1}..{hi} in this segment", "present")]))
                continue
            for part in STEP_PARTS:
                note(part, _where(n, world), compare_trees(ref.get(part), s.get(part), atol=atol, rtol=rtol, path=part),
                     early=k == 0)
        missing = [n for n in range(lo + 1, hi + 1) if n not in ran]
        if missing:
            note("progress", f"segment {k + 1}", Comparison(differences=[
                Difference("steps", "structure", f"steps {missing[:5]} planned", "not run")]), early=k == 0)
        lo = hi
    for part in (*STATE_PARTS, "evaluation"):
        state(part, reference["final"], segments[-1]["final"], "at the end")
    return PathComparison(checks, first), before


def _row(reference: dict[str, Any], last: dict[str, Any], cmp: PathComparison) -> dict[str, Any]:
    a = (reference["final"].get("evaluation") or {}).get("last_loss")
    b = (last["final"].get("evaluation") or {}).get("last_loss")
    gap = None
    if isinstance(a, int | float) and isinstance(b, int | float):
        gap = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
    return {"max_weight_gap": cmp.checks["parameters"].max_abs_gap if "parameters" in cmp.checks else None,
            "max_optimizer_gap": cmp.checks["optimizer"].max_abs_gap if "optimizer" in cmp.checks else None,
            "final_loss": b, "continuous_final_loss": a, "loss_gap": gap, "agrees": cmp.agrees,
            "first_divergence": cmp.first_divergence}


def verify_world(command: Sequence[str], *, output: str | Path, world_sizes: Sequence[int] | str, steps: int = 12,
                 atol: float = 0.0, rtol: float = 0.0, show_progress: bool = True) -> Verdict:
    """Verify that ``command`` resumed across ``world_sizes`` ends as it would have uninterrupted on the first
    (docs/VERIFY.md, "Across world sizes"); write ``verification.json`` into the new folder ``output``."""
    output = Path(output)
    sizes = parse_world_sizes(world_sizes) if isinstance(world_sizes, str) else parse_world_sizes(",".join(map(str, world_sizes)))
    cuts = segment_cuts(steps, len(sizes))
    if atol < 0 or rtol < 0 or not math.isfinite(atol) or not math.isfinite(rtol):
        raise BadInput("tolerances must be finite and non-negative", found=f"atol={atol}, rtol={rtol}")
    if not command:
        raise BadInput("no trainer command given", hint="ripresa verify --world-sizes 2,1,4 --output DIR -- python train.py")
    _refuse_launcher(command)
    if os.path.lexists(output):
        raise OutputExists("the verification output folder already exists", file=output,
                           expected="a folder that does not exist yet", found="an existing path",
                           hint="choose a new folder: a verification never overwrites an earlier one")
    output.mkdir(parents=True)
    t0 = time.perf_counter()
    runs, docs = _run_with_progress(command, sizes, steps, output, show_progress)
    lines = {}
    for line in LINES:
        segs = [docs[f"{line}-{k}"] for k in range(1, len(sizes) + 1)]
        lines[line] = compare_line(docs[REFERENCES[line]], segs, sizes, cuts, steps, atol=atol, rtol=rtol)
    (positive, _), (negative, negative_before) = lines["resume"], lines["negative"]
    negative_diverged = not negative.agrees
    report = {
        "kind": "world-sizes",
        "all_checks_passed": positive.agrees and negative_diverged and negative_before.passed,
        "positive": positive.agrees,
        "negative_divergence_detected": negative_diverged,
        "negative_identical_before_first_change": negative_before.passed,
        "world_sizes": list(sizes),
        "cuts": cuts,
        "steps": steps,
        "tolerance": {"absolute": atol, "relative": rtol},
        "command": list(command),
        "mode": "steered",
        "compared": {"every step": list(STEP_PARTS), "at the start, each change and the end": list(STATE_PARTS),
                     "at the end": ["evaluation"]},
        "not_compared": NOT_COMPARED,
        "checks": {line: [c.as_dict() for c in cmp.checks.values()] for line, (cmp, _) in lines.items()},
        "negative_before_first_change": negative_before.as_dict(),
        "first_divergence": {line: cmp.first_divergence for line, (cmp, _) in lines.items()},
        "checkpointer_said": {line: [checkpointer_said(runs[f"{line}-{k}"]) for k in range(1, len(sizes) + 1)]
                              for line in LINES},
        "table": {line: _row(docs[REFERENCES[line]], docs[f"{line}-{len(sizes)}"], cmp) for line, (cmp, _) in lines.items()},
        "paths": {name: {"argv": r.argv, "returncode": r.returncode, "seconds": round(r.seconds, 3), "output": str(r.output),
                         "log": str(r.log), "steering": r.env.get(STEER_ENV)} for name, r in runs.items()},
        "seconds": round(time.perf_counter() - t0, 3),
        "versions": versions(),
    }
    # the one line on the final state: the uninterrupted run's last generation against the last segment's
    report["final_state"] = final_state(runs[REFERENCES["resume"]].output / "run",
                                        runs[f"resume-{len(sizes)}"].output / "run",
                                        skip_parts=("rng", "data", "objects"))  # one per rank: not compared
    write_atomic(output / "verification.json", [json.dumps(report, indent=2, default=str).encode()])
    return Verdict(report)


def _run_with_progress(command, sizes, steps, output, show):
    """:func:`run_world_paths` under a progress line (a TTY only): launches done of the ``2 + 2n`` planned."""
    from ..console import progress

    total = 2 + 2 * len(sizes)
    done: list[str] = []
    with progress(quiet=not show, transient=False) as bar:
        task = bar.add_task(f"verify across {' → '.join(map(str, sizes))} ranks: continuous ∥ without the mode",
                            total=total, unit="launches")

        def cb(name: str, rc: int) -> None:
            if name not in done:
                done.append(name)
            bar.update(task, completed=len(done), description=f"verify across world sizes: {name} done (exit {rc})")

        return run_world_paths(command, world_sizes=sizes, steps=steps, output=output, progress_cb=cb)


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "0" if v == 0 else repr(v)
    return str(v)


def render_world_verdict(verdict: Verdict, console=None) -> None:
    """Print the verdict of a verification across world sizes: gaps and verdict per line, what was compared."""
    from rich.table import Table

    from ..console import joined
    from ..text import safe_console

    console = console or safe_console()
    r = verdict.report
    t = r["table"]
    sizes = " → ".join(map(str, r["world_sizes"]))
    tol = r["tolerance"]["absolute"]
    table = Table(title=f"resume across world sizes {sizes} — {r['steps']} steps, cuts at {joined(map(str, r['cuts']))}, "
                        f"tolerance abs {tol:g} rel {r['tolerance']['relative']:g}")
    table.add_column("comparison with the continuous run", overflow="fold")
    table.add_column("resumed", justify="right", no_wrap=True)
    table.add_column("resumed, steered without the mode", justify="right", no_wrap=True)
    pos, neg = t["resume"], t["negative"]
    table.add_row("max weight gap", _fmt(pos["max_weight_gap"]), _fmt(neg["max_weight_gap"]))
    table.add_row("max optimizer-state gap", _fmt(pos["max_optimizer_gap"]), _fmt(neg["max_optimizer_gap"]))
    table.add_row("final loss", _fmt(pos["final_loss"]), _fmt(neg["final_loss"]))
    table.add_row("loss gap", _fmt(pos["loss_gap"]), _fmt(neg["loss_gap"]))
    table.add_row("verdict", f"agrees within {tol:g}" if pos["agrees"] else "[red]DIVERGES[/]",
                  "divergence detected" if not neg["agrees"] else "[red]no divergence (check is blind)[/]")
    console.print(table)
    console.print(f"compared: every step's {joined(r['compared']['every step'])}; "
                  f"{joined(r['compared']['at the start, each change and the end'])} at the start, at each change "
                  "and at the end")
    console.print(f"not compared (one per rank, as many as ranks): {joined(r['not_compared'].values())}")
    if r.get("final_state"):
        same = r["final_state"]["same"]
        color = "green" if same else "red" if same is False else "yellow"
        console.print(f"[{color}]{rich_escape(r['final_state']['line'])}[/]")
    said = r["checkpointer_said"]["resume"][1:]  # segment 2 on: each began with a change
    if said:
        from rich.markup import escape

        console.print("the resumed run's Checkpointer at each change: " + escape(joined(
            f"{s['change'] or 'no world-size change recorded'}" + (f" ({s['why']})" if s.get("why") else "") for s in said)))
    if not pos["agrees"]:
        console.print(f"[red]first divergence of the resumed run:[/] {r['first_divergence']['resume']}")
    if neg["first_divergence"]:
        console.print(f"first divergence without the mode (the negative control): {r['first_divergence']['negative']}")
    if not r["negative_identical_before_first_change"]:
        console.print("[red]without the mode the run already differs before the first change:[/] "
                      f"{r['negative_before_first_change']['first_problem']}")
    console.print(
        f"all_checks_passed: {str(r['all_checks_passed']).lower()}  positive: {str(r['positive']).lower()}  "
        f"negative_divergence_detected: {str(r['negative_divergence_detected']).lower()}"
    )
