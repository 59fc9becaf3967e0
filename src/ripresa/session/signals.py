"""Signals as requests, handled at the next step boundary (docs/FAULTS.md, "Signalling the trainer").

SIGTERM and SIGINT: finish the current step, write a checkpoint, exit 0; SIGUSR1: the same, then
continue. The handlers only set flags; the save happens in the main flow, at the step boundary,
so a second SIGTERM during the save cannot abort it. SIGUSR1 never ends a run: :func:`hold`
defers one that arrives before the Checkpointer exists, one blocked by the parent stays pending
until :meth:`SignalRequests.install` unblocks it, and after ``close()`` or at interpreter exit
it is ignored (docs/ARCHITECTURE.md, "Signals through the launcher").
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from types import FrameType

__all__ = ["SignalRequests", "hold", "unblock_checkpoint_signal"]

USR1 = signal.SIGUSR1

#: SIGUSR1s that arrived while :func:`hold`'s handler was installed (taken by the next install).
_deferred: list[str] = []
_atexit_armed = False


def _defer(signum: int, frame: FrameType | None) -> None:
    """Before any Checkpointer: remember the request (only a list append: safe in a handler)."""
    _deferred.append(signal.Signals(signum).name)


def _after_close(signum: int, frame: FrameType | None) -> None:
    """After ``close()``: there is no run to checkpoint; say so and carry on."""
    try:
        os.write(2, b"ripresa: SIGUSR1 after the Checkpointer closed: ignored (no run to checkpoint)\n")
    except OSError:
        pass


def _ours(handler: object) -> bool:
    return handler in (_defer, _after_close)


def _ignore_at_exit() -> None:
    """Interpreter exit puts SIG_DFL back for every Python handler: make SIGUSR1 ignored instead, also when a
    session still holds it (a script that ended by an exception without closing its Checkpointer)."""
    handler = signal.getsignal(USR1)
    if threading.current_thread() is threading.main_thread() and (
            _ours(handler) or getattr(handler, "__func__", None) is SignalRequests._handler):
        signal.signal(USR1, signal.SIG_IGN)


def _arm_atexit() -> None:
    global _atexit_armed
    if not _atexit_armed:
        atexit.register(_ignore_at_exit)
        _atexit_armed = True


def unblock_checkpoint_signal() -> None:
    """Unblock SIGUSR1 in this thread: one that a launcher kept pending is delivered now."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {USR1})


def hold() -> bool:
    """Defer SIGUSR1 from now until a Checkpointer installs its handlers (main thread; else a no-op).

    Only replaces the default action (a handler someone else installed is kept).
    Returns True when the deferring handler is in place.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(USR1)
    if current in (signal.SIG_DFL, None) or current is _after_close:
        signal.signal(USR1, _defer)
        _arm_atexit()
        return True
    return current is _defer


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
        """Install the handlers (main thread only; elsewhere this is a no-op).

        A SIGUSR1 deferred by :func:`hold` or kept pending by a launcher's
        signal mask becomes a checkpoint request here.
        """
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (*self.STOP, *self.CHECKPOINT):
            self._previous[sig] = signal.signal(sig, self._handler)
        _arm_atexit()  # a SIGUSR1 during the interpreter's exit is ignored, never its default action
        if self._previous.get(USR1) is _defer and _deferred:
            self.received.extend(_deferred)
            _deferred.clear()
            self.checkpoint_requested = True
        self.installed = True
        unblock_checkpoint_signal()  # a pending SIGUSR1 is delivered to the handler just installed
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back; SIGUSR1's default action never comes back (it is ignored, with a note)."""
        if threading.current_thread() is not threading.main_thread():
            self._previous.clear()
            self.installed = False
            return
        for sig, prev in self._previous.items():
            if sig == USR1 and (prev in (signal.SIG_DFL, None) or _ours(prev)):
                signal.signal(sig, _after_close)
                _arm_atexit()
            else:
                signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()
        self.installed = False

    def take_checkpoint_request(self) -> bool:
        """True once per SIGUSR1 burst (the flag is cleared)."""
        if self.checkpoint_requested:
            self.checkpoint_requested = False
            return True
        return False
