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


def terminal_width(default: int = 80) -> int:
    """The width printed lines fit: the terminal's, or ``COLUMNS``, else ``default`` (docs/FAULTS.md, "Progress and width")."""
    import shutil

    return max(20, shutil.get_terminal_size((default, 24)).columns)


def break_offsets(line: str, width: int, indent: int = 0) -> list[int]:
    """Where ``line`` breaks to fit ``width`` columns: at spaces only, never inside a token; a token longer than
    the width gets a line of its own (whole). Continuation lines are ``indent`` columns in. Offsets start lines."""
    offsets: list[int] = []
    col = 0  # the current line's width so far
    i, n = 0, len(line)
    while i < n:
        j = i
        while j < n and line[j] == " ":
            j += 1
        k = j
        while k < n and line[k] != " ":
            k += 1
        if k == j:
            break  # trailing blanks
        gap, word = j - i, k - j
        if col and col + gap + word > width:  # the token starts a new line
            offsets.append(j)
            col = indent + word
        else:
            col += gap + word
        i = k
    return offsets


def wrap_words(text: str, width: int | None = None) -> str:
    """``text`` with each line longer than ``width`` (default: :func:`terminal_width`) broken at spaces only.

    A token (a path, a sha256, ``every 100``'s number) is never split: one longer than the width stands whole on
    its own line. Continuation lines keep the line's indentation; lines that fit are left as they are.
    """
    width = width or terminal_width()
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        pad = line[: len(line) - len(line.lstrip(" "))]
        cuts = [0, *break_offsets(line, width, len(pad)), len(line)]
        parts = [line[a:b].rstrip(" ") for a, b in zip(cuts, cuts[1:], strict=False)]
        out.append(parts[0] + "".join("\n" + pad + p for p in parts[1:]))
    return "\n".join(out)


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
        from rich.text import Text

        class SafeConsole(Console):
            def render_str(self, text: str, **kw: Any) -> Any:  # type: ignore[override]
                return super().render_str(escape_terminal(text), **kw)

            def print(self, *objects: Any, sep: str = " ", end: str = "\n", **kw: Any) -> None:  # type: ignore[override]
                """Strings wrap at spaces only: a token (path, hash, number) is never split (:func:`break_offsets`)."""
                if not objects or not all(isinstance(o, str) for o in objects) or kw.keys() & {"overflow", "width",
                                                                                               "no_wrap", "crop"}:
                    super().print(*objects, sep=sep, end=end, **kw)
                    return
                opts = {k: kw.pop(k) for k in ("markup", "emoji", "highlight") if k in kw}
                text = self.render_str(sep.join(objects), **opts)
                lines = []
                for line in text.split("\n", allow_blank=True):
                    plain = line.plain
                    pad = len(plain) - len(plain.lstrip(" "))
                    parts = line.divide(break_offsets(plain, self.width, pad))
                    for n, part in enumerate(parts):
                        part.rstrip()
                        lines.append(part if n == 0 else Text(" " * pad) + part)
                super().print(Text("\n").join(lines), end=end, overflow="ignore", crop=False, **kw)

        _SAFE_CONSOLE = SafeConsole
    return _SAFE_CONSOLE(**kwargs)


def has_control(text: str) -> bool:
    """Whether ``text`` holds a character :func:`escape_terminal` would escape (ignoring newlines and tabs)."""
    return _UNSAFE.search(text) is not None


__all__ = ["break_offsets", "escape_terminal", "escape_markup", "has_control", "safe_console", "terminal_width",
           "wrap_words"]
