"""The soak: real training loops interrupted at random, then compared bitwise with uninterrupted runs.

    make soak                                                   # >= 1,000 interruptions, < 60 min on 2 cores
    python tests/soak/soak.py --seed 7 --interruptions 20 --lanes general,andrea   # a sample (make test runs one)
    python tests/soak/soak.py --seed 5 --interruptions 3 --lanes nodes             # the two-node lane alone
    python tests/soak/soak.py --seed 41 --interruptions 16 --lanes andrea --memory-every 1   # the memory tier on
    python tests/soak/soak.py --seed 3 --interruptions 8 --lanes andrea --probe-every 5      # the live probe on

Lanes (each a real training loop with ripresa's ``Checkpointer``; docs/FAULTS.md, "The soak"):

* ``general``: one process, Adafactor, dropout, a cosine schedule, ``format="general"``
  (``step_NNNNNN.safetensors`` generations; on odd laps ``step_NNNNNN.shards`` folders of two shards
  with a staging budget smaller than the state);
* ``andrea``: one process, fp32 AdamW, an ``EpochSampler`` over 10^9 rows (Feistel, O(1)),
  ``format="andrea"`` (``step_NNNNNN.bin`` generations);
* ``ddp``: two ranks under ``python -m ripresa.torchrun`` (gloo, DDP, ``DistributedEpochSampler``);
* ``s3``: one process, fp32 AdamW, ``format="andrea"``, mirrored to a real S3 server (moto, on
  127.0.0.1) through a fault proxy (tests/support/s3server.py) that the soak breaks.
* ``nodes``: two "nodes" on this host (tests/support/nodes.py: a plain ``torchrun`` launcher each, in
  its own session, one FSDP2 rank of tests/fixtures/fsdp_loop.py), each on a run folder of its own,
  committed through the store (docs/DISTRIBUTED.md): odd laps a real S3 server of its own behind the
  fault proxy, even laps a ``file://`` store. Kinds: ``node-kill`` (one node's launcher session
  SIGKILLed while training: the other must exit non-zero within :data:`HANG_S`, no rank may outlive
  its launcher by :data:`ORPHAN_S`; both restart), ``node-lost`` (the same, and the killed node's
  folder deleted: the fresh node resumes from the store), ``outage`` (S3 laps: the store down 0.5-8 s
  while training; no node exits, nothing committed goes), ``sigterm`` (both launchers: a stop
  checkpoint at the last step, committed); ``node-kill-start`` (a kill within seconds of the rank's
  spawn) is in :data:`KNOWN_FAILING`, drawn only when ``--kinds`` names it. "Lost": a start that
  resumed an older step than the store's newest commit when it was launched (its first line in the
  per-rank sample-id files), or a final generation whose ``.distcp`` objects in the store differ
  from the uninterrupted two-node run's. ``make soak`` gives it :data:`NODES_INTERRUPTIONS`
  (``--nodes-interruptions``): each costs a launch of both nodes (~10 s on 2 cores).

Each single-process lane writes its run folder on its own small tmpfs (mounted
here, as root). Interruptions, drawn at random (seeded) at random moments:

* ``sigkill``: SIGKILL of the trainer (of the whole torchrun session; or of one rank),
  at any moment, some during the start (import, resume);
* ``sigterm``: the trainer must exit 0 with a stop checkpoint at its last step;
* ``sigusr1+kill``: SIGUSR1, wait for the signal checkpoint, then SIGKILL;
* ``enospc``: the tmpfs is filled while the trainer runs: saves fail, training goes on,
  and the previous generation is deep-checked while the disk is full; then room is freed;
* ``lost-folder``: SIGKILL, the run folder is deleted, the next start resumes from a
  local-path mirror (only when ``Checkpointer`` takes ``mirror=``);
* ``sigusr1-start``: SIGUSR1 at a random moment from the first line of ripresa's code in the
  process (the launcher's first act, the trainer's ``hold()``): start, import, resume, training
  (for torchrun: to the launcher or to a rank); it must lead to a signal checkpoint (or, after
  the last step, be ignored), never end the process;
* ``outage`` (``s3``): the store goes away for a random 0.5-8 s while the trainer trains: the
  proxy resets every connection (``down``), stalls every request (``stall``), resets each request
  (``reset``), or the S3 server itself is stopped and restarted (``restart``);
* ``outage-close`` (``s3``): an outage, then SIGTERM: the trainer closes with the store down and
  must exit within :data:`HANG_S` seconds (a stop checkpoint, exit 0).

Every trainer must end within :data:`HANG_S` seconds after SIGTERM (else "hung"); the ``s3``
lane reports the most history lines of mirror events in one lap.

Steps redone per interruption: for each interruption that ended a trainer, the last step the killed
trainer completed (its last step line; the step it resumed from when it completed none) minus the step
the next start resumed from (its ``soak_start`` line), per kind (mean, max); a trainer killed before its
``soak_start`` line did no work of its own (0; a loss it causes shows at the earlier interruption's). ``--memory-every K`` turns the memory tier on
(``Checkpointer(memory_every=K)``, a generation in ``/dev/shm`` every K steps) in the lanes of
:data:`MEMORY_LANES` (single-process: the tier is off in distributed sessions); then a kind of
:data:`MEMORY_KINDS` (a SIGKILL that leaves the run folder) redoing more than 2K-1 steps is a failure
(the capture of the last multiple of K may still be in flight; at K=1: at most one step).

Trainers are real processes in their own session: forked from a server that
imported torch once (one start in ten a fresh interpreter; every torchrun
start fresh). Each lap of a lane trains to its last step through any number of
interruptions; its final state (parameters, buffers, optimizer, schedule, data
position, every random stream) is hashed and compared with the lane's
uninterrupted run, and every step's loss with the uninterrupted one.
"Lost" counts restarts that resumed an older step than a generation already
committed (a lost generation), and laps whose final state differs. Exit 0 only
when lost is 0. JSON: ``build/soak/soak.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
LANES = ("general", "andrea", "ddp", "s3", "nodes")
#: Interruption kinds of each lane (``lost-folder`` is added when the mirror exists).
KINDS = {
    "general": ["sigkill", "sigkill-start", "sigterm", "sigusr1+kill", "enospc"],
    "andrea": ["sigkill", "sigkill-start", "sigterm", "sigusr1+kill", "enospc"],
    "ddp": ["sigkill-group", "sigkill-rank", "sigkill-start", "sigterm", "sigusr1+kill", "sigusr1-start"],
    "s3": ["outage", "outage-close", "sigkill", "sigterm", "sigusr1+kill", "sigusr1-start"],
    "nodes": ["node-kill", "node-lost", "outage", "sigterm", "node-kill-start"],
}
#: Kinds that find a known bug, drawn only when ``--kinds`` names them (a replay); docs/FAULTS.md, "The soak".
KNOWN_FAILING = {
    "node-kill-start": "a node SIGKILLed during torchrun's rendezvous (before any rank exists) leaves the other "
                       "node's agent waiting for it for the rendezvous' join_timeout (600 s by default): torchrun's "
                       "own wait, before ripresa runs (the orphaned-rank half of this kind is fixed)",
}
for _k in ("general", "andrea"):
    KINDS[_k].append("sigusr1-start")
#: The mirror's failure events, bounded per outage (docs/MIRROR.md: an outage is recorded once, with a count);
#: ``mirror_uploaded``/``mirror_retention`` record each generation's upload and grow with the run, not with outages.
OUTAGE_EVENTS = frozenset({"mirror_outage", "mirror_recovered", "mirror_retry", "mirror_pending", "mirror_error",
                           "mirror_failed"})
#: Seconds a trainer may take to exit after SIGTERM (a store outage included) before it counts as hung.
HANG_S = 90.0
OUTAGES = ("down", "stall", "reset", "restart")
#: Mirror events may take a few history lines per outage (failed, pending, recovered), never one per wake-up.
MIRROR_LINES_BASE, MIRROR_LINES_PER_OUTAGE = 20, 10
#: The general lane's odd laps write sharded generations (docs/FORMAT.md, "Sharded general generations") with
#: this staging budget (bytes: part of the state is written live while the loop waits); the even laps and the
#: reference one file, so a lap's final state is compared across the two layouts.
SHARDED_STAGING_BUDGET = 16 * 1024
#: Lap length and cadence (steps) of each lane.
TOTAL = {"general": 1000, "andrea": 400, "ddp": 60, "s3": 300, "nodes": 60}
EVERY = {"general": 10, "andrea": 10, "ddp": 5, "s3": 10, "nodes": 5}
#: Interruptions of the nodes lane in a run of several lanes (each costs a launch of both nodes: ~10 s).
NODES_INTERRUPTIONS = 16
TMPFS_BYTES = 8 << 20
#: Lanes where ``--memory-every`` turns the memory tier on: single-process sessions (the tier is off in
#: distributed ones; docs/FAULTS.md, "The soak").
MEMORY_LANES = ("general", "andrea", "s3")
#: Kinds whose steps redone the memory tier bounds (``--memory-every K``: at most 2K-1): a SIGKILL of a trainer
#: whose run folder stays. ``lost-folder`` loses the run folder (its token too: the memory generation belongs
#: to the lost run) and is measured, not bounded; ``sigterm`` saves its last step (0 redone).
MEMORY_KINDS = ("sigkill", "sigkill-start", "sigusr1+kill")
FINAL = "soak_final"  # the digest files a finished trainer writes: soak_final.rank{R}.json


# ====================================================================== the trainers
def digest(obj: Any, h: Any = None) -> str:
    """sha256 of a state tree: every tensor's dtype, shape and bytes; every scalar's repr."""
    import numpy as np
    import torch

    top = h is None
    h = hashlib.sha256() if top else h
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.flatten().view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode() + np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode() + b":")
            digest(obj[k], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            digest(v, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode() + b";")
    return h.hexdigest() if top else ""


def _checkpointer_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"every": cfg["every"]}
    if cfg.get("format"):
        kw["format"] = cfg["format"]
    if cfg.get("sharded"):  # the general lane's odd laps: .shards generations, half the state staged
        kw.update(shard_threshold=0, shards=2, staging_budget=cfg["sharded"])
    if isinstance(cfg.get("mirror"), dict):  # the s3 lane: short requests, the default close wait
        from ripresa.store.mirror import MirrorSpec

        kw["mirror"] = MirrorSpec(**cfg["mirror"])
    elif cfg.get("mirror"):
        kw["mirror"] = cfg["mirror"]
    if cfg.get("memory_every"):  # --memory-every: the memory tier (single-process lanes)
        kw["memory_every"] = cfg["memory_every"]
    if cfg.get("probe_every"):  # --probe-every: the live probe, its side process this trainer again (a worker)
        kw["probe_every"] = cfg["probe_every"]
        kw["probe_command"] = [sys.executable, str(HERE), "--worker", json.dumps(cfg)]
    return kw


def train_single(cfg: dict[str, Any]) -> int:
    """One process: the ``general`` (Adafactor, general format) or ``andrea`` (AdamW, .bin) loop."""
    import numpy as np
    import torch

    import ripresa

    torch.set_num_threads(1)
    random.seed(0)
    torch.manual_seed(0)
    gen = np.random.default_rng(0)
    andrea = cfg["lane"] in ("andrea", "s3")
    X = torch.randn(4096, 16, generator=torch.Generator().manual_seed(1))
    Y = torch.sin(X @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2)))
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    if andrea:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sampler = ripresa.EpochSampler(10**9, 16, generator=gen, permutation="feistel")
        scheduler = None
    else:
        optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
        sampler = ripresa.EpochSampler(len(X), 16, generator=gen)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["total"])
    state = ripresa.TrainingState(model=model, optimizer=optimizer, scheduler=scheduler, data=sampler,
                                  rng=ripresa.RandomStreams(numpy={"data": gen}), config={"lane": cfg["lane"]})
    ckpt = ripresa.Checkpointer(cfg["run"], state, **_checkpointer_kwargs(cfg))
    start = ckpt.resume(restore_rng=cfg.get("sabotage") != "rng")
    ckpt.history.event("soak_start", start=start, pid=os.getpid(), token=cfg.get("token"))
    for step in range(start + 1, cfg["total"] + 1):
        ids = torch.as_tensor(sampler.next_batch(), dtype=torch.long) % len(X)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(X[ids]), Y[ids])
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if ckpt.step_done(step, loss=loss.item()):
            break
    ckpt.close(final_save=True)
    if ckpt.progress.step == cfg["total"]:
        _write_final(cfg["run"], 0, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "data": sampler.state_dict(), "torch": torch.get_rng_state(), "numpy": gen.bit_generator.state,
            "random": random.getstate()})
    return 0


def train_ddp(cfg: dict[str, Any]) -> int:
    """One rank of the 2-rank DDP loop (gloo)."""
    import torch
    import torch.distributed as dist

    import ripresa
    from ripresa.core.data import DistributedEpochSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    random.seed(0)
    torch.manual_seed(0)
    X = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    Y = X.sum(dim=1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = DistributedEpochSampler(len(X), 8, seed=0, drop_last=True)
    state = ripresa.TrainingState(model=model, optimizer=optimizer, data=sampler, config={"lane": "ddp"})
    ckpt = ripresa.Checkpointer(cfg["run"], state, **_checkpointer_kwargs(cfg))
    start = ckpt.resume(restore_rng=cfg.get("sabotage") != "rng")
    ckpt.history.event("soak_start", start=start, pid=os.getpid(), token=cfg.get("token"))
    for step in range(start + 1, cfg["total"] + 1):
        ids = sampler.next_batch()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(X[ids]), Y[ids])
        loss.backward()
        optimizer.step()
        if ckpt.step_done(step, loss=loss.item()):
            break
    ckpt.close(final_save=True)
    if ckpt.progress.step == cfg["total"]:
        _write_final(cfg["run"], rank, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                        "data": sampler.state_dict(), "torch": torch.get_rng_state(),
                                        "random": random.getstate()})
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no gloo teardown at interpreter exit


def _write_final(run: str, rank: int, tree: dict[str, Any]) -> None:
    path = Path(run) / f"{FINAL}.rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"digest": digest(tree)}))
    os.replace(tmp, path)


def run_worker(cfg: dict[str, Any]) -> int:
    return train_ddp(cfg) if cfg["lane"] == "ddp" else train_single(cfg)


# ====================================================================== the fork server
def fork_server() -> None:
    """Import torch and ripresa once; fork one trainer per request (stdin JSON lines), report pids and exits."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (an optimizer's constructor imports it: 3-5 s in every child otherwise)

    import ripresa  # noqa: F401
    import ripresa.formats.dcp  # noqa: F401
    import ripresa.session.checkpointer  # noqa: F401
    import ripresa.store.general  # noqa: F401

    out = sys.stdout.buffer
    live: set[int] = set()

    def say(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg).encode() + b"\n")
        out.flush()

    say({"ready": os.getpid()})
    buf = b""
    while True:
        r, _, _ = select.select([0], [], [], 0.02)
        if r:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:  # the trainer: its own session, its own output, default signals
                    try:
                        os.setsid()
                        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                        os.dup2(fd, 1)
                        os.dup2(fd, 2)
                        nul = os.open(os.devnull, os.O_RDONLY)
                        os.dup2(nul, 0)
                        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGCHLD):
                            signal.signal(s, signal.SIG_DFL)
                        from ripresa.session.signals import hold

                        hold()  # the trainer's first line (docs/ARCHITECTURE.md, "Signals through the launcher")
                        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                        rc = run_worker(req["cfg"])
                        sys.stdout.flush()
                        sys.stderr.flush()
                    except BaseException:
                        import traceback

                        traceback.print_exc()
                        rc = 1
                    os._exit(rc)
                live.add(pid)
                say({"pid": pid})
        while live:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            live.discard(pid)
            say({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})


