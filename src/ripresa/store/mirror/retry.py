"""The mirror's one back-off policy for a request to its store (docs/MIRROR.md, "Retries and failures").

:class:`Retry` runs one request: up to ``attempts`` tries (one in its one-try mode), a ``mirror_retry`` event
before each wait, the wait exponential (``backoff``·2^k, at most ``max_backoff``) times a jitter in [0.5, 1.5]
drawn from the mirror's own stream (:data:`~ripresa.store.mirror.layout.JITTER`), and, given a stop event,
checked before each try and waited on instead of sleeping (:class:`Stopped` when it is set). The pull
(:func:`ripresa.store.mirror.pull.retrying`) and the upload thread (``Mirror._retry``) both use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import RipresaError
from ...io.objstore import RemoteUnavailable
from .layout import JITTER, MirrorSpec


class Stopped(Exception):
    """The stop event was set before a try or during a wait: the request is abandoned."""


@dataclass(frozen=True)
class Retry:
    """How one request to a mirror's store is retried (the ``attempts``, ``backoff`` and ``max_backoff`` of a
    :class:`~ripresa.store.mirror.layout.MirrorSpec`)."""

    attempts: int
    backoff: float
    max_backoff: float

    @classmethod
    def of(cls, spec: MirrorSpec) -> Retry:
        return cls(spec.attempts, spec.backoff, spec.max_backoff)

    def wait(self, attempt: int) -> float:
        """The pause after failed try number ``attempt`` (from 1): exponential, capped, jittered."""
        return min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * JITTER.uniform(0.5, 1.5)

    def call(self, fn: Callable[[], Any], *, what: str, step: int | None = None,
             event: Callable[..., None] | None = None, once: bool = False,
             retry_on: tuple[type[RipresaError], ...] = (RemoteUnavailable,),
             failed: Callable[[RipresaError], None] | None = None, stop: threading.Event | None = None,
             cap: Callable[[], float | None] | None = None) -> Any:
        """``fn()``, tried again after each failure of a type in ``retry_on``; the last failure is raised.

        ``once``: one try only. ``what``, ``step``: the object and generation a retry's event names
        (``mirror_retry``: object, attempt, error, found, wait). ``failed(exc)``: called on every failure,
        the last too. ``stop``: checked before each try and waited on between tries (:class:`Stopped`).
        ``cap()``: the longest wait before the next try, asked at each (None: no cap; a close must not linger).
        """
        tries = 1 if once else self.attempts
        for attempt in range(1, tries + 1):
            if stop is not None and stop.is_set():
                raise Stopped
            try:
                return fn()
            except retry_on as exc:
                if failed is not None:
                    failed(exc)
                if attempt == tries:
                    raise
                wait = self.wait(attempt)
                longest = None if cap is None else cap()
                if longest is not None:
                    wait = min(wait, longest)
                if event is not None:
                    event("mirror_retry", step=step, object=what, attempt=attempt, error=exc.message,
                          found=None if exc.found is None else str(exc.found)[:200], wait=round(wait, 3))
                if stop is None:
                    time.sleep(wait)
                elif stop.wait(wait):
                    raise Stopped from None
        raise AssertionError("unreachable")
