"""The run folder's own files beside its generations: its path, and the metric values each generation was saved with.

:func:`local_run_dir` refuses a URL as a run folder (docs/MIRROR.md); :class:`GenerationMetrics`
keeps ``retention_metrics.json`` for a metric retention policy (docs/RETENTION.md).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.numbers import checked_number, describe
from ..errors import BadInput
from ..io.fsio import read_json_small, write_atomic

__all__ = ["METRICS_NAME", "METRICS_SCHEMA", "GenerationMetrics", "local_run_dir", "read_metrics_sidecar"]


#: The run-folder file recording the metric values each generation was saved with (``KeepBest``).
METRICS_NAME = "retention_metrics.json"
METRICS_SCHEMA = "ripresa.retention_metrics/1"
_METRICS_LIMIT = 16 * 1024 * 1024


def _as_metric(value: Any) -> float | None:
    """A reported metric as a finite float (a Python/NumPy number or a one-element tensor), else None."""
    if isinstance(value, bool) or isinstance(value, str | bytes):
        return None
    try:
        v = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return v if math.isfinite(v) else None


def read_metrics_sidecar(path: Path) -> dict[int, dict[str, float]]:
    """The ``{step: {metric: value}}`` recorded in ``retention_metrics.json``; {} when absent.

    Read through the safe opener (no link followed, size bounded); anything but
    the schema written by the ``Checkpointer`` is a :class:`BadInput`: a metric
    retention policy must not delete generations on values it cannot trust.
    """
    if not os.path.lexists(path):
        return {}
    doc = read_json_small(path, "the retention metrics", _METRICS_LIMIT)

    def bad(found: str) -> BadInput:
        return BadInput("the retention metrics file is not what the Checkpointer writes", file=path,
                        expected=f'{{"schema": "{METRICS_SCHEMA}", "steps": {{"STEP": {{"METRIC": number}}}}}}',
                        found=found, hint="move the file away: the best-by-metric generations kept so far then lose "
                                          "their values and only the step-based part of the policy keeps them")

    if not isinstance(doc, dict) or doc.get("schema") != METRICS_SCHEMA or not isinstance(doc.get("steps"), dict):
        raise bad(f"{str(doc)[:120]}")
    out: dict[int, dict[str, float]] = {}
    for key, values in doc["steps"].items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 18) or not isinstance(values, dict):
            raise bad(f"step entry {str(key)[:40]!r}")
        clean: dict[str, float] = {}
        for name, v in values.items():
            if not isinstance(name, str):
                raise bad(f"step {key}: {describe(name)}")
            clean[name] = checked_number(v, file=path, field=f"retention metrics: step {key}: {name[:40]}",
                                         lo=-sys.float_info.max, hi=sys.float_info.max, integer=False, error=BadInput)
        out[checked_number(key, file=path, field="retention metrics: a step", lo=0, hi=2**63 - 1, text=True,
                           error=BadInput)] = clean
    return out


_URL_RE = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/")


def local_run_dir(run_dir: str | os.PathLike[str], what: str = "run_dir") -> Path:
    """``run_dir`` as a local folder; a URL is refused, never turned into a folder named ``s3:``.

    ``file:///abs/path`` (and ``file://localhost/abs/path``) is the local
    folder it names. Any other ``scheme://...`` (``s3://``, ``gs://``,
    ``https://``, ...) raises :class:`BadInput` with the fix: a local run folder
    and the URL as its ``mirror`` (docs/MIRROR.md). A local folder whose name
    really starts with ``word:`` is written ``./word:/...`` (as text).
    """
    text = os.fspath(run_dir)
    if isinstance(text, bytes):
        raise TypeError(f"{what} must be a str or os.PathLike of str, not bytes")
    m = _URL_RE.match(text)
    if m is None:
        return Path(text)
    scheme = m["scheme"].lower()
    after = text[len(m["scheme"]) + 1:]  # '//host/path', or '/path' when Path() collapsed the '//'
    if scheme == "file":
        if not after.startswith("//"):
            return Path(after)
        host, _, tail = after[2:].partition("/")
        if host.lower() not in ("", "localhost"):
            raise BadInput(f"{what} is a file:// URL of another host", file=text, expected="file:///absolute/path",
                           found=f"host {host!r}", hint="name a local folder")
        return Path("/" + tail)
    url = f"{m['scheme']}://{after.lstrip('/')}"
    raise BadInput(f"{what} is a URL, not a local run folder: a run folder is always local", file=text,
                   expected="a local folder (a path, or file:///absolute/path)", found=f"a {scheme}:// URL",
                   hint=f"keep the run in a local folder and mirror it there: Checkpointer('runs/x', state, "
                        f"mirror={url!r}) or ripresa train --run runs/x --mirror {url} (docs/MIRROR.md)")


class GenerationMetrics:
    """The metrics a retention policy reads (``KeepBest``): their latest values, and those each generation was saved with."""

    def __init__(self, names: tuple[str, ...], run_dir: Path) -> None:
        self.names = names
        self.path = run_dir / METRICS_NAME
        self.latest: dict[str, float] = {}
        self.by_step: dict[int, dict[str, float]] = {}

    def load(self) -> None:
        """Read what earlier processes recorded (the writer, at start)."""
        self.by_step = read_metrics_sidecar(self.path)

    def note(self, metrics: Mapping[str, Any]) -> None:
        """Keep the latest finite value of each metric the retention policy reads."""
        for name in self.names:
            if name in metrics:
                value = _as_metric(metrics[name])
                if value is None:
                    self.latest.pop(name, None)  # NaN / inf / not a number: this step is not a candidate
                else:
                    self.latest[name] = value

    def record(self, step: int) -> None:
        """Record, before generation ``step`` is committed, the metric values it is saved with."""
        older = {s: m for s, m in self.by_step.items() if s < step}
        self.by_step = {**older, step: dict(self.latest)}  # a new dict: the writer's thread reads it
        doc = {"schema": METRICS_SCHEMA, "metric_names": list(self.names),
               "steps": {str(s): m for s, m in sorted(self.by_step.items())}}
        write_atomic(self.path, [json.dumps(doc, indent=1).encode() + b"\n"])

    def resumed(self, step: int) -> None:
        """The values as they were at the resumed step; later ones belong to no generation."""
        self.by_step = {s: m for s, m in self.by_step.items() if s <= step}
        self.latest = dict(self.by_step.get(step, {}))
