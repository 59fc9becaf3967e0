"""Terminal-safe rendering of untrusted text (docs/FAULTS.md, "Trust model", "What it cannot achieve").

Every string ripresa prints that it did not write itself in this process goes through
:func:`escape_terminal` (plain ``print`` and error text) or :func:`escape_markup` (text handed to
rich): control characters, bidirectional overrides and lone surrogates come out as visible escapes,
so a planted string can neither drive the terminal nor hide or reorder what is printed.

This module sits beside :mod:`ripresa.errors` at the bottom of the layers: it imports nothing of
ripresa, and rich only when markup is escaped.
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls except \t and \n, DEL, C1 controls, bidi embeddings/overrides/isolates, line/paragraph separators,
# lone surrogates (from surrogateescape'd file names).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _visible(m: re.Match[str]) -> str:
    c = m.group(0)
    o = ord(c)
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    if 0xDC80 <= o <= 0xDCFF:  # a byte that was not UTF-8, carried by surrogateescape
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o <= 0xFF else f"\\u{o:04x}"


def escape_terminal(value: Any, *, newlines: bool = True) -> str:
    """``str(value)`` with every terminal control character shown as a visible escape.

    ``newlines=False`` escapes ``\\n`` and ``\\t`` too (one-line values).
    """
    text = value if isinstance(value, str) else str(value)
    return (_UNSAFE if newlines else _UNSAFE_LINE).sub(_visible, text)


def escape_markup(value: Any, *, newlines: bool = True) -> str:
    """:func:`escape_terminal`, then rich's markup escape: for text printed by a rich Console or Table cell."""
    from rich.markup import escape

    return escape(escape_terminal(value, newlines=newlines))


_SAFE_CONSOLE: type | None = None


def safe_console(**kwargs: Any) -> Any:
    """A ``rich.console.Console`` whose every string (printed, a table cell, a title) is made terminal-safe first.

    Rich turns each ``str`` renderable into text through ``Console.render_str``; this console escapes its control
    characters there, before markup is parsed, so what it prints of a file cannot reach the terminal raw even
    where a caller forgot :func:`escape_markup` (markup itself still needs :func:`escape_markup`).
    """
    global _SAFE_CONSOLE
    if _SAFE_CONSOLE is None:
        from rich.console import Console

        class SafeConsole(Console):
            def render_str(self, text: str, **kw: Any) -> Any:  # type: ignore[override]
                return super().render_str(escape_terminal(text), **kw)

        _SAFE_CONSOLE = SafeConsole
    return _SAFE_CONSOLE(**kwargs)


def has_control(text: str) -> bool:
    """Whether ``text`` holds a character :func:`escape_terminal` would escape (ignoring newlines and tabs)."""
    return _UNSAFE.search(text) is not None


__all__ = ["escape_terminal", "escape_markup", "safe_console", "has_control"]