class ForkServer:
    """The driver's side of :func:`fork_server`."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--fork-server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()
        self.pids: list[int] = []
        self.cond = threading.Condition()
        self.exits: dict[int, int] = {}
        self.ready = False

    def _wait_ready(self) -> None:
        if not self.ready:
            first = json.loads(self.proc.stdout.readline() or b"{}")
            if "ready" not in first:
                raise RuntimeError("the fork server did not start")
            self.ready = True
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "pid" in msg:  # a pid seen before is reused (pid_max 32768): its old exit is not this one's
                    self.exits.pop(msg["pid"], None)  # (seed 2128: stale exits -9 and 1 taken for new trainers')
                    self.pids.append(msg["pid"])
                else:
                    self.exits[msg["exit"]] = msg["rc"]
                self.cond.notify_all()

    def start(self, cfg: dict[str, Any], log: Path) -> int:
        with self.lock:
            self._wait_ready()
            self.proc.stdin.write(json.dumps({"cfg": cfg, "log": str(log)}).encode() + b"\n")
            self.proc.stdin.flush()
            with self.cond:
                while not self.pids:
                    self.cond.wait()
                return self.pids.pop(0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Trainer:
    """One started trainer (a forked child, a fresh interpreter, or a torchrun session): signals, exit status."""

    def __init__(self, lane: str, cfg: dict[str, Any], log: Path, server: ForkServer, env: dict[str, str], fresh: bool):
        self.server, self.popen = server, None
        self.how = "torchrun" if lane == "ddp" else "fresh" if fresh else "fork"
        self.token = cfg["token"]  # written in its soak_start line: this start, whatever its pid
        if lane == "ddp":
            argv = [sys.executable, "-m", "ripresa.torchrun", "--standalone", "--nproc_per_node=2",
                    str(HERE), "--worker", json.dumps(cfg)]
        else:
            argv = [sys.executable, str(HERE), "--worker", json.dumps(cfg)]
        if self.how == "fork":
            self.pid = server.start(cfg, log)
        else:
            with open(log, "ab") as f:
                self.popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, env=env)
            self.pid = self.popen.pid
        self.t0 = time.monotonic()
        #: it went through a full disk: stopping with SaveFailed after max_failed_saves is its documented end
        self.may_fail_saves = False
        #: its end is accounted for: a signal after its last step (close() had put the default action
        #: back), or an interruption judged when it landed after the lap's final state was written
        self.ended_by_late_signal = False
        self.orphans = 0  # ranks still alive 20 s after their launcher was killed

    def poll(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        with self.server.cond:
            return self.server.exits.get(self.pid)

    def wait(self, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            rc = self.poll()
            if rc is not None:
                return rc
            time.sleep(0.01)
        return None

    def signal(self, signum: int, group: bool = False) -> bool:
        """Send ``signum`` (to the whole session with ``group``); False when it had already exited."""
        if self.poll() is not None:
            return False
        try:
            if group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def kill_all(self) -> int:
        """SIGKILL the whole session; wait for the exit. torchrun's ranks (sessions of their own) must die with it."""
        ranks = self.ranks() if self.how == "torchrun" and self.poll() is None else []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        rc = self.wait(60)
        if rc is None:
            raise RuntimeError(f"trainer {self.pid} did not exit after SIGKILL")
        end = time.monotonic() + 20
        while ranks and time.monotonic() < end:
            ranks = [p for p in ranks if alive(p)]
            time.sleep(0.02)
        for p in ranks:  # an orphan would train on in the run folder, unsupervised
            self.orphans += 1
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return rc

    def ranks(self) -> list[int]:
        """torchrun: the worker pids (children of the launcher)."""
        from ripresa.session.torchrun import children

        return children(self.pid)


def alive(pid: int) -> bool:
    """A live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"
    except (OSError, ValueError):
        return False


def ripresa_started(pid: int) -> bool:
    """ripresa's first line has run in ``pid``: SIGUSR1 blocked (the launcher) or caught (``hold()``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read(8192).splitlines() if b":" in line)
        bit = 1 << (signal.SIGUSR1 - 1)
        return bool((int(fields[b"SigBlk"], 16) | int(fields[b"SigCgt"], 16)) & bit)
    except (OSError, ValueError, KeyError):
        return False


class Store:
    """The s3 lane's store (the nodes lane has its own): moto on 127.0.0.1 behind the fault proxy; outages on demand."""

    def __init__(self, bucket: str = "soak") -> None:
        sys.path.insert(0, str(REPO / "tests"))
        import logging

        import boto3
        from support.s3server import FaultProxy, MotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self.moto = MotoServer().start()
        self.proxy = FaultProxy(self.moto.port)
        self.bucket = bucket
        boto3.client("s3", endpoint_url=self.moto.url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=self.bucket)
        self.lock = threading.Lock()
        self.outages: Counter[str] = Counter()

    @staticmethod
    def env() -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def break_(self, how: str) -> None:
        with self.lock:
            self.outages[how] += 1
            if how == "down":
                self.proxy.mode = "down"
                self.proxy.drop_all()
            elif how in ("stall", "reset"):
                self.proxy.arm(*[how] * 100000)
            else:  # the server itself stops (its objects stay in this process's moto backend)
                self.moto.stop()

    def mend(self, how: str) -> None:
        with self.lock:
            if how == "down":
                self.proxy.mode = "pass"
            elif how in ("stall", "reset"):
                with self.proxy._lock:
                    self.proxy.faults.clear()
                self.proxy.drop_all()
            else:
                from moto.server import ThreadedMotoServer

                for _ in range(100):  # the port may linger a moment
                    try:
                        self.moto.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto.port, verbose=False)
                        self.moto.start()
                        break
                    except (OSError, RuntimeError, SystemExit):
                        time.sleep(0.1)

    def close(self) -> None:
        self.proxy.close()
        with contextlib.suppress(Exception):
            self.moto.stop()


