"""Issue 29, "Small things a newcomer met" (round 3): each reproduced on main, each fixed and kept fixed here.

1. a hyper-parameter changed in the script is named on resume (the checkpoint's wins, or ``hyperparameters="script"``);
2. the README's loop, SIGKILLed or SIGTERMed and run again, ends with its last generation's files byte-identical
   (sha256) to a run never interrupted; the optimizer state is saved in one canonical order;
3. a ripresa error that ends a user's script prints one paragraph (no traceback) and exits with its code;
4. a mistyped option names the nearest ones;
5. printed lines fit 80 columns and no token (a number, a path, a hash) is split;
6. the framework snippets of docs/INTEGRATIONS*.md are whole scripts (examples/integrations/) that run and resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import REPO, run

import ripresa

README = (REPO / "README.md").read_text()


def _own_loop() -> str:
    at = README.index("### 1. Your own loop")
    return re.findall(r"```python\n(.*?)```", README[at: README.index("### 2.", at)], flags=re.S)[0]


# ---------------------------------------------------------------------------------- 1. hyper-parameters
def _session(run_dir: Path, lr: float, side: str | None = None, steps: int = 3, scheduler: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if scheduler else None
    kw = {} if side is None else {"hyperparameters": side}
    ckpt = ripresa.Checkpointer(run_dir, ripresa.TrainingState(model=model, optimizer=opt, scheduler=sched), every=0,
                                handle_signals=False, asynchronous=False, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ckpt.resume()
    for step in range(start + 1, start + steps + 1):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        if sched is not None:
            sched.step()
        ckpt.step_done(step)
    lr_used = opt.param_groups[0]["lr"] if sched is None else opt.param_groups[0]["initial_lr"]
    ckpt.close()
    hyper = [str(w.message) for w in caught if w.category.__name__ == "HyperparameterWarning"]
    return start, lr_used, hyper, ckpt


def _events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / ".loss.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def test_a_changed_lr_is_named_and_the_checkpoint_wins_by_default(tmp_path):
    _session(tmp_path, 1e-3)
    start, lr, hyper, _ = _session(tmp_path, 3e-4)
    assert start == 3 and lr == 1e-3  # the checkpoint's value, as before: an exact resume
    assert len(hyper) == 1 and "lr 0.001 -> 0.0003" in hyper[0] and 'hyperparameters="script"' in hyper[0], hyper
    assert "weight_decay" not in hyper[0]  # only what changed
    (event,) = _events(tmp_path, "hyperparameter_change")
    assert event["used"] == "checkpoint" and [c["key"] for c in event["changes"]] == ["lr"]


def test_hyperparameters_script_applies_the_scripts_value_and_records_it(tmp_path):
    _session(tmp_path, 1e-3)
    start, lr, hyper, _ = _session(tmp_path, 3e-4, "script")
    assert start == 3 and lr == 3e-4 and hyper == []  # chosen explicitly: no warning, but recorded
    (event,) = _events(tmp_path, "hyperparameter_change")
    assert event["used"] == "script" and event["changes"][0]["checkpoint"] == "0.001"


def test_an_unchanged_script_and_a_scheduled_lr_say_nothing(tmp_path):
    _session(tmp_path / "a", 1e-3)
    assert _session(tmp_path / "a", 1e-3)[2] == []
    _session(tmp_path / "b", 1e-3, scheduler=True)  # the group's lr is the scheduler's: not a change of the script
    assert _session(tmp_path / "b", 1e-3, scheduler=True)[2] == []
    hyper = _session(tmp_path / "b", 5e-4, scheduler=True)[2]  # the base rate changed: initial_lr names it
    assert len(hyper) == 1 and "initial_lr 0.001 -> 0.0005" in hyper[0]
    assert _session(tmp_path / "a", 2e-3, "loop")[1:3] == (1e-3, [])  # the loop sets its own after resume()
    assert len(_events(tmp_path / "a", "hyperparameter_change")) == 0
    with pytest.raises(ValueError, match="hyperparameters"):
        ripresa.Checkpointer(tmp_path / "c", ripresa.TrainingState(model=torch.nn.Linear(1, 1)), hyperparameters="mine")


# ---------------------------------------------------------------------------------- 2. the same bytes
def test_optimizer_state_is_saved_in_one_order_whatever_order_it_was_built_in(tmp_path):
    """A parameter that first gets a gradient at step 2 gets its optimizer state after the others: the
    generation still lists the state by parameter index, each entry's keys sorted (a restored state, built
    in the saved order, then writes the same bytes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    for first in (True, False):
        opt.zero_grad()
        (model[1](x) if first else model(x)).pow(2).mean().backward()
        opt.step()
    assert list(opt.state_dict()["state"]) == [2, 3, 0, 1]  # as torch built it
    ckpt = ripresa.Checkpointer(tmp_path, ripresa.TrainingState(model=model, optimizer=opt), every=0,
                                handle_signals=False)
    ckpt.resume()
    ckpt.step_done(2)
    ckpt.close()
    pairs = json.loads((tmp_path / "step_000002.safetensors.json").read_text())["state"]["optimizer"]["state"]["__dict__"]
    assert [i for i, _ in pairs] == [0, 1, 2, 3]
    assert all(list(entry) == sorted(entry) for _, entry in pairs)


