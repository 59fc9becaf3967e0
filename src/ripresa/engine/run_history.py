"""A run's history read for pictures and comparisons (docs/ENGINE.md, "Pictures, comparisons, bundles, batch inference").

:func:`load_run` reads ``.loss.jsonl`` (docs/FORMAT.md) and nothing else into a memory-bounded
:class:`RunHistory`: the canonical line of each step is the last one written for it, event lines keep their
order and are placed on the step axis (:class:`Event`). The numbers drawn from it: :func:`ema_series` and
:func:`rolling_arm_shares`. The drawing is :mod:`ripresa.engine.plots`.
"""

from __future__ import annotations

import math
import os
import sys
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.numbers import checked_number
from ..errors import BadInput, IntegrityError
from ..io.fsio import read_json_small
from ..store.history import HISTORY_NAME, HistoryReader, reduce_record

#: Smoothing of the EMA curves (weight of the past; ~50-step memory).
EMA_ALPHA = 0.98

# Keys that place an event on the step axis, in order of preference.
_STEP_KEYS = {"resume": ("from_step", "step"), "fork": ("parent_step", "step", "from_step")}
_DEFAULT_STEP_KEYS = ("step", "at_step", "from_step", "parent_step")


# ---- reading ------------------------------------------------------------------------------------


_SEQ = iter(range(1 << 62))


@dataclass
class Event:
    kind: str
    step: int  # where it sits on the step axis
    record: dict[str, Any]
    logged_before: int = 0  # the last step line written before this event
    seq: int = field(default_factory=lambda: next(_SEQ))  # order in the history

    @property
    def redone(self) -> int:
        """For a resume: steps the dead process had logged past the checkpoint, run again now."""
        return max(0, self.logged_before - self.step) if self.kind == "resume" else 0


#: Most events of one kind a :class:`RunHistory` keeps (the latest; all are counted in ``event_counts``).
MAX_EVENTS_PER_KIND = 1024
#: Longest arm name kept (a longer one is cut).
MAX_ARM_NAME = 200
#: Most distinct arm names kept (beyond, a step's arm is "(other)").
MAX_ARMS = 64


class Arms(Sequence):  # type: ignore[type-arg]
    """Each step's arm, stored as an index per step into a small table of names (compact for long runs)."""

    def __init__(self, index: array, names: list[str]) -> None:
        self._index, self._names = index, names

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        k = self._index[i]
        return None if k < 0 else self._names[k]

    def __iter__(self) -> Iterator[str | None]:
        names = self._names
        return (None if k < 0 else names[k] for k in self._index)


class _Canonical:
    """The last line written for each step, reduced to (step, loss, arm), in compact arrays.

    Lines are appended in file order; when the arrays hold twice as many rows as
    the last compaction kept (and at least 2**20), they are sorted by step keeping
    the last row of each step (numpy, stable): memory stays O(steps kept), ~20
    bytes per step, never O(lines) or O(bytes) of the history.
    """

    def __init__(self) -> None:
        self.steps, self.losses, self.arms = array("q"), array("d"), array("l")
        self._kept = 0

    def add(self, step: int, loss: float, arm: int) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.arms.append(arm)
        if len(self.steps) > max(2 * self._kept, 1 << 20):
            self.compact()

    def compact(self) -> None:
        import numpy as np

        s = np.frombuffer(self.steps, dtype=np.int64) if len(self.steps) else np.empty(0, np.int64)
        order = np.argsort(s, kind="stable")
        ss = s[order]
        last = np.ones(len(ss), dtype=bool)
        last[:-1] = ss[1:] != ss[:-1]
        keep = order[last]
        out_s, out_l, out_a = array("q"), array("d"), array("l")
        out_s.frombytes(s[keep].tobytes())
        if len(keep):
            out_l.frombytes(np.frombuffer(self.losses, dtype=np.float64)[keep].tobytes())
            out_a.frombytes(np.frombuffer(self.arms, dtype=out_a.typecode)[keep].tobytes())
        self.steps, self.losses, self.arms, self._kept = out_s, out_l, out_a, len(out_s)


