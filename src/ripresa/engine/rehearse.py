"""``ripresa rehearse RUN``: a rented machine's save–stop–pull–resume cycle, rehearsed at the start of the rental.

docs/OPERATIONS.md, "Rehearse the rental's cycle at the start". On scratch copies only — the run folder and
the committed generations of its mirror are never written:

1. **start**: the run's newest valid generation, copied hash-verified (``ripresa fork`` machinery) into a
   scratch folder; a run folder without one takes the mirror's newest (``ripresa mirror pull``, read-only on
   the mirror); a new run trains ``k`` steps from its config.
2. **train, save, stop**: ``ripresa train`` in a child process resumes that generation in a blank scratch run
   that mirrors to a *scratch prefix of the same store* (its credentials, its bandwidth), trains ``k`` steps
   and gets a real SIGTERM: it saves, uploads and exits.
3. **pull**: the stop generation is pulled from the scratch prefix into a brand-new blank folder.
4. **resume**: ``ripresa train`` resumes the pulled folder for ``k`` more steps.
5. **uninterrupted**: the same steps without the stop, from the same start, in one process.
6. **compare**: the two final generations, bit for bit (the ``.bin``: weights, m, v; the companion's state:
   progress, optimizer, data position, mixture, every random stream).
7. **export**: the stop generation exported (``ripresa export``), the last part of a deadline's tail.

Each step's time and bytes are measured and set against the rental's deadline (docs/CADENCE.md, "Deadline");
the scratch prefix and the scratch folders are removed, the report stays in ``--output``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..console import progress
from ..errors import BadInput, OutputExists, RipresaError, SaveFailed
from ..formats.companion import read_companion
from ..io.child import child_env, ripresa_argv
from ..io.fsio import open_run_file, write_atomic
from ..io.objstore import LocalStore, ObjectStore, open_store
from ..io.redact import redact_url
from ..session.cadence import median
from ..session.deadline import Deadline, deadline_time
from ..store.history import HISTORY_NAME, read_history
from ..store.kinds import latest_valid_any, latest_valid_of
from ..store.mirror import MIRROR_MARKER, RemoteView, cli_pull, resolve_url, retrying
from ..text import escape_markup
from ..verify.compare import first_difference
from .demo import wait_for_step

#: The parts of a companion's ``state`` that are the training state (the rest describes the process: versions,
#: code, config, lineage), compared bit for bit with the ``.bin``.
STATE_PARTS = ("progress", "optimizer", "scheduler", "scaler", "data", "objects", "rng")
#: The longest a child may take to reach its step or to stop (a hang guard, seconds).
PHASE_TIMEOUT = 3600.0
#: Steps of the cycle in the report (``steps``), in order; ``cycle`` sums the real-world ones.
CYCLE = ("stop", "pull", "resume")
REPORT_NAME = "rehearsal.json"
LOG_NAME = "rehearsal.log"


class RehearsalWarning(UserWarning):
    """The rehearsal's measured end of the rental does not fit the deadline (or the session's plan of it)."""


# ----------------------------------------------------------------------------- the scratch prefix
def scratch_for(url: str, tag: str) -> str:
    """The scratch prefix beside the mirror ``url``: ``/disk/mirror`` → ``/disk/mirror<tag>``,
    ``s3://b/runs/gpt`` → ``s3://b/runs/gpt<tag>`` (same store, another prefix: nothing of the mirror's)."""
    if "://" not in url:
        p = Path(url).expanduser().absolute()
        if not p.name:
            raise BadInput("the mirror is a file system's root: no scratch folder beside it", found=url,
                           hint="name one with --scratch PATH")
        return str(p.with_name(p.name + tag))
    u = urlparse(url)
    prefix = u.path.strip("/")
    if not prefix:
        raise BadInput("the mirror is a whole bucket or folder: no scratch prefix beside it", found=redact_url(url),
                       expected="a mirror URL with a prefix, e.g. s3://bucket/runs/gpt",
                       hint="name an empty scratch prefix with --scratch s3://bucket/scratch")
    return f"{u.scheme}://{u.netloc}/{prefix}{tag}"