def _sha256s(run_dir: Path, step: int) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run_dir.glob(f"step_{step:06d}*"))}


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_the_readme_loop_interrupted_and_run_again_ends_with_the_same_bytes(tmp_path, sig):
    """The README's loop as written, run through; and run again after a real signal at step 150 (a SIGKILL loses
    steps 101-150, a SIGTERM saves step 150): sha256 of every file of generation 300 is the same."""
    code = _own_loop()
    env = {"OMP_NUM_THREADS": "1"}
    for name in ("ref", "me"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.py").write_text(code)
    ref = run([sys.executable, "train.py"], cwd=tmp_path / "ref", env=env)
    assert ref.returncode == 0, ref.stderr
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # the signal, sent by the process to itself after step 150
        "import os, signal, ripresa\n"
        "_done = ripresa.Checkpointer.step_done\n"
        "def step_done(self, step, **k):\n"
        f"    if step == 150: os.kill(os.getpid(), signal.{sig})\n"
        "    return _done(self, step, **k)\n"
        "ripresa.Checkpointer.step_done = step_done\n")
    cut = run([sys.executable, "train.py"], cwd=tmp_path / "me", env={**env, "PYTHONPATH": str(hook)})
    assert cut.returncode == (-9 if sig == "SIGKILL" else 0), cut.stderr
    again = run([sys.executable, "train.py"], cwd=tmp_path / "me", env=env)
    assert again.returncode == 0, again.stderr
    resumed = [e["from_step"] for e in _events(tmp_path / "me" / "runs/mine", "resume")]
    assert resumed == [100 if sig == "SIGKILL" else 150]
    a, b = _sha256s(tmp_path / "ref" / "runs/mine", 300), _sha256s(tmp_path / "me" / "runs/mine", 300)
    assert sorted(a) == ["step_000300.safetensors", "step_000300.safetensors.json", "step_000300.safetensors.sha256"]
    assert a == b


# ---------------------------------------------------------------------------------- 3. errors in a script
SCRIPT = """
import torch, ripresa
ckpt = ripresa.Checkpointer({run!r}, ripresa.TrainingState(model=torch.nn.Linear(2, 1)))
ckpt.resume()
"""


def test_a_second_process_on_a_locked_run_prints_one_paragraph_and_exits_2(tmp_path):
    held = ripresa.Checkpointer(tmp_path / "run", ripresa.TrainingState(model=torch.nn.Linear(2, 1)),
                                handle_signals=False)
    try:
        (tmp_path / "train.py").write_text(SCRIPT.format(run=str(tmp_path / "run")))
        res = run([sys.executable, "train.py"], cwd=tmp_path, env={"RIPRESA_DEBUG": ""})
    finally:
        held.abort()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stderr.startswith("ripresa train.py: error: "), res.stderr
    assert "locked" in res.stderr and "ripresa.errors.LockHeld, exit 2" in res.stderr
    assert all(line.startswith("  ") for line in res.stderr.splitlines()[1:]), res.stderr  # one paragraph


BATCH = """
import numpy as np, torch, ripresa
sampler = ripresa.EpochSampler(64, {batch}, generator=np.random.default_rng(0))
state = ripresa.TrainingState(model=torch.nn.Linear(2, 1), data=sampler)
ckpt = ripresa.Checkpointer({run!r}, state, every=1)
start = ckpt.resume()
ckpt.step_done(start + 1)
ckpt.close()
"""


