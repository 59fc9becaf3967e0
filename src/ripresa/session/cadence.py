"""Checkpoint cadence from measurements: ``every="auto"`` and ``ripresa advise`` (docs/CADENCE.md).

:class:`AutoCadence` turns the measured step time, save stall and background write time into
an interval in steps: Young's ``τ = √(2·C·MTBF)``, bounded by ``max_redo``, at least one step
and, for background saves, not shorter than the write. :func:`advise` computes the same from a
run's history alone (hostile input: unusable values are skipped; no step times or no checkpoint
is a :class:`~ripresa.errors.BadInput`). The model, its bounds and why Daly's terms are left
out: docs/CADENCE.md.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..store.history import HISTORY_NAME, iter_lines
from ..text import wrap_words

#: MTBF used when none is given: one failure a day (docs/CADENCE.md, "Defaults").
DEFAULT_MTBF_S = 24 * 3600.0
#: Steps before the first (measuring) save of an automatic cadence.
WARMUP_STEPS = 10
#: Steps between re-evaluations besides the one after each save.
REEVALUATE_STEPS = 50
#: A new interval is recorded (``cadence`` event) only when it differs by more than this fraction.
CHANGE_FRACTION = 0.05
#: Step times kept for the median; saves (stall, write time) kept for the median.
STEP_WINDOW = 64
SAVE_WINDOW = 5
#: The MTBF values ``ripresa advise`` shows by default.
ADVISE_MTBFS = ("1h", "6h", "24h", "7d")

#: The longest duration accepted (MTBF, max_redo, a deadline ahead): 100 years.
MAX_DURATION_S = 100 * 365 * 86400.0
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*$")


def parse_duration(text: str | float | int, what: str = "a duration") -> float:
    """``"90s"``, ``"30m"``, ``"24h"``, ``"7d"``, ``"1.5h"`` or a number of seconds → seconds (> 0, finite)."""
    if isinstance(text, bool):
        raise BadInput(f"{what} must be a duration", expected="e.g. 90s, 30m, 24h, 7d", found=repr(text))
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(str(text)) if len(str(text)) <= 64 else None
        if m is None:
            raise BadInput(f"{what} is not a duration", expected="a number with an optional unit s, m, h or d "
                           "(e.g. 90s, 30m, 24h, 7d)", found=str(text)[:64])
        value = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if not math.isfinite(value) or value <= 0 or value > MAX_DURATION_S:
        raise BadInput(f"{what} must be a positive duration of at most 100 years", expected="> 0 seconds",
                       found=repr(text)[:64])
    return value


def parse_max_redo(text: str | int | float | None) -> tuple[str, float] | None:
    """``--max-redo``: a whole number of steps (``"500"``) or a duration (``"30m"``) → ``("steps"|"seconds", value)``."""
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        steps = text
    elif isinstance(text, str) and text.strip().isdigit() and len(text.strip()) <= 18:
        steps = int(text.strip())
    else:
        return ("seconds", parse_duration(text, "--max-redo"))
    if steps < 1:
        raise BadInput("--max-redo must be at least one step", expected="N >= 1 steps, or a duration such as 30m", found=text)
    return ("steps", float(steps))


@dataclass(frozen=True)
class Decision:
    """One choice of interval: ``every`` steps, and why (``bound``)."""

    every: int
    young_daly_steps: float  # √(2·C·MTBF) / step time, before any bound
    bound: str  # "young_daly" | "max_redo" | "write_time" | "one_step"
    step_s: float
    cost_s: float
    write_s: float | None
    mtbf_s: float

    @property
    def interval_s(self) -> float:
        return self.every * self.step_s

    def expected(self) -> dict[str, float]:
        """Expected work lost per failure and the loop overhead of this choice (docs/CADENCE.md)."""
        lost = self.interval_s / 2 + (self.write_s or 0.0)
        overhead = self.cost_s / (self.interval_s + self.cost_s)
        return {"lost_per_failure_s": lost, "overhead": overhead, "waste": overhead + lost / self.mtbf_s}


def choose_every(step_s: float, cost_s: float, mtbf_s: float, *, max_redo: tuple[str, float] | None = None,
                 write_s: float | None = None) -> Decision:
    """The interval in steps: ⌊√(2·C·MTBF)/step⌉, ≤ max_redo, ≥ 1, and ≥ the background write time.

    ``write_s`` is given for background saves only (one is in flight at most:
    a shorter interval would make the loop wait for it). Where ``max_redo``
    and the write time disagree, the write time wins: no cadence can commit
    generations faster than they are written.
    """
    step_s = max(float(step_s), 1e-9)
    cost_s = max(float(cost_s), 0.0)
    ideal = math.sqrt(2.0 * cost_s * mtbf_s) / step_s
    every, bound = max(1, round(ideal)), "young_daly"
    if max_redo is not None:
        cap = max_redo[1] if max_redo[0] == "steps" else max_redo[1] / step_s
        cap_steps = max(1, math.floor(cap))
        if every > cap_steps:
            every, bound = cap_steps, "max_redo"
    if write_s is not None:
        floor_steps = math.ceil(write_s / step_s)
        if every < floor_steps:
            every, bound = floor_steps, "write_time"
    if every == 1 and bound == "young_daly" and ideal < 0.5:
        bound = "one_step"
    return Decision(every, ideal, bound, step_s, cost_s, write_s, float(mtbf_s))


def median(values: Iterable[float]) -> float | None:
    vals = list(values)
    return statistics.median(vals) if vals else None


class AutoCadence:
    """The session's automatic cadence: measurements in, an interval in steps out.

    The :class:`~ripresa.session.checkpointer.Checkpointer` calls
    :meth:`step_time` with each step's duration measured outside
    ``step_done``, :meth:`saved` with the stall of each cadence save,
    :meth:`written` with each save's write time, and :meth:`due` at each step.
    Until the first save is measured the interval is :data:`WARMUP_STEPS`;
    then it is re-evaluated after each save and every
    :data:`REEVALUATE_STEPS` steps. :meth:`reevaluate` returns the fields of
    a ``cadence`` history event when the interval changed by more than
    :data:`CHANGE_FRACTION` (the first decision always), else None. With
    ``follow=False`` (a distributed session) a decision is only
    :attr:`proposed`: the session adopts rank 0's at each save, so that every
    rank keeps the same schedule.
    """

    def __init__(self, *, mtbf_s: float = DEFAULT_MTBF_S, max_redo: tuple[str, float] | None = None,
                 background: bool = True, warmup: int = WARMUP_STEPS, follow: bool = True) -> None:
        self.mtbf_s = float(mtbf_s)
        self.max_redo = max_redo
        self.background = background
        self.every = max(1, int(warmup))
        if max_redo is not None and max_redo[0] == "steps":
            self.every = min(self.every, int(max_redo[1]))
        self.steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self.stalls: deque[float] = deque(maxlen=SAVE_WINDOW)
        self.writes: deque[float] = deque(maxlen=SAVE_WINDOW)
        self.proposed = self.every  # the latest decision; ``every`` follows it at once, or (distributed) at a save
        self.follow = follow
        self.anchor: int | None = None  # the step of the last save (or the start)
        self.decision: Decision | None = None
        self._recorded: int | None = None  # the interval of the last cadence event
        self._evaluated_at = 0

    # measurements
    def step_time(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.steps.append(seconds)

    def saved(self, step: int, stall_s: float) -> None:
        """A save was requested at ``step`` (the schedule restarts there); ``stall_s`` NaN when not measured here."""
        self.anchor = step
        if math.isfinite(stall_s) and stall_s >= 0:
            self.stalls.append(stall_s)

    def written(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.writes.append(seconds)

    # schedule
    def due(self, step: int) -> bool:
        if self.anchor is None:
            self.anchor = step - 1  # the first step this session saw: count from the step before it
        if self.decision is None and self.max_redo is not None and self.max_redo[0] == "seconds" and self.steps:
            # warming up: the first save is still due within max_redo seconds of work
            self.every = max(1, min(self.every, math.floor(self.max_redo[1] / max(median(self.steps) or 0.0, 1e-9))))
        return step - self.anchor >= self.every

    def steps_to_next(self, step: int) -> int:
        anchor = step if self.anchor is None else self.anchor
        return max(0, self.every - (step - anchor))

    def reevaluate(self, step: int, *, force: bool = False) -> dict[str, Any] | None:
        """Recompute the interval (after a save, or every :data:`REEVALUATE_STEPS` steps)."""
        if not force and step - self._evaluated_at < REEVALUATE_STEPS:
            return None
        self._evaluated_at = step
        step_s, cost_s = median(self.steps), median(self.stalls)
        write_s = median(self.writes) if self.background else None
        if step_s is None or cost_s is None or (self.background and write_s is None):
            return None  # still warming up: no step, save or (background) write measured yet
        d = choose_every(step_s, cost_s, self.mtbf_s, max_redo=self.max_redo, write_s=write_s)
        self.decision, previous = d, self._recorded
        self.proposed = d.every
        if self.follow:
            self.every = d.every
        if previous is not None and abs(d.every - previous) <= CHANGE_FRACTION * previous:
            return None
        self._recorded = d.every
        return {"step": step, "every": d.every, "previous": previous, **_decision_fields(d)}


def _decision_fields(d: Decision) -> dict[str, Any]:
    return {"young_daly_steps": round(d.young_daly_steps, 3), "bound": d.bound, "step_s": round(d.step_s, 6),
            "cost_s": round(d.cost_s, 6), "write_s": None if d.write_s is None else round(d.write_s, 6),
            "mtbf_s": d.mtbf_s, "interval_s": round(d.interval_s, 3)}


# ----------------------------------------------------------------------------- ripresa advise
def _seconds(x: Any, limit: float = 1e9) -> float | None:
    """A non-negative finite number (of seconds) below ``limit`` from a hostile history field, else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    v = float(x)
    return v if math.isfinite(v) and 0 <= v < limit else None


