"""A deadline: stop in time to save, finish the mirror upload and export before it (docs/CADENCE.md, "Deadline").

The planned stop is ``deadline − (save + upload + export) − margin``, each term measured or
estimated as docs/CADENCE.md says. The session asks :meth:`Deadline.due` at each step boundary;
when the next step would end past the planned stop it stops through the SIGTERM path (a
committed stop generation), then :meth:`Deadline.finish` drains the mirror and runs the
injected export (``on_deadline``). History events: ``deadline_plan``, ``deadline_stop``,
``deadline_done``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import BadInput, RipresaError
from .cadence import MAX_DURATION_S, WARMUP_STEPS, parse_duration

#: The export estimate before one is measured: ``EXPORT_FACTOR·save + EXPORT_BASE_S``.
EXPORT_FACTOR = 3.0
EXPORT_BASE_S = 2.0
#: The margin: ``max(MARGIN_STEPS steps, MARGIN_FRACTION of the tail, MARGIN_MIN_S)``.
MARGIN_STEPS = 3
MARGIN_FRACTION = 0.10
MARGIN_MIN_S = 5.0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def deadline_time(when: datetime | float | int | str, *, now: float | None = None) -> float:
    """The deadline as a POSIX time: an aware ``datetime``, seconds from now, ``"72h"`` or ``"2026-12-24T18:00Z"``."""
    now = time.time() if now is None else now
    if isinstance(when, datetime):
        if when.tzinfo is None:
            raise BadInput("the deadline has no time zone", expected="a time with its zone: 2026-12-24T18:00Z or +01:00 (an aware datetime)",
                           found=when.isoformat(), hint="a naive time is ambiguous across machines; add a zone")
        return when.timestamp()
    if isinstance(when, str) and ("-" in when or ":" in when or "T" in when):
        text = when.strip()
        try:
            dt = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError:
            raise BadInput("--deadline is neither a time nor a duration", expected="2026-12-24T18:00Z or 72h",
                           found=text[:64]) from None
        return deadline_time(dt, now=now)
    return now + parse_duration(when, "--deadline")


@dataclass(frozen=True)
class Plan:
    """One deadline plan (POSIX times; seconds); ``estimated`` names the parts not measured yet."""

    deadline: float
    stop_at: float
    step_s: float
    save_s: float
    upload_s: float
    export_s: float
    margin_s: float
    estimated: tuple[str, ...]

    def fields(self, now: float) -> dict[str, Any]:
        d = {k: round(v, 3) for k, v in asdict(self).items() if isinstance(v, float)}
        d.update(deadline=_iso(self.deadline), stop_at=_iso(self.stop_at), estimated=list(self.estimated),
                 stop_in_s=round(self.stop_at - now, 3))
        return d


class Deadline:
    """The session's deadline: measurements in, a planned stop out (see the module)."""

    def __init__(self, when: datetime | float | int | str, *, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.deadline = deadline_time(when, now=now)
        if self.deadline <= now:
            raise BadInput("the deadline has passed", expected="a time in the future",
                           found=f"{_iso(self.deadline)} (now {_iso(now)})")
        if self.deadline - now > MAX_DURATION_S:
            raise BadInput("the deadline is more than 100 years ahead", expected="a time within 100 years",
                           found=f"{self.deadline - now:.3g} s from now")
        self.save_s: float | None = None
        self.plan: Plan | None = None
        self._recorded: Plan | None = None
        self.stopped_at_step: int | None = None
        self._stop_t0 = 0.0
        self._probed = False
        self.done: dict[str, Any] | None = None  # the fields of deadline_done, once finished

    def saved(self, seconds: float) -> None:
        """A save committed, start to commit (stall + background write)."""
        if math.isfinite(seconds) and seconds >= 0:
            self.save_s = seconds

    def needs_probe(self, steps_run: int) -> bool:
        """True when no save has been measured after the warm-up: the session saves once to measure."""
        if self.save_s is not None or self._probed or steps_run < WARMUP_STEPS:
            return False
        self._probed = True
        return True

    def replan(self, step_s: float | None, mirror: Any, now: float) -> dict[str, Any] | None:
        """Recompute the plan; the fields of a ``deadline_plan`` event when it moved enough, else None."""
        estimated = []
        step_s = step_s if step_s is not None else 0.0
        if step_s == 0.0:
            estimated.append("step")
        save = self.save_s
        if save is None:
            save = 0.0
            estimated.append("save")
        upload = 0.0
        if mirror is not None:
            measured = getattr(mirror, "last_upload_seconds", None)
            if isinstance(measured, (int, float)) and not isinstance(measured, bool) and math.isfinite(measured):
                upload = max(0.0, float(measured))
            else:
                upload = save
                estimated.append("upload")
        export = EXPORT_FACTOR * save + EXPORT_BASE_S  # an estimate (the real time is in deadline_done)
        estimated.append("export")
        tail = save + upload + export
        margin = max(MARGIN_STEPS * step_s, MARGIN_FRACTION * tail, MARGIN_MIN_S)
        self.plan = Plan(self.deadline, self.deadline - tail - margin, step_s, save, upload, export, margin, tuple(estimated))
        last = self._recorded
        if last is not None and abs(last.stop_at - self.plan.stop_at) <= max(5.0, 0.05 * tail) \
                and last.estimated == self.plan.estimated:
            return None
        self._recorded = self.plan
        return self.plan.fields(now)

    def check(self, step: int, step_s: float | None, mirror: Any, event: Callable[..., None]) -> bool:
        """At a step boundary: re-plan (``deadline_plan`` when it moved); True, after ``deadline_stop``, to stop now."""
        now = time.time()
        fields = self.replan(step_s, mirror, now)
        if fields is not None:
            event("deadline_plan", step=step, **fields)
        if not self.due(now):
            return False
        event("deadline_stop", **self.stop(step, now))
        return True

    def due(self, now: float) -> bool:
        """True when the next step would end past the planned stop."""
        p = self.plan
        return p is not None and now + p.step_s >= p.stop_at

    def seconds_to_stop(self, now: float | None = None) -> float | None:
        if self.plan is None:
            return None
        return self.plan.stop_at - (time.time() if now is None else now)

    def stop(self, step: int, now: float) -> dict[str, Any]:
        """The fields of the ``deadline_stop`` event (the plan used)."""
        self.stopped_at_step = step
        self._stop_t0 = now
        assert self.plan is not None
        return {"step": step, "seconds_to_deadline": round(self.deadline - now, 3), **self.plan.fields(now)}

    def finish(self, step: int, mirror: Any, on_deadline: Callable[[int], Any] | None,
               event: Callable[..., None]) -> Any:
        """After the stop generation committed: drain the mirror, run the export, record ``deadline_done``."""
        t_saved = time.time()
        fields: dict[str, Any] = {"step": step, "save_s": round(t_saved - self._stop_t0, 3)}
        if mirror is not None and hasattr(mirror, "drain"):
            left = self.deadline - t_saved  # the time left, less the export's share (at least 1 s, never past it)
            budget = max(0.0, min(left, max(1.0, left - (self.plan.export_s if self.plan else 0.0))))
            fields["drain_budget_s"] = round(budget, 3)
            t0 = time.time()
            fields["mirror_drained"] = bool(mirror.drain(timeout=budget))
            fields["upload_s"] = round(time.time() - t0, 3)
        result = None
        if on_deadline is not None:
            t0 = time.time()
            try:
                result = on_deadline(step)
            except (RipresaError, OSError) as exc:
                fields.update(export_s=round(time.time() - t0, 3), error=str(getattr(exc, "message", exc))[:300],
                              seconds_before_deadline=round(self.deadline - time.time(), 3), met=False)
                event("deadline_done", **fields)
                self.done = fields
                raise
            fields["export_s"] = round(time.time() - t0, 3)
            fields["export"] = str(result.get("dest")) if isinstance(result, dict) else str(result) if isinstance(result, (str, Path)) else None
        left = self.deadline - time.time()
        fields.update(seconds_before_deadline=round(left, 3), met=left >= 0 and fields.get("mirror_drained", True) is not False)
        event("deadline_done", **fields)
        self.done = fields
        return result
