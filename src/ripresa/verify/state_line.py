"""The one line a verification says about the final state: the fingerprints of two runs' last generations
(docs/VERIFY.md, "Same state, in one line"; the tree: docs/INSPECT.md, "The state fingerprint").

Each path of a steered verification ends with a committed generation in its run folder; the continuous one
and the resumed one hold the same state when every part both fingerprints hold is equal — the weights,
the moments, the step counters, the random streams, the data position — apart from what records the run's
own history (``extra``: lineage, per-rank records; ``identity``). A generation that cannot be read is said,
never raised: the verdict rests on the step-by-step comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Parts that record the run's own history rather than its state: not compared.
HISTORY_PARTS = ("extra", "identity")


def final_state(reference: Path, other: Path, *, unused_streams: Sequence[str] = (),
                skip_parts: Sequence[str] = ()) -> dict[str, Any]:
    """``{"same": bool | None, "line": str, "roots": [..]}`` for the newest valid generations of two run folders;
    ``unused_streams``: random streams the command never seeded (``rng/<name>``: not compared, as in the verdict);
    ``skip_parts``: parts the verdict does not compare either (across world sizes: the per-rank ones)."""
    from ..errors import RipresaError
    from ..formats.fingerprint_read import fingerprint_path
    from ..store.kinds import latest_valid_any

    try:
        gens = [latest_valid_any(folder, warn=False) for folder in (reference, other)]
        if any(g is None for g in gens):
            return {"same": None, "line": "no committed generation to fingerprint", "roots": []}
        a, b = (fingerprint_path(g.path, threads=2) for g in gens)  # type: ignore[union-attr]
    except (RipresaError, OSError) as exc:
        return {"same": None, "line": f"fingerprint not available: {exc}", "roots": []}
    kept = [p for p in a.parts if p in b.parts and not p.startswith(HISTORY_PARTS) and p not in skip_parts]
    skipped = {f"rng/{name}" for name in unused_streams}
    leaves = [n for n in a.differences(b) if n.split("/", 1)[0] in kept and n not in skipped]
    differ = [p for p in kept if any(n.split("/", 1)[0] == p for n in leaves)]
    names = [gens[0].path.name, gens[1].path.name]  # type: ignore[union-attr]
    if not differ:
        unseeded = f"; never seeded, not compared: {', '.join(sorted(unused_streams))}" if unused_streams else ""
        line = (f"same state: the final generations ({names[1]}) agree in {', '.join(kept)} "
                f"(fingerprints {a.root[:16]}, {b.root[:16]}{unseeded})")
    else:
        first = [n for n in leaves if n.split("/", 1)[0] == differ[0]][:3]
        line = f"different state: {names[1]} differs from {names[0]} first in part {differ[0]} ({', '.join(first)})"
    return {"same": not differ, "line": line, "roots": [a.root, b.root], "parts": kept, "differ": differ,
            "not_compared": sorted(skipped)}
