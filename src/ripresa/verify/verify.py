"""The resume verification protocol (docs/VERIFY.md): four fresh processes, compared, one verdict.

The paths (continuous, interrupted at the cut, full resume, resume without RNG) run in :mod:`ripresa.verify.paths`;
this module compares them step by step and at the end (:func:`compare_resumed`, :func:`compare_prefix`, with
:mod:`ripresa.verify.compare`), writes ``verification.json`` and renders the verdict. The verdict passes only when
the full resume agrees within the tolerance **and** the negative case diverges; exit codes 0 pass, 1 a comparison
failed, 2 the verification could not be completed.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape as rich_escape

from ..core.identity import versions
from ..errors import BadInput, OutputExists
from ..io.fsio import write_atomic
from ..session.steer import ENV as STEER_ENV
from .compare import Comparison, Tally, compare_trees
from .paths import MODES, REFERENCE, PathRuns, log_tail, run_paths
from .paths import (
    reference_exercise_command as reference_exercise_command,  # re-exported (cli, engine.demo)
)
from .paths import saved_checkpoint as saved_checkpoint  # re-exported (tests)
from .state_line import final_state
from .trajectory import read_trajectory

PATHS = ("continuous", "interrupted", "resume", "resume-without-rng")
#: Parts of a state block, in the order a divergence is looked for.
STATE_PARTS = ("progress", "data", "parameters", "optimizer", "scheduler", "scaler", "objects", "next_lr", "next_draws")
STEP_PARTS = ("rows", "lr", "loss")
#: Step parts compared only when a trajectory records them (a steered Checkpointer records the data position).
OPTIONAL_STEP_PARTS = ("data", "loss_per_rank")


def _step_parts(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, ...]:
    return STEP_PARTS + tuple(p for p in OPTIONAL_STEP_PARTS if p in a or p in b)


def streams_not_used(continuous: dict[str, Any], interrupted: dict[str, Any]) -> list[str]:
    """The random streams the command never seeds (docs/VERIFY.md, "not used").

    The two reference paths are fresh processes at the same point (step 0,
    before their first step): a stream whose next draw differs there is seeded
    from the operating system's entropy, so the run cannot depend on it
    reproducibly. It is reported as not used and left out of the ``next_draws``
    comparisons; if the run did draw from it, the losses already differ before
    the cut and the determinism check fails the verdict.
    """
    a = continuous["start"].get("next_draws") or {}
    b = interrupted["start"].get("next_draws") or {}
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return []
    return sorted(k for k in set(a) & set(b) if a[k] != b[k])


def _without_streams(doc: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    out = dict(doc)
    for block in ("start", "final"):
        b = dict(out[block])
        if isinstance(b.get("next_draws"), dict):
            b["next_draws"] = {k: v for k, v in b["next_draws"].items() if k not in names}
        out[block] = b
    return out


@dataclass
class CheckResult(Tally):
    """One named check (e.g. ``parameters``) of one path against the reference."""

    name: str
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def add(self, where: str, cmp: Comparison) -> None:
        self.count(cmp)
        self.problems.extend(f"{where}: {d.describe()}" for d in cmp.differences)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "max_abs_gap": self.max_abs_gap,
            "values_compared": self.compared,
            "first_problem": self.problems[0] if self.problems else None,
            "problems": self.problems[:20],
            "problem_count": len(self.problems),
        }


@dataclass
class PathComparison:
    """All checks of one resumed path (full resume or negative) against the references."""

    checks: dict[str, CheckResult]
    first_divergence: str | None

    @property
    def agrees(self) -> bool:
        return all(c.passed for c in self.checks.values())


def check_named(checks: dict[str, CheckResult], name: str) -> CheckResult:
    """The check ``name`` of ``checks``, added empty the first time."""
    if name not in checks:
        checks[name] = CheckResult(name)
    return checks[name]


def compare_resumed(
    continuous: dict[str, Any], interrupted: dict[str, Any], resumed: dict[str, Any], *, atol: float, rtol: float = 0.0
) -> PathComparison:
    """Compare a resumed path with the interrupted (at the cut) and continuous (after) paths."""
    checks: dict[str, CheckResult] = {}
    first: str | None = None

    def note(check: str, where: str, cmp: Comparison) -> None:
        nonlocal first
        check_named(checks, check).add(where, cmp)
        if first is None and cmp.differences:
            first = f"{check} {where}: {cmp.differences[0].describe()}"

    # 1. At the cut: what the resumed process holds before its first step must
    #    be what the interrupted process saved.
    for part in STATE_PARTS:
        note(part, "at the cut", compare_trees(interrupted["final"].get(part), resumed["start"].get(part), atol=atol, rtol=rtol, path=part))
    # 2. Step by step after the cut.
    cont_steps = {s["step"]: s for s in continuous["steps"]}
    for s in resumed["steps"]:
        ref = cont_steps.get(s["step"])
        if ref is None:
            note("progress", f"step {s['step']}", Comparison(differences=[_extra_step(s["step"])]))
            continue
        for part in _step_parts(ref, s):
            note(part, f"step {s['step']}", compare_trees(ref.get(part), s.get(part), atol=atol, rtol=rtol, path=part))
    after_cut = [k for k in cont_steps if k > resumed["start"]["progress"]["step"]]
    ran = {s["step"] for s in resumed["steps"]}
    missing = [k for k in after_cut if k not in ran]
    if missing:
        note("progress", "steps", Comparison(differences=[_missing_steps(missing)]))
    # 3. At the end.
    for part in (*STATE_PARTS, "evaluation"):
        note(part, "at the end", compare_trees(continuous["final"].get(part), resumed["final"].get(part), atol=atol, rtol=rtol, path=part))
    return PathComparison(checks, first)


def _extra_step(step: int):
    from .compare import Difference

    return Difference(f"step {step}", "structure", "absent from the continuous run", "present")


def _missing_steps(steps: list[int]):
    from .compare import Difference

    return Difference("steps", "structure", f"continuous ran {steps[:5]}", "resumed run did not")


def compare_prefix(continuous: dict[str, Any], interrupted: dict[str, Any], *, atol: float) -> CheckResult:
    """Before the cut the interrupted run must repeat the continuous one (determinism)."""
    res = CheckResult("determinism before the cut")
    cont = {s["step"]: s for s in continuous["steps"]}
    for s in interrupted["steps"]:
        ref = cont.get(s["step"])
        if ref is None:
            res.problems.append(f"step {s['step']} absent from the continuous run")
            continue
        for part in _step_parts(ref, s):
            res.add(f"step {s['step']}", compare_trees(ref.get(part), s.get(part), atol=atol, path=part))
    return res


@dataclass
class Verdict:
    """The outcome of the protocol, as written to ``verification.json``."""

    report: dict[str, Any]

    @property
    def passed(self) -> bool:
        return bool(self.report["all_checks_passed"])

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1


def _eval_key(block: dict[str, Any]) -> str | None:
    ev = block.get("evaluation") or {}
    for k, v in ev.items():
        if isinstance(v, int | float):
            return k
    return None


def _summary_row(cont: dict[str, Any], other: dict[str, Any], cmp: PathComparison) -> dict[str, Any]:
    key = _eval_key(cont["final"])
    row: dict[str, Any] = {
        "max_weight_gap": cmp.checks["parameters"].max_abs_gap if "parameters" in cmp.checks else None,
        "eval_metric": key,
        "final_eval": other["final"]["evaluation"].get(key) if key else None,
        "eval_gap": None,
        "agrees": cmp.agrees,
        "first_divergence": cmp.first_divergence,
    }
    if key is not None:
        a, b = cont["final"]["evaluation"][key], other["final"]["evaluation"].get(key)
        if isinstance(b, int | float):
            row["eval_gap"] = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
    return row


def verify_resume(
    command: Sequence[str],
    *,
    output: str | Path,
    steps: int = 10,
    cut: int = 5,
    atol: float = 1e-12,
    rtol: float = 0.0,
    show_progress: bool = True,
    mode: str = "steer",
) -> Verdict:
    """Run the protocol for ``command`` into the new folder ``output``; write ``verification.json``.

    ``mode`` (docs/VERIFY.md): ``steer`` (default) — the command uses a
    ``Checkpointer`` and runs unchanged, steered through the environment into
    folders under ``output``; ``contract`` — the command implements the
    trainer's contract (``--steps``/``--output``/``--resume``/``--omit-rng-restore``).
    """
    output = Path(output)
    if not 0 < cut < steps:
        raise BadInput("the cut must fall strictly inside the run", expected=f"0 < cut < steps = {steps}", found=f"cut = {cut}")
    if atol < 0 or rtol < 0 or not math.isfinite(atol):
        raise BadInput("tolerances must be finite and non-negative", found=f"atol={atol}, rtol={rtol}")
    if os.path.lexists(output):
        raise OutputExists(
            "the verification output folder already exists",
            file=output,
            expected="a folder that does not exist yet",
            found="an existing path",
            hint="choose a new folder: a verification never overwrites an earlier one",
        )
    if not command:
        raise BadInput("no trainer command given", hint="ripresa verify ... -- python train.py")
    if mode not in MODES:
        raise BadInput("unknown verification mode", expected=" | ".join(MODES), found=mode)
    output.mkdir(parents=True)
    t0 = time.perf_counter()
    ran = _run_with_progress(command, steps=steps, cut=cut, output=output, show=show_progress, mode=mode)
    runs = ran.runs
    docs = {name: read_trajectory(r.output / "summary.json") for name, r in runs.items()}
    not_used = streams_not_used(docs["continuous"], docs["interrupted"])
    if not_used:
        docs = {name: _without_streams(d, not_used) for name, d in docs.items()}
    prefix = compare_prefix(docs["continuous"], docs["interrupted"], atol=atol)
    positive = compare_resumed(docs["continuous"], docs["interrupted"], docs["resume"], atol=atol, rtol=rtol)
    negative = compare_resumed(docs["continuous"], docs["interrupted"], docs["resume-without-rng"], atol=atol, rtol=rtol)
    for name, cmp in (("resume", positive), ("resume-without-rng", negative)):
        rc = runs[name].returncode
        if rc != 0:
            last = log_tail(runs[name].log, 4).replace("\n", " | ")
            cmp.checks["process"] = CheckResult("process", problems=[f"exited with code {rc}: {last}"])
            if cmp.first_divergence is None:
                cmp.first_divergence = f"process: exited with code {rc}: {last}"
    positive_ok = prefix.passed and positive.agrees
    negative_diverged = not negative.agrees
    report = {
        "all_checks_passed": positive_ok and negative_diverged,
        "positive": positive_ok,
        "negative_divergence_detected": negative_diverged,
        "tolerance": {"absolute": atol, "relative": rtol},
        "steps": steps,
        "cut": cut,
        "command": list(command),
        "mode": ran.mode,
        "streams_not_used": not_used,
        "determinism_before_cut": prefix.as_dict(),
        "checks": {
            "resume": [c.as_dict() for c in positive.checks.values()],
            "resume-without-rng": [c.as_dict() for c in negative.checks.values()],
        },
        "first_divergence": {"resume": positive.first_divergence, "resume-without-rng": negative.first_divergence},
        "table": {
            "resume": _summary_row(docs["continuous"], docs["resume"], positive),
            "resume-without-rng": _summary_row(docs["continuous"], docs["resume-without-rng"], negative),
            "continuous_final_eval": docs["continuous"]["final"]["evaluation"],
        },
        "paths": {
            name: {"argv": r.argv, "returncode": r.returncode, "seconds": round(r.seconds, 3), "output": str(r.output), "log": str(r.log),
                   **({"steering": r.env[STEER_ENV]} if r.env else {})}
            for name, r in runs.items()
        },
        "seconds": round(time.perf_counter() - t0, 3),
        "versions": versions(),
    }
    if ran.mode == "steered":  # the one line on the final state: the two runs' last generations fingerprinted
        report["final_state"] = final_state(runs["continuous"].output / "run", runs["resume"].output / "run",
                                            unused_streams=not_used)
    write_atomic(output / "verification.json", [json.dumps(report, indent=2, default=str).encode()])
    return Verdict(report)


def _run_with_progress(command, *, steps, cut, output, show, mode) -> PathRuns:
    """:func:`run_paths` under a progress line on stderr (a TTY only, ripresa.console.progress): paths done of the
    four planned (:class:`PathCount`)."""
    from ..console import progress

    count = PathCount()
    with progress(quiet=not show, transient=False) as bar:
        task = bar.add_task("verify: continuous ∥ interrupted", total=len(PATHS), unit="paths")

        def cb(name: str, rc: int) -> None:
            completed, description = count.done(name, rc)
            bar.update(task, completed=completed, description=description)

        return run_paths(command, steps=steps, cut=cut, output=output, progress_cb=cb, mode=mode)


class PathCount:
    """Paths done of the four planned: each path counted once, whatever reports it (never ``6/4 paths``)."""

    def __init__(self) -> None:
        self.finished: list[str] = []

    def done(self, name: str, rc: int) -> tuple[int, str]:
        """Record ``name`` finished with exit code ``rc``: (paths done, the progress line's text)."""
        if name in PATHS and name not in self.finished:
            self.finished.append(name)
        if name in REFERENCE:
            nxt = "resume ∥ resume-without-rng" if set(REFERENCE) <= set(self.finished) else "the other reference path"
        else:
            nxt = "comparing" if len(self.finished) == len(PATHS) else "the other resumed path"
        return len(self.finished), f"verify: {name} done (exit {rc}) → {nxt}"


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "0" if v == 0 else repr(v)
    return str(v)


def render_verdict(verdict: Verdict, console=None) -> None:
    """Print the verdict table: weight gap, final metric, gap, verdict per path."""
    from rich.table import Table

    from ..console import capped_rows, joined
    from ..text import safe_console

    console = console or safe_console()
    r = verdict.report
    t = r["table"]
    metric = t["resume"]["eval_metric"] or "evaluation"
    tol = r["tolerance"]["absolute"]
    table = Table(title=f"resume verification — {r['steps']} steps, cut at {r['cut']}, tolerance abs {tol:g} rel {r['tolerance']['relative']:g}")
    table.add_column("comparison", overflow="fold")  # numbers stay whole on one line; the labels wrap
    table.add_column("full resume", justify="right", no_wrap=True)
    table.add_column("resume without RNG", justify="right", no_wrap=True)
    table.add_row("max weight gap", _fmt(t["resume"]["max_weight_gap"]), _fmt(t["resume-without-rng"]["max_weight_gap"]))
    table.add_row(f"final {metric}", _fmt(t["resume"]["final_eval"]), _fmt(t["resume-without-rng"]["final_eval"]))
    table.add_row(f"{metric} gap vs continuous", _fmt(t["resume"]["eval_gap"]), _fmt(t["resume-without-rng"]["eval_gap"]))
    table.add_row(
        "verdict",
        f"agrees within {tol:g}" if t["resume"]["agrees"] else "[red]DIVERGES[/]",
        "divergence detected" if not t["resume-without-rng"]["agrees"] else "[red]no divergence (check is blind)[/]",
    )
    console.print(table)
    checks = Table(title="checks after the cut (max absolute gap)")
    checks.add_column("check", overflow="fold")
    checks.add_column("full resume", justify="right", no_wrap=True)
    checks.add_column("without RNG", justify="right", no_wrap=True)
    neg = {c["name"]: c for c in r["checks"]["resume-without-rng"]}
    failed_first = sorted(r["checks"]["resume"], key=lambda c: bool(c["passed"]))  # failures first, in their order
    capped_rows(checks, failed_first, lambda c: (
        c["name"],
        ("ok " if c["passed"] else "[red]FAIL[/] ") + _fmt(c["max_abs_gap"]),
        ("same " if neg.get(c["name"], {}).get("passed") else "differs ") + _fmt(neg.get(c["name"], {}).get("max_abs_gap")),
    ), what="checks")
    console.print(checks)
    if r.get("mode") == "steered":
        console.print("steered: the command ran unchanged in folders ripresa verify owns, its Checkpointer "
                      "recorded the trajectory")
    if r.get("final_state"):
        same = r["final_state"]["same"]
        color = "green" if same else "red" if same is False else "yellow"
        console.print(f"[{color}]{rich_escape(r['final_state']['line'])}[/]")
    if r.get("streams_not_used"):
        console.print(f"random streams not used (never seeded by the command, not compared): {joined(r['streams_not_used'])}")
    if not r["determinism_before_cut"]["passed"]:
        console.print(f"[red]the trainer is not deterministic before the cut:[/] {r['determinism_before_cut']['first_problem']}")
    if not t["resume"]["agrees"]:
        console.print(f"[red]first divergence of the full resume:[/] {r['first_divergence']['resume']}")
    console.print(
        f"all_checks_passed: {str(r['all_checks_passed']).lower()}  positive: {str(r['positive']).lower()}  "
        f"negative_divergence_detected: {str(r['negative_divergence_detected']).lower()}"
    )
