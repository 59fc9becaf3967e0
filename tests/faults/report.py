"""Run the whole fault matrix and print the table (``make test-faults``).

    python tests/faults/report.py [--out build/faults] [--sample] [-- PYTEST ARGS...]

Runs ``tests/test_faults_*.py`` and the hostile-folder fuzzer
(``tests/test_hostile_folders.py``) — every family, slow ones included — with
``RIPRESA_FAULTS_FULL=1`` (the long matrix; ``--sample`` runs the default
suite's sample instead) and ``RIPRESA_FAULTS_LEDGER`` pointing at a ledger
the tests append to (one line per family and test: cases, survived, lost).
Then it aggregates the ledger and pytest's JUnit report into
``OUT/faults.json`` and prints:

    fault family | tried | survived | failed

(failed: data lost, damage trusted, or for a hostile-folder family a case that broke any of its checks).

Exit 0 only if pytest passed and every row lost 0; a test that failed
without recording its family shows as a row of its own, counted as lost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Row order: the families of the issue, in its order.
ORDER = ("kill:", "power loss:", "full disk", "file-size", "EIO", "training", "stop after", "hostile folders",
         "hostile", "symlinks",
         "single-bit", "truncated", "property", "concurrent", "authenticated")


def _order(family: str) -> tuple[int, str]:
    for i, prefix in enumerate(ORDER):
        if family.startswith(prefix):
            return i, family
    return len(ORDER), family


def aggregate(ledger: Path) -> list[dict]:
    rows: dict[str, dict] = {}
    if not ledger.exists():
        return []
    for line in ledger.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        row = rows.setdefault(rec["family"], {"family": rec["family"], "what": "", "cases": 0, "survived": 0,
                                              "lost": 0, "failures": [], "details": [], "tests": []})
        row["what"] = row["what"] or rec.get("what", "")
        for k in ("cases", "survived", "lost"):
            row[k] += rec[k]
        row["failures"] += rec.get("failures", [])
        if rec.get("detail"):
            row["details"].append(rec["detail"])
        if rec.get("test") and rec["test"] not in row["tests"]:
            row["tests"].append(rec["test"])
    return sorted(rows.values(), key=lambda r: _order(r["family"]))


def junit_outcomes(path: Path) -> tuple[list[str], list[str], list[str], int]:
    """(failed tests, skipped tests with reasons, passed tests, total) from a JUnit XML report."""
    if not path.exists():
        return [], [], [], 0
    failed, skipped, passed = [], [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif (s := case.find("skipped")) is not None:
            skipped.append(f"{name}: {s.get('message', '')}")
        else:
            passed.append(name)
    return failed, skipped, passed, len(failed) + len(skipped) + len(passed)


def render(report: dict) -> str:
    rows = report["rows"]
    w = max([len("fault family")] + [len(r["family"]) for r in rows])
    head = f"{'fault family':<{w}}  {'tried':>7}  {'survived':>9}  {'failed':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['family']:<{w}}  {r['cases']:>7}  {r['survived']:>9}  {r['lost']:>7}")
    t = report["totals"]
    lines += ["-" * len(head), f"{'total':<{w}}  {t['cases']:>7}  {t['survived']:>9}  {t['lost']:>7}"]
    lines.append(f"wall time {report['wall_s']:.0f} s ({report['wall_s'] / 60:.1f} min), "
                 f"{'long matrix' if report['full'] else 'sample'}, pytest exit {report['pytest_rc']}, "
                 f"{report['tests']['passed']} tests passed, {len(report['tests']['skipped'])} skipped, "
                 f"{len(report['tests']['failed'])} failed")
    executed = [r for r in rows if "executed" in r["family"]]
    if executed:
        lines.append("code executed by hostile files: " + ", ".join(f"{r['lost']} of {r['cases']} ({r['family']})" for r in executed)
                     + " — must be 0")
    for s in report["tests"]["skipped"]:
        lines.append(f"skipped: {s}")
    for f in report["tests"]["failed"]:
        lines.append(f"FAILED: {f}")
    for r in rows:
        for f in r["failures"][:5]:
            lines.append(f"FAILED in {r['family']}: {f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in raw:
        i = raw.index("--")
        raw, extra = raw[:i], raw[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "build" / "faults", help="folder for faults.json, the ledger, junit.xml")
    ap.add_argument("--sample", action="store_true", help="the default suite's sample instead of the long matrix")
    args = ap.parse_args(raw)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ledger, junit = out / "ledger.jsonl", out / "junit.xml"
    for p in (ledger, junit):
        if p.exists():
            p.unlink()
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_faults_*.py"))
    files.append("tests/test_hostile_folders.py")  # issue #10: one row per hostile-folder family, and 'code executed'
    env = dict(os.environ, RIPRESA_FAULTS_LEDGER=str(ledger), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    if args.sample:
        env.pop("RIPRESA_FAULTS_FULL", None)
    else:
        env["RIPRESA_FAULTS_FULL"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files, *extra]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    wall = time.time() - t0
    rows = aggregate(ledger)
    failed, skipped, passed, _ = junit_outcomes(junit)
    recorded = {t for r in rows for t in r["tests"]}
    unrecorded = [f for f in failed if not any(f.split("::")[-1] in t for t in recorded)]
    if unrecorded:
        rows.append({"family": "tests that failed before recording", "what": "; ".join(unrecorded), "cases": len(unrecorded),
                     "survived": 0, "lost": len(unrecorded), "failures": unrecorded, "details": [], "tests": unrecorded})
    totals = {k: sum(r[k] for r in rows) for k in ("cases", "survived", "lost")}
    report = {"wall_s": round(wall, 1), "pytest_rc": rc, "full": not args.sample, "rows": rows, "totals": totals,
              "tests": {"passed": len(passed), "failed": failed, "skipped": skipped},
              "command": cmd, "python": sys.version.split()[0]}
    (out / "faults.json").write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(render(report))
    print(f"report: {out / 'faults.json'}")
    return 0 if rc == 0 and totals["lost"] == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
