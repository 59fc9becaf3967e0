"""fsio: the durable-write protocol, fault injection, sidecars, and safe one-pass reads."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import must_not_block, rchar

from ripresa.errors import BadInput, IntegrityError, SaveFailed
from ripresa.io import fsio
from ripresa.io.fsio import (
    SIDECAR_MAX,
    Digest,
    StagedFile,
    clean_temporaries,
    drop_page_cache,
    is_temp_name,
    open_regular,
    read_exact_hashing,
    read_sidecar,
    require_regular_file,
    sha256_fd,
    sha256_file,
    sidecar_line,
    sidecar_path,
    temp_name_for,
    verify_against_sidecar,
    write_atomic,
    write_sidecar,
)


@pytest.fixture(autouse=True)
def _no_hook():
    """Every test starts and ends with no fault-injection hook."""
    fsio.ops.hook = None
    yield
    fsio.ops.hook = None


def temps_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if is_temp_name(p.name))


# ---- StagedFile / write_atomic ----------------------------------------------------


def test_staged_file_round_trip_and_digest(tmp_path):
    final = tmp_path / "data.bin"
    parts = [
        b"hello ",
        bytearray(b"world"),
        memoryview(os.urandom(100_000)),
        np.arange(10, dtype=np.float32),
    ]
    with StagedFile(final) as f:
        assert is_temp_name(f.temp.name) and f.temp.parent == tmp_path
        assert not final.exists()  # nothing at the final name before publish
        for part in parts:
            f.write(part)
        digest = f.finish()
        assert f.finish() is digest  # idempotent
        f.publish()
    fsio.fsync_dir(tmp_path)
    content = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert final.read_bytes() == content
    assert digest == Digest(hashlib.sha256(content).hexdigest(), len(content))
    assert sha256_file(final) == digest
    assert temps_in(tmp_path) == []
    with pytest.raises(SaveFailed):
        f.write(b"late")  # after finish()


def test_short_writes_are_completed(tmp_path, monkeypatch):
    """``write`` may write less than asked; StagedFile loops until all is written."""
    calls = []

    def one_kilobyte_at_most(fd, data, path):
        calls.append(len(data))
        return os.write(fd, data[:1024])

    monkeypatch.setattr(fsio.ops, "write", one_kilobyte_at_most)
    data = os.urandom(10_000)
    digest = write_atomic(tmp_path / "x", [data])
    assert (tmp_path / "x").read_bytes() == data and digest.size == len(data)
    assert len(calls) == 10


def test_no_temporary_left_when_the_body_raises(tmp_path):
    final = tmp_path / "ck.pt"
    final.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with StagedFile(final) as f:
            f.write(b"partial new content")
            assert f.temp.exists()
            raise RuntimeError("boom")
    assert final.read_bytes() == b"old"
    assert temps_in(tmp_path) == []
    # leaving the block without publishing also discards
    with StagedFile(tmp_path / "never.bin") as f:
        f.write(b"x")
        f.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


def test_temp_names_round_trip():
    t = temp_name_for(Path("/r/step_000001.bin"))
    assert t.parent == Path("/r") and t.name.startswith(".step_000001.bin.tmp.")
    assert is_temp_name(t.name)
    assert str(os.getpid()) in t.name
    for name in (
        "step_000001.bin",
        ".x.tmp.12",
        ".x.tmp.12.zzzzzzzz",
        "x.tmp.12.0123abcd",
        ".x.tmp.p.0123abcd",
    ):
        assert not is_temp_name(name), name


# ---- fault injection through ops.hook ----------------------------------------------


INJECTIONS = [
    ("open", errno.ENOSPC, "ENOSPC"),
    ("write", errno.ENOSPC, "ENOSPC"),
    ("fsync", errno.EIO, "EIO"),
    ("rename", errno.EIO, "EIO"),
    ("fsync_dir", errno.EIO, "EIO"),
]


@pytest.mark.parametrize(("op", "code", "name"), INJECTIONS, ids=[i[0] for i in INJECTIONS])
def test_injected_oserror_fails_the_save_cleanly(tmp_path, op, code, name):
    final = tmp_path / "checkpoint.pt"
    final.write_bytes(b"the previous, good checkpoint")
    seen: list[str] = []

    def hook(o: str, path: str) -> None:
        seen.append(o)
        if o == op:
            raise OSError(code, os.strerror(code))

    fsio.ops.hook = hook
    new = os.urandom(3 * 1024 * 1024)
    with pytest.raises(SaveFailed) as ei:
        write_atomic(final, [new[: len(new) // 2], new[len(new) // 2 :]])
    err = ei.value
    assert err.exit_code == 2
    assert name in str(err.found) and f"errno {code}" in str(err.found)
    assert os.strerror(code) in str(err.found)
    assert err.hint and "previous checkpoint is untouched" in err.hint
    if code == errno.ENOSPC:
        assert "disk is full" in err.hint
    else:
        assert "I/O error" in err.hint
    assert seen.count(op) == 1  # a failed fsync is never retried
    assert temps_in(tmp_path) == []
    if op == "fsync_dir":
        # the rename already happened: the destination holds the complete new
        # file (never a mix); only its durability is unknown, hence the error
        assert final.read_bytes() == new
        assert str(err.file) == str(tmp_path)
    else:
        assert final.read_bytes() == b"the previous, good checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_injected_failure_at_the_nth_write(tmp_path):
    """A failure in the middle of a multi-chunk save, not only at the first call."""
    final = tmp_path / "big.bin"
    final.write_bytes(b"old")
    count = {"write": 0}

    def hook(op: str, path: str) -> None:
        if op == "write":
            count["write"] += 1
            if count["write"] == 3:
                raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    fsio.ops.hook = hook
    with pytest.raises(SaveFailed) as ei:
        write_atomic(final, [b"a" * 1000] * 5)
    assert "EFBIG" in str(ei.value.found) and "size limit" in ei.value.hint
    assert final.read_bytes() == b"old" and temps_in(tmp_path) == []


def test_sidecar_failure_leaves_no_marker(tmp_path):
    """The sidecar is the commit marker: if writing it fails, there is none."""
    data = tmp_path / "step_000001.bin"
    digest = write_atomic(data, [b"payload"])

    def hook(op: str, path: str) -> None:
        if op == "rename" and path.endswith(".sha256"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    fsio.ops.hook = hook
    with pytest.raises(SaveFailed):
        write_sidecar(data, digest)
    fsio.ops.hook = None
    assert not sidecar_path(data).exists() and temps_in(tmp_path) == []
    with pytest.raises(IntegrityError, match="missing commit marker"):
        read_sidecar(data)


# ---- clean_temporaries ----------------------------------------------------------


def test_clean_temporaries_removes_dead_writers_and_keeps_live_ones(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # exited and reaped: its pid names no process
    try:
        names = {
            "live": f".ck.pt.tmp.{live.pid}.0123abcd",
            "dead": f".ck.pt.tmp.{dead.pid}.89abcdef",
            "mine": f".step_000001.bin.tmp.{os.getpid()}.00ff00ff",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")
        (tmp_path / "ck.pt").write_bytes(b"committed")
        (tmp_path / f".dir.tmp.{dead.pid}.deadbeef").mkdir()  # folders are never removed
        removed = clean_temporaries(tmp_path)
        assert [p.name for p in removed] == [names["dead"]]
        left = {p.name for p in tmp_path.iterdir()}
        assert names["live"] in left and names["mine"] in left and "ck.pt" in left
        assert f".dir.tmp.{dead.pid}.deadbeef" in left
        # the lock holder removes every temporary file, live writer or not
        removed = clean_temporaries(tmp_path, only_dead=False)
        assert sorted(p.name for p in removed) == sorted([names["live"], names["mine"]])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["ck.pt", f".dir.tmp.{dead.pid}.deadbeef"]
        )
    finally:
        live.kill()
        live.wait()
    assert clean_temporaries(tmp_path / "missing") == []


# ---- sidecars --------------------------------------------------------------------


def test_write_atomic_sidecar_and_real_sha256sum(tmp_path):
    data = tmp_path / "step_000042.bin"
    chunks = [os.urandom(5000), os.urandom(70_000)]
    digest = write_atomic(data, chunks)
    side = write_sidecar(data, digest)
    assert side == sidecar_path(data) == tmp_path / "step_000042.bin.sha256"
    assert side.read_bytes() == sidecar_line(digest, data.name)
    assert side.read_text() == f"{hashlib.sha256(b''.join(chunks)).hexdigest()}  step_000042.bin\n"
    assert read_sidecar(data) == digest.sha256
    assert verify_against_sidecar(data) == digest
    exe = shutil.which("sha256sum")
    if exe is None:
        pytest.skip("sha256sum not installed")
    res = subprocess.run([exe, "-c", side.name], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step_000042.bin: OK" in res.stdout
    # damage: both sha256sum and ripresa refuse
    raw = bytearray(data.read_bytes())
    raw[1234] ^= 0x01
    data.write_bytes(bytes(raw))
    assert subprocess.run([exe, "-c", side.name], cwd=tmp_path, capture_output=True).returncode != 0
    with pytest.raises(IntegrityError, match="sha256 mismatch") as ei:
        verify_against_sidecar(data)
    assert ei.value.expected == digest.sha256 and ei.value.file == str(data)


def test_binary_mode_sidecar_line_is_accepted(tmp_path):
    data = tmp_path / "c.pt"
    digest = write_atomic(data, [b"x"])
    sidecar_path(data).write_text(f"{digest.sha256} *c.pt\n")  # `sha256sum -b` style
    assert read_sidecar(data) == digest.sha256
    sidecar_path(data).write_text(f"{digest.sha256}  c.pt")  # no final newline
    assert read_sidecar(data) == digest.sha256


HEX = "ab" * 32
BAD_SIDECARS = {
    "empty": b"",
    "bad-hex": b"g" * 64 + b"  c.pt\n",
    "uppercase-hex": HEX.upper().encode() + b"  c.pt\n",
    "short-hash": b"ab" * 31 + b"  c.pt\n",
    "long-hash": b"ab" * 33 + b"  c.pt\n",
    "one-space-only": HEX.encode() + b" c.pt\n",
    "two-lines": HEX.encode() + b"  c.pt\n" + HEX.encode() + b"  c.pt\n",
    "blank-second-line": HEX.encode() + b"  c.pt\n\n",
    "crlf": HEX.encode() + b"  c.pt\r\n",
    "binary": b"\xff\xfe garbage",
    "nul-in-name": HEX.encode() + b"  c.pt\x00\n",
    "dotdot-name": HEX.encode() + b"  ../c.pt\n",
    "absolute-name": HEX.encode() + b"  /tmp/c.pt\n",
    "oversized": HEX.encode() + b"  c.pt\n" + b" " * SIDECAR_MAX,
}


@pytest.mark.parametrize("content", list(BAD_SIDECARS.values()), ids=list(BAD_SIDECARS))
def test_read_sidecar_refuses_malformed(tmp_path, content):
    data = tmp_path / "c.pt"
    data.write_bytes(b"x")
    sidecar_path(data).write_bytes(content)
    with pytest.raises(IntegrityError, match="malformed sha256 sidecar") as ei:
        read_sidecar(data)
    err = ei.value
    assert err.exit_code == 1 and err.file == str(sidecar_path(data)) and err.hint
    assert len(str(err.found)) < 300  # the message quotes a bounded prefix


def test_read_sidecar_refuses_another_files_name(tmp_path):
    data = tmp_path / "c.pt"
    sidecar_path(data).write_text(f"{HEX}  other.pt\n")
    with pytest.raises(IntegrityError, match="names another file") as ei:
        read_sidecar(data)
    assert ei.value.expected == "c.pt" and ei.value.found == "other.pt"


def test_read_sidecar_reads_a_bounded_prefix(tmp_path):
    """A huge (sparse) sidecar is refused after reading at most SIDECAR_MAX + 1 bytes."""
    data = tmp_path / "c.pt"
    side = sidecar_path(data)
    side.write_text(f"{HEX}  c.pt\n")
    os.truncate(side, 1 << 34)  # 16 GiB, sparse
    before = rchar()
    with pytest.raises(IntegrityError, match="too large") as ei:
        read_sidecar(data)
    assert rchar() - before <= SIDECAR_MAX + 1 + 4096
    assert f"more than {SIDECAR_MAX} bytes" in str(ei.value.found)
    side.write_bytes(f"{HEX}  c.pt\n".encode().ljust(SIDECAR_MAX, b" "))
    with pytest.raises(
        IntegrityError, match="malformed"
    ):  # at the limit: read, then refused by the pattern
        read_sidecar(data)


def test_read_sidecar_refuses_fifo_without_blocking(tmp_path):
    data = tmp_path / "c.pt"
    data.write_bytes(b"x")
    os.mkfifo(sidecar_path(data))
    with must_not_block():
        with pytest.raises(IntegrityError, match="not a regular file") as ei:
            read_sidecar(data)
    assert ei.value.found == "a FIFO" and ei.value.exit_code == 1


def test_read_sidecar_refuses_symlink_and_folder(tmp_path):
    data = tmp_path / "c.pt"
    digest = write_atomic(data, [b"x"])
    elsewhere = tmp_path / "real"
    elsewhere.mkdir()
    (elsewhere / "c.pt.sha256").write_bytes(sidecar_line(digest, "c.pt"))
    sidecar_path(data).symlink_to(elsewhere / "c.pt.sha256")
    with pytest.raises(IntegrityError, match="not a regular file") as ei:
        read_sidecar(data)
    assert ei.value.found == "a symlink"
    sidecar_path(data).unlink()
    sidecar_path(data).symlink_to(tmp_path / "nowhere")  # dangling: still a symlink, not "missing"
    with pytest.raises(IntegrityError, match="not a regular file"):
        read_sidecar(data)
    sidecar_path(data).unlink()
    sidecar_path(data).mkdir()
    with pytest.raises(IntegrityError, match="not a regular file") as ei:
        read_sidecar(data)
    assert ei.value.found == "a folder"
    sidecar_path(data).rmdir()
    with pytest.raises(IntegrityError, match="missing commit marker"):
        read_sidecar(data)


def test_read_sidecar_open_failure_is_bad_input(tmp_path, monkeypatch):
    data = tmp_path / "c.pt"
    sidecar_path(data).write_text(f"{HEX}  c.pt\n")

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fsio.os, "open", refuse)
    with pytest.raises(BadInput, match="not readable") as ei:
        read_sidecar(data)
    assert "EACCES" in str(ei.value.found) and ei.value.exit_code == 2


# ---- open_regular and friends ----------------------------------------------------


def test_open_regular_returns_a_blocking_descriptor(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"content")
    link = tmp_path / "link"
    link.symlink_to(f)
    for path in (f, link, str(f)):  # a symlink to a regular file is followed
        fd = open_regular(path)
        try:
            assert os.get_blocking(fd)
            assert os.get_inheritable(fd) is False
            assert os.read(fd, 100) == b"content"
        finally:
            os.close(fd)


def test_open_regular_refusals(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing")
    sock_path = tmp_path / "s"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    cases = {
        fifo: ("ANDREA .bin is not a regular file", "a FIFO"),
        folder: ("ANDREA .bin is a folder", "a folder"),
        tmp_path / "missing": ("ANDREA .bin not found", "nothing at this path"),
        dangling: ("ANDREA .bin not found", "nothing at this path"),
        sock_path: ("ANDREA .bin is not a regular file", None),
    }
    try:
        with must_not_block():
            for path, (message, found) in cases.items():
                with pytest.raises(BadInput) as ei:
                    open_regular(path, "ANDREA .bin")
                err = ei.value
                assert err.message == message, path
                assert err.file == str(path) and err.expected and err.hint
                if found is not None:
                    assert err.found == found
                for fn in (sha256_file, drop_page_cache):
                    with pytest.raises(BadInput):
                        fn(path)
    finally:
        sock.close()


def test_open_regular_permission_error_names_errno(tmp_path, monkeypatch):
    f = tmp_path / "f"
    f.write_bytes(b"x")

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fsio.os, "open", refuse)
    with pytest.raises(BadInput, match="not readable") as ei:
        open_regular(f)
    assert "Permission denied" in str(ei.value.found) and "EACCES" in str(ei.value.found)


def test_require_regular_file_folder_has_a_hint(tmp_path):
    with pytest.raises(BadInput, match="is a folder") as ei:
        require_regular_file(tmp_path)
    assert ei.value.hint and "inside the folder" in ei.value.hint
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="not a regular file") as ei:
        require_regular_file(fifo)
    assert ei.value.found == "a FIFO"


def test_drop_page_cache_keeps_content(tmp_path):
    f = tmp_path / "f"
    data = os.urandom(100_000)
    write_atomic(f, [data])
    assert drop_page_cache(f) is hasattr(os, "posix_fadvise")
    assert f.read_bytes() == data
    assert sha256_file(f, drop_cache=True).sha256 == hashlib.sha256(data).hexdigest()


# ---- one-pass reading ------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_read_exact_hashing_fills_buffers_and_hashes_like_sha256_file(tmp_path, overlap):
    data = os.urandom(3 * 4096 * 5 + 123)
    f = tmp_path / "f"
    f.write_bytes(data)
    sizes = [0, 1, 4096 * 5, 7, 4096 * 10 + 115]
    assert sum(sizes) == len(data)
    buffers = [bytearray(s) for s in sizes]
    h = hashlib.sha256()
    fd = open_regular(f)
    try:
        n = read_exact_hashing(
            fd, [memoryview(b) for b in buffers], h, path=f, piece=4096, overlap=overlap
        )
        assert os.read(fd, 1) == b""
    finally:
        os.close(fd)
    assert n == len(data)
    assert b"".join(buffers) == data
    assert h.hexdigest() == sha256_file(f).sha256 == hashlib.sha256(data).hexdigest()


def test_read_exact_hashing_into_numpy_arrays(tmp_path):
    arrays = [np.random.default_rng(i).standard_normal(1000 + i).astype("<f4") for i in range(3)]
    f = tmp_path / "f"
    digest = write_atomic(f, arrays)
    out = [np.empty_like(a) for a in arrays]
    h = hashlib.sha256()
    fd = open_regular(f)
    try:
        read_exact_hashing(
            fd, [memoryview(a) for a in out], h, piece=512
        )  # float views are cast to bytes
    finally:
        os.close(fd)
    for a, b in zip(arrays, out, strict=True):
        assert np.array_equal(a, b)
    assert h.hexdigest() == digest.sha256


@pytest.mark.parametrize("overlap", [False, True])
def test_read_exact_hashing_short_file_is_integrity_error(tmp_path, overlap):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10_000)
    fd = open_regular(f)
    try:
        with pytest.raises(IntegrityError, match="shrank") as ei:
            read_exact_hashing(
                fd,
                [bytearray(6000), bytearray(6000)],
                hashlib.sha256(),
                path=f,
                what="ANDREA .bin",
                piece=1000,
                overlap=overlap,
            )
    finally:
        os.close(fd)
    err = ei.value
    assert err.message.startswith("ANDREA .bin") and err.file == str(f)
    assert err.expected == "12000 bytes" and "10000 bytes" in str(err.found)


def test_read_exact_hashing_refuses_read_only_buffers(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    fd = open_regular(f)
    try:
        with pytest.raises(ValueError):
            read_exact_hashing(fd, [memoryview(b"abc")])
        assert read_exact_hashing(fd, [bytearray(3)], None) == 3  # no hasher: only reads
    finally:
        os.close(fd)


def test_read_exact_hashing_read_error_is_bad_input(tmp_path):
    folder_fd = os.open(tmp_path, os.O_RDONLY)  # reading a folder fails with EISDIR
    try:
        with pytest.raises(BadInput, match="could not be read") as ei:
            read_exact_hashing(folder_fd, [bytearray(10)], path=tmp_path)
        assert "EISDIR" in str(ei.value.found)
    finally:
        os.close(folder_fd)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    piece=st.integers(1, 3000),
    overlap=st.booleans(),
)
def test_read_exact_hashing_property(tmp_path_factory, sizes, piece, overlap):
    data = os.urandom(sum(sizes))
    f = tmp_path_factory.mktemp("p") / "f"
    f.write_bytes(data)
    buffers = [bytearray(s) for s in sizes]
    h = hashlib.sha256()
    fd = open_regular(f)
    try:
        assert read_exact_hashing(fd, buffers, h, piece=piece, overlap=overlap) == len(data)
    finally:
        os.close(fd)
    assert b"".join(buffers) == data and h.hexdigest() == hashlib.sha256(data).hexdigest()


def test_sha256_fd_and_sha256_file_agree(tmp_path):
    data = os.urandom(fsio.CHUNK + 17)  # more than one buffer
    f = tmp_path / "f"
    f.write_bytes(data)
    fd = open_regular(f)
    try:
        d = sha256_fd(fd)
    finally:
        os.close(fd)
    assert d == sha256_file(f) == Digest(hashlib.sha256(data).hexdigest(), len(data))
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert sha256_file(empty) == Digest(hashlib.sha256(b"").hexdigest(), 0)


@pytest.mark.parametrize("size", [0, 1, fsio.CHUNK - 1, fsio.CHUNK, 2 * fsio.CHUNK + 5])
@pytest.mark.parametrize("exact", [False, True])
def test_copy_hashing_copies_and_hashes_like_sha256_file(tmp_path, size, exact):
    """To EOF or exactly ``size`` bytes: the same bytes, the same digest, each piece seen once by ``on_chunk``."""
    src = tmp_path / "src"
    src.write_bytes(np.random.default_rng(size).bytes(size))
    seen: list[bytes] = []
    fd = os.open(src, os.O_RDONLY)
    try:
        with fsio.StagedFile(tmp_path / "dst") as out:
            digest = fsio.copy_hashing(fd, out, path=src, on_chunk=lambda p: seen.append(bytes(p)),
                                       size=size if exact else None)
            out.publish()
    finally:
        os.close(fd)
    assert digest == fsio.sha256_file(src) == fsio.sha256_file(tmp_path / "dst")
    assert b"".join(seen) == src.read_bytes()


def test_copy_hashing_of_a_file_that_shrank_is_an_integrity_error(tmp_path):
    """With ``size`` (the size at open, as ``ripresa export`` passes) a shorter file is refused, nothing published."""
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(IntegrityError, match="shrank"), fsio.StagedFile(tmp_path / "dst") as out:
            fsio.copy_hashing(fd, out, path=src, what="the generation's .bin", size=150)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
