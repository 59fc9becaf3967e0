"""The report kit of ``ripresa inspect``: statistics, the verdict, the JSON document, table formatting.

Shared by every kind's inspector (:mod:`ripresa.tools.inspect_bin`,
``inspect_pt``, ``inspect_run``, ``inspect_general``, ``inspect_dcp``); it
knows no kind. The document's stable keys and exit codes: docs/INSPECT.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RipresaError

SCHEMA = "ripresa.tools.inspect"
SCHEMA_VERSION = 1

#: Floats per streaming block of the statistics pass (4 MiB of float32; the
#: float64 temporaries of one block are 8 MiB each).
STAT_BLOCK = 1 << 20


class Stats:
    """Streaming float64 statistics of one array, fed block by block.

    Non-finite values are counted (NaN, +Inf, -Inf, the first one located)
    and left out of ``min``/``max``/``mean``/``std``; mean and variance are
    merged over blocks with Chan et al.'s pairwise formula.
    """

    def __init__(self) -> None:
        self.count = 0
        self.finite = 0
        self.nan = 0
        self.posinf = 0
        self.neginf = 0
        self.first_nonfinite: dict[str, Any] | None = None
        self.min = math.inf
        self.max = -math.inf
        self.mean = 0.0
        self.m2 = 0.0

    def add(self, block: np.ndarray, *, where: str, index: int = 0, offset: int | None = None, itemsize: int = 4) -> None:
        """Fold a 1-D block in. ``index`` is the block's first element index
        within ``where``; ``offset`` its byte offset in the file (or ``None``)."""
        a = block.reshape(-1)
        n = int(a.size)
        if n == 0:
            return
        self.count += n
        x = a.astype(np.float64)  # always a copy: the in-place steps below never touch the caller's data
        with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf in a damaged block
            total_sum = float(x.sum())
        if not math.isfinite(total_sum):  # a NaN/Inf somewhere (or a float64 overflow): count and drop them
            fin = np.isfinite(x)
            nan = int(np.count_nonzero(np.isnan(x)))
            pos = int(np.count_nonzero(x == np.inf))
            self.nan += nan
            self.posinf += pos
            self.neginf += n - int(np.count_nonzero(fin)) - nan - pos
            if self.first_nonfinite is None and not fin.all():
                i = int(np.argmin(fin))
                self.first_nonfinite = {
                    "where": where,
                    "index": index + i,
                    "offset": None if offset is None else offset + itemsize * i,
                    "value": repr(float(a[i])),
                }
            x = x[fin]
            if x.size == 0:
                return
            total_sum = float(x.sum())
        k = int(x.size)
        bmin, bmax = float(x.min()), float(x.max())
        bmean = total_sum / k
        np.subtract(x, bmean, out=x)
        np.square(x, out=x)
        bm2 = float(x.sum())
        self.min = min(self.min, bmin)
        self.max = max(self.max, bmax)
        merged = self.finite + k
        delta = bmean - self.mean
        self.mean += delta * k / merged
        self.m2 += bm2 + delta * delta * self.finite * k / merged
        self.finite = merged

    @property
    def nonfinite(self) -> int:
        return self.count - self.finite

    def as_dict(self) -> dict[str, Any]:
        has = self.finite > 0
        return {
            "count": self.count,
            "finite": self.finite,
            "nan": self.nan,
            "posinf": self.posinf,
            "neginf": self.neginf,
            "min": self.min if has else None,
            "max": self.max if has else None,
            "mean": self.mean if has else None,
            "std": math.sqrt(self.m2 / self.finite) if has else None,
            "first_nonfinite": self.first_nonfinite,
        }


def tensor_blocks(t: Any) -> Iterable[tuple[int, np.ndarray]]:
    """``(start, float64-able numpy block)`` of a tensor, flattened, in blocks."""
    import torch

    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), STAT_BLOCK):
        piece = flat[start : start + STAT_BLOCK]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        if piece.dtype not in (torch.float32, torch.float64):
            piece = piece.to(torch.float64)  # bfloat16/float16 have no numpy view
        yield start, piece.numpy()


def add_tensor(stats: Stats, t: Any, where: str) -> None:
    for start, block in tensor_blocks(t):
        stats.add(block, where=where, index=start)


def jsonable(obj: Any) -> Any:
    """A JSON-safe copy: tensors summarised, tuples as lists, non-finite floats as strings."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return jsonable(obj.item())
        return {"tensor": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if isinstance(obj, np.ndarray):
        return {"tensor": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, bytes | bytearray):
        return f"<{len(obj)} bytes>"
    if isinstance(obj, Path):
        return str(obj)
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    return repr(obj)


def err_text(exc: RipresaError) -> str:
    """One line: message, file, and what was found."""
    text = exc.message
    if exc.file:
        text += f" ({exc.file})"
    if exc.expected is not None:
        text += f"; expected {exc.expected}"
    if exc.found is not None:
        text += f"; found {exc.found}"
    return text


class Verdict:
    """Problems (each with its exit code) and warnings of one inspection."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.code = 0

    def fail(self, text: str, code: int = 1) -> None:
        self.problems.append(text)
        self.code = max(self.code, code)

    def warn(self, text: str) -> None:
        self.warnings.append(text)


def base_report(path: str | Path, kind: str | None, check_finite: bool, deep: bool) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "path": str(path),
        "kind": kind,
        "ok": True,
        "exit_code": 0,
        "problems": [],
        "warnings": [],
        "notes": [],
        "options": {"check_finite": check_finite, "deep": deep},
        "error": None,
        "bin": None,
        "checkpoint": None,
        "run": None,
        "safetensors": None,
        "dcp": None,
        "shards": None,
        "fingerprint": None,  # set by inspect.with_fingerprint (docs/INSPECT.md, "The state fingerprint")
    }


def finish(report: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
    report["problems"] = verdict.problems
    report["warnings"] = verdict.warnings
    report["notes"] = verdict.notes
    report["exit_code"] = verdict.code
    report["ok"] = verdict.code == 0
    return jsonable(report)


def error_report(path: str | Path, exc: RipresaError, *, check_finite: bool = False, deep: bool = True) -> dict[str, Any]:
    """The JSON document for an inspection that could not start (missing path, unknown kind)."""
    report = base_report(path, None, check_finite, deep)
    report["error"] = exc.as_dict()
    v = Verdict()
    v.fail(err_text(exc), exc.exit_code)
    return finish(report, v)


def state_summary(encoded: Any) -> dict[str, Any]:
    """progress / versions / code / data identity of a companion's (encoded) state."""
    from ..formats.companion import decode_tree

    out: dict[str, Any] = {"state_keys": [], "progress": None, "versions": None, "code": None, "data_identity": None}
    if not isinstance(encoded, dict):
        return out
    out["state_keys"] = sorted(map(str, encoded))
    for key in ("progress", "versions", "data_identity"):
        if key in encoded:
            try:
                decoded = decode_tree(encoded[key])
            except RipresaError:
                decoded = None
            # renderers iterate these as dicts; JSON output needs finite floats and no tensors
            out[key] = jsonable(decoded) if isinstance(decoded, dict) else None
    if isinstance(encoded.get("code"), dict):
        out["code"] = code_summary(encoded["code"])
    return out


def code_summary(code: dict[str, Any]) -> dict[str, Any]:
    files = code.get("files")
    return {
        "files_sha256": code.get("files_sha256"),
        "git_commit": code.get("git_commit"),
        "git_dirty": code.get("git_dirty"),
        "n_files": len(files) if isinstance(files, dict) else None,
    }


def regular(p: Path) -> bool:
    return p.is_file() and not p.is_symlink()


def fmt(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def fmt_size(n: Any) -> str:
    if not isinstance(n, int):
        return "—"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    f, i = float(n), 0
    while f >= 1024 and i < len(units) - 1:
        f /= 1024
        i += 1
    return f"{n} bytes" if i == 0 else f"{n} bytes ({f:.1f} {units[i]})"


def fmt_short_size(n: Any) -> str:
    text = fmt_size(n)
    return text[text.index("(") + 1 : -1] if "(" in text else text


def fmt_status(ok: Any) -> str:
    if ok is True:
        return "[green]ok[/]"
    if ok is False:
        return "[red]FAIL[/]"
    return "[dim]not checked[/]"


def stats_table(title: str, stats: dict[str, Any], width: int) -> Any:
    """One row per region or group, laid out across when it fits ``width`` and down otherwise (no number is
    wrapped or cut: ripresa.console.fit_table); where the first non-finite value is, the problems/warnings say."""
    from rich.markup import escape

    from ..console import capped, fit_table, more_line

    rows = []
    shown, more = capped(stats.items())
    for name, s in shown:
        bad = s["nan"] + s["posinf"] + s["neginf"]
        detail = f"[red]{bad}[/]" if bad else "0"
        rows.append([escape(name), str(s["count"]), fmt(s["min"]), fmt(s["max"]), fmt(s["mean"]), fmt(s["std"]), detail])
    if more:
        rows.append([more_line(more, "groups"), "", "", "", "", "", ""])
    return fit_table(title, ("", "count", "min", "max", "mean", "std", "non-finite"), rows, width)
