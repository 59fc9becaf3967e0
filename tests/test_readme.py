"""The README's commands and examples are run, so they cannot rot."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, run

README = (REPO / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_the_two_commands():
    first_sh = _blocks("sh")[0]
    assert "make demo" in first_sh and "make test" in first_sh
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "torch==2.13.0" in makefile
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci


def test_readme_python_examples_run(tmp_path):
    blocks = _blocks("python")
    assert blocks, "the README has no python example"
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(code)
        res = run([sys.executable, str(script)], cwd=tmp_path)
        assert res.returncode == 0, f"README python block {i} failed:\n{res.stdout}\n{res.stderr}"
        assert "bit-identical" in res.stdout or "generations:" in res.stdout
    assert "generations: [100, 200, 300]" in res.stdout


def test_make_demo_runs_the_main_job(tmp_path):
    """`make demo` (the .venv already exists here, so it only runs the job)."""
    out = tmp_path / "demo"
    res = subprocess.run(["make", "-s", "demo", f"DEMO_OUT={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "agrees within 1e-12" in res.stdout and "divergence detected" in res.stdout
    report = json.loads((out / "verify" / "verification.json").read_text())
    assert report["all_checks_passed"] is True
    # The engine's cycle: a SIGUSR1 generation off the cadence, a SIGTERM stop, a resume.
    assert "sent SIGUSR1" in res.stdout and "sent SIGTERM" in res.stdout and "exit code 0" in res.stdout
    assert "resumed" in res.stdout
    events = [json.loads(line) for line in (out / "gpt" / ".loss.jsonl").read_text().splitlines() if '"event"' in line]
    kinds = [e["event"] for e in events]
    assert "signal" in kinds and "resume" in kinds and kinds.count("checkpoint") >= 4


@pytest.mark.slow
def test_readme_exercise_commands(tmp_path):
    """The per-path commands of the README, run as written (in a scratch copy of the folder)."""
    block = next(b for b in _blocks("sh") if "python -B train.py" in b)
    cmds = [line.strip() for line in block.splitlines() if line.strip().startswith("python -B train.py")]
    assert len(cmds) == 4
    for line in cmds:
        argv = line.split()
        argv[0] = sys.executable
        argv[2] = str(REPO / "examples" / "regression" / "train.py")
        res = run(argv, cwd=tmp_path)
        assert res.returncode == 0, line + "\n" + res.stderr
    cont = json.loads((tmp_path / "runs/continuous/summary.json").read_text())
    resumed = json.loads((tmp_path / "runs/resume/summary.json").read_text())
    assert cont["final"]["parameters"] == resumed["final"]["parameters"]
