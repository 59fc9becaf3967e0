"""The ``summary.json`` trajectory a trainer writes for the resume verifier.

A trainer that follows the verification contract records ``start``, ``steps`` and ``final`` in
``OUTPUT/summary.json``; :class:`Trajectory` builds every state block from a
:class:`~ripresa.TrainingState`. The schema: docs/VERIFY.md, "The trainer's contract". The recorder
lives in :mod:`ripresa.session.trajectory` (a ``Checkpointer`` steered by ``ripresa verify`` writes
the same file); this module re-exports it and reads ``summary.json`` back.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import BadInput, IntegrityError
from ..io.fsio import read_small
from ..session.trajectory import SCHEMA, Trajectory, observe, to_json_tree

__all__ = ["SCHEMA", "SUMMARY_MAX", "Trajectory", "observe", "read_trajectory", "to_json_tree"]


#: Largest ``summary.json`` read (bytes).
SUMMARY_MAX = 256 << 20


def read_trajectory(path: str | Path) -> dict[str, Any]:
    """Load and structurally check a ``summary.json``."""
    p = Path(path)
    if not os.path.lexists(p):
        raise BadInput(
            "trajectory summary not found",
            file=p,
            expected="summary.json written by the trainer",
            found="nothing",
            hint="the trainer must follow the verification contract (docs/VERIFY.md)",
        )
    raw = read_small(p, "trajectory summary", SUMMARY_MAX, error=IntegrityError)  # no link, no FIFO, bounded
    try:
        doc = json.loads(raw.decode("utf-8"),
                         parse_constant=lambda c: {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[c])
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise IntegrityError("summary.json is not valid JSON", file=p, found=f"{type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise IntegrityError(
            "summary.json has an unknown schema", file=p, expected=SCHEMA,
            found=doc.get("schema") if isinstance(doc, dict) else type(doc).__name__,
        )
    for key in ("start", "steps", "final"):
        if doc.get(key) is None:
            raise IntegrityError(f"summary.json lacks '{key}'", file=p, expected=key, found=sorted(doc))
    return doc
