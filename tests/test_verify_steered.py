"""`ripresa verify` on scripts that use the Checkpointer and do not implement the contract (docs/VERIFY.md,
"Verifying a script that uses the Checkpointer, with no extra code"): real processes, tolerance 0."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import textwrap

import pytest
import torch
from conftest import EXAMPLES, ripresa_cli, run

import ripresa
from ripresa.errors import BadInput
from ripresa.session.steer import ENV, Steering
from ripresa.verify.trajectory import read_trajectory

#: A user loop: a sampler drawing row ids from torch's *global* generator (torch.randint), SGD with
#: momentum (so the general .safetensors format), a StepLR; it never touches Python's random or NumPy.
RANDINT_SCRIPT = textwrap.dedent('''
    import argparse, sys
    import torch
    import ripresa

    class RandintSampler:
        """Row ids from the global torch generator; its own state is only a batch counter."""
        def __init__(self, n, batch, generator=None):
            self.n, self.batch, self.generator, self.batches = n, batch, generator, 0
        def next_batch(self):
            self.batches += 1
            return torch.randint(0, self.n, (self.batch,), generator=self.generator)
        def state_dict(self):
            return {"batches": self.batches}
        def load_state_dict(self, state):
            self.batches = state["batches"]

    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--fault", choices=["none", "reseed", "unsaved-sampler"], default="none")
    args = ap.parse_args()

    torch.manual_seed(0)
    X = torch.randn(64, 4)
    Y = X.sum(1, keepdim=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if args.fault == "unsaved-sampler":   # its own generator, in neither the data nor the random streams
        sampler = RandintSampler(len(X), 8, generator=torch.Generator().manual_seed(7))
        state = ripresa.TrainingState(model=model, optimizer=opt, scheduler=sched)
    else:
        sampler = RandintSampler(len(X), 8)
        state = ripresa.TrainingState(model=model, optimizer=opt, scheduler=sched, data=sampler)
    ckpt = ripresa.Checkpointer(args.run, state, every=2)
    start = ckpt.resume()
    if args.fault == "reseed" and start:
        torch.manual_seed(start)          # the classic mistake: re-seeding instead of restoring
    for step in range(start + 1, args.steps + 1):
        ids = sampler.next_batch()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X[ids]), Y[ids])
        loss.backward()
        opt.step()
        sched.step()
        if ckpt.step_done(step, loss=loss.item()):
            break
    ckpt.close(final_save=True)
''')


def _report(out):
    return json.loads((out / "verification.json").read_text())


def _listing(folder):
    """Every entry under ``folder``: kind, size, mtime_ns and the content's sha256 (files)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
        out[str(p.relative_to(folder))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def test_verify_with_defaults_never_touches_the_scripts_own_run(tmp_path):
    """The one steered verification of the default suite: examples/loop/train.py made a script with a hard-coded
    run folder that ignores unknown options (so a contract attempt would run it as itself), verified with defaults."""
    real = tmp_path / "my-real-run"
    res = run([sys.executable, "-B", str(EXAMPLES / "loop" / "train.py"), "--run", str(real), "--steps", "4", "--every", "2"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(real.glob("step_*"))  # a real run with generations, history, lock file
    script = tmp_path / "train_mine.py"
    code = (EXAMPLES / "loop" / "train.py").read_text()
    code = code.replace('ap.add_argument("--run", required=True,', f'ap.add_argument("--run", default={str(real)!r},')
    code = code.replace("args = ap.parse_args()", "args, _unknown = ap.parse_known_args()")
    unseeded = code.replace("    random.seed(0)", "    pass  # unseeded").replace("    np.random.seed(0)\n", "")
    assert code.count(repr(str(real))) == 1 and "parse_known_args" in code and unseeded.count(".seed(0)") == 0
    code = unseeded  # a script that seeds neither Python's random nor NumPy's global stream (below)
    script.write_text(code)
    before = _listing(real)
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--steps", "6", "--cut", "3", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-B", str(script), "--steps", "2000", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _listing(real) == before  # nothing created, changed or removed in the user's run
    r = _report(out)
    assert r["all_checks_passed"] and r["positive"] and r["negative_divergence_detected"]
    assert r["mode"] == "steered" and r["tolerance"] == {"absolute": 0.0, "relative": 0.0}
    assert "contract_probe" not in r and not (out / "contract-probe").exists()
    # the script never seeds Python's random nor NumPy's global stream: reported, not compared
    assert r["streams_not_used"] == ["numpy_legacy", "python"]
    checks = {c["name"]: c for c in r["checks"]["resume"]}
    for name in ("loss", "lr", "data", "parameters", "optimizer", "scheduler", "progress", "next_draws", "evaluation"):
        assert checks[name]["passed"] and checks[name]["max_abs_gap"] == 0.0 and checks[name]["values_compared"] > 0, name
    assert r["first_divergence"]["resume"] is None
    assert r["first_divergence"]["resume-without-rng"].startswith("next_draws at the cut: next_draws.numpy:data")
    # every path ran the command unchanged, in its own run folder; the folder the script names is never touched
    assert all(p["argv"][-2:] == ["--steps", "2000"] for p in r["paths"].values())
    for path in ("continuous", "interrupted", "resume", "resume-without-rng"):
        assert list((out / path / "run").glob("step_*.safetensors")), path  # format="auto": the general format
    summary = json.loads((out / "interrupted" / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == [1, 2, 3] and summary["final"]["progress"]["step"] == 3
    assert summary["steps"][0]["data"]["cursor"] == 32  # the EpochSampler's position, per step
    resumed = json.loads((out / "resume" / "summary.json").read_text())
    assert [s["step"] for s in resumed["steps"]] == [4, 5, 6] and resumed["resumed_from"].endswith("step_000003.safetensors")
    assert "random streams not used" in res.stdout
    # the final state in one line: the two runs' last generations fingerprinted (docs/VERIFY.md)
    fs = r["final_state"]
    assert fs["same"] is True and fs["line"].startswith("same state: the final generations (step_000006")
    assert " ".join(fs["line"].split()) in " ".join(res.stdout.split())  # printed (rich wraps long lines)
    assert {"model", "optimizer", "rng", "data"} <= set(fs["parts"]) and fs["roots"][0] != fs["roots"][1]


@pytest.mark.slow
def test_a_randint_sampler_script_verifies_steered(tmp_path):
    script = tmp_path / "train_randint.py"
    script.write_text(RANDINT_SCRIPT)
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--steer", "--steps", "8", "--cut", "4", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-B", str(script), "--run", tmp_path / "never")
    assert res.returncode == 0, res.stdout + res.stderr
    r = _report(out)
    assert r["all_checks_passed"] and r["mode"] == "steered"
    assert r["streams_not_used"] == ["numpy_legacy", "python"]
    assert list((out / "interrupted" / "run").glob("step_*.safetensors"))  # SGD: the general format
    neg = {c["name"]: c for c in r["checks"]["resume-without-rng"]}
    assert not neg["next_draws"]["passed"] and not neg["loss"]["passed"]
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["reseed", "unsaved-sampler"])
def test_a_broken_resume_of_a_steered_script_is_caught(tmp_path, fault):
    script = tmp_path / "train_randint.py"
    script.write_text(RANDINT_SCRIPT)
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--steps", "8", "--cut", "4", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-B", str(script), "--run", "x", "--fault", fault, cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    r = _report(out)
    assert r["mode"] == "steered" and r["positive"] is False and r["all_checks_passed"] is False
    assert r["determinism_before_cut"]["passed"]
    # what the resumed process holds at the cut is what was saved; the first step after it differs
    assert r["first_divergence"]["resume"].startswith("loss step 5: "), r["first_divergence"]["resume"]
    assert "first divergence of the full resume" in res.stdout
    assert r["final_state"]["same"] is False and r["final_state"]["line"].startswith("different state: ")


def _state() -> ripresa.TrainingState:
    m = torch.nn.Linear(2, 1)
    return ripresa.TrainingState(model=m, optimizer=torch.optim.AdamW(m.parameters()))


@pytest.mark.parametrize("value", ["1", "{}", '{"schema": "ripresa.verify.steer/1"}',
                                   '{"schema": "other", "path": "p", "run_dir": "r", "output": "o", "stop_at": 1, "restore_rng": true}',
                                   '{"schema": "ripresa.verify.steer/1", "path": "p", "run_dir": "r", "output": "o", "stop_at": "1", "restore_rng": true}'])
def test_a_steering_variable_not_set_by_verify_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(BadInput, match=ENV):
        ripresa.Checkpointer(tmp_path / "run", _state(), every=0)
    assert not (tmp_path / "run").exists()


def test_steering_is_taken_once_and_redirects_the_run_folder(tmp_path, monkeypatch):
    steer = Steering("continuous", tmp_path / "steered", tmp_path / "out", stop_at=2)
    monkeypatch.setenv(ENV, steer.to_env()[ENV])
    ckpt = ripresa.Checkpointer(tmp_path / "named", _state(), every=0, asynchronous=False, handle_signals=False)
    assert ENV not in os.environ  # a process the script starts later is not steered
    assert ckpt.run_dir == tmp_path / "steered"
    assert ckpt.resume() == 0
    assert ckpt.step_done(1, loss=1.0) is False
    assert ckpt.step_done(2, loss=0.5) is True  # the steered stop: saved as on SIGTERM
    ckpt.close(final_save=True)
    doc = read_trajectory(tmp_path / "out" / "summary.json")
    assert [s["loss"] for s in doc["steps"]] == [1.0, 0.5] and doc["final"]["evaluation"] == {"last_loss": 0.5}
    assert list((tmp_path / "steered").glob("step_000002.*")) and not (tmp_path / "named").exists()
    # the next Checkpointer of the process is steered too, into a folder of its own, and records nothing
    other = ripresa.Checkpointer(tmp_path / "named", _state(), every=0, handle_signals=False)
    assert other.steering is not None and other.run_dir == tmp_path / "out" / "session-2"
    other.close()
    assert not (tmp_path / "named").exists()


@pytest.mark.slow
def test_contract_mode_does_not_fall_back_and_steer_mode_says_it_steered(tmp_path):
    cmd = [sys.executable, "-c", "import sys; sys.exit(3)"]
    res = ripresa_cli("verify", "--contract", "--output", tmp_path / "c", "--", *cmd)
    assert res.returncode == 2 and "path failed (exit 3)" in res.stderr and "steered" not in res.stderr
    assert not (tmp_path / "c" / "contract-probe").exists()
    res = ripresa_cli("verify", "--steer", "--output", tmp_path / "s", "--", *cmd)
    assert res.returncode == 2 and "path failed (exit 3)" in res.stderr and f"steered: {ENV}=" in res.stderr


def test_a_steered_command_without_a_checkpointer_is_incomplete(tmp_path):
    res = ripresa_cli("verify", "--steer", "--output", tmp_path / "v", "--", sys.executable, "-c", "pass")
    assert res.returncode == 2 and "wrote no summary.json" in res.stderr and "Checkpointer" in res.stderr


@pytest.mark.slow
def test_gpt_prefetch_example_verifies_unchanged_at_tolerance_zero(tmp_path):
    """The nanoGPT-style example (global-generator batches, a prefetched batch in ScriptState, a best_val
    that starts at inf) is proven exact with no contract code; its negative control diverges."""
    out = tmp_path / "v"
    res = ripresa_cli("verify", "--steps", "6", "--cut", "3", "--tolerance", "0", "--output", out, "--",
                      sys.executable, "-B", EXAMPLES / "gpt_prefetch" / "train.py", "--run", tmp_path / "IGNORED",
                      "--steps", "100", "--every", "50", timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((out / "verification.json").read_text())
    assert report["mode"] == "steered" and report["positive"] is True, report
    assert report["negative_divergence_detected"] is True
    assert not (tmp_path / "IGNORED").exists()
