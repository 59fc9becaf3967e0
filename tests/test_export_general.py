"""``ripresa export`` of a general generation (a ``Checkpointer``'s default format; docs/FORMAT.md, "Export bundles").

A real run of a user model (bf16 parameters, tied weights: a state the ``.bin``
cannot hold) is exported as a resume bundle and as ``--inference``; the
bundle's generation resumes bitwise, the inference tensors load with
``load_state_dict(strict=True)`` and equal the trained ones bitwise; a
damaged source or bundle is refused with a typed error.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from conftest import ripresa_cli

import ripresa
from ripresa.cli import main as cli_main
from ripresa.errors import BadInput, IntegrityError
from ripresa.io import auth
from ripresa.tools.export import export_run, verify_export


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.head(self.mid(self.emb(idx).to(torch.bfloat16)).float())


def train(run, steps: int, every: int = 2) -> Tied:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"model": {"kind": "tied", "vocab": 16}})
    ckpt = ripresa.Checkpointer(run, state, every=every, handle_signals=False)
    start = ckpt.resume()
    for step in range(start + 1, steps + 1):
        idx = torch.randint(0, 16, (4, 3))
        loss = torch.nn.functional.cross_entropy(model(idx).reshape(-1, 16), idx.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step_done(step, loss=loss.item())
    ckpt.close()
    return model


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(
        a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def test_a_general_run_exports_resumes_bitwise_and_gives_consolidated_inference_tensors(tmp_path):
    run = tmp_path / "run"
    model = train(run, 4)
    assert (run / "step_000004.safetensors.sha256").is_file() and not list(run.glob("*.bin"))
    report = export_run(run, tmp_path / "bundle", show_progress=False)  # no model factory: none is built
    assert report["verified"] and report["step"] == 4 and report["source"]["format"] == "general"
    b = tmp_path / "bundle"
    for name in ("step_000004.safetensors", "step_000004.safetensors.json", "step_000004.safetensors.sha256"):
        assert (b / "checkpoint" / name).read_bytes() == (run / name).read_bytes()
    assert (b / "metrics" / "loss.jsonl").is_file() and json.loads((b / "config.json").read_text())["model"]["kind"] == "tied"
    assert json.loads((b / "MANIFEST.json").read_text())["generation"]["format"] == "general"
    assert report["verification"]["reload"]["step"] == 4

    # the bundle's generation resumes in a new folder, bitwise the same as going on in the run
    ref = train(tmp_path / "ref", 6)
    moved = tmp_path / "moved"
    shutil.copytree(b / "checkpoint", moved)
    assert same(train(moved, 6).state_dict(), ref.state_dict())

    inf = export_run(run, tmp_path / "inf", inference=True, show_progress=False)
    assert inf["kind"] == "inference" and inf["verification"]["reload"]["bit_identical_to_source"] is True
    from safetensors.torch import load_file

    fresh = Tied()
    fresh.load_state_dict(load_file(str(tmp_path / "inf" / "model.safetensors")), strict=True)
    assert same(fresh.state_dict(), model.state_dict())
    assert fresh.head.weight.dtype == torch.float32 and fresh.mid.weight.dtype == torch.bfloat16

    # the CLI, in-process: the same exports; --verify re-checks them
    assert cli_main(["export", str(run), "--to", str(tmp_path / "cli"), "--step", "2"]) == 0  # the rendered report
    assert cli_main(["export", "--verify", str(tmp_path / "cli"), "--json"]) == 0
    assert cli_main(["export", "--verify", str(tmp_path / "inf"), "--json"]) == 0


def test_damaged_general_sources_and_bundles_are_refused_with_typed_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(auth.ENV_KEY, "k" * 32)  # a signed run: the signature travels into the bundle
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    run = tmp_path / "run"
    train(run, 4)
    newest = run / "step_000004.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 1
    newest.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="damaged"):
        export_run(run, tmp_path / "a", step=4, show_progress=False)
    assert not (tmp_path / "a").exists()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        report = export_run(run, tmp_path / "b", show_progress=False)  # the damaged newest is skipped
    assert report["step"] == 2
    assert (tmp_path / "b" / "checkpoint" / "step_000002.safetensors.hmac").is_file()
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    assert verify_export(tmp_path / "b")["reload"]["step"] == 2
    monkeypatch.setenv(auth.ENV_KEY, "x" * 32)  # another key: the bundle's generation is refused
    with pytest.raises(auth.SignatureError):
        verify_export(tmp_path / "b")
    monkeypatch.delenv(auth.ENV_REQUIRE)
    copied = tmp_path / "b" / "checkpoint" / "step_000002.safetensors"
    data = bytearray(copied.read_bytes())
    data[-1] ^= 1
    copied.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        verify_export(tmp_path / "b")
    assert cli_main(["export", "--verify", str(tmp_path / "b")]) == 1
    assert cli_main(["export", str(run), "--to", str(tmp_path / "c"), "--step", "3"]) == 2  # no such step
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    with pytest.raises(BadInput, match="model factory"):
        export_run(tmp_path / "b", tmp_path / "d")  # a folder without a general generation
    with pytest.raises(BadInput):
        export_run(tmp_path / "nothing", tmp_path / "e")


@pytest.mark.slow
def test_ripresa_export_of_a_general_run_in_real_processes(tmp_path):
    """`ripresa export RUN --to D`, `--inference` and `--verify` as real processes on a Checkpointer's run."""
    run = tmp_path / "run"
    train(run, 4)
    for extra, dest in (([], "d"), (["--inference"], "i")):
        res = ripresa_cli("export", run, "--to", tmp_path / dest, "--json", *extra, timeout=120)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["verified"] is True
        check = ripresa_cli("export", "--verify", tmp_path / dest, "--json", timeout=120)
        assert check.returncode == 0 and json.loads(check.stdout)["reload"]["step"] == 4, check.stderr
    res = ripresa_cli("export", run, "--to", tmp_path / "d", timeout=120)  # not empty: refused, nothing overwritten
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
