"""Small helpers more than one test file needs (tests/README.md, "Shared helpers").

Each was a private copy in two or more test files; the copies now import it from here.
Fixtures that undo process-wide settings (fault hooks, HMAC variables, thread count)
live in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ripresa.formats.andrea_bin import BinArrays


def sha256_file(p: Path) -> str:
    """The sha256 (hex) of a file's bytes."""
    return hashlib.sha256(p.read_bytes()).hexdigest()


def rchar() -> int:
    """Bytes this process has read so far (``rchar`` of /proc/self/io: read(2), pread(2), ...)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@contextlib.contextmanager
def must_not_block(seconds: float = 5.0) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging if the body blocks, e.g. opening a FIFO."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def next_line(proc: subprocess.Popen[str], timeout: float = 10.0) -> str:
    """The next line of a child's stdout, failing (not hanging) if it never comes."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "child printed nothing in time"
    line = proc.stdout.readline()
    assert line, f"child exited early with {proc.wait()}"
    return line.strip()


def arrays_for(step: int, n: int) -> BinArrays:
    """Deterministic weights/m/v of a .bin generation for a step, so a reader checks them bitwise."""
    g = np.random.default_rng(step)
    w, m, v = (g.standard_normal(n).astype(np.float32) for _ in range(3))
    return BinArrays((w,), (m,), (np.abs(v),))


def small_companion(step: int) -> dict:
    """A small companion (``.pt`` side) for :func:`arrays_for`'s generation."""
    return {"progress": {"step": step}, "note": f"generation {step}", "t": torch.arange(3)}


def rebless_dcp(folder: Path, step: int, *, companion: dict | None = None) -> None:
    """What an attacker without the HMAC key can do to a .dcp generation: make the companion's file sizes and the
    marker's sha256 lines match the (tampered) files again; ``companion`` replaces the companion's document."""
    from ripresa.formats import dcp as dcp_fmt

    d, mk = dcp_fmt.dcp_paths(folder, step)
    comp = d / dcp_fmt.COMPANION_NAME
    doc = companion if companion is not None else json.loads(comp.read_bytes())
    if isinstance(doc, dict) and isinstance(doc.get("files"), dict):
        doc["files"] = {n: (d / n).stat().st_size for n in sorted(os.listdir(d)) if n != dcp_fmt.COMPANION_NAME}
    comp.write_bytes(json.dumps(doc).encode())
    mk.write_text("".join(f"{sha256_file(d / n)}  {d.name}/{n}\n" for n in sorted(os.listdir(d))))


def history_events(run: Path, name: str) -> list[dict]:
    """The events named ``name`` in a run folder's history (``.loss.jsonl``), in order."""
    from ripresa.store.history import HISTORY_NAME, read_history

    return [e for e in read_history(run / HISTORY_NAME).events if e.get("event") == name]


def valid_dcp_steps(run: Path, *, deep: bool = False) -> list[int]:
    """Steps of the valid ``.dcp`` generations of a run folder (``deep``: every shard re-hashed)."""
    from ripresa.formats import dcp as dcp_fmt

    return [g.step for g in dcp_fmt.dcp_generations(run, deep=deep) if g.valid]


class PtyStderr:
    """A pseudo-terminal for a child's stderr (ripresa.console shows progress only on a terminal), drained by a
    thread so the child never blocks on it: ``Popen(..., stderr=tty.slave)``, then ``tty.start()``; ``tty.text()``
    is what it printed so far as plain text; ``tty.close()`` once the child has ended."""

    def __init__(self) -> None:
        import pty

        self.master, self.slave = pty.openpty()
        self.chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        os.close(self.slave)  # the child holds its end: the reader sees EOF when the child exits
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                piece = os.read(self.master, 65536)
            except OSError:  # the child closed its end
                return
            if not piece:
                return
            self.chunks.append(piece)

    def text(self) -> str:
        """The terminal's bytes as plain text: escape sequences removed, runs of blanks and line breaks one space."""
        return " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", " ", b"".join(self.chunks).decode(errors="replace")).split())

    def close(self) -> None:
        self._reader.join(timeout=5)
        os.close(self.master)

