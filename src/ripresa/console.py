"""How the ``ripresa`` command speaks to a terminal (docs/FAULTS.md, "Messages: one line each, the same shape everywhere" and "Progress and width").

:func:`install` (called by the CLI's entry only) routes Python warnings and log records to
:func:`warning_line`, one terminal-safe line each; the library itself keeps warning through
:mod:`warnings`. :func:`fit_table` lays a table of numbers out across or down, so a number is never
wrapped or cut; :func:`progress` draws on stderr only on a terminal and not under ``--quiet`` or
``RIPRESA_PROGRESS=0`` (otherwise an object with the same methods that draws nothing).

Like :mod:`ripresa.text`, this module imports nothing of ripresa's layers, and rich only when it draws.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .text import escape_terminal

#: The command named in each line (set by :func:`install` and :func:`set_command`).
_COMMAND = ["ripresa"]


def one_line(text: Any) -> str:
    """``text`` as one terminal-safe line: its lines joined with ``; `` (an error's
    ``file:``/``expected:``/``found:``/``hint:`` lines stay readable), control characters escaped."""
    out = ""
    for part in (" ".join(p.split()) for p in escape_terminal(text).split("\n")):  # runs of blanks: one space
        if part:
            out += part if not out else (" " if out.endswith(":") else "; ") + part
    return escape_terminal(out, newlines=False)


def _origin(filename: str | None) -> str | None:
    """The package a warning came from, by the file that raised it ("ripresa" for its own, None: unknown)."""
    if not filename:
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.abspath(filename)
    if path.startswith(here + os.sep):
        return "ripresa"
    parts = path.replace("\\", "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = parts.index(marker)
            if i + 1 < len(parts):
                return parts[i + 1].removesuffix(".py")
    return os.path.basename(path)


def warning_line(message: Any, category: type[Warning] | None = None, filename: str | None = None,
                 command: str | None = None) -> str:
    """The one line a warning prints as: ``ripresa COMMAND: warning: TEXT``.

    A warning of ripresa's own (its text says what, which file, why and what to
    do) prints as is; one from another package names its category and origin,
    ``warning (UserWarning, torch): ...``.
    """
    cmd = escape_terminal(command or _COMMAND[0], newlines=False)[:40]
    prefix = cmd if cmd.startswith("ripresa") else f"ripresa {cmd}"
    origin = _origin(filename)
    own = origin == "ripresa" or (category is not None and category.__module__.startswith("ripresa"))
    tag = "" if own or category is None else f" ({category.__name__}{', ' + origin if origin else ''})"
    return f"{prefix}: warning{tag}: {one_line(message)}"


def show_warning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                 line: str | None = None) -> None:
    """A ``warnings.showwarning`` replacement: :func:`warning_line` on stderr (never raises)."""
    try:
        (file or sys.stderr).write(warning_line(message, category, filename) + "\n")
        (file or sys.stderr).flush()
    except (OSError, ValueError, AttributeError):
        pass


class _LogLine(logging.Handler):
    """Log records of WARNING and above (a library's logger), one line each, like a warning."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record must not break the command
            text = str(record.msg)
        level = "error" if record.levelno >= logging.ERROR else "warning"
        try:
            sys.stderr.write(f"ripresa {_COMMAND[0]}: {level} ({record.name}): {one_line(text)}\n")
        except (OSError, ValueError):
            pass


def set_command(command: str) -> None:
    """Name the running subcommand in every later line."""
    _COMMAND[0] = command


def install(command: str = "ripresa") -> Callable[[], None]:
    """Route warnings (and log records, where no logging is configured) to :func:`warning_line`.

    For the CLI's entry point only; returns a function that undoes it.
    """
    set_command(command)
    shown = warnings.showwarning
    warnings.showwarning = show_warning
    root = logging.getLogger()
    handler: logging.Handler | None = None
    if not root.handlers:
        handler = _LogLine(logging.WARNING)
        root.addHandler(handler)

    def undo() -> None:
        warnings.showwarning = shown
        if handler is not None:
            root.removeHandler(handler)

    return undo


# ---- a user's script: ripresa's errors and warnings as the command prints them --------------------

_SCRIPT_HOOKS: dict[str, Any] = {}


def _script_name() -> str:
    """The script's name (``train.py``), a ``python -m`` module's package (``pytest``), or ``python``."""
    path = sys.argv[0] if sys.argv and sys.argv[0] else ""
    name = os.path.basename(path)
    if name == "__main__.py":
        name = os.path.basename(os.path.dirname(path)) or name
    return name if name and name != "-c" else "python"


def _own(category: type[Warning] | None, filename: str | None) -> bool:
    return _origin(filename) == "ripresa" or (category is not None and category.__module__.startswith("ripresa"))


def script_error(exc: BaseException, script: str | None = None) -> str:
    """The paragraph a ripresa error that ends a script prints: as the command's (``ripresa train.py: error:
    WHAT`` and its ``file:``/``expected:``/``found:``/``hint:`` lines), then the class to catch and the exit code."""
    from .io.redact import redact

    name = escape_terminal(script or _script_name(), newlines=False)[:60]
    code = getattr(exc, "exit_code", 2)
    return (f"ripresa {name}: error: {redact(str(exc))}\n"
            f"  raised:   ripresa.errors.{type(exc).__name__}, exit {code} (RIPRESA_DEBUG=1: the traceback)\n")


#: Functions that turn an exception no check anticipated into the ripresa error it means (None: not theirs);
#: a multi-node session registers one: a collective that failed because a node is gone is ``NodeLost``.
TRANSLATORS: list[Callable[[BaseException], BaseException | None]] = []


def translated(exc: BaseException) -> BaseException:
    """``exc`` as the first of :data:`TRANSLATORS` that claims it reads it, else ``exc``."""
    for t in list(TRANSLATORS):
        try:
            new = t(exc)
        except Exception:  # noqa: BLE001 - a translator never hides the original failure
            new = None
        if new is not None:
            return new
    return exc


def _script_excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    from .errors import NodeLost, RipresaError

    previous = _SCRIPT_HOOKS.get("excepthook") or sys.__excepthook__
    if not isinstance(exc, RipresaError) and os.environ.get("RIPRESA_DEBUG") != "1":
        exc = translated(exc)
    if not isinstance(exc, RipresaError) or os.environ.get("RIPRESA_DEBUG") == "1":
        previous(exc_type, exc, tb)
        return
    try:
        sys.stderr.write(script_error(exc))
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    if isinstance(exc, NodeLost):  # a process group whose peer is gone can hang or abort in finalization
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(exc.exit_code)
    raise SystemExit(exc.exit_code)  # from an excepthook: the interpreter exits with it (atexit still runs)


def _script_formatwarning(message: Any, category: type[Warning], filename: str, lineno: int,
                          line: str | None = None) -> str:
    previous = _SCRIPT_HOOKS["formatwarning"]
    if not _own(category, filename) or os.environ.get("RIPRESA_DEBUG") == "1":
        return previous(message, category, filename, lineno, line)
    return warning_line(message, category, filename, command=_script_name()) + "\n"


def install_script_hooks() -> None:
    """In a user's script (the :class:`~ripresa.Checkpointer` calls it): a :class:`~ripresa.errors.RipresaError`
    that reaches the top prints one paragraph (:func:`script_error`) and exits with its ``exit_code``, and
    ripresa's own warnings print one line each (:func:`warning_line`, through ``warnings.formatwarning``, so
    ``catch_warnings(record=True)`` and ``pytest.warns`` still record them); every other exception and warning keeps
    Python's hooks (docs/API.md, "Errors and warnings in your script"). Idempotent; ``RIPRESA_DEBUG=1`` keeps
    tracebacks. Not under the ``ripresa`` command, which renders its own (:func:`install`).
    """
    if sys.excepthook is not _script_excepthook:
        _SCRIPT_HOOKS["excepthook"] = sys.excepthook
        sys.excepthook = _script_excepthook
    if warnings.formatwarning is not _script_formatwarning:  # the text only: recording (catch_warnings) still works
        _SCRIPT_HOOKS["formatwarning"] = warnings.formatwarning
        warnings.formatwarning = _script_formatwarning


def fit_json(doc: dict[str, Any], width: int | None = None) -> str:
    """A flat JSON object as ``json.loads`` reads it, one key a line, fitting ``width`` columns (default: the
    terminal's): a value too long for its key's line goes on the next line, whole (a hash, a path: never split)."""
    import json

    from .text import terminal_width

    width = width or terminal_width()
    rows = []
    for i, (k, v) in enumerate(doc.items()):
        key, value = json.dumps(str(k)), json.dumps(v, default=str)  # ASCII: every control character escaped
        comma = "," if i < len(doc) - 1 else ""
        one = f"  {key}: {value}{comma}"
        rows.append(one if len(one) <= width else f"  {key}:\n    {value}{comma}")
    return "{\n" + "\n".join(rows) + "\n}" if rows else "{}"

# ---- long lists: capped ------------------------------------------------------------------------

#: Most entries of one list a command prints for people (aliases, tensors, generations, files, events, steps,
#: checks, warnings...): the rest are counted on one line, ``... N more`` (docs/INSPECT.md, "Long lists").
#: ``--json`` keeps every entry.
MAX_LISTED = 64


def capped(items: Iterable[Any], limit: int = MAX_LISTED) -> tuple[list[Any], int]:
    """The first ``limit`` entries of ``items`` (a mapping gives its items) and how many more there are.

    The rest are counted, never kept or formatted: a list of a million entries
    costs its count, not a million lines. The one capping helper of every list
    a command prints (docs/INSPECT.md, "Long lists").
    """
    from collections.abc import Mapping
    from itertools import islice

    if isinstance(items, Mapping):
        items = items.items()
    it = iter(items)
    shown = list(islice(it, max(0, limit)))
    try:
        more = len(items) - len(shown)  # type: ignore[arg-type]
    except TypeError:
        more = sum(1 for _ in it)
    return shown, max(0, more)


def more_line(more: int, what: str = "") -> str:
    """The line that counts what a capped list left out: ``... 12,345 more aliases``."""
    return f"... {more:,} more" + (f" {what}" if what else "")


def joined(items: Iterable[Any], fmt: Callable[[Any], str] = str, sep: str = ", ", limit: int = MAX_LISTED,
           what: str = "") -> str:
    """``items`` joined on one line through :func:`capped`: the first ``limit``, then ``... N more``."""
    shown, more = capped(items, limit)
    parts = [fmt(x) for x in shown]
    if more:
        parts.append(more_line(more, what))
    return sep.join(parts)


def capped_lines(items: Iterable[Any], fmt: Callable[[Any], str], limit: int = MAX_LISTED,
                 what: str = "") -> list[str]:
    """One line per entry of ``items`` through :func:`capped`, the last one ``... N more`` if any were left out."""
    shown, more = capped(items, limit)
    return [fmt(x) for x in shown] + ([more_line(more, what)] if more else [])


def capped_rows(table: Any, items: Iterable[Any], row: Callable[[Any], Sequence[str]], limit: int = MAX_LISTED,
                what: str = "") -> None:
    """Add a rich table's rows, one per entry through :func:`capped`; a last row ``... N more`` if any were left out."""
    shown, more = capped(items, limit)
    for x in shown:
        table.add_row(*row(x))
    if more:
        table.add_row(more_line(more, what))


# ---- tables that fit ----------------------------------------------------------------------------


def _cell_width(cell: str) -> int:
    from rich.text import Text

    try:
        return Text.from_markup(cell).cell_len
    except Exception:  # noqa: BLE001 - not markup: its plain width
        return Text(cell).cell_len


def table_width(header: Sequence[str], rows: Iterable[Sequence[str]]) -> int:
    """The width a rich table with a box, padding 1 and these cells needs (no cell wrapped)."""
    widths = [_cell_width(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], _cell_width(cell))
    return sum(widths) + 3 * len(widths) + 1


def fit_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> Any:
    """A rich renderable of ``rows`` under ``header`` (the first column names the row) that fits ``width``.

    Across (one row per name, one column per header) when that fits, no cell
    wrapped or cut; otherwise down: one row per (name, field, value) — each
    value whole on its line (a value longer than the width folds, never cut).
    """
    from rich.table import Table

    if table_width(header, rows) <= width:
        t = Table(title=title)
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
        for row in rows:
            t.add_row(*row)
        return t
    t = Table(title=title)
    t.add_column(header[0] or "name", overflow="fold")  # a long name folds; the numbers keep their width
    t.add_column("field", no_wrap=True)
    t.add_column("value", justify="right", overflow="fold")
    for row in rows:
        for i, (h, cell) in enumerate(zip(header[1:], row[1:], strict=True)):
            t.add_row(row[0] if i == 0 else "", h, cell)
        t.add_section()
    return t


class KeyValues:
    """A report's fields, one ``field  value`` line each, that keeps a long value whole (docs/INSPECT.md, "80 columns").

    A two-column table box cut a sha256 (64 characters) in its value column at 80 columns; here a
    value that does not fit beside its field goes on its own line under it, indented four, and a
    hash or a path is never broken unless it is longer than the line itself. The API is the part of
    ``rich.table.Table`` the key/value reports use (``add_row``, so :func:`capped_rows` works).
    """

    #: Widest field column; a longer field puts its value on the next line.
    FIELD_MAX = 26

    def __init__(self, title: str = "") -> None:
        self.title = title
        self.rows: list[tuple[str, str]] = []

    def add_column(self, *args: Any, **kwargs: Any) -> None:  # the Table API: columns are fixed
        pass

    def add_row(self, field: str = "", value: str = "") -> None:
        self.rows.append((field, value))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.padding import Padding
        from rich.table import Table
        from rich.text import Text

        def text(cell: str) -> Any:
            try:
                return Text.from_markup(cell)
            except Exception:  # noqa: BLE001 - not markup: the plain text
                return Text(cell)

        width = options.max_width
        rows = [(text(f), text(v)) for f, v in self.rows]
        fw = min(max((f.cell_len for f, _ in rows), default=0), self.FIELD_MAX)
        room = max(width - 2 - fw - 2, 8)  # the value column beside the fields
        if self.title:
            yield text(f"[bold]{self.title}[/]")
        grid: Any = None
        for f, v in rows:
            longest = max((len(w) for w in v.plain.split()), default=0)
            if f.cell_len <= fw and longest <= room:  # beside its field, wrapped at spaces if need be
                if grid is None:
                    grid = Table.grid(padding=(0, 2))
                    grid.add_column(width=fw, no_wrap=True)
                    grid.add_column(max_width=room, overflow="fold")
                grid.add_row(f, v)
                continue
            if grid is not None:
                yield Padding(grid, (0, 0, 0, 2), expand=False)
                grid = None
            lead = len(f.plain) - len(f.plain.lstrip(" "))  # a sub-field's value goes under it, deeper
            yield Padding(f, (0, 0, 0, 2), expand=False)  # a hash or a path on its own line under its field
            yield Padding(v, (0, 0, 0, 4 + lead), expand=False)
        if grid is not None:
            yield Padding(grid, (0, 0, 0, 2), expand=False)


# ---- progress on stderr -------------------------------------------------------------------------


def live(quiet: bool = False) -> bool:
    """Whether a progress display may draw: stderr is a terminal, not ``--quiet``, not ``RIPRESA_PROGRESS=0``."""
    if quiet or os.environ.get("RIPRESA_PROGRESS") == "0":
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, OSError, ValueError):
        return False


