"""Hostile ``.dcp`` generations (issue #10, classes 1, 2 and the .dcp items of 6; docs/FAULTS.md).

Every attack below is made by someone who can write the run folder and knows
the formats but not the HMAC key: the companion's file sizes and the commit
marker hold plain sha256s, so each crafted file is "re-blessed" (companion and
marker recomputed) before the victim reads it. A crafted pickle's payload
would create a marker file; the tests assert it never exists.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from support.helpers import rebless_dcp

import ripresa
from ripresa.cli import main as cli_main
from ripresa.core.state import Progress
from ripresa.errors import IntegrityError
from ripresa.formats import dcp as dcp_fmt
from ripresa.formats import dcp_safe
from ripresa.formats.generation import Generation
from ripresa.io import auth
from ripresa.session.checkpointer import rank_view
from ripresa.session.distributed import check_distributed_record
from ripresa.store import dcp as store_dcp
from ripresa.store.history import read_history
from ripresa.store.store import CheckpointWarning

KEY = b"ripresa-dcp-hostile-test-key-32b"


pytestmark = pytest.mark.usefixtures("no_hmac_env")  # tests/conftest.py


class _Payload:
    """Unpickling this runs ``touch MARKER`` (what an attacker's .metadata does to a plain pickle.load)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _toy(stepped: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    if stepped:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        (model(x) - x).pow(2).mean().backward()
        opt.step()
    return model, opt


def _dcp_generation(folder: Path, step: int, *, key: bytes | None = None, state=None) -> Generation:
    """A real .dcp generation (DCP shards of a toy model and AdamW), committed like an FSDP2 run does."""
    model, opt = _toy()
    part = dcp_fmt.partial_path(folder, step)
    folder.mkdir(parents=True, exist_ok=True)
    dcp_fmt.save_shards(model, opt, part, no_dist=True)
    n = sum(p.numel() for p in model.parameters())
    gen = store_dcp.commit_dcp(folder, step, part, world_size=1, n_params=n,
                             state=state if state is not None else {"progress": {"step": step}}, hmac_key=key)
    assert gen.valid, gen.reason
    return gen


def _load_checked(model, opt, path: Path) -> None:
    """What every loader does: a (shallow) check records the marker's hashes, then exactly those bytes load."""
    step = dcp_fmt.parse_dcp_name(path.name)
    g = dcp_fmt.check_dcp(path.parent, step)
    assert g.valid, g.reason
    doc = dcp_fmt.read_dcp_companion(path, g.companion_sha256)
    dcp_fmt.load_shards(model, opt, path, files=g.files, sizes=doc["files"], no_dist=True)


def _plant_payload(folder: Path, step: int, marker: Path) -> None:
    d, _ = dcp_fmt.dcp_paths(folder, step)
    (d / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    rebless_dcp(folder, step)


# ---------------------------------------------------------------- class 1: no unpickling of untrusted bytes


def test_metadata_payload_is_refused_by_the_reader_and_every_loader(tmp_path):
    marker = tmp_path / "EXECUTED"
    gen = _dcp_generation(tmp_path / "run", 5)
    _plant_payload(tmp_path / "run", 5, marker)
    assert dcp_fmt.check_dcp(tmp_path / "run", 5).valid  # shallow: sizes and hashes were re-blessed
    deep = dcp_fmt.check_dcp(tmp_path / "run", 5, deep=True)
    assert not deep.valid and "system" in deep.reason
    with pytest.raises(IntegrityError) as err:
        dcp_safe.read_metadata(gen.path)
    assert "global" in str(err.value) and ("posix.system" in str(err.value) or "os.system" in str(err.value))
    assert err.value.file == str(gen.path / ".metadata")
    model, opt = _toy()
    with pytest.raises(IntegrityError):
        _load_checked(model, opt, gen.path)
    assert not marker.exists()


def test_convert_of_a_crafted_dcp_runs_nothing(tmp_path, capsys):
    """`ripresa convert X.dcp DEST`: refused with exit 1, the global named, the payload never run."""
    marker = tmp_path / "EXECUTED"
    _dcp_generation(tmp_path / "run", 5)
    _plant_payload(tmp_path / "run", 5, marker)
    assert cli_main(["convert", str(tmp_path / "run" / "step_000005.dcp"), str(tmp_path / "o" / "step_000005.bin")]) == 1
    err = capsys.readouterr().err
    assert "system" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "o" / "step_000005.bin").exists()


@pytest.mark.slow
def test_train_resume_of_a_crafted_dcp_runs_nothing(tmp_path):
    """`ripresa train --resume X.dcp` (a real subprocess): refused, exit 1, no traceback, no payload."""
    marker = tmp_path / "EXECUTED"
    run = tmp_path / "run"
    _dcp_generation(run, 5)
    _plant_payload(run, 5, marker)
    train = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(tmp_path / "t"), "--config", "tiny",
                            "--quiet", "--threads", "1", "--no-audit", "--steps", "6", "--resume",
                            str(run / "step_000005.dcp")],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert train.returncode == 1, train.stderr
    assert "system" in train.stderr and "Traceback" not in train.stderr
    assert not marker.exists()