def test_a_changed_batch_size_prints_one_line_per_generation_and_one_paragraph(tmp_path):
    exec(BATCH.format(batch=16, run=str(tmp_path / "run")), {})  # noqa: S102 - generation 1, batch size 16
    (tmp_path / "train.py").write_text(BATCH.format(batch=8, run=str(tmp_path / "run")))
    res = run([sys.executable, "train.py"], cwd=tmp_path, env={"RIPRESA_DEBUG": ""})
    assert res.returncode == 1, res.stderr  # SchemaError: a check failed
    lines = res.stderr.splitlines()
    assert "Traceback" not in res.stderr and "warnings.warn" not in res.stderr and "Warning:" not in res.stderr
    assert lines[0].startswith("ripresa train.py: warning: .safetensors generation 1 not used: data position was "
                               "saved with batch_size=16"), res.stderr
    assert lines[1].startswith("ripresa train.py: error: data position was saved with batch_size=16")
    assert lines[-1] == "  raised:   ripresa.errors.SchemaError, exit 1 (RIPRESA_DEBUG=1: the traceback)"


def test_script_hooks_render_ripresa_warnings_in_one_line_and_leave_others_alone(tmp_path):
    from ripresa import console
    from ripresa.store.store import CheckpointWarning

    old_hook, old_format = sys.excepthook, warnings.formatwarning
    try:
        console.install_script_hooks()
        own = warnings.formatwarning("generation 3 not used: sha256 mismatch", CheckpointWarning, __file__, 1)
        assert re.match(r"ripresa \S+: warning: generation 3 not used: sha256 mismatch\n$", own), own
        other = warnings.formatwarning("something else", UserWarning, __file__, 7)
        assert "UserWarning: something else" in other  # Python's own format for another package's warning
        with pytest.warns(CheckpointWarning, match="still recorded"):  # recording is untouched
            ripresa.Checkpointer(tmp_path, ripresa.TrainingState(model=torch.nn.Linear(1, 1)), handle_signals=False).abort()
            warnings.warn("still recorded", CheckpointWarning, stacklevel=1)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as ended:
            sys.excepthook(ripresa.IntegrityError, ripresa.IntegrityError("bad", file="x"), None)
        assert ended.value.code == 1 and "Traceback" not in err.getvalue() and "file:     x" in err.getvalue()
    finally:
        sys.excepthook, warnings.formatwarning = old_hook, old_format


# ---------------------------------------------------------------------------------- 4. option typos
def _cli(*argv: str) -> tuple[int, str, str]:
    from ripresa.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, near", [
    (["train", "--stpes", "600"], "--steps"),
    (["train", "--run", "r", "--evrey=5"], "--every"),
    (["inspect", "x", "--jsno"], "--json"),
    (["advise", "r", "--mtfb", "1h"], "--mtbf"),
    (["generate", "r", "--inptus", "p.txt"], "--inputs"),
])
def test_a_mistyped_option_names_the_nearest(argv, near):
    code, _, err = _cli(*argv)
    assert code == 2 and "usage:" not in err, err
    assert f"did you mean {near}" in err and f"ripresa {argv[0]}: error: unknown option" in err, err
    assert max(map(len, err.splitlines())) <= 80, err  # the refusal fits a terminal, not a 300-column option list


def test_a_mistyped_command_names_the_nearest():
    code, _, err = _cli("inpsect", "x")
    assert code == 2 and "did you mean 'inspect'" in err


# ---------------------------------------------------------------------------------- 5. 80 columns
def _fits(text: str, width: int = 80) -> None:
    """No line longer than ``width`` but a single token on its own line."""
    for line in text.splitlines():
        if len(line) > width:
            assert len(line.split()) == 1, f"{len(line)} columns: {line!r}"


def test_wrap_words_breaks_at_spaces_only():
    from ripresa.text import wrap_words

    text = "checkpoint every 100 → " + "runs/" + "x" * 90 + " and " + "a" * 64 + " done"
    out = wrap_words(text, 80)
    _fits(out)
    assert out.split() == text.split()  # every token whole, in order
    assert wrap_words("  indented " + "w " * 60, 40).splitlines()[1].startswith("  w")


