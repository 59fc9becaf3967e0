"""The run's append-only history, ``.loss.jsonl`` (DESIGN §5).

One JSON object per line: one line per optimizer step
(``{"step", "loss", "lr", "arm", "tokens", "time", ...}``) plus event lines
(``{"event": "resume" | "checkpoint" | "signal" | "pivot" | "fork" | "zombie_arm" | ..., ...}``).

Rules:

* never archived, truncated, rewritten or reset — only appended;
* appending is O(1): the file is opened once in append mode and each line is
  one ``write`` (no read, no seek, no rewrite), flushed to the OS at once and
  ``fsync``'d at each checkpoint (:meth:`History.sync`);
* after a crash, a resumed run re-appends the steps the dead process had
  logged past its last checkpoint; readers take the **last** line written for
  each step as canonical;
* a torn last line (killed mid-write) is ignored by readers; before the next
  append the writer terminates it with a newline, so it never corrupts what
  follows. Readers skip any line that is not a complete JSON object and count
  it.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BadInput

HISTORY_NAME = ".loss.jsonl"


class History:
    """Appender of ``.loss.jsonl`` (one writer: the lock holder)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: every write lands at the end, even if the file was extended.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._f = os.fdopen(fd, "ab", buffering=0)
        self.lost_lines = 0  # appends that failed (e.g. disk full) since the last one that succeeded
        self.repaired_torn_line = self._terminate_torn_line()

    def _terminate_torn_line(self) -> bool:
        size = os.fstat(self._f.fileno()).st_size
        if size == 0:
            return False
        with open(self.path, "rb") as r:
            r.seek(size - 1)
            if r.read(1) == b"\n":
                return False
        self._f.write(b"\n")  # the torn fragment becomes a line of its own, which readers skip
        return True

    def append(self, record: dict[str, Any]) -> None:
        """Append one JSON line (a single write system call).

        A failed append (a full disk) does not stop training: it is counted and
        warned about, and the next append that succeeds first writes a
        ``history_lines_lost`` event with the count, so the gap is on record.
        """
        line = json.dumps(record, separators=(",", ":"), allow_nan=True).encode() + b"\n"
        try:
            if self.lost_lines:
                gap = {"event": "history_lines_lost", "count": self.lost_lines, "time": round(time.time(), 3)}
                self._f.write(json.dumps(gap, separators=(",", ":")).encode() + b"\n")
                self.lost_lines = 0
            self._f.write(line)
        except OSError as exc:
            self.lost_lines += 1
            if self.lost_lines == 1:
                warnings.warn(f"could not append to {self.path} ({exc}); training goes on, the gap will be recorded",
                              stacklevel=3)

    def step(self, step: int, **metrics: Any) -> None:
        """The line of one optimizer step."""
        self.append({"step": int(step), **metrics, "time": round(time.time(), 3)})

    def event(self, name: str, **fields: Any) -> None:
        """An event line (resume, checkpoint, signal, pivot, fork, zombie_arm, ...)."""
        self.append({"event": name, **fields, "time": round(time.time(), 3)})

    def sync(self) -> None:
        """``fsync`` the history (done at every checkpoint)."""
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


@dataclass
class HistoryView:
    """What a reader sees: the canonical line per step, the events, and skipped lines."""

    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: list[int] = field(default_factory=list)
    lines: int = 0

    def losses(self) -> list[tuple[int, float]]:
        return [(s, r["loss"]) for s, r in sorted(self.steps.items()) if "loss" in r]


def iter_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, parsed object or None for a torn/invalid line)."""
    p = Path(path)
    with open(p, "rb") as f:
        for no, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                yield no, None  # a torn last line
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                yield no, None
                continue
            yield no, obj if isinstance(obj, dict) else None


def read_history(path: str | Path) -> HistoryView:
    """Read ``.loss.jsonl``: last line per step wins; torn or invalid lines are skipped."""
    p = Path(path)
    if not p.is_file():
        raise BadInput("history not found", file=p, expected=f"a {HISTORY_NAME} file", found="nothing",
                       hint="is this a run folder written by ripresa train?")
    view = HistoryView()
    for no, obj in iter_lines(p):
        view.lines = no
        if obj is None:
            view.skipped_lines.append(no)
        elif "event" in obj:
            view.events.append(obj)
        elif isinstance(obj.get("step"), int):
            view.steps[obj["step"]] = obj
        else:
            view.skipped_lines.append(no)
    return view
