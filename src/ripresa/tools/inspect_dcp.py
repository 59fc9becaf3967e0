"""``ripresa inspect RUN/step_NNNNNN.dcp``: one sharded (FSDP2) generation (docs/SHARDED.md).

The named checks of :func:`ripresa.formats.dcp.check_dcp` (deep by default:
every file re-hashed, the companion decoded, ``.metadata`` read through the
restricted reader of :mod:`ripresa.formats.dcp_safe` — never DCP's own
pickle reader), then what the generation holds: step, world size, the shard
files, the tensors DCP indexes (model and optimizer, by parameter name, their
global shapes and dtypes), the progress and every rank's data position.
Nothing is loaded into a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..console import capped_lines, capped_rows, joined
from ..errors import BadInput, RipresaError
from .report import Verdict, base_report, finish


def inspect_dcp(p: Path, given: str | Path, *, deep: bool) -> tuple[dict[str, Any], list[tuple[str, int]], list[str]]:
    """(the ``dcp`` section, problems with their exit codes, warnings) of the generation folder ``p``."""
    from ..formats import dcp as dcp_fmt
    from ..formats.dcp_safe import read_metadata

    step = dcp_fmt.parse_dcp_name(p.name)
    if step is None:
        raise BadInput("not a .dcp generation folder", file=p, expected="step_NNNNNN.dcp", found=p.name)
    gen = dcp_fmt.check_dcp(p.parent, step, deep=deep)
    section: dict[str, Any] = {
        "step": step, "valid": gen.valid, "reason": gen.reason, "deep": deep,
        "checks": [c.as_dict() for c in gen.checks],
        "world_size": gen.world_size, "size": gen.size, "files": None, "tensors": None, "progress": None, "ranks": None,
    }
    problems: list[tuple[str, int]] = []
    warnings: list[str] = []
    if not gen.valid:
        problems.append((f"generation {step} is not valid: {gen.reason}", 1))
        return section, problems, warnings
    try:
        doc = dcp_fmt.read_dcp_companion(p, gen.files[dcp_fmt.COMPANION_NAME] if gen.files else None)
        section["files"] = doc["files"]
        section["n_params"] = doc["n_params"]
        state = dcp_fmt.decode_state(doc, p)
        prog = state.get("progress") if isinstance(state, dict) else None
        section["progress"] = prog if isinstance(prog, dict) else None
        extra = state.get("extra") if isinstance(state, dict) else None
        dist = extra.get("distributed") if isinstance(extra, dict) else None
        if isinstance(dist, dict):
            section["ranks"] = [{"rank": r.get("rank"), "data": r.get("data")} for r in dist.get("ranks", [])
                                if isinstance(r, dict)]
        md = read_metadata(p)
        tensors = []
        for key, meta in md.state_dict_metadata.items():
            size = getattr(meta, "size", None)
            props = getattr(meta, "properties", None)
            tensors.append({"key": key, "shape": list(size) if size is not None else None,
                            "dtype": str(getattr(props, "dtype", "")).replace("torch.", "") if props else None,
                            "chunks": len(getattr(meta, "chunks", []) or [])})
        section["tensors"] = tensors
        model = [t for t in tensors if t["key"].startswith("model.") and t["shape"] is not None]
        n = sum(_numel(t["shape"]) for t in model)
        section["model_elements"] = n
        if n != doc["n_params"] and not any(t["key"].startswith("model.") and "running" in t["key"] for t in model):
            warnings.append(f"the .metadata indexes {n} model elements, the companion says {doc['n_params']} parameters")
    except RipresaError as exc:
        problems.append((f"{exc.message} ({exc.file})", exc.exit_code))
    if not deep:
        warnings.append("--no-deep: the shard files were not re-hashed and .metadata was not read")
    return section, problems, warnings


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def dcp_report(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    """The whole ``inspect`` report of the generation folder ``p`` (its ``dcp`` section: :func:`inspect_dcp`)."""
    report = base_report(given, "dcp", check_finite, deep)
    v = Verdict()
    report["dcp"], problems, warns = inspect_dcp(p, given, deep=deep)
    for text, code in problems:
        v.fail(text, code)
    for text in warns:
        v.warn(text)
    if check_finite:
        v.warn("--check-finite is not applied to .dcp shards (the tensors are not read); export or convert first")
    return finish(report, v)


def render_dcp(d: dict[str, Any], console: Any) -> None:
    """The checks, the shard files and a summary of the tensors."""
    from rich.markup import escape
    from rich.table import Table

    console.print(f"sharded generation step {d['step']} (.dcp), world size {d.get('world_size')}, "
                  f"{d.get('size') or 0:,} bytes")
    t = Table(title="checks")
    t.add_column("check", no_wrap=True)
    t.add_column("ok", no_wrap=True)
    t.add_column("found", overflow="fold")
    capped_rows(t, d["checks"], lambda c: (escape(c["name"]), "yes" if c["ok"] else "[red]no[/]",
                                           escape(str(c.get("found") or c.get("message") or ""))[:80]), what="checks")
    console.print(t)
    if d.get("files"):
        ft = Table(title="files")
        ft.add_column("file", overflow="fold")
        ft.add_column("bytes", justify="right", no_wrap=True)
        capped_rows(ft, sorted(d["files"].items()), lambda ns: (escape(ns[0]), f"{ns[1]:,}"), what="files")
        console.print(ft)
    if d.get("tensors") is not None:
        model = [x for x in d["tensors"] if x["key"].startswith("model.")]
        optim = [x for x in d["tensors"] if x["key"].startswith("optim.")]
        console.print(f"tensors: {len(model)} model ({d.get('model_elements', 0):,} elements), {len(optim)} optimizer "
                      f"entries; dtypes {escape(joined(sorted({x['dtype'] for x in d['tensors'] if x['dtype']}), what='dtypes'))}")
    if d.get("progress"):
        console.print(f"progress: {escape(str(d['progress']))}")
    for line in capped_lines(d.get("ranks") or [], lambda r: f"rank {r['rank']}: data position "
                             f"{escape(str(r['data']))[:160]}", what="ranks"):
        console.print(line)
