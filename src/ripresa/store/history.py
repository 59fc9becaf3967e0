"""The run's append-only history, ``.loss.jsonl`` (docs/FORMAT.md, "History ``.loss.jsonl``").

One JSON object per line: a line per optimizer step plus event lines. Only ever appended (one
``write`` per line, ``fsync``'d at each checkpoint by :meth:`History.sync`); after a crash a resumed
run re-appends the steps past its last checkpoint and readers take the **last** line of a step; a
torn last line is terminated before the next append and skipped by readers. The file is hostile
input (docs/FAULTS.md): opened with :func:`ripresa.io.fsio.open_run_file` (no symlink, no FIFO) and
streamed with a bounded line length (:data:`MAX_LINE`); over-long lines and out-of-range numbers
are skipped and counted.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..io.fsio import open_run_file
from ..io.pieces import PieceBudget

HISTORY_NAME = ".loss.jsonl"


class History:
    """Appender of ``.loss.jsonl`` (one writer: the lock holder).

    Opened with :func:`ripresa.io.fsio.open_run_file` (``create_append``): a
    symlink, FIFO, folder or device in place of the history is refused with
    :class:`~ripresa.errors.BadInput`, so nothing is ever appended outside the
    run folder and nothing blocks.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: every write lands at the end, even if the file was extended.
        fd = open_run_file(self.path, "history (.loss.jsonl)", mode="create_append")
        self._f = os.fdopen(fd, "ab", buffering=0)
        self.lost_lines = 0  # appends that failed (e.g. disk full) since the last one that succeeded
        try:
            self.repaired_torn_line = self._terminate_torn_line()
        except BaseException:
            self._f.close()
            raise

    def _terminate_torn_line(self) -> bool:
        fd = self._f.fileno()
        size = os.fstat(fd).st_size
        if size == 0:
            return False
        # the descriptor is O_RDWR: read the last byte of the very file opened (no second open by name)
        if os.pread(fd, 1, size - 1) == b"\n":
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


#: Longest history line a reader accepts (bytes, newline included). A valid
#: line is a few hundred bytes; a longer one is skipped and counted.
MAX_LINE = 1 << 20
#: Read size of the streaming reader (bytes).
_READ_CHUNK = 1 << 20
#: Ints in a history line must lie in ``(-2**63, 2**63)``; steps in ``[0, 2**63)``.
INT_LIMIT = 1 << 63


#: Most line numbers of skipped lines a :class:`HistoryView` lists (the rest are counted).
MAX_SKIPPED_LISTED = 1000
#: Most events a :class:`HistoryView` keeps (the latest; the rest are counted in ``events_dropped``).
MAX_EVENTS_KEPT = 10_000
#: Most fields the step lines a :class:`HistoryView` keeps may hold in all (a line ripresa writes has ~4).
MAX_KEPT_FIELDS = 16_000_000
#: What a reduced record keeps of a line (docs/FORMAT.md, "Reading the history"): whole fields
#: while their values hold at most :data:`MAX_RECORD_NODES` JSON values in all, no string
#: longer than :data:`MAX_RECORD_STR` characters; a field that would exceed either is dropped.
MAX_RECORD_NODES = 256
MAX_RECORD_STR = 512


def _nodes(v: Any, budget: int) -> int:
    """JSON values in ``v`` (iterative), or ``budget + 1`` as soon as it exceeds ``budget`` or holds a long string."""
    n, stack = 0, [v]
    while stack:
        x = stack.pop()
        n += 1
        if n > budget or (isinstance(x, str) and len(x) > MAX_RECORD_STR):
            return budget + 1
        if isinstance(x, dict):
            if any(len(k) > MAX_RECORD_STR for k in x):
                return budget + 1
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return n


def reduce_record(obj: dict[str, Any], max_nodes: int = MAX_RECORD_NODES) -> dict[str, Any]:
    """The bounded form of a history line a reader keeps (docs/FORMAT.md, "Reading the history").

    Fields are kept whole, in order, while their values hold at most
    ``max_nodes`` JSON values in all and no string longer than
    :data:`MAX_RECORD_STR`; a field that would go past is dropped. Every line
    ripresa writes is kept whole; a hostile 1 MiB line costs a reader a few KB,
    not the ~50 MB its parsed form takes.
    """
    out: dict[str, Any] = {}
    left = max_nodes
    for k, v in obj.items():
        if len(k) > MAX_RECORD_STR:
            continue
        n = _nodes(v, left)
        if n <= left:
            out[k] = v
            left -= n
    return out


@dataclass
class HistoryView:
    """What a reader sees: the canonical line per step, the events, and skipped lines — memory bounded.

    ``steps`` maps each step to its last line, reduced (:func:`reduce_record`);
    ``events`` holds the latest :data:`MAX_EVENTS_KEPT` event lines, reduced
    (``events_dropped`` counts older ones). ``skipped`` counts every skipped
    line (torn, invalid, over-long or out of range), ``skipped_lines`` lists
    the line numbers of the first :data:`MAX_SKIPPED_LISTED`;
    ``skipped_long_lines`` counts those longer than :data:`MAX_LINE`,
    ``skipped_out_of_range`` those with a number out of range.
    """

    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    skipped_lines: list[int] = field(default_factory=list)
    lines: int = 0
    skipped_long_lines: int = 0
    skipped_out_of_range: int = 0
    skipped: int = 0
    events_dropped: int = 0

    def losses(self) -> list[tuple[int, float]]:
        return [(s, r["loss"]) for s, r in sorted(self.steps.items()) if "loss" in r]


