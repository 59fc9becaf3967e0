"""Structural, tolerance-aware comparison of two JSON-like trees.

Used by the resume verifier. Numbers compare with an absolute tolerance
(relative tolerance 0 by default, as the protocol fixes); integers, strings
and booleans compare exactly. The same infinity on both sides is equal; any
other non-finite number is always reported, never accepted — not even NaN
against NaN. Missing keys, extra keys, different
lengths and different types are structural differences, reported by path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Difference:
    """One reason two trees disagree, at a dotted path."""

    path: str
    kind: str  # "value", "structure", "non-finite", "bits" (exact: tensor bytes differ)
    a: Any
    b: Any
    gap: float = math.inf

    def describe(self) -> str:
        if self.kind == "value":
            return f"{self.path}: {self.a!r} vs {self.b!r} (gap {self.gap:.3g})"
        return f"{self.path}: {self.kind}: {_short(self.a)} vs {_short(self.b)}"


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


@dataclass
class Tally:
    """How many values were compared and the largest numeric gap among them (keyword-only fields)."""

    max_abs_gap: float = field(default=0.0, kw_only=True)
    compared: int = field(default=0, kw_only=True)

    def count(self, other: Tally) -> None:
        """Add ``other``'s values to this tally."""
        self.max_abs_gap = max(self.max_abs_gap, other.max_abs_gap)
        self.compared += other.compared


@dataclass
class Comparison(Tally):
    """Result of comparing two trees: the largest numeric gap and every difference."""

    differences: list[Difference] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences

    def merge(self, other: Comparison) -> None:
        self.count(other)
        self.differences.extend(other.differences)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def compare_trees(a: Any, b: Any, *, atol: float = 1e-12, rtol: float = 0.0, path: str = "",
                  exact: bool = False, first: bool = False) -> Comparison:
    """Compare ``a`` and ``b``; the result lists differences in traversal order.

    ``exact`` compares two state trees bit for bit (``ripresa convert``'s
    round-trip check): tensors by dtype, shape and bytes, numbers with ``==``
    (a NaN equals a NaN), tuples as lists, keys as text. ``first`` stops at
    the first difference.
    """
    out = Comparison()
    stack: list[tuple[str, Any, Any]] = [(path, a, b)]
    while stack and not (first and out.differences):
        p, x, y = stack.pop()
        if exact:
            _exact_step(p, x, y, stack, out)
        elif isinstance(x, Mapping) and isinstance(y, Mapping):
            for k in sorted(set(x) | set(y), key=str, reverse=True):
                sub = f"{p}.{k}" if p else str(k)
                if k not in x or k not in y:
                    out.differences.append(
                        Difference(sub, "structure", "missing" if k not in x else "present", "missing" if k not in y else "present")
                    )
                else:
                    stack.append((sub, x[k], y[k]))
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                out.differences.append(Difference(p, "structure", f"length {len(x)}", f"length {len(y)}"))
                continue
            # Fast path for flat numeric lists (the bulk of the data).
            if x and all(_is_number(v) for v in x) and all(_is_number(v) for v in y):
                _compare_numbers(p, x, y, atol, rtol, out)
            else:
                for i in range(len(x) - 1, -1, -1):
                    stack.append((f"{p}[{i}]", x[i], y[i]))
        elif _is_number(x) and _is_number(y):
            _compare_numbers(p, [x], [y], atol, rtol, out, scalar=True)
        else:
            _compare_leaf(p, x, y, out)
    return out


def _compare_leaf(p: str, x: Any, y: Any, out: Comparison) -> None:
    """Two leaves that are not both numbers: same type and equal, or a difference."""
    if type(x) is not type(y):
        out.differences.append(Difference(p, "structure", f"{type(x).__name__} {_short(x)}", f"{type(y).__name__} {_short(y)}"))
        return
    out.compared += 1
    if x != y:
        out.differences.append(Difference(p, "value", x, y))


def _compare_numbers(p: str, xs: list, ys: list, atol: float, rtol: float, out: Comparison, scalar: bool = False) -> None:
    first: Difference | None = None
    worst = 0.0
    n_bad = 0
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        out.compared += 1
        where = p if scalar else f"{p}[{i}]"
        if isinstance(x, float) and not math.isfinite(x) or isinstance(y, float) and not math.isfinite(y):
            if isinstance(x, float) and isinstance(y, float) and math.isinf(x) and x == y:
                continue  # the same infinity (a "best so far" that starts at inf): equal, exactly
            out.differences.append(Difference(where, "non-finite", x, y))
            continue
        if isinstance(x, int) and isinstance(y, int) and not (isinstance(x, bool) or isinstance(y, bool)):
            gap = float(abs(x - y))
        else:
            gap = abs(float(x) - float(y))
        worst = max(worst, gap)
        if gap > atol + rtol * abs(float(y)):
            n_bad += 1
            if first is None:
                first = Difference(where, "value", x, y, gap)
    out.max_abs_gap = max(out.max_abs_gap, worst)
    if first is not None:
        if n_bad > 1:
            first.path = f"{first.path} (first of {n_bad} differing values)"
        out.differences.append(first)


def _exact_step(p: str, x: Any, y: Any, stack: list[tuple[str, Any, Any]], out: Comparison) -> None:
    """One node of an exact (bitwise) comparison: a difference, or its children pushed on ``stack``."""
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            out.differences.append(Difference(p, "structure", type(x).__name__, type(y).__name__))
        elif x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
            out.differences.append(Difference(p, "structure", f"{x.dtype}{tuple(x.shape)}", f"{y.dtype}{tuple(y.shape)}"))
        else:
            out.compared += x.numel()
            if _bits(x) != _bits(y):
                out.differences.append(Difference(p, "bits", "values", "other values"))
    elif isinstance(x, Mapping) and isinstance(y, Mapping):
        xk, yk = {str(k): v for k, v in x.items()}, {str(k): v for k, v in y.items()}
        if set(xk) != set(yk):
            out.differences.append(Difference(p, "structure", f"keys {sorted(xk)[:6]}", f"keys {sorted(yk)[:6]}"))
            return
        for k in reversed(list(xk)):
            stack.append((f"{p}.{k}" if p else k, xk[k], yk[k]))
    elif isinstance(x, list | tuple) and isinstance(y, list | tuple):
        if len(x) != len(y):
            out.differences.append(Difference(p, "structure", f"length {len(x)}", f"length {len(y)}"))
            return
        for i in range(len(x) - 1, -1, -1):
            stack.append((f"{p}[{i}]", x[i], y[i]))
    elif _is_number(x) and _is_number(y):
        out.compared += 1
        if x != y and not (x != x and y != y):  # NaN equals NaN here: the bits were copied
            out.differences.append(Difference(p, "value", x, y, abs(float(x) - float(y))))
    else:
        _compare_leaf(p, x, y, out)


def _bits(t: Any) -> bytes:
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first place where two state trees differ bit for bit (:func:`compare_trees` ``exact``), or None."""
    cmp = compare_trees(a, b, path=path, exact=True, first=True)
    return cmp.differences[0].describe() if cmp.differences else None