def _location(url: str) -> tuple[str, str]:
    """(store, path) of a URL, to tell whether one lies inside another."""
    if "://" not in url:
        return "file", str(Path(url).expanduser().absolute()).rstrip("/")
    u = urlparse(url)
    return (u.scheme if u.scheme != "file" else "file") + ("://" + u.netloc if u.scheme == "s3" else ""), "/" + u.path.strip("/")


def _check_scratch(scratch: str, mirror: str, run: Path) -> ObjectStore:
    """The scratch store: neither the mirror nor inside it (nor it inside the scratch), not in the run folder,
    and empty (nothing in it is anyone's: the rehearsal removes it whole at the end)."""
    (sa, sp), (ma, mp) = _location(scratch), _location(mirror)
    if sa == ma and (sp == mp or sp.startswith(mp.rstrip("/") + "/") or mp.startswith(sp.rstrip("/") + "/")):
        raise BadInput("the scratch prefix overlaps the mirror", found=redact_url(scratch),
                       expected=f"a prefix beside {redact_url(mirror)}, not in it",
                       hint="the rehearsal never writes into the mirror: name another --scratch")
    store = open_store(scratch)
    if isinstance(store, LocalStore):
        here = str(run.resolve())
        if sp == here or sp.startswith(here + "/"):
            raise BadInput("the scratch folder is inside the run folder", found=scratch, hint="name another --scratch")
        if os.path.lexists(store.root):
            raise OutputExists("the scratch folder exists", file=store.root, expected="a new folder",
                               hint="the rehearsal removes its scratch whole: it never reuses one")
    elif retrying(lambda: store.entries(1)):
        raise OutputExists("the scratch prefix is not empty", file=redact_url(scratch), expected="an empty prefix",
                           hint="the rehearsal removes its scratch whole: name an empty --scratch")
    return store


def remove_scratch(store: ObjectStore) -> bool:
    """Remove everything under the scratch prefix (a folder: the folder); True when nothing is left."""
    if isinstance(store, LocalStore):
        if os.path.islink(store.root) or (os.path.lexists(store.root) and not store.root.is_dir()):
            return False  # not what the rehearsal created: left alone
        shutil.rmtree(store.root, ignore_errors=True)
        return not os.path.lexists(store.root)
    for _ in range(1000):  # at most 1000 listings of 1000 keys
        keys = retrying(lambda: store.entries(1000))
        if not keys:
            return True
        for key in sorted(keys, key=lambda k: not k.endswith(".sha256")):  # markers first: never a half generation
            try:
                retrying(lambda k=key: store.delete(k))
            except ValueError:  # not a key ripresa writes: not the rehearsal's, left alone
                return False
    return False