@dataclass
class RunHistory:
    """One run's history, ready to draw: canonical steps in order, positioned events — memory bounded.

    ``steps``/``losses`` are compact arrays (int64/float64, ~16 bytes per step),
    ``arms`` an :class:`Arms` sequence; ``events`` the latest
    :data:`MAX_EVENTS_PER_KIND` of each kind (records reduced by
    :func:`~ripresa.store.history.reduce_record`), ``event_counts`` every event
    by kind, ``checkpoint_steps`` the step of every checkpoint event.
    """

    name: str
    folder: Path
    history: Path
    steps: Sequence[int]
    losses: Sequence[float]  # NaN where a step line has no finite loss
    arms: Sequence[str | None]
    events: list[Event] = field(default_factory=list)
    config_name: str | None = None
    skipped_lines: int = 0
    #: lines longer than :data:`ripresa.store.history.MAX_LINE`, skipped (counted in ``skipped_lines`` too)
    skipped_long_lines: int = 0
    event_counts: dict[str, int] = field(default_factory=dict)
    checkpoint_steps: Sequence[int] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def fork_step(self) -> int | None:
        """``parent_step`` of the last ``fork`` event, if this run is a fork."""
        for e in reversed(self.of_kind("fork")):
            p = e.record.get("parent_step")
            if isinstance(p, int) and not isinstance(p, bool):
                return p
        return None


def _as_float(v: Any) -> float:
    try:  # the one checked conversion (docs/FAULTS.md, "Numbers read from files"); a bad value is a gap
        return checked_number(v, file=None, field="a history value", lo=-sys.float_info.max,
                              hi=sys.float_info.max, integer=False)
    except IntegrityError:
        return math.nan


def _event_step(kind: str, rec: dict[str, Any]) -> int | None:
    for key in _STEP_KEYS.get(kind, _DEFAULT_STEP_KEYS):
        v = rec.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def load_run(run_dir: str | Path) -> RunHistory:
    """Read a run folder's ``.loss.jsonl`` (or that file itself); :class:`BadInput` if there is none.

    Events that carry no step (``zombie_arm``, ``bandit_fresh``, a ``pivot``
    without one) are written when a process starts, right before its first
    step: they are placed at the step before the next step line (or at the
    last step when nothing follows).
    """
    p = Path(run_dir)
    if not p.exists():
        raise BadInput("run folder not found", file=p, expected="a run folder written by ripresa train",
                       found="nothing", hint="check the path")
    hist = p if p.is_file() else p / HISTORY_NAME
    folder = p.parent if p.is_file() else p
    if not os.path.lexists(hist):
        found = sorted(x.name for x in p.iterdir())[:8] if p.is_dir() else "no such file"
        raise BadInput("run has no history", file=hist, expected=f"a {HISTORY_NAME} (written by ripresa train)",
                       found=found or "an empty folder", hint="is this a run folder? `ripresa train --run DIR` writes one")
    canonical = _Canonical()
    arm_names: dict[str, int] = {}
    kept: dict[str, deque[Event]] = {}
    counts: dict[str, int] = {}
    checkpoint_steps = array("q")
    pending: deque[Event] = deque(maxlen=MAX_EVENTS_PER_KIND)
    last_step = 0
    skipped = 0
    reader = HistoryReader(hist)  # streamed; a link or FIFO is refused; over-long/out-of-range lines skipped
    for _no, obj in reader:
        if obj is None:
            skipped += 1
        elif "event" in obj:
            kind = str(obj["event"])[:64]
            at = _event_step(kind, obj)
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "checkpoint" and at is not None and 0 <= at < 1 << 63:
                checkpoint_steps.append(at)
            bucket = kind if kind in kept or len(kept) < 16 else "(other)"
            ev = Event(kind, at if at is not None else last_step, reduce_record(obj, 32), logged_before=last_step)
            kept.setdefault(bucket, deque(maxlen=MAX_EVENTS_PER_KIND)).append(ev)
            if at is None:
                pending.append(ev)
        elif isinstance(obj.get("step"), int) and not isinstance(obj.get("step"), bool):
            s = obj["step"]
            arm = obj.get("arm")
            idx = -1
            if arm is not None:
                name = str(arm)[:MAX_ARM_NAME] if isinstance(arm, str | int | float | bool) else "(other)"
                idx = arm_names.get(name, -1)
                if idx < 0:
                    if len(arm_names) >= MAX_ARMS:
                        name = "(other)"
                    idx = arm_names.setdefault(name, len(arm_names))
            canonical.add(s, _as_float(obj.get("loss")), idx)  # the last line written for a step is canonical
            for ev in pending:
                ev.step = max(0, s - 1)
            pending.clear()
            last_step = s
        else:
            skipped += 1
    canonical.compact()
    events = sorted((e for q in kept.values() for e in q), key=lambda e: e.seq)
    steps = canonical.steps
    if not steps:
        raise BadInput("history has no step lines", file=hist, expected="one line per optimizer step",
                       found=f"{sum(counts.values())} event line(s), {skipped} unreadable line(s)",
                       hint="the run has not completed a step yet")
    config_name = None
    cfg = folder / "config.json"
    if os.path.lexists(cfg):
        try:
            doc = read_json_small(cfg, "the run's config.json", 1 << 20)
            name = doc.get("name") if isinstance(doc, dict) else None
            config_name = name if isinstance(name, str) else None
        except BadInput:
            config_name = None
    return RunHistory(
        name=folder.name or str(folder), folder=folder, history=hist, steps=steps,
        losses=canonical.losses, arms=Arms(canonical.arms, list(arm_names)),
        events=events, config_name=config_name if isinstance(config_name, str) else None, skipped_lines=skipped, skipped_long_lines=reader.long_lines,
        event_counts=counts, checkpoint_steps=checkpoint_steps,
    )


