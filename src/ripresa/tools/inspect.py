"""``ripresa inspect PATH``: what a checkpoint holds, and whether it can be trusted.

PATH is an ANDREA ``.bin``, a ``.safetensors`` file (a general generation's or
a foreign one), a ``checkpoint.pt``, a ``.dcp`` generation or a run folder; this
module only picks the inspector of its kind (``inspect_bin``, ``inspect_general``,
``inspect_pt``, ``inspect_dcp``, ``inspect_run``; the shared kit is
:mod:`ripresa.tools.report`). Inspection is read-only. What is checked, the exit
codes and the stable keys of the ``--json`` document: docs/INSPECT.md.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import BadInput, RipresaError
from ..io.fsio import open_regular
from .inspect_bin import inspect_bin, render_bin, scan_bin
from .inspect_dcp import dcp_report, render_dcp
from .inspect_general import inspect_safetensors, render_safetensors
from .inspect_pt import inspect_pt, render_pt
from .inspect_run import inspect_run, render_run
from .report import SCHEMA, SCHEMA_VERSION, STAT_BLOCK, Stats, error_report

#: What `inspect` reads (its error messages say so).
INSPECTABLE = "a .bin, a .safetensors file, a checkpoint.pt, a step_NNNNNN.dcp folder or a run folder"


def inspect_path(path: str | Path, *, check_finite: bool = False, deep: bool = True) -> dict[str, Any]:
    """Inspect a ``.bin``, a ``.safetensors``, a ``checkpoint.pt``, a ``.dcp`` folder or a run folder; return the report.

    The report is JSON-able (see the module docstring for its keys) and
    carries its ``exit_code``. Raises :class:`~ripresa.errors.BadInput`
    (exit 2) for a missing or special path and a file of no known kind.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise BadInput(
            "nothing to inspect: the path does not exist",
            file=p,
            expected=INSPECTABLE,
            found="nothing at this path" if not os.path.lexists(p) else "a dangling symlink",
            hint="check the path",
        ) from None
    except OSError as exc:
        raise BadInput("cannot inspect the path", file=p, expected="a readable path", found=str(exc)) from exc
    try:
        return _dispatch(p, path, st, check_finite=check_finite, deep=deep)
    except OSError as exc:  # an unreadable folder entry, an I/O error
        raise BadInput(
            "inspection could not be completed",
            file=getattr(exc, "filename", None) or p,
            expected="readable files",
            found=f"{type(exc).__name__}: {exc}",
            hint="check the permissions and the disk",
        ) from exc


def _dispatch(p: Path, path: str | Path, st: os.stat_result, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    if stat.S_ISDIR(st.st_mode) and p.name.endswith(".dcp"):  # one sharded generation (tools/inspect_dcp.py)
        return dcp_report(p, path, check_finite=check_finite, deep=deep)
    if stat.S_ISDIR(st.st_mode):
        return inspect_run(p, path, check_finite=check_finite, deep=deep)
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(
            "cannot inspect a special file",
            file=p,
            expected=INSPECTABLE,
            found="a FIFO, socket or device",
            hint="ripresa never reads from special files",
        )
    kind = _file_kind(p)
    if kind == "bin":
        return inspect_bin(p, path, check_finite=check_finite, deep=deep)
    if kind == "checkpoint.pt":
        return inspect_pt(p, path, check_finite=check_finite, deep=deep)
    if kind == "safetensors":
        return inspect_safetensors(p, path, check_finite=check_finite, deep=deep)
    raise BadInput(
        "unknown kind of file",
        file=p,
        expected="an ANDREA .bin, a .safetensors file, a checkpoint.pt (torch zip archive), a step_NNNNNN.dcp folder or a run folder",
        found=f"a file named '{p.name}'",
        hint="for a generation's .json or .sha256, inspect its .bin or the run folder",
    )


def _file_kind(p: Path) -> str | None:
    if p.suffix == ".bin":
        return "bin"
    if p.suffix == ".safetensors":
        return "safetensors"
    if p.suffix in (".pt", ".pth"):
        return "checkpoint.pt"
    try:
        fd = open_regular(p, "file")  # the descriptor is checked: a FIFO is refused, never waited on
    except RipresaError:
        return None
    try:
        if os.pread(fd, 4, 0) == b"PK\x03\x04":  # a zip archive: what torch.save writes
            return "checkpoint.pt"
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def render_report(report: dict[str, Any], console: Any = None) -> None:
    """Print a report as rich tables, then problems, warnings and the verdict."""
    from rich.markup import escape

    from ..text import safe_console

    console = console or safe_console()
    kind = report["kind"]
    if kind == "bin":
        render_bin(report["bin"], console, deep=report["options"]["deep"])
    elif kind == "checkpoint.pt":
        render_pt(report["checkpoint"], console)
    elif kind == "run":
        render_run(report["run"], console)
    elif kind == "dcp" and report.get("dcp"):
        render_dcp(report["dcp"], console)
    elif kind == "safetensors":
        render_safetensors(report["safetensors"], console)
    for text in report["problems"]:
        console.print(f"[red]problem:[/] {escape(text)}")
    for text in report["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(text)}")
    for text in report["notes"]:
        console.print(f"note: {escape(text)}")
    if report["ok"]:
        console.print(f"[bold green]OK[/] {escape(report['path'])} (exit 0)")
    else:
        console.print(f"[bold red]FAILED[/] {escape(report['path'])} (exit {report['exit_code']})")


__all__ = ["SCHEMA", "SCHEMA_VERSION", "STAT_BLOCK", "Stats", "error_report", "inspect_path", "render_report", "scan_bin"]
