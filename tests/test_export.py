"""``ripresa export``: a recoverable bundle, verified by re-hashing and reloading at the destination.

Every test works on a real run folder made by ``ripresa train`` (tiny config,
20 steps, a generation every 10) and on real files: a real ``sha256sum``, a
real safetensors load, the README's own numpy snippet executed, and a real
resume of the training from the bundle in a fresh process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ripresa_cli, tree_digest

from ripresa.engine.gpt.factory import GPT_FACTORY
from ripresa.engine.gpt.model import GPT, from_config_dict
from ripresa.errors import BadInput, IntegrityError, OutputExists
from ripresa.formats.andrea_bin import read_bin
from ripresa.store.store import CheckpointWarning
from ripresa.tools.export import (
    MANIFEST_JSON,
    MANIFEST_SHA,
    export_run,
    render_export,
    verify_export,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    res = ripresa_cli("train", "--run", run, "--config", "tiny", "--quiet", "--threads", "1",
                      "--set", "train.batch_size=4", "--steps", "20", "--every", "10", "--no-audit", timeout=120)
    assert res.returncode == 0, res.stderr
    assert (run / "step_000010.bin").is_file() and (run / "step_000020.bin").is_file()
    return run


@pytest.fixture(scope="module")
def bundle(run_dir, tmp_path_factory) -> tuple[Path, dict]:
    """One full export of the newest generation, shared by the read-only tests."""
    dest = tmp_path_factory.mktemp("bundle") / "export"
    before = tree_digest(run_dir)
    report = export_run(run_dir, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert tree_digest(run_dir) == before, "an export must not change the run folder"
    return dest, report


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _snippet(readme: str, name: str) -> str:
    m = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)\n```", readme, re.S)
    assert m, f"README has no {name} snippet"
    return m.group(1)


def _model_of(dest: Path) -> GPT:
    cfg = json.loads((dest / "config.json").read_text())
    return GPT(from_config_dict(cfg["model"]))


# ----------------------------------------------------------------------------- full bundle


def test_full_export_manifest_sha256sum_readme_and_reload(bundle, run_dir):
    dest, report = bundle
    assert report["verified"] is True and report["exit_code"] == 0
    assert report["kind"] == "resume" and report["step"] == 20
    assert report["source"]["verified_before_copy"] and report["source"]["skipped"] == []
    reload = report["verification"]["reload"]
    assert reload["forward"] == "ok" and reload["logits_finite"] and reload["step"] == 20
    assert reload["n_params"] == _model_of(dest).n_params()

    # the generation, config and history are byte-identical copies
    for name in ("step_000020.bin", "step_000020.json", "step_000020.bin.sha256"):
        assert (dest / "checkpoint" / name).read_bytes() == (run_dir / name).read_bytes()
    assert (dest / "config.json").read_bytes() == (run_dir / "config.json").read_bytes()
    assert (dest / "metrics" / "loss.jsonl").read_bytes() == (run_dir / ".loss.jsonl").read_bytes()
    assert (dest / "metrics" / "state.json").read_bytes() == (run_dir / ".state.json").read_bytes()
    assert not list(dest.rglob("step_000010*")), "only the exported generation is copied"

    # data identifiers and versions come from the companion
    companion = json.loads((run_dir / "step_000020.json").read_text())["state"]
    data = json.loads((dest / "data.json").read_text())
    assert data["data_identity"] == companion["data_identity"]
    assert [s["name"] for s in data["sources"]] == companion["config"]["data"]["sources"]
    assert all(s["sha256"] == companion["data_identity"][s["name"]] for s in data["sources"])
    versions = json.loads((dest / "versions.json").read_text())
    assert versions["versions"] == companion["versions"] and versions["code"] == companion["code"]

    # the manifest lists every file with its real size and sha256
    manifest = json.loads((dest / MANIFEST_JSON).read_text())
    on_disk = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert sorted([e["path"] for e in manifest["files"]] + [MANIFEST_JSON, MANIFEST_SHA]) == on_disk
    import hashlib

    for e in manifest["files"]:
        raw = (dest / e["path"]).read_bytes()
        assert (len(raw), hashlib.sha256(raw).hexdigest()) == (e["size"], e["sha256"])
    assert report["bytes"] == sum(e["size"] for e in manifest["files"])
    assert not [p for p in dest.rglob("*") if ".tmp." in p.name], "no temporary file left behind"

    # the real sha256sum agrees, inside DEST and inside checkpoint/
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum not installed")
    res = subprocess.run(["sha256sum", "-c", MANIFEST_SHA], cwd=dest, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(": OK") == len(manifest["files"]) + 1
    res = subprocess.run(["sha256sum", "-c", "step_000020.bin.sha256"], cwd=dest / "checkpoint", capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr

    readme = (dest / "README.md").read_text()
    for needle in ("resume checkpoint", "little-endian", "int32", "float32", "8 + 12", "sha256sum -c MANIFEST.sha256",
                   "ripresa train --run", "CheckpointStore", "activation checkpointing", "metrics/loss.jsonl",
                   "data.json", "versions.json", "parameters.json"):
        assert needle in readme, needle


def test_verify_export_and_render(bundle):
    dest, report = bundle
    again = verify_export(dest, model_factory=GPT_FACTORY)
    assert again["verified"] and again["unlisted"] == [] and again["reload"]["forward"] == "ok"
    assert again["reload"]["probe_loss"] == report["verification"]["reload"]["probe_loss"]
    from rich.console import Console

    console = Console(record=True, width=140)
    render_export(report, console)
    text = console.export_text()
    assert "verified" in text and "step_000020.bin" in text and "OK" in text


@pytest.mark.slow
def test_numpy_snippet_in_readme_reads_the_same_weights(bundle, run_dir, monkeypatch, capsys):
    dest, _ = bundle
    code = _snippet((dest / "README.md").read_text(), "numpy-read")
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    monkeypatch.chdir(dest)
    ns: dict = {}
    exec(compile(code, "README.md:numpy-read", "exec"), ns)
    assert "step 20" in capsys.readouterr().out
    ref = read_bin(run_dir / "step_000020.bin")
    assert ns["step"] == 20 and ns["n"] == ref.n_params
    for name in ("weights", "m", "v"):
        assert np.array_equal(ns[name], getattr(ref, name))
    model = _model_of(dest)
    named = dict(model.named_parameters())
    assert list(ns["params"]) == list(named)
    assert all(tuple(ns["params"][k].shape) == tuple(p.shape) for k, p in named.items())
    # the last parameter (lm_head) ends exactly at n_params: the layout is complete
    last = ns["layout"][-1]
    assert last["offset"] + last["numel"] == ns["n"]


@pytest.mark.slow
def test_export_of_an_older_step_copies_that_generation(run_dir, tmp_path, monkeypatch):
    import ripresa.tools.bundle as bundle_mod

    monkeypatch.setattr(bundle_mod, "PROGRESS_MIN_BYTES", 0)  # draw the byte progress bars (on stderr)
    dest = tmp_path / "older"
    dest.mkdir()  # an existing empty folder is accepted
    report = export_run(run_dir, dest, model_factory=GPT_FACTORY, step=10, show_progress=True)
    assert report["step"] == 10 and report["verified"]
    names = sorted(p.name for p in (dest / "checkpoint").iterdir())
    assert names == ["step_000010.bin", "step_000010.bin.sha256", "step_000010.json"]
    assert not list(dest.rglob("step_000020*"))
    assert (dest / "checkpoint" / "step_000010.bin").read_bytes() == (run_dir / "step_000010.bin").read_bytes()
    manifest = json.loads((dest / MANIFEST_JSON).read_text())
    assert manifest["step"] == 10 and manifest["generation"]["bin"] == "checkpoint/step_000010.bin"
    assert "step_000010.bin" in (dest / "README.md").read_text()
    assert verify_export(dest, model_factory=GPT_FACTORY)["reload"]["step"] == 10


# ----------------------------------------------------------------------------- refusals


@pytest.mark.slow
def test_non_empty_destination_is_refused_and_untouched(run_dir, tmp_path):
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine\n")
    before = tree_digest(dest)
    with pytest.raises(OutputExists) as info:
        export_run(run_dir, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert info.value.exit_code == 2 and info.value.file == str(dest)
    assert tree_digest(dest) == before and sorted(os.listdir(dest)) == ["notes.txt"]

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(OutputExists):
        export_run(run_dir, a_file, model_factory=GPT_FACTORY, show_progress=False)
    assert a_file.read_text() == "x"


@pytest.mark.slow
def test_absent_step_is_refused_with_exit_2(run_dir, tmp_path):
    dest = tmp_path / "absent"
    with pytest.raises(BadInput) as info:
        export_run(run_dir, dest, model_factory=GPT_FACTORY, step=15, show_progress=False)
    assert info.value.exit_code == 2 and "15" in info.value.message
    assert "10" in str(info.value.expected) and "20" in str(info.value.expected)
    assert not dest.exists()
    with pytest.raises(BadInput):
        export_run(tmp_path / "no-such-run", dest, model_factory=GPT_FACTORY, show_progress=False)


@pytest.mark.slow
def test_damaged_source_generation_is_refused_before_any_copy(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    # a bit flip deep inside the weights: header, size, marker and companion still look fine
    _flip_byte(run / "step_000020.bin")
    dest = tmp_path / "dest"
    with pytest.raises(IntegrityError) as info:
        export_run(run, dest, model_factory=GPT_FACTORY, step=20, show_progress=False)
    assert info.value.exit_code == 1 and "sha256" in str(info.value)
    assert not dest.exists(), "nothing may be written before the source is verified"

    # without --step the damaged newest generation is skipped, loudly, for the previous valid one
    with pytest.warns(CheckpointWarning, match="generation 20 not used"):
        report = export_run(run, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert report["step"] == 10 and report["source"]["skipped"][0]["step"] == 20
    assert not list(dest.rglob("step_000020*"))


def test_flipped_byte_in_the_destination_is_caught(bundle, tmp_path):
    src, _ = bundle
    dest = tmp_path / "copy"
    shutil.copytree(src, dest)
    target = dest / "checkpoint" / "step_000020.bin"
    expected = next(e["sha256"] for e in json.loads((dest / MANIFEST_JSON).read_text())["files"]
                    if e["path"] == "checkpoint/step_000020.bin")
    _flip_byte(target, 4096)
    with pytest.raises(IntegrityError) as info:
        verify_export(dest, model_factory=GPT_FACTORY)
    err = info.value
    assert err.exit_code == 1
    assert err.file == str(target) and err.expected == expected
    import hashlib

    assert err.found == hashlib.sha256(target.read_bytes()).hexdigest()
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "-c", "--quiet", MANIFEST_SHA], cwd=dest, capture_output=True).returncode != 0

    # an edited config.json is caught too; a missing MANIFEST.sha256 means an incomplete export
    shutil.rmtree(dest)
    shutil.copytree(src, dest)
    (dest / "config.json").write_text((dest / "config.json").read_text().replace('"n_layer": 2', '"n_layer": 3'))
    with pytest.raises(IntegrityError, match="config.json|size mismatch"):
        verify_export(dest, model_factory=GPT_FACTORY)
    (dest / MANIFEST_SHA).unlink()
    with pytest.raises(IntegrityError, match="not a complete export"):
        verify_export(dest, model_factory=GPT_FACTORY)


@pytest.mark.parametrize("version", ["1e400", "-1", "2", "true", '"1"'])
def test_a_manifest_of_an_unknown_version_is_refused_even_with_its_hash_recomputed(bundle, tmp_path, version):
    """MANIFEST.sha256 holds a plain sha256: an attacker recomputes it. The manifest's own
    format_version must still be the one this ripresa reads, else verify refuses (exit 1)."""
    import hashlib

    src, _ = bundle
    dest = tmp_path / "copy"
    shutil.copytree(src, dest)
    doc = (dest / MANIFEST_JSON).read_text()
    doc = doc.replace('"format_version": 1', f'"format_version": {version}', 1)
    (dest / MANIFEST_JSON).write_text(doc)
    lines = (dest / MANIFEST_SHA).read_text().splitlines()
    digest = hashlib.sha256(doc.encode()).hexdigest()
    (dest / MANIFEST_SHA).write_text("".join(
        f"{digest}  {MANIFEST_JSON}\n" if line.endswith(MANIFEST_JSON) else line + "\n" for line in lines))
    with pytest.raises(IntegrityError, match="format_version") as info:
        verify_export(dest, model_factory=GPT_FACTORY)
    assert info.value.exit_code == 1


@pytest.mark.slow
def test_a_failed_reload_leaves_no_complete_looking_bundle(run_dir, tmp_path, monkeypatch):
    import ripresa.tools.export_bin as export_mod

    def broken(model, where):
        raise IntegrityError("the reloaded model gives non-finite logits", file=where)

    monkeypatch.setattr(export_mod, "_probe_forward", broken)
    dest = tmp_path / "dest"
    with pytest.raises(IntegrityError) as info:
        export_run(run_dir, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert MANIFEST_SHA in (info.value.hint or "")
    assert not (dest / MANIFEST_SHA).exists()
    with pytest.raises(IntegrityError, match="not a complete export"):
        verify_export(dest, model_factory=GPT_FACTORY)


# ----------------------------------------------------------------------------- inference export


@pytest.mark.slow
def test_inference_export_loads_with_safetensors_and_generates(run_dir, tmp_path, monkeypatch, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    dest = tmp_path / "inference"
    report = export_run(run_dir, dest, model_factory=GPT_FACTORY, inference=True, show_progress=False)
    assert report["kind"] == "inference" and report["verified"] and report["step"] == 20
    reload = report["verification"]["reload"]
    assert reload["bit_identical_to_source"] is True and len(reload["sample"]["completion"]) > 0
    assert sorted(os.listdir(dest)) == sorted(["MANIFEST.json", "MANIFEST.sha256", "README.md", "config.json",
                                               "export.json", "model.safetensors"])
    assert not list(dest.rglob("*.bin")), "an inference export holds no resume checkpoint"

    tensors = load_file(str(dest / "model.safetensors"))
    model = _model_of(dest)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    model.load_state_dict(tensors, strict=True)
    ref = read_bin(run_dir / "step_000020.bin")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert np.array_equal(flat, ref.weights)
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    marker = (run_dir / "step_000020.bin.sha256").read_text().split()[0]
    assert meta["step"] == "20" and meta["source_bin_sha256"] == marker and meta["ripresa"]
    out = model.generate(torch.tensor([list(b"def ")]), 12, generator=torch.Generator().manual_seed(1))
    assert out.shape == (1, 16) and int(out.min()) >= 0 and int(out.max()) < 256

    readme = (dest / "README.md").read_text()
    assert "not a resume checkpoint" in readme and "load_file" in readme
    monkeypatch.chdir(dest)
    exec(compile(_snippet(readme, "load-safetensors"), "README.md:load-safetensors", "exec"), {})
    assert capsys.readouterr().out.startswith("The ")
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "-c", MANIFEST_SHA], cwd=dest, capture_output=True).returncode == 0

    with pytest.raises(OutputExists):  # the destination is now full
        export_run(run_dir, dest, model_factory=GPT_FACTORY, inference=True, show_progress=False)


# ----------------------------------------------------------------------------- the proof of resume


@pytest.mark.slow
def test_training_resumes_from_the_bundle_following_its_readme(bundle, run_dir, tmp_path):
    """The README's resume recipe, run for real: the bundle continues exactly like the run it came from."""
    dest, _ = bundle
    before = tree_digest(dest)
    readme = (dest / "README.md").read_text()
    block = re.search(r"## 4\. Resume.*?```sh\n(.*?)\n```", readme, re.S)
    assert block
    new = tmp_path / "resumed"
    for line in block.group(1).splitlines():
        line = line.split("#")[0].strip()
        if line.startswith(("mkdir", "cp")):
            res = subprocess.run(line.replace("runs/resumed", str(new)), shell=True, cwd=dest, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr
    original = tmp_path / "original"
    shutil.copytree(run_dir, original)
    args = ("--quiet", "--threads", "1", "--steps", "22", "--no-audit")  # --steps: the run's end step
    res = ripresa_cli("train", "--run", new, *args, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"resumed {new} at step 20" in res.stdout
    res = ripresa_cli("train", "--run", original, *args, timeout=120)
    assert res.returncode == 0, res.stderr

    def steps(run: Path) -> dict[int, tuple]:
        out = {}
        for line in (run / ".loss.jsonl").read_text().splitlines():
            obj = json.loads(line)
            if "loss" in obj:
                out[obj["step"]] = (obj["loss"], obj["lr"], obj["arm"], obj["tokens"])
        return out

    resumed, continued = steps(new), steps(original)
    assert sorted(resumed)[-2:] == [21, 22]
    assert resumed == continued, "the bundle must continue exactly like the run folder it was exported from"
    assert tree_digest(dest) == before, "resuming from a copy leaves the bundle untouched"


@pytest.mark.slow
def test_pivoted_and_forked_runs_export_archive_lineage_and_notes(run_dir, tmp_path):
    from ripresa.engine.fork import fork
    from ripresa.engine.pivot import pivot

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    pivot(run, caps=["stdlib-code=0.5"])  # moves .state.json into archive/pivot_000020/, edits config.json
    dest = tmp_path / "pivoted"
    report = export_run(run, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert (dest / "metrics/archive/pivot_000020/state.json").read_bytes() == \
        (run / "archive/pivot_000020/.state.json").read_bytes()
    assert not (dest / "metrics/state.json").exists()
    assert (dest / "config.json").read_bytes() == (run / "config.json").read_bytes()
    assert any("differs from the config this generation was saved with" in n for n in report["notes"])
    assert verify_export(dest, model_factory=GPT_FACTORY)["verified"]

    child = tmp_path / "child"
    fork(run_dir, 10, child)
    dest = tmp_path / "forked"
    report = export_run(child, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert report["step"] == 10
    assert (dest / "lineage.json").read_bytes() == (child / "lineage.json").read_bytes()
    assert "lineage.json" in (dest / "README.md").read_text()


def test_a_run_of_another_training_script_exports_without_a_forward_pass(tmp_path, monkeypatch, capsys):
    """A Checkpointer run of a plain torch model: the bundle verifies, the numpy reader still works."""
    from support.tiny import tiny_state

    import ripresa

    state = tiny_state((4, 2), lr=1e-2)
    model, opt = state.model, state.optimizer
    run = tmp_path / "plain"
    ckpt = ripresa.Checkpointer(run, state, every=5,
                                asynchronous=False, handle_signals=False, format="andrea")  # export reads a .bin
    for step in range(ckpt.resume() + 1, 11):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step_done(step, loss=float(loss.detach()))
    ckpt.close()
    dest = tmp_path / "dest"
    report = export_run(run, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert report["verified"] and report["step"] == 10
    assert report["verification"]["reload"]["forward"].startswith("skipped")
    assert not (dest / "parameters.json").exists()
    readme = (dest / "README.md").read_text()
    assert "Checkpointer" in readme and "ripresa train --run" not in readme
    monkeypatch.chdir(dest)
    ns: dict = {}
    exec(compile(_snippet(readme, "numpy-read"), "README.md:numpy-read", "exec"), ns)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert ns["step"] == 10 and np.array_equal(ns["weights"], flat)


# ---- the READMEs come from package data, byte for byte what the f-strings wrote -------------

README_GOLDEN = Path(__file__).parent / "data" / "export_readme"


def _readme_cases():
    """The fixed inputs whose READMEs were captured (tests/data/export_readme/) before the text moved
    from f-strings in tools/export.py to tools/templates/export_readme.md."""
    from ripresa.store.store import Generation

    run = Path("/data/runs/andrea")
    gen = Generation(step=1200, kind="bin", path=run / "step_001200.bin", companion=run / "step_001200.json",
                     marker=run / "step_001200.bin.sha256", valid=True, size=8 + 12 * 137000,
                     files={"step_001200.bin": "ab" * 32, "step_001200.json": "cd" * 32})
    params = [{"name": "transformer.wte.weight", "shape": [256, 64], "offset": 0, "numel": 16384}]
    config = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 128}, "train": {"lr": 0.001}}
    state = {"versions": {"device": "cpu", "torch": "2.13.0", "python": "3.11.9"}}
    src = [{"name": "stdlib-code", "path": None, "kind": "builtin", "sha256": "ef" * 32},
           {"name": "mine", "path": "/home/u/texts", "kind": "text folder", "sha256": None}]
    metrics = ["metrics/loss.jsonl", "metrics/samples.json", "metrics/state.json", "metrics/archive/pivot_000100/"]
    common = {"run": run, "gen": gen, "n_params": 137000, "created": "2025-01-02T03:04:05Z"}
    yield "resume_gpt_full", "resume", {**common, "progress": {"step": 1200, "epoch": 0, "samples_seen": 38400,
                                                               "tokens_seen": 4915200},
                                        "params": params, "metrics": metrics, "has_lineage": True, "config": config,
                                        "state": state, "sources": src}
    yield "resume_gpt_bare", "resume", {**common, "progress": {}, "params": params, "metrics": [],
                                        "has_lineage": False, "config": config, "state": {}, "sources": []}
    yield "resume_own_model", "resume", {**common, "progress": {"step": 1200, "lr": 0.5}, "params": None,
                                         "metrics": ["metrics/loss.jsonl"], "has_lineage": False,
                                         "config": {"lr": 1}, "state": state, "sources": src[1:]}
    yield "resume_no_config", "resume", {**common, "progress": {"step": 3}, "params": None, "metrics": [],
                                         "has_lineage": True, "config": None, "state": state, "sources": src[:1]}
    yield "inference", "inference", {**common, "shapes": [("transformer.wte.weight", [256, 64]),
                                                          ("lm_head.weight", [256, 64])],
                                     "model_cfg": config["model"], "config": config}


@pytest.mark.parametrize("case", [c[0] for c in _readme_cases()])
def test_readme_text_from_package_data_is_byte_identical_to_the_former_fstrings(case):
    from ripresa._version import __version__
    from ripresa.tools import export_readme

    _, kind, kwargs = next(c for c in _readme_cases() if c[0] == case)
    render = export_readme.resume_readme if kind == "resume" else export_readme.inference_readme
    expected = (README_GOLDEN / f"{case}.md").read_text(encoding="utf-8").replace("{{version}}", __version__)
    assert render(**kwargs) == expected
