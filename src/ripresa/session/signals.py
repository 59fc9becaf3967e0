"""Signals as requests, handled at the next step boundary.

Who may send them from the command line (`ripresa signal`, `ripresa pivot`),
and how that sender makes sure it signals this run's trainer and no other
process: docs/FAULTS.md, "Signalling the trainer".

| signal            | request                                                   |
|-------------------|-----------------------------------------------------------|
| SIGTERM, SIGINT   | finish the current step, write a checkpoint, exit 0       |
| SIGUSR1           | finish the current step, write a checkpoint, continue     |

The handlers only set flags; the save happens in the main flow, at the step
boundary. A second SIGTERM during the save only sets the flag again, so it
cannot abort the save.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class SignalRequests:
    """Installs the handlers and exposes the pending requests."""

    STOP = (signal.SIGTERM, signal.SIGINT)
    CHECKPOINT = (signal.SIGUSR1,)

    def __init__(self) -> None:
        self.stop_requested = False
        self.checkpoint_requested = False
        self.received: list[str] = []
        self._previous: dict[int, object] = {}
        self.installed = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Only set flags: no I/O, no locks, nothing that could deadlock in a handler.
        if signum in self.STOP:
            self.stop_requested = True
        else:
            self.checkpoint_requested = True
        self.received.append(signal.Signals(signum).name)

    def install(self) -> SignalRequests:
        """Install the handlers (main thread only; elsewhere this is a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (*self.STOP, *self.CHECKPOINT):
            self._previous[sig] = signal.signal(sig, self._handler)
        self.installed = True
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()
        self.installed = False

    def take_checkpoint_request(self) -> bool:
        """True once per SIGUSR1 burst (the flag is cleared)."""
        if self.checkpoint_requested:
            self.checkpoint_requested = False
            return True
        return False
