"""``ripresa rehearse RUN`` (docs/OPERATIONS.md, "Rehearse the rental's cycle at the start").

A real tiny ``ripresa train --mirror`` run (a local-path mirror) is rehearsed through the CLI: exit 0, a report
with each step's time and bytes, the run folder and the mirror byte-identical before and after, the scratch
prefix gone. The comparison is real: a companion whose random streams differ is caught (default tier), and a
rehearsal whose resume omits the RNG restore exits 1 (slow). No mirror, or a store that cannot be reached, is
exit 2 with a hint. The S3 sample (slow) runs against the real moto server of tests/support/s3fixtures.py.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import time

import pytest
from conftest import ripresa_cli, tree_digest

from ripresa.cli import main
from ripresa.engine.rehearse import RehearsalWarning, compare_generations, scratch_for, verdict
from ripresa.errors import BadInput

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3

CYCLE_STEPS = ("save", "stop", "upload", "pull", "resume", "compare")


def _train(run, mirror):
    """``ripresa train --mirror``: the tiny GPT on one small text (its config.json says so, and every trainer the
    rehearsal starts reads it: no built-in source to build in each of them)."""
    text = run.parent / "text.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text(inspect.getsource(json.decoder) * 3)
    res = ripresa_cli("train", "--run", run, "--config", "tiny", "--steps", "4", "--every", "2", "--mirror", mirror,
                      "--threads", "1", "--quiet", "--no-audit", "--set", "train.batch_size=4",
                      "--set", f'data.sources=["text={text}"]')
    assert res.returncode == 0, res.stderr
    return run


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """A real tiny run (generations 2 and 4) mirrored to a local folder: the user's run, never to be changed."""
    base = tmp_path_factory.mktemp("rehearse")
    return _train(base / "runs" / "gpt", base / "disk2" / "mirror"), base / "disk2" / "mirror"


