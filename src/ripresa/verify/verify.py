"""The resume verification protocol (docs/VERIFY.md).

Four fresh processes run the same trainer:

=====================  ==========================================  ===========
path                   run                                         folder
=====================  ==========================================  ===========
continuous             ``--steps N`` from the initial state        continuous/
interrupted            ``--steps K``, save, stop                   interrupted/
full resume            ``--steps N-K --resume interrupted/...``    resume/
resume without RNG     the same plus ``--omit-rng-restore``        resume-without-rng/
=====================  ==========================================  ===========

Compared after the cut, step by step and at the end: the ids of the rows
consumed, the learning rates, the losses, the parameters, the optimizer state,
the scheduler state, the progress, the data position, the next draw of every
random stream, the next LR and the final evaluation. The state the resumed
process holds right after its restore is also compared with the state the
interrupted process saved, so a fault is named where it first appears.

That table is the contract mode (``mode="contract"``, ``--contract``). The
default mode is the steered one: a script that uses the ``Checkpointer`` runs
unchanged on every path, its session steered through ``RIPRESA_VERIFY``
(:mod:`ripresa.session.steer`): its own run folder per path under ``output``
(the resumed paths get a copy of the interrupted one), a stop with a save at
the cut, no RNG restore for the negative case, no mirror; the session records
the same ``summary.json``. The command is never run as itself: every path
writes only into folders this verifier owns (docs/VERIFY.md, "Your runs are
never touched"). Random streams whose next draw differs between
the two fresh reference processes are never seeded by the command: they are
reported as not used and not compared (:func:`streams_not_used`).

The verdict passes only when the full resume agrees within the tolerance
**and** the negative case diverges. Exit codes: 0 pass, 1 a comparison
failed, 2 the verification could not be completed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.identity import versions
from ..errors import BadInput, OutputExists, RipresaError
from ..io.child import child_env
from ..io.fsio import open_run_file, read_json_small, write_atomic
from ..session.steer import ENV as STEER_ENV
from ..session.steer import Steering
from .compare import Comparison, Tally, compare_trees
from .trajectory import SUMMARY_MAX, read_trajectory

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


def _check(checks: dict[str, CheckResult], name: str) -> CheckResult:
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
        _check(checks, check).add(where, cmp)
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


# --------------------------------------------------------------------------- running


@dataclass
class PathRun:
    name: str
    argv: list[str]
    output: Path
    log: Path
    returncode: int | None = None
    seconds: float = 0.0
    env: dict[str, str] = field(default_factory=dict)  # added to the environment (the steering)


#: How the verifier runs the command (docs/VERIFY.md): ``steer`` (the default) or ``contract``.
MODES = ("steer", "contract")
REFERENCE = ("continuous", "interrupted")
RESUMED = ("resume", "resume-without-rng")


@dataclass
class PathRuns:
    """The four paths as run, and how (``contract`` or ``steered``)."""

    runs: dict[str, PathRun]
    mode: str


#: How ripresa starts its own reference exercise: ``-P``, nothing from the working folder on ``sys.path``.
_OWN_FLAGS = ["-B", "-P"]


def _launch(run: PathRun) -> subprocess.Popen:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    if run.argv[:1] == [sys.executable] and run.argv[1:3] == _OWN_FLAGS:
        # ripresa's own reference exercise: ripresa's code whatever the working folder and PYTHONPATH
        # hold (docs/FAULTS.md, "Child processes"); a user's command runs as the user wrote it
        env = child_env(env)
    env.pop(STEER_ENV, None)  # only the steering this verifier sets is ever seen by a path
    env.update(run.env)
    logf = open(run.log, "wb")
    proc = subprocess.Popen(run.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    proc._ripresa_log = logf  # type: ignore[attr-defined]
    proc._ripresa_t0 = time.perf_counter()  # type: ignore[attr-defined]
    return proc


def _tail(path: Path, n: int = 15, window: int = 64 * 1024) -> str:
    """The last ``n`` lines of a path's log (its last ``window`` bytes; no link followed, no FIFO waited on)."""
    try:
        fd = open_run_file(path, "log")
    except RipresaError:
        return ""
    try:
        size = os.fstat(fd).st_size
        raw = os.pread(fd, window, max(0, size - window))
    except OSError:
        return ""
    finally:
        os.close(fd)
    return "\n".join(raw.decode(errors="replace").splitlines()[-n:])


def _wave(runs: dict[str, PathRun], names: Sequence[str], progress_cb) -> None:
    """Run ``names`` at the same time (2 cores), each a fresh process; record exit codes and times."""
    procs = {name: _launch(runs[name]) for name in names}
    for name, proc in procs.items():
        rc = proc.wait()
        proc._ripresa_log.close()  # type: ignore[attr-defined]
        runs[name].returncode = rc
        runs[name].seconds = time.perf_counter() - proc._ripresa_t0  # type: ignore[attr-defined]
        if progress_cb:
            progress_cb(name, rc)


