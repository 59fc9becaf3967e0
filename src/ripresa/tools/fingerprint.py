"""``ripresa fingerprint PATH [OTHER]``: one hash of a generation's state whatever its layout (docs/INSPECT.md,
"The state fingerprint"; the canonical names: docs/FORMAT.md, "The state fingerprint").

This module shows what :func:`ripresa.formats.fingerprint_read.fingerprint_path` computes: the root, each part's
digest, the notes on how names were made; with a second path, which parts both hold and whether they are equal,
naming the first leaves that differ. The hashing shows a progress bar when it reads more than
:data:`PROGRESS_ABOVE` bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..formats.fingerprint import SHORT, Fingerprint
from ..formats.fingerprint_read import fingerprint_path

#: A fingerprint that reads more bytes than this shows a progress bar (not with ``--json``).
PROGRESS_ABOVE = 256 * 1024 * 1024
#: Leaves named per differing part.
MAX_NAMED = 5


def _total_bytes(path: Path) -> int:
    """About how many bytes a fingerprint of ``path`` reads (the sizes of its files), for the progress bar."""
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
        return os.lstat(path).st_size
    except OSError:
        return 0


def fingerprint(path: str | Path, *, model: torch.nn.Module | None = None, param_names: Sequence[str] | None = None,
                threads: int | None = None, show_progress: bool = False) -> Fingerprint:
    """:func:`~ripresa.formats.fingerprint_read.fingerprint_path`, with a rich progress bar for a large state."""
    p = Path(path)
    total = _total_bytes(p) if show_progress else 0
    if total <= PROGRESS_ABOVE:
        return fingerprint_path(p, model=model, param_names=param_names, threads=threads)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from ..text import escape_markup

    with Progress(TextColumn("fingerprint {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  transient=True) as bar:
        task = bar.add_task(escape_markup(p.name), total=total)
        advance: Callable[[int], None] = lambda n: bar.advance(task, n)  # noqa: E731
        return fingerprint_path(p, model=model, param_names=param_names, threads=threads, progress=advance)


def compare(a: Fingerprint, b: Fingerprint) -> dict[str, Any]:
    """Which parts both hold, which are equal, which differ (first differing leaves), which only one holds."""
    return a.compare(b, named=MAX_NAMED)


def report(paths: Sequence[Path], prints: Sequence[Fingerprint], *, leaves: bool = False) -> dict[str, Any]:
    """The ``--json`` document: one entry per path, and the comparison when there are two."""
    out: dict[str, Any] = {"fingerprints": [{"path": str(p), **f.as_dict(leaves=leaves)} for p, f in zip(paths, prints, strict=True)]}
    if len(prints) == 2:
        out["comparison"] = compare(prints[0], prints[1])
    out["exit_code"] = 0 if len(prints) < 2 or out["comparison"]["same_state"] else 1
    return out


def render(doc: dict[str, Any], console: Any = None) -> None:
    """Print a :func:`report`: each fingerprint (root, parts), then the comparison's verdict in one line."""
    from rich.table import Table

    from ..text import escape_markup, safe_console

    console = console or safe_console()
    for f in doc["fingerprints"]:
        console.print(f"[bold]{escape_markup(f['path'])}[/] ({f['layout']})")
        console.print(f"fingerprint: {f['root']}")
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for col in ("part", "digest", "values", "bytes"):
            t.add_column(col, justify="right" if col in ("values", "bytes") else "left")
        for part, digest in f["parts"].items():
            t.add_row(part, digest[:SHORT * 2], str(f["counts"][part]), f"{f['bytes'][part]:,}")
        console.print(t)
        for note in f["notes"]:
            console.print(f"note: {escape_markup(note)}")
    c = doc.get("comparison")
    if c is None:
        return
    if c["same_root"]:
        console.print("[bold green]same state[/]: the roots are equal (every value, every part)")
    elif c["same_state"]:
        console.print(f"[bold green]same state[/] in the parts both hold ({', '.join(c['same_parts'])}); "
                      f"only in the first: {', '.join(c['only_first']) or '-'}; "
                      f"only in the second: {', '.join(c['only_second']) or '-'}")
    else:
        first = next(iter(c["differ"]))
        console.print(f"[bold red]different state[/]: part {escape_markup(first)} differs first "
                      f"({escape_markup(', '.join(c['differ'][first]) or 'its leaves')}); "
                      f"differing parts: {escape_markup(', '.join(c['differ']))}; "
                      f"equal: {', '.join(c['same_parts']) or '-'}")
