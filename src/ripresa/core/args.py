"""Argument checks of the Python API: misuse raises ``TypeError`` / ``ValueError``.

ripresa's own errors (``ripresa.errors``) are for files and user input; a
wrong type or an out-of-range number passed by the calling program is a
programming error (docs/FAULTS.md, "Exit codes and the exception tree").
"""

from __future__ import annotations

import operator

__all__ = ["check_int"]


def check_int(value: object, what: str, *, at_least: int, hint: str = "") -> int:
    """``value`` as an ``int >= at_least``; ``TypeError`` for a bool or a non-integer, ``ValueError`` below the bound.

    Integer-like values (NumPy integers) are accepted through ``__index__``;
    ``3.0`` and ``"3"`` are not. ``hint`` ends the message of either error.
    """
    end = f" ({hint})" if hint else ""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int >= {at_least}, not a bool ({value!r}){end}")
    try:
        n = operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{what} must be an int >= {at_least}, not {type(value).__name__} ({value!r:.80}){end}") from None
    if n < at_least:
        raise ValueError(f"{what} must be >= {at_least}, got {n}{end}")
    return n