def _check_wave(runs: dict[str, PathRun], names: Sequence[str]) -> None:
    for name in names:
        r = runs[name]
        # A resumed path that failed after writing its trajectory (e.g. its
        # save refused an inconsistent state) is still compared: the
        # failure becomes a failed check, not an incomplete verification.
        resumed_with_summary = name in RESUMED and _has_summary(r.output)
        if r.returncode != 0 and not resumed_with_summary:
            how = "run by hand: " + " ".join(r.argv)
            if r.env:
                how += f" (steered: {STEER_ENV}='{r.env[STEER_ENV]}')"
            raise BadInput(
                f"the {name} path failed (exit {r.returncode}); the verification could not be completed",
                file=r.log,
                expected="exit code 0",
                found=f"exit code {r.returncode}; last lines:\n{_tail(r.log)}",
                hint=how,
            )


def _contract_reference(command: Sequence[str], steps: int, cut: int, output: Path) -> dict[str, PathRun]:
    return {
        "continuous": PathRun("continuous", [*command, "--steps", str(steps), "--output", str(output / "continuous")], output / "continuous", output / "continuous.log"),
        "interrupted": PathRun("interrupted", [*command, "--steps", str(cut), "--output", str(output / "interrupted")], output / "interrupted", output / "interrupted.log"),
    }


def _contract_resumed(command: Sequence[str], steps: int, cut: int, output: Path) -> dict[str, PathRun]:
    ckpt = saved_checkpoint(output / "interrupted")
    resume_argv = [*command, "--steps", str(steps - cut), "--resume", str(ckpt)]
    return {
        "resume": PathRun("resume", [*resume_argv, "--output", str(output / "resume")], output / "resume", output / "resume.log"),
        "resume-without-rng": PathRun(
            "resume-without-rng", [*resume_argv, "--omit-rng-restore", "--output", str(output / "resume-without-rng")],
            output / "resume-without-rng", output / "resume-without-rng.log",
        ),
    }


def _steered(name: str, command: Sequence[str], output: Path, stop_at: int, restore_rng: bool = True) -> PathRun:
    """One steered path: the command unchanged; its Checkpointer uses ``output/NAME/run`` and stops at ``stop_at``."""
    folder = output / name
    folder.mkdir()
    steer = Steering(name, folder / "run", folder, stop_at, restore_rng)
    return PathRun(name, list(command), folder, output / f"{name}.log", env=steer.to_env())


def _steered_reference(command: Sequence[str], steps: int, cut: int, output: Path) -> dict[str, PathRun]:
    return {"continuous": _steered("continuous", command, output, steps),
            "interrupted": _steered("interrupted", command, output, cut)}


def _steered_resumed(command: Sequence[str], steps: int, cut: int, output: Path) -> dict[str, PathRun]:
    """The resumed paths: each gets a copy of the interrupted path's run folder, and the script's own resume() finds step K."""
    runs = {"resume": _steered("resume", command, output, steps),
            "resume-without-rng": _steered("resume-without-rng", command, output, steps, restore_rng=False)}
    for r in runs.values():
        shutil.copytree(output / "interrupted" / "run", r.output / "run", symlinks=True)
    return runs


def _check_steered_reference(runs: dict[str, PathRun], steps: int, cut: int) -> None:
    """A steered reference path must have stopped where it was steered to (the script's own count may be shorter)."""
    for name, want in (("interrupted", cut), ("continuous", steps)):
        r = runs[name]
        if not os.path.lexists(r.output / "summary.json"):
            raise BadInput(
                f"the steered {name} path wrote no summary.json", file=r.output / "summary.json",
                expected="a script that builds a ripresa Checkpointer and calls its resume()",
                found=f"exit code {r.returncode}, no trajectory; last lines:\n{_tail(r.log)}",
                hint="ripresa verify steers scripts that use ripresa.Checkpointer; a trainer that implements "
                     "the contract (--steps/--output/--resume, summary.json) is verified with --contract (docs/VERIFY.md)",
            )
        doc = read_trajectory(r.output / "summary.json")
        got = (doc.get("final") or {}).get("progress", {}).get("step")
        if got != want:
            raise BadInput(
                f"the steered {name} path stopped at step {got}, not {want}", file=r.output / "summary.json",
                expected=f"the script's loop reaching step {want}", found=f"step {got}",
                hint="the script's own step count must reach --steps (e.g. pass it a larger --steps); "
                     "ripresa verify stops it at the cut and at --steps",
            )
    if not (runs["interrupted"].output / "run").is_dir():
        raise BadInput("the steered interrupted path left no run folder", file=runs["interrupted"].output / "run")


