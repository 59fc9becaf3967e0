"""The one checked conversion of a number read from a run-folder file (docs/FAULTS.md, "Numbers read from files").

Every number ripresa reads from a file it did not just write (a companion, ``config.json``,
``retention_metrics.json``, ``.loss.jsonl``, ``.state.json``, a marker, a mirror manifest)
goes through :func:`checked_number` before it is used: a JSON integer may have thousands of
digits (``float()`` of it is an ``OverflowError``, ``str()`` of it a ``ValueError``), a float
may be NaN or infinite, a string may hold a megabyte of digits. Each of those is one typed
error naming the file, the field, the range allowed and what was found, never a traceback.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, RipresaError

#: Longest text of digits converted (``int("9" * 10**6)`` is quadratic and refused by Python anyway).
MAX_DIGITS = 40
#: The range of a signed 64-bit integer, the widest any ripresa file field holds.
INT64 = (-(2**63), 2**63 - 1)


def describe(value: Any, limit: int = 60) -> str:
    """A short, safe description of a value read from a file: a huge int is described by its size,
    never converted to text (Python refuses ints of more than 4,300 digits as text)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 100:
            return f"an integer of {value.bit_length()} bits"
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str | bytes):
        text = repr(value[:limit])
        return text + (f" ({len(value)} characters)" if len(value) > limit else "")
    return f"a {type(value).__name__}"


def checked_number(value: Any, *, file: str | Path | None, field: str, lo: float, hi: float,
                   integer: bool = True, text: bool = False,
                   error: type[RipresaError] = IntegrityError) -> Any:
    """``value`` (read from ``file``'s ``field``) as an int (``integer``) or a finite float in ``[lo, hi]``.

    Accepted: a JSON int (not a bool); for ``integer``, a float only when it
    is whole (``3.0``); for a float field, any finite int or float. With
    ``text``, a string of at most :data:`MAX_DIGITS` characters is converted
    first (a marker's or a safetensors metadata's step). Anything else —
    NaN, ±inf, a non-integer where an integer is due, a number out of range
    however many digits it has — raises ``error`` (default
    :class:`~ripresa.errors.IntegrityError`), one paragraph: file, field,
    expected range, what was found.
    """
    kind = "an integer" if integer else "a finite number"

    def bad(why: str) -> RipresaError:
        return error(f"{field}: {why}", file=file, expected=f"{kind} in [{_fmt(lo)}, {_fmt(hi)}]",
                     found=describe(value),
                     hint="the file was edited or not written by ripresa; fix or remove it")

    v = value
    if text and isinstance(v, str):
        if not v or len(v) > MAX_DIGITS:
            raise bad("not a number of at most 40 characters")
        try:
            v = int(v) if integer else float(v)
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                raise bad("not a number") from None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad("not a number")
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            raise bad("not finite")
        if integer:
            if not v.is_integer():
                raise bad("not an integer")
    # int/float comparisons are exact in Python, whatever the int's size: no OverflowError here
    if not lo <= v <= hi:
        raise bad("out of range")
    if integer:
        return int(v)
    return float(v)


def _fmt(x: float) -> str:
    """A bound as people read it: ``2**63-1`` rather than 19 digits."""
    if isinstance(x, int) and abs(x) >= 2**20:
        n, sign = abs(x), "-" if x < 0 else ""
        if n & (n - 1) == 0:
            return f"{sign}2**{n.bit_length() - 1}"
        if (n + 1) & n == 0:
            return f"{sign}2**{n.bit_length()}-1"
    return repr(x) if isinstance(x, float) else str(x)
