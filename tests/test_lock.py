"""The run folder's writer lock, tested with real processes and real SIGKILLs."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.helpers import next_line

from ripresa.errors import BadInput, LockHeld
from ripresa.io.lock import LOCK_NAME, RunLock, pid_alive, read_lock_holder

# Children import ripresa.io.lock directly: the package's __init__ imports its
# public names lazily, so this loads neither torch nor anything but lock.py and
# errors.py.
PRELUDE = """
import os, sys, time
from ripresa.errors import LockHeld
from ripresa.io.lock import RunLock, read_lock_holder
assert "torch" not in sys.modules
"""

HOLDER = (
    PRELUDE
    + """
lock = RunLock(sys.argv[1]).acquire()
print("locked", os.getpid(), flush=True)
time.sleep(60)
"""
)

# Holds the lock, forks a child that just sleeps, reports both pids.
HOLDER_THAT_FORKS = (
    PRELUDE
    + """
lock = RunLock(sys.argv[1]).acquire()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print("locked", os.getpid(), child, flush=True)
time.sleep(60)
"""
)

# Waits for a start file, tries once, reports, then holds until stdin closes.
RACER = (
    PRELUDE
    + """
print("ready", flush=True)
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.001)
try:
    RunLock(sys.argv[1]).acquire()
    print("won", os.getpid(), flush=True)
except LockHeld as exc:
    print("lost", repr(str(exc)), flush=True)
sys.stdin.read()
"""
)

TRY_ONCE = (
    PRELUDE
    + """
try:
    RunLock(sys.argv[1]).acquire()
    print("won", flush=True)
except LockHeld:
    print("lost", flush=True)