# ====================================================================== reading a lap's history
class LapHistory:
    """Follows one lap's ``.loss.jsonl`` as it grows: commits, starts, redone steps, losses, lost generations."""

    def __init__(self, run: Path, ref_losses: dict[int, float] | None) -> None:
        self.path = run / ".loss.jsonl"
        self.ref = ref_losses
        self.offset = 0
        self.buf = b""
        self.committed = 0  # newest generation committed (its checkpoint event)
        self.max_step = 0
        self.last_step = 0  # the last step line read
        self.generations = 0
        self.starts: list[int] = []
        self.redone = 0
        self.lost: list[str] = []
        self.diverged: list[int] = []
        self.losses: dict[int, float] = {}
        self.events: list[dict[str, Any]] = []
        self.from_mirror = False
        self.mirror_resumes = 0  # starts after a lost folder that resumed a pulled generation (step > 0)
        self.mirror_lines = 0  # history lines of the mirror's failure events (OUTAGE_EVENTS)
        self.start_tokens: set[str] = set()  # the start tokens of the soak_start lines read
        #: interruptions that ended a trainer, not yet measured: (kind, the killed trainer's start token)
        self.pending: list[tuple[str, str]] = []
        #: the trainer whose lines are read now (its start token) and its progress: its last step line, or the
        #: step it resumed from while it has completed none
        self.current_token: str | None = None
        self.current_ref = 0
        #: steps redone per interruption, by kind: that last step minus the step the next start resumed
        self.redone_by_kind: dict[str, list[int]] = {}
        self.memory_resumes: list[dict[str, Any]] = []  # memory_resume events (step, newest_disk)
        self.memory_skipped: list[str] = []  # memory_generation_skipped / memory_tier_off events (why)

    def reset_file(self) -> None:
        """The run folder was lost: a new history begins (what was committed stays the bar)."""
        self.offset, self.buf = 0, b""
        self.lost_at = time.time()  # the new history starts with the lines the mirror restores: not read again

    def poll(self) -> list[dict[str, Any]]:
        new: list[dict[str, Any]] = []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return new
        self.offset += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for raw in lines:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # a torn line (killed mid-write), terminated by the next writer
            if not isinstance(rec, dict):
                continue
            if isinstance(rec.get("time"), int | float) and rec["time"] < getattr(self, "lost_at", 0.0):
                continue  # restored from the mirror (docs/MIRROR.md): read before the folder was lost
            new.append(rec)
            self._take(rec)
        return new

    def _take(self, rec: dict[str, Any]) -> None:
        ev = rec.get("event")
        if ev is None and isinstance(rec.get("step"), int):
            step = rec["step"]
            self.max_step = max(self.max_step, step)
            self.last_step = step
            self.current_ref = step
            self.losses[step] = rec.get("loss")
            if self.ref is not None and self.ref.get(step) != rec.get("loss"):
                self.diverged.append(step)
            return
        self.events.append(rec)
        if ev in OUTAGE_EVENTS:
            self.mirror_lines += 1
        if ev == "checkpoint":
            self.generations += 1
            self.committed = max(self.committed, int(rec["step"]))
        elif ev == "soak_start":
            self.start_tokens.add(rec.get("token"))
            start = int(rec["start"])
            if self.from_mirror:  # the first start after the folder was lost
                self.mirror_resumes += start > 0
                self.from_mirror = False
            self.starts.append(start)
            self.redone += max(0, self.max_step - start)
            for kind, token in self.pending:  # every interruption since the previous start: measured at this one
                # a trainer killed before its start line had done nothing of its own: nothing of its is redone
                # (a loss it caused shows at the start after an earlier interruption's trainer)
                ref = self.current_ref if token == self.current_token else start
                self.redone_by_kind.setdefault(kind, []).append(max(0, ref - start))
            self.pending.clear()
            self.current_token, self.current_ref = rec.get("token"), start
            if start < self.committed:
                self.lost.append(f"resumed step {start} while step {self.committed} was committed")
        elif ev == "memory_resume":
            self.memory_resumes.append({"step": rec.get("step"), "newest_disk": rec.get("newest_disk")})
        elif ev in ("memory_generation_skipped", "memory_tier_off"):
            self.memory_skipped.append(f"{ev}: {str(rec.get('reason'))[:160]}")

    def wait_for(self, pred, trainer: Trainer, timeout: float) -> dict[str, Any] | None:
        """Poll until an event line satisfies ``pred`` (returned), the trainer exits or the time is up (None)."""
        end = time.monotonic() + timeout
        while True:
            for rec in self.poll():
                if pred(rec):
                    return rec
            if trainer.poll() is not None or time.monotonic() > end:
                for rec in self.poll():
                    if pred(rec):
                        return rec
                return None
            time.sleep(0.005)


# ====================================================================== the driver
class Tmpfs:
    """A small real tmpfs mounted for one lane's run folders (root only)."""

    def __init__(self, where: Path, size: int) -> None:
        where.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise OSError(res.stderr.strip() or f"mount exited {res.returncode}")
        self.where = where

    def fill(self, leave_pages: int = 4) -> Path | None:
        """Fill the file system but ``leave_pages`` pages; the filler (None: it was already full)."""
        st = os.statvfs(self.where)
        take = max(0, (st.f_bavail - leave_pages) * st.f_frsize)
        filler = self.where / "filler"
        try:
            f = open(filler, "wb", buffering=0)  # noqa: SIM115 (unbuffered: a full disk shows at a write, never at close)
        except OSError:
            return None
        try:
            while take > 0:
                n = min(take, 1 << 20)
                try:
                    f.write(b"\0" * n)
                except OSError:
                    break
                take -= n
        finally:
            try:
                f.close()
            except OSError:
                pass
        return filler

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.where)], capture_output=True)


class Laps:
    """What every lane does: its uninterrupted reference once, then laps until its interruptions are delivered."""

    def run(self) -> None:
        t0 = time.monotonic()
        self.reference()
        lap = 0
        while sum(self.delivered.values()) < self.budget:
            lap += 1
            self.lap(lap)
        self.wall_s = round(time.monotonic() - t0, 1)