class NoProgress:
    """What :func:`progress` returns when nothing may draw: rich ``Progress``'s methods, doing nothing."""

    def __enter__(self) -> NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def start(self) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None

    def advance(self, *args: Any, **kwargs: Any) -> None:
        return None

    def stop(self) -> None:
        return None


def stderr_console() -> Any:
    """The terminal-safe rich console of progress displays (stderr; width from the terminal or ``COLUMNS``)."""
    from .text import safe_console

    return safe_console(stderr=True)


def progress(kind: str = "count", *, quiet: bool = False, transient: bool = True) -> Any:
    """A progress display on stderr for a wait: ``kind`` ``count`` (N/M and a unit, e.g. paths) or ``bytes``.

    The numbers come first, then the description of what is being done (last:
    it wraps under them, never cut); under 100 columns the bar and the rate
    are left out. Each task gives ``unit=`` (``paths``, ``bytes`` aside). Nothing draws (a
    :class:`NoProgress`) unless :func:`live`.
    """
    if not live(quiet):
        return NoProgress()
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )
    from rich.table import Column

    console = stderr_console()
    wide = console.width >= 100
    number = Column(no_wrap=True)
    columns: list[Any] = [SpinnerColumn()]
    if wide:
        columns.append(BarColumn(bar_width=24))
    if kind == "bytes":
        columns.append(DownloadColumn(table_column=number))
        if wide:
            columns.append(TransferSpeedColumn(table_column=Column(no_wrap=True)))
    else:
        columns.append(MofNCompleteColumn(table_column=number))
        columns.append(TextColumn("{task.fields[unit]}", table_column=Column(no_wrap=True)))
    columns.append(TimeElapsedColumn(table_column=Column(no_wrap=True)))
    columns.append(TextColumn("{task.description}", table_column=Column(overflow="fold")))  # last: it wraps, whole
    return Progress(*columns, console=console, transient=transient, expand=False)


__all__ = ["NoProgress", "fit_json", "fit_table", "install", "install_script_hooks", "live", "one_line", "progress", "script_error",
           "set_command", "show_warning", "stderr_console", "table_width", "warning_line"]
