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
