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


# ---------------------------------------------------------------------- ScriptState
def _script_values():
    return dict(
        batch=(torch.arange(12, dtype=torch.int64).reshape(3, 4) * (2**40), torch.randn(3, 4, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)),
        ema_loss=0.1 + 0.2, big=2**62 + 1, bad_evals=3, stop=True, name="run-a", nothing=None,
        best=float("inf"), hist=[1.5, {"x": torch.tensor(7.25, dtype=torch.float64)}],
    )


def _same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b or (a != a and b != b)


def test_script_state_attribute_and_item_access():
    sv = ripresa.ScriptState(batch=None, ema_loss=0.0, bad_evals=0)
    sv.ema_loss = 0.9 * sv.ema_loss + 0.1 * 2.5
    sv["bad_evals"] += 1
    sv.batch = (torch.zeros(2), torch.ones(2))
    assert sv.bad_evals == 1 and sv["ema_loss"] == 0.25 and "batch" in sv and list(sv) == ["batch", "ema_loss", "bad_evals"]
    assert len(sv) == 3 and dict(sv.items())["bad_evals"] == 1 and "ema_loss=0.25" in repr(sv)
    assert isinstance(sv, ripresa.Stateful)
    sv.update(ema_loss=1.5, bad_evals=2)
    assert (sv.ema_loss, sv.bad_evals) == (1.5, 2)
    with pytest.raises(AttributeError, match="declare it"):
        sv.update(ema_los=1.0)
    import copy
    twin = copy.deepcopy(sv)
    twin.bad_evals = 7
    assert sv.bad_evals == 2 and torch.equal(twin.batch[1], sv.batch[1]) and list(twin) == list(sv)
    with pytest.raises(AttributeError, match="declare it"):
        sv.bad_eval = 2  # a typo is not silently left out of every checkpoint
    with pytest.raises(AttributeError, match="no variable 'nope'"):
        sv.nope  # noqa: B018
    for value in (np.int64(3), object(), {1: 2}, [torch.zeros(1), {"__x__": 1}]):
        with pytest.raises(TypeError, match="cannot be saved"):
            sv.ema_loss = value
    with pytest.raises(TypeError, match=r"convert it"):
        ripresa.ScriptState(step=np.int32(1))
    sv.batch = [object()][:0] + [1]  # a list changed in place later is checked at the save
    sv.batch.append(object())
    with pytest.raises(TypeError, match="cannot be saved"):
        sv.state_dict()


@pytest.mark.parametrize("fmt", ["andrea", "general"])
def test_script_state_round_trips_exactly_through_a_checkpointer(tmp_path, fmt):
    """Every kind of value comes back with its type and its bits, from either generation format."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        sv = ripresa.ScriptState(**{k: None for k in _script_values()})
        state = ripresa.TrainingState(model=model, optimizer=torch.optim.AdamW(model.parameters()), objects={"script": sv})
        return state, sv

    state, sv = build()
    for k, v in _script_values().items():
        sv[k] = v
    ck = ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False, format=fmt)
    assert ck.resume() == 0
    ck.step_done(1)
    ck.close()
    suffix = ".bin" if fmt == "andrea" else ".safetensors"
    assert (tmp_path / f"step_000001{suffix}").exists()
    state2, sv2 = build()
    ck2 = ripresa.Checkpointer(tmp_path, state2, every=1, handle_signals=False, format=fmt)
    assert ck2.resume() == 1
    ck2.close()
    for k, v in _script_values().items():
        _same(v, sv2[k])
    if fmt == "general":  # the batch lives in the tensor file, not in the JSON companion
        from safetensors import safe_open
        with safe_open(str(tmp_path / "step_000001.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor("objects/script/values/batch/0"), _script_values()["batch"][0])


def test_script_state_with_other_names_is_refused_and_changes_nothing():
    model = torch.nn.Linear(2, 1)
    saved = ripresa.TrainingState(model=model, objects={"script": ripresa.ScriptState(batch=torch.ones(2), n=4)})
    snap = saved.snapshot(ripresa.Progress(step=5))
    live = ripresa.ScriptState(batch=None, n=0, best=1.0)  # a variable added to the script since
    state = ripresa.TrainingState(model=torch.nn.Linear(2, 1), objects={"script": live})
    with pytest.raises(ripresa.errors.SchemaError, match="script variables differ"):
        state.restore(snap)
    assert live.batch is None and live.n == 0
    live2 = ripresa.ScriptState(batch=None, n=0)
    ripresa.TrainingState(model=torch.nn.Linear(2, 1), objects={"script": live2}).restore(snap)
    assert torch.equal(live2.batch, torch.ones(2)) and live2.n == 4
    snap["objects"]["script"]["devices"]["batch"] = [3]
    with pytest.raises(ripresa.errors.SchemaError, match="malformed"):
        ripresa.TrainingState(model=torch.nn.Linear(2, 1), objects={"script": ripresa.ScriptState(batch=None, n=0)}).restore(snap)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_script_state_puts_tensors_back_on_their_device():
    sv = ripresa.ScriptState(batch=(torch.ones(2, device="cuda"), torch.zeros(2)))
    snap = ripresa.TrainingState(model=torch.nn.Linear(2, 1), objects={"s": sv}).snapshot(ripresa.Progress())
    assert snap["objects"]["s"]["values"]["batch"][0].device.type == "cpu"
    live = ripresa.ScriptState(batch=None)
    ripresa.TrainingState(model=torch.nn.Linear(2, 1), objects={"s": live}).restore(snap)
    assert live.batch[0].device.type == "cuda" and live.batch[1].device.type == "cpu"
