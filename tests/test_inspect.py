"""``ripresa inspect``: .bin, checkpoint.pt and run folders; reports, JSON keys and exit codes.

Fixtures are real files written by the library (CheckpointStore, the
reference exercise) or by hand in the ANDREA layout (a "foreign" .bin);
exit codes are checked on real ``python -m ripresa inspect`` processes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ripresa_cli
from support.helpers import arrays_for, small_companion

from ripresa.errors import BadInput
from ripresa.formats.andrea_bin import describe_missing
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore, generation_paths
from ripresa.tools import inspect as insp

TOP_KEYS = {
    "schema", "schema_version", "path", "kind", "ok", "exit_code", "problems", "warnings", "notes",
    "options", "error", "bin", "checkpoint", "run", "safetensors", "dcp", "shards", "fingerprint",
}
STATS_KEYS = {"count", "finite", "nan", "posinf", "neginf", "min", "max", "mean", "std", "first_nonfinite"}
BIN_KEYS = {
    "file", "size", "expected_size", "size_ok", "header", "name_step", "sha256", "full_pass", "sidecar",
    "companion", "lacks", "regions", "finite",
}
PT_KEYS = {
    "file", "size", "sidecar", "schema_ok", "progress", "versions", "code", "data_identity", "config", "lineage",
    "extra_keys", "model", "optimizer", "scheduler", "scaler", "data", "rng", "objects", "finite",
}
RUN_KEYS = {"folder", "generations", "resume_step", "lock", "temporaries", "finite", "memory"}
GEN_KEYS = {"step", "valid", "reason", "size", "deep_checked", "resume", "files", "kind", "checks"}


def make_run(folder, steps=(1, 2, 3), n=3000, arrays=arrays_for):
    with CheckpointStore(folder, retention=KeepLast(10)) as store:
        for s in steps:
            store.save(s, arrays(s, n), small_companion(s))
    return folder


def write_foreign_bin(path, step, w, m, v):
    """A .bin as another engine writes it: the bytes only, no sidecar, no companion."""
    path.write_bytes(struct.pack("<ii", step, w.size) + w.tobytes() + m.tobytes() + v.tobytes())
    return path


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def cli_json(*args):
    res = ripresa_cli("inspect", *args, "--json")
    return res, json.loads(res.stdout)


def render(report) -> str:
    """The human output of a report, as plain text."""
    from rich.console import Console

    buf = io.StringIO()
    insp.render_report(report, Console(file=buf, width=200, color_system=None))
    return buf.getvalue()


def expected_stats(a):
    x = np.asarray(a, dtype=np.float64)
    return {"min": float(x.min()), "max": float(x.max()), "mean": float(x.mean()), "std": float(x.std())}


def assert_stats(got, arr):
    exp = expected_stats(arr)
    assert set(got) == STATS_KEYS
    assert got["count"] == arr.size and got["finite"] == arr.size
    assert got["nan"] == got["posinf"] == got["neginf"] == 0 and got["first_nonfinite"] is None
    for k, val in exp.items():
        assert got[k] == pytest.approx(val, rel=1e-12, abs=1e-15), k


# ---- .bin ----------------------------------------------------------------------------


def test_valid_bin_statistics_match_numpy_across_blocks(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run", steps=(7,), n=5000)
    import ripresa.tools.inspect_bin as inspect_bin

    monkeypatch.setattr(inspect_bin, "STAT_BLOCK", 777)  # several blocks per region, a short last one
    report = insp.inspect_path(run / "step_000007.bin")
    assert report["exit_code"] == 0 and report["ok"] and report["problems"] == [] and report["warnings"] == []
    b = report["bin"]
    assert b["header"] == {"step": 7, "n_params": 5000} and b["size"] == b["expected_size"] == 8 + 12 * 5000
    exp = arrays_for(7, 5000)
    for name in ("weights", "m", "v"):
        assert_stats(b["regions"][name], getattr(exp, name)[0])
    # the two lines of the generation's commit marker are both checked
    assert b["sidecar"]["kind"] == "generation-marker"
    assert [(line["name"], line["ok"]) for line in b["sidecar"]["lines"]] == [
        ("step_000007.bin", True), ("step_000007.json", True)]
    assert b["sidecar"]["lines"][0]["actual"] == b["sha256"]
    assert b["companion"]["present"] and b["companion"]["disagreements"] == []
    assert b["companion"]["progress"] == {"step": 7} and b["lacks"] == []


def test_valid_bin_cli_json_has_documented_keys_and_exit_0(tmp_path):
    run = make_run(tmp_path / "run", steps=(4,), n=1000)
    res, doc = cli_json(run / "step_000004.bin")
    assert res.returncode == 0, res.stderr
    assert set(doc) == TOP_KEYS and doc["kind"] == "bin" and doc["ok"] is True
    assert doc["schema"] == "ripresa.tools.inspect" and doc["schema_version"] == 1
    assert doc["checkpoint"] is None and doc["run"] is None
    assert set(doc["bin"]) == BIN_KEYS
    assert set(doc["bin"]["regions"]) == {"weights", "m", "v"}
    assert doc["bin"]["finite"] == {"checked": False, "ok": None}


@pytest.mark.slow
def test_foreign_bin_reports_what_it_lacks_exit_0_with_flags(tmp_path):
    g = np.random.default_rng(3)
    w, m, v = (g.standard_normal(2000).astype(np.float32) for _ in range(3))
    path = write_foreign_bin(tmp_path / "andrea.bin", 42, w, m, v)
    res = ripresa_cli("inspect", path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "lacks" in res.stdout and "random generator states" in res.stdout
    assert "no companion 'andrea.json'" in res.stdout and "no sha256 sidecar" in res.stdout
    report = insp.inspect_path(path)
    assert report["ok"] and len(report["warnings"]) == 2
    assert report["bin"]["lacks"] == describe_missing(path)
    assert report["bin"]["sidecar"]["present"] is False and report["bin"]["companion"]["present"] is False
    assert_stats(report["bin"]["regions"]["m"], m)


@pytest.mark.slow
def test_truncated_bin_exit_1_names_expected_and_actual_size(tmp_path):
    g = np.random.default_rng(1)
    w, m, v = (g.standard_normal(1000).astype(np.float32) for _ in range(3))
    path = write_foreign_bin(tmp_path / "cut.bin", 5, w, m, v)
    os.truncate(path, 12008 - 100)
    res = ripresa_cli("inspect", path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "truncated" in res.stdout and "12008" in res.stdout and "11908" in res.stdout
    report = insp.inspect_path(path)
    b = report["bin"]
    assert (b["size"], b["expected_size"], b["size_ok"]) == (11908, 12008, False)
    assert b["header"] == {"step": 5, "n_params": 1000} and b["regions"] is None
    assert report["error"]["error"] == "IntegrityError"


@pytest.mark.slow
def test_nan_is_a_warning_and_fails_with_check_finite(tmp_path):
    g = np.random.default_rng(2)
    w, m, v = (g.standard_normal(3000).astype(np.float32) for _ in range(3))
    m[123] = np.nan
    v[5], v[7] = np.inf, -np.inf
    path = write_foreign_bin(tmp_path / "nan.bin", 9, w, m, v)
    plain = insp.inspect_path(path)
    assert plain["exit_code"] == 0 and "--check-finite" in render(plain)
    res, doc = cli_json(path, "--check-finite")
    assert res.returncode == 1 and doc["exit_code"] == 1 and doc["bin"]["finite"] == {"checked": True, "ok": False}
    rm, rv = doc["bin"]["regions"]["m"], doc["bin"]["regions"]["v"]
    assert (rm["nan"], rm["finite"]) == (1, 2999)
    assert rm["first_nonfinite"]["index"] == 123 and rm["first_nonfinite"]["offset"] == 8 + 4 * 3000 + 4 * 123
    assert (rv["posinf"], rv["neginf"], rv["first_nonfinite"]["index"]) == (1, 1, 5)
    finite_m = m[np.isfinite(m)]
    assert rm["mean"] == pytest.approx(float(finite_m.astype(np.float64).mean()), rel=1e-12)
    assert any("m[123]" in p for p in doc["problems"])


def test_bin_with_changed_companion_fails_its_marker_line(tmp_path):
    run = make_run(tmp_path / "run", steps=(2,), n=500)
    _, comp, _ = generation_paths(run, 2)
    comp.write_bytes(comp.read_bytes().replace(b"generation 2", b"generation X"))
    report = insp.inspect_path(run / "step_000002.bin")
    assert report["exit_code"] == 1
    lines = {line["name"]: line["ok"] for line in report["bin"]["sidecar"]["lines"]}
    assert lines == {"step_000002.bin": True, "step_000002.json": False}


# ---- checkpoint.pt ---------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_pt_valid_report(interrupted_run):
    ck = interrupted_run / "checkpoint.pt"
    res, doc = cli_json(ck)
    assert res.returncode == 0, res.stderr
    assert set(doc) == TOP_KEYS and doc["kind"] == "checkpoint.pt" and set(doc["checkpoint"]) == PT_KEYS
    c = doc["checkpoint"]
    assert c["sidecar"]["ok"] is True and c["schema_ok"] is True
    assert c["progress"]["step"] == 5 and c["versions"]["torch"] == torch.__version__
    assert len(c["code"]["files_sha256"]) == 64 and set(c["data_identity"]) == {"rows"}
    state = torch.load(ck, map_location="cpu", weights_only=True)
    assert c["model"]["elements"] == sum(t.numel() for t in state["model"].values()) == 33
    m = np.concatenate([s["exp_avg"].reshape(-1).numpy() for s in state["optimizer"]["state"].values()])
    v = np.concatenate([s["exp_avg_sq"].reshape(-1).numpy() for s in state["optimizer"]["state"].values()])
    assert_stats(c["optimizer"]["state"]["m"], m)
    assert_stats(c["optimizer"]["state"]["v"], v)
    assert c["optimizer"]["steps"] == [5]
    human = render(doc)
    assert "step 5" in human and "optimizer m" in human and "OK" in human


@pytest.mark.slow
def test_checkpoint_pt_flipped_byte_exit_1(tmp_path, interrupted_run):
    shutil.copytree(interrupted_run, tmp_path / "run")
    ck = tmp_path / "run" / "checkpoint.pt"
    flip_byte(ck, ck.stat().st_size // 2)
    res = ripresa_cli("inspect", ck)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "sha256 mismatch" in res.stdout
    report = insp.inspect_path(ck)
    assert report["error"]["error"] == "IntegrityError" and report["checkpoint"]["sidecar"]["ok"] is False


@pytest.mark.slow
def test_checkpoint_pt_check_finite_names_the_tensor(tmp_path, interrupted_run):
    from ripresa.formats.torch_pt import load_checkpoint, save_checkpoint

    state = load_checkpoint(interrupted_run / "checkpoint.pt").state
    state["model"]["3.weight"].view(-1)[2] = float("nan")
    ck = tmp_path / "checkpoint.pt"
    save_checkpoint(ck, state)
    assert insp.inspect_path(ck)["exit_code"] == 0
    report = insp.inspect_path(ck, check_finite=True)
    assert report["exit_code"] == 1 and report["checkpoint"]["finite"] == {"checked": True, "ok": False}
    first = report["checkpoint"]["model"]["stats"]["first_nonfinite"]
    assert (first["where"], first["index"]) == ("model.3.weight", 2)


@pytest.mark.slow
def test_folder_with_only_a_checkpoint_pt_is_inspected_as_it(interrupted_run):
    report = insp.inspect_path(interrupted_run)
    assert report["kind"] == "checkpoint.pt" and report["exit_code"] == 0 and report["notes"]


# ---- run folders -----------------------------------------------------------------------


@pytest.mark.slow
def test_run_folder_damaged_newest_generation(tmp_path):
    run = make_run(tmp_path / "run")
    flip_byte(run / "step_000003.bin", 5000)  # inside the data: only a re-hash sees it
    res = ripresa_cli("inspect", run)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "INVALID" in res.stdout and "sha256 mismatch" in res.stdout
    assert "a resume would use generation 2" in res.stdout
    report = insp.inspect_path(run)
    assert set(report) == TOP_KEYS and set(report["run"]) == RUN_KEYS
    r = report["run"]
    assert r["resume_step"] == 2
    assert all(set(g) == GEN_KEYS for g in r["generations"])
    assert [(g["step"], g["valid"], g["resume"]) for g in r["generations"]] == [
        (1, True, False), (2, True, True), (3, False, False)]
    assert "sha256 mismatch" in r["generations"][2]["reason"]
    assert any("generation 3" in w for w in report["warnings"])
    # --no-deep does not re-hash: the flipped bit goes unnoticed (documented)
    shallow = insp.inspect_path(run, deep=False)
    assert shallow["run"]["resume_step"] == 3 and shallow["exit_code"] == 0


@pytest.mark.slow
def test_run_folder_truncated_newest_is_caught_even_without_deep(tmp_path):
    run = make_run(tmp_path / "run", steps=(1, 2))
    os.truncate(run / "step_000002.bin", 100)
    report = insp.inspect_path(run, deep=False)
    assert report["run"]["resume_step"] == 1 and report["exit_code"] == 0
    assert "truncated" in report["run"]["generations"][1]["reason"]


@pytest.mark.slow
def test_empty_folder_and_no_valid_generation_exit_1(tmp_path):
    (tmp_path / "empty").mkdir()
    res = ripresa_cli("inspect", tmp_path / "empty")
    assert res.returncode == 1 and "no generation" in res.stdout
    run = make_run(tmp_path / "run", steps=(1,))
    (run / "step_000001.bin.sha256").unlink()  # uncommitted
    report = insp.inspect_path(run)
    assert report["exit_code"] == 1 and report["run"]["resume_step"] is None
    assert "missing commit marker" in report["run"]["generations"][0]["reason"]


@pytest.mark.slow
def test_run_folder_check_finite_checks_the_resume_generation(tmp_path):
    def nan_arrays(step, n):
        a = arrays_for(step, n)
        a.v[0][17] = np.nan
        return a

    run = make_run(tmp_path / "run", steps=(1,), n=400, arrays=nan_arrays)
    assert insp.inspect_path(run)["exit_code"] == 0
    report = insp.inspect_path(run, check_finite=True)
    assert report["exit_code"] == 1 and report["run"]["finite"]["ok"] is False
    assert report["run"]["finite"]["regions"]["v"]["first_nonfinite"]["index"] == 17


@pytest.mark.slow
def test_lock_holder_and_leftover_temporaries_are_reported(tmp_path):
    run = make_run(tmp_path / "run", steps=(1,), n=100)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    temp = run / f".step_000002.bin.tmp.{dead.pid}.0123abcd"
    with CheckpointStore(run, retention=KeepLast(10)):  # a live writer: this test process
        temp.write_bytes(b"x" * 10)  # after the writer's start, which cleans leftovers
        res, doc = cli_json(run)
    assert res.returncode == 0, res.stdout + res.stderr
    human = render(doc)
    assert f"LOCK held by a live writer: pid {os.getpid()}" in human and temp.name in human and "dead (leftover)" in human
    lock = doc["run"]["lock"]
    assert lock["held"] is True and lock["pid"] == os.getpid()
    assert doc["run"]["temporaries"] == [{"name": temp.name, "size": 10, "pid": dead.pid, "writer_alive": False}]


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.slow
def test_missing_path_exit_2(tmp_path):
    res, doc = cli_json(tmp_path / "nope")
    assert res.returncode == 2 and "does not exist" in res.stderr and "nope" in res.stderr
    assert set(doc) == TOP_KEYS
    assert doc["kind"] is None and doc["exit_code"] == 2 and doc["error"]["error"] == "BadInput"


@pytest.mark.slow
def test_unknown_kind_exit_2(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    res = ripresa_cli("inspect", tmp_path / "notes.txt")
    assert res.returncode == 2 and "unknown kind" in res.stderr and "notes.txt" in res.stderr
    with pytest.raises(BadInput):
        insp.inspect_path(tmp_path / "nope")


@pytest.mark.slow
def test_run_folder_with_dcp_generations(tmp_path):
    """An FSDP2 run folder: `ripresa inspect` lists its .dcp generations and the one a resume uses."""
    from ripresa.formats import dcp as dcp_fmt
    from ripresa.store import dcp as store_dcp

    for s in (2, 4):
        part = dcp_fmt.partial_path(tmp_path, s)
        dcp_fmt.save_shards(torch.nn.Linear(1, 3, bias=False), None, part, no_dist=True)  # a real tiny DCP save
        assert store_dcp.commit_dcp(tmp_path, s, part, world_size=1, n_params=3, state={"progress": {"step": s}}).valid
    shard = tmp_path / "step_000004.dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-5] + b"xxxxx")  # damaged newest (same size)
    res = ripresa_cli("inspect", tmp_path, "--json")
    report = json.loads(res.stdout)
    assert res.returncode == 0, res.stderr
    gens = report["run"]["generations"]
    assert [(g["step"], g["kind"], g["valid"]) for g in gens] == [(2, "dcp", True), (4, "dcp", False)]
    assert report["run"]["resume_step"] == 2 and "sha256" in gens[1]["reason"]
