"""``ripresa inspect FILE.safetensors``: a general generation's tensor file, or a foreign safetensors file.

For a general generation (``step_NNNNNN.safetensors`` whose header names the
``ripresa.general`` format): the header (tensors, dtypes, key groups), the
companion (aliases, progress, versions, code, data identity) and the named
checks of :func:`ripresa.store.general.validate_general`, the same a resume
runs. Any other safetensors file (``safetensors.torch.save_file``'s) is shown
as a foreign file: its header and metadata, checked as hostile input. The
header is validated before anything else is read (docs/INSPECT.md).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from ..console import MAX_LISTED, KeyValues, capped, capped_rows, joined
from ..errors import RipresaError
from .report import Verdict, base_report, err_text, finish, fmt, fmt_size, fmt_status, state_summary

#: Tensors listed one by one in the report (all of them are counted in ``dtypes`` and ``groups``).
MAX_LISTED_TENSORS = MAX_LISTED


def _header_summary(header: Any) -> dict[str, Any]:
    """Counts, dtypes and key groups of a validated header (the first ``MAX_LISTED_TENSORS`` entries listed)."""
    dtypes: Counter[str] = Counter()
    groups: dict[str, dict[str, int]] = {}
    for e in header.entries:
        dtypes[e.dtype] += 1
        g = groups.setdefault(e.key.split("/", 1)[0] if "/" in e.key else "", {"tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += e.end - e.begin
    return {
        "tensors": len(header.entries),
        "data_bytes": header.data_size,
        "header_bytes": header.data_start,
        "metadata": dict(header.metadata),
        "dtypes": dict(sorted(dtypes.items())),
        "groups": dict(sorted(groups.items())),
        "entries": [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.end - e.begin}
                    for e in capped(header.entries, MAX_LISTED_TENSORS)[0]],
    }


def inspect_safetensors(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    """The ``safetensors`` report of ``p`` (a regular file; the caller refused special files)."""
    from ..formats import general as general_fmt
    from ..formats import safetensors_file as st
    from ..io import auth
    from ..io.fsio import sha256_file
    from ..store.general import general_paths, parse_general_name, validate_general

    report = base_report(given, "safetensors", check_finite, deep)
    v = Verdict()
    section: dict[str, Any] = {
        "file": str(p), "size": None, "generation": False, "step": parse_general_name(p.name), "header": None,
        "sha256": None, "aliases": {}, "companion": None, "checks": [], "valid": None, "reason": None,
    }
    report["safetensors"] = section
    try:
        section["size"] = os.lstat(p).st_size
        header = st.read_header(p)
    except RipresaError as exc:
        report["error"] = exc.as_dict()
        v.fail(err_text(exc), exc.exit_code)
        return finish(report, v)
    section["header"] = _header_summary(header)
    ours = header.metadata.get("format") == general_fmt.FORMAT
    if not ours or section["step"] is None:
        what = "names no ripresa format" if not ours else "is not named step_NNNNNN.safetensors"
        v.warn(f"a foreign safetensors file (its header {what}): no companion, no commit marker, nothing vouches "
               "for its content; not a generation a resume uses")
        if deep:
            try:
                st.read(p)  # every tensor read once: the byte ranges hold what the header says
                section["sha256"] = sha256_file(p, what="safetensors file").sha256
            except RipresaError as exc:
                v.fail(err_text(exc), exc.exit_code)
        return finish(report, v)

    section["generation"] = True
    key = auth.load_key() if auth.require_signature_from_env() else None
    if auth.require_signature_from_env() and key is None:
        exc = auth.missing_key_error("ripresa inspect --require-signature")
        v.fail(err_text(exc), exc.exit_code)
        return finish(report, v)
    val = validate_general(p.parent, section["step"], deep=deep, key=key)
    gen = val.generation
    section["checks"] = [c.as_dict() for c in gen.checks]
    section["valid"], section["reason"] = gen.valid, gen.reason
    if gen.valid and gen.files:
        section["sha256"] = gen.files.get(p.name) if deep else None
    if not gen.valid:
        v.fail(f"generation {section['step']} is not valid: {gen.reason}")
    elif not deep:
        v.warn("--no-deep: the tensor file was not read in full; its sha256 and the companion's state were not checked")
    _, comp, _ = general_paths(p.parent, section["step"])
    cinfo: dict[str, Any] = {"path": str(comp), "present": os.path.lexists(comp), "record": None}
    section["companion"] = cinfo
    if cinfo["present"]:
        try:
            from ..formats.companion import loads_bounded
            from ..io.fsio import read_small

            doc = loads_bounded(read_small(comp, "companion", general_fmt.MAX_COMPANION_BYTES), file=comp)
            general_fmt.validate_envelope(doc, comp)
        except RipresaError:
            pass  # the named checks above say why
        else:
            cinfo["record"] = doc["tensors"]
            cinfo["size"] = os.lstat(comp).st_size
            section["aliases"] = doc["aliases"]
            cinfo.update(state_summary(doc["state"]))
    if check_finite:
        v.warn("--check-finite reads .bin files; a general generation's tensors are not scanned for NaN/Inf")
    return finish(report, v)


def render_safetensors(s: dict[str, Any], console: Any) -> None:
    """The tables of a ``safetensors`` report."""
    from rich.markup import escape
    from rich.table import Table

    title = "general generation" if s["generation"] else "safetensors file (foreign)"
    t = KeyValues(f"{title} — {escape(s['file'])}")  # a hash or a path on its own line, never cut (docs/INSPECT.md, "80 columns")
    t.add_row("size", escape(fmt_size(s["size"])))
    h = s["header"]
    if h is not None:
        t.add_row("tensors", f"{h['tensors']} ({escape(fmt_size(h['data_bytes']))} of data, header {h['header_bytes']} bytes)")
        t.add_row("dtypes", escape(joined(h["dtypes"].items(), lambda kn: f"{kn[0]} x{kn[1]}", what="dtypes")))
        capped_rows(t, h["groups"].items(), lambda gi: (f"  {escape(gi[0] or '(top level)')}/",
                    f"{gi[1]['tensors']} tensors, {escape(fmt_size(gi[1]['bytes']))}"), what="key groups")
        if h["metadata"]:
            t.add_row("metadata", escape(joined(h["metadata"].items(), lambda kv: f"{kv[0]}={kv[1]}", what="keys")))
    if s["generation"]:
        t.add_row("step", fmt(s["step"]))
        t.add_row("valid", fmt_status(s["valid"]) + (f"  {escape(str(s['reason']))}" if s["reason"] else ""))
        t.add_row("sha256", s["sha256"] or "[dim]not computed[/]")
        capped_rows(t, s["aliases"].items(), lambda at: ("  alias", f"{escape(at[0])} -> {escape(at[1])}"),
                    what="aliases")
        c = s["companion"] or {}
        if c.get("record") is not None:
            t.add_row("companion", f"{escape(Path(c['path']).name)} ({escape(fmt_size(c.get('size')))})")
            if c.get("progress") is not None:
                t.add_row("  progress", escape(str(c["progress"])))
            if c.get("versions") is not None:
                t.add_row("  versions", escape(", ".join(f"{k} {val}" for k, val in c["versions"].items()
                                                         if k in ("python", "torch", "numpy", "ripresa"))))
        capped_rows(t, s["checks"], lambda chk: (f"  check {escape(chk['name'])}", fmt_status(chk["ok"]) + (
            f"  {escape(str(chk.get('message') or ''))[:200]}" if not chk["ok"] else "")), what="checks")
    console.print(t)
    if h is not None and h["entries"]:
        e = Table(title=f"tensors (first {len(h['entries'])} of {h['tensors']})")
        e.add_column("key", overflow="fold")
        for col in ("dtype", "shape", "bytes"):  # numbers whole on one line
            e.add_column(col, no_wrap=True, justify="right" if col == "bytes" else "left")
        capped_rows(e, h["entries"], lambda row: (escape(row["key"]), row["dtype"], escape(str(row["shape"])),
                                                  str(row["bytes"])), what="tensors")
        console.print(e)