"""
)


@pytest.fixture
def spawn() -> Iterator:
    procs: list[subprocess.Popen[str]] = []
    extra_pids: list[int] = []

    def start(script: str, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    start.extra_pids = extra_pids  # type: ignore[attr-defined]
    yield start
    for pid in extra_pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_other_process_is_refused_then_a_killed_holder_does_not_block(
    tmp_path: Path, spawn
) -> None:
    holder = spawn(HOLDER, tmp_path)
    assert next_line(holder) == f"locked {holder.pid}"
    lock_file = tmp_path / LOCK_NAME
    content = lock_file.read_bytes()
    assert content.split(b"\n")[0] == str(holder.pid).encode()  # plain pid on line 1

    with pytest.raises(LockHeld) as refused:
        RunLock(tmp_path).acquire()
    err = refused.value
    assert isinstance(err, BadInput) and err.exit_code == 2
    assert str(holder.pid) in err.message and str(tmp_path) in err.message
    assert err.file == str(lock_file)
    assert str(holder.pid) in str(err.found)
    assert err.hint and f"ripresa signal {tmp_path} stop" in err.hint
    # a refused writer never touches the holder's content
    assert lock_file.read_bytes() == content

    info = read_lock_holder(tmp_path)
    assert info is not None and info.pid == holder.pid
    assert info.hostname == socket.gethostname() and info.is_local
    assert info.argv is not None and info.argv[0] == "-c"
    assert info.started is not None and abs(info.started - time.time()) < 60

    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # the dead holder's file and pid are still there, but nobody holds the lock
    assert lock_file.read_bytes() == content
    assert read_lock_holder(tmp_path) is None

    with RunLock(tmp_path) as lock:
        assert lock.held
        assert lock_file.read_text().splitlines()[0] == str(os.getpid())
        mine = read_lock_holder(tmp_path)
        assert mine is not None and mine.pid == os.getpid() and mine == lock.info
    assert not lock.held
    assert lock_file.read_bytes() == b""  # released: no stale pid left behind
    assert read_lock_holder(tmp_path) is None


@pytest.mark.parametrize("round_", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_four_processes_racing_exactly_one_wins(tmp_path: Path, spawn, round_: int) -> None:
    go = tmp_path / "go"
    racers = [spawn(RACER, tmp_path, go) for _ in range(4)]
    for racer in racers:
        assert next_line(racer) == "ready"
    go.touch()
    results = [next_line(racer) for racer in racers]
    winners = [r for r, racer in zip(results, racers, strict=True) if r == f"won {racer.pid}"]
    assert len(winners) == 1, results
    winner_pid = winners[0].split()[1]
    losers = [r for r in results if r not in winners]
    assert len(losers) == 3 and all(r.startswith("lost") and winner_pid in r for r in losers)
    info = read_lock_holder(tmp_path)
    assert info is not None and str(info.pid) == winner_pid


def test_second_runlock_in_same_process_is_refused(tmp_path: Path) -> None:
    first = RunLock(tmp_path).acquire()
    try:
        with pytest.raises(LockHeld) as refused:
            RunLock(tmp_path).acquire()
        assert str(os.getpid()) in str(refused.value)
        # another spelling of the same folder is the same lock
        link = tmp_path.parent / f"{tmp_path.name}-link"
        link.symlink_to(tmp_path)
        with pytest.raises(LockHeld):
            RunLock(link).acquire()
        # the same object twice is refused too
        with pytest.raises(LockHeld):
            first.acquire()
        assert first.held
    finally:
        first.release()
    second = RunLock(tmp_path).acquire()
    assert second.held and not first.held
    second.release()
    second.release()  # idempotent


@pytest.mark.slow
def test_reading_the_holder_in_its_own_process_keeps_the_lock(tmp_path: Path, spawn) -> None:
    # With lockf/fcntl record locks, closing the reader's descriptor would drop
    # the holder's lock; the child must still be refused afterwards.
    lock = RunLock(tmp_path).acquire()
    for _ in range(3):
        info = read_lock_holder(tmp_path)
        assert info is not None and info.pid == os.getpid()
    child = spawn(TRY_ONCE, tmp_path)
    assert next_line(child) == "lost"
    lock.release()
    child = spawn(TRY_ONCE, tmp_path)
    assert next_line(child) == "won"


@pytest.mark.slow
def test_forked_child_does_not_keep_a_killed_holder_locked(tmp_path: Path, spawn) -> None:
    holder = spawn(HOLDER_THAT_FORKS, tmp_path)
    word, pid, child = next_line(holder).split()
    assert word == "locked" and int(pid) == holder.pid
    spawn.extra_pids.append(int(child))
    with pytest.raises(LockHeld):
        RunLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    os.kill(int(child), 0)  # the forked child is still alive...
    with RunLock(tmp_path):  # ...and does not hold the lock
        pass


def test_acquire_waits_up_to_timeout(tmp_path: Path) -> None:
    first = RunLock(tmp_path).acquire()
    timer = threading.Timer(0.15, first.release)
    timer.start()
    try:
        t0 = time.monotonic()
        second = RunLock(tmp_path).acquire(timeout=10)
        assert 0.1 < time.monotonic() - t0 < 5
        assert second.held
        second.release()
    finally:
        timer.cancel()
        first.release()

    held = RunLock(tmp_path).acquire()
    try:
        t0 = time.monotonic()
        with pytest.raises(LockHeld):
            RunLock(tmp_path).acquire(timeout=0.3)
        assert time.monotonic() - t0 >= 0.3
    finally:
        held.release()


def test_lock_file_format(tmp_path: Path) -> None:
    with RunLock(tmp_path) as lock:
        first, second, end = (tmp_path / LOCK_NAME).read_text().split("\n")
        assert first == str(os.getpid()) and end == ""
        extra = json.loads(second)
        assert extra["pid"] == os.getpid()
        assert extra["hostname"] == socket.gethostname()
        assert extra["argv"] == sys.argv
        assert lock.info is not None and lock.info.pid == os.getpid()
        assert f"pid {os.getpid()}" in lock.info.describe()


def test_context_manager_releases_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), RunLock(tmp_path):
        raise RuntimeError("boom")
    assert read_lock_holder(tmp_path) is None
    with RunLock(tmp_path):
        pass


def test_missing_folder_and_missing_lock_file(tmp_path: Path) -> None:
    with pytest.raises(BadInput) as missing:
        RunLock(tmp_path / "nope").acquire()
    assert not isinstance(missing.value, LockHeld)
    assert missing.value.file == str(tmp_path / "nope")
    with pytest.raises(BadInput):
        read_lock_holder(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput):
        RunLock(tmp_path / "file").acquire()
    # a folder without LOCK is unlocked, and reading does not create LOCK
    assert read_lock_holder(tmp_path) is None
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow
def test_held_lock_without_a_pid_is_reported(tmp_path: Path, spawn, monkeypatch) -> None:
    monkeypatch.setattr("ripresa.io.lock._HOLDER_WAIT_S", 0.05)
    holder = spawn(HOLDER, tmp_path)
    assert next_line(holder) == f"locked {holder.pid}"
    (tmp_path / LOCK_NAME).write_text("garbage")  # something rewrote the holder's content
    with pytest.raises(BadInput) as unreadable:
        read_lock_holder(tmp_path, wait=0)
    assert not isinstance(unreadable.value, LockHeld)
    assert "garbage" in str(unreadable.value.found)
    with pytest.raises(LockHeld) as refused:
        RunLock(tmp_path).acquire()
    assert "pid unknown" in str(refused.value)


PROBER = (
    PRELUDE
    + """
