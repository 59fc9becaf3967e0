"""Running the four paths of a resume verification, each a fresh process (docs/VERIFY.md).

:func:`run_paths` runs continuous ∥ interrupted, then resume ∥ resume-without-rng, steered (the default: the command
unchanged, its ``Checkpointer`` steered through ``RIPRESA_VERIFY``) or by the contract (``--steps/--output/--resume``).
Every path writes only into folders the verifier owns (docs/VERIFY.md, "Your runs are never touched").
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput, RipresaError
from ..io.child import child_env
from ..io.fsio import open_run_file, read_json_small
from ..session.steer import ENV as STEER_ENV
from ..session.steer import Steering
from .trajectory import SUMMARY_MAX, read_trajectory


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


def log_tail(path: Path, n: int = 15, window: int = 64 * 1024) -> str:
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


def run_wave(runs: dict[str, PathRun], names: Sequence[str], progress_cb) -> None:
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
                found=f"exit code {r.returncode}; last lines:\n{log_tail(r.log)}",
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


def steered_path(name: str, command: Sequence[str], output: Path, stop_at: int, restore_rng: bool = True,
             invariant: bool = True) -> PathRun:
    """One steered path: the command unchanged; its Checkpointer uses ``output/NAME/run`` and stops at ``stop_at``
    (``invariant=False``: a ``world_size_invariant`` Checkpointer reduces the ordinary way, docs/VERIFY.md)."""
    folder = output / name
    folder.mkdir()
    steer = Steering(name, folder / "run", folder, stop_at, restore_rng, invariant=invariant)
    return PathRun(name, list(command), folder, output / f"{name}.log", env=steer.to_env())


def _steered_reference(command: Sequence[str], steps: int, cut: int, output: Path) -> dict[str, PathRun]:
    return {"continuous": steered_path("continuous", command, output, steps),
            "interrupted": steered_path("interrupted", command, output, cut)}


def _steered_resumed(command: Sequence[str], steps: int, cut: int, output: Path) -> dict[str, PathRun]:
    """The resumed paths: each gets a copy of the interrupted path's run folder, and the script's own resume() finds step K."""
    runs = {"resume": steered_path("resume", command, output, steps),
            "resume-without-rng": steered_path("resume-without-rng", command, output, steps, restore_rng=False)}
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
                found=f"exit code {r.returncode}, no trajectory; last lines:\n{log_tail(r.log)}",
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
    run_wave(runs, REFERENCE, progress_cb)
    _check_wave(runs, REFERENCE)
    if steered:
        _check_steered_reference(runs, steps, cut)
    runs.update((_steered_resumed if steered else _contract_resumed)(command, steps, cut, output))
    run_wave(runs, RESUMED, progress_cb)
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
