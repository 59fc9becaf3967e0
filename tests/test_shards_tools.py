"""Every tool on a sharded general generation (``step_NNNNNN.shards/``, docs/FORMAT.md "Sharded general generations").

Real run folders written by a ``Checkpointer(shard_threshold=0, shards=2)``; the CLI in real subprocesses:

* the mirror: a blank machine resumes from a local-path mirror bitwise, ``ripresa mirror pull`` lands a verified
  ``.shards`` folder and falls back past a damaged remote shard;
* ``ripresa inspect`` of the run and of the folder itself (``--deep`` hashes every shard, ``--json``,
  ``--require-signature``);
* ``ripresa export`` (a resume bundle that keeps the folder and resumes bitwise, ``--inference``, ``--verify``);
* ``ripresa convert`` (``.bin`` -> ``.shards`` -> ``.bin`` byte-identical; a damaged source refused), ``ripresa
  train --resume step_NNNNNN.shards``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ripresa_cli
from support.helpers import history_events
from support.mirror_train import train

import ripresa
from ripresa.store.mirror import local_generations

SHARDED = {"shard_threshold": 0, "shards": 2}
KEY = "6b" * 32


def _flip(path: Path, offset: int = -1) -> None:
    """Flip one byte of ``path`` (by default its last, a tensor byte of a shard)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x55
    path.write_bytes(bytes(data))


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, ripresa.TrainingState]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, ripresa.TrainingState(model=model, optimizer=opt, config={"what": "shards tools"})


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, ck: ripresa.Checkpointer, start: int, end: int) -> None:
    g = torch.Generator().manual_seed(start)
    for step in range(start + 1, end + 1):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        ck.step_done(step, loss=1.0)


