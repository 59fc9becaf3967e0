"""Issue #10: hostile run folders — nothing executes, nothing leaks, nothing hangs, no other process is hit.

The fuzzer is ``tests/faults/hostile_folders.py``: real fixtures built once by
the real CLI, mutations that are functions of a seed, every CLI reader run as a
real subprocess under a time limit with its peak RSS measured, and checks on
exit codes, tracebacks, the private tree outside the folder, a canary for
crafted pickles and an unrelated victim process.

* ``test_hostile_folders_sample`` — a fixed, seeded sample (20 invocations)
  spread over every family, the crafted pickles, the dangerous LOCK pids and
  one case of each family of issue #19 (mirror.json naming another run, a
  planted ``ripresa/`` package under ``pivot --restart``, a shard swapped
  during a signed load, a memo bomb, a password in mirror.json, escape
  sequences) always included;
* ``test_hostile_folders_matrix`` — ``@slow`` and ``make test-faults``: the whole
  matrix (every fixture file x every mutation, each run by the commands that
  read it), on two workers. ``RIPRESA_FUZZ_FIXTURES=shards`` (comma-separated
  fixture names) restricts either to the cases of those fixtures.

Both write the distinct failures to ``/tmp/fuzz_findings.md``
(``RIPRESA_FUZZ_FINDINGS``) and record one ledger row per family. Replay one
case: ``RIPRESA_FUZZ_CASE='fixture:target:mutation:command:seed' pytest -q
tests/test_hostile_folders.py -k replay``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from faults import hostile_folders as hf
from faults.common import FULL


@pytest.fixture(scope="session")
def hostile_fixtures(tmp_path_factory) -> hf.Fixtures:
    return hf.build_fixtures(tmp_path_factory.mktemp("hostile-fixtures"))


def _run_and_check(cases: list[hf.Case], fx: hf.Fixtures, work: Path, *, workers: int, title: str) -> None:
    outcomes = hf.run_cases(cases, fx, work, workers=workers)
    text = hf.write_findings(outcomes, title=title)
    rows = hf.tallies(outcomes)
    for t in rows:
        t.record()
    bad = [o for o in outcomes if not o.ok]
    ran = {o.case.family for o in outcomes if not o.skipped}
    if hf.only_fixtures(cases) is cases:  # the whole set (RIPRESA_FUZZ_FIXTURES restricts it to some fixtures)
        assert ran >= {hf.F_PICKLE, hf.F_LOCK, *(f for f, _, _ in hf.SAMPLE_ROUND_TWO),
                       *(f for f, _, _ in hf.r3.SAMPLE_ROUND_THREE)}, "a family ran no case"
    executed = [o for o in outcomes if o.executed]
    assert not executed, "CODE EXECUTED:\n" + "\n".join(o.line() for o in executed)
    assert not bad, (f"{len(bad)}/{len(outcomes)} hostile-folder cases failed "
                     f"(findings: {hf.FINDINGS}):\n" + "\n".join(o.line()[:400] for o in bad[:40]) + "\n\n" + text[:3000])


@pytest.mark.slow
@pytest.mark.timeout(3600)  # under RIPRESA_FAULTS_FULL=1 (make test-faults) it runs the whole matrix
def test_hostile_folders_sample(hostile_fixtures, tmp_path):
    """The default suite's sample of the matrix (or the whole matrix under RIPRESA_FAULTS_FULL=1)."""
    cases = hf.all_cases(hostile_fixtures)
    chosen = hf.only_fixtures(cases if FULL else hf.sample_cases(cases))
    _run_and_check(chosen, hostile_fixtures, tmp_path, workers=2,
                   title="(full matrix)" if FULL else "(default-suite sample)")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_hostile_folders_matrix(hostile_fixtures, tmp_path):
    """The whole matrix: every fixture file x every mutation, each run by the commands that read it."""
    if FULL:
        pytest.skip("the sample test already ran the whole matrix (RIPRESA_FAULTS_FULL=1)")
    _run_and_check(hf.only_fixtures(hf.all_cases(hostile_fixtures)), hostile_fixtures, tmp_path, workers=2,
                   title="(full matrix)")


@pytest.mark.skipif(not os.environ.get("RIPRESA_FUZZ_CASE"), reason="set RIPRESA_FUZZ_CASE to replay one case")
def test_replay_one_case(hostile_fixtures, tmp_path):
    case = hf.find_case(os.environ["RIPRESA_FUZZ_CASE"], hf.all_cases(hostile_fixtures))
    outcome = hf.run_cases([case], hostile_fixtures, tmp_path)[0]
    print(outcome.line(), "\n", outcome.stderr_tail)
    assert outcome.ok, outcome.line() + "\n" + outcome.stderr_tail


def test_round_two_attacks_are_real(tmp_path):
    """The default suite's cheap check of the fuzzer's own issue-#19 machinery (no fixture to build):

    * the shard-swap watcher replaces a file right after a process first closes it, so a second open by
      path reads the foreign bytes (the attack on a load that re-opens what it hashed);
    * a planted ``ripresa/`` package runs when a child is started with ``python -m ripresa`` in the folder,
      and does not under ``-P`` (how the fuzzer starts the command itself): a canary case that fails is
      ripresa's child, never the fuzzer's own start.
    """
    import random
    import subprocess
    import sys

    target, side = tmp_path / "shard.distcp", tmp_path / "side"
    side.mkdir()
    target.write_bytes(b"genuine")
    (side / "foreign").write_bytes(b"foreign")
    fired: list[str] = []
    # the reader holds the file open a while, as a real shard read does (the watcher polls /proc)
    reader = ("import sys, time\np = sys.argv[1]\nf = open(p, 'rb')\nfirst = f.read()\ntime.sleep(0.3)\nf.close()\n"
              "time.sleep(0.5)\nsecond = open(p, 'rb').read()\nprint(first.decode(), second.decode())")
    logs = tmp_path / "logs"
    logs.mkdir()
    rc, hung, _rss, so, _se = hf.run_argv([sys.executable, "-c", reader, str(target)], tmp_path, dict(os.environ),
                                          logs, 30, hf._swap_watcher(target, side / "foreign", fired))
    assert rc == 0 and not hung and fired, (rc, so, fired)
    assert so.split() == ["genuine", "foreign"], so

    ctx = hf.Ctx(tmp_path, tmp_path / "p", "t", tmp_path / "canary" / "PWNED", fx=None)  # type: ignore[arg-type]
    folder = tmp_path / "run"
    folder.mkdir()
    hf.m_plant_package(folder, "ripresa/", random.Random(0), ctx)
    env = hf._env()
    guarded = subprocess.run([*hf.RIPP, "--version"], cwd=folder, env=env, capture_output=True, text=True, timeout=60)
    assert guarded.returncode == 0 and "ripresa" in guarded.stdout and not ctx.canary.parent.exists()
    naive = subprocess.run([sys.executable, "-m", "ripresa", "--version"], cwd=folder, env=env, capture_output=True,
                           text=True, timeout=60)
    assert naive.returncode != 0 and ctx.canary.parent.exists(), naive.stdout + naive.stderr
