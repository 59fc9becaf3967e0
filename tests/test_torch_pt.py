"""checkpoint.pt: atomic writes, sha256 sidecar, and refusal of every kind of bad input.

Each bad input must give a clear message (file, expected, found, hint), the
documented exit code, and leave every existing file unchanged.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import TRAIN, train, tree_digest

import ripresa
from ripresa.formats.torch_pt import load_checkpoint, save_checkpoint
from ripresa.io.fsio import sidecar_path


def _copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst / "checkpoint.pt"


def test_written_checkpoint_loads_with_weights_only_and_sha256sum_passes(interrupted_run):
    ck = interrupted_run / "checkpoint.pt"
    state = torch.load(ck, map_location="cpu", weights_only=True)  # the plain safe loader
    assert state["progress"]["step"] == 5 and state["data"]["cursor"] == 20
    for key in ("model", "optimizer", "scheduler", "rng", "config", "versions", "code", "data_identity"):
        assert key in state
    assert state["optimizer"]["state"][0]["exp_avg"].shape == state["model"]["0.weight"].shape
    assert isinstance(state["rng"]["torch_cpu"], torch.Tensor) and state["rng"]["torch_cpu"].dtype == torch.uint8
    assert isinstance(state["rng"]["numpy"]["pcg64"]["state"]["state"], int)
    assert len(state["code"]["files_sha256"]) == 64 and len(state["data_identity"]["rows"]) == 64
    res = subprocess.run(["sha256sum", "-c", "checkpoint.pt.sha256"], cwd=interrupted_run, capture_output=True, text=True)
    assert res.returncode == 0 and "checkpoint.pt: OK" in res.stdout


def test_no_temporary_file_is_left_and_sidecar_is_last(tmp_path, interrupted_run):
    ck = load_checkpoint(interrupted_run / "checkpoint.pt")
    out = tmp_path / "c.pt"
    events = []
    from ripresa.io import fsio

    fsio.ops.hook = lambda op, path: events.append((op, os.path.basename(path)))
    try:
        save_checkpoint(out, ck.state)
    finally:
        fsio.ops.hook = None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "c.pt.sha256"]
    renames = [name for op, name in events if op == "rename"]
    assert renames == ["c.pt", "c.pt.sha256"]  # data first, commit marker last
    ops_order = [op for op, _ in events]
    assert ops_order.index("fsync") < ops_order.index("rename")
    assert ops_order[-1] == "fsync_dir"


def _expect_refusal(tmp_path, ck, exit_code, *needles):
    before = tree_digest(ck.parent)
    res = train("--steps", "1", "--resume", ck, "--output", tmp_path / "out")
    assert res.returncode == exit_code, res.stdout + res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr
    assert "hint:" in res.stderr or "expected:" in res.stderr
    assert tree_digest(ck.parent) == before, "a refused load changed files"
    assert not (tmp_path / "out").exists()
    return res.stderr


@pytest.mark.slow
def test_truncated_checkpoint(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    data = ck.read_bytes()
    ck.write_bytes(data[: len(data) // 2])
    _expect_refusal(tmp_path, ck, 1, "sha256 mismatch", str(ck))


@pytest.mark.slow
def test_one_flipped_byte(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    data = bytearray(ck.read_bytes())
    data[len(data) // 3] ^= 0x01
    ck.write_bytes(bytes(data))
    _expect_refusal(tmp_path, ck, 1, "sha256 mismatch")


@pytest.mark.slow
def test_missing_sidecar(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    sidecar_path(ck).unlink()
    _expect_refusal(tmp_path, ck, 1, "missing commit marker")


@pytest.mark.slow
@pytest.mark.parametrize(
    "content",
    [b"", b"nothex  checkpoint.pt\n", b"ab" * 31 + b"  checkpoint.pt\n", b"\xff\xfe garbage", None],
    ids=["empty", "bad-hex", "short-hash", "binary", "other-name"],
)
def test_malformed_sidecar(tmp_path, interrupted_run, content):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    side = sidecar_path(ck)
    if content is None:
        content = side.read_bytes().replace(b"checkpoint.pt", b"../other.pt")
    side.write_bytes(content)
    err = _expect_refusal(tmp_path, ck, 1, "sidecar")
    assert str(side) in err


@pytest.mark.slow
def test_wrong_hash(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    sidecar_path(ck).write_text("0" * 64 + "  checkpoint.pt\n")
    _expect_refusal(tmp_path, ck, 1, "sha256 mismatch", "0" * 64)


def _rehash(path):
    ripresa.io.fsio.write_sidecar(path, ripresa.io.fsio.sha256_file(path))


@pytest.mark.slow
def test_wrong_schema_with_valid_hash(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    state = torch.load(ck, weights_only=True)
    del state["rng"]
    torch.save(state, ck)
    _rehash(ck)
    _expect_refusal(tmp_path, ck, 1, "lacks 'rng'")


@pytest.mark.slow
def test_inconsistent_progress_with_valid_hash(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    state = torch.load(ck, weights_only=True)
    state["progress"]["step"] = 7
    torch.save(state, ck)
    _rehash(ck)
    _expect_refusal(tmp_path, ck, 1, "different instants")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_pickle_naming_os_system_is_refused_without_running(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    state = torch.load(ck, weights_only=True)
    state["extra"] = {"payload": _Evil()}
    torch.save(state, ck)  # a torch zip whose pickle names os.system
    _rehash(ck)  # even with a matching sidecar
    err = _expect_refusal(tmp_path, ck, 1, "safe loader")
    assert "system" in err
    assert not (tmp_path / "PWNED").exists() and not (ck.parent / "PWNED").exists()
    assert not list(tmp_path.rglob("PWNED"))


@pytest.mark.slow
def test_raw_pickle_not_a_zip_is_refused(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    ck.write_bytes(pickle.dumps(_Evil()))
    _rehash(ck)
    _expect_refusal(tmp_path, ck, 1, "not a torch zip archive")
    assert not list(tmp_path.rglob("PWNED"))


@pytest.mark.slow
def test_resume_path_that_does_not_exist(tmp_path):
    res = train("--steps", "1", "--resume", tmp_path / "nope.pt", "--output", tmp_path / "out")
    assert res.returncode == 2
    assert "checkpoint not found" in res.stderr and "nope.pt" in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_path_that_is_a_folder(tmp_path):
    res = train("--steps", "1", "--resume", tmp_path, "--output", tmp_path / "out")
    assert res.returncode == 2 and "is a folder" in res.stderr


@pytest.mark.slow
def test_existing_output_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep")
    res = train("--steps", "1", "--output", out)
    assert res.returncode == 2 and "already exists" in res.stderr
    assert (out / "x").read_text() == "keep"


def test_identity_mismatch_refused_then_allowed_and_recorded(tmp_path, interrupted_run):
    """Different code → refused; allowed explicitly → accepted and carried in the lineage."""
    ck = load_checkpoint(interrupted_run / "checkpoint.pt")
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import importlib

        mod = importlib.import_module("train")
    finally:
        sys.path.pop(0)
    torch.set_default_dtype(torch.float64)
    try:
        model = mod.build_model()
        opt, sched = mod.build_optimizer(model)
        import numpy as np

        pcg = np.random.Generator(np.random.PCG64(0))
        other_code = tmp_path / "train_v2.py"
        other_code.write_text(TRAIN.read_text() + "\n# edited\n")
        st = ripresa.TrainingState(
            model=model, optimizer=opt, scheduler=sched,
            data=ripresa.EpochSampler(24, 4, generator=pcg), rng=ripresa.RandomStreams(numpy={"pcg64": pcg}),
            config=mod.CONFIG, code_files=[other_code], data_sources={"rows": mod.DATA},
        )
        w_before = model[0].weight.detach().clone()
        with pytest.raises(ripresa.errors.IdentityMismatch) as ei:
            st.restore(ck)
        assert "--allow-code-change" in str(ei.value) and ei.value.exit_code == 1
        assert torch.equal(model[0].weight, w_before), "a refused restore changed the model"
        progress = st.restore(ck, allow_code_change=True)
        assert progress.step == 5
        assert st.lineage and "code.files_sha256" in st.lineage[-1]["accepted_changes"]
        snap = st.snapshot(progress)
        assert snap["lineage"][-1]["at_step"] == 5
    finally:
        torch.set_default_dtype(torch.float32)


def test_snapshot_with_numpy_array_is_refused_before_writing(tmp_path, interrupted_run):
    import numpy as np

    state = load_checkpoint(interrupted_run / "checkpoint.pt").state
    state["extra"] = {"arr": np.zeros(3)}
    with pytest.raises(ripresa.errors.SchemaError, match="weights_only"):
        save_checkpoint(tmp_path / "c.pt", state)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_zip_with_corrupt_directory_is_refused(tmp_path, interrupted_run):
    ck = _copy_run(interrupted_run, tmp_path / "run")
    data = ck.read_bytes().replace(b"PK\x01\x02", b"XX\x01\x02")  # trash every central-directory entry
    ck.write_bytes(data)
    _rehash(ck)
    _expect_refusal(tmp_path, ck, 1, str(ck))


def test_argument_misuse_is_a_type_error(tmp_path):
    """Wrong argument types are programming errors; a missing file stays BadInput (docs/FAULTS.md)."""
    with pytest.raises(TypeError, match="path"):
        save_checkpoint(3, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping state"):
        save_checkpoint(tmp_path / "c.pt", [("model", {})])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path"):
        load_checkpoint(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="require_signature"):
        load_checkpoint(tmp_path / "c.pt", require_signature="yes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ripresa.errors.BadInput, match="not found"):
        load_checkpoint(tmp_path / "c.pt")