def _sharded_run(run: Path, steps: int = 4) -> dict[str, torch.Tensor]:
    """A run folder of ``.shards`` generations every 2 steps; the model's state_dict at the end."""
    model, opt, state = _state()
    ck = ripresa.Checkpointer(run, state, every=2, **SHARDED)
    _steps(model, opt, ck, ck.resume(), steps)
    ck.close(final_save=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _resumed(run: Path) -> tuple[int, dict[str, torch.Tensor], dict]:
    """(the step a fresh state resumes at from ``run``, its model's state_dict, its optimizer's state_dict)."""
    model, opt, state = _state()
    ck = ripresa.Checkpointer(run, state, every=2, **SHARDED)
    try:
        start = ck.resume()
        return start, {k: v.detach().clone() for k, v in model.state_dict().items()}, opt.state_dict()
    finally:
        ck.close()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run folder with .shards generations at steps 2 and 4 (read-only for the tests: copy before damaging)."""
    run = tmp_path_factory.mktemp("shards") / "run"
    return run, _sharded_run(run)


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst, symlinks=True)
    return dst


# ---------------------------------------------------------------------------- the mirror


@pytest.mark.usefixtures("no_hmac_env")
def test_a_blank_machine_resumes_a_sharded_run_from_the_mirror_bitwise(tmp_path):
    remote = tmp_path / "other-disk" / "mirror"
    ref = train(tmp_path / "ref", 9, 3, checkpointer=SHARDED)
    first = train(tmp_path / "a", 6, 3, mirror=str(remote), checkpointer=SHARDED)
    assert first["last_upload_seconds"] is not None
    assert sorted(local_generations(remote)) == ["step_000003.shards", "step_000006.shards"]
    assert sorted(p.name for p in (remote / "step_000006.shards").iterdir()) == [
        "companion.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    shutil.rmtree(tmp_path / "a")  # the machine is gone
    again = train(tmp_path / "b", 9, 3, mirror=remote.as_uri(), checkpointer=SHARDED)
    assert (again["start"], again["resumed"]) == (6, "step_000006.shards")
    assert again["digest"] == ref["digest"]
    assert [e["step"] for e in history_events(tmp_path / "b", "mirror_pulled")] == [6]
    assert not list((tmp_path / "b").glob(".*.partial"))  # pulled into a partial folder, renamed


@pytest.mark.usefixtures("no_hmac_env")
def test_mirror_pull_lands_a_verified_shards_folder_and_skips_a_damaged_one(sharded, tmp_path):
    run, _ = sharded
    src = _copy(run, tmp_path)
    remote = tmp_path / "mirror"
    push = ripresa_cli("mirror", "push", src, "--mirror", remote)
    assert push.returncode == 0, push.stderr
    assert sorted(local_generations(remote).values()) == [2, 4]
    _flip(remote / "step_000004.shards" / "model-00002-of-00002.safetensors")  # the store changed a byte
    blank = tmp_path / "blank"
    blank.mkdir()
    pulled = ripresa_cli("mirror", "pull", blank, "--mirror", remote)
    assert pulled.returncode == 0, pulled.stderr
    assert "step_000002.shards" in pulled.stdout and not (blank / "step_000004.shards").exists()
    refused = history_events(blank, "mirror_refused")
    assert [e["step"] for e in refused] == [4] and "differs from its marker" in refused[0]["reason"]
    assert not list(blank.glob(".*.partial"))
    assert _resumed(blank)[0] == 2  # the landed folder is a whole, verified generation


# ---------------------------------------------------------------------------- inspect


def _inspect(*args) -> tuple[int, dict]:
    res = ripresa_cli("inspect", *args, "--json")
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, json.loads(res.stdout)


@pytest.mark.usefixtures("no_hmac_env")
def test_inspect_lists_and_reports_a_shards_generation(sharded, tmp_path):
    run, _ = sharded
    rc, r = _inspect(run)
    assert rc == 0 and [(g["step"], g["kind"], g["valid"]) for g in r["run"]["generations"]] == [
        (2, "shards", True), (4, "shards", True)]
    rc, r = _inspect(run / "step_000004.shards")
    assert rc == 0 and r["kind"] == "shards", r
    s = r["shards"]
    assert s["valid"] and s["step"] == 4 and [x["name"] for x in s["shards"]] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "shard sha256" in [c["name"] for c in s["checks"]]  # --deep (the default) hashes every shard
    assert s["tensors"]["count"] == sum(x["tensors"] for x in s["shards"]) and s["index"]["weight_map"] > 0
    assert s["companion"]["progress"]["step"] == 4
    assert sum(x["size"] for x in s["shards"]) == s["size"] == sum(
        n for name, n in s["files"].items() if name.startswith("model-"))
    text = ripresa_cli("inspect", run / "step_000004.shards")
    assert text.returncode == 0 and "model-00001-of-00002.safetensors" in text.stdout


@pytest.mark.usefixtures("no_hmac_env")
def test_inspect_deep_hashes_every_shard(sharded, tmp_path):
    run, _ = sharded
    bad = _copy(run, tmp_path)
    _flip(bad / "step_000004.shards" / "model-00001-of-00002.safetensors")  # a tensor byte: only --deep sees it
    rc, r = _inspect(bad / "step_000004.shards", "--no-deep")
    assert rc == 0 and "shard sha256" not in [c["name"] for c in r["shards"]["checks"]]
    rc, r = _inspect(bad / "step_000004.shards", "--deep")
    assert rc == 1 and not r["shards"]["valid"] and "sha256" in r["shards"]["reason"]
    rc, r = _inspect(bad)  # the run: the damaged newest is reported, the resume falls back to step 2
    assert rc == 0 and [g["valid"] for g in r["run"]["generations"]] == [True, False]
    assert [g["step"] for g in r["run"]["generations"] if g["resume"]] == [2]


def test_inspect_require_signature_on_a_run_of_shards(tmp_path, monkeypatch, no_hmac_env):
    monkeypatch.setenv("RIPRESA_HMAC_KEY", KEY)
    signed = tmp_path / "signed"
    _sharded_run(signed)
    assert (signed / "step_000004.shards.hmac").is_file()
    env = {"RIPRESA_HMAC_KEY": KEY}
    assert ripresa_cli("inspect", signed, "--require-signature", env=env).returncode == 0
    res = ripresa_cli("inspect", signed / "step_000004.shards", "--require-signature", "--json", env=env)
    assert res.returncode == 0 and json.loads(res.stdout)["shards"]["signature_verified"] is True
    (signed / "step_000004.shards.hmac").unlink()  # an unsigned newest: not trusted, step 2 is
    res = ripresa_cli("inspect", signed / "step_000004.shards", "--require-signature", env=env)
    assert res.returncode == 1 and "not signed" in res.stdout and "Traceback" not in res.stderr
    res = ripresa_cli("inspect", signed, "--require-signature", "--json", env=env)
    assert res.returncode == 0 and [g["valid"] for g in json.loads(res.stdout)["run"]["generations"]] == [True, False]
    res = ripresa_cli("inspect", signed / "step_000004.shards" / "companion.json", "--require-signature", env=env)
    assert res.returncode == 2 and "step_NNNNNN.shards" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------------------- export


@pytest.mark.usefixtures("no_hmac_env")
def test_export_of_a_shards_run_keeps_the_folder_and_resumes_bitwise(sharded, tmp_path):
    run, weights = sharded
    dest = tmp_path / "bundle"
    res = ripresa_cli("export", run, "--to", dest, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["step"] == 4 and report["source"]["format"] == "shards" and report["verified"]
    folder = dest / "checkpoint" / "step_000004.shards"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in (run / "step_000004.shards").iterdir())
    assert all((folder / p.name).read_bytes() == p.read_bytes() for p in (run / "step_000004.shards").iterdir())
    assert ripresa_cli("export", "--verify", dest).returncode == 0
    # the README's recipe: the contents of checkpoint/ in an empty run folder resume exactly
    new = tmp_path / "resumed"
    shutil.copytree(dest / "checkpoint", new)
    start, got, _ = _resumed(new)
    assert start == 4 and _same(got, weights)
    # a damaged copy is caught by --verify, by its hashes, with no traceback
    _flip(folder / "model-00002-of-00002.safetensors")
    bad = ripresa_cli("export", "--verify", dest)
    assert bad.returncode == 1 and "sha256 mismatch" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.usefixtures("no_hmac_env")
def test_export_inference_of_a_shards_run_is_the_model_bitwise(sharded, tmp_path):
    from safetensors.torch import load_file

    run, weights = sharded
    dest = tmp_path / "inf"
    res = ripresa_cli("export", run, "--to", dest, "--inference")
    assert res.returncode == 0, res.stderr
    assert _same(load_file(str(dest / "model.safetensors")), weights)
    manifest = json.loads((dest / "MANIFEST.json").read_text())
    assert manifest["weights"]["source"] == "shards"
    assert ripresa_cli("export", "--verify", dest).returncode == 0
    step2 = ripresa_cli("export", run, "--to", tmp_path / "two", "--step", "2")  # an explicit older step
    assert step2.returncode == 0 and (tmp_path / "two" / "checkpoint" / "step_000002.shards").is_dir()


# ---------------------------------------------------------------------------- convert, train --resume


@pytest.fixture(scope="module")
def gpt_bin(tmp_path_factory) -> Path:
    """A real 4-step generation of the tiny GPT (``ripresa train``)."""
    root = tmp_path_factory.mktemp("gpt")
    text = root / "text.txt"
    text.write_text(inspect.getsource(json.decoder) * 3)
    res = ripresa_cli("train", "--run", root / "run", "--config", "tiny", "--quiet", "--threads", "1", "--no-audit",
                      "--steps", "4", "--every", "4", "--set", "train.batch_size=4", "--set",
                      f'data.sources=["text={text}"]', env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    return root / "run" / "step_000004.bin"


@pytest.mark.usefixtures("no_hmac_env")
@pytest.mark.slow  # the default tier samples the family with the cheaper tests of this file
def test_convert_bin_to_shards_and_back_is_byte_identical_and_train_resumes_it(gpt_bin, tmp_path):
    sh = tmp_path / "a" / "step_000004.shards"
    res = ripresa_cli("convert", gpt_bin, sh)
    assert res.returncode == 0 and "identical" in res.stdout, res.stderr
    assert len(list(sh.glob("model-*-of-*.safetensors"))) >= 2 and (tmp_path / "a" / "step_000004.shards.sha256").is_file()
    back = tmp_path / "b" / "step_000004.bin"
    res = ripresa_cli("convert", sh, back)
    assert res.returncode == 0, res.stderr
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(gpt_bin.read_bytes()).digest()
    # ripresa train --resume names the folder itself
    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(gpt_bin.parent / "config.json", new / "config.json")
    res = ripresa_cli("train", "--run", new, "--resume", sh, "--steps", "5", "--every", "1", "--threads", "1",
                      "--quiet", "--no-audit", env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    assert "step_000004.shards" in res.stdout and (new / "step_000005.bin").is_file()


@pytest.mark.usefixtures("no_hmac_env")
def test_convert_refuses_a_damaged_or_misnamed_shards_generation(sharded, tmp_path):
    run, _ = sharded
    bad = _copy(run, tmp_path)
    _flip(bad / "step_000004.shards" / "model-00001-of-00002.safetensors")
    res = ripresa_cli("convert", bad / "step_000004.shards", tmp_path / "out" / "step_000004.bin")
    assert res.returncode == 1 and "not valid" in res.stderr and "sha256" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out" / "step_000004.bin").exists()
    os.rename(bad / "step_000002.shards", bad / "two.shards")
    res = ripresa_cli("convert", bad / "two.shards", tmp_path / "out" / "x.pt")
    assert res.returncode == 2 and "step_NNNNNN.shards" in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "elsewhere").mkdir()
    res = ripresa_cli("train", "--run", tmp_path / "t", "--resume", tmp_path / "elsewhere" / "x.txt", "--steps", "1")
    assert res.returncode == 2 and "step_NNNNNN.shards" in res.stderr and "Traceback" not in res.stderr
