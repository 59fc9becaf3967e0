"""The resume verifier on the reference exercise, and on deliberately broken resumes."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import FIXTURES, REPO, TRAIN, ripresa_cli, run


@pytest.mark.slow
def test_verify_resume_script_passes_on_the_exercise(tmp_path):
    out = tmp_path / "proof"
    res = run([sys.executable, "-B", str(REPO / "examples/regression/verify_resume.py"), "--output", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((out / "verification.json").read_text())
    assert report["all_checks_passed"] is True
    assert report["positive"] is True
    assert report["negative_divergence_detected"] is True
    assert report["tolerance"] == {"absolute": 1e-12, "relative": 0.0}
    checks = {c["name"]: c for c in report["checks"]["resume"]}
    for name in ("rows", "lr", "loss", "parameters", "optimizer", "scheduler", "progress", "next_draws", "evaluation", "data"):
        assert checks[name]["passed"] and checks[name]["max_abs_gap"] == 0.0, name
        assert checks[name]["values_compared"] > 0, name
    neg = {c["name"]: c for c in report["checks"]["resume-without-rng"]}
    assert not neg["parameters"]["passed"] and neg["parameters"]["max_abs_gap"] > 1e-6
    assert not neg["next_draws"]["passed"]
    assert "versions" in report and report["versions"]["torch"]
    # The seed's facts about the exercise.
    cont = json.loads((out / "continuous" / "summary.json").read_text())
    inter = json.loads((out / "interrupted" / "summary.json").read_text())
    assert inter["final"]["data"]["cursor"] == 20 and inter["final"]["data"]["n_rows"] == 24
    assert sum(len(s["rows"]) for s in cont["steps"]) == 40
    assert cont["final"]["data"]["epoch"] == 1  # crossed into a new permutation
    assert cont["final"]["next_lr"] == [0.00375]
    n_params = sum(len(v) if isinstance(v[0], float) else sum(len(r) for r in v) for v in cont["final"]["parameters"].values())
    assert n_params == 33
    for path in ("continuous", "interrupted", "resume", "resume-without-rng"):
        assert (out / path / "checkpoint.pt").is_file() and (out / path / "checkpoint.pt.sha256").is_file()
    assert "agrees within 1e-12" in res.stdout and "divergence detected" in res.stdout


@pytest.mark.slow
def test_ripresa_verify_with_explicit_command(tmp_path):
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--contract", "--steps", "10", "--cut", "5", "--output", out, "--", sys.executable, "-B", str(TRAIN))
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((out / "verification.json").read_text())["all_checks_passed"] is True


@pytest.mark.parametrize(
    ("fault", "first_part"),
    [
        # `make test-long` runs them all; the default suite's broken resume is the steered negative control
        pytest.param("scheduler", "scheduler at the cut", marks=pytest.mark.slow),
        pytest.param("optimizer", "optimizer at the cut", marks=pytest.mark.slow),
        pytest.param("reseed", "next_draws at the cut", marks=pytest.mark.slow),
        pytest.param("cursor", "data at the cut", marks=pytest.mark.slow),
        pytest.param("scheduler-order", "optimizer at the cut: optimizer.param_groups[0].lr", marks=pytest.mark.slow),
    ],
)
def test_broken_resumes_are_caught(tmp_path, fault, first_part):
    out = tmp_path / fault
    res = ripresa_cli("verify", "--contract", "--output", out, "--", sys.executable, "-B", str(FIXTURES / "faulty_regression.py"), "--fault", fault)
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads((out / "verification.json").read_text())
    assert report["positive"] is False and report["all_checks_passed"] is False
    assert report["first_divergence"]["resume"].startswith(first_part), report["first_divergence"]["resume"]
    assert "first divergence of the full resume" in res.stdout


@pytest.mark.slow
def test_existing_output_folder_is_refused(tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    res = ripresa_cli("verify", "--output", out)
    assert res.returncode == 2
    assert "already exists" in res.stderr and str(out) in res.stderr
    assert (out / "keep.txt").read_text() == "precious" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.slow
def test_failing_trainer_makes_verification_incomplete(tmp_path):
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--output", out, "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert res.returncode == 2
    assert "continuous path failed (exit 3)" in res.stderr or "interrupted path failed (exit 3)" in res.stderr


def test_bad_cut_is_bad_input(tmp_path):
    res = ripresa_cli("verify", "--steps", "4", "--cut", "4", "--output", tmp_path / "v")
    assert res.returncode == 2 and "cut" in res.stderr
    assert not (tmp_path / "v").exists()


def test_the_same_infinity_is_equal_and_nan_never_is():
    """A "best so far" that starts at inf compares equal at tolerance 0; NaN, or inf against -inf, fails."""
    from ripresa.verify.compare import compare_trees

    inf, nan = float("inf"), float("nan")
    assert compare_trees({"best": inf, "w": [1.0, -inf]}, {"best": inf, "w": [1.0, -inf]}, atol=0.0).equal
    for a, b in ((inf, -inf), (inf, 1e308), (nan, nan), (nan, 1.0), (-inf, nan)):
        res = compare_trees({"best": a}, {"best": b}, atol=0.0)
        assert [d.kind for d in res.differences] == ["non-finite"], (a, b, res.differences)