class Lane(Laps):
    def __init__(self, name: str, args: argparse.Namespace, budget: int, root: Path, server: ForkServer,
                 env: dict[str, str], mirror_ok: bool, store: Store | None = None) -> None:
        self.name, self.args, self.budget, self.server, self.env = name, args, budget, server, env
        self.rng = random.Random(f"{args.seed}/{name}")
        self.kinds = list(KINDS[name])
        self.root = root / name
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.tmpfs: Tmpfs | None = None
        self.notes: list[str] = []
        self.store = store
        self.max_mirror_lines = 0  # the most history lines of mirror events in one lap
        self.lap_outages = 0
        self.orphans = 0
        if name in ("general", "andrea"):
            try:
                self.tmpfs = Tmpfs(self.root / "mnt", args.tmpfs_bytes)
            except OSError as exc:
                self.kinds.remove("enospc")
                self.notes.append(f"enospc left out: cannot mount a tmpfs here ({exc})")
        self.mirror = None
        if mirror_ok and name in ("general", "andrea"):
            self.kinds.append("lost-folder")
        self.delivered: Counter[str] = Counter()
        self.survived: Counter[str] = Counter()
        self.failures: list[str] = []
        self.starts: Counter[str] = Counter()
        self.generations = self.redone = self.laps = self.equal_laps = 0
        self.wall_s = 0.0
        self.last_kind: str | None = None
        self.lost_seen = 0
        self.lost_by_kind: Counter[str] = Counter()
        self.close_s: list[float] = []  # outage-close: seconds from SIGTERM to exit with the store down
        self.mirror_resumes = 0
        self.rankless = 0  # sigkill-rank found no rank (they had ended): nothing sent
        self.diverged = 0
        self.lost: list[str] = []
        self.sabotage = args.sabotage.get(name)
        #: the memory tier's cadence in this lane (0: off; distributed lanes keep it off)
        self.memory_every = args.memory_every if name in MEMORY_LANES else 0
        if args.memory_every and not self.memory_every:
            self.notes.append("memory tier off: a distributed session (it is built for single-process sessions)")
        #: the live probe's cadence in this lane (0: off), and what its probes said over the laps
        self.probe_every = args.probe_every if name in MEMORY_LANES else 0
        self.probes: dict[str, int] = {"probe_ok": 0, "probe_mismatch": 0, "probe_off": 0}
        self.redone_by_kind: dict[str, list[int]] = {}
        self.memory_resumes: list[dict[str, Any]] = []
        self.memory_skipped: list[str] = []

    # ------------------------------------------------------------ helpers
    def cfg(self, run: Path, sabotage: bool) -> dict[str, Any]:
        cfg: dict[str, Any] = {"lane": self.name, "run": str(run), "total": TOTAL[self.name], "every": EVERY[self.name]}
        if self.name == "general":
            cfg["format"] = "general"
            if run.name.startswith("lap") and int(run.name[3:] or 0) % 2:  # odd laps (not the reference, lap 0)
                cfg["sharded"] = SHARDED_STAGING_BUDGET
        elif self.name in ("andrea", "s3"):
            cfg["format"] = "andrea"
        if self.name == "s3" and self.store is not None:
            cfg["mirror"] = {"url": f"s3://{self.store.bucket}/{self.args.seed}/{run.name}", "timeout": 2.0,
                             "attempts": 2, "backoff": 0.2, "max_backoff": 1.0}
        if self.mirror is not None:
            cfg["mirror"] = str(self.mirror)
        if sabotage and self.sabotage == "rng":
            cfg["sabotage"] = "rng"
        if self.memory_every:
            cfg["memory_every"] = self.memory_every
        if self.probe_every:
            cfg["probe_every"] = self.probe_every
        cfg["token"] = os.urandom(6).hex()  # not from self.rng: the seeded choices stay as they were
        return cfg

    def start(self, run: Path, sabotage: bool = True) -> Trainer:
        fresh = self.name != "ddp" and self.rng.random() < self.args.fresh_share
        t = Trainer(self.name, self.cfg(run, sabotage), self.root / "trainer.log", self.server, self.env, fresh)
        self.starts[t.how] += 1
        return t

    def finals(self, run: Path) -> list[str] | None:
        n = 2 if self.name == "ddp" else 1
        out = []
        for r in range(n):
            p = run / f"{FINAL}.rank{r}.json"
            if not p.exists():
                return None
            out.append(json.loads(p.read_text())["digest"])
        return out

    def lap_folder(self, n: int) -> Path:
        base = self.tmpfs.where if self.tmpfs is not None else self.root
        return base / f"lap{n:04d}"

    # ------------------------------------------------------------ the reference
    def reference(self) -> None:
        run = self.root / "reference" if self.tmpfs is None else self.lap_folder(0)
        self.discard_memory(run)
        t = self.start(run, sabotage=False)
        rc = t.wait(900)
        if rc != 0:
            raise RuntimeError(f"{self.name}: the uninterrupted run exited {rc}; see {self.root / 'trainer.log'}")
        hist = LapHistory(run, None)
        hist.poll()
        self.ref_losses = hist.losses
        self.ref_final = self.finals(run)
        if self.ref_final is None or len(self.ref_losses) != TOTAL[self.name]:
            raise RuntimeError(f"{self.name}: the uninterrupted run left no final state")
        self.discard_memory(run)
        shutil.rmtree(run)

    # ------------------------------------------------------------ a lap

    def lap(self, n: int) -> None:
        run = self.lap_folder(n)
        if self.name != "ddp" and "lost-folder" in self.kinds:
            self.mirror = self.root / f"mirror{n:04d}"
        hist = LapHistory(run, self.ref_losses)
        self.discard_memory(run)  # a former soak's lap of this path (its token differs: it would only be skipped)
        trainer = self.start(run)
        while True:
            left = self.budget - sum(self.delivered.values())
            rc = trainer.poll()
            if rc is not None:
                hist.poll()
                if rc != 0 and not (rc in (1, 2) and trainer.may_fail_saves) and not trainer.ended_by_late_signal:
                    self.failures.append(f"lap {n}: a trainer exited {rc} without being interrupted")
                if self.finals(run) is not None:
                    break
                trainer = self.start(run)
                continue
            if left <= 0:  # the budget is spent: let this lap finish undisturbed
                if trainer.wait(900) is None:
                    self.failures.append(f"lap {n}: the last trainer did not finish within 900 s")
                    trainer.kill_all()
                continue
            self.blame(hist)
            kind = self.rng.choice([k for k in self.kinds if not self.args.kinds or k in self.args.kinds])
            trainer = self.interrupt(kind, trainer, run, hist)
        hist.poll()
        self.blame(hist)
        self.laps += 1
        final = self.finals(run)
        equal = final == self.ref_final
        self.equal_laps += equal
        if not equal:
            self.lost.append(f"lap {n}: final state differs from the uninterrupted run")
            self.keep(run, f"lap{n}-differs")
        self.lost.extend(f"lap {n}: {x}" for x in hist.lost)
        self.lost_seen = 0
        self.generations += hist.generations
        self.mirror_resumes += hist.mirror_resumes
        self.max_mirror_lines = max(self.max_mirror_lines, hist.mirror_lines)
        bound = MIRROR_LINES_BASE + MIRROR_LINES_PER_OUTAGE * self.lap_outages
        if self.store is not None and hist.mirror_lines > bound:
            self.failures.append(f"lap {n}: {hist.mirror_lines} history lines of mirror events through "
                                 f"{self.lap_outages} outage(s) (bound {bound})")
        self.lap_outages = 0
        self.redone += hist.redone
        for kind, values in hist.redone_by_kind.items():
            self.redone_by_kind.setdefault(kind, []).extend(values)
            bound = 2 * self.memory_every - 1  # the capture of the last multiple of K may be in flight
            over = [v for v in values if v > bound] if self.memory_every and kind in MEMORY_KINDS else []
            if over:
                self.failures.append(f"lap {n}: {kind} redid {max(over)} steps with the memory tier every "
                                     f"{self.memory_every} step(s) (bound {bound}; {len(over)} of {len(values)})")
                self.keep(run, f"lap{n}-redone")
        self.memory_resumes.extend(hist.memory_resumes)
        self.memory_skipped.extend(f"lap {n}: {x}" for x in hist.memory_skipped)
        self.diverged += len(hist.diverged)
        if self.probe_every:
            self.count_probes(run, n)
        self.discard_memory(run)  # the lap's last trainer removed it at its normal end; a lap cut short did not
        shutil.rmtree(run, ignore_errors=True)
        if self.mirror is not None:
            shutil.rmtree(self.mirror, ignore_errors=True)

    def count_probes(self, run: Path, n: int) -> None:
        """--probe-every: the lap's probe events; an exact lane must never raise an alarm (docs/VERIFY.md)."""
        try:
            lines = (run / ".loss.jsonl").read_text(errors="replace").splitlines()
        except OSError:
            return
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            name = rec.get("event") if isinstance(rec, dict) else None
            if name in self.probes:
                self.probes[name] += 1
                if name == "probe_mismatch" and not self.sabotage:
                    self.failures.append(f"lap {n}: the live probe raised an alarm on an exact run: {rec.get('first')}")
                    self.keep(run, f"lap{n}-probe")

    def _ended_at_total(self, hist: LapHistory, rc: int | None) -> bool:
        """The trainer had reached the lap's last step: a SIGTERM then lands in close() (exit 0) or after it,
        once the Checkpointer gave the signal back (its default action), with nothing left to save."""
        hist.poll()
        return (rc in (0, -signal.SIGTERM) and hist.last_step == TOTAL[self.name]
                and TOTAL[self.name] in (hist.committed, hist.starts[-1] if hist.starts else None))

    def running(self, hist: LapHistory, trainer: Trainer, timeout: float = 120) -> bool:
        """Wait until this trainer has resumed (its soak_start line): signal handlers are installed."""
        # By the start's own token, never by pid: pids are reused (pid_max 32768 here), and a new trainer
        # taken for an old one that had started got its SIGUSR1 before hold() (seed 2127: exit -10).
        def mine(r: dict[str, Any]) -> bool:
            return r.get("token") == trainer.token

        hist.poll()
        if trainer.token in hist.start_tokens:  # it had started already (an interruption it survived)
            return trainer.poll() is None
        return hist.wait_for(lambda r: r.get("event") == "soak_start" and mine(r), trainer, timeout) is not None

    def interrupt(self, kind: str, trainer: Trainer, run: Path, hist: LapHistory) -> Trainer:
        """Deliver one interruption of ``kind``; return the trainer that runs now (a new one after a stop)."""
        r = self.rng
        ok = True
        delivered = False
        if kind == "sigkill-start":  # during the start: import, fork, resume
            time.sleep(r.uniform(0, 2.5 if trainer.how != "fork" else 0.15))
            delivered = trainer.signal(signal.SIGKILL, group=True)
            trainer.kill_all()
        elif kind in ("sigkill", "sigkill-group", "sigkill-rank", "lost-folder"):
            if not self.running(hist, trainer):
                return trainer
            time.sleep(r.uniform(0, 0.6))
            if kind == "sigkill-rank":
                ranks = trainer.ranks()
                delivered = bool(ranks) and trainer.poll() is None
                if not delivered:  # the ranks had ended (the lap's last step): not an interruption
                    self.rankless += 1
                    return trainer
                if delivered:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(r.choice(ranks), signal.SIGKILL)
                    rc = trainer.wait(120)  # the launcher stops the other rank and exits
                    if rc is None:
                        self.failures.append("torchrun did not exit after one rank was killed")
            else:
                delivered = trainer.signal(signal.SIGKILL, group=True)
            trainer.kill_all()
            if delivered and kind == "lost-folder":
                hist.poll()
                shutil.rmtree(run, ignore_errors=True)
                hist.reset_file()
                hist.committed = newest_mirrored(self.mirror)  # the bar is now what the mirror holds
                hist.from_mirror = True
        elif kind == "sigterm":
            if not self.running(hist, trainer):
                return trainer
            time.sleep(r.uniform(0, 0.6))
            hist.poll()
            seen = len(hist.events)
            delivered = trainer.signal(signal.SIGTERM)
            rc = trainer.wait(HANG_S)
            if rc is None:
                ok = False
                self.failures.append(f"SIGTERM: hung (no exit within {HANG_S:.0f} s)")
                trainer.kill_all()
            elif delivered:
                hist.poll()
                mine = hist.events[seen:]
                stops = [e["step"] for e in mine if e.get("event") == "signal" and e.get("action") == "stop"]
                saved = [e["step"] for e in mine if e.get("event") == "checkpoint" and e.get("reason") == "stop"]
                last = hist.last_step
                at_end = self._ended_at_total(hist, rc)
                # a trainer ending by its full disk (SaveFailed after max_failed_saves, its documented end: exit 2, its
                # exit_code, or 1 where the script's excepthook is Python's)
                # that the SIGTERM reached during that exit, after its session stopped handling signals (no stop
                # recorded): the interpreter's exit had put SIGTERM's default action back (seed 2131: exit -15)
                full_disk_end = trainer.may_fail_saves and rc in (1, 2, -signal.SIGTERM) and not stops
                if not at_end and not full_disk_end and (rc != 0 or stops != [last] or saved != [last]):
                    ok = False
                    self.failures.append(f"SIGTERM: exit {rc}, stop signal at {stops}, stop checkpoint {saved}, "
                                         f"last step {last}")
                    self.keep(run, f"sigterm-{len(self.failures)}")
        elif kind == "sigusr1+kill":
            if not self.running(hist, trainer):
                return trainer
            time.sleep(r.uniform(0, 0.4))
            hist.poll()
            seen = len(hist.events)
            delivered = trainer.signal(signal.SIGUSR1)
            if delivered:
                def signal_checkpoint(rec: dict[str, Any]) -> bool:
                    return rec.get("event") == "checkpoint" and rec.get("reason") == "signal"
                got = hist.wait_for(signal_checkpoint, trainer, 60)
                if got is None and trainer.poll() is None:
                    ok = False
                    self.failures.append("SIGUSR1: no signal checkpoint within 60 s")
                elif got is None:  # it ended first: the signal came after its last step, not an interruption
                    delivered = any(signal_checkpoint(e) for e in hist.events[seen:])
                    rc = trainer.poll()
                    hist.poll()
                    # after close() SIGUSR1 is ignored: no exit is explained by it, but a full disk's
                    # SaveFailed after max_failed_saves is the documented end (docs/FAULTS.md)
                    if not delivered and rc != 0 and not (rc in (1, 2) and trainer.may_fail_saves):
                        ok, delivered = False, True
                        self.failures.append(f"SIGUSR1: exit {rc} without a signal checkpoint")
            trainer.kill_all()
        elif kind == "sigusr1-start":
            ok, delivered = self.usr1_at_start(trainer, hist)
        elif kind in ("outage", "outage-close"):
            if self.store is None or not self.running(hist, trainer):
                return trainer
            how = r.choice(OUTAGES)
            time.sleep(r.uniform(0, 0.6))
            self.store.break_(how)
            self.lap_outages += 1
            delivered = True
            try:
                if kind == "outage":
                    time.sleep(r.uniform(0.5, 8.0))
                else:  # the close runs with the store down
                    time.sleep(r.uniform(0, 2.0))
                    t0 = time.monotonic()
                    sent = trainer.signal(signal.SIGTERM)
                    rc = trainer.wait(HANG_S)
                    if rc is None:
                        ok = False
                        self.failures.append(f"outage-close ({how}): hung (no exit within {HANG_S:.0f} s of SIGTERM)")
                        trainer.kill_all()
                    elif sent and rc != 0 and not self._ended_at_total(hist, rc):
                        ok = False
                        self.failures.append(f"outage-close ({how}): exit {rc} after SIGTERM")
                    elif sent:
                        self.close_s.append(round(time.monotonic() - t0, 1))
            finally:
                self.store.mend(how)
            if kind == "outage" and trainer.poll() not in (None, 0):  # (outage-close judged its own exit above)
                ok = False
                self.failures.append(f"outage ({how}): the trainer exited {trainer.poll()}")
        elif kind == "enospc":
            if not self.running(hist, trainer):
                return trainer
            if hist.committed == 0 and hist.wait_for(lambda r: r.get("event") == "checkpoint", trainer, 60) is None:
                return trainer  # a full disk is delivered once a generation exists, to be deep-checked while full
            time.sleep(r.uniform(0, 0.3))
            if trainer.poll() is not None:
                return trainer
            ok = self.full_disk(trainer, run, hist)
            trainer.may_fail_saves = True
            delivered = True
        hist.poll()  # the lines of a trainer that ended are all on disk: none is taken for the next one's
        if trainer.orphans:
            self.orphans += trainer.orphans
            self.failures.append(f"{kind}: {trainer.orphans} rank(s) trained on after their launcher was killed")
            trainer.orphans = 0
        if not delivered:
            return trainer
        self.delivered[kind] += 1
        self.survived[kind] += ok
        self.last_kind = kind
        if trainer.poll() is None:
            return trainer
        if self.sabotage == "lose" and kind != "sigterm":
            self.lose_newest(run, hist)
        if self.finals(run) is not None:  # it had finished its lap before the interruption landed: judged above
            trainer.ended_by_late_signal = True
            return trainer
        hist.pending.append((kind, trainer.token))  # measured at the next start's soak_start line
        return self.start(run)

    def usr1_at_start(self, trainer: Trainer, hist: LapHistory) -> tuple[bool, bool]:
        """SIGUSR1 at a random moment from ripresa's first line in the process; (survived, delivered)."""
        r = self.rng
        t0 = time.monotonic()
        while not ripresa_started(trainer.pid):
            if trainer.poll() is not None or time.monotonic() - t0 > 120:
                return True, False
            time.sleep(0.001)
        time.sleep(r.uniform(0, 0.3 if trainer.how == "fork" else 3.0))
        hist.poll()
        seen = len(hist.events)
        target = trainer.pid
        if trainer.how == "torchrun" and r.random() < 0.5:
            ranks = trainer.ranks()
            target = r.choice(ranks) if ranks else target
        if trainer.poll() is not None:
            return True, False
        try:
            os.kill(target, signal.SIGUSR1)
        except ProcessLookupError:
            return True, False

        def signal_checkpoint(rec: dict[str, Any]) -> bool:
            return rec.get("event") == "checkpoint" and rec.get("reason") == "signal"

        got = hist.wait_for(signal_checkpoint, trainer, 120)
        rc = trainer.poll()
        hist.poll()
        if got is None and rc is None and hist.last_step == TOTAL[self.name]:
            return True, True  # past its last step (in close): ignored; a close that never ends is judged as hung
        if got is None and rc is None:
            self.failures.append("SIGUSR1 at start: no signal checkpoint within 120 s")
            return False, True
        if got is None and rc in (1, 2) and trainer.may_fail_saves:
            return True, True  # the disk was full: SaveFailed after max_failed_saves is its documented end
        if got is None and rc != 0 and not any(signal_checkpoint(e) for e in hist.events[seen:]):
            self.failures.append(f"SIGUSR1 at start: exit {rc} without a signal checkpoint")
            return False, True
        return True, True

    def blame(self, hist: LapHistory) -> None:
        """A lost generation shows at the next start: the interruption before it did not survive."""
        new = len(hist.lost) - self.lost_seen
        if new > 0 and self.last_kind is not None:
            self.survived[self.last_kind] -= min(new, self.survived[self.last_kind])
            self.lost_by_kind[self.last_kind] += new
        self.lost_seen = len(hist.lost)

    def full_disk(self, trainer: Trainer, run: Path, hist: LapHistory) -> bool:
        """Fill the tmpfs; wait for a failed save; deep-check the newest generation while full; free the room."""
        from ripresa.store.backend import latest_valid_any

        assert self.tmpfs is not None
        filler = self.tmpfs.fill()
        if filler is None:
            usage = {p.name: p.stat().st_size for p in self.tmpfs.where.rglob("*") if p.is_file()}
            self.notes.append(f"the tmpfs was full before the filler: {sorted(usage.items(), key=lambda x: -x[1])[:6]}")
        try:
            failed = hist.wait_for(lambda r: r.get("event") == "checkpoint_failed", trainer, 30)
            if failed is None and trainer.poll() is None:
                self.failures.append("ENOSPC: no failed save within 30 s on a full disk")
                return False
            hist.poll()
            gen = latest_valid_any(run, deep=True, warn=False)
            ok = gen is not None and gen.valid and gen.step >= hist.committed
            if not ok:
                self.failures.append(f"ENOSPC: deep check while full: {gen and gen.reason}, step "
                                     f"{gen and gen.step} vs committed {hist.committed}")
            time.sleep(self.rng.uniform(0, 0.2))
            return ok
        finally:
            if filler is not None:
                filler.unlink()

    def keep(self, run: Path, name: str) -> None:
        """Keep a failed lap's history for the post-mortem (build/soak/failed/)."""
        dest = Path(self.args.out) / "failed"
        dest.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copy(run / ".loss.jsonl", dest / f"{self.name}-{name}.jsonl")

    def lose_newest(self, run: Path, hist: LapHistory) -> None:
        """Sabotage (tests the soak itself): delete the newest committed generation before the restart."""
        hist.poll()
        if hist.committed <= 0:
            return
        for p in run.glob(f"step_{hist.committed:06d}*"):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()

    def discard_memory(self, run: Path) -> None:
        """Remove the memory tier's generations of ``run`` (in ``/dev/shm``, outside the run folder)."""
        if self.memory_every:
            from ripresa.store.memory import discard

            discard(run)

    def close(self) -> None:
        if self.tmpfs is not None:
            self.tmpfs.close()

    def record(self) -> dict[str, Any]:
        if self.delivered.get("lost-folder"):
            self.notes.append(f"lost-folder: {self.mirror_resumes} of {self.delivered['lost-folder']} restarts resumed "
                              "a generation pulled from the mirror (the others: none uploaded yet, step 0)")
        if self.store is not None:
            self.notes.append(f"mirror-event history lines: at most {self.max_mirror_lines} in one lap; outages "
                              f"{dict(self.store.outages)}; SIGTERM to exit with the store down: "
                              f"{max(self.close_s) if self.close_s else '-'} s at most ({len(self.close_s)} closes)")
        if self.orphans:
            self.notes.append(f"{self.orphans} rank(s) outlived their killed launcher (SIGKILLed by the soak)")
        if self.memory_every:
            self.notes.append(f"memory tier every {self.memory_every} step(s): {len(self.memory_resumes)} start(s) "
                              f"resumed from it; {len(self.memory_skipped)} memory generation(s) not used or tier off"
                              + (f" (first: {self.memory_skipped[0]})" if self.memory_skipped else ""))
        if self.probe_every:
            self.notes.append(f"live probe every {self.probe_every} generation(s): {self.probes['probe_ok']} "
                              f"confirmed, {self.probes['probe_mismatch']} alarm(s), {self.probes['probe_off']} "
                              "turned off (a side process that found its generation gone: a trainer killed under it)")
        if self.rankless:
            self.notes.append(f"sigkill-rank sent nothing {self.rankless} time(s): the ranks had ended (not counted)")
        return {"delivered": dict(self.delivered), "survived": dict(self.survived),
                "lost_by_kind": dict(self.lost_by_kind), "mirror_resumes": self.mirror_resumes, "starts": dict(self.starts),
                "generations": self.generations, "redone_steps": self.redone, "laps": self.laps,
                "equal_laps": self.equal_laps, "diverged_steps": self.diverged, "lost": len(self.lost),
                "lost_detail": self.lost[:20], "failures": self.failures[:20], "notes": self.notes,
                "wall_s": self.wall_s, "total_steps": TOTAL[self.name], "every": EVERY[self.name], "sabotage": self.sabotage,
                "max_mirror_lines": self.max_mirror_lines, "close_s": self.close_s, "orphans": self.orphans,
                "memory_every": self.memory_every, "redone_by_kind": self.redone_by_kind,
                "redone_per_interruption": redone_summary(self.redone_by_kind),
                "memory_resumes": len(self.memory_resumes), "memory_skipped": self.memory_skipped[:20],
                "probe_every": self.probe_every, "probes": dict(self.probes)}


