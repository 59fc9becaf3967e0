"""``ripresa pivot``: a policy change of a run's data mixture without retraining.

1. The new policy (floors and caps of the data mixture) is validated against
   the run's arms **before** anything is stopped.
2. If a trainer holds the run: SIGUSR1 (a checkpoint, the audit point right
   before the change) and wait until it is committed; then SIGTERM (it saves
   the step it reached and exits 0) and wait until the run folder's lock is free.
   Both signals go through :func:`ripresa.io.lock.signal_holder`, which checks
   LOCK's pid against the kernel first (docs/FAULTS.md, "Signalling the
   trainer"): a forged LOCK stops the pivot before anything is signalled.
3. With the lock held by this command: ``.samples.json`` and ``.state.json``
   are moved into ``archive/pivot_NNNNNN/`` (NNNNNN = the newest valid
   generation, the pivot step); ``.loss.jsonl`` stays where it is and gets a
   ``pivot`` event; ``config.json`` gets the new policy and the next phase.
4. ``--restart`` starts ``ripresa train --run RUN`` detached (output to
   ``RUN/train.log``); otherwise the exact command is printed.

The resumed run has full weights, m and v (the generation), a fresh bandit
(the saved bandit belongs to the previous phase and is not loaded), a fresh
sample log, and a continuous history.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import BadInput, CheckFailed
from ..io.fsio import fsync_dir, open_run_file, write_atomic
from ..io.lock import NotRunning, RunLock, is_locked, signal_holder
from ..store.history import HISTORY_NAME, History
from ..store.store import CheckpointStore
from .fork import read_run_config
from .gpt.train import SAMPLES_NAME, STATE_NAME
from .mixture import MixturePolicy, parse_policy_args


def _arms(cfg: dict[str, Any]) -> list[str]:
    return [spec.partition("=")[0] for spec in cfg["data"]["sources"]]


def new_policy(cfg: dict[str, Any], caps: Sequence[str], floors: Sequence[str]) -> MixturePolicy:
    """The run's policy with the given overrides, validated against its arms."""
    current = MixturePolicy.from_dict({"floors": cfg["mixture"].get("floors", {}), "caps": cfg["mixture"].get("caps", {})})
    delta = parse_policy_args(caps=list(caps), floors=list(floors))
    merged = MixturePolicy(floors={**current.floors, **delta.floors}, caps={**current.caps, **delta.caps})
    merged.validate(_arms(cfg))
    return merged


def _newest_valid(run: Path) -> int | None:
    gen = _newest_generation(run)
    return gen.step if gen else None


def _newest_generation(run: Path) -> Any:
    """The newest valid generation of any kind (``.bin``, general, a sharded ``.dcp``): what a resume takes."""
    from ..store.backend import latest_valid_of, registered

    return latest_valid_of(run, tuple(registered()), deep=False, warn=False, store=CheckpointStore(run, writer=False))


