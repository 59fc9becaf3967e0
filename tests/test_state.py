"""TrainingState: complete capture, strict restore, identity checks through the real CLI."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import TRAIN, run

import ripresa


class Counter:
    """A user object following the Stateful protocol."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _build(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Dropout(0.2), torch.nn.Linear(5, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    gen = np.random.Generator(np.random.PCG64(seed))
    tgen = torch.Generator().manual_seed(seed + 1)
    sampler = ripresa.EpochSampler(30, 7, generator=gen)
    counter = Counter()
    state = ripresa.TrainingState(
        model=model, optimizer=opt, scheduler=sched, scaler=scaler, data=sampler,
        rng=ripresa.RandomStreams(numpy={"g": gen}, torch_generators={"aug": tgen}),
        objects={"counter": counter}, config={"k": 1}, data_sources={"d": b"data"},
    )
    return state, tgen, counter


X = torch.randn(30, 3, generator=torch.Generator().manual_seed(5))
Y = torch.randn(30, 1, generator=torch.Generator().manual_seed(6))


def _steps(state, tgen, counter, progress, n):
    losses = []
    for _ in range(n):
        ids = state.data.next_batch()
        x = X[ids] + 0.01 * torch.randn(len(ids), 3, generator=tgen)
        state.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(state.model(x), Y[ids])
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        counter.n += 1
        progress.step += 1
        losses.append(loss.item())
    return losses


def test_full_state_round_trip_is_bit_exact(tmp_path):
    state, tgen, counter = _build()
    ref_losses = _steps(state, tgen, counter, ripresa.Progress(), 12)
    ref = {k: v.clone() for k, v in state.model.state_dict().items()}

    state, tgen, counter = _build()
    progress = ripresa.Progress()
    _steps(state, tgen, counter, progress, 5)
    ripresa.save_checkpoint(tmp_path / "c.pt", state.snapshot(progress))
    scaler_at_save = state.scaler.state_dict()
    assert scaler_at_save["scale"] != 1024.0  # it grew, so a fresh scaler would differ
    _steps(state, tgen, counter, progress, 3)  # the process goes on, then dies

    state2, tgen2, counter2 = _build(seed=42)  # other seeds: only the restore may make it equal
    progress2 = state2.restore(ripresa.load_checkpoint(tmp_path / "c.pt"))
    assert progress2.step == 5 and counter2.n == 5
    assert state2.scaler.state_dict() == scaler_at_save
    losses = _steps(state2, tgen2, counter2, progress2, 7)
    assert losses == ref_losses[5:]
    for k, v in state2.model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_snapshot_is_a_copy_not_a_view(tmp_path):
    state, tgen, counter = _build()
    snap = state.snapshot(ripresa.Progress())
    before = snap["model"]["0.weight"].clone()
    with torch.no_grad():
        state.model[0].weight.add_(1.0)
    assert torch.equal(snap["model"]["0.weight"], before)


@pytest.mark.parametrize("missing", ["optimizer", "scheduler", "scaler", "data"])
def test_missing_state_is_an_error_not_a_default(tmp_path, missing):
    state, _, _ = _build()
    snap = state.snapshot(ripresa.Progress())
    snap[missing] = None
    fresh, _, _ = _build()
    w = fresh.model[0].weight.detach().clone()
    with pytest.raises(ripresa.errors.SchemaError, match=f"{missing} state"):
        fresh.restore(snap)
    assert torch.equal(fresh.model[0].weight, w)


def test_other_architecture_is_refused():
    state, _, _ = _build()
    snap = state.snapshot(ripresa.Progress())
    other = ripresa.TrainingState(model=torch.nn.Linear(3, 1))
    with pytest.raises(ripresa.errors.SchemaError, match="model state does not match"):
        other.restore(snap)


def test_versions_mismatch_refused_unless_allowed():
    state, _, _ = _build()
    snap = state.snapshot(ripresa.Progress())
    snap["versions"]["torch"] = "1.13.0"
    fresh, _, _ = _build()
    with pytest.raises(ripresa.errors.IdentityMismatch, match="allow-version-change"):
        fresh.restore(snap)
    fresh.restore(snap, allow_version_change=True)
    assert fresh.lineage[-1]["accepted_changes"]["versions.torch"] == {"saved": "1.13.0", "now": str(torch.__version__)}


def test_data_identity_mismatch_refused():
    state, _, _ = _build()
    snap = state.snapshot(ripresa.Progress())
    snap["data_identity"]["d"] = "0" * 64
    fresh, _, _ = _build()
    with pytest.raises(ripresa.errors.IdentityMismatch, match="allow-data-change"):
        fresh.restore(snap)


@pytest.mark.slow
def test_edited_training_code_refused_by_the_trainer_then_allowed(tmp_path):
    """Real processes: resume with an edited copy of train.py."""
    work = tmp_path / "ex"
    shutil.copytree(TRAIN.parent, work, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    script = work / "train.py"
    assert run([sys.executable, "-B", str(script), "--steps", "3", "--output", str(tmp_path / "a")]).returncode == 0
    script.write_text(script.read_text() + "\n# an edit after the save\n")
    ck = tmp_path / "a" / "checkpoint.pt"
    res = run([sys.executable, "-B", str(script), "--steps", "2", "--resume", str(ck), "--output", str(tmp_path / "b")])
    assert res.returncode == 1 and "--allow-code-change" in res.stderr and "code.files_sha256" in res.stderr
    res = run([sys.executable, "-B", str(script), "--steps", "2", "--resume", str(ck), "--allow-code-change", "--output", str(tmp_path / "c")])
    assert res.returncode == 0, res.stderr
    saved = torch.load(tmp_path / "c" / "checkpoint.pt", weights_only=True)
    assert saved["lineage"][0]["at_step"] == 3 and "code.files_sha256" in saved["lineage"][0]["accepted_changes"]