print("probing", flush=True)
end = time.monotonic() + 20
while time.monotonic() < end:
    read_lock_holder(sys.argv[1])
"""
)


def test_a_writer_rides_over_a_probe_in_progress(tmp_path: Path) -> None:
    # A probe caught in the middle: a shared lock on LOCK held for 0.1 s.
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)
    timer = threading.Timer(0.1, os.close, (fd,))  # closing drops the shared lock
    timer.start()
    try:
        with RunLock(tmp_path) as lock:  # timeout=0, still not refused
            assert lock.held
    finally:
        timer.join()


@pytest.mark.slow
def test_a_reader_probing_never_makes_a_writer_fail(tmp_path: Path, spawn) -> None:
    # read_lock_holder probes with a shared lock held for microseconds; a
    # writer that starts at that instant must not be refused.
    prober = spawn(PROBER, tmp_path)
    assert next_line(prober) == "probing"
    for _ in range(100):
        time.sleep(0.001)  # unlocked most of the time, so that the prober's probes succeed
        with RunLock(tmp_path) as lock:
            assert lock.held
    assert prober.poll() is None  # the prober itself never failed either


def test_pid_alive_never_addresses_a_group_and_never_raises() -> None:
    # kill(0, ...) and kill(-N, ...) address process groups; huge and non-int pids
    # used to raise OverflowError/TypeError. None of them may reach the kernel.
    for pid in (0, -1, -os.getpgid(0), 2**22 + 1, 2**40, 2**70, "123", 1.0, True, None):
        assert pid_alive(pid) is False
    assert pid_alive(os.getpid()) is True
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert pid_alive(gone.pid) is False


@pytest.mark.slow
def test_lock_that_names_no_valid_pid_is_reported_not_raised(tmp_path: Path, spawn, monkeypatch) -> None:
    monkeypatch.setattr("ripresa.io.lock._HOLDER_WAIT_S", 0.05)
    holder = spawn(HOLDER, tmp_path)
    assert next_line(holder) == f"locked {holder.pid}"
    genuine = (tmp_path / LOCK_NAME).read_bytes().split(b"\n")[1]
    for first in (b"0", b"-1", str(2**40).encode(), b"9" * 50_000):
        with open(tmp_path / LOCK_NAME, "r+b") as f:
            f.truncate(0)
            f.write(first + b"\n" + genuine + b"\n")
        with pytest.raises(BadInput) as refused:
            read_lock_holder(tmp_path, wait=0)
        assert not isinstance(refused.value, LockHeld)
        with pytest.raises(LockHeld):
            RunLock(tmp_path).acquire()