def _wait(predicate, timeout: float, what: str, run: Path, *, gone=None) -> None:
    """Poll ``predicate`` until true; refuse if ``gone()`` says the trainer is no more, or on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return
        if gone is not None and gone():
            if predicate():
                return
            raise BadInput(f"the trainer exited while waiting for {what}", file=run,
                           expected=what, found="the run folder's lock is free",
                           hint="see RUN/train.log (or your program's output); then run the pivot again")
        time.sleep(0.05)
    raise BadInput(f"timed out waiting for {what}", file=run, expected=f"{what} within {timeout:g} s",
                   found="the trainer did not respond", hint="check RUN/train.log; raise --timeout for a slow save")


def stop_trainer(run: Path, timeout: float = 600) -> dict[str, Any]:
    """SIGUSR1 → committed generation → SIGTERM → lock free. Returns what happened.

    Both signals go through :func:`ripresa.io.lock.signal_holder`: the pid in
    ``LOCK`` is checked against the kernel (a live process on this host and in
    this pid namespace that holds this run's lock) before anything is sent,
    and the SIGTERM goes only to the process that got the SIGUSR1. A forged
    ``LOCK`` is refused (:class:`~ripresa.errors.BadInput`, exit 2) before any
    signal, so nothing is stopped and nothing is archived.
    """
    if not is_locked(run):
        return {"trainer": None}
    before = _newest_valid(run)
    try:
        holder = signal_holder(run, signal.SIGUSR1)
    except NotRunning:
        return {"trainer": None}  # it stopped on its own since the look above
    _wait(lambda: (_newest_valid(run) or -1) > (before if before is not None else -1), timeout,
          "the SIGUSR1 checkpoint", run, gone=lambda: not is_locked(run))
    audit_step = _newest_valid(run)
    try:
        signal_holder(run, signal.SIGTERM, pid=holder.pid)
    except NotRunning:
        pass  # already gone: nothing left to stop
    _wait(lambda: not is_locked(run), timeout, "the trainer to stop", run)
    return {"trainer": holder.pid, "sigusr1_step": audit_step, "stopped_at": _newest_valid(run)}


def pivot(run: Path, *, caps: Sequence[str] = (), floors: Sequence[str] = (), restart: bool = False,
          timeout: float = 600) -> dict[str, Any]:
    """Perform the pivot (see the module doc); returns a report."""
    run = Path(run)
    cfg_path = run / "config.json"
    if not os.path.lexists(cfg_path):
        raise BadInput("not a ripresa train run folder", file=run, expected="config.json", found="nothing")
    cfg = read_run_config(cfg_path)  # no link, no FIFO, bounded (docs/FAULTS.md)
    if not caps and not floors:
        raise BadInput("a pivot needs a new policy", expected="--caps ARM=X and/or --floors ARM=Y")
    policy = new_policy(cfg, caps, floors)  # refused here, before anything is stopped
    stopped = stop_trainer(run, timeout)
    lock = RunLock(run).acquire()
    try:
        step = _newest_valid(run)
        if step is None:
            raise CheckFailed("the run has no valid generation to pivot from", file=run,
                              hint="train until a checkpoint exists (or send `ripresa signal RUN checkpoint`)")
        archive = run / "archive" / f"pivot_{step:06d}"
        for folder in (run / "archive", archive):  # never move files through a link out of the run folder
            if os.path.islink(folder) or (os.path.lexists(folder) and not folder.is_dir()):
                raise BadInput("the run's archive is not a folder inside the run", file=folder,
                               expected="a folder (or nothing yet)", found="a symlink" if os.path.islink(folder) else "a file",
                               hint="ripresa never follows links inside a run folder; remove it")
        for name in (SAMPLES_NAME, STATE_NAME):
            if os.path.lexists(run / name):
                os.close(open_run_file(run / name, f"the run's {name}"))  # a link or FIFO is refused, not archived
        archive.mkdir(parents=True, exist_ok=True)
        moved = []
        for name in (SAMPLES_NAME, STATE_NAME):
            src = run / name
            if os.path.lexists(src):
                os.replace(src, archive / name)  # atomic within the folder's filesystem
                moved.append(name)
        fsync_dir(archive)
        fsync_dir(run)
        old = {"floors": dict(cfg["mixture"].get("floors", {})), "caps": dict(cfg["mixture"].get("caps", {}))}
        phase = int(cfg["mixture"].get("phase", 0)) + 1
        cfg["mixture"].update(policy.to_dict())
        cfg["mixture"]["phase"] = phase
        history = History(run / HISTORY_NAME)
        history.event("pivot", step=step, phase=phase, old_policy=old, new_policy=policy.to_dict(),
                      archived=[f"archive/pivot_{step:06d}/{n}" for n in moved], trainer=stopped)
        history.sync()
        history.close()
        write_atomic(cfg_path, [json.dumps(cfg, indent=2).encode() + b"\n"])
    finally:
        lock.release()
    command = _train_command(run)
    report = {"step": step, "phase": phase, "archive": str(archive), "archived": moved, "policy": policy.to_dict(),
              "stopped": stopped, "command": " ".join(command), "restarted": None}
    if restart:
        log = open(run / "train.log", "ab")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=os.getcwd())
        log.close()
        report["restarted"] = proc.pid
    return report


def _train_command(run: Path) -> list[str]:
    """How the run goes on: ``ripresa train --run RUN``; a sharded run (newest generation a ``.dcp``) under
    ``python -m ripresa.torchrun`` with its saved world size and ``--shard fsdp`` (docs/SHARDED.md)."""
    gen = _newest_generation(run)
    if gen is not None and gen.kind == "dcp":
        return [sys.executable, "-m", "ripresa.torchrun", "--standalone", f"--nproc_per_node={gen.world_size or 1}",
                "-m", "--", "ripresa", "train", "--run", str(run), "--shard", "fsdp"]
    return [sys.executable, "-m", "ripresa", "train", "--run", str(run)]