@dataclass
class Measured:
    """What a history says about a run's steps and saves (medians of the most recent ones)."""

    step_s: float
    cost_s: float
    write_s: float | None
    steps: int
    checkpoints: int
    every_now: int | None  # the interval in use at the end of the history (last cadence event or checkpoint gaps)


def measure_history(run_dir: str | Path) -> Measured:
    """Step time, save stall and write time from ``RUN/.loss.jsonl`` alone (bounded memory, hostile-safe)."""
    path = Path(run_dir) / HISTORY_NAME
    if not Path(run_dir).is_dir():
        raise BadInput("no such run folder", file=run_dir, expected="a run folder holding .loss.jsonl")
    gaps: deque[float] = deque(maxlen=STEP_WINDOW * 4)
    stalls: deque[float] = deque(maxlen=SAVE_WINDOW * 4)
    writes: deque[float] = deque(maxlen=SAVE_WINDOW * 4)
    saved_steps: deque[int] = deque(maxlen=8)
    prev: tuple[int, float] | None = None
    every_now: int | None = None
    n_steps = n_ckpt = 0
    for _, obj in iter_lines(path):
        if obj is None:
            continue
        event = obj.get("event")
        if event is None:
            step, t = obj.get("step"), _seconds(obj.get("time"), 1e12)  # a POSIX time
            if isinstance(step, bool) or not isinstance(step, int) or t is None:
                prev = None
                continue
            n_steps += 1
            if prev is not None and step == prev[0] + 1 and t >= prev[1]:
                gaps.append(t - prev[1])
            prev = (step, t)
        elif event == "checkpoint" and obj.get("reason") == "cadence":
            secs, stall = _seconds(obj.get("seconds")), _seconds(obj.get("stall"))
            if secs is None:
                continue
            n_ckpt += 1
            stalls.append(stall if stall is not None else secs)
            if obj.get("background") is True:  # a background save: "seconds" is its write time
                writes.append(secs)
            s = obj.get("step")
            if isinstance(s, int) and not isinstance(s, bool) and s >= 0:
                saved_steps.append(s)
        elif event == "cadence":
            e = obj.get("every")
            if isinstance(e, int) and not isinstance(e, bool) and 0 < e < 1 << 62:
                every_now = e
        elif event in ("start", "resume"):
            prev = None
    if not gaps or statistics.median(list(gaps)[-STEP_WINDOW:]) <= 0:
        raise BadInput("the history has no step times (or steps shorter than its millisecond clock)", file=path, expected="step lines with a time, consecutive steps",
                       found=f"{n_steps} usable step line(s)", hint="train at least a few steps first")
    if not stalls:
        raise BadInput("the history has no cadence checkpoint to measure", file=path,
                       expected="a 'checkpoint' event with seconds (reason cadence)", found="none",
                       hint="train until at least one checkpoint (--every) has been written")
    if every_now is None and len(saved_steps) >= 2:
        diffs = [b - a for a, b in zip(saved_steps, list(saved_steps)[1:], strict=False) if b > a]
        every_now = int(statistics.median(diffs)) if diffs else None
    # a step line's time includes a save's stall on the steps that saved; the median drops them
    return Measured(step_s=round(statistics.median(list(gaps)[-STEP_WINDOW:]), 6), cost_s=statistics.median(list(stalls)[-SAVE_WINDOW:]),
                    write_s=statistics.median(list(writes)[-SAVE_WINDOW:]) if writes else None,
                    steps=n_steps, checkpoints=n_ckpt, every_now=every_now)


