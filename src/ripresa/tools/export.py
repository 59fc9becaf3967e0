"""``ripresa export``: a recoverable bundle of one generation, checked by reading it back.

A thin dispatcher: the kind of the generation picks its exporter
(:mod:`~ripresa.tools.export_general`, :mod:`~ripresa.tools.export_shards`, :mod:`~ripresa.tools.export_bin`; a
sharded ``.dcp`` is consolidated to a ``.bin`` first), all of them write through
the kit of :mod:`~ripresa.tools.bundle`, and :func:`verify_export` re-hashes and
reloads the result. Layout and protocol: docs/FORMAT.md ("Export bundles");
refusals: docs/FAULTS.md §7.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import BadInput, IntegrityError, RipresaError
from ..formats.andrea_bin import bin_name
from ..io.fsio import fsync_dir
from ..store.store import CheckpointStore, Generation
from . import export_bin, export_general, export_shards
from .bundle import (
    COMPANION_MAX,
    EXPORT_FORMAT,
    EXPORT_FORMAT_VERSION,
    INFERENCE,
    JSON_MAX,
    MANIFEST_JSON,
    MANIFEST_SHA,
    PROGRESS_MIN_BYTES,
    RESUME,
    SOURCE_RUN,
    as_dict,
    check_dest,
    drop_page_cache_quiet,
    hash_bundle_file,
    meter,
    read_manifest,
    safe_rel,
)
from .export_bin import PROBE_PROMPT, PROBE_TEXT
from .models import ModelFactory


def export_run(run: Path, dest: Path, *, model_factory: ModelFactory | None = None, step: int | None = None,
               inference: bool = False, show_progress: bool = True, source_run: str | None = None) -> dict[str, Any]:
    """Export one generation of ``run`` (:mod:`~ripresa.tools.export_general` or :mod:`~ripresa.tools.export_bin`); a sharded ``.dcp`` one is consolidated first.

    When the generation to export (``step``, or the newest valid one of the
    run) is a ``step_NNNNNN.dcp`` of an FSDP2 run, it is checked deeply
    (every file's sha256; ``.metadata`` through the restricted reader), read
    into one process and written as a ``.bin`` generation in a staging folder
    beside ``dest`` (``ripresa convert``: re-read and compared bitwise), which
    is then exported like any other and removed: the bundle resumes on any
    number of ranks, ``--inference`` gives consolidated safetensors
    (docs/SHARDED.md). ``source_run``: what the bundle's manifest names as its source instead of ``run``'s path
    (a store URL whose generation was pulled into ``run``, a temporary folder: docs/MIRROR.md).
    """
    token = SOURCE_RUN.set(source_run)
    try:
        return _export_run(Path(run), Path(dest), model_factory=model_factory, step=step, inference=inference,
                           show_progress=show_progress)
    finally:
        SOURCE_RUN.reset(token)


def _export_run(run: Path, dest: Path, *, model_factory: ModelFactory | None, step: int | None, inference: bool,
                show_progress: bool) -> dict[str, Any]:
    for _kind, needs_factory, source, export in _SOURCES:
        if needs_factory and model_factory is None and run.is_dir():
            raise BadInput("exporting a .bin or .dcp generation needs the model factory", file=run,
                           expected="export_run(..., model_factory=GPT_FACTORY)", found="model_factory=None",
                           hint="only a general generation (a Checkpointer's default format) exports without one")
        gen = source(run, step)
        if gen is not None:
            return export(run, dest, gen, model_factory=model_factory, inference=inference, show_progress=show_progress)
    return export_bin.export_bin(run, dest, model_factory=model_factory, step=step, inference=inference,
                                 show_progress=show_progress, verify=verify_or_uncommit)


def _export_general(run: Path, dest: Path, gen: Generation, *, model_factory: ModelFactory | None, inference: bool,
                    show_progress: bool) -> dict[str, Any]:
    return export_general.export_general(run, dest, gen, model_factory=model_factory, inference=inference,
                                         show_progress=show_progress, verify=verify_or_uncommit)


def _export_shards(run: Path, dest: Path, gen: Generation, *, model_factory: ModelFactory | None, inference: bool,
                   show_progress: bool) -> dict[str, Any]:
    return export_shards.export_shards(run, dest, gen, model_factory=model_factory, inference=inference,
                                       show_progress=show_progress, verify=verify_or_uncommit)


def _export_sharded(run: Path, dest: Path, sharded: Generation, *, model_factory: ModelFactory | None, inference: bool,
                    show_progress: bool) -> dict[str, Any]:
    """A ``.dcp`` generation, converted to a ``.bin`` one in a staging folder beside ``dest``, exported, removed."""
    import shutil
    import tempfile

    from .convert import convert

    check_dest(dest, run)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.consolidate-", dir=dest.parent))
    try:
        convert(sharded.path, stage / bin_name(sharded.step), model_factory=model_factory)
        report = export_bin.export_bin(run, dest, model_factory=model_factory, step=sharded.step, inference=inference,
                                        show_progress=show_progress, store=CheckpointStore(stage, writer=False),
                                        verify=verify_or_uncommit)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    report["source"]["consolidated_from"] = {"dcp": str(sharded.path), "world_size": sharded.world_size,
                                             "files_sha256": dict(sharded.files or {})}
    report["notes"].append(f"consolidated from the sharded generation {sharded.path.name} "
                           f"({sharded.world_size} rank(s)), compared bitwise after conversion")
    return report


def _sharded_source(run: Path, step: int | None) -> Generation | None:
    """The ``.dcp`` generation to export, deep-checked, or None when the export is of a ``.bin``."""
    from ..formats import dcp as dcp_fmt
    from ..store.backend import latest_valid_of, registered

    dcp_steps = dcp_fmt.dcp_steps_on_disk(run) if run.is_dir() else []
    if not dcp_steps:
        return None
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step in CheckpointStore(run, writer=False).steps_on_disk() \
                or step not in dcp_steps:
            return None
        gen = dcp_fmt.check_dcp(run, step, deep=True)
        if not gen.valid:
            raise IntegrityError(f".dcp generation {step} is damaged or uncommitted: not exported", file=gen.path,
                                 expected="a committed generation whose files match its marker", found=gen.reason,
                                 hint="export another step (`ripresa inspect RUN` shows which are valid)")
        return gen
    newest = latest_valid_of(run, tuple(registered()), deep=True)
    return newest if newest is not None and newest.kind == "dcp" else None


#: The kinds whose generation an export looks for first, in this order (docs/FORMAT.md, "Export bundles"):
#: (kind, whether it needs the model factory, the deep-checked generation of that kind to export or None, its
#: exporter). A general generation is a Checkpointer's default format (a ``.shards`` one when it is large); a
#: ``.bin`` is what is left (export_bin).
_SOURCES: tuple[tuple[str, bool, Callable[[Path, int | None], Generation | None], Callable[..., dict[str, Any]]], ...] = (
    ("general", False, export_general.general_source, _export_general),
    ("shards", False, export_shards.shards_source, _export_shards),
    ("dcp", True, _sharded_source, _export_sharded),
)


#: Where a manifest of each bundle kind names the kind of generation it came from (absent: a ``.bin``).
_SOURCE_OF = {RESUME: ("generation", "format"), INFERENCE: ("weights", "source")}
#: How a bundle is reloaded, by (bundle kind, kind of generation): (dest, manifest, expected weights, factory).
_RELOADS: dict[tuple[str, str], Callable[[Path, dict[str, Any], Any, Any], dict[str, Any]]] = {
    (RESUME, "general"): lambda dest, manifest, weights, factory: export_general.reload_resume(dest, manifest),
    (RESUME, "bin"): lambda dest, manifest, weights, factory: export_bin.reload_resume(dest, manifest, factory),
    (INFERENCE, "general"): lambda dest, manifest, weights, factory: export_general.reload_inference(dest, manifest, weights),
    (INFERENCE, "bin"): lambda dest, manifest, weights, factory: export_bin.reload_inference(dest, manifest, weights, factory),
    (RESUME, "shards"): lambda dest, manifest, weights, factory: export_shards.reload_resume(dest, manifest),
    (INFERENCE, "shards"): lambda dest, manifest, weights, factory: export_general.reload_inference(
        dest, manifest, weights, source="shards"),
}


def verify_export(dest: Path, *, model_factory: ModelFactory | None = None, show_progress: bool = False, _expected_weights: Any = None) -> dict[str, Any]:
    """Re-hash every file of an export against its manifest, then reload it; return a report.

    Every file is read back from the disk (its cached pages dropped first,
    where the platform allows). A resume bundle is reloaded through
    :class:`~ripresa.store.store.CheckpointStore` (marker, companion and ``.bin``
    hashes, NaN/Inf check) into the GPT built from its ``config.json``, and one
    forward pass must give finite logits. An inference export is loaded with
    ``safetensors.torch.load_file`` into a fresh GPT (keys and shapes must
    match exactly) and generates a few bytes with an explicit generator.

    Raises :class:`~ripresa.errors.IntegrityError` (exit 1) naming the file,
    the expected and the found hash (or size) at the first mismatch;
    :class:`~ripresa.errors.BadInput` (exit 2) if ``dest`` is not a folder.
    """
    t0 = time.monotonic()
    dest = Path(dest)
    if not dest.is_dir():
        raise BadInput("export folder not found", file=dest, expected="a folder written by ripresa export",
                       found="nothing" if not os.path.lexists(dest) else "not a folder")
    manifest = read_manifest(dest)
    total = sum(e["size"] for e in manifest["files"])
    dropped = True
    with meter(total, "verify", show_progress) as advance:
        for e in manifest["files"]:
            path = safe_rel(dest, e["path"], dest / MANIFEST_JSON)
            if not os.path.lexists(path):
                raise IntegrityError("a file of the export is missing", file=path,
                                     expected=f"{e['size']} bytes, sha256 {e['sha256']}", found="nothing")
            d, was_dropped = hash_bundle_file(path, f"exported file {e['path']}")
            dropped = was_dropped and dropped
            if d.size != e["size"]:
                raise IntegrityError("size mismatch: the exported file is not the one that was written", file=path,
                                     expected=f"{e['size']} bytes", found=f"{d.size} bytes",
                                     hint="truncated or extended copy; export again")
            if d.sha256 != e["sha256"]:
                raise IntegrityError("sha256 mismatch: the exported file is not the one that was written", file=path,
                                     expected=e["sha256"], found=d.sha256, hint="the copy is damaged; export again")
            advance(d.size, f"verify {e['path']}")
    listed = {e["path"] for e in manifest["files"]} | {MANIFEST_JSON, MANIFEST_SHA}
    unlisted = sorted(str(p.relative_to(dest)) for p in dest.rglob("*")
                      if (p.is_file() or p.is_symlink()) and str(p.relative_to(dest)) not in listed)
    section, key = _SOURCE_OF[manifest["kind"]]
    named = as_dict(manifest.get(section)).get(key)
    source = named if isinstance(named, str) and (manifest["kind"], named) in _RELOADS else "bin"
    if model_factory is None and source == "bin":
        raise BadInput("verifying the export of a .bin generation needs the model factory", file=dest,
                       expected="verify_export(..., model_factory=GPT_FACTORY)", found="model_factory=None")
    reload = _RELOADS[manifest["kind"], source](dest, manifest, _expected_weights, model_factory)
    return {
        "dest": str(dest), "kind": manifest["kind"], "step": manifest.get("step"),
        "files": len(manifest["files"]) + 2, "bytes": total, "hashes_checked": len(manifest["files"]) + 1,
        "page_cache_dropped": dropped, "unlisted": unlisted, "reload": reload,
        "verified": True, "seconds": round(time.monotonic() - t0, 3),
    }


def verify_or_uncommit(dest: Path, model_factory: Any, show_progress: bool, expected: Any) -> dict[str, Any]:
    """Verify a just-written bundle; one that does not verify loses its MANIFEST.sha256 (incomplete) and says so."""
    try:
        return verify_export(dest, model_factory=model_factory, show_progress=show_progress,
                             _expected_weights=expected)
    except RipresaError as exc:
        try:
            os.unlink(dest / MANIFEST_SHA)
            fsync_dir(dest)
        except OSError:
            pass
        note = f"the export in {dest} did not verify and is incomplete ({MANIFEST_SHA} removed): delete it and export again"
        exc.hint = f"{exc.hint}; {note}" if exc.hint else note
        raise


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} bytes"  # pragma: no cover


def render_export(report: dict[str, Any], console: Any = None) -> None:
    """A rich summary of an :func:`export_run` (or :func:`verify_export`) report."""
    from rich.markup import escape
    from rich.table import Table

    from ..console import capped_lines, capped_rows
    from ..text import safe_console

    console = console or safe_console()
    ver = report.get("verification", report)
    table = Table(title=f"ripresa export — {report.get('kind', '?')}", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")  # a path or a hash folds onto the next line, whole
    if "run" in report:
        table.add_row("source run", escape(report["run"]))
        src = report.get("source", {})
        table.add_row("step", f"{report['step']} ({src.get('n_params', 0):,} parameters, verified before copy)")
        capped_rows(table, src.get("skipped", []), lambda s: ("skipped", escape(f"step {s['step']}: {s['reason']}")),
                    what="skipped")
    else:
        table.add_row("step", str(report.get("step")))
    table.add_row("destination", escape(str(report.get("dest"))))
    n_files = len(report["files"]) + 2 if isinstance(report.get("files"), list) else report.get("files")
    table.add_row("files", f"{n_files} ({_fmt_bytes(int(report.get('bytes', 0)))})")
    table.add_row("hashes", f"{ver.get('hashes_checked')} files re-read and re-hashed against the manifest"
                  + ("" if ver.get("page_cache_dropped") else " (page cache could not be dropped)"))
    r = ver.get("reload", {})
    reload_text = f"{r.get('loaded')} step {r.get('step')}, {r.get('n_params', 0):,} parameters; forward {r.get('forward')}"
    if "probe_loss" in r:
        reload_text += f" (probe loss {r['probe_loss']:.3f})"
    table.add_row("reload", escape(reload_text))
    if "sample" in r:
        table.add_row("sample", escape(repr(r["sample"]["prompt"] + r["sample"]["completion"])))
    if "seconds" in report:
        table.add_row("time", f"{report['seconds']:.2f} s")
    console.print(table)
    for line in capped_lines(report.get("notes", []), lambda note: f"note: {escape(note)}", what="notes"):
        console.print(line)
    for line in capped_lines(ver.get("unlisted", []), lambda name: f"[yellow]warning:[/] {escape(name)} is not in "
                             "the manifest", what="files not in the manifest"):
        console.print(line)
    if report.get("kind") == INFERENCE:
        console.print("[yellow]inference export: weights only — not a resume checkpoint[/]")
    if ver.get("verified"):
        console.print(f"[bold green]OK[/] {escape(str(report.get('dest')))} verified (exit 0)")
    else:  # pragma: no cover - a failed verification raises
        console.print(f"[bold red]FAILED[/] {escape(str(report.get('dest')))}")


__all__ = ["COMPANION_MAX", "EXPORT_FORMAT", "EXPORT_FORMAT_VERSION", "INFERENCE", "JSON_MAX", "MANIFEST_JSON",
           "MANIFEST_SHA", "PROBE_PROMPT", "PROBE_TEXT", "PROGRESS_MIN_BYTES", "RESUME", "drop_page_cache_quiet",
           "export_run", "render_export", "verify_export", "verify_or_uncommit"]