@pytest.fixture
def short_run(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    run_dir = tmp_path / ("a_rather_long_folder_name_for_runs_" * 3) / "mine"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = ripresa.Checkpointer(run_dir, ripresa.TrainingState(model=model, optimizer=opt), every=10,
                                handle_signals=False)
    ckpt.resume()
    for step in range(1, 31):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        time.sleep(0.004)  # a step the history's millisecond clock measures (advise reads it)
        ckpt.step_done(step, loss=0.0)
    ckpt.close()
    return run_dir


def test_inspect_and_advise_fit_80_columns_without_splitting_a_token(short_run):
    code, out, err = _cli("inspect", str(short_run))
    assert code == 0, err
    _fits(out)
    assert str(short_run) in out.split()  # the path whole, as one token
    code, out, err = _cli("advise", str(short_run))
    assert code == 0, err
    _fits(out)
    assert str(short_run) + ":" in out.split() and "round(√(2·stall·MTBF)" in out.split()


@pytest.mark.slow
def test_train_header_and_generate_fit_80_columns(tmp_path):
    env = {"COLUMNS": "80"}
    run_dir = tmp_path / ("a_rather_long_folder_name_for_runs_" * 2)
    res = run([sys.executable, "-m", "ripresa", "train", "--run", str(run_dir), "--config", "tiny", "--steps", "4",
               "--every", "100", "--quiet", "--no-audit"], env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("ripresa train:"))
    last = next(i for i in range(first, len(lines)) if lines[i].split()[-1:] == [str(run_dir)])
    header = "\n".join(lines[first: last + 1])  # the header, wrapped: its path whole on the last line
    _fits(header)
    assert "every 100 →" in " ".join(header.split()) and header.split()[:3] == ["ripresa", "train:", "tiny"]
    (tmp_path / "p.txt").write_text("hello\nworld\n")
    res = run([sys.executable, "-m", "ripresa", "generate", str(run_dir), "--inputs", str(tmp_path / "p.txt"),
               "--out", str(tmp_path / "o.jsonl"), "--quiet"], env=env)
    assert res.returncode == 0, res.stderr
    _fits(res.stdout)
    report = json.loads(res.stdout)
    assert report["total"] == 2 and len(report["bin_sha256"]) == 64
    assert report["bin_sha256"] in [token.strip('",') for token in res.stdout.split()]  # whole, on its own line


# ---------------------------------------------------------------------------------- 6. framework scripts
EXAMPLES = REPO / "examples" / "integrations"
SCRIPTS = {"lightning": ("lightning_train.py", "docs/INTEGRATIONS_lightning.md"),
           "transformers": ("hf_trainer_train.py", "docs/INTEGRATIONS_transformers.md"),
           "accelerate": ("accelerate_train.py", "docs/INTEGRATIONS.md")}


def test_each_integration_page_points_to_its_whole_script():
    for script, page in SCRIPTS.values():
        text = (REPO / page).read_text()
        assert f"examples/integrations/{script}" in text, (page, script)
        assert (EXAMPLES / script).is_file()
        assert "ExactResume(run_dir, every=20)" in (EXAMPLES / script).read_text() or script.startswith("accelerate")


def _run_example(script: str, cwd: Path, steps: int, env: dict | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, str(EXAMPLES / script), "runs/x", str(steps)], cwd=cwd,
               env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=600)


def test_the_lightning_script_runs_as_written(tmp_path):
    res = _run_example("lightning_train.py", tmp_path, 20)
    assert res.returncode == 0, res.stderr
    assert "generations: [20]" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("framework", sorted(SCRIPTS))
def test_each_integration_script_resumes_bitwise_after_a_sigkill(tmp_path, framework):
    script = SCRIPTS[framework][0]
    for name in ("ref", "me"):
        (tmp_path / name).mkdir()
    ref = _run_example(script, tmp_path / "ref", 40)
    assert ref.returncode == 0 and "generations: [20, 40]" in ref.stdout, ref.stderr
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # a real SIGKILL after step 30: the last generation is step 20
        "import os, signal\n"
        "import ripresa.session.checkpointer as c\n"
        "_done = c.Checkpointer.step_done\n"
        "def step_done(self, step, **k):\n"
        "    if step == 30: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _done(self, step, **k)\n"
        "c.Checkpointer.step_done = step_done\n")
    cut = _run_example(script, tmp_path / "me", 40, {"PYTHONPATH": str(hook)})
    assert cut.returncode == -9, cut.stderr
    again = _run_example(script, tmp_path / "me", 40)
    assert again.returncode == 0, again.stderr
    assert [e["from_step"] for e in _events(tmp_path / "me" / "runs/x", "resume")] == [20]
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "ref" / "runs/x" / "step_000040.safetensors"))
    b = load_file(str(tmp_path / "me" / "runs/x" / "step_000040.safetensors"))
    keys = [k for k in a if k.startswith(("model/", "optimizer/"))]
    assert keys and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in keys)
