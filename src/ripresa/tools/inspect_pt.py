"""``ripresa inspect checkpoint.pt``: a ``torch.save`` checkpoint read through the restricted loader.

Its sidecar, schema, progress, versions and code identity, then per-group
statistics of the model and optimizer tensors (docs/INSPECT.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..console import KeyValues, capped_rows, joined
from ..errors import IntegrityError, RipresaError
from .report import (
    Stats,
    Verdict,
    add_tensor,
    base_report,
    code_summary,
    err_text,
    finish,
    fmt_size,
    fmt_status,
    stats_table,
)


def _pt_sidecar_after_failure(p: Path) -> dict[str, Any]:
    from ..io.fsio import read_sidecar, sha256_file, sidecar_path

    side = sidecar_path(p)
    info: dict[str, Any] = {"path": str(side), "present": os.path.lexists(side), "expected": None, "actual": None,
                            "ok": None, "error": None}
    if info["present"]:
        try:
            info["expected"] = read_sidecar(p)
        except RipresaError as exc:
            info["error"] = err_text(exc)
    try:
        info["actual"] = sha256_file(p, what="checkpoint").sha256
    except RipresaError as exc:
        info["error"] = info["error"] or err_text(exc)
    if info["expected"] is not None and info["actual"] is not None:
        info["ok"] = info["expected"] == info["actual"]
    elif not info["present"]:
        info["ok"] = False
    return info


def inspect_pt(p: Path, given: str | Path, *, check_finite: bool, deep: bool, note: str | None = None) -> dict[str, Any]:
    import torch

    from ..errors import SchemaError
    from ..formats.torch_pt import load_checkpoint
    from ..io.fsio import sidecar_path

    report = base_report(given, "checkpoint.pt", check_finite, deep)
    v = Verdict()
    if note:
        v.notes.append(note)
    section: dict[str, Any] = {
        "file": str(p),
        "size": p.stat().st_size,
        "sidecar": None,
        "schema_ok": None,
        "progress": None,
        "versions": None,
        "code": None,
        "data_identity": None,
        "config": None,
        "lineage": None,
        "extra_keys": None,
        "model": None,
        "optimizer": None,
        "scheduler": None,
        "scaler": None,
        "data": None,
        "rng": None,
        "objects": None,
        "finite": {"checked": check_finite, "ok": None},
    }
    report["checkpoint"] = section
    try:
        ck = load_checkpoint(p)
    except RipresaError as exc:
        report["error"] = exc.as_dict()
        v.fail(err_text(exc), exc.exit_code)
        section["sidecar"] = _pt_sidecar_after_failure(p)
        if section["sidecar"]["ok"] and isinstance(exc, IntegrityError):
            section["schema_ok"] = False if isinstance(exc, SchemaError) else None
        return finish(report, v)

    side = sidecar_path(p)
    section["sidecar"] = {"path": str(side), "present": True, "expected": ck.digest.sha256,
                          "actual": ck.digest.sha256, "ok": True, "error": None}
    section["schema_ok"] = True
    s = ck.state
    section["progress"] = s["progress"]
    section["versions"] = s["versions"]
    section["code"] = code_summary(s["code"])
    section["data_identity"] = s["data_identity"]
    section["config"] = s["config"]
    section["lineage"] = s["lineage"]
    section["extra_keys"] = sorted(map(str, s["extra"]))

    # model tensors
    model_stats = Stats()
    dtypes: dict[str, int] = {}
    entries = []
    elements = floating = 0
    for name, t in s["model"].items():
        dt = str(t.dtype).removeprefix("torch.")
        dtypes[dt] = dtypes.get(dt, 0) + 1
        elements += t.numel()
        entries.append({"name": name, "shape": list(t.shape), "dtype": dt, "numel": t.numel()})
        if t.is_floating_point():
            floating += t.numel()
            add_tensor(model_stats, t, f"model.{name}")
    section["model"] = {"tensors": len(entries), "elements": elements, "floating_elements": floating,
                        "dtypes": dtypes, "stats": model_stats.as_dict(), "entries": entries}
    all_stats: list[Stats] = [model_stats]

    # optimizer
    opt = s["optimizer"]
    if opt is not None:
        groups = []
        for g in opt["param_groups"]:
            row = {"n_params": len(g.get("params", []))}
            row.update({k: val for k, val in g.items() if k != "params"})
            groups.append(row)
        by_key: dict[str, Stats] = {}
        steps: set[float] = set()
        alias = {"exp_avg": "m", "exp_avg_sq": "v"}
        for idx, st in opt["state"].items():
            if not isinstance(st, dict):
                continue
            for key, t in st.items():
                if key == "step":
                    steps.add(float(t.item() if isinstance(t, torch.Tensor) else t))
                elif isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0:
                    add_tensor(by_key.setdefault(alias.get(key, key), Stats()), t, f"optimizer.state[{idx}].{key}")
        section["optimizer"] = {
            "param_groups": groups,
            "params_with_state": len(opt["state"]),
            "steps": sorted(int(x) if x == int(x) else x for x in steps),
            "state": {k: st.as_dict() for k, st in by_key.items()},
        }
        all_stats.extend(by_key.values())

    sched = s["scheduler"]
    section["scheduler"] = None if sched is None else {
        k: sched[k] for k in ("last_epoch", "_last_lr", "base_lrs") if k in sched
    } | {"keys": sorted(map(str, sched))}
    section["scaler"] = s["scaler"]
    section["data"] = s["data"]
    section["rng"] = sorted(k for k, val in s["rng"].items() if val is not None)
    section["objects"] = sorted(map(str, s["objects"]))

    bad = [st for st in all_stats if st.nonfinite]
    if check_finite:
        section["finite"]["ok"] = not bad
    for st in bad:
        first = st.first_nonfinite or {}
        text = f"{st.nonfinite} non-finite value(s); first {first.get('where')}[{first.get('index')}] = {first.get('value')}"
        if check_finite:
            v.fail(text)
        else:
            v.warn(text + " (use --check-finite to fail on it)")
    return finish(report, v)


def render_pt(c: dict[str, Any], console: Any) -> None:
    from rich.markup import escape

    t = KeyValues(f"checkpoint.pt — {escape(c['file'])}")  # a hash or a path on its own line, never cut (docs/INSPECT.md, "80 columns")
    t.add_row("size", fmt_size(c["size"]))
    side = c["sidecar"] or {}
    if not side.get("present"):
        t.add_row("sidecar", "[red]missing[/]")
    else:
        t.add_row("sidecar", f"{fmt_status(side.get('ok'))}  expected {side.get('expected')}"
                  + (f", found {side.get('actual')}" if side.get("ok") is False else ""))
    if side.get("error"):
        t.add_row("", f"[red]{escape(side['error'])}[/]")
    t.add_row("schema", fmt_status(c["schema_ok"]))
    if c["progress"] is not None:
        t.add_row("progress", escape(joined(c["progress"].items(), lambda kv: f"{kv[0]} {kv[1]}")))
    if c["versions"] is not None:
        t.add_row("versions", escape(joined(c["versions"].items(), lambda kv: f"{kv[0]} {kv[1]}")))
    if c["code"] is not None:
        code = c["code"]
        t.add_row("code", escape(f"{code['files_sha256']} ({code['n_files']} files; git {code['git_commit']}, dirty {code['git_dirty']})"))
    if c["data_identity"] is not None:
        t.add_row("data identity", escape(joined(c["data_identity"].items(), lambda kv: f"{kv[0]} {kv[1]}") or "—"))
    if c["model"] is not None:
        m = c["model"]
        t.add_row("model", f"{m['tensors']} tensors, {m['elements']} elements "
                  f"({m['floating_elements']} floating), dtypes {escape(str(m['dtypes']))}")
    if c["optimizer"] is not None:
        o = c["optimizer"]
        t.add_row("optimizer", f"{len(o['param_groups'])} group(s), {o['params_with_state']} parameter(s) with state, "
                  f"steps {o['steps']}")
        keys = ("lr", "betas", "eps", "weight_decay")
        capped_rows(t, enumerate(o["param_groups"]), lambda ig: (f"  group {ig[0]}", escape(
            f"{ig[1]['n_params']} params, " + ", ".join(f"{k} {ig[1][k]}" for k in keys if k in ig[1]))), what="groups")
    if c["scheduler"] is not None:
        t.add_row("scheduler", escape(str({k: val for k, val in c["scheduler"].items() if k != "keys"})))
    if c["rng"] is not None:
        t.add_row("random streams", escape(joined(c["rng"], what="streams")))
    if c["data"] is not None:
        d = c["data"]
        t.add_row("data position", escape(joined(((k, val) for k, val in d.items() if not isinstance(val, dict)), lambda kv: f"{kv[0]} {kv[1]}")))
    t.add_row("finite", "[dim]not checked[/]" if not c["finite"]["checked"] else fmt_status(c["finite"]["ok"]))
    console.print(t)
    groups: dict[str, Any] = {}
    if c["model"] is not None:
        groups["model"] = c["model"]["stats"]
    if c["optimizer"] is not None:
        groups.update({f"optimizer {k}": s for k, s in c["optimizer"]["state"].items()})
    if groups:
        console.print(stats_table("tensor groups (float64 statistics over finite values)", groups, console.width))
