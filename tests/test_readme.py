"""The README's commands and examples are run, so they cannot rot — and so are those of the docs/ pages its
reference material moved to (docs/API.md, docs/ENGINE.md, docs/OPERATIONS.md, docs/VERIFY.md).

A newcomer's path is walked too: the README's own loop saved as a script, SIGKILLed, started again with the
command the README shows, then ``ripresa plot`` of it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, run

README = (REPO / "README.md").read_text()
#: The README and the pages its reference material moved to: their commands and examples are kept working.
PAGES = {name: (REPO / name).read_text() for name in
         ("README.md", "docs/API.md", "docs/ENGINE.md", "docs/OPERATIONS.md", "docs/VERIFY.md")}
#: The pages whose python blocks are whole programs (each is run).
PROGRAMS = ("README.md", "docs/API.md")


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_opens_with_the_two_commands():
    first_sh = _blocks("sh")[0]
    assert "make demo" in first_sh and "make test" in first_sh
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "torch==2.13.0" in makefile
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci
    # ... then how to get the command, then the three ways in, each linking its page in docs/
    assert ".venv/bin/ripresa" in README and "source .venv/bin/activate" in README
    for page in ("docs/API.md", "docs/INTEGRATIONS.md", "docs/ENGINE.md", "docs/VERIFY.md"):
        assert f"]({page}" in README, page
    assert len(README.splitlines()) < 300  # a newcomer's page; the reference lives in docs/


def test_readme_python_examples_run(tmp_path):
    ran = 0
    for page in PROGRAMS:
        blocks = _blocks("python", PAGES[page])
        assert blocks, f"{page} has no python example"
        for i, code in enumerate(blocks):
            work = tmp_path / f"{page.replace('/', '_')}_{i}"
            work.mkdir()
            script = work / "example.py"
            script.write_text(code)
            res = run([sys.executable, str(script)], cwd=work, env={"OMP_NUM_THREADS": "1"})
            assert res.returncode == 0, f"{page} python block {i} failed:\n{res.stdout}\n{res.stderr}"
            assert "bit-identical" in res.stdout or "generations:" in res.stdout
            if page == "README.md" and "runs/mine" in code:
                assert "generations: [100, 200, 300]" in res.stdout
            ran += 1
    assert ran >= 4  # the README's loop; saving by hand and the two exact loaders of docs/API.md


def _help_text(command: str) -> str:
    """The ``--help`` of one subcommand (``generate`` has its own parser, in engine/ledger.py)."""
    from ripresa import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        if command == "generate":
            from ripresa.engine.ledger import main as ledger_main

            ledger_main(["--help"])
        else:
            cli.build_parser().parse_args([*command.split(), "--help"])
    return out.getvalue()


def _ripresa_lines() -> list[tuple[str, list[str]]]:
    """Every ``ripresa ...`` command of the pages' sh blocks: (page, argv from the subcommand on)."""
    found = []
    for page, text in PAGES.items():
        for block in _blocks("sh", text):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip()
                try:
                    tokens = shlex.split(line)
                except ValueError:
                    continue
                at = next((i for i, t in enumerate(tokens) if os.path.basename(t) == "ripresa"), None)
                if at is None or (at > 0 and tokens[at - 1] not in ("-m", "--")):
                    continue
                argv = tokens[at + 1:]
                if "--" in argv:  # the trainer's command after `ripresa verify ... --`
                    argv = argv[: argv.index("--")]
                if argv and not argv[0].startswith("-"):
                    found.append((page, argv))
    return found


def test_every_ripresa_command_of_the_pages_names_real_options():
    """Each ``ripresa`` line of the README and the moved pages: a real command, and options it really has."""
    from ripresa import cli

    cli.build_parser()
    checked = 0
    helps: dict[str, str] = {}
    for page, argv in _ripresa_lines():
        command = argv[0]
        assert command in cli._COMMANDS, f"{page}: unknown command {command!r} in {argv}"
        if command == "mirror":
            command = f"mirror {argv[1]}"
        text = helps.setdefault(command, _help_text(command))
        for token in argv[1:]:
            opt = token.strip("[]").split("=")[0]
            if opt.startswith("--"):
                assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), f"{page}: {command} has no {opt}"
        checked += 1
    assert checked >= 40, checked