# ---- numbers --------------------------------------------------------------------------------------


def ema_series(losses: Iterable[float], alpha: float = EMA_ALPHA) -> list[float]:
    """Bias-corrected exponential moving average of ``losses``.

    ``m_t = alpha*m_{t-1} + (1-alpha)*x_t`` and ``w_t = alpha*w_{t-1} + (1-alpha)``
    from ``m = w = 0``; the value is ``m_t / w_t`` — a weighted mean of the values
    seen so far (weights ``alpha**age``), so the first value is ``x_0`` itself and
    a short series is not dragged towards its start. ``alpha = 0`` is the raw
    series. A non-finite value (a diverged step) leaves the EMA where it was;
    before the first finite value it is NaN.
    """
    return list(ema_array(losses, alpha))


def ema_array(losses: Iterable[float], alpha: float) -> array:
    """:func:`ema_series` as a compact float64 array (8 bytes per step)."""
    a = float(alpha)
    if not 0.0 <= a < 1.0:
        raise BadInput("EMA alpha out of range", expected="0 <= alpha < 1", found=alpha,
                       hint="0.98 averages over ~50 steps")
    out = array("d")
    m = w = 0.0
    for x in losses:
        x = _as_float(x)
        if not math.isnan(x):
            m = a * m + (1.0 - a) * x
            w = a * w + (1.0 - a)
        out.append(m / w if w > 0 else math.nan)
    return out


def rolling_arm_shares(arms: Sequence[str | None], window: int, stride: int = 1) -> dict[str, list[float]]:
    """Share of each arm among the last ``window`` steps (trailing), per step (every ``stride``-th step and the last)."""
    names = sorted({a if a is not None else "(none)" for a in arms})
    counts = dict.fromkeys(names, 0)
    shares: dict[str, list[float]] = {n: [] for n in names}
    labels = [a if a is not None else "(none)" for a in arms]
    last = len(labels) - 1
    for i, a in enumerate(labels):
        counts[a] += 1
        if i >= window:
            counts[labels[i - window]] -= 1
        if i % stride and i != last:
            continue
        n = min(i + 1, window)
        for k in names:
            shares[k].append(counts[k] / n)
    return shares