def _rehearse(capsys, *args):
    capsys.readouterr()
    rc = main(["rehearse", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip() else None), err


def test_rehearse_a_mirrored_run_passes_times_each_step_and_touches_nothing(user_run, tmp_path, capsys):
    run, mirror = user_run
    before_run, before_mirror = tree_digest(run), tree_digest(mirror)
    out = tmp_path / "rehearsal"
    rc, report, err = _rehearse(capsys, run, "--steps", "2", "--threads", "1", "--output", out, "--deadline", "72h")
    assert rc == 0, err
    assert report["passed"] and report["compare"]["equal"] and report["exit_code"] == 0
    b = report["compare"]["bin_sha256"]
    assert b["uninterrupted"] == b["resumed"]
    assert report["start"] == {"source": "run", "step": 4}  # the run's newest generation
    s = report["stop_step"]
    assert s >= 6 and report["end_step"] == s + 2
    for name in CYCLE_STEPS + ("start", "export"):
        row = report["steps"][name]
        assert row["seconds"] >= 0 and row["bytes"] > 0, (name, row)
    assert report["steps"]["stop"]["seconds"] > 0 and report["steps"]["resume"]["seconds"] > 0
    gen_bytes = report["steps"]["save"]["bytes"]
    assert gen_bytes > 136_960 * 12  # weights, m and v of the tiny model, its companion and marker
    assert report["steps"]["upload"]["bytes"] >= gen_bytes - 4096 and report["steps"]["pull"]["bytes"] >= gen_bytes
    assert report["cycle"]["seconds"] == pytest.approx(sum(report["steps"][n]["seconds"] for n in ("stop", "pull", "resume")), abs=0.01)
    d = report["deadline"]
    assert d["fits"] is True and 0 < d["tail_s"] < d["left_s"] <= 72 * 3600
    assert report["verdict"].startswith("PASS") and " fit in the " in report["verdict"]
    assert "--no-audit" in report["flags"] and "--threads=1" in report["flags"]  # the run's own launch, and ours
    # never written: the run folder and the mirror, byte for byte
    assert tree_digest(run) == before_run and tree_digest(mirror) == before_mirror
    # the scratch prefix beside the mirror and the work folder are gone; the report stays
    assert report["cleaned"] == {"scratch": True, "work": True}
    assert not [p for p in mirror.parent.iterdir() if p.name != "mirror"], list(mirror.parent.iterdir())
    assert sorted(p.name for p in out.iterdir()) == ["rehearsal.json", "rehearsal.log"]
    assert json.loads((out / "rehearsal.json").read_text()) == report
    # the same measurements against a deadline 2 s away: the stop and export (and the 5 s margin) do not fit
    with pytest.warns(RehearsalWarning, match="are left before the deadline"):
        late = verdict(report, time.time() + 2)
    assert late["fits"] is False and late["deadline"]["tail_s"] == d["tail_s"] and "do NOT fit" in late["verdict"]
    assert late["exit_code"] == 0  # advice: the comparison decides the exit code


def _recommit_companion(run, step, edit):
    """Edit generation ``step``'s companion and rewrite its marker to match (a consistent, committed generation)."""
    comp, marker = run / f"step_{step:06d}.json", run / f"step_{step:06d}.bin.sha256"
    doc = json.loads(comp.read_text())
    edit(doc["state"])
    comp.write_text(json.dumps(doc))
    lines = [line.split("  ", 1) for line in marker.read_text().splitlines()]
    fixed = [f"{hashlib.sha256(comp.read_bytes()).hexdigest() if name == comp.name else sha}  {name}"
             for sha, name in lines]
    marker.write_text("\n".join(fixed) + "\n")


def test_the_comparison_catches_a_state_that_differs_only_in_a_random_stream(user_run, tmp_path):
    run, _ = user_run
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        for name in ("step_000004.bin", "step_000004.json", "step_000004.bin.sha256", "config.json"):
            shutil.copy(run / name, d / name)
    same = compare_generations(a, b, 4)
    assert same["equal"] and same["first_difference"] is None and same["bytes"] > 0

    def bump(state):
        state["rng"]["numpy"]["data"]["state"]["state"] += 1  # the crop stream, one draw's worth

    _recommit_companion(b, 4, bump)
    diff = compare_generations(a, b, 4)
    assert not diff["equal"]
    assert diff["bin_sha256"]["uninterrupted"] == diff["bin_sha256"]["resumed"]  # weights, m, v the same
    assert diff["first_difference"].startswith("state.rng.numpy.data")


def test_rehearse_without_a_mirror_is_exit_2_with_the_hint_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "runs" / "plain"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    out = tmp_path / "out"
    rc, report, err = _rehearse(capsys, run, "--output", out)
    assert rc == 2 and report is None
    assert "the run has no mirror" in err and "hint:" in err and "--mirror s3://bucket/prefix" in err
    assert "Traceback" not in err
    assert not out.exists() and sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_rehearse_with_a_store_that_cannot_be_reached_is_exit_2_typed(tmp_path, capsys, monkeypatch):
    pytest.importorskip("boto3")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)  # port 9 (discard): nothing listens, the connection is refused
    run = tmp_path / "run"
    run.mkdir()
    rc, report, err = _rehearse(capsys, run, "--mirror", "s3://bucket-x/runs/gpt", "--output", tmp_path / "out")
    assert rc == 2 and report is None
    assert "ripresa rehearse: error:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_scratch_prefix_is_beside_the_mirror_never_in_it(tmp_path, capsys):
    assert scratch_for(str(tmp_path / "m"), ".r1") == str(tmp_path / "m.r1")
    assert scratch_for("file:///disk/m", ".r1") == "file:///disk/m.r1"
    assert scratch_for("s3://bkt/runs/gpt", ".r1") == "s3://bkt/runs/gpt.r1"
    with pytest.raises(BadInput, match="whole bucket"):
        scratch_for("s3://bkt", ".r1")
    mirror = tmp_path / "m"
    mirror.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    rc, _, err = _rehearse(capsys, run, "--mirror", mirror, "--scratch", mirror / "inside", "--output", tmp_path / "o")
    assert rc == 2 and "overlaps the mirror" in err
    assert list(mirror.iterdir()) == [] and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_rehearse_with_the_rng_restore_omitted_fails_the_comparison_exit_1(user_run, tmp_path, capsys):
    run, mirror = user_run
    before_run, before_mirror = tree_digest(run), tree_digest(mirror)
    rc, report, err = _rehearse(capsys, run, "--steps", "2", "--threads", "1", "--output", tmp_path / "o",
                                "--omit-rng-restore")
    assert rc == 1, err
    assert not report["passed"] and not report["compare"]["equal"] and "FAIL" in report["verdict"]
    assert report["compare"]["bin_sha256"]["uninterrupted"] != report["compare"]["bin_sha256"]["resumed"]
    assert report["cleaned"] == {"scratch": True, "work": True}
    assert tree_digest(run) == before_run and tree_digest(mirror) == before_mirror


@pytest.mark.slow
def test_rehearse_an_s3_mirrored_run_against_the_real_server(tmp_path, s3, capsys):
    run = _train(tmp_path / "run", s3.url)
    keys = s3.keys()
    objects = {k: hashlib.sha256(s3.get(k)).hexdigest() for k in keys}
    rc, report, err = _rehearse(capsys, run, "--steps", "2", "--threads", "1", "--output", tmp_path / "o")
    assert rc == 0, err
    assert report["passed"] and report["scratch"].startswith(s3.url + ".rehearsal-")
    assert report["steps"]["upload"]["bytes"] > 0 and report["steps"]["pull"]["bytes"] > 0
    assert report["cleaned"]["scratch"] is True
    everything = s3.client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])
    assert not [o["Key"] for o in everything if not o["Key"].startswith(s3.prefix)]  # the scratch prefix is gone
    assert {k: hashlib.sha256(s3.get(k)).hexdigest() for k in s3.keys()} == objects  # the mirror untouched


@pytest.mark.slow
def test_rehearse_on_a_blank_machine_starts_from_the_mirror_and_creates_no_run_folder(user_run, tmp_path, capsys):
    _, mirror = user_run
    before = tree_digest(mirror)
    blank = tmp_path / "runs" / "gpt"
    rc, report, err = _rehearse(capsys, blank, "--mirror", mirror, "--steps", "2", "--output", tmp_path / "o")
    assert rc == 0, err
    assert report["start"] == {"source": "mirror", "step": 4} and report["passed"]
    assert "--no-audit" in report["flags"]  # the launch record of the history the pull restored
    assert not blank.exists() and tree_digest(mirror) == before
    assert report["cleaned"] == {"scratch": True, "work": True}
