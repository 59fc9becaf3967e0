"""An inconsistent state is refused at the resume, never trained on (docs/FAULTS.md, docs/FORMAT.md).

* the optimizer state must cover every parameter the saved optimizer had state
  for, and nothing else, and agree with the model: one validator
  (``core.state.check_optimizer_state``) for ``checkpoint.pt``, the general
  ``.safetensors`` and the ANDREA ``.bin`` alike — hashes recomputed, as a
  careless script would, do not help;
* ``step_done`` refuses a step that does not go forward;
* a changed experiment config is refused with exit 2 (not treated as damage:
  no generation is skipped for it); an allowed change is recorded.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ripresa_cli, valid_steps

import ripresa
from ripresa.errors import BadInput, IntegrityError
from ripresa.store.history import read_history
from ripresa.store.store import CheckpointWarning

FAST = ["--config", "tiny", "--quiet", "--set", "train.batch_size=4", "--threads", "1", "--no-audit"]


class TwoHeads(torch.nn.Module):
    """``b`` is never used: the optimizer holds no state for it (a legitimate gap the check must accept)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x)


def _trained(steps: int = 3, config=None):
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    return model, opt, ripresa.TrainingState(model=model, optimizer=opt, config=config or {"lr": 1e-2})


def _fresh(config=None):
    torch.manual_seed(1)
    model = TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, ripresa.TrainingState(model=model, optimizer=opt, config=config or {"lr": 1e-2})


def test_checkpoint_pt_missing_or_extra_optimizer_entry_is_refused_naming_the_parameter(tmp_path):
    model, opt, state = _trained()
    pt = tmp_path / "checkpoint.pt"
    snap = state.snapshot(ripresa.Progress(step=3))
    ripresa.save_checkpoint(pt, snap)
    # the intact state resumes (b has no optimizer state, as at the save)
    _, opt2, fresh = _fresh()
    fresh.restore(ripresa.load_checkpoint(pt))
    assert len(opt2.state) == 2

    # a careless script drops a.bias's moments and writes the file again (sha256 recomputed)
    doc = torch.load(pt, weights_only=True)
    del doc["optimizer"]["state"][1]
    ripresa.save_checkpoint(pt, doc)
    _, opt3, fresh = _fresh()
    with pytest.raises(IntegrityError, match=r"'a\.bias' \(index 1\) is missing") as err:
        fresh.restore(ripresa.load_checkpoint(pt))
    assert err.value.exit_code == 1
    assert len(opt3.state) == 0  # nothing restored: never fresh moments for one parameter

    # ... or gives b.weight (no state at the save) the moments of a.weight
    doc = state.snapshot(ripresa.Progress(step=3))
    doc["optimizer"]["state"][2] = {k: v.clone() for k, v in doc["optimizer"]["state"][0].items()}
    ripresa.save_checkpoint(pt, doc)
    with pytest.raises(IntegrityError, match=r"'b\.weight' \(index 2\) is an extra entry"):
        _fresh()[2].restore(ripresa.load_checkpoint(pt))

    # a step count edited in one entry
    doc = state.snapshot(ripresa.Progress(step=3))
    doc["optimizer"]["state"][0]["step"] = torch.tensor(1.0)
    ripresa.save_checkpoint(pt, doc)
    with pytest.raises(IntegrityError, match=r"'a\.weight' \(index 0\) has another step count"):
        _fresh()[2].restore(ripresa.load_checkpoint(pt))


def _rewrite_marker(run: Path, step: int, name: str) -> None:
    mk = run / f"step_{step:06d}.bin.sha256"
    lines = []
    for line in mk.read_text().splitlines():
        h, fname = line.split("  ", 1)
        if fname == name:
            h = hashlib.sha256((run / name).read_bytes()).hexdigest()
        lines.append(f"{h}  {fname}")
    mk.write_text("\n".join(lines) + "\n")