# ====================================================================== the nodes lane
#: The nodes lane: two "nodes" (one torchrun launcher each, 1 rank, FSDP2 on gloo) on node-local folders,
#: committed through the store (docs/DISTRIBUTED.md); tests/fixtures/fsdp_loop.py, slowed to give a kill a window.
NODES_STEP_MS = 60.0
#: Seconds after the first step of a start within which a node-kill, a SIGTERM or an outage lands.
NODES_WINDOW_S = 3.0
#: ``node-kill-start``: seconds after the victim's rank was spawned within which the kill lands (before the
#: first step: import, the group's start, the resume take ~5-8 s on 2 cores).
NODES_START_S = 5.0
#: Seconds a node's rank may outlive its launcher (bound to it, the kernel ends it at once).
ORPHAN_S = 5.0
#: A survivor slower than this to exit after its peer's SIGKILL is noted, its log kept (HANG_S is the failure).
NODES_SLOW_EXIT_S = 10.0
#: Starts of one lap before it is given up (a failure): a lap that never commits its last step.
NODES_MAX_STARTS = 40


class NodeStart:
    """One start of a nodes-lane lap: both nodes' launchers (tests/support/nodes.py), started together."""

    def __init__(self, nodes: list[Any], ids_offset: int) -> None:
        self.nodes = nodes
        self.ids_offset = ids_offset  # rank 0's sample-id file before this start: its first new line is its first step
        self.interrupted = False
        self.t0 = time.monotonic()

    def rcs(self) -> list[int | None]:
        return [n.proc.poll() for n in self.nodes]

    def running(self) -> bool:
        return any(rc is None for rc in self.rcs())

    def wait(self, timeout: float) -> list[int | None]:
        end = time.monotonic() + timeout
        while self.running() and time.monotonic() < end:
            time.sleep(0.02)
        return self.rcs()

    def ranks(self) -> list[int]:
        from ripresa.session.torchrun import children

        return [p for n in self.nodes if n.proc.poll() is None for p in children(n.proc.pid)]

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()
        for n in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=60)