def _in_range(obj: Any) -> bool:
    """No int beyond ``±2**63`` anywhere in ``obj`` (iterative: no recursion limit)."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, int) and not isinstance(x, bool) and not -INT_LIMIT < x < INT_LIMIT:
            return False
    return True


def _valid_step(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < INT_LIMIT


class HistoryReader:
    """Stream ``.loss.jsonl``: iterate ``(line number, object or None)``, bounded memory.

    Opened with :func:`ripresa.io.fsio.open_run_file` (symlink, FIFO, folder:
    :class:`~ripresa.errors.BadInput`). The file is read in chunks; a line
    longer than ``max_line`` bytes is never held whole: the reader drops its
    bytes up to the next newline, yields ``None`` for it and counts it in
    :attr:`long_lines`. A line that is not a JSON object, torn, or holds an
    int beyond ``±2**63`` yields ``None`` too (:attr:`out_of_range` counts the
    latter). Never raises for the content of the file.
    """

    def __init__(self, path: str | Path, *, max_line: int = MAX_LINE) -> None:
        self.path = Path(path)
        self.max_line = max_line
        self.lines = 0
        self.long_lines = 0
        self.out_of_range = 0
        self.invalid = 0

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any] | None]]:
        fd = open_run_file(self.path, "history (.loss.jsonl)")
        try:
            yield from self._lines(fd)
        finally:
            os.close(fd)

    def read_from(self, fd: int) -> Iterator[tuple[int, dict[str, Any] | None]]:
        """Iterate the lines of a history already opened (with :func:`~ripresa.io.fsio.open_run_file`) as ``fd``.

        The caller owns ``fd``: a command that must refuse a linked or FIFO history
        before it writes anything opens it first and streams it later (one pass).
        """
        return self._lines(fd)

    def _read(self, fd: int) -> bytes:
        try:
            return os.read(fd, _READ_CHUNK)
        except OSError as exc:
            raise BadInput("history could not be read", file=self.path, expected="a readable file",
                           found=f"{type(exc).__name__}: {exc}", hint="check the disk") from exc

    def _lines(self, fd: int) -> Iterator[tuple[int, dict[str, Any] | None]]:
        buf = bytearray()
        skipping = False  # inside an over-long line: drop bytes up to its newline
        while True:
            chunk = self._read(fd)
            if not chunk:
                break
            if skipping:
                nl = chunk.find(b"\n")
                if nl < 0:
                    continue
                skipping = False
                chunk = chunk[nl + 1:]
                self.lines += 1
                yield self.lines, None
            buf += chunk
            start = 0
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                self.lines += 1
                if nl + 1 - start > self.max_line:
                    self.long_lines += 1
                    yield self.lines, None
                else:
                    yield self.lines, self._parse(bytes(buf[start:nl + 1]))
                start = nl + 1
            del buf[:start]
            if len(buf) > self.max_line:
                self.long_lines += 1
                skipping = True
                buf.clear()
        if skipping:
            self.lines += 1  # an over-long torn last line
            yield self.lines, None
        elif buf:
            self.lines += 1
            self.invalid += 1
            yield self.lines, None  # a torn last line

    def _parse(self, raw: bytes) -> dict[str, Any] | None:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; so are ints of > 4300 digits
            self.invalid += 1
            return None
        if not isinstance(obj, dict):
            self.invalid += 1
            return None
        step = obj.get("step")
        if not _in_range(obj) or (isinstance(step, float) and not math.isfinite(step)):
            self.out_of_range += 1
            return None
        return obj


def iter_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, parsed object or None for a torn/invalid/over-long/out-of-range line).

    A streaming reader (:class:`HistoryReader`): memory stays bounded by
    :data:`MAX_LINE` whatever the file holds.
    """
    return iter(HistoryReader(path))


def read_history(path: str | Path) -> HistoryView:
    """Read ``.loss.jsonl``: last line per step wins; torn, invalid, over-long lines are skipped and counted."""
    p = Path(path)
    if not os.path.lexists(p):
        raise BadInput("history not found", file=p, expected=f"a {HISTORY_NAME} file", found="nothing",
                       hint="is this a run folder written by ripresa train?")
    view = HistoryView()
    reader = HistoryReader(p)
    events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS_KEPT)
    n_events = 0
    kept = PieceBudget(f"the lines kept of {HISTORY_NAME}", MAX_KEPT_FIELDS, unit="fields",
                       hint="a history ripresa writes keeps a few fields per step; this one was crafted")

    def skip(no: int) -> None:
        view.skipped += 1
        if len(view.skipped_lines) < MAX_SKIPPED_LISTED:
            view.skipped_lines.append(no)

    for no, obj in reader:
        view.lines = no
        if obj is None:
            skip(no)
        elif "event" in obj:
            events.append(reduce_record(obj))
            n_events += 1
        elif _valid_step(obj.get("step")):
            rec = reduce_record(obj)
            kept.take(len(rec), p)  # every line bounded, their sum too (docs/FAULTS.md, "Many pieces, one budget")
            view.steps[obj["step"]] = rec
        else:
            skip(no)
    view.events = list(events)
    view.events_dropped = n_events - len(events)
    view.skipped_long_lines = reader.long_lines
    view.skipped_out_of_range = reader.out_of_range
    return view
