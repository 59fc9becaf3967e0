"""``ripresa inspect RUN/step_NNNNNN.shards``: one sharded general generation (docs/INSPECT.md).

The named checks of :func:`ripresa.store.shards.validate_shards`, the same a resume runs (with
``--deep``, the default, every shard read and hashed, the companion's state resolved), then what
the folder holds: each shard (size, tensors, sha256), the Hugging Face index, the tensors (dtypes,
key groups, the first ones listed) and the companion's progress and versions. Nothing is loaded into
a model. Layout: docs/FORMAT.md ("Sharded general generations").
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path
from typing import Any

from ..console import MAX_LISTED, capped_lines, capped_rows, joined
from ..errors import BadInput, IntegrityError, RipresaError
from .report import Verdict, base_report, err_text, finish, fmt_size, fmt_status, state_summary

#: Tensors listed one by one in the report (all of them are counted in ``dtypes`` and ``groups``).
MAX_LISTED_TENSORS = MAX_LISTED


def shards_report(p: Path, given: str | Path, *, check_finite: bool, deep: bool) -> dict[str, Any]:
    """The whole ``inspect`` report of the generation folder ``p`` (its ``shards`` section)."""
    from ..formats.shards import SHARDS_NAMES
    from ..io import auth
    from ..store.shards import validate_shards

    step = SHARDS_NAMES.parse(p.name)
    if step is None:
        raise BadInput("not a .shards generation folder", file=p, expected="step_NNNNNN.shards", found=p.name)
    report = base_report(given, "shards", check_finite, deep)
    v = Verdict()
    section: dict[str, Any] = {"step": step, "valid": None, "reason": None, "deep": deep, "checks": [], "size": None,
                               "files": None, "shards": None, "tensors": None, "index": None, "aliases": {},
                               "companion": None, "signature_verified": False}
    report["shards"] = section
    key = auth.load_key() if auth.require_signature_from_env() else None
    if auth.require_signature_from_env() and key is None:
        exc = auth.missing_key_error("ripresa inspect --require-signature")
        v.fail(err_text(exc), exc.exit_code)
        return finish(report, v)
    gen = validate_shards(p.parent, step, deep=deep, key=key).generation
    section.update(valid=gen.valid, reason=gen.reason, checks=[c.as_dict() for c in gen.checks], size=gen.size,
                   signature_verified=gen.signature_verified)
    if not gen.valid:
        v.fail(f"generation {step} is not valid: {gen.reason}")
        return finish(report, v)
    try:
        _describe(p, section, dict(gen.files or {}))
    except RipresaError as exc:  # changed since the checks ran
        v.fail(err_text(exc), exc.exit_code)
    if not deep:
        v.warn("--no-deep: the shards were not read in full; their sha256 and the companion's state were not checked")
    if check_finite:
        v.warn("--check-finite reads .bin files; a sharded generation's tensors are not scanned for NaN/Inf")
    return finish(report, v)


def _describe(p: Path, section: dict[str, Any], hashes: dict[str, str]) -> None:
    """Fill the shards, tensors, index and companion of a generation that passed its checks."""
    from ..formats import general as general_fmt
    from ..formats import safetensors_file as st
    from ..formats.companion import loads_bounded
    from ..formats.shards import COMPANION_NAME, INDEX_NAME, validate_companion
    from ..io.fsio import read_small
    from ..store.shards import MAX_INDEX_BYTES

    def committed(path: Path, what: str, limit: int) -> Any:
        """``path``'s JSON, read again: the bytes the checks passed (the marker's sha256), else IntegrityError."""
        raw = read_small(path, what, limit, error=IntegrityError)
        if hashlib.sha256(raw).hexdigest() != hashes.get(path.name):
            raise IntegrityError(f"the {what} changed since it was checked", file=path, expected=hashes.get(path.name),
                                 found=hashlib.sha256(raw).hexdigest(), hint="inspect again")
        return loads_bounded(raw, file=path)

    comp = p / COMPANION_NAME
    doc = committed(comp, "companion", general_fmt.MAX_COMPANION_BYTES)
    validate_companion(doc, comp)
    section["files"] = {name: os.lstat(p / name).st_size for name in sorted(hashes)}
    dtypes: Counter[str] = Counter()
    groups: dict[str, dict[str, int]] = {}
    entries: list[dict[str, Any]] = []
    shards = []
    for rec in doc["tensors"]["shards"]:
        header = st.read_header(p / rec["name"])
        shards.append({"name": rec["name"], "size": rec["size"], "tensors": rec["count"], "sha256": rec["sha256"],
                       "data_bytes": header.data_size})
        for e in header.entries:
            dtypes[e.dtype] += 1
            g = groups.setdefault(e.key.split("/", 1)[0] if "/" in e.key else "model", {"tensors": 0, "bytes": 0})
            g["tensors"] += 1
            g["bytes"] += e.end - e.begin
            if len(entries) < MAX_LISTED_TENSORS:
                entries.append({"key": e.key, "shard": rec["name"], "dtype": e.dtype, "shape": list(e.shape),
                                "bytes": e.end - e.begin})
    section["shards"] = shards
    section["tensors"] = {"count": doc["tensors"]["count"], "dtypes": dict(sorted(dtypes.items())),
                          "groups": dict(sorted(groups.items())), "entries": entries}
    index = committed(p / INDEX_NAME, "shard index", MAX_INDEX_BYTES)  # as checked: it says what the shards say
    section["index"] = {"file": INDEX_NAME, "total_size": index["metadata"]["total_size"],
                        "weight_map": len(index["weight_map"])}
    section["aliases"] = doc["aliases"]
    section["companion"] = {"file": COMPANION_NAME, "size": section["files"][COMPANION_NAME],
                            **state_summary(doc["state"])}


def render_shards(s: dict[str, Any], console: Any) -> None:
    """The checks, the shards and a summary of the tensors."""
    from rich.markup import escape
    from rich.table import Table

    console.print(f"sharded general generation step {s['step']} (.shards), {fmt_size(s.get('size'))}")
    t = Table(title="checks")
    t.add_column("check", no_wrap=True)
    t.add_column("ok", no_wrap=True)
    t.add_column("found", overflow="fold")
    capped_rows(t, s["checks"], lambda c: (escape(c["name"]), fmt_status(c["ok"]),
                                           escape(str(c.get("found") or c.get("message") or ""))[:120]), what="checks")
    console.print(t)
    if s.get("shards"):
        ft = Table(title="shards")
        ft.add_column("file", overflow="fold")
        for col in ("bytes", "tensors"):
            ft.add_column(col, justify="right", no_wrap=True)
        ft.add_column("sha256", overflow="fold")
        capped_rows(ft, s["shards"], lambda r: (escape(r["name"]), f"{r['size']:,}", str(r["tensors"]), r["sha256"]),
                    what="shards")
        console.print(ft)
    tensors = s.get("tensors")
    if tensors:
        console.print(f"tensors: {tensors['count']}; dtypes "
                      + escape(joined(tensors["dtypes"].items(), lambda kn: f"{kn[0]} x{kn[1]}", what="dtypes")))
        for line in capped_lines(tensors["groups"].items(), lambda gi: f"  {escape(gi[0])}/: {gi[1]['tensors']} "
                                 f"tensors, {escape(fmt_size(gi[1]['bytes']))}", what="key groups"):
            console.print(line)
    if s.get("index"):
        console.print(f"index: {s['index']['file']}, {s['index']['weight_map']} names, "
                      f"total_size {s['index']['total_size']:,}")
    for line in capped_lines((s.get("aliases") or {}).items(), lambda at: f"alias: {escape(at[0])} -> {escape(at[1])}",
                             what="aliases"):
        console.print(line)
    c = s.get("companion") or {}
    if c.get("progress") is not None:
        console.print(f"progress: {escape(str(c['progress']))}")
