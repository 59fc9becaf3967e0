"""``make demo``: the whole cycle, as a new user would see it.

1. The resume proof on the 33-parameter reference exercise (``ripresa verify``).
2. The ANDREA engine on the ``tiny`` config, in a real child process:
   checkpoints every 100 steps with a sample audit each, a SIGUSR1 (checkpoint
   and continue), a SIGTERM (checkpoint and exit 0), then a resume from the
   step it stopped at — and where every file is.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..console import capped_rows, progress
from ..errors import BadInput, SaveFailed
from ..io.child import child_env, ripresa_argv
from ..io.fsio import open_run_file, read_json_small
from ..store.history import read_history
from ..store.store import CheckpointStore
from ..text import escape_markup, safe_console
from ..verify.verify import reference_exercise_command, render_verdict, verify_resume


def _train_cmd(run: Path, *extra: str) -> list[str]:
    """``ripresa train`` on the demo's run: ripresa's own code whatever the working folder holds (io/child.py)."""
    return ripresa_argv("train", "--run", str(run), "--config", "tiny", "--threads", "1", "--quiet", *extra)


def _last_step(run: Path) -> int:
    hist = run / ".loss.jsonl"
    steps = read_history(hist).steps if hist.exists() else []
    return max(steps) if steps else 0


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 600, *, what: str | None = None,
                  total: int | None = None, until_exit: bool = False) -> int:
    """The newest step in ``run``'s history once it is ``>= step`` (or, ``until_exit``, once the child ``proc``
    training it has ended). The child must stay alive until then: a typed :class:`~ripresa.errors.SaveFailed`,
    exit 2, when it exits early or stalls past ``timeout``. With ``what``, a progress line (ripresa.console.progress:
    the steps done of ``total``; nothing when stderr is not a terminal)."""
    t0 = time.time()
    with progress("count") if what else contextlib.nullcontext() as bar:
        task = bar.add_task(f"{what} (tiny; history {run / '.loss.jsonl'})", total=total or step,
                            unit="steps") if bar is not None else None
        while time.time() - t0 < timeout:
            done = proc.poll() is not None
            at = _last_step(run)
            if bar is not None:
                bar.update(task, completed=min(at, total or step))
            if until_exit and done:
                return at
            if done:
                raise SaveFailed("the trainer exited early", file=run, expected=f"training up to step {step}",
                                 found=f"exit code {proc.returncode}", hint="its output is in the log beside the run")
            if not until_exit and at >= step:
                return at
            time.sleep(0.1)
    raise SaveFailed("the trainer did not reach its step in time (a hang guard)", file=run,
                     expected=f"step {step} within {timeout:.0f} s", found="fewer steps",
                     hint="its output is in the log beside the run")


def _valid(run: Path) -> list[int]:
    return [g.step for g in CheckpointStore(run, writer=False).generations() if g.valid]


def _fields(detail: dict, most: int = 240) -> str:
    """An event's fields as ``key=value`` (values as JSON), whole fields only: past ``most`` characters the rest
    is counted (``+N more``), never cut mid-value."""
    shown: list[str] = []
    used = 0
    for i, (k, v) in enumerate(detail.items()):
        item = f"{k}={json.dumps(v, default=str)}"
        if shown and used + len(item) > most:
            shown.append(f"(+{len(detail) - i} more)")
            break
        shown.append(item)
        used += len(item) + 1
    return " ".join(shown)


def run_demo(out: Path, console: Console | None = None) -> int:
    console = console or safe_console()
    t_all = time.perf_counter()
    if os.path.lexists(out) and (os.path.islink(out) or not out.is_dir()):
        raise BadInput("the demo's --output is not a folder", file=out, expected="a new folder (or an existing one)",
                       found="a symlink" if os.path.islink(out) else "a file", hint="choose another --output")
    out.mkdir(parents=True, exist_ok=True)
    # the engine's log, opened before anything runs: a planted link or FIFO is refused, never followed
    log = open_run_file(out / "train.log", "the demo's train.log", mode="create_append")
    try:
        return _run_demo(out, console, log, t_all)
    finally:
        os.close(log)


def _run_demo(out: Path, console: Console, log: int, t_all: float) -> int:
    console.rule("[bold]1/2 · proving a resume exact on the 33-parameter reference exercise")
    verdict = verify_resume(reference_exercise_command(), output=out / "verify", steps=10, cut=5, mode="contract")
    render_verdict(verdict, console)
    if not verdict.passed:
        return verdict.exit_code

    console.rule("[bold]2/2 · the ANDREA engine (tiny): checkpoints, sample audits, SIGUSR1, SIGTERM, resume")
    run = out / "gpt"
    env = child_env(PYTHONDONTWRITEBYTECODE="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(_train_cmd(run, "--steps", "400", "--every", "100"), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        at = wait_for_step(run, 150, proc, what="training to step 150", total=400)
        proc.send_signal(__import__("signal").SIGUSR1)
        console.print(f"· step {at}: sent SIGUSR1 (checkpoint and continue)")
        t1 = time.time()
        while not [s for s in _valid(run) if s % 100] and time.time() - t1 < 60:
            time.sleep(0.05)
        extra = [s for s in _valid(run) if s % 100]
        console.print(f"  → generation step_{extra[0]:06d}.bin committed while training went on" if extra else "  → (no extra generation seen)")
        at = wait_for_step(run, 250, proc, what="training on to step 250", total=400)
        proc.send_signal(__import__("signal").SIGTERM)
        console.print(f"· step {at}: sent SIGTERM (checkpoint and exit)")
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = max(read_history(run / ".loss.jsonl").steps)
    console.print(f"  → exit code {rc}; last step {stopped}; generations {_valid(run)}")
    # the same command again, 50 steps further: `ripresa train` resumes and says from which generation
    goal = stopped + 50
    again = subprocess.Popen(_train_cmd(run, "--steps", str(goal), "--every", "100"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for_step(run, goal, again, what=f"resumed, training to step {goal}", total=goal, until_exit=True)
        said, err = again.communicate(timeout=120)
    finally:
        if again.poll() is None:
            again.kill()
    first = next((line for line in said.splitlines() if line.startswith("resumed")), said.strip()[:200])
    console.print(f"· started again on the same folder: {escape_markup(first)}")
    if again.returncode != 0 or rc != 0:
        console.print(f"[red]the engine failed[/] (exit {rc}, {again.returncode}):\n{escape_markup(err[-2000:])}")
        return 2
    view = read_history(run / ".loss.jsonl")
    table = Table(title=f"history of {run} (.loss.jsonl: {len(view.steps)} steps, {len(view.events)} events)")
    table.add_column("event", no_wrap=True)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")  # wraps between fields, never cuts a value

    def row(e: dict) -> tuple[str, str, str]:
        detail = {k: v for k, v in e.items() if k not in ("event", "time", "step", "from_step", "lineage")}
        return (escape_markup(e["event"]), escape_markup(str(e.get("step", e.get("from_step", "")))),
                escape_markup(_fields(detail)))

    capped_rows(table, view.events, row, what="events")
    console.print(table)
    samples = read_json_small(run / ".samples.json", "sample audits", 16 << 20)  # no link followed, no FIFO waited on
    last = samples["audits"][-1]
    console.print(f"sample audit at step {last['step']}: {last['samples'][0]['prompt']!r} → {last['samples'][0]['completion'][:60]!r}")
    console.print(
        f"\n[bold]files[/] ({time.perf_counter() - t_all:.0f} s in all, engine {time.perf_counter() - t0:.0f} s):\n"
        f"  {out / 'verify'}/verification.json   the resume proof\n"
        f"  {run}/step_NNNNNN.bin (+ .json companion, .bin.sha256 marker)   generations {_valid(run)}\n"
        f"  {run}/.loss.jsonl   append-only history · .samples.json   audits · .state.json   bandit · config.json\n"
        f"  try: {ripresa_command()} inspect {run}{_path_hint()}"
    )
    return 0


def ripresa_command() -> str:
    """How to call ``ripresa`` from the shell that started this process: ``ripresa`` when that is this very
    installation on the PATH, else the script beside this interpreter (``.venv/bin/ripresa`` from the clone),
    else ``python -m ripresa`` with this interpreter."""
    import shutil
    import sys

    here = Path(sys.executable).parent / "ripresa"
    found = shutil.which("ripresa")
    if found is not None and os.path.realpath(found) == os.path.realpath(here):
        return "ripresa"
    if here.is_file() and os.access(here, os.X_OK):
        rel = os.path.relpath(here)
        return rel if not rel.startswith("..") else str(here)
    return f"{sys.executable} -m ripresa"


def _path_hint() -> str:
    cmd = ripresa_command()
    if cmd == "ripresa" or " -m " in cmd or not (Path(cmd).parent / "activate").is_file():
        return ""
    return f"\n  (ripresa is not on this shell's PATH: `source {Path(cmd).parent}/activate` puts it there)"