def run_paths(command: Sequence[str], *, steps: int, cut: int, output: Path, progress_cb=None, mode: str = "steer") -> PathRuns:
    """Run the four paths, two at a time (continuous ∥ interrupted, then resume ∥ negative).

    ``steer`` (default): the command runs unchanged and its ``Checkpointer`` is
    steered into ``output/PATH/run``. ``contract``: the command implements the
    contract (docs/VERIFY.md) and is given ``--output``/``--resume`` under ``output``.
    Either way no path is the command run as itself.
    """
    if mode not in MODES:
        raise BadInput("unknown verification mode", expected=" | ".join(MODES), found=mode)
    steered = mode == "steer"
    runs = (_steered_reference if steered else _contract_reference)(command, steps, cut, output)
    _wave(runs, REFERENCE, progress_cb)
    _check_wave(runs, REFERENCE)
    if steered:
        _check_steered_reference(runs, steps, cut)
    runs.update((_steered_resumed if steered else _contract_resumed)(command, steps, cut, output))
    _wave(runs, RESUMED, progress_cb)
    _check_wave(runs, RESUMED)
    return PathRuns(runs, "steered" if steered else "contract")


def saved_checkpoint(folder: Path) -> Path:
    """The checkpoint the interrupted path saved: ``summary.json``'s ``checkpoint``
    (relative to the folder, never leaving it), else ``checkpoint.pt``.

    ``summary.json`` is read through the safe opener (no symlink followed, a
    FIFO never waited on, bounded): a special, oversized or malformed one is
    a :class:`~ripresa.errors.BadInput`, as is a ``checkpoint`` naming a path
    outside the folder.
    """
    p = folder / "summary.json"
    if not os.path.lexists(p):
        return folder / "checkpoint.pt"
    doc = read_json_small(p, "trajectory summary", SUMMARY_MAX)
    name = doc.get("checkpoint") if isinstance(doc, dict) else None
    if name is None or name == "":
        return folder / "checkpoint.pt"
    rel = Path(name) if isinstance(name, str) and "\x00" not in name else None
    if rel is None or rel.is_absolute() or ".." in rel.parts:
        raise BadInput("summary.json names a checkpoint outside its folder", file=p,
                       expected="a path relative to the path's output folder", found=repr(name)[:160],
                       hint="the trainer's summary.json must name its checkpoint inside --output (docs/VERIFY.md)")
    return folder / rel


def _has_summary(folder: Path) -> bool:
    """``folder/summary.json`` is a regular file (never following a link, never opening a FIFO)."""
    try:
        return stat.S_ISREG(os.lstat(folder / "summary.json").st_mode)
    except OSError:
        return False


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
            last = _tail(runs[name].log, 4).replace("\n", " | ")
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
    for c in r["checks"]["resume"]:
        n = neg.get(c["name"], {})
        checks.add_row(
            c["name"],
            ("ok " if c["passed"] else "[red]FAIL[/] ") + _fmt(c["max_abs_gap"]),
            ("same " if n.get("passed") else "differs ") + _fmt(n.get("max_abs_gap")),
        )
    console.print(checks)
    if r.get("mode") == "steered":
        console.print("steered: the command ran unchanged in folders ripresa verify owns, its Checkpointer "
                      "recorded the trajectory")
    if r.get("streams_not_used"):
        console.print(f"random streams not used (never seeded by the command, not compared): {', '.join(r['streams_not_used'])}")
    if not r["determinism_before_cut"]["passed"]:
        console.print(f"[red]the trainer is not deterministic before the cut:[/] {r['determinism_before_cut']['first_problem']}")
    if not t["resume"]["agrees"]:
        console.print(f"[red]first divergence of the full resume:[/] {r['first_divergence']['resume']}")
    console.print(
        f"all_checks_passed: {str(r['all_checks_passed']).lower()}  positive: {str(r['positive']).lower()}  "
        f"negative_divergence_detected: {str(r['negative_divergence_detected']).lower()}"
    )


def reference_exercise_command() -> list[str]:
    """The command of the 33-parameter reference exercise (from the source tree)."""
    here = Path(__file__).resolve()
    for root in here.parents:
        cand = root / "examples" / "regression" / "train.py"
        if cand.is_file():
            return [sys.executable, *_OWN_FLAGS, str(cand)]
    raise BadInput(
        "the reference exercise examples/regression/train.py was not found",
        expected="a ripresa source checkout (examples/ beside src/)",
        found=f"ripresa installed at {here.parent}",
        hint="pass the trainer explicitly: ripresa verify --output DIR -- python path/to/train.py",
    )