def advise(run_dir: str | Path, mtbfs: Sequence[str] = ADVISE_MTBFS, *, max_redo: str | None = None) -> dict[str, Any]:
    """The cadence ``every="auto"`` would choose for ``run_dir``, for each MTBF: a JSON-able report."""
    labels = [m.strip() for m in mtbfs if m.strip()]
    if not labels or len(labels) > 32:
        raise BadInput("--mtbf needs 1 to 32 durations", expected="e.g. 1h,6h,24h,7d", found=",".join(mtbfs)[:80])
    values = [parse_duration(m, "--mtbf") for m in labels]
    redo = parse_max_redo(max_redo)
    m = measure_history(run_dir)
    rows = []
    for label, mtbf in zip(labels, values, strict=True):
        d = choose_every(m.step_s, m.cost_s, mtbf, max_redo=redo, write_s=m.write_s)
        rows.append({"mtbf": label, "every": d.every, **_decision_fields(d),
                     **{k: round(v, 6) for k, v in d.expected().items()}})
    return {"run": str(run_dir), "measured": asdict(m), "max_redo": redo, "choices": rows}


def render_advice(report: dict[str, Any]) -> str:
    """The text of ``ripresa advise`` (a table, one row per MTBF)."""
    m = report["measured"]
    write = f"{m['write_s']:.3f} s in the background" if m["write_s"] is not None else "synchronous"
    lines = [f"run {report['run']}: step {m['step_s']:.4f} s (median), checkpoint stall {m['cost_s']:.4f} s, "
             f"write {write}; {m['steps']} steps, {m['checkpoints']} cadence checkpoints"
             + (f"; every {m['every_now']} steps now" if m["every_now"] else ""),
             f"{'MTBF':>6}  {'every':>8}  {'interval':>10}  {'lost/failure':>12}  {'overhead':>8}  bound"]
    for r in report["choices"]:
        lines.append(f"{r['mtbf']:>6}  {r['every']:>8}  {_fmt_s(r['interval_s']):>10}  {_fmt_s(r['lost_per_failure_s']):>12}"
                     f"  {100 * r['overhead']:>7.2f}%  {r['bound']}")
    lines.append("every = round(√(2·stall·MTBF) / step), bounded (docs/CADENCE.md); lost/failure = interval/2 + write")
    return wrap_words("\n".join(lines))  # at spaces only: a number or a path is never split


def _fmt_s(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"
