"""``ripresa pivot``: a policy change of a run's data mixture without retraining.

Validate the new policy first; stop the trainer (SIGUSR1 and wait for the commit, SIGTERM and wait
for the lock), signalling only through :func:`ripresa.io.lock.signal_holder`; with the lock held,
move ``.samples.json`` and ``.state.json`` to ``archive/pivot_NNNNNN/`` and write the new policy into
``config.json``; push one mirror round when the run mirrors; ``--restart`` the trainer (a child that
runs ripresa's own code, :mod:`ripresa.io.child`) with the flags of its last ``launch`` record, or
print that command. The steps and guarantees: docs/ENGINE.md, "Pivot and fork" and "Restart after a
pivot"; the signals: docs/FAULTS.md, "Signalling the trainer".
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.numbers import checked_number
from ..errors import BadInput, CheckFailed, RipresaError, SaveFailed
from ..io import auth
from ..io.child import child_env, ripresa_argv
from ..io.fsio import fsync_dir, open_run_file
from ..io.lock import NotRunning, RunLock, is_locked, signal_holder
from ..store.history import HISTORY_NAME, History, HistoryReader
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


def _newest_generation(run: Path, *, deep: bool = False) -> Any:
    """The newest valid generation of any kind (``.bin``, general, a sharded ``.dcp``): what a resume takes."""
    from ..store.backend import latest_valid_of, registered

    return latest_valid_of(run, tuple(registered()), deep=deep, warn=False, store=CheckpointStore(run, writer=False))


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
    launch = read_launch(run)  # a malformed record is refused here too, before anything is stopped
    log_path = run / "train.log"
    if restart:
        restart_command(run, launch, _newest_generation(run))  # e.g. a redacted mirror URL, a world size too large
        if os.path.lexists(log_path):
            os.close(open_run_file(log_path, "the run's train.log", mode="append"))  # a link or FIFO: refused now
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
        phase = checked_number(cfg["mixture"].get("phase", 0), file="config.json", field="mixture.phase", lo=0, hi=2**31 - 1, error=BadInput) + 1
        cfg["mixture"].update(policy.to_dict())
        cfg["mixture"]["phase"] = phase
        history = History(run / HISTORY_NAME)
        history.event("pivot", step=step, phase=phase, old_policy=old, new_policy=policy.to_dict(),
                      archived=[f"archive/pivot_{step:06d}/{n}" for n in moved], trainer=stopped)
        history.sync()
        history.close()
        auth.write_signed_run_file(cfg_path, json.dumps(cfg, indent=2).encode() + b"\n")
    finally:
        lock.release()
    report = {"step": step, "phase": phase, "archive": str(archive), "archived": moved, "policy": policy.to_dict(),
              "stopped": stopped, "launch": launch, "mirrored": None, "command": None, "no_command": None,
              "restarted": None}
    mirror = (launch or {}).get("options", {}).get("mirror")
    if mirror is not None:
        report["mirrored"] = _push_pivot(run, mirror)  # before the new phase trains (docs/ENGINE.md)
    try:
        command = restart_command(run, launch, _newest_generation(run))
    except BadInput as exc:
        if restart:
            raise
        report["no_command"] = str(exc)  # the pivot is done; say why no command is printed
        return report
    report["command"] = " ".join(shlex.quote(c) for c in command)
    if restart:
        fd = open_run_file(log_path, "the run's train.log", mode="create_append")  # never through a link or FIFO
        try:
            proc = subprocess.Popen(command, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=os.getcwd(), env=child_env())
        finally:
            os.close(fd)
        report["restarted"] = proc.pid
    return report


#: The most ranks a ``pivot --restart`` starts on one machine (also bounded by 4x its CPU count).
MAX_NPROC = 1024


def max_nproc() -> int:
    """How many ranks a restart may start here: ``min(MAX_NPROC, 4 x os.cpu_count())``."""
    return min(MAX_NPROC, 4 * max(1, os.cpu_count() or 1))


def read_launch(run: Path) -> dict[str, Any] | None:
    """The run's last ``launch`` event (``ripresa train``'s record of its options, without event/time), or None.

    Read line by line (memory bounded by the longest line, whatever the
    history's size); a record that is not a dict of known options with the
    expected types is a :class:`BadInput` (exit 2): it is replayed as a
    command, so nothing in it is guessed or passed through unchecked.
    """
    path = run / HISTORY_NAME
    if not os.path.lexists(path):
        return None
    last = None
    for _, rec in HistoryReader(path):  # opened without following a link, never waiting on a FIFO
        if isinstance(rec, dict) and rec.get("event") == "launch":
            last = {k: v for k, v in rec.items() if k not in ("event", "time")}
    if last is None:
        return None
    _check_launch(last, path)
    return last


def _bad_record(path: Path, expected: str, found: Any) -> BadInput:
    return BadInput("the run's launch record is malformed", file=path, expected=expected, found=repr(found)[:120],
                    hint="the restart command is rebuilt from it; pivot without --restart and start the trainer yourself")


def _is_int(x: Any, lo: int = 0, hi: int = 2**63 - 1) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _is_text(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= 4096 and "\x00" not in x and x.isprintable()


def _check_launch(rec: Any, path: Path) -> None:
    from .gpt.train import LAUNCH_OPTIONS

    if not isinstance(rec, dict) or not isinstance(rec.get("options"), dict):
        raise _bad_record(path, "a launch record with options", rec)
    o = rec["options"]
    unknown = set(o) - set(LAUNCH_OPTIONS) - {"require_signature"}
    if unknown:
        raise _bad_record(path, f"options among {sorted(LAUNCH_OPTIONS)}", sorted(unknown))
    checks = {
        "steps": lambda v: v is None or _is_int(v), "every": lambda v: v is None or v == "auto" or _is_int(v),
        "threads": lambda v: v is None or _is_int(v, 0, 4096), "device": lambda v: v in ("auto", "cpu", "cuda"),
        "shard": lambda v: v in ("ddp", "fsdp"), "mirror": lambda v: v is None or _is_text(v),
        "mtbf": lambda v: v is None or _is_text(v), "max_redo": lambda v: v is None or _is_text(v),
        "deadline": lambda v: v is None or _is_text(v), "memory_every": lambda v: v is None or _is_int(v),
        "probe_every": lambda v: v is None or _is_int(v),
        **{k: (lambda v: isinstance(v, bool)) for k in ("audit", "asynchronous", "quiet", "allow_version_change",
                                                        "allow_code_change", "allow_data_change", "require_signature")},
    }
    for key, ok in checks.items():
        if key in o and not ok(o[key]):
            raise _bad_record(path, f"a valid {key}", o[key])
    for key in ("world_size", "local_world_size"):
        if key in rec and not _is_int(rec[key], 1):
            raise _bad_record(path, f"{key} >= 1", rec[key])
    from ..session.cadence import parse_duration, parse_max_redo
    from ..session.deadline import deadline_time

    try:  # what the restarted trainer would refuse, refused here (before anything is stopped)
        if o.get("mtbf") is not None:
            parse_duration(o["mtbf"], "--mtbf")
        parse_max_redo(o.get("max_redo"))
        if o.get("deadline") is not None and not any(c in o["deadline"] for c in "-:T"):
            raise BadInput("the recorded deadline is not a time", expected="an ISO time", found=o["deadline"])
        if o.get("deadline") is not None:
            deadline_time(o["deadline"])
    except BadInput as exc:
        raise _bad_record(path, exc.expected or "a valid --mtbf, --max-redo or --deadline", exc.found) from None


def _replayed_flags(launch: dict[str, Any] | None, run: Path) -> list[str]:
    """The recorded process flags as ``--opt=value`` (never a value read as another option)."""
    if launch is None:
        return []
    o = launch["options"]
    flags = []
    for key in ("steps", "every", "threads", "mtbf", "max_redo", "deadline", "memory_every", "probe_every"):
        if o.get(key) is not None and not (key in ("memory_every", "probe_every") and o[key] == 0):
            flags.append(f"--{key.replace('_', '-')}={o[key]}")
    if o.get("device", "auto") != "auto":
        flags.append(f"--device={o['device']}")
    mirror = o.get("mirror")
    if mirror is not None:
        if "***@" in mirror:
            raise BadInput("the run's mirror URL was recorded without its password", file=run / HISTORY_NAME,
                           expected="a mirror URL the restart can use", found=mirror,
                           hint="give the credentials through the environment (AWS_*), or pivot without --restart "
                                "and start `ripresa train --run RUN --mirror URL` yourself")
        flags.append(f"--mirror={mirror}")
    for key, flag, default in (("audit", "--no-audit", True), ("asynchronous", "--sync", True),
                               ("quiet", "--quiet", False)):
        if o.get(key, default) != default:
            flags.append(flag)
    for key in ("allow_version_change", "allow_code_change", "allow_data_change", "require_signature"):
        if o.get(key):
            flags.append(f"--{key.replace('_', '-')}")
    return flags


def restart_command(run: Path, launch: dict[str, Any] | None, gen: Any) -> list[str]:
    """How the run goes on: ``ripresa train --run RUN`` with the recorded flags (see the module doc).

    Under ``python -m ripresa.torchrun`` when the run was sharded (its newest
    generation a ``.dcp``, or a ``launch`` record with more than one rank).
    The world size of a ``.dcp`` run is the newest *fully verified*
    generation's (every hash; the signature when signatures are required),
    never a shallow look at a folder anyone may plant; whatever its source it
    must be at most :func:`max_nproc`, else :class:`BadInput` (exit 2).
    """
    flags = _replayed_flags(launch, run)
    shard = (launch or {}).get("options", {}).get("shard", "ddp")
    world = checked_number((launch or {}).get("world_size", 1), file=run, field="launch.world_size", lo=1, hi=2**20,
                           error=BadInput)
    from ..store.backend import spec_of

    if gen is not None and spec_of(gen.kind).collective:  # a sharded kind (.dcp)
        verified = _newest_generation(run, deep=True)
        if verified is None or not spec_of(verified.kind).collective or not _is_int(verified.world_size, 1):
            raise BadInput("the sharded run's world size cannot be taken from a verified generation", file=run,
                           expected="a .dcp generation that passes its deep check (every hash, the signature "
                                    "when required)", found=f"newest verified: {getattr(verified, 'path', None)}",
                           hint="ripresa inspect RUN --deep; restart it yourself with "
                                "python -m ripresa.torchrun --nproc_per_node=N -m ripresa train --run RUN --shard fsdp")
        world, shard = verified.world_size, "fsdp"
    train = ["train", "--run", str(run), *flags]
    if world <= 1 and shard != "fsdp":
        return ripresa_argv(*train)
    if launch is not None and launch.get("local_world_size", world) != world:
        raise BadInput("the run trained on several machines; a pivot restarts it on this one only", file=run,
                       expected="a single-machine run", found=f"world size {world}, {launch.get('local_world_size')} "
                       "rank(s) on the starting machine", hint="pivot without --restart and start every node yourself")
    if world > max_nproc():
        raise BadInput("the run's world size is more than this machine starts", file=run,
                       expected=f"at most {max_nproc()} ranks (min({MAX_NPROC}, 4 x {os.cpu_count()} CPUs))",
                       found=f"{world} ranks", hint="restart it yourself with "
                       "python -m ripresa.torchrun --standalone --nproc_per_node=N -m ripresa train --run RUN ...")
    if shard == "fsdp":
        train += ["--shard", "fsdp"]
    return ripresa_argv("--standalone", f"--nproc_per_node={world}", "-m", "--", "ripresa", *train,
                        module="ripresa.torchrun")


def _push_pivot(run: Path, url: str) -> dict[str, Any]:
    """One mirror round (``ripresa mirror push``): the pivot generation and the new ``config.json`` uploaded."""
    from ..store.mirror import cli_push

    try:
        return cli_push(run, url)
    except RipresaError as exc:
        raise SaveFailed("the pivot is done, but its state could not reach the run's mirror", file=url,
                         expected="the pivot generation and config.json uploaded before the new phase trains",
                         found=exc.message, hint="run `ripresa mirror push RUN`, then the printed command "
                         "(the trainer was not restarted)") from exc