class NodeStore:
    """What the driver reads of a lap's store (never through the fault proxy): committed steps, markers, objects."""

    def __init__(self, url: str, store: Store | None) -> None:
        self.url = url
        self.s3 = url.startswith("s3://")
        if self.s3:
            import boto3

            assert store is not None
            self.bucket, _, self.prefix = url[len("s3://"):].partition("/")
            self.client = boto3.client("s3", endpoint_url=store.moto.url, region_name="us-east-1",
                                       aws_access_key_id="testing", aws_secret_access_key="testing")
        else:
            self.path = Path(url[len("file://"):])

    def keys(self) -> list[str]:
        if not self.s3:
            if not self.path.exists():
                return []
            return [str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file()]
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            out.extend(o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", []))
        return out

    def get(self, key: str) -> bytes | None:
        if not self.s3:
            p = self.path / key
            return p.read_bytes() if p.is_file() else None
        try:
            return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def delete(self, key: str) -> None:
        if not self.s3:
            (self.path / key).unlink(missing_ok=True)
        else:
            self.client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")

    def committed(self) -> list[int]:
        """The steps of the generations the store holds committed (their marker), oldest first."""
        out = []
        for k in self.keys():
            if "/" not in k and k.startswith("step_") and k.endswith(".dcp.sha256"):
                with contextlib.suppress(ValueError):
                    out.append(int(k[len("step_"):-len(".dcp.sha256")]))
        return sorted(out)

    def newest(self) -> int:
        steps = self.committed()
        return steps[-1] if steps else 0

    def shards(self, step: int) -> tuple[dict[str, str] | None, str]:
        """Generation ``step``'s ``.distcp`` files as the store holds them: name → sha256 of the object's bytes,
        each checked against its marker line; (None, why) when the marker is absent or an object differs."""
        marker = self.get(f"step_{step:06d}.dcp.sha256")
        if marker is None:
            return None, f"no marker of step {step} in the store"
        out = {}
        for line in marker.decode().splitlines():
            sha, _, name = line.partition("  ")
            if not name.endswith(".distcp"):
                continue
            data = self.get(name)
            if data is None or hashlib.sha256(data).hexdigest() != sha:
                return None, f"{name}: {'absent' if data is None else 'differs from its marker'}"
            out[name.rsplit("/", 1)[-1]] = sha
        if not out:
            return None, f"the marker of step {step} names no .distcp file"
        return out, ""


class IdsFollower:
    """Follows the lap's sample-id files (fsdp_loop.py ``--ids``: ``step epoch ids`` per line and rank): each
    start's first step (the step it resumed, plus one) and every step's ids against the uninterrupted run's."""

    def __init__(self, root: Path, ref: dict[int, dict[int, str]] | None) -> None:
        self.paths = {r: root / f"ids.{r}" for r in (0, 1)}
        self.offsets = {0: 0, 1: 0}
        self.ref = ref
        self.bar: int | None = None  # the newest committed step when the latest start was launched (to check)
        self.max_step = 0
        self.starts: list[int] = []
        self.redone = 0
        self.lost: list[str] = []
        self.diverged: list[str] = []

    def size(self) -> int:
        try:
            return self.paths[0].stat().st_size
        except FileNotFoundError:
            return 0

    def started(self, bar: int) -> None:
        self.poll()
        self.bar = bar

    def poll(self) -> bool:
        """Read new lines; True when rank 0 took a step since the latest start."""
        stepped = False
        for r, path in self.paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            self.offsets[r] += end
            for raw in data[:end].decode().splitlines():
                step_s, _, rest = raw.partition(" ")
                step = int(step_s)
                if self.ref is not None and self.ref.get(r, {}).get(step) != rest:
                    self.diverged.append(f"rank {r} step {step}: ids {rest!r}, uninterrupted "
                                         f"{self.ref.get(r, {}).get(step)!r}")
                if r != 0:
                    continue
                stepped = True
                if self.bar is not None:  # the first step of a start: it resumed step - 1
                    start = step - 1
                    self.starts.append(start)
                    self.redone += max(0, self.max_step - start)
                    if start < self.bar:
                        self.lost.append(f"resumed step {start} while step {self.bar} was committed in the store")
                    self.bar = None
                self.max_step = max(self.max_step, step)
        return stepped

    def read_all(self) -> dict[int, dict[int, str]]:
        out: dict[int, dict[int, str]] = {}
        for r, path in self.paths.items():
            for raw in path.read_text().splitlines():
                step_s, _, rest = raw.partition(" ")
                out.setdefault(r, {})[int(step_s)] = rest
        return out


class NodesLane(Laps):
    """Two nodes on node-local folders, committed through the store; nodes killed, lost, the store down, SIGTERM.

    Odd laps use the S3 server through the fault proxy, even laps a ``file://`` store (no
    ``outage`` there). Every start launches both nodes again (a fresh rendezvous, as an operator would).
    """

    name = "nodes"

    def __init__(self, args: argparse.Namespace, budget: int, root: Path, env: dict[str, str],
                 store: Store | None) -> None:
        sys.path.insert(0, str(REPO / "tests"))
        self.args, self.budget, self.env, self.store = args, budget, env, store
        self.rng = random.Random(f"{args.seed}/nodes")
        self.kinds = list(KINDS["nodes"])
        self.root = root / "nodes"
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.notes: list[str] = []
        for k, why in KNOWN_FAILING.items():
            if k not in args.kinds:
                self.notes.append(f"{k} left out (known to fail, drawn only with --kinds {k}): {why}")
        if store is None:
            self.kinds.remove("outage")
            self.notes.append("outage left out: no S3 server (every lap on a file:// store)")
        self.delivered: Counter[str] = Counter()
        self.survived: Counter[str] = Counter()
        self.lost_by_kind: Counter[str] = Counter()
        self.failures: list[str] = []
        self.starts: Counter[str] = Counter()
        self.lost: list[str] = []
        self.generations = self.redone = self.laps = self.equal_laps = self.diverged = self.orphans = 0
        self.wall_s = 0.0
        self.exit_s: list[float] = []  # node-kill/node-lost: seconds from the SIGKILL to the survivor's exit
        self.sequence: list[dict[str, Any]] = []  # every interruption delivered, in order (the JSON's "sequence")
        self.kills: list[dict[str, Any]] = []  # each kill: victim, moment, the survivor's exit and its seconds
        self.survivor_rcs: Counter[int] = Counter()
        self.named = 0  # survivors whose log names the lost node (NodeLost, exit 4, before their agent ended them)
        self.failed_saves = 0  # checkpoint_failed events in rank 0's histories (a store outage: training goes on)
        self.node_lost_count = 0
        self.hung = 0  # nodes that did not exit within HANG_S (their stacks are kept)
        self.at_start = 0  # node kills that landed before the start's first step
        self.close_s: list[float] = []  # sigterm: seconds from SIGTERM to both launchers' exit
        self.outages: Counter[str] = Counter()
        self.last_kind: str | None = None
        self.lost_seen = 0
        self.sabotage = args.sabotage.get("nodes")
        self.max_mirror_lines = 0

    # ------------------------------------------------------------ helpers
    def url(self, lap: int, root: Path) -> str:
        if self.store is not None and lap % 2 == 1:
            return f"s3://{self.store.bucket}/{self.args.seed}/lap{lap:04d}"
        return f"file://{root / 'store'}"

    def launch(self, root: Path, url: str) -> NodeStart:
        from support.nodes import FSDP_LOOP, launch

        args = ["--mirror", url, "--sync", "--step-ms", str(NODES_STEP_MS), "--every", str(EVERY["nodes"]),
                "--steps", str(TOTAL["nodes"]), "--ids", str(root / "ids")]
        ids_offset = (root / "ids.0").stat().st_size if (root / "ids.0").exists() else 0
        start = NodeStart(launch(root, 2, FSDP_LOOP, args, env=self.env), ids_offset)
        self.starts["torchrun"] += 2
        return start

    def reference(self) -> None:
        root = self.root / "reference"
        root.mkdir()
        url = f"file://{root / 'store'}"
        start = self.launch(root, url)
        rcs = start.wait(900)
        if rcs != [0, 0]:
            start.kill()
            raise RuntimeError(f"nodes: the uninterrupted run exited {rcs}; see {root}/node*.log")
        hist = LapHistory(root / "node0" / "run", None)
        hist.poll()
        self.ref_losses = hist.losses
        self.ref_ids = IdsFollower(root, None).read_all()
        final, why = NodeStore(url, None).shards(TOTAL["nodes"])
        if final is None or len(self.ref_losses) != TOTAL["nodes"]:
            raise RuntimeError(f"nodes: the uninterrupted run left no final generation in its store ({why})")
        self.ref_final = final
        shutil.rmtree(root)


    def blame(self, ids: IdsFollower) -> None:
        new = len(ids.lost) - self.lost_seen
        if new > 0 and self.last_kind is not None:
            self.survived[self.last_kind] -= min(new, self.survived[self.last_kind])
            self.lost_by_kind[self.last_kind] += new
        self.lost_seen = len(ids.lost)

    # ------------------------------------------------------------ a lap
    def lap(self, n: int) -> None:
        root = self.root / f"lap{n:04d}"
        root.mkdir()
        url = self.url(n, root)
        store = NodeStore(url, self.store)
        hist = LapHistory(root / "node0" / "run", self.ref_losses)
        ids = IdsFollower(root, self.ref_ids)
        failures = len(self.failures)
        kinds = [k for k in self.kinds if (k in self.args.kinds if self.args.kinds else k not in KNOWN_FAILING)
                 and (k != "outage" or store.s3)]
        start = self.launch(root, url)
        self.sequence.append({"lap": n, "store": "s3" if store.s3 else "file"})
        ids.started(0)
        starts = 1
        while True:
            hist.poll()
            ids.poll()
            self.blame(ids)
            if not start.running():
                rcs = start.rcs()
                if store.newest() == TOTAL["nodes"]:
                    break
                if not start.interrupted:
                    self.failures.append(f"lap {n}: the nodes exited {rcs} without being interrupted")
                if starts >= NODES_MAX_STARTS:
                    self.failures.append(f"lap {n}: no final generation in the store after {starts} starts")
                    break
                bar = store.newest()
                if self.sabotage == "lose" and bar > 0:  # (tests the soak itself) the newest commit is deleted
                    store.delete(f"step_{bar:06d}.dcp.sha256")
                start = self.launch(root, url)
                self.sequence.append({"start": starts, "resume_bar": bar})
                starts += 1
                ids.started(bar)
                continue
            left = self.budget - sum(self.delivered.values())
            if left <= 0 or not kinds:  # the budget is spent: let this lap finish undisturbed
                if None in start.wait(600):
                    self.failures.append(f"lap {n}: the last start did not finish within 600 s")
                    start.kill()
                    start.interrupted = True
                continue
            kind = self.rng.choice(kinds)
            self.interrupt(kind, start, root, store, hist, ids)
        hist.poll()
        ids.poll()
        self.blame(ids)
        self.laps += 1
        final, why = store.shards(TOTAL["nodes"])
        equal = final == self.ref_final
        self.equal_laps += equal
        if not equal:
            self.lost.append(f"lap {n}: the final generation's shards differ from the uninterrupted run's "
                             f"({why or 'other bytes'})")
            self.keep(root, n, "differs")
        self.lost.extend(f"lap {n}: {x}" for x in ids.lost)
        self.lost_seen = 0
        self.diverged += len(hist.diverged) + len(ids.diverged)
        if ids.diverged:
            self.failures.extend(f"lap {n}: {x}" for x in ids.diverged[:3])
        self.generations += hist.generations
        self.failed_saves += sum(e.get("event") == "checkpoint_failed" for e in hist.events)
        self.redone += ids.redone
        self.max_mirror_lines = max(self.max_mirror_lines, hist.mirror_lines)
        if equal and not ids.lost and not ids.diverged and len(self.failures) == failures:
            shutil.rmtree(root, ignore_errors=True)
        else:
            self.keep(root, n, "failed")

    def keep(self, root: Path, n: int, why: str) -> None:
        """A failed lap's folder stays (build/soak/runs/nodes/lapNNNN: nodes' logs, histories); noted."""
        self.notes.append(f"lap {n} ({why}) kept: {root}")

    def training(self, start: NodeStart, ids: IdsFollower, timeout: float = 180) -> bool:
        """Wait until this start has taken its first step (both nodes joined, resumed, handlers installed)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and start.running():
            try:
                if (start.ids_offset < (ids.paths[0].stat().st_size)) and start.rcs() == [None, None]:
                    return True
            except FileNotFoundError:
                pass
            time.sleep(0.02)
        return False

    @staticmethod
    def ids_size(root: Path) -> int:
        try:
            return (root / "ids.0").stat().st_size
        except FileNotFoundError:
            return 0

    def dump(self, root: Path, node: Any, where: Path | None = None, hung: bool = True) -> Path:
        """The Python stacks of a hung (or slow) node's launcher and ranks (py-spy, when installed), its log's tail."""
        from ripresa.session.torchrun import children

        where = root if where is None else where
        where.mkdir(parents=True, exist_ok=True)
        out = where / f"{'hung' if hung else 'slow'}-node{node.index}.{int(time.time())}.txt"
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        with open(out, "w") as f:
            for pid in [node.proc.pid, *children(node.proc.pid)]:
                f.write(f"==== pid {pid}\n")
                f.flush()
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run([spy, "dump", "--pid", str(pid)], stdout=f, stderr=subprocess.STDOUT, timeout=60)
            with contextlib.suppress(OSError):
                f.write("==== log\n" + node.log.read_text(errors="replace")[-6000:])
        self.hung += hung
        return out

    def orphaned(self, kind: str, ranks: list[int], moment: str, whose: str = "the killed node's") -> bool:
        """``ranks`` still alive are orphans (a failure): SIGKILLed; True when there is none."""
        ranks = [p for p in ranks if alive(p)]
        for p in ranks:
            self.orphans += 1
            self.failures.append(f"{kind}: {whose} rank (pid {p}) outlived its launcher by {ORPHAN_S:.0f} s ({moment})")
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return not ranks

    def node_kill(self, kind: str, start: NodeStart, root: Path, store: NodeStore, hist: LapHistory,
                  victim: int | None = None) -> None:
        """SIGKILL one node's launcher session; the other must exit non-zero within :data:`HANG_S`, its ranks
        too (within :data:`ORPHAN_S`); ``node-lost``: the killed node's folder is deleted as well."""
        ok = True
        victim = self.rng.randrange(2) if victim is None else victim
        from ripresa.session.torchrun import children

        ranks = children(start.nodes[victim].proc.pid)  # the killed node's ranks: they must die with it
        others = children(start.nodes[1 - victim].proc.pid)
        moment = (f"{time.monotonic() - start.t0:.1f} s after the launch, "
                  + ("before the first step" if start.ids_offset == self.ids_size(root) else "training"))
        node, other = start.nodes[victim], start.nodes[1 - victim]
        node.kill()
        t0 = time.monotonic()
        start.interrupted = True
        end = t0 + HANG_S
        stacks = None
        while other.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.01)
            if stacks is None and time.monotonic() > t0 + NODES_SLOW_EXIT_S:  # where a slow survivor waits
                stacks = self.dump(root, other, Path(self.args.out) / "failed", hung=False)
            if ranks and time.monotonic() > t0 + ORPHAN_S:  # the killed node's ranks outlived it: orphans
                ok = self.orphaned(kind, ranks, moment) and ok
                ranks = []
        rc = other.proc.poll()
        if rc is None:
            ok = False
            dump = self.dump(root, other)
            self.failures.append(f"{kind}: node {1 - victim} hung (no exit within {HANG_S:.0f} s of node "
                                 f"{victim}'s SIGKILL, {moment}); stacks: {dump}")
            start.kill()
        else:
            took = round(time.monotonic() - t0, 1)
            self.exit_s.append(took)
            self.survivor_rcs[rc] += 1
            self.kills.append({"kind": kind, "victim": victim, "moment": moment, "exit": rc, "exit_s": took})
            self.sequence.append(self.kills[-1])
            if took > NODES_SLOW_EXIT_S:  # slower than a lost node is named (~4-5 s): the survivor's log is kept
                kept = Path(self.args.out) / "failed" / f"nodes-slow-exit-{len(self.kills)}.log"
                kept.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copy(other.log, kept)
                self.notes.append(f"{kind}: node {1 - victim} exited {rc} {took} s after node {victim}'s SIGKILL "
                                  f"({moment}); its log: {kept}; its stacks at {NODES_SLOW_EXIT_S:.0f} s: {stacks}")
            if rc == 0 and store.newest() != TOTAL["nodes"]:
                ok = False
                self.failures.append(f"{kind}: node {1 - victim} exited 0 after node {victim} was killed")
        start.wait(60)
        with contextlib.suppress(OSError):
            self.named += "lost node" in other.log.read_text(errors="replace")
        while ranks and time.monotonic() < t0 + ORPHAN_S:
            ranks = [p for p in ranks if alive(p)]
            time.sleep(0.05)
        ok = self.orphaned(kind, ranks, moment) and ok
        end = time.monotonic() + ORPHAN_S  # the survivor's ranks end with their agent
        while others and time.monotonic() < end:
            others = [p for p in others if alive(p)]
            time.sleep(0.05)
        ok = self.orphaned(kind, others, moment, "the surviving node's") and ok
        if kind == "node-lost":
            shutil.rmtree(root / f"node{victim}")
            self.node_lost_count += 1
            if victim == 0:
                hist.poll()
                hist.reset_file()
        self.delivered[kind] += 1
        self.survived[kind] += ok
        self.last_kind = kind

    def interrupt(self, kind: str, start: NodeStart, root: Path, store: NodeStore, hist: LapHistory,
                  ids: IdsFollower) -> None:
        r = self.rng
        if kind == "node-kill-start":
            # during the start, once the victim's rank runs: its import, the group's start, the Checkpointer's
            # start, the resume (a pull from the store)
            from ripresa.session.torchrun import children

            victim = r.randrange(2)
            end = start.t0 + 120
            while not children(start.nodes[victim].proc.pid) and start.rcs() == [None, None] \
                    and time.monotonic() < end:
                time.sleep(0.01)
            end = time.monotonic() + r.uniform(0, NODES_START_S)
            while time.monotonic() < end and start.rcs() == [None, None] and start.ids_offset == ids.size():
                time.sleep(0.01)
            if start.rcs() == [None, None]:
                self.at_start += start.ids_offset == ids.size()
                self.node_kill(kind, start, root, store, hist, victim)
            return
        if not self.training(start, ids):
            if start.running():
                self.failures.append(f"{kind}: no first step within 180 s of the start")
                start.kill()
                start.interrupted = True
            return
        time.sleep(r.uniform(0, NODES_WINDOW_S))
        if start.rcs() != [None, None]:
            return  # the lap ended (or a node failed: judged by the lap)
        ok = True
        if kind in ("node-kill", "node-lost"):
            self.node_kill(kind, start, root, store, hist)
            return
        if kind == "sigterm":
            hist.poll()
            seen = len(hist.events)
            t0 = time.monotonic()
            for node in start.nodes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.proc.pid, signal.SIGTERM)
            start.interrupted = True
            rcs = start.wait(HANG_S)
            self.sequence.append({"kind": kind, "at": round(t0 - start.t0, 1), "exits": rcs})
            if None in rcs:
                ok = False
                self.failures.append(f"sigterm: hung (no exit within {HANG_S:.0f} s): exits {rcs}")
                start.kill()
            else:
                self.close_s.append(round(time.monotonic() - t0, 1))
                hist.poll()
                mine = hist.events[seen:]
                stops = [e["step"] for e in mine if e.get("event") == "signal" and e.get("action") == "stop"]
                saved = [e["step"] for e in mine if e.get("event") == "checkpoint" and e.get("reason") == "stop"]
                last = hist.last_step
                newest = store.newest()
                at_end = last == TOTAL["nodes"] == newest
                if not at_end and (stops != [last] or saved != [last] or newest != last):
                    ok = False
                    self.failures.append(f"sigterm: exits {rcs}, stop signal at {stops}, stop checkpoint {saved}, "
                                         f"last step {last}, newest in the store {newest}")
                    self.keep(root, 0, "sigterm")
        elif kind == "outage":
            assert self.store is not None
            before = store.newest()
            how = r.choice(OUTAGES)
            self.store.break_(how)
            self.outages[how] += 1
            lasts = r.uniform(0.5, 8.0)
            self.sequence.append({"kind": kind, "how": how, "s": round(lasts, 1),
                                  "at": round(time.monotonic() - start.t0, 1)})
            try:
                time.sleep(lasts)
            finally:
                self.store.mend(how)
            after = store.newest()
            shards, why = store.shards(after) if after else ({}, "")
            if after < before or shards is None:
                ok = False
                self.failures.append(f"outage ({how}): the store's newest generation was {before}, now {after} "
                                     f"{why}")
            rcs = start.rcs()
            if any(rc not in (None, 0) for rc in rcs):
                ok = False
                start.interrupted = True
                self.failures.append(f"outage ({how}): the nodes exited {rcs}")
                self.keep(root, 0, "outage")
        self.delivered[kind] += 1
        self.survived[kind] += ok
        self.last_kind = kind

    def close(self) -> None:
        pass

    def record(self) -> dict[str, Any]:
        if self.exit_s:
            self.notes.append(f"a node SIGKILLed: the other exited within {max(self.exit_s)} s at most "
                              f"(exits {dict(self.survivor_rcs)}); {self.named} of {len(self.exit_s)} "
                              f"survivors' logs name the lost node; {self.at_start} kill(s) before the first step")
        if self.node_lost_count:
            self.notes.append(f"node-lost: {self.node_lost_count} folder(s) deleted, the fresh node resumed from the store")
        if self.close_s:
            self.notes.append(f"SIGTERM to both launchers: exit within {max(self.close_s)} s at most")
        if self.outages:
            self.notes.append(f"outages {dict(self.outages)}; {self.failed_saves} save(s) failed, training went on")
        return {"delivered": dict(self.delivered), "survived": dict(self.survived),
                "lost_by_kind": dict(self.lost_by_kind), "mirror_resumes": 0, "starts": dict(self.starts),
                "generations": self.generations, "redone_steps": self.redone, "laps": self.laps,
                "equal_laps": self.equal_laps, "diverged_steps": self.diverged, "lost": len(self.lost),
                "lost_detail": self.lost[:20], "failures": self.failures[:20], "notes": self.notes,
                "wall_s": self.wall_s, "total_steps": TOTAL["nodes"], "every": EVERY["nodes"],
                "sabotage": self.sabotage, "max_mirror_lines": self.max_mirror_lines, "close_s": self.close_s,
                "orphans": self.orphans, "hung": self.hung, "exit_s": self.exit_s, "kills": self.kills, "sequence": self.sequence, "survivor_exits": dict(self.survivor_rcs)}


