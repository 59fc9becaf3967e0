"""``ripresa inspect PATH``: what a checkpoint holds, and whether it can be trusted.

PATH is an ANDREA ``.bin``, a ``.safetensors`` file (a general generation's or
a foreign one), a ``checkpoint.pt``, a ``.dcp`` or ``.shards`` generation or a run folder;
this module only picks the inspector of its kind (``inspect_bin``, ``inspect_general``,
``inspect_pt``, ``inspect_dcp``, ``inspect_shards``, ``inspect_run``; the shared kit is
:mod:`ripresa.tools.report`). Inspection is read-only. What is checked, the exit
codes and the stable keys of the ``--json`` document: docs/INSPECT.md.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..console import capped_lines
from ..errors import BadInput, RipresaError
from ..io.fsio import open_regular
from .inspect_bin import inspect_bin, render_bin, scan_bin
from .inspect_dcp import dcp_report, render_dcp
from .inspect_general import inspect_safetensors, render_safetensors
from .inspect_pt import inspect_pt, render_pt
from .inspect_run import inspect_run, render_run
from .inspect_shards import render_shards, shards_report
from .report import SCHEMA, SCHEMA_VERSION, STAT_BLOCK, Stats, error_report

#: What `inspect` reads (its error messages say so).
INSPECTABLE = ("a .bin, a .safetensors file, a checkpoint.pt, a step_NNNNNN.dcp or step_NNNNNN.shards folder "
               "or a run folder")


def inspect_path(path: str | Path, *, check_finite: bool = False, deep: bool = True,
                 bin_model: Any = None) -> dict[str, Any]:
    """Inspect a ``.bin``, a ``.safetensors``, a ``checkpoint.pt``, a ``.dcp`` or ``.shards`` folder or a run folder.

    The report is JSON-able (see the module docstring for its keys) and
    carries its ``exit_code``. Raises :class:`~ripresa.errors.BadInput`
    (exit 2) for a missing or special path and a file of no known kind.
    A valid generation inspected deep carries its state fingerprint (``fingerprint``, docs/INSPECT.md, "The
    state fingerprint"; ``bin_model`` names a ``.bin``'s parameters as ``ripresa fingerprint`` does).
    """
    report = _inspect_path(path, check_finite=check_finite, deep=deep)
    return with_fingerprint(report, Path(path), deep=deep, bin_model=bin_model)


def with_fingerprint(report: dict[str, Any], p: Path, *, deep: bool, bin_model: Any = None) -> dict[str, Any]:
    """``report`` with ``fingerprint``: the :class:`~ripresa.formats.fingerprint.Fingerprint` as a dict for a valid
    generation inspected deep, else None. A fingerprint that cannot be made is a warning, never a failure."""
    report["fingerprint"] = None
    if not deep or not report.get("ok") or report.get("kind") not in _FINGERPRINTED:
        return report
    from ..formats.fingerprint_read import fingerprint_path

    try:
        report["fingerprint"] = fingerprint_path(p, model=bin_model).as_dict()
    except RipresaError as exc:
        report["warnings"].append(f"fingerprint: not computed: {exc.message}")
    return report


#: The report kinds whose path :func:`~ripresa.formats.fingerprint_read.fingerprint_path` reads.
_FINGERPRINTED = ("bin", "checkpoint.pt", "dcp", "shards", "safetensors")


def _inspect_path(path: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
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


#: The inspector of each generation kind (the registry's names, :mod:`ripresa.store.kinds`), chosen by the
#: kind's file suffix: a ``.bin`` or ``.safetensors`` of any name (a foreign one too), a ``.dcp`` or ``.shards`` folder.
_BY_KIND = {"bin": inspect_bin, "general": inspect_safetensors, "dcp": dcp_report, "shards": shards_report}
#: Files of no generation kind, by suffix (any other name: a zip archive is a ``checkpoint.pt``).
_BY_SUFFIX = {".pt": inspect_pt, ".pth": inspect_pt}


def _dispatch(p: Path, path: str | Path, st: os.stat_result, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    is_dir = stat.S_ISDIR(st.st_mode)
    if not is_dir and not stat.S_ISREG(st.st_mode):
        raise BadInput(
            "cannot inspect a special file",
            file=p,
            expected=INSPECTABLE,
            found="a FIFO, socket or device",
            hint="ripresa never reads from special files",
        )
    inspector = _kind_inspector(p, is_dir) or (inspect_run if is_dir else _BY_SUFFIX.get(p.suffix) or _zip_inspector(p))
    if inspector is not None:
        return inspector(p, path, check_finite=check_finite, deep=deep)
    raise BadInput(
        "unknown kind of file",
        file=p,
        expected=INSPECTABLE,
        found=f"a file named '{p.name}'",
        hint="for a generation's .json or .sha256, inspect its .bin or the run folder",
    )


def _kind_inspector(p: Path, is_dir: bool) -> Callable[..., dict[str, Any]] | None:
    """The inspector of the registered kind whose main file (or folder) suffix ``p`` carries, if any."""
    from ..store.kinds import kinds  # the registry imports torch: only once a path is inspected

    for spec in kinds():
        names = spec.naming
        if names is None or names.folder != is_dir or spec.kind not in _BY_KIND:
            continue
        if (p.name.endswith(names.suffix) if is_dir else p.suffix == names.suffix):
            return _BY_KIND[spec.kind]
    return None


def _zip_inspector(p: Path) -> Callable[..., dict[str, Any]] | None:
    """:func:`inspect_pt` for a zip archive (what ``torch.save`` writes) of any name, else None."""
    try:
        fd = open_regular(p, "file")  # the descriptor is checked: a FIFO is refused, never waited on
    except RipresaError:
        return None
    try:
        if os.pread(fd, 4, 0) == b"PK\x03\x04":
            return inspect_pt
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


#: The tables of each report kind: its section rendered.
_RENDERERS: dict[str, Callable[[dict[str, Any], Any], None]] = {
    "bin": lambda r, console: render_bin(r["bin"], console, deep=r["options"]["deep"]),
    "checkpoint.pt": lambda r, console: render_pt(r["checkpoint"], console),
    "run": lambda r, console: render_run(r["run"], console),
    "dcp": lambda r, console: render_dcp(r["dcp"], console) if r.get("dcp") else None,
    "shards": lambda r, console: render_shards(r["shards"], console) if r.get("shards") else None,
    "safetensors": lambda r, console: render_safetensors(r["safetensors"], console),
}


def render_report(report: dict[str, Any], console: Any = None) -> None:
    """Print a report as rich tables, then problems, warnings and the verdict."""
    from rich.markup import escape

    from ..text import safe_console

    console = console or safe_console()
    render = _RENDERERS.get(report["kind"])
    if render is not None:
        render(report, console)
    for line in capped_lines(report["problems"], lambda text: f"[red]problem:[/] {escape(text)}", what="problems"):
        console.print(line)
    for line in capped_lines(report["warnings"], lambda text: f"[yellow]warning:[/] {escape(text)}", what="warnings"):
        console.print(line)
    for line in capped_lines(report["notes"], lambda text: f"note: {escape(text)}", what="notes"):
        console.print(line)
    fp = report.get("fingerprint")
    if fp:
        console.print(f"fingerprint: {fp['root']}")
        console.print("  parts: " + " ".join(f"{k}={v[:8]}" for k, v in fp["parts"].items()), soft_wrap=True)
    if report["ok"]:
        console.print(f"[bold green]OK[/] {escape(report['path'])} (exit 0)")
    else:
        console.print(f"[bold red]FAILED[/] {escape(report['path'])} (exit {report['exit_code']})")


__all__ = ["SCHEMA", "SCHEMA_VERSION", "STAT_BLOCK", "Stats", "error_report", "inspect_path", "render_report", "scan_bin",
           "with_fingerprint"]