def _train(run: Path, total: int, **kw) -> ripresa.Checkpointer:
    model, opt = _toy(stepped=False)
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"toy": True})
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    ck = ripresa.Checkpointer(run, state, every=5, asynchronous=False, handle_signals=False, **{"format": "andrea", **kw})
    start = ck.resume()
    for step in range(start + 1, total + 1):
        opt.zero_grad()
        (model(x) - x).pow(2).mean().backward()
        opt.step()
        ck.step_done(step)
    ck.close(final_save=True)
    return ck


def test_single_process_run_refuses_a_planted_dcp_through_the_restricted_reader(tmp_path):
    """A .dcp planted at the newest step of a .bin run: a single process considers it (it resumes .dcp generations),
    reads its .metadata only through the restricted reader, refuses it (named in a warning) and resumes the .bin;
    nothing of the payload runs."""
    marker = tmp_path / "EXECUTED"
    run = tmp_path / "run"
    _train(run, 10)
    _dcp_generation(tmp_path / "elsewhere", 20)
    os.rename(tmp_path / "elsewhere" / "step_000020.dcp", run / "step_000020.dcp")
    os.rename(tmp_path / "elsewhere" / "step_000020.dcp.sha256", run / "step_000020.dcp.sha256")
    _plant_payload(run, 20, marker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = _train(run, 12)
    assert ck.resumed_from.step == 10 and ck.resumed_from.bin.name == "step_000010.bin"
    assert any(issubclass(w.category, CheckpointWarning) and "20" in str(w.message) and "system" in str(w.message)
               for w in caught)
    events = read_history(run / ".loss.jsonl").events
    assert any(e["event"] == "skipped_generation" and "20" in e["reason"] for e in events)
    assert not marker.exists()


def test_shard_items_load_with_weights_only(tmp_path):
    """A non-tensor item (an AdamW hyper-parameter) of a .distcp replaced by a pickle payload: refused, not run."""
    marker = tmp_path / "EXECUTED"
    gen = _dcp_generation(tmp_path / "run", 5)
    md = dcp_safe.read_metadata(gen.path)
    idx = next(i for i in md.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = md.storage_data[idx]
    shard = gen.path / info.relative_path
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    evil = buf.getvalue()
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(evil)
    info.offset, info.length = offset, len(evil)
    (gen.path / ".metadata").write_bytes(pickle.dumps(md))
    rebless_dcp(tmp_path / "run", 5)
    assert dcp_fmt.check_dcp(tmp_path / "run", 5, deep=True).valid  # the metadata itself is well-formed
    model, opt = _toy()
    with pytest.raises(IntegrityError) as err:
        _load_checked(model, opt, gen.path)
    assert "weights_only" in str(err.value) and "optim.param_groups.0.lr" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("edit,found", [
    (lambda info: setattr(info, "relative_path", "../../../etc/passwd"), "names the file"),
    (lambda info: setattr(info, "offset", 10**15), "which has"),
    (lambda info: setattr(info, "transform_descriptors", ["zstd"]), "transform"),
])
def test_metadata_that_points_outside_its_shards_is_refused(tmp_path, edit, found):
    gen = _dcp_generation(tmp_path / "run", 5)
    md = dcp_safe.read_metadata(gen.path)
    edit(next(iter(md.storage_data.values())))
    (gen.path / ".metadata").write_bytes(pickle.dumps(md))
    rebless_dcp(tmp_path / "run", 5)
    g = dcp_fmt.check_dcp(tmp_path / "run", 5, deep=True)
    assert not g.valid and found in g.reason
    model, opt = _toy()
    with pytest.raises(IntegrityError):
        _load_checked(model, opt, gen.path)


def test_a_real_dcp_generation_round_trips_through_the_safe_reader(tmp_path):
    gen = _dcp_generation(tmp_path / "run", 5)
    src_model, src_opt = _toy()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    _load_checked(model, opt, gen.path)
    for a, b in zip(src_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == 1e-3 and tuple(opt.param_groups[0]["betas"]) == (0.9, 0.95)
    for p_src, p in zip(src_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(src_opt.state[p_src]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


# ---------------------------------------------------------------- class 2: signatures mean signatures


def test_dcp_generations_are_signed_and_checked(tmp_path, monkeypatch):
    run = tmp_path / "run"
    gen = _dcp_generation(run, 5, key=KEY)
    sig = dcp_fmt.signature_path(run, 5)
    assert sig.name == "step_000005.dcp.hmac" and sig.read_text().startswith("ripresa-hmac-sha256 v1 ")
    assert dcp_fmt.check_dcp(run, 5, deep=True, require_signature=True, hmac_key=KEY).valid
    other = dcp_fmt.check_dcp(run, 5, require_signature=True, hmac_key=b"another-key-that-is-long-enough!")
    assert not other.valid and "another key" in other.reason
    shard = next(gen.path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    rebless_dcp(run, 5)
    assert dcp_fmt.check_dcp(run, 5, deep=True).valid is True  # sha256 alone: the attacker wins
    tampered = dcp_fmt.check_dcp(run, 5, deep=True, require_signature=True, hmac_key=KEY)
    assert not tampered.valid and "signature does not match" in tampered.reason
    _dcp_generation(run, 10)  # unsigned
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    unsigned = dcp_fmt.check_dcp(run, 10)
    assert not unsigned.valid and "not signed" in unsigned.reason
    store_dcp.delete_dcp(run, 5)
    assert not sig.exists() and not gen.path.exists()


def test_require_signature_refuses_what_cannot_be_signed(tmp_path, monkeypatch):
    """A foreign .bin (no companion), a checkpoint.pt, a plain .bin given to convert: refused, saying what is missing."""
    run = tmp_path / "run"
    _train(run, 5)
    foreign = tmp_path / "loose" / "step_000005.bin"
    foreign.parent.mkdir()
    foreign.write_bytes((run / "step_000005.bin").read_bytes())
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    model, opt = _toy(stepped=False)
    ck = ripresa.Checkpointer(tmp_path / "new", ripresa.TrainingState(model=model, optimizer=opt, config={}),
                              asynchronous=False, handle_signals=False)
    try:
        with pytest.raises(auth.SignatureError) as err:
            ck.resume(from_path=foreign)
        assert "no companion" in str(err.value) and "not signed" in str(err.value)
    finally:
        ck.close()
    assert not list((tmp_path / "new").glob("step_*"))  # nothing was signed into a new generation
    from ripresa.formats.torch_pt import load_checkpoint, save_checkpoint

    pt = tmp_path / "checkpoint.pt"
    monkeypatch.delenv(auth.ENV_REQUIRE)
    save_checkpoint(pt, ripresa.TrainingState(model=model, optimizer=opt, config={}).snapshot(Progress()))
    assert load_checkpoint(pt).step == 0
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    with pytest.raises(auth.SignatureError, match="checkpoint.pt"):
        load_checkpoint(pt)
    assert cli_main(["convert", str(foreign), str(tmp_path / "o" / "x.pt")]) == 1


# ---------------------------------------------------------------- class 5/6: companion robustness


def _nest(depth: int):
    doc: list = []
    for _ in range(depth):
        doc = [doc]
    return doc


@pytest.mark.parametrize("mutate,reason", [
    (lambda doc: doc["state"].__setitem__("deep", _nest(100_000)), "not valid JSON"),
    (lambda doc: doc.__setitem__("world_size", 10**12), "out of range"),
    (lambda doc: doc.__setitem__("world_size", "2"), "wrong type"),
    (lambda doc: doc.__setitem__("files", ["x"]), "wrong type"),
    (lambda doc: doc["state"].__setitem__("extra", {"distributed": {"world_size": 2, "ranks": []}}), "world_size differs"),
    (lambda doc: (doc.__setitem__("world_size", 3),
                  doc["state"].__setitem__("extra", {"distributed": {"world_size": 3, "ranks": [{}]}})), "list of 1"),
    (lambda doc: doc["state"].__setitem__("rng", {"__tensor__": 7}), "companion.rng"),
])
def test_hostile_companion_fields_are_integrity_errors(tmp_path, mutate, reason):
    run = tmp_path / "run"
    gen = _dcp_generation(run, 5)
    doc = json.loads((gen.path / dcp_fmt.COMPANION_NAME).read_bytes())
    mutate(doc)
    if "deep" in doc["state"]:  # json.dumps itself recurses: write the nesting by hand
        del doc["state"]["deep"]
        text = json.dumps(doc)
        raw = text[:-2] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}}"
        (gen.path / dcp_fmt.COMPANION_NAME).write_text(raw)
        d, mk = dcp_fmt.dcp_paths(run, 5)
        mk.write_text("".join(f"{hashlib.sha256((d / n).read_bytes()).hexdigest()}  {d.name}/{n}\n"
                              for n in sorted(os.listdir(d))))
    else:
        rebless_dcp(run, 5, companion=doc)
    g = dcp_fmt.check_dcp(run, 5, deep=True)
    assert not g.valid and reason in g.reason, g.reason


def test_per_rank_records_are_checked_before_use():
    """A .bin companion's extra.distributed: a claimed world size is checked against the list that holds it."""
    huge = {"extra": {"distributed": {"world_size": 10**12, "ranks": []}}}
    with pytest.raises(IntegrityError, match="world_size"):
        rank_view(huge, 0)
    short = {"extra": {"distributed": {"world_size": 2, "ranks": [{"rank": 0, "rng": {}, "data": None, "objects": {}}]}}}
    with pytest.raises(IntegrityError, match="2 entries"):
        rank_view(short, 1)
    swapped = {"world_size": 2, "ranks": [{"rank": 1, "rng": {}, "data": None, "objects": {}},
                                          {"rank": 0, "rng": {}, "data": None, "objects": {}}]}
    with pytest.raises(IntegrityError, match="another rank"):
        check_distributed_record(swapped)
    ok = {"world_size": 1, "ranks": [{"rank": 0, "rng": {"a": 1}, "data": None, "objects": {}}]}
    assert rank_view({"extra": {"distributed": ok}, "rng": None}, 0)[0]["rng"] == {"a": 1}