# ----------------------------------------------------------------------------- measurements
def _size(path: Path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0


def _tree_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder`` (no link followed)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        total += sum(_size(Path(root) / f) for f in files)
    return total


def _generation_bytes(gen: Any) -> int:
    """Bytes of a generation's files: the ones its marker vouches for, the marker, a signature."""
    folder = gen.marker.parent
    return sum(_size(folder / name) for name in gen.files) + _size(gen.marker) + _size(Path(f"{gen.path}.hmac"))


def _events(run: Path, name: str, step: int | None = None) -> list[dict[str, Any]]:
    return [e for e in read_history(run / HISTORY_NAME).events
            if e.get("event") == name and (step is None or e.get("step") == step)]


def _last_since(run: Path, name: str, t0: float) -> dict[str, Any]:
    """The last ``name`` event of ``run``'s history written at or after ``t0`` (``{}``: none)."""
    return next((e for e in reversed(_events(run, name)) if _num(e.get("time"), t0) >= 0), {})


def _step_seconds(run: Path) -> float | None:
    """The median time of one step in ``run``'s history (consecutive step lines)."""
    steps = read_history(run / HISTORY_NAME).steps
    times = [(s, r.get("time")) for s, r in sorted(steps.items())]
    gaps = [b[1] - a[1] for a, b in zip(times, times[1:], strict=False) if b[0] == a[0] + 1
            and isinstance(a[1], (int, float)) and isinstance(b[1], (int, float)) and b[1] >= a[1]]
    return median(gaps)


def _launch_options(run: Path) -> dict[str, Any]:
    """The options of the run's last ``ripresa train`` launch (its history's ``launch`` event), checked: the
    device, threads, audit and save mode the rehearsal's trainers use, and the deadline it was given."""
    try:
        events = read_history(run / HISTORY_NAME).events if os.path.lexists(run / HISTORY_NAME) else []
    except RipresaError:
        return {}
    launch = next((e.get("options") for e in reversed(events) if e.get("event") == "launch"), None)
    if not isinstance(launch, dict):
        return {}
    out: dict[str, Any] = {}
    if launch.get("device") in ("auto", "cpu", "cuda"):
        out["device"] = launch["device"]
    threads = launch.get("threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and 0 < threads <= 4096:
        out["threads"] = threads
    for key in ("audit", "asynchronous"):
        if isinstance(launch.get(key), bool):
            out[key] = launch[key]
    if isinstance(launch.get("deadline"), str) and len(launch["deadline"]) <= 64:
        out["deadline"] = launch["deadline"]
    return out


# ----------------------------------------------------------------------------- the children
class _Children:
    """The rehearsal's ``ripresa train`` children: ripresa's own code (io/child.py), output into one log."""

    def __init__(self, log: int, timeout: float, device: str | None, threads: int | None) -> None:
        self.log, self.timeout, self.device, self.threads = log, timeout, device, threads
        self.env = child_env(PYTHONDONTWRITEBYTECODE="1", RIPRESA_PROGRESS="0")
        self.flags: list[str] = []
        self.use({})

    def use(self, launch: dict[str, Any]) -> list[str]:
        """The trainers' flags: the device, threads, audit and save mode of ``launch`` (a run's last launch,
        :func:`_launch_options`), ``--device``/``--threads`` over them."""
        self.flags = [f"--device={self.device or launch.get('device', 'auto')}"]
        if self.threads or launch.get("threads"):
            self.flags.append(f"--threads={self.threads or launch['threads']}")
        if launch.get("audit") is False:
            self.flags.append("--no-audit")
        if launch.get("asynchronous") is False:
            self.flags.append("--sync")
        return self.flags

    def start(self, *args: str) -> subprocess.Popen:
        os.write(self.log, f"\n$ ripresa train {' '.join(args)}\n".encode())
        return subprocess.Popen(ripresa_argv("train", *args, "--quiet", *self.flags), stdout=self.log,
                                stderr=subprocess.STDOUT, env=self.env)

    def run(self, *args: str) -> tuple[float, float]:
        """Run one trainer to its end; (its start, its end) as POSIX times. A failure is :class:`SaveFailed`."""
        t0 = time.time()
        proc = self.start(*args)
        rc = None
        try:
            rc = proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:  # a timeout, or Ctrl-C: no trainer outlives the rehearsal (its folders are removed next)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if rc != 0:
            raise SaveFailed("a rehearsal trainer failed", expected="exit 0", found=f"exit {rc}" if rc is not None
                             else f"no end within {self.timeout:.0f} s", hint=f"its output is in {LOG_NAME}")
        return t0, time.time()


@contextmanager
def _step(bar_total: int, i: int, text: str, quiet: bool) -> Iterator[None]:
    """One step of the rehearsal on the progress line (ripresa.console.progress: stderr, a terminal only)."""
    with progress("count", quiet=quiet) as bar:
        bar.add_task(escape_markup(text, newlines=False), total=bar_total, completed=i - 1, unit="steps")
        yield


def _valid(folder: Path) -> Any:
    gen = latest_valid_of(folder, ("bin",), deep=True, warn=False)
    if gen is None:
        raise SaveFailed("a rehearsal trainer left no valid generation", file=folder, expected="a committed .bin",
                         found="none", hint=f"its output is in {LOG_NAME}")
    return gen


# ----------------------------------------------------------------------------- the rehearsal
def rehearse(run: Path, *, output: Path | None = None, mirror: str | None = None, scratch: str | None = None,
             steps: int = 10, deadline: str | None = None, config: str | None = None, device: str | None = None,
             threads: int | None = None, omit_rng_restore: bool = False, quiet: bool = False,
             timeout: float = PHASE_TIMEOUT) -> dict[str, Any]:
    """Rehearse ``run``'s save–stop–pull–resume cycle (see the module); the report (``exit_code`` 0 or 1).

    Raises a :class:`~ripresa.errors.RipresaError` (exit 2) when the rehearsal could not be done: no mirror,
    a store that cannot be reached, a trainer that failed. ``omit_rng_restore`` is the negative control: the
    resume skips the random streams, and the comparison must fail.
    """
    run = Path(run)
    if steps < 1 or steps > 1_000_000:
        raise BadInput("--steps must be between 1 and 1000000", found=steps)
    if device not in (None, "auto", "cpu", "cuda"):
        raise BadInput("unknown --device", expected="auto, cpu or cuda", found=device)
    if threads is not None and not 0 < threads <= 4096:
        raise BadInput("--threads must be between 1 and 4096", found=threads)
    if os.path.lexists(run) and (os.path.islink(run) or not run.is_dir()):
        raise BadInput("the run is not a folder", file=run, expected="a run folder (ripresa train --run)")
    if mirror is None and not os.path.lexists(run / "mirror.json"):
        raise BadInput("the run has no mirror: there is no cycle to rehearse", file=run / "mirror.json",
                       expected="a run trained with --mirror, or --mirror URL", found="no mirror.json, no --mirror",
                       hint="ripresa rehearse RUN --mirror s3://bucket/prefix (the store `ripresa train --mirror` "
                            "will use; docs/MIRROR.md)")
    url, _explicit = resolve_url(run, mirror, write=True)  # docs/MIRROR.md, "Trust": as `mirror push` follows it
    launch = _launch_options(run) if run.is_dir() else {}
    due = deadline_time(deadline) if deadline is not None else None  # the project's syntax: 72h, 2026-12-24T18:00Z
    if due is not None:
        Deadline(due)  # refuses a deadline passed or more than 100 years ahead, as `ripresa train` does
    if due is None and launch.get("deadline") is not None:  # the run's own, when it is still ahead
        try:
            due = deadline_time(launch["deadline"])
        except BadInput:
            due = None
        if due is not None and due <= time.time():
            due = None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(output) if output is not None else run.parent / f"{run.name}.rehearsal-{stamp}"
    here = run.resolve()
    if out.resolve() == here or here in out.resolve().parents:
        raise BadInput("--output is inside the run folder", file=out, hint="the rehearsal never writes into the run")
    if os.path.lexists(out) and (os.path.islink(out) or not out.is_dir() or any(out.iterdir())):
        raise OutputExists("the rehearsal's --output exists", file=out, expected="a new or empty folder")
    remote = open_store(url)
    remote_keys = retrying(remote.list)  # the store is reachable, with these credentials (else exit 2, typed)
    if not _explicit and MIRROR_MARKER not in remote_keys:
        raise BadInput("the run's mirror.json names a target that is not a mirror: not followed",
                       file=run / "mirror.json", found=redact_url(url), hint="name the mirror with --mirror URL")
    scratch_url = scratch or scratch_for(url, f".rehearsal-{stamp}-{secrets.token_hex(3)}")
    scratch_store = _check_scratch(scratch_url, url, run)

    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir()
    log = open_run_file(out / LOG_NAME, "the rehearsal's log", mode="create_append")
    os.write(log, (f"ripresa rehearse {run}: scratch prefix {redact_url(scratch_url)} and folder {work}; both are "
                   "removed at the end (a rehearsal killed before it: remove them by hand)\n").encode())
    report: dict[str, Any] = {
        "run": str(run), "mirror": redact_url(url), "scratch": redact_url(scratch_url), "output": str(out),
        "trainer_running": _running(run), "k": steps,
        "omit_rng_restore": omit_rng_restore,
    }
    kids = _Children(log, timeout, device, threads)
    kids.use(launch)
    t_all = time.time()
    try:
        report.update(_cycle(run, url, scratch_url, work, kids, steps, config, omit_rng_restore, quiet,
                             bool(RemoteView(remote_keys).committed)))
    except RipresaError as exc:  # not done (exit 2): the report says where it stopped, then the error is raised
        report["error"] = exc.as_dict()
        raise
    finally:
        os.close(log)
        report["cleaned"] = {"scratch": _removed(scratch_store), "work": _remove(work)}
        if "error" in report:
            write_atomic(out / REPORT_NAME, [json.dumps(report, indent=2, default=str).encode() + b"\n"])
    report["wall_s"] = round(time.time() - t_all, 3)
    report.update(verdict(report, due))
    write_atomic(out / REPORT_NAME, [json.dumps(report, indent=2).encode() + b"\n"])
    return report


def _running(run: Path) -> bool:
    """Whether a trainer holds ``run`` now (a probe of its lock that takes nothing; a LOCK that is a link or a
    FIFO: False, it is no trainer's)."""
    from ..io.lock import is_locked

    try:
        return run.is_dir() and os.path.lexists(run / "LOCK") and is_locked(run)
    except (RipresaError, OSError):
        return False


def _removed(store: ObjectStore) -> bool:
    """:func:`remove_scratch`, never raising over the error that ended the rehearsal (False: some is left)."""
    try:
        return remove_scratch(store)
    except (RipresaError, OSError):
        return False


def _remove(folder: Path) -> bool:
    shutil.rmtree(folder, ignore_errors=True)
    return not os.path.lexists(folder)


def _start(run: Path, url: str, start_dir: Path, kids: _Children, k: int, config: str | None, has_remote: bool,
           quiet: bool) -> tuple[Any, str]:
    """The rehearsal's start in ``start_dir``: (its generation, where it came from: run, mirror or config)."""
    from .fork import fork

    gen = latest_valid_any(run, deep=False, warn=False) if run.is_dir() else None
    if gen is not None and gen.kind not in ("bin", "dcp"):
        raise BadInput("the run's generations are not the ANDREA engine's", file=gen.path,
                       expected="a `ripresa train` run (.bin or .dcp generations)", found=gen.kind,
                       hint="ripresa rehearse rehearses `ripresa train --mirror` runs")
    if gen is not None:
        with _step(7, 1, f"start: copying step {gen.step} of the run, hash-verified", quiet):
            for attempt in range(3):  # a live trainer's retention may delete it while it is copied: the newer one
                try:
                    fork(run, gen.step, start_dir)
                    break
                except RipresaError:
                    shutil.rmtree(start_dir, ignore_errors=True)
                    gen = latest_valid_any(run, deep=False, warn=False)
                    if attempt == 2 or gen is None:
                        raise
        return (_valid(start_dir) if gen.kind == "bin" else gen), "run"
    if has_remote:  # a blank machine: the mirror's newest generation (read-only on the mirror)
        cli_pull(start_dir, url)
        return _valid_any(start_dir), "mirror"
    cfg = config or (str(run / "config.json") if (run / "config.json").is_file() else None)
    if cfg is None:
        raise BadInput("nothing to start the rehearsal from", file=run,
                       expected="a generation in the run or its mirror, or a config",
                       found="no generation, no config.json", hint="ripresa rehearse RUN --config tiny|andrea-12m|FILE.toml")
    with _step(7, 1, f"start: a new run, {k} steps of {cfg}", quiet):
        kids.run("--run", str(start_dir), "--config", cfg, "--steps", str(k), "--every", "0")
    return _valid(start_dir), "config"


def _valid_any(folder: Path) -> Any:
    gen = latest_valid_any(folder, deep=True, warn=False)
    if gen is None or gen.kind not in ("bin", "dcp"):
        raise BadInput("the mirror's generation is not the ANDREA engine's", file=folder,
                       expected="a .bin or .dcp generation", found=getattr(gen, "kind", None))
    return gen


def _cycle(run: Path, url: str, scratch_url: str, work: Path, kids: _Children, k: int, config: str | None,
           omit_rng_restore: bool, quiet: bool, has_remote: bool) -> dict[str, Any]:
    """The seven steps (see the module), measured; the report's body."""
    from ..tools.export import export_run
    from .gpt.factory import GPT_FACTORY

    total = 7
    rows: dict[str, dict[str, Any]] = {}
    start_dir, stopped, pulled, straight = work / "start", work / "stopped", work / "pulled", work / "straight"

    # 1. the start: the run's newest generation, else the mirror's, else k steps of the run's config
    t0 = time.time()
    gen, source = _start(run, url, start_dir, kids, k, config, has_remote, quiet)
    if source == "mirror":  # a blank machine: the launch record is in the history the pull restored
        kids.use(_launch_options(start_dir))
    begin, start_main = gen.step, start_dir / gen.path.name
    rows["start"] = {"seconds": time.time() - t0, "bytes": _tree_bytes(start_dir), "step": begin,
                     "what": f"step {begin} from the {source}"}
    cfg_file = str(start_dir / "config.json")

    # 2. train k steps mirroring to the scratch prefix, then the stop: a real SIGTERM
    with _step(total, 2, f"train {k} steps from step {begin}, then SIGTERM (save, upload, exit)", quiet):
        t_launch = time.time()
        proc = kids.start("--run", str(stopped), "--resume", str(start_main), "--config", cfg_file,
                          "--steps", str(begin + 10**9), "--every", "0", "--mirror", scratch_url)
        try:
            wait_for_step(stopped, begin + k, proc, timeout=kids.timeout)
            t_sig = time.time()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=kids.timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        t_exit = time.time()
        if rc != 0:
            raise SaveFailed("the rehearsal's trainer did not stop cleanly on SIGTERM", file=stopped, expected="exit 0",
                             found=f"exit {rc}", hint=f"its output is in {LOG_NAME}")
        stop_gen = _valid(stopped)
        s = stop_gen.step
        saved = next(iter(_events(stopped, "checkpoint", s)), {})
        uploaded = next(iter(_events(stopped, "mirror_uploaded", s)), None)
        if uploaded is None:
            raise SaveFailed("the stop generation was not uploaded to the scratch prefix", file=redact_url(scratch_url),
                             expected=f"a mirror_uploaded event for step {s}", found="none",
                             hint=f"the trainer's output ({LOG_NAME}) names the store's error; credentials that may "
                                  "write only the mirror's prefix: name a --scratch they may write")
        resumed = _last_since(stopped, "resume", t_launch)
        rows["train"] = {"seconds": t_sig - t_launch, "bytes": 0, "step": s,
                         "what": f"start, resume at {begin}, {s - begin} steps", "startup_s": _num(resumed.get("time"), t_launch)}
        rows["save"] = {"seconds": float(saved.get("seconds", 0.0)), "bytes": _generation_bytes(stop_gen),
                        "what": f"step {s}, at the SIGTERM"}
        rows["stop"] = {"seconds": t_exit - t_sig, "bytes": _generation_bytes(stop_gen),
                        "what": "SIGTERM to exit: save, upload"}
        rows["upload"] = {"seconds": float(uploaded.get("seconds", 0.0)), "bytes": int(uploaded.get("bytes", 0)),
                          "what": f"step {s} to the scratch prefix"}
        step_s = _step_seconds(stopped)

    # 3. the pull into a brand-new blank folder (its own progress line)
    t0 = time.time()
    cli_pull(pulled, scratch_url, step=s)
    rows["pull"] = {"seconds": time.time() - t0, "bytes": _tree_bytes(pulled),
                    "what": f"step {s} into a blank folder"}
    resume_bytes = _generation_bytes(_valid(pulled))

    # 4. the resume of the pulled folder, k more steps
    end = s + k
    with _step(total, 4, f"resume the pulled folder at step {s}, {k} steps", quiet):
        extra = ("--omit-rng-restore",) if omit_rng_restore else ()
        t0, t1 = kids.run("--run", str(pulled), "--steps", str(end), "--every", "0", *extra)
        back = _last_since(pulled, "resume", t0)  # the pulled history holds the first trainer's too
        rows["resume"] = {"seconds": _num(back.get("time"), t0), "bytes": resume_bytes,
                          "what": "process start to resumed", "train_s": round(t1 - t0, 3)}

    # 5. the same steps, uninterrupted
    with _step(total, 5, f"the same steps uninterrupted, {begin}→{end}", quiet):
        t0, t1 = kids.run("--run", str(straight), "--resume", str(start_main), "--config", cfg_file,
                          "--steps", str(end), "--every", "0")
        rows["uninterrupted"] = {"seconds": t1 - t0, "bytes": 0, "what": f"steps {begin}→{end}, one process"}

    # 6. the comparison, bit for bit
    with _step(total, 6, f"compare step {end}, bit for bit", quiet):
        t0 = time.time()
        comparison = compare_generations(straight, pulled, end)
        rows["compare"] = {"seconds": time.time() - t0, "bytes": comparison.pop("bytes"),
                           "what": f"step {end}, bit for bit"}

    # 7. the export of the stop generation: the last part of a deadline's tail (docs/CADENCE.md)
    with _step(total, 7, f"export step {s} (the deadline's last part)", quiet):
        t0 = time.time()
        export_run(stopped, work / "export", model_factory=GPT_FACTORY, step=s, show_progress=False)
        rows["export"] = {"seconds": time.time() - t0, "bytes": _tree_bytes(work / "export"),
                          "what": f"step {s}, verified"}

    for r in rows.values():
        r["seconds"] = round(max(0.0, r["seconds"]), 3)
    return {"start": {"source": source, "step": begin}, "flags": kids.flags, "stop_step": s, "end_step": end, "step_s": step_s,
            "steps": rows, "compare": comparison,
            "cycle": {"seconds": round(sum(rows[n]["seconds"] for n in CYCLE), 3),
                      "bytes": rows["save"]["bytes"] + rows["upload"]["bytes"] + rows["pull"]["bytes"]}}


def _num(t: Any, since: float) -> float:
    return float(t) - since if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


def compare_generations(a: Path, b: Path, step: int) -> dict[str, Any]:
    """Generation ``step`` of folders ``a`` and ``b``, bit for bit: each deep-checked (every byte hashed against
    its marker), the ``.bin``'s sha256 (step, weights, m, v) and the companion's training state
    (:data:`STATE_PARTS`) compared exactly. ``equal`` and the first difference."""
    ga = latest_valid_of(a, ("bin",), deep=True, warn=False)
    gb = latest_valid_of(b, ("bin",), deep=True, warn=False)
    if ga is None or gb is None or ga.step != step or gb.step != step:
        raise SaveFailed("a rehearsal trainer did not end at its step", expected=f"step {step} in both",
                         found=f"{getattr(ga, 'step', None)} and {getattr(gb, 'step', None)}",
                         hint=f"its output is in {LOG_NAME}")
    diff = None
    if ga.bin_sha256 != gb.bin_sha256:
        diff = f"{ga.path.name}: sha256 {ga.bin_sha256[:16]}… vs {gb.bin_sha256[:16]}… (weights, m or v differ)"
    sa, sb = read_companion(ga.companion)["state"], read_companion(gb.companion)["state"]
    state_diff = first_difference({p: sa.get(p) for p in STATE_PARTS}, {p: sb.get(p) for p in STATE_PARTS}, "state")
    diff = diff or state_diff
    return {"equal": diff is None, "step": step, "first_difference": diff, "state_difference": state_diff,
            "bin_sha256": {"uninterrupted": ga.bin_sha256, "resumed": gb.bin_sha256},
            "bytes": _generation_bytes(ga) + _generation_bytes(gb)}


# ----------------------------------------------------------------------------- the verdict
def human_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 7 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class _Measured:
    """What :meth:`Deadline.replan` reads of a mirror: the measured upload."""

    def __init__(self, seconds: float) -> None:
        self.last_upload_seconds = seconds


def verdict(report: dict[str, Any], due: float | None) -> dict[str, Any]:
    """``passed``, ``exit_code``, the deadline's figures (``due``: a POSIX time, or None) and the one-paragraph
    verdict of a rehearsal's measurements; a :class:`RehearsalWarning` when the end of the rental does not fit."""
    rows, cmp = report["steps"], report["compare"]
    cyc = report["cycle"]
    cycle = (f"the full cycle takes {human_seconds(cyc['seconds'])} and {human_bytes(cyc['bytes'])} (stop "
             f"{human_seconds(rows['stop']['seconds'])}, pull {human_seconds(rows['pull']['seconds'])}, resume "
             f"{human_seconds(rows['resume']['seconds'])})")
    # the end of the rental: the stop (save, upload, close) and the export, measured, plus the session's margin
    tail = rows["stop"]["seconds"] + rows["export"]["seconds"]
    step_s = report.get("step_s") or 0.0
    out: dict[str, Any] = {"passed": cmp["equal"], "exit_code": 0 if cmp["equal"] else 1}
    if due is not None:
        now = time.time()
        plan = Deadline(max(due, now + 0.001), now=now)  # passed during the rehearsal: nothing fits
        plan.saved(rows["save"]["seconds"])
        plan.replan(step_s, _Measured(rows["upload"]["seconds"]), now)
        assert plan.plan is not None
        margin = plan.plan.margin_s
        left = due - now
        planned_tail = plan.plan.save_s + plan.plan.upload_s + plan.plan.export_s
        fits = tail + margin <= left
        out["deadline"] = {"deadline": plan.plan.fields(now)["deadline"], "left_s": round(left, 3),
                           "tail_s": round(tail, 3), "margin_s": round(margin, 3), "fits": fits,
                           "planned_tail_s": round(planned_tail, 3), "plan_covers_tail": tail <= planned_tail + margin}
        end = (f"the end-of-rental stop and export ({human_seconds(tail)} + {human_seconds(margin)} margin) "
               f"{'fit' if fits else 'do NOT fit'} in the {human_seconds(max(0.0, left))} left before the deadline")
        if fits and not out["deadline"]["plan_covers_tail"]:
            end += (f"; but the session plans only {human_seconds(planned_tail + margin)} for them: "
                    f"give --deadline {human_seconds(tail + margin - planned_tail)} earlier than the rental ends")
    else:
        out["deadline"] = None
        end = (f"the end-of-rental stop and export take {human_seconds(tail)} (no deadline known: "
               "--deadline 72h or 2026-12-24T18:00Z sets it against one)")
    if step_s:
        end += f"; one step takes {human_seconds(step_s)}"
    if cmp["equal"]:
        out["verdict"] = (f"PASS: the resume from the mirror equals the uninterrupted run bit for bit at step "
                          f"{cmp['step']}; {cycle}; {end}.")
    else:
        out["verdict"] = (f"FAIL: the resume from the mirror differs from the uninterrupted run at step {cmp['step']}: "
                          f"{cmp['first_difference']}; {cycle}; {end}.")
    d = out["deadline"]
    if d is not None and not d["fits"]:  # one line on stderr through the CLI (docs/FAULTS.md, "Messages")
        warnings.warn(f"the end-of-rental stop and export need {human_seconds(d['tail_s'] + d['margin_s'])} but only "
                      f"{human_seconds(max(0.0, d['left_s']))} are left before the deadline: the final generation would not "
                      "be saved, uploaded and exported in time (docs/CADENCE.md, \"Deadline\")", RehearsalWarning,
                      stacklevel=3)
    elif d is not None and not d["plan_covers_tail"]:
        warnings.warn(f"the session's deadline plan gives the stop and export {human_seconds(d['planned_tail_s'] + d['margin_s'])}"
                      f", less than the {human_seconds(d['tail_s'])} measured: give --deadline earlier than the rental's end",
                      RehearsalWarning, stacklevel=3)
    out["fits"] = None if due is None else out["deadline"]["fits"]
    return out


def render_rehearsal(report: dict[str, Any], console: Any) -> None:
    """The rehearsal as a table of steps (time, bytes, what) and its verdict."""
    from ..console import fit_table

    order = ("start", "train", "save", "stop", "upload", "pull", "resume", "uninterrupted", "compare", "export")
    rows = [[name + (" *" if name in CYCLE else ""), human_seconds(r["seconds"]), human_bytes(r["bytes"]) if r["bytes"] else "—",
             escape_markup(r["what"], newlines=False)]
            for name in order if (r := report["steps"].get(name)) is not None]
    title = f"rehearsal of {escape_markup(report['run'], newlines=False)} (* the cycle)"
    console.print(fit_table(title, ["step", "time", "bytes", "what"], rows, console.width))
    colour = "green" if report["passed"] else "red"
    console.print(f"[{colour}]{escape_markup(report['verdict'])}[/]", highlight=False)
    if report.get("trainer_running"):
        console.print("note: the run's trainer was running: the rehearsal shared the machine with it, so its times "
                      "are upper bounds", highlight=False)
    cleaned = report["cleaned"]
    console.print(f"scratch prefix {escape_markup(report['scratch'], newlines=False)}: "
                  f"{'removed' if cleaned['scratch'] else 'NOT removed'}; report: "
                  f"{escape_markup(str(Path(report['output']) / REPORT_NAME), newlines=False)}", highlight=False)
