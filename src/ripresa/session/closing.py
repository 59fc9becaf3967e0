"""The end of a session with a mirror: how long the close waits for the store, and what it reports (docs/MIRROR.md,
"The close").

A **normal end** (the loop finished, or a deadline stop) waits for a store that cannot be reached, up to
``final_upload_timeout`` (default the mirror's ``close_timeout``, 900 s) and never past the run's deadline: the
final state is what must get off the machine. A **stop** (SIGTERM, SIGINT: an operator, a preemption) keeps the
short bound: one more round with the store down, then it leaves. :class:`CloseResult` is what
``Checkpointer.close()`` returns: "done, and safe off-machine" or "done, upload pending" (exit code 3 in
``ripresa train``, :class:`~ripresa.errors.UploadPending`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ..errors import BadInput, UploadPending
from ..store.mirror import DEFAULT_CLOSE_TIMEOUT

#: The default bound of a normal end's wait for the store (seconds): 15 minutes. Long enough to ride out a
#: store's usual incidents (a restart, a network blip, throttling: minutes), short enough that a machine
#: billed by the hour is not held for long by a store that is gone; the generations stay pinned locally and
#: ``ripresa mirror push RUN`` uploads them afterwards (docs/MIRROR.md, "The close").
DEFAULT_FINAL_UPLOAD_TIMEOUT = DEFAULT_CLOSE_TIMEOUT


def parse_final_upload_timeout(value: Any, what: str = "final_upload_timeout") -> float | None:
    """``None`` (the mirror's ``close_timeout``), seconds ``>= 0`` (0: no wait), or a duration such as ``"15m"``.

    A number of the wrong type or out of range is misuse of the API (``TypeError``/``ValueError``); text is
    user input (:class:`~ripresa.errors.BadInput`, as ``--final-upload-timeout``).
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            from .cadence import parse_duration

            return parse_duration(text, what)
        if not math.isfinite(seconds) or seconds < 0:
            raise BadInput(f"{what} must be a number of seconds >= 0 or a duration", expected="e.g. 900, 15m, 0",
                           found=text[:64])
        return seconds
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be seconds (a number) or a duration such as '15m', not {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be >= 0 seconds, got {value!r}")
    return float(value)


def close_plan(spec_timeout: float, final_upload_timeout: float | None, *, stopped: bool,
               deadline: float | None, now: float | None = None) -> tuple[float, bool, str]:
    """(the bound in seconds, whether to wait for a store that cannot be reached, the bound's name).

    ``stopped``: a stop signal ended the run (short bound: no waiting for the store). ``deadline``: the run's
    deadline (POSIX time), never waited past.
    """
    if stopped:
        return spec_timeout, False, "close_timeout"
    bound = spec_timeout if final_upload_timeout is None else final_upload_timeout
    label = "final_upload_timeout"
    if deadline is not None:
        left = max(0.0, deadline - (time.time() if now is None else now))
        if left < bound:
            bound, label = left, "the deadline"
    return bound, True, label


@dataclass(frozen=True)
class CloseResult:
    """What ``Checkpointer.close()`` ended with.

    ``step``: the newest generation committed (the run's final state; None: none was). ``mirror``: the mirror's
    URL (None: no mirror). ``pending``: the steps the mirror still lacks (they stay in the run folder, pinned).
    ``reason``: why they were left (the store could not be reached within the bound, a signal, ...).
    ``seconds``: how long the close waited for uploads. ``push_command``: the command that uploads them.
    """

    step: int | None = None
    mirror: str | None = None
    pending: tuple[int, ...] = ()
    reason: str | None = None
    seconds: float = 0.0
    push_command: str | None = None
    run_dir: str | None = None

    @property
    def upload_pending(self) -> bool:
        """True when the session ended with generations its mirror does not hold ("done, upload pending")."""
        return bool(self.pending)

    @property
    def safe_off_machine(self) -> bool:
        """True when a mirror holds everything this session committed ("done, and safe off-machine")."""
        return self.mirror is not None and not self.pending

    @property
    def exit_code(self) -> int:
        """0, or 3 when an upload is pending (``ripresa train``'s exit code; docs/FAULTS.md, "Exit codes")."""
        return UploadPending.exit_code if self.pending else 0

    def message(self) -> str | None:
        """One line for a person when an upload is pending (None otherwise)."""
        if not self.pending:
            return None
        steps = ", ".join(str(s) for s in self.pending)
        return (f"the run ended with step(s) {steps} not in the mirror {self.mirror} ({self.reason}); they stay in "
                f"{self.run_dir}: upload them with `{self.push_command}`")

    def error(self) -> UploadPending | None:
        """The typed error of a pending upload (None when nothing is pending)."""
        if not self.pending:
            return None
        return UploadPending("the run ended but its final generation is not in the mirror: the upload is pending",
                             file=self.mirror, expected=f"step {self.step} uploaded before the end",
                             found=f"step(s) {', '.join(str(s) for s in self.pending)} pending ({self.reason})",
                             hint=f"nothing is lost on this machine: upload them with `{self.push_command}` "
                                  "(docs/MIRROR.md, \"The close\")")

    def raise_if_pending(self) -> None:
        """Raise :class:`~ripresa.errors.UploadPending` when an upload is pending."""
        err = self.error()
        if err is not None:
            raise err


def warn_if_pending(result: CloseResult | None, who: str) -> None:
    """The framework callbacks' one line when a run ended with its upload pending (a ``CheckpointWarning``)."""
    msg = result.message() if result is not None else None
    if msg is not None:
        import warnings

        from ..store.store import CheckpointWarning

        warnings.warn(f"{who}: {msg} (exit code 3 by ripresa's convention: sys.exit(callback.close_result.exit_code))",
                      CheckpointWarning, stacklevel=3)
