"""The live probe: every k-th committed generation replayed in a side process and compared bitwise (docs/VERIFY.md,
"The live probe").

``Checkpointer(probe_every=k)``: at the first cadence generation and then at every k-th one, the session keeps a
compact record — digests — of the state it saved (the state a resume must restore) and of the state after the next
step (:data:`REPLAY_STEPS`): the loss, every parameter and optimizer tensor, the scheduler, the random streams, the
data position and the inputs of the model's training forwards (the data the step drew, sample by sample). Once the
generation is committed it starts the script again — the same command, working folder and environment, plus
:data:`ENV` — as a side process at a lower priority. That process's ``Checkpointer`` (:class:`Replay`) resumes the
generation the way a resume does (in a scratch folder of its own, nothing of the live run touched), records the same
digests after the resume and after the replayed step, writes them and exits at once. The live session compares the
two at a later ``step_done`` (a ``poll``, never a wait) or at ``close``.

A difference is a ``probe_mismatch`` history event and one :class:`ProbeMismatchWarning` line naming what differs
first — a random stream, the data position, a sample of the batch, the scheduler, the loss, a tensor — and the
generation to resume from (the newest one a probe confirmed). A probe that cannot run says so once
(:class:`ProbeOffWarning`, a ``probe_off`` event) and turns itself off. The digests are taken by one function,
:func:`digests`; :func:`compare` reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState
from ..errors import BadInput
from ..io.fsio import write_atomic
from ..store.commit import CheckpointWarning
from .torchrun import launcher_value, parent_of, parse_identity, start_time
from .trajectory import to_json_tree

__all__ = ["ENV", "ProbeMismatchWarning", "ProbeOffWarning", "LiveProbe", "Replay", "compare", "digests", "take_replay"]

#: The environment variable that makes a process a probe's side process.
ENV = "RIPRESA_PROBE"
SCHEMA = "ripresa.probe/1"
_KEYS = {"schema", "generation", "step", "steps", "output", "rank", "parent"}
#: Steps a probe replays after the generation it loaded.
REPLAY_STEPS = 1
#: Rows of a forward input digested one by one (the rest only as a whole).
MAX_ROWS = 4096
#: How long :meth:`LiveProbe.close` waits for a side process still running (seconds).
CLOSE_WAIT_S = 300.0
#: A side process that has not answered this long after it started is stopped and the probe turned off.
TIMEOUT_S = 900.0
#: Differences listed in a ``probe_mismatch`` event.
LISTED = 20
_MAX_DEPTH = 64


class ProbeMismatchWarning(CheckpointWarning):
    """A probe replayed a committed generation and did not get, bit for bit, what the live run computed."""


class ProbeOffWarning(CheckpointWarning):
    """The probe could not run (or could not be trusted to) and turned itself off; training goes on."""


# ---------------------------------------------------------------------------------------------------- digests
def _tensor_digest(t: torch.Tensor) -> str:
    """dtype, shape and the bytes of ``t`` in logical (row-major) order."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _tree_digest(obj: Any) -> str:
    """A JSON-able tree (tensors as nested lists, floats by ``repr``): its digest."""
    raw = json.dumps(to_json_tree(obj), sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()


def _rows(t: torch.Tensor) -> list[str] | None:
    """One digest per row (dim 0) of a forward input: names the sample that differs."""
    if t.dim() == 0 or t.shape[0] > MAX_ROWS or t.shape[0] < 1:
        return None
    return [_tensor_digest(r) for r in t.detach().cpu()]


def _flat(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    """The top-level keys of a state dict, each its own entry (``scheduler.last_epoch``), else the whole."""
    if isinstance(obj, Mapping) and obj:
        for k, v in obj.items():
            out[f"{prefix}.{k}"] = _tree_digest(v)
    else:
        out[prefix] = _tree_digest(obj)


def _rng_entries(state: TrainingState, out: dict[str, Any]) -> None:
    rng = state.rng.state_dict()
    for k, v in rng.items():
        if isinstance(v, Mapping) and k in ("numpy", "torch", "python_random"):
            for n, s in v.items():
                out[f"random stream {k}:{n}"] = _tree_digest(s)
        elif v is not None:
            out[f"random stream {k}"] = _tree_digest(v)


def capture(state: TrainingState, progress: Progress, loss: Any = None, batch: Sequence[Any] | None = None
            ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What :func:`digests` needs, taken on the loop: the small parts digested now (in the order a difference is
    reported: its cause before its effects), the tensors as copies (digested later, off the loop)."""
    small: dict[str, Any] = {}
    for k, v in progress.as_dict().items():
        small[f"progress.{k}"] = str(v)
    if state.data is not None:
        _flat("data position", state.data.state_dict(), small)
    if batch is not None:
        for name, value in batch:
            small[f"batch {name}"] = value
    _rng_entries(state, small)
    if state.scheduler is not None:
        _flat("scheduler", state.scheduler.state_dict(), small)
    opt = state.optimizer
    if opt is not None:
        for g, group in enumerate(opt.param_groups):
            for k, v in group.items():
                if k != "params":
                    small[f"optimizer param_groups[{g}].{k}"] = _tree_digest(v)
    if loss is not None:
        small["loss"] = _tree_digest(float(loss) if not isinstance(loss, int | float) else loss)
    if state.scaler is not None:
        _flat("scaler", state.scaler.state_dict(), small)
    for n, o in sorted(state.objects.items()):
        _flat(f"object {n}", o.state_dict(), small)
    tensors: dict[str, torch.Tensor] = {}
    if opt is not None:
        names = {id(p): n for n, p in state.model.named_parameters()}
        for p, per in opt.state.items():
            if not isinstance(per, Mapping):
                continue
            pname = names.get(id(p), f"#{len(tensors)}")
            for k, v in per.items():
                key = f"optimizer state {pname}.{k}"
                if isinstance(v, torch.Tensor):
                    tensors[key] = _local(v).clone()
                else:
                    small[key] = _tree_digest(v)
    for n, t in state.model.state_dict().items():
        if isinstance(t, torch.Tensor):
            tensors[f"tensor {n}"] = _local(t).clone()
    return small, tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (each rank compares its own), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def digests(state: TrainingState, progress: Progress, loss: Any = None, batch: Sequence[Any] | None = None
            ) -> dict[str, Any]:
    """The record a probe compares: ``{what: digest}`` (a forward input: its digest per sample), in report order.

    The one place the state is digested (a fingerprint of the state may take its place)."""
    small, tensors = capture(state, progress, loss, batch)
    return finish(small, tensors)


def finish(small: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """:func:`capture`'s two halves as one record (the tensors digested here: off the loop on the live side)."""
    order = ("optimizer state", "tensor")  # the moments before the weights: a moment saved wrong changes both
    out = dict(small)
    for prefix in order:
        for k, t in tensors.items():
            if k.startswith(prefix + " "):
                out[k] = _tensor_digest(t)
    out[FINGERPRINT_KEY] = state_fingerprint(tensors)  # last: a difference names its tensor first
    return out


#: The record's entry holding the Merkle root of the weights and moments (docs/INSPECT.md, "The state fingerprint").
FINGERPRINT_KEY = "state fingerprint"


def state_fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """The state fingerprint (``ripresa fingerprint``'s tree, its canonical names) of the weights (``model``),
    moments (``optimizer``) and step counters (``steps``) of :func:`capture`'s tensors: the root of those parts,
    the one the generation's ``model``/``optimizer``/``steps`` parts give in a single-process run."""
    from ..formats.fingerprint import fingerprint_state

    named: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if k.startswith("tensor "):
            named[f"model/{k[len('tensor '):]}"] = t
        elif k.startswith("optimizer state "):
            pname, _, entry = k[len("optimizer state "):].rpartition(".")
            named[f"steps/{pname}" if entry == "step" else f"optimizer/{pname}/{entry}"] = t
    return fingerprint_state(named, threads=1).root


class BatchRecorder:
    """The inputs of the model's training forwards (grad enabled, module in train mode), digested as they come."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[tuple[str, Any]] = []
        self._forwards = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # an evaluation: not part of the step a resume replays
        i = self._forwards
        self._forwards += 1
        items = [(f"input {j}", a) for j, a in enumerate(args)] + [(f"input {k!r}", v) for k, v in sorted(kwargs.items())]
        for name, value in items:
            if isinstance(value, torch.Tensor):
                self.seen.append((f"forward {i} {name}", {"all": _tensor_digest(value), "rows": _rows(value)}))

    def take(self) -> list[tuple[str, Any]]:
        self.close()
        return list(self.seen)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


# ---------------------------------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Difference:
    phase: str  # "restored" (the state right after the resume) or "after step N" (after the replayed step)
    what: str
    detail: str
    order: int = 0  # the entry's place in the live record (a cause before its effects)

    def describe(self) -> str:
        return f"{self.what} ({self.phase}{': ' + self.detail if self.detail else ''})"


def _what(key: str) -> str:
    if key.startswith("batch "):
        return "the batch drawn (" + key[len("batch "):] + ")"
    return key


def compare(live: Mapping[str, Any], replayed: Mapping[str, Any], phase: str) -> list[Difference]:
    """What differs between two records of :func:`digests`, in the live record's order (its cause first)."""
    out: list[Difference] = []
    for order, (key, want) in enumerate(live.items()):
        if key not in replayed:
            out.append(Difference(phase, _what(key), "absent from the replay", order))
            continue
        got = replayed[key]
        if got == want:
            continue
        detail = ""
        if isinstance(want, Mapping) and isinstance(got, Mapping):
            a, b = want.get("rows"), got.get("rows")
            if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
                bad = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
                detail = f"sample{'s' if len(bad) > 1 else ''} {_span(bad)} of {len(a)} differ{'' if len(bad) > 1 else 's'}"
            elif isinstance(a, list) and isinstance(b, list):
                detail = f"{len(a)} rows live, {len(b)} replayed"
        out.append(Difference(phase, _what(key), detail, order))
    for key in replayed:
        if key not in live:
            out.append(Difference(phase, _what(key), "absent from the live run", len(live)))
    return out


def _span(ids: list[int]) -> str:
    return ", ".join(str(i) for i in ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")


# ---------------------------------------------------------------------------------------------------- the side process
@dataclass(frozen=True)
class Replay:
    """What a probe's side process is asked: resume ``generation`` (step ``step``) in ``output/run``, replay
    ``steps`` steps, write ``output/result-rankR.json`` and exit."""

    generation: Path
    step: int
    steps: int
    output: Path
    rank: int

    @property
    def run_dir(self) -> Path:
        return self.output / "run"

    @property
    def result(self) -> Path:
        return self.output / f"result-rank{self.rank}.json"

    def to_env(self) -> dict[str, str]:
        doc = {"schema": SCHEMA, "generation": str(self.generation), "step": self.step, "steps": self.steps,
               "output": str(self.output), "rank": self.rank, "parent": launcher_value()}
        return {ENV: json.dumps(doc)}

    @classmethod
    def parse(cls, raw: str) -> Replay:
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        ok = (isinstance(doc, dict) and doc.get("schema") == SCHEMA and set(doc) == _KEYS
              and isinstance(doc["generation"], str) and doc["generation"] and isinstance(doc["output"], str)
              and doc["output"] and type(doc["step"]) is int and 0 < doc["step"] < 2**62
              and type(doc["steps"]) is int and 0 < doc["steps"] <= 64 and type(doc["rank"]) is int
              and 0 <= doc["rank"] < 2**20 and isinstance(doc["parent"], str))
        if not ok:
            raise BadInput(f"the environment variable {ENV} is set but is not a ripresa probe's", found=raw[:200],
                           expected=f"a JSON object of schema {SCHEMA} with keys {sorted(_KEYS)}",
                           hint=f"only a Checkpointer with probe_every sets {ENV}; unset it to run the script as itself")
        _check_parent(doc["parent"])
        return cls(Path(doc["generation"]), doc["step"], doc["steps"], Path(doc["output"]), doc["rank"])


def _check_parent(value: str) -> None:
    """Trusted only under the live run that set it: that process (pid and start time) must be an ancestor."""
    parsed = parse_identity(value)
    if parsed is None or parsed[1] is None:
        raise BadInput(f"the environment variable {ENV} names no live run (PID:START)", found=value[:60],
                       hint=f"unset {ENV} and run the script again")
    if not sys.platform.startswith("linux"):
        return
    want, start = parsed
    pid: int | None = os.getppid()
    for _ in range(_MAX_DEPTH):
        if pid is None or pid <= 1:
            break
        if pid == want and start_time(pid) == start:
            return
        pid = parent_of(pid)
    raise BadInput(f"the environment variable {ENV} is set, but the live run that set it (pid {want}) is not "
                   "running this process: a value left over or inherited", expected=f"{ENV} only in a probe",
                   hint=f"unset {ENV} (`unset {ENV}`) and run the script again; nothing was touched")


def take_replay() -> Replay | None:
    """This process's probe, taken out of the environment (None: a process of its own)."""
    raw = os.environ.pop(ENV, None)
    return None if raw is None else Replay.parse(raw)


class ReplaySession:
    """The side process's side of a :class:`~ripresa.Checkpointer`: record after the resume and after each
    replayed step, then write the result and leave (nothing after the last replayed step runs)."""

    def __init__(self, replay: Replay, state: TrainingState) -> None:
        self.replay, self.state = replay, state
        self.doc: dict[str, Any] = {"schema": SCHEMA, "step": replay.step, "rank": replay.rank, "restored": None,
                                    "steps": {}, "error": None}
        self.batch: BatchRecorder | None = None
        self._parent = os.getppid()
        try:
            os.nice(10)  # training keeps the cores first
        except OSError:
            pass

    def resumed(self, step: int, progress: Progress) -> None:
        if step != self.replay.step:
            self._leave(f"the script's resume() restored step {step}, not the probed generation's {self.replay.step}")
        self.doc["restored"] = digests(self.state, progress)
        self.batch = BatchRecorder(self.state.model)

    def step_done(self, step: int, progress: Progress, metrics: Mapping[str, Any]) -> None:
        if self.doc["restored"] is None:
            self._leave(f"step_done({step}) before resume(): the probe replays a script that calls resume() first")
        if step != self.replay.step + len(self.doc["steps"]) + 1:
            self._leave(f"step_done({step}) after the resume of step {self.replay.step}: steps do not follow on")
        batch = self.batch.take() if self.batch is not None else []
        self.doc["steps"][str(step)] = digests(self.state, progress, metrics.get("loss"), batch)
        if len(self.doc["steps"]) >= self.replay.steps:
            self._leave(None)
        self.batch = BatchRecorder(self.state.model)

    def _leave(self, error: str | None) -> None:
        self.doc["error"] = error
        try:
            write_atomic(self.replay.result, [json.dumps(self.doc).encode()])
            if os.getppid() != self._parent:  # the live run has ended (killed): nobody reads it, nothing left behind
                shutil.rmtree(self.replay.output, ignore_errors=True)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os._exit(0 if error is None else 3)  # nothing of the script after the replayed step runs


# ---------------------------------------------------------------------------------------------------- the live side
def _relaunch_command() -> tuple[list[str] | None, str | None]:
    """This process's own command line, or why it cannot be started again."""
    main = sys.modules.get("__main__")
    if main is None or not (getattr(main, "__file__", None) or getattr(main, "__spec__", None)):
        return None, "this process is interactive (no script to start again); pass probe_command"
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or Path(getattr(main, "__file__", "") or "").name
    if "pytest" in name or Path(sys.argv[0] if sys.argv else "").name in ("pytest", "py.test"):
        return None, "this process is a test runner; pass probe_command"
    argv = list(getattr(sys, "orig_argv", []) or [])
    if not argv or "-c" in argv[1:2]:
        return None, "this process was started with -c; pass probe_command"
    return [sys.executable, *argv[1:]], None


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read(256).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Probe:
    """One probe in flight: the generation, the live record, the side process."""

    step: int
    folder: Path
    live: dict[str, Any]
    restored: Any = None  # a Future of the live record at the save
    after: Any = None  # a Future of the live record after the replayed step
    path: Path | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    batch: BatchRecorder | None = None
    launched: bool = False
    compared: bool = False


class LiveProbe:
    """``probe_every`` of a live session (see the module doc)."""

    def __init__(self, every: int, state: TrainingState, event: Callable[..., Any], dist: Any = None,
                 command: Sequence[str] | None = None) -> None:
        self.every, self.state, self.event, self.dist = int(every), state, event, dist
        self.main = dist is None or dist.is_main
        self.rank = 0 if dist is None else dist.rank
        self.cwd = os.getcwd()
        self.off: str | None = None
        self.generations = 0  # cadence generations saved
        self.probed = 0
        self.skipped = 0
        self.confirmed: int | None = None  # the newest generation a probe confirmed
        self.confirmed_path: str | None = None
        self.mismatches: list[dict[str, Any]] = []
        self.current: _Probe | None = None
        self._pool: Any = None
        self._paths: dict[int, Path] = {}
        if command is not None:
            self.command: list[str] | None = [str(a) for a in command]
        else:
            self.command, why = _relaunch_command()
            if why is not None:
                self.turn_off(why)
        if dist is not None and getattr(dist, "sharded", False):
            self.turn_off("a sharded (FSDP2) session is not probed yet; docs/VERIFY.md, \"The live probe\"")
        self.off_at_start = self.off is not None  # the same on every rank: no collective is ever asked of it

    # ---- hooks of the Checkpointer
    def pinning(self, previous: Callable[[Any], Any] | None) -> Callable[[Any], set[int]]:
        """The run folder's ``pinned`` (what retention keeps): ``previous``'s steps and the generation a probe
        has yet to read (a side process that starts a few seconds later finds it in place)."""
        def pinned(valid: Any) -> set[int]:
            steps = list(valid)
            keep = set(previous(steps)) if previous is not None else set()
            p = self.current
            if p is not None and p.step in steps:
                keep.add(p.step)
            return keep
        return pinned

    def saved(self, step: int, reason: str, progress: Progress, handed: bool = True) -> None:
        """A generation of ``step`` was handed to the pipeline: record it when it is due for a probe.

        Distributed: rank 0 decides, every rank follows (one broadcast per cadence save while the probe was
        on at the start; the side processes of every rank form a group of their own)."""
        if reason != "cadence" or self.off_at_start:
            return
        go = None
        if self.main and self.off is None and handed:
            self.generations += 1
            if (self.generations - 1) % self.every == 0:
                if self.current is not None:
                    self.skipped += 1  # one probe at a time: the previous one still runs
                else:
                    go = tempfile.mkdtemp(prefix="ripresa-probe-")
        if self.dist is not None:
            go = self.dist.broadcast(go)
        if go is None:
            return
        if self.current is not None:  # a rank other than 0: its previous side process has answered rank 0
            self._drop(self.current, keep_folder=True)
        p = _Probe(step, Path(go), {})
        small, tensors = capture(self.state, progress)
        p.restored = self._submit(small, tensors)
        p.batch = BatchRecorder(self.state.model)
        self.current = p

    def committed(self, step: int, path: Path) -> None:
        """Generation ``step`` is committed at ``path`` (rank 0; from the writer's thread too)."""
        self._paths[step] = Path(path)

    def step_done(self, step: int, progress: Progress, metrics: Mapping[str, Any]) -> None:
        """Record the replayed step's live state when it is this one; start the side process once the generation is
        committed; compare when its result is there. Never waits."""
        p = self.current
        if p is None or self.off is not None:
            return
        if p.after is None and step == p.step + REPLAY_STEPS:
            batch = p.batch.take() if p.batch is not None else []
            p.batch = None
            small, tensors = capture(self.state, progress, metrics.get("loss"), batch)
            p.after = self._submit(small, tensors)
        elif p.after is None and step > p.step + REPLAY_STEPS:  # steps skipped: nothing to compare with
            self._drop(p)
            return
        if not p.launched:
            self._maybe_launch(p)
        if p.launched:
            self._poll(p, block=False)

    def close(self) -> None:
        """The end of the session: wait (bounded) for a side process in flight and compare; then a summary event."""
        p = self.current
        if p is not None:
            if p.after is None or not p.launched:
                self._drop(p)
            else:
                self._poll(p, block=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.main and (self.probed or self.off is not None):
            self.event("probe_summary", probes=self.probed, confirmed=self.confirmed, mismatches=len(self.mismatches),
                       skipped=self.skipped, off=self.off)

    # ---- internals
    def _submit(self, small: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ripresa-probe")
        return self._pool.submit(finish, small, tensors)

    def _maybe_launch(self, p: _Probe) -> None:
        path = self._paths.get(p.step) if self.main else None
        why = None
        if self.main and path is not None:
            why = self._cannot_start()
        go: Any = (str(path) if path is not None else None, why, _free_port() if self.dist is not None and path else None)
        if self.dist is not None:
            go = self.dist.broadcast(go)
        gen, why, port = go
        if why is not None:
            self.turn_off(why)
            self._drop(p)
            return
        if gen is None:
            return  # not committed yet: the next step_done asks again
        p.path = Path(gen)
        replay = Replay(p.path, p.step, REPLAY_STEPS, p.folder, self.rank)
        env = dict(os.environ)
        env.update(replay.to_env())
        if self.dist is not None:
            for k in [k for k in env if k.startswith("TORCHELASTIC_")]:
                del env[k]
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        assert self.command is not None
        log = open(p.folder / f"probe-rank{self.rank}.log", "wb")  # noqa: SIM115 - the child's, closed below
        try:
            p.proc = subprocess.Popen(self.command, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT)
        except OSError as exc:
            self._fail(p, f"the script could not be started again: {exc}")
            return
        finally:
            log.close()
        p.started, p.launched = time.monotonic(), True
        self.probed += 1

    def _cannot_start(self) -> str | None:
        """Why a side process must not start now (not enough memory for a second copy of this process)."""
        need, avail = _rss_bytes(), _available_bytes()
        if need is not None and avail is not None and avail < need * 1.25:
            return (f"not enough memory for the side process: {avail >> 20} MiB available, this process holds "
                    f"{need >> 20} MiB")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            free, _total = torch.cuda.mem_get_info()
            used = torch.cuda.memory_allocated()
            if free < used * 1.25:
                return f"not enough GPU memory for the side process: {free >> 20} MiB free, the run holds {used >> 20} MiB"
        return None

    def _poll(self, p: _Probe, *, block: bool) -> None:
        """The side process's result, if it is there (``block``: wait for it, bounded)."""
        assert p.proc is not None
        limit = time.monotonic() + CLOSE_WAIT_S if block else None
        while True:
            code = p.proc.poll()
            if code is not None:
                break
            if time.monotonic() - p.started > TIMEOUT_S or (limit is not None and time.monotonic() > limit):
                p.proc.kill()
                p.proc.wait()
                self._fail(p, f"the side process did not finish the replayed step within "
                              f"{int(time.monotonic() - p.started)} s (a step too big for a probe?)")
                return
            if not block:
                return
            time.sleep(0.05)
        mine = p.folder / f"result-rank{self.rank}.json"
        if not mine.exists() or code != 0:
            self._fail(p, self._why_failed(p, code))
            return
        if self.dist is not None:
            self._publish_live(p)
        if not self.main:
            self._drop(p, keep_folder=True)
            return
        if self.dist is not None and not self._all_ranks(p, block):
            return
        self._compare(p)

    def _publish_live(self, p: _Probe) -> None:
        """A rank of a distributed run: its live record beside its side process's result, for rank 0."""
        doc = {"restored": p.restored.result(), "after": p.after.result()}
        write_atomic(p.folder / f"live-rank{self.rank}.json", [json.dumps(doc).encode()])

    def _all_ranks(self, p: _Probe, block: bool) -> bool:
        assert self.dist is not None
        limit = time.monotonic() + CLOSE_WAIT_S
        while True:
            names = [f"{k}-rank{r}.json" for r in range(self.dist.world_size) for k in ("live", "result")]
            if all((p.folder / n).exists() for n in names):
                return True
            if not block or time.monotonic() > limit:
                if block:
                    self._fail(p, "the side processes of the other ranks did not all answer")
                return False
            time.sleep(0.05)

    def _why_failed(self, p: _Probe, code: int | None) -> str:
        mine = p.folder / f"result-rank{self.rank}.json"
        try:
            err = json.loads(mine.read_bytes()[: 1 << 20]).get("error") if mine.exists() else None
        except (OSError, ValueError, AttributeError):
            err = None
        if err:
            return str(err)
        tail = ""
        try:
            tail = (p.folder / f"probe-rank{self.rank}.log").read_bytes()[-800:].decode(errors="replace").strip()
        except OSError:
            pass
        return (f"the script started again for the probe ended with exit code {code} before it replayed step "
                f"{p.step + REPLAY_STEPS}" + (f"; its last lines: {tail[-400:]}" if tail else ""))

    def _compare(self, p: _Probe) -> None:
        ranks = 1 if self.dist is None else self.dist.world_size
        diffs: list[tuple[int, Difference]] = []
        for r in range(ranks):
            try:
                got = json.loads((p.folder / f"result-rank{r}.json").read_bytes())
                if self.dist is None:
                    live = {"restored": p.restored.result(), "after": p.after.result()}
                else:
                    live = json.loads((p.folder / f"live-rank{r}.json").read_bytes())
            except (OSError, ValueError) as exc:
                self._fail(p, f"the probe's result could not be read: {exc}")
                return
            for doc in (live, got):
                if doc.get("error"):
                    self._fail(p, f"rank {r}: {doc['error']}" if ranks > 1 else str(doc["error"]))
                    return
            after = p.step + REPLAY_STEPS
            diffs += [(r, d) for d in compare(live["restored"], got.get("restored") or {}, "restored")]
            diffs += [(r, d) for d in compare(live["after"], (got.get("steps") or {}).get(str(after)) or {},
                                              f"after step {after}")]
        p.compared = True
        seconds = round(time.monotonic() - p.started, 3)
        if not diffs:
            self.confirmed, self.confirmed_path = p.step, str(p.path)
            fp = str(live["after"].get(FINGERPRINT_KEY, ""))[:16] if ranks == 1 else None
            self.event("probe_ok", step=p.step, file=p.path.name if p.path else None, seconds=seconds,
                       **({"state": f"same state (fingerprint {fp}: weights, moments, steps)"} if fp else {}))
            self._drop(p)
            return
        def name(r: int, d: Difference) -> str:
            return (f"rank {r}: " if ranks > 1 else "") + d.describe()
        # the first difference: the earliest phase, then the record's order (a cause before its effects), then the rank
        diffs.sort(key=lambda rd: (rd[1].phase != "restored", rd[1].order, rd[0]))
        first = diffs[0]
        back = (f"resume from step {self.confirmed} ({Path(self.confirmed_path).name}), the newest generation a "
                "probe confirmed" if self.confirmed is not None and self.confirmed_path else
                "no generation of this session was confirmed by a probe")
        record = {"step": p.step, "file": p.path.name if p.path else None, "first": name(*first),
                  "differences": [name(*rd) for rd in diffs[:LISTED]], "count": len(diffs),
                  "confirmed": self.confirmed, "seconds": seconds}
        self.mismatches.append(record)
        self.event("probe_mismatch", **record)
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        warnings.warn(f"the probe of generation {p.step} does not replay the live run bit for bit: {name(*first)} "
                      f"differs{more}; this run's resume is not exact from there — {back} (docs/VERIFY.md, "
                      "\"The live probe\")", ProbeMismatchWarning, stacklevel=4)
        self._drop(p)

    def _fail(self, p: _Probe, why: str) -> None:
        if self.dist is not None and not self.main:  # rank 0 reads it, says it and turns the probe off everywhere
            for kind in ("live", "result"):
                try:
                    if kind == "live" or not (p.folder / f"result-rank{self.rank}.json").exists():
                        write_atomic(p.folder / f"{kind}-rank{self.rank}.json", [json.dumps({"error": why}).encode()])
                except OSError:
                    pass
            self._drop(p, keep_folder=True)
            return
        self.turn_off(why)
        self._drop(p)

    def abort(self) -> None:
        """An error path: stop a side process in flight, compare nothing."""
        if self.current is not None:
            self._drop(self.current)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _drop(self, p: _Probe, *, keep_folder: bool = False) -> None:
        if p.batch is not None:
            p.batch.close()
        if p.proc is not None and p.proc.poll() is None:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait()
        if self.main and not keep_folder:
            shutil.rmtree(p.folder, ignore_errors=True)
        self._paths.pop(p.step, None)
        if self.current is p:
            self.current = None

    def turn_off(self, why: str) -> None:
        """Say once why the probe cannot run, and stop probing (training goes on)."""
        if self.off is not None:
            return
        self.off = why
        if self.main:
            self.event("probe_off", reason=why[:600])
            warnings.warn(f"the live probe is off, training goes on: {why}", ProbeOffWarning, stacklevel=4)