def test_bin_and_general_generations_pass_the_same_validator(tmp_path):
    from ripresa.core.state import optimizer_record
    from ripresa.formats import general as general_fmt
    from ripresa.store.general import save_general
    from ripresa.store.restore import rest_proxy

    # ANDREA .bin: the companion's entry for a.bias removed, the marker's line recomputed
    model, opt, state = _trained()
    run = tmp_path / "bin"
    ck = ripresa.Checkpointer(run, state, every=100, handle_signals=False, format="andrea")
    ck.resume()
    ck.step_done(3)
    ck.close()
    comp = run / "step_000003.json"
    doc = json.loads(comp.read_text())
    entries = doc["state"]["optimizer"]["state"]["__dict__"]
    doc["state"]["optimizer"]["state"]["__dict__"] = [e for e in entries if e[0] != 1]
    comp.write_text(json.dumps(doc))
    _rewrite_marker(run, 3, comp.name)
    _, opt2, fresh = _fresh()
    ck = ripresa.Checkpointer(tmp_path / "other", fresh, every=100, handle_signals=False)
    with pytest.raises(IntegrityError, match=r"'a\.bias' \(index 1\) is missing"):
        ck.resume(from_path=run / "step_000003.bin")
    ck.abort()
    assert len(opt2.state) == 0
    # the run folder itself: its only generation is refused, never resumed (exit 1, not a fresh start)
    _, _, fresh = _fresh()
    ck = ripresa.Checkpointer(run, fresh, every=100, handle_signals=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(IntegrityError, match=r"a\.bias"):
            ck.resume()
    ck.abort()

    # general .safetensors: written from a snapshot whose optimizer lacks a.bias (hashes all computed)
    model, opt, state = _trained()
    gen = tmp_path / "general"
    gen.mkdir()
    snap = rest_proxy(state).snapshot(ripresa.Progress(step=3))
    snap["model"] = dict(model.state_dict(keep_vars=True))
    sd = opt.state_dict()
    snap["optimizer_params"] = optimizer_record(model, opt)
    del sd["state"][1]
    snap["optimizer"] = sd
    tensors, encoded, aliases = general_fmt.split_state(snap, general_fmt.model_aliases(model))
    save_general(gen, 3, tensors, encoded, aliases, hmac_key=None)
    _, opt3, fresh = _fresh()
    ck = ripresa.Checkpointer(tmp_path / "other2", fresh, every=100, handle_signals=False)
    with pytest.raises(IntegrityError, match=r"'a\.bias' \(index 1\) is missing"):
        ck.resume(from_path=gen / "step_000003.safetensors")
    ck.abort()
    assert len(opt3.state) == 0


def test_step_done_must_go_forward(tmp_path):
    model, opt, state = _trained()
    ck = ripresa.Checkpointer(tmp_path / "r", state, every=2, handle_signals=False, asynchronous=False)
    assert ck.resume() == 0
    for step in (1, 2, 3, 4):
        ck.step_done(step)
    with pytest.raises(ValueError, match=r"step_done\(4\) after step_done\(4\)"):
        ck.step_done(4)
    ck.close()
    _, _, fresh = _fresh()
    ck = ripresa.Checkpointer(tmp_path / "r", fresh, every=2, handle_signals=False)
    assert ck.resume() == 4
    with pytest.raises(ValueError, match=r"step_done\(1\) but resume\(\) returned step 4"):
        ck.step_done(1)
    ck.close()
    assert valid_steps(tmp_path / "r")[-1] == 4  # no older generation written beside the newest


def test_a_changed_config_is_refused_not_skipped_and_an_allowed_one_recorded(tmp_path):
    model, opt, state = _trained(config={"lr": 1e-2, "batch": 8})
    run = tmp_path / "r"
    ck = ripresa.Checkpointer(run, state, every=100, handle_signals=False, asynchronous=False)
    ck.resume()
    for step in (1, 2):
        ck.step_done(step)
    ck.save_now()
    ck.step_done(3)
    ck.close()
    assert valid_steps(run) == [2, 3]
    _, _, fresh = _fresh(config={"lr": 1e-2, "batch": 4})
    ck = ripresa.Checkpointer(run, fresh, every=100, handle_signals=False, allow_config_change=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # no generation is skipped for it
        with pytest.raises(BadInput, match=r"config differs .*: batch \(8 -> 4\)") as err:
            ck.resume()
    ck.abort()
    assert err.value.exit_code == 2 and "--allow-config-change" in err.value.hint
    assert not any(e["event"] == "skipped_generation" for e in read_history(run / ".loss.jsonl").events)

    _, _, fresh = _fresh(config={"lr": 1e-2, "batch": 4})
    ck = ripresa.Checkpointer(run, fresh, every=100, handle_signals=False, allow_config_change=True)
    assert ck.resume() == 3
    ck.step_done(4)
    ck.close()
    ev = [e for e in read_history(run / ".loss.jsonl").events if e["event"] == "config_change"]
    assert ev and ev[-1]["changes"] == {"batch": {"saved": 8, "now": 4}}
    _, _, again = _fresh(config={"lr": 1e-2, "batch": 4})
    ck = ripresa.Checkpointer(run, again, every=100, handle_signals=False, allow_config_change=False)
    assert ck.resume() == 4  # the generation saved after the change carries the new config, and its lineage
    ck.abort()
    assert again.lineage[-1]["accepted_changes"] == {"config.batch": {"saved": 8, "now": 4}}


def test_train_refuses_a_changed_config_with_exit_2_before_building_anything(tmp_path):
    """The default tier's CLI sample: a run's config.json and a --set that changes it (nothing is built)."""
    from ripresa.engine.gpt.config import resolve_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = resolve_config("tiny", ["train.batch_size=4"], None)
    (run / "config.json").write_text(json.dumps(cfg, indent=2))
    res = ripresa_cli("train", "--run", run, "--quiet", "--threads", "1", "--no-audit", "--steps", "1",
                      "--set", "train.batch_size=8", "--set", "train.max_steps=77")
    assert res.returncode == 2, res.stdout + res.stderr
    first = res.stderr.splitlines()[0]
    assert "train.batch_size (4 -> 8)" in first and "train.max_steps" in first, res.stderr
    assert "--allow-config-change" in res.stderr and "Traceback" not in res.stderr
    assert not any(p.name.startswith("step_") for p in run.iterdir())


@pytest.mark.slow
def test_train_config_change_on_a_real_run_refused_then_allowed_and_recorded(tmp_path):
    run = tmp_path / "run"
    assert ripresa_cli("train", "--run", run, *FAST, "--steps", "6", "--every", "2").returncode == 0
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "8", "--every", "2", "--set", "train.batch_size=8")
    assert res.returncode == 2, res.stderr
    assert "not used" not in res.stderr and "CheckpointWarning" not in res.stderr
    assert "train.batch_size (4 -> 8)" in res.stderr.splitlines()[0]
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "8", "--every", "2", "--set", "train.batch_size=8",
                      "--allow-config-change")
    assert res.returncode == 0, res.stderr[-3000:]
    events = read_history(run / ".loss.jsonl").events
    change = [e for e in events if e["event"] == "config_change"]
    assert change and change[-1]["changes"]["train.batch_size"] == {"saved": 4, "now": 8}
    comp = json.loads((run / "step_000008.json").read_text())
    assert comp["state"]["lineage"][-1]["accepted_changes"]["config.train.batch_size"] == {"saved": 4, "now": 8}
    # the same command again: the run's config is now the new one; nothing to train
    res = ripresa_cli("train", "--run", run, *FAST, "--steps", "8", "--every", "2", "--set", "train.batch_size=8")
    assert res.returncode == 0 and "already at step 8" in res.stdout


@pytest.mark.slow
def test_regression_example_refuses_a_checkpoint_pt_missing_an_optimizer_entry(tmp_path):
    from conftest import train

    assert train("--steps", "3", "--output", tmp_path / "a").returncode == 0
    pt = tmp_path / "a" / "checkpoint.pt"
    doc = torch.load(pt, weights_only=True)
    victim = sorted(doc["optimizer"]["state"])[-1]
    del doc["optimizer"]["state"][victim]
    ripresa.save_checkpoint(pt, doc)
    res = train("--steps", "2", "--resume", pt, "--output", tmp_path / "b")
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"(index {victim}) is missing" in res.stderr
