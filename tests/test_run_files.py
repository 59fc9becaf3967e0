"""Hostile run folders: one way to open a file (issue #10, classes 4, 5, 6).

Every file of a run folder, bundle or ledger is opened through
:func:`ripresa.fsio.open_run_file` / :func:`ripresa.fsio.read_small`:
symlinks are refused, FIFOs never block, sizes are bounded before any
allocation (``docs/FAULTS.md``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from ripresa import fsio
from ripresa.errors import BadInput, IntegrityError

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
    from ripresa.history import History

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
    from ripresa.history import History, read_history

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
    from ripresa.history import iter_lines, read_history

    p = tmp_path / ".loss.jsonl"
    _make(kind, p, tmp_path / "outside.jsonl")
    with pytest.raises(BadInput):
        read_history(p)
    with pytest.raises(BadInput):
        list(iter_lines(p))


def test_history_reader_skips_and_counts_long_and_out_of_range_lines(tmp_path):
    from ripresa.history import MAX_LINE, HistoryReader, read_history

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
    from ripresa.history import HistoryReader

    p = tmp_path / ".loss.jsonl"
    p.write_bytes(b'{"step":1}\n' + b"z" * (3 << 20) + b'\n{"step":2}\n')
    reader = HistoryReader(p, max_line=64)
    got = [obj for _, obj in reader]
    assert got == [{"step": 1}, None, {"step": 2}]
    assert reader.long_lines == 1


_RSS_CHILD = r"""
import resource, sys
from ripresa.history import read_history
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