def newest_mirrored(mirror: Path | None) -> int:
    """The newest step of a local-path mirror that verifies (its marker last; docs/MIRROR.md), or 0."""
    from ripresa.store.backend import latest_valid_any

    if mirror is None or not mirror.exists():
        return 0
    gen = latest_valid_any(mirror, deep=True, warn=False)
    return gen.step if gen is not None else 0


def mirror_available() -> bool:
    import inspect

    from ripresa.session.checkpointer import Checkpointer

    return "mirror" in inspect.signature(Checkpointer).parameters


def redone_summary(by_kind: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
    """Steps redone per interruption, per kind: count, mean, max."""
    return {k: {"n": len(v), "mean": round(sum(v) / len(v), 2), "max": max(v)} for k, v in sorted(by_kind.items()) if v}


def split_budget(total: int, lanes: list[str], ddp_share: float) -> dict[str, int]:
    out: dict[str, int] = {}
    single = [x for x in lanes if x != "ddp"]
    ddp = round(total * ddp_share) if "ddp" in lanes and single else (total if "ddp" in lanes else 0)
    for i, lane in enumerate(single):
        out[lane] = (total - ddp) // len(single) + (1 if i < (total - ddp) % len(single) else 0)
    if "ddp" in lanes:
        out["ddp"] = ddp
    return out


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"soak — seed {result['seed']}, {result['wall_s']:.0f} s")
    for col in ("lane", "kind", "delivered", "survived", "lost after it"):
        table.add_column(col, justify="left" if col in ("lane", "kind") else "right")
    for lane, rec in result["lanes"].items():
        for kind in sorted(rec["delivered"]):
            table.add_row(lane, kind, str(rec["delivered"][kind]), str(rec["survived"].get(kind, 0)),
                          str(rec["lost_by_kind"].get(kind, 0)))
    table.add_section()
    table.add_row("all", "interruptions", str(result["delivered"]), str(result["survived"]),
                  str(sum(sum(r["lost_by_kind"].values()) for r in result["lanes"].values())))
    console = Console(width=120)
    console.print(table)
    summary = Table(show_header=True)
    for col in ("lane", "starts (fork/fresh/torchrun)", "generations", "redone steps", "laps equal", "diverged steps",
                "lost"):
        summary.add_column(col)
    for lane, rec in result["lanes"].items():
        s = rec["starts"]
        summary.add_row(lane, f"{s.get('fork', 0)}/{s.get('fresh', 0)}/{s.get('torchrun', 0)}", str(rec["generations"]),
                        str(rec["redone_steps"]), f"{rec['equal_laps']}/{rec['laps']}", str(rec["diverged_steps"]),
                        str(rec["lost"]))
    summary.add_section()
    summary.add_row("all", "", str(result["generations"]), str(result["redone_steps"]),
                    f"{result['equal_laps']}/{result['laps']}", str(result["diverged_steps"]), str(result["lost"]))
    console.print(summary)
    tier = f"memory tier every {result['memory_every']} step(s)" if result.get("memory_every") else "memory tier off"
    redone = Table(title=f"steps redone per interruption ({tier})")
    for col in ("lane", "kind", "restarts", "mean", "max"):
        redone.add_column(col, justify="left" if col in ("lane", "kind") else "right")
    for lane, rec in result["lanes"].items():
        for kind, s in rec.get("redone_per_interruption", {}).items():
            redone.add_row(lane, kind, str(s["n"]), f"{s['mean']:.2f}", str(s["max"]))
    if result.get("redone_per_interruption"):
        console.print(redone)
    for lane, rec in result["lanes"].items():
        for line in rec["notes"] + rec["failures"] + rec["lost_detail"]:
            console.print(f"  {lane}: {line}", markup=False)
    console.print(f"verdict: {'PASS' if result['ok'] else 'FAIL'} — lost {result['lost']}; replay: {result['command']}",
                  markup=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ripresa's soak: >= 1,000 interruptions, bitwise final states")
    ap.add_argument("--seed", type=int, default=None, help="seed of every random choice (default: drawn, printed)")
    ap.add_argument("--interruptions", type=int, default=1000, help="interruptions in total across the lanes")
    ap.add_argument("--lanes", default=",".join(LANES), help="comma-separated: general, andrea, ddp, s3, nodes")
    ap.add_argument("--ddp-share", type=float, default=0.08, help="share of the interruptions for the ddp lane")
    ap.add_argument("--nodes-interruptions", type=int, default=NODES_INTERRUPTIONS,
                    help="interruptions of the nodes lane when other lanes run too (taken from --interruptions)")
    ap.add_argument("--fresh-share", type=float, default=0.1, help="single-process starts in a fresh interpreter")
    ap.add_argument("--kinds", default="", help="comma-separated: only these interruption kinds (a replay)")
    ap.add_argument("--total", type=int, default=0, help="steps per lap of the single-process lanes (default: 1000, 400, 300)")
    ap.add_argument("--tmpfs-bytes", type=int, default=TMPFS_BYTES)
    ap.add_argument("--sabotage", default="", help="LANE=lose|rng,...: break a lane on purpose (the soak must fail)")
    ap.add_argument("--memory-every", type=int, default=0, metavar="K",
                    help="the memory tier every K steps in the single-process lanes (0: off); a SIGKILL kind "
                         "redoing more than 2K-1 steps fails (docs/FAULTS.md, \"The soak\")")
    ap.add_argument("--probe-every", type=int, default=0, metavar="K",
                    help="the live probe every K generations in the single-process lanes (0: off); an alarm on an "
                         "exact lane fails (docs/VERIFY.md, \"The live probe\")")
    ap.add_argument("--out", default=str(REPO / "build" / "soak"), help="folder of soak.json and the run folders")
    ap.add_argument("--progress-every", type=float, default=60.0, help="seconds between progress lines")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--fork-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fork_server:
        fork_server()
        return 0
    if args.worker:
        from ripresa.session.signals import hold

        hold()  # the trainer's first line (docs/ARCHITECTURE.md, "Signals through the launcher")
        return run_worker(json.loads(args.worker))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    lanes = [x for x in args.lanes.split(",") if x]
    if not lanes or any(x not in LANES for x in lanes):
        ap.error(f"--lanes takes {', '.join(LANES)}")
    args.kinds = [x for x in args.kinds.split(",") if x]
    if args.memory_every < 0:
        ap.error("--memory-every takes K >= 0 (0: the memory tier off)")
    if args.total:
        TOTAL.update(general=args.total, andrea=args.total, s3=args.total)
    args.sabotage = dict(x.split("=", 1) for x in args.sabotage.split(",") if x)
    command = (f"python tests/soak/soak.py --seed {args.seed} --interruptions {args.interruptions} --lanes {','.join(lanes)}"
               + (f" --kinds {','.join(args.kinds)}" if args.kinds else "") + (f" --total {args.total}" if args.total else "")
               + (f" --fresh-share {args.fresh_share}" if args.fresh_share != 0.1 else "")
               + (f" --ddp-share {args.ddp_share}" if args.ddp_share != 0.08 else "")
               + (f" --nodes-interruptions {args.nodes_interruptions}"
                  if args.nodes_interruptions != NODES_INTERRUPTIONS else "")
               + (f" --sabotage {','.join(f'{k}={v}' for k, v in args.sabotage.items())}" if args.sabotage else "")
               + (f" --memory-every {args.memory_every}" if args.memory_every else "")
               + (f" --probe-every {args.probe_every}" if args.probe_every else ""))
    print(f"soak: seed {args.seed}; replay: {command}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.monotonic()
    store = Store() if "s3" in lanes else None
    if store is not None:
        env.update(store.env(), AWS_ENDPOINT_URL=store.proxy.url)  # the trainers reach the store through the proxy
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            env.pop(k, None)
    others = [x for x in lanes if x != "nodes"]
    nstore = Store("soak-nodes") if "nodes" in lanes else None  # its own server and proxy: its own outages
    nenv = dict(env, **(nstore.env() if nstore else {}), AWS_ENDPOINT_URL=nstore.proxy.url if nstore else "")
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        nenv.pop(k, None)
    server = ForkServer(env) if others else None
    nodes_budget = (min(args.nodes_interruptions, args.interruptions) if others else args.interruptions
                    ) if "nodes" in lanes else 0
    budget = split_budget(args.interruptions - nodes_budget, others, args.ddp_share)
    mirror_ok = mirror_available()
    objs: dict[str, Any] = {name: Lane(name, args, budget[name], out / "runs", server, env, mirror_ok, store)
                            for name in others}
    if "nodes" in lanes:
        objs["nodes"] = NodesLane(args, nodes_budget, out / "runs", nenv, nstore)
        if args.memory_every:
            objs["nodes"].notes.append("memory tier off: a distributed session (it is built for single-process sessions)")
    errors: dict[str, str] = {}

    def drive(lane: Lane) -> None:
        try:
            lane.run()
        except Exception as exc:  # reported as a failed soak, never hidden
            import traceback

            errors[lane.name] = "".join(traceback.format_exception(exc))[-3000:]

    try:
        threads = [threading.Thread(target=drive, args=(lane,)) for lane in objs.values()]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            deadline = time.monotonic() + args.progress_every
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in threads):
                print(f"{time.monotonic() - t0:6.0f} s  " + "  ".join(
                    f"{lane.name} {sum(lane.delivered.values())}/{lane.budget} (lap {lane.laps + 1})"
                    for lane in objs.values()), flush=True)
    finally:
        for lane in objs.values():
            lane.close()
        if server is not None:
            server.close()
        for st in (store, nstore):
            if st is not None:
                st.close()
    lanes_rec = {name: lane.record() for name, lane in objs.items()}
    for name, err in errors.items():
        lanes_rec[name]["error"] = err
    result: dict[str, Any] = {
        "seed": args.seed, "command": command, "wall_s": round(time.monotonic() - t0, 1), "lanes": lanes_rec,
        "mirror": mirror_ok,
        "delivered": sum(sum(r["delivered"].values()) for r in lanes_rec.values()),
        "survived": sum(sum(r["survived"].values()) for r in lanes_rec.values()),
    }
    for key in ("generations", "redone_steps", "laps", "equal_laps", "diverged_steps", "lost"):
        result[key] = sum(r[key] for r in lanes_rec.values())
    result["memory_every"] = args.memory_every
    by_kind: dict[str, list[int]] = {}
    for r in lanes_rec.values():
        for kind, values in r.get("redone_by_kind", {}).items():
            by_kind.setdefault(kind, []).extend(values)
    result["redone_per_interruption"] = redone_summary(by_kind)
    result["failures"] = sum(len(r["failures"]) for r in lanes_rec.values())
    result["ok"] = (not errors and result["lost"] == 0 and result["diverged_steps"] == 0 and result["failures"] == 0
                    and result["survived"] == result["delivered"] and result["equal_laps"] == result["laps"] > 0)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    report(result)
    for name, err in errors.items():
        print(f"{name}: {err}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
