"""Several "nodes" on one host: each its own ``torchrun`` launcher and its own run folder, one store.

A node is launched the way users launch one (``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:PORT``), in a session of its own so that a test can SIGKILL it whole; its run folder is
``ROOT/nodeK/run`` and is never visible to another node (docs/DISTRIBUTED.md). Used by tests/test_nodes.py,
the soak's two-node lane and benchmarks/bench_nodes.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FSDP_LOOP = FIXTURES / "fsdp_loop.py"
DIST_LOOP = FIXTURES / "dist_loop.py"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    """One node's launcher (a Popen) and its folder."""

    index: int
    run: Path
    proc: subprocess.Popen
    log: Path
    out: str = field(default="")

    def wait(self, timeout: float = 240) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            raise
        self.out = self.log.read_text(errors="replace")
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the launcher's whole session (the launcher and its ranks: a lost machine)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(root: Path, nodes: int, script: Path, args: list[str], *, nproc: int = 1, env: dict | None = None,
           port: int | None = None, tag: str | None = None, first: int = 0) -> list[Node]:
    """Start ``nodes`` launchers of ``script`` (its ``--run`` is each node's own folder), as users would;
    ``script`` ``"-mripresa train"`` runs a module (``torchrun ... -m -- ripresa train``)."""
    port = port or free_port()
    rdzv = tag or uuid.uuid4().hex[:8]
    out = []
    for k in range(first, first + nodes):
        run = root / f"node{k}" / "run"
        run.parent.mkdir(parents=True, exist_ok=True)
        log = root / f"node{k}.{rdzv}.log"
        target = ["-m", "--", *str(script)[2:].split()] if str(script).startswith("-m") else ["--", str(script)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv, *target,
               "--run", str(run), *map(str, args)]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, **ENV, **(env or {})}, start_new_session=True)
        out.append(Node(k, run, proc, log))
    return out


def run_nodes(root: Path, nodes: int, script: Path, args: list[str], **kw) -> list[Node]:
    """:func:`launch`, then wait for every node; each node's exit code is checked by the caller."""
    started = launch(root, nodes, script, args, **kw)
    for n in started:
        n.wait()
    return started


def ok(nodes: list[Node]) -> None:
    for n in nodes:
        assert n.proc.returncode == 0, f"node {n.index} exit {n.proc.returncode}:\n{n.out[-3000:]}"
