"""Hostile run folders: one way to open a file (issue #10, classes 4, 5, 6).

Every file of a run folder, bundle or ledger is opened through
:func:`ripresa.io.fsio.open_run_file` / :func:`ripresa.io.fsio.read_small`:
symlinks are refused, FIFOs never block, sizes are bounded before any
allocation (``docs/FAULTS.md``).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from ripresa.engine.gpt.factory import GPT_FACTORY
from ripresa.errors import BadInput, IntegrityError
from ripresa.io import fsio

MODES = ("read", "append", "create_append")


def _make(kind: str, path: Path, outside: Path) -> None:
    if kind == "symlink":
        outside.write_bytes(b'{"secret": 1}\n')
        os.symlink(outside, path)
    elif kind == "dangling":
        os.symlink(outside, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    else:  # pragma: no cover
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["symlink", "dangling", "fifo", "folder", "socket"])
@pytest.mark.parametrize("mode", MODES)
def test_open_run_file_refuses_what_is_not_a_regular_file(tmp_path, kind, mode):
    target = tmp_path / "run" / "f.json"
    target.parent.mkdir()
    outside = tmp_path / "private.txt"
    _make(kind, target, outside)
    before = outside.read_bytes() if outside.exists() else None
    with pytest.raises(IntegrityError) as info:
        fsio.open_run_file(target, "test file", mode=mode, error=IntegrityError)
    err = info.value
    assert err.file == str(target) and err.found and err.hint
    # nothing was created or appended outside the folder
    assert (outside.read_bytes() if outside.exists() else None) == before


def test_open_run_file_appends_and_creates(tmp_path):
    p = tmp_path / "h.jsonl"
    fd = fsio.open_run_file(p, "history", mode="create_append")
    os.write(fd, b"a\n")
    os.close(fd)
    fd = fsio.open_run_file(p, "history", mode="append")
    os.write(fd, b"b\n")
    os.close(fd)
    assert p.read_bytes() == b"a\nb\n"
    with pytest.raises(BadInput, match="not found"):
        fsio.open_run_file(tmp_path / "missing", "history", mode="append")


def test_read_small_bounds_before_reading(tmp_path):
    p = tmp_path / "big.json"
    with open(p, "wb") as f:
        f.truncate(1 << 30)  # sparse 1 GiB: refused from its size, never read
    with pytest.raises(BadInput, match="too large") as info:
        fsio.read_small(p, "config", 1 << 20)
    assert str(1 << 30) in info.value.found
    q = tmp_path / "ok"
    q.write_bytes(b"x" * 10)
    assert fsio.read_small(q, "ok", 10) == b"x" * 10
    with pytest.raises(BadInput):
        fsio.read_small(q, "ok", 9)


@pytest.mark.parametrize(
    "content",
    [b"[" * 200_000 + b"]" * 200_000, b"\xff\xfe{}", b"{", b'{"a": 1} x', b"NaN-nope"],
)
def test_read_json_small_maps_every_parse_failure(tmp_path, content):
    p = tmp_path / "x.json"
    p.write_bytes(content)
    with pytest.raises(IntegrityError) as info:
        fsio.read_json_small(p, "manifest", 1 << 20, error=IntegrityError)
    assert info.value.file == str(p) and info.value.hint


@pytest.mark.parametrize(
    "name",
    [
        ".a.bin.tmp.99999999999999999999999.0123abcd",
        ".a.bin.tmp." + "9" * 200 + ".0123abcd",
        ".a.bin.tmp.0.0123abcd",
        ".a.bin.tmp.00012.0123abcd",
        ".a.bin.tmp.4194305.0123abcd",
    ],
)
def test_temp_names_out_of_range_are_not_ours(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(b"x")
    assert not fsio.is_temp_name(name)
    assert fsio.temp_name_pid(name) is None
    assert fsio.clean_temporaries(tmp_path) == []
    assert fsio.clean_temporaries(tmp_path, only_dead=False) == []
    assert p.exists()


def test_temp_name_of_a_dead_writer_is_cleaned(tmp_path):
    name = fsio.temp_name_for(tmp_path / "a.bin").name
    dead = name.replace(f".tmp.{os.getpid()}.", ".tmp.4194304.")
    (tmp_path / dead).write_bytes(b"x")
    assert fsio.temp_name_pid(dead) == 4194304
    assert fsio.clean_temporaries(tmp_path) == [tmp_path / dead]


# ---- the history, .loss.jsonl -------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "dangling", "fifo", "folder", "socket"])
def test_history_writer_refuses_what_is_not_a_regular_file(tmp_path, kind):
    from ripresa.store.history import History

    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "outside.jsonl"
    _make(kind, run / ".loss.jsonl", outside)
    before = outside.read_bytes() if outside.exists() else None
    with pytest.raises(BadInput) as info:
        History(run / ".loss.jsonl")
    assert info.value.file == str(run / ".loss.jsonl")
    assert (outside.read_bytes() if outside.exists() else None) == before


def test_history_torn_line_repair_reads_the_file_it_appends_to(tmp_path):
    from ripresa.store.history import History, read_history

    p = tmp_path / ".loss.jsonl"
    p.write_bytes(b'{"step":1,"loss":2.0}\n{"step":2,"lo')
    h = History(p)
    assert h.repaired_torn_line
    h.step(2, loss=1.5)
    h.close()
    view = read_history(p)
    assert sorted(view.steps) == [1, 2] and view.skipped_lines == [2]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_history_readers_refuse_links_and_fifos(tmp_path, kind):
    from ripresa.store.history import iter_lines, read_history

    p = tmp_path / ".loss.jsonl"
    _make(kind, p, tmp_path / "outside.jsonl")
    with pytest.raises(BadInput):
        read_history(p)
    with pytest.raises(BadInput):
        list(iter_lines(p))


def test_history_reader_skips_and_counts_long_and_out_of_range_lines(tmp_path):
    from ripresa.store.history import MAX_LINE, HistoryReader, read_history

    p = tmp_path / ".loss.jsonl"
    lines = [
        b'{"step":1,"loss":3.0}',
        b'{"step":2,"loss":"' + b"x" * (MAX_LINE + 10) + b'"}',  # over-long
        b'{"step":1e400,"loss":1.0}',  # inf step
        b'{"step":' + b"1" + b"0" * 400 + b',"loss":1.0}',  # int beyond 2**63
        b'{"step":3,"loss":' + b"9" * 400 + b"}",  # loss beyond 2**63: float() would overflow
        b'{"step":' + b"9" * 5000 + b"}",  # beyond int-from-str digit limit
        b'{"step":4,"loss":2.0}',
        b"[" * 100_000,  # deep nesting
        b'{"event":"x","deep":' + b"[" * 900 + b"1" + b"]" * 900 + b"}",
        b'{"step":5,"loss":1.0}',
    ]
    p.write_bytes(b"\n".join(lines) + b"\n" + b"y" * (MAX_LINE + 5))  # an over-long torn tail
    view = read_history(p)
    assert sorted(view.steps) == [1, 4, 5]
    assert view.skipped_long_lines == 2
    assert view.skipped_out_of_range == 3
    assert view.lines == len(lines) + 1
    reader = HistoryReader(p)
    got = list(reader)
    assert [no for no, _ in got] == list(range(1, len(lines) + 2))
    assert reader.long_lines == 2


def test_history_reader_small_line_limit_streams(tmp_path):
    """The limit holds across read chunks: a line straddling many chunks is skipped, the next one read."""
    from ripresa.store.history import HistoryReader

    p = tmp_path / ".loss.jsonl"
    p.write_bytes(b'{"step":1}\n' + b"z" * (3 << 20) + b'\n{"step":2}\n')
    reader = HistoryReader(p, max_line=64)
    got = [obj for _, obj in reader]
    assert got == [{"step": 1}, None, {"step": 2}]
    assert reader.long_lines == 1


_RSS_CHILD = r"""
import resource, sys
from ripresa.store.history import read_history
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
view = read_history(sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(after - before, view.skipped_long_lines, sorted(view.steps))
"""


def test_sparse_gigabyte_history_line_stays_in_bounded_memory(tmp_path):
    """A single 1 GiB line (a few KB on disk when sparse) never lives in memory whole."""
    import subprocess
    import sys

    p = tmp_path / ".loss.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"step":1,"loss":1.0}\n')
        f.truncate(1 << 30)
        f.seek(0, os.SEEK_END)
        f.write(b'\n{"step":2,"loss":0.5}\n')
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(p)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grew_kib, long_lines, steps = out.stdout.split(maxsplit=2)
    assert int(long_lines) == 1 and steps.strip() == "[1, 2]"
    assert int(grew_kib) < 64 * 1024, f"reader grew by {grew_kib} KiB"


# ---- real runs: export, export --verify, fork, train --run ------------------------

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

KEY = "0123456789abcdef0123456789abcdef"
SECRET = b"PRIVATE-SECRET-never-in-a-bundle\n"
FAST = ["--quiet", "--threads", "1", "--set", "train.batch_size=4"]


def _cli(*args, env=None, timeout=120):
    full = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COLUMNS="200")
    full.pop("RIPRESA_HMAC_KEY_FILE", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "ripresa", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full)


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory):
    """A real, signed 20-step run (generations 10 and 20) with an archived phase and a lineage."""
    run = tmp_path_factory.mktemp("signed") / "run"
    res = _cli("train", "--run", run, "--config", "tiny", *FAST, "--steps", "20", "--every", "10", "--no-audit",
               env={"RIPRESA_HMAC_KEY": KEY})
    assert res.returncode == 0, res.stderr
    assert (run / "step_000020.bin.hmac").is_file()
    phase = run / "archive" / "pivot_000010"
    phase.mkdir(parents=True)
    shutil.copy(run / ".state.json", phase / ".state.json")
    (run / "lineage.json").write_text('{"parent_run": "x", "step": 10}\n')
    return run


@pytest.fixture
def run_copy(signed_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(signed_run, dst, symlinks=True)
    return dst


def _no_secret_under(folder: Path) -> None:
    if not folder.exists():
        return
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert SECRET not in p.read_bytes(), p


def _no_traceback(res) -> None:
    assert "Traceback" not in res.stderr, res.stderr


@pytest.mark.slow
def test_export_and_fork_carry_the_signature(run_copy, tmp_path):
    from ripresa.tools.export import export_run

    report = export_run(run_copy, tmp_path / "bundle", model_factory=GPT_FACTORY, show_progress=False)
    sig = "checkpoint/step_000020.bin.hmac"
    assert sig in {f["path"] for f in report["files"]}
    assert (tmp_path / "bundle" / sig).read_bytes() == (run_copy / "step_000020.bin.hmac").read_bytes()
    res = _cli("fork", run_copy, "--step", "20", "--into", tmp_path / "fork")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "fork" / "step_000020.bin.hmac").read_bytes() == (run_copy / "step_000020.bin.hmac").read_bytes()
    # the fork's generation verifies under --require-signature with the run's key
    for target in (tmp_path / "fork" / "step_000020.bin", tmp_path / "bundle" / "checkpoint" / "step_000020.bin"):
        res = _cli("inspect", "--require-signature", target, env={"RIPRESA_HMAC_KEY": KEY})
        assert res.returncode == 0, res.stdout + res.stderr


SLOW = pytest.mark.slow
HOSTILE_EXPORT_FILES = [".state.json"] + [pytest.param(n, marks=SLOW) for n in (
    ".samples.json", "lineage.json", "config.json", ".loss.jsonl", "archive/pivot_000010/.state.json",
    "archive/pivot_000010", "archive", "step_000020.bin.hmac")]


@pytest.mark.parametrize("name", HOSTILE_EXPORT_FILES)
def test_export_refuses_a_symlink_and_leaks_nothing(run_copy, tmp_path, name):
    from ripresa.tools.export import export_run

    private = tmp_path / "private"
    private.mkdir()
    (private / "secret.txt").write_bytes(SECRET)
    (private / ".state.json").write_bytes(SECRET)
    target = run_copy / name
    if target.is_dir():
        shutil.rmtree(target)
        os.symlink(private, target)
    else:
        if not target.exists():
            (run_copy / ".samples.json").write_text('{"phase": 0, "audits": []}\n')
        target.unlink()
        os.symlink(private / "secret.txt", target)
    dest = tmp_path / "bundle"
    with pytest.raises((BadInput, IntegrityError)) as info:
        export_run(run_copy, dest, model_factory=GPT_FACTORY, show_progress=False)
    assert "symlink" in (str(info.value.found) + info.value.message)
    _no_secret_under(dest)
    assert not (dest / "MANIFEST.sha256").exists()


@pytest.mark.parametrize("name", [".state.json"] + [pytest.param(n, marks=SLOW) for n in (
    ".loss.jsonl", "lineage.json", "config.json", ".samples.json")])
def test_export_refuses_a_fifo_without_hanging(run_copy, tmp_path, name):
    (run_copy / name).unlink(missing_ok=True)  # a short run may have written no .samples.json: export reads it if present
    os.mkfifo(run_copy / name)
    res = _cli("export", run_copy, "--to", tmp_path / "bundle", timeout=120)
    assert res.returncode == 2, res.stderr
    _no_traceback(res)
    assert "FIFO" in res.stderr


@pytest.mark.parametrize("rel", ["metrics/state.json", pytest.param("MANIFEST.json", marks=SLOW)])
def test_export_verify_fails_on_a_bundle_holding_a_symlink(run_copy, tmp_path, rel):
    from ripresa.tools.export import export_run

    dest = tmp_path / "bundle"
    export_run(run_copy, dest, model_factory=GPT_FACTORY, show_progress=False)
    if True:
        d2 = tmp_path / f"b-{rel.replace('/', '_')}"
        shutil.copytree(dest, d2, symlinks=True)
        outside = tmp_path / f"outside-{rel.replace('/', '_')}"
        shutil.copy(d2 / rel, outside)  # identical bytes: only the link is wrong
        (d2 / rel).unlink()
        os.symlink(outside, d2 / rel)
        res = _cli("export", "--verify", d2)
        assert res.returncode == 1, res.stdout + res.stderr
        _no_traceback(res)
        assert "symlink" in res.stderr


@pytest.mark.parametrize(("command", "kind"), [
    ("fork", "fifo"),
    pytest.param("train", "fifo", marks=SLOW),
    pytest.param("fork", "symlink", marks=SLOW),
    pytest.param("train", "symlink", marks=SLOW),
])
def test_fork_and_train_refuse_a_hostile_history_without_hanging(run_copy, tmp_path, command, kind):
    hist = run_copy / ".loss.jsonl"
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(b'{"step":1,"loss":1.0}\n')
    before = outside.read_bytes()
    hist.unlink()
    if kind == "fifo":
        os.mkfifo(hist)
    else:
        os.symlink(outside, hist)
    if command == "fork":
        res = _cli("fork", run_copy, "--step", "20", "--into", tmp_path / "fork", timeout=120)
        assert not (tmp_path / "fork").exists()
    else:
        res = _cli("train", "--run", run_copy, *FAST, "--steps", "5", "--no-audit", timeout=120,
                   env={"RIPRESA_HMAC_KEY": KEY})
    assert res.returncode == 2, res.stdout + res.stderr
    _no_traceback(res)
    assert ".loss.jsonl" in res.stderr
    assert outside.read_bytes() == before


@pytest.mark.slow
def test_train_refuses_a_config_that_does_not_fit_its_checkpoints(run_copy):
    cfg = json.loads((run_copy / "config.json").read_text())
    cfg["model"].update(n_layer=48, n_embd=1024, n_head=16)  # ~600 M parameters (2.4 GB) if it were ever built
    (run_copy / "config.json").write_text(json.dumps(cfg))
    res = _cli("train", "--run", run_copy, *FAST, "--steps", "5", "--no-audit", env={"RIPRESA_HMAC_KEY": KEY})
    assert res.returncode == 2, res.stdout + res.stderr
    _no_traceback(res)
    assert "does not match the run's checkpoints" in res.stderr


def test_export_refuses_a_config_that_does_not_fit_the_bin_before_building(run_copy, tmp_path):
    from ripresa.errors import SchemaError
    from ripresa.tools.export_bin import _build_model

    cfg = json.loads((run_copy / "config.json").read_text())
    big = dict(cfg["model"], n_layer=48, n_embd=1024, n_head=16)  # under the size cap, not the .bin's
    with pytest.raises(SchemaError, match="does not match the checkpoint"):
        _build_model(GPT_FACTORY, big, run_copy / "config.json", 136_960)