def test_make_demo_runs_the_main_job(tmp_path):
    """`make demo` (the .venv already exists here, so it only runs the job)."""
    out = tmp_path / "demo"
    env = dict(os.environ, COLUMNS="200")
    res = subprocess.run(["make", "-s", "demo", f"DEMO_OUT={out}"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=env)
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
    # The README describes both parts, as the demo names them.
    assert "1/2 · " in res.stdout and "2/2 · the ANDREA engine" in res.stdout
    assert "**1/2 · the proof.**" in README and "**2/2 · the ANDREA engine.**" in README
    # Its last line is a command that works in the shell that ran `make demo` (the ripresa on its PATH, if any).
    tried = next(line.strip()[4:].strip() for line in res.stdout.splitlines() if line.strip().startswith("try:"))
    assert tried.endswith(f"inspect {out / 'gpt'}"), tried
    res = subprocess.run(tried, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, f"{tried}:\n{res.stdout}\n{res.stderr}"


def _own_loop() -> tuple[str, list[str]]:
    """The README's own loop (the python block of "Your own loop") and the sh lines shown right after it."""
    at = README.index("### 1. Your own loop")
    section = README[at: README.index("### 2.", at)]
    code = _blocks("python", section)[0]
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in _blocks("sh", section)[0].splitlines()]
    return code, [line for line in lines if line]


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    assert argv[0] == "ripresa", line
    return [sys.executable, "-m", "ripresa", *argv[1:]]


def _weights(run_dir, step: int) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(str(run_dir / f"step_{step:06d}.safetensors"))
    return {k: v for k, v in tensors.items() if k.startswith(("model/", "optimizer/"))}


@pytest.mark.slow
def test_a_newcomer_kills_and_resumes_their_own_loop_then_plots(tmp_path):
    """Only what the README shows: its loop saved as train.py, SIGKILLed mid-run, the same command again, then
    `ripresa plot` — it ends with the weights and moments of a run never interrupted."""
    import torch

    code, shown = _own_loop()
    start = next(line for line in shown if line.startswith("python "))
    plot = next(line for line in shown if line.startswith("ripresa plot "))
    run_dir = plot.split()[-1]
    env = {"OMP_NUM_THREADS": "1"}
    for name in ("ref", "me"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.py").write_text(code)
    ref = run(_argv(start), cwd=tmp_path / "ref", env=env)
    assert ref.returncode == 0 and "generations: [100, 200, 300]" in ref.stdout, ref.stderr

    # A slow machine (every step takes 20 ms more), so that the SIGKILL lands mid-run, after the first generation.
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import time, ripresa\n"
        "_done = ripresa.Checkpointer.step_done\n"
        "def step_done(self, *a, **k):\n"
        "    time.sleep(0.02)\n"
        "    return _done(self, *a, **k)\n"
        "ripresa.Checkpointer.step_done = step_done\n")
    me = tmp_path / "me"
    proc = subprocess.Popen(_argv(start), cwd=me, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=f"{slow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                                     PYTHONDONTWRITEBYTECODE="1", **env))
    marker = me / run_dir / "step_000100.safetensors.sha256"
    t0 = time.monotonic()
    while not marker.exists() and proc.poll() is None and time.monotonic() - t0 < 240:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the loop ended before it could be killed"
    assert not (me / run_dir / "step_000300.safetensors.sha256").exists()

    again = run(_argv(start), cwd=me, env=env)  # the same command
    assert again.returncode == 0 and "generations: [100, 200, 300]" in again.stdout, again.stderr
    history = [json.loads(line) for line in (me / run_dir / ".loss.jsonl").read_text().splitlines()]
    assert [e["from_step"] for e in history if e.get("event") == "resume"] == [100]
    a, b = _weights(tmp_path / "ref" / run_dir, 300), _weights(me / run_dir, 300)
    assert a.keys() == b.keys() and len(a) > 4 and all(torch.equal(a[k], b[k]) for k in a)

    res = run(_argv(plot), cwd=me, env=env)
    assert res.returncode == 0, res.stderr
    png = me / run_dir / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_readme_exercise_commands(tmp_path):
    """The per-path commands of the reference exercise (docs/VERIFY.md), run as written (in a scratch folder)."""
    block = next(b for text in PAGES.values() for b in _blocks("sh", text) if "python -B train.py" in b)
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
