"""`ripresa signal` and `ripresa pivot` signal only the real trainer of the run.

LOCK's content names a pid, and anybody who can write into the run folder can
rewrite it. Every test here runs real processes: a real holder of RunLock (with
SIGUSR1/SIGTERM handlers that write a file instead of dying), real bystanders
(`sleep` children, each in its own session), and the real CLI in a subprocess.
A forged LOCK must be refused with exit 2 and no traceback, the bystanders must
still be alive afterwards, and the holder must have received nothing; the
genuine LOCK still gets its signal through. See docs/FAULTS.md, "Signalling the
trainer".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.helpers import next_line

import ripresa
from ripresa.errors import BadInput
from ripresa.io.lock import (
    LOCK_NAME,
    NotRunning,
    RunLock,
    is_locked,
    pid_alive,
    read_lock_holder,
    signal_holder,
)

ENV = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")

# A trainer stand-in: takes the run's lock like a Checkpointer does, and logs
# every SIGUSR1/SIGTERM it gets into a file instead of acting on it.
HOLDER = """
import os, signal, sys, time
from ripresa.io.lock import RunLock
log = sys.argv[2]
def on(sig, frame):
    with open(log, "a") as f:
        f.write(signal.Signals(sig).name + "\\n")
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGTERM, on)
lock = RunLock(sys.argv[1]).acquire()
print("locked", os.getpid(), flush=True)
while True:
    time.sleep(0.05)
"""

# A process that has LOCK open (for reading) but does not hold the lock.
READER = """
import os, sys, time
fd = os.open(os.path.join(sys.argv[1], "LOCK"), os.O_RDONLY)
print("open", os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def holder(tmp_path: Path, procs) -> tuple[Path, subprocess.Popen, Path]:
    """(run folder, the holder process, the file its signal handler writes)."""
    run = tmp_path / "run"
    run.mkdir()
    log = tmp_path / "holder-signals.txt"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(log)], stdout=subprocess.PIPE,
                            text=True, env=ENV, start_new_session=True)
    procs.append(proc)
    assert next_line(proc, 20) == f"locked {proc.pid}"
    return run, proc, log


def _sleeper(procs) -> subprocess.Popen:
    """An unrelated live process in its own session and process group (SIGUSR1/SIGTERM kill it)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    procs.append(proc)
    return proc


def _signal_cli(run: Path, action: str = "checkpoint") -> subprocess.CompletedProcess[str]:
    """`ripresa signal RUN ACTION`, run by a shell in a session of its own.

    The shell stands for the user's shell: it is in the CLI's process group, so
    a signal to "pid 0" (the caller's group) would kill it and the CLI, and the
    shell's exit status would show it.
    """
    script = '"$0" -m ripresa signal "$1" "$2"; echo "rc=$?"'
    return subprocess.run(["sh", "-c", script, sys.executable, str(run), action], capture_output=True, text=True,
                          env=ENV, timeout=60, start_new_session=True)


def _genuine(run: Path) -> tuple[str, dict]:
    first, second, _ = (run / LOCK_NAME).read_text().split("\n")
    return first, json.loads(second)


def _forge(run: Path, first: str, extra: dict | None) -> None:
    """Rewrite LOCK's content in place (same inode; the holder keeps its lock)."""
    text = first + "\n" + (json.dumps(extra) + "\n" if extra is not None else "")
    with open(run / LOCK_NAME, "r+") as f:
        f.truncate(0)
        f.write(text)


def _refused(res: subprocess.CompletedProcess[str], *, library_hint: bool = True) -> str:
    assert res.returncode == 0, f"the shell around the CLI was killed: {res.returncode} {res.stderr}"
    assert res.stdout.strip().endswith("rc=2"), res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "sent SIG" not in res.stdout
    assert "ripresa signal: error:" in res.stderr
    if library_hint:  # the hint fits a user of ripresa.Checkpointer as well as of `ripresa train`
        assert "ripresa.Checkpointer" in res.stderr and "ripresa train" in res.stderr
    return res.stderr


def _received(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def _wait_received(log: Path, n: int) -> list[str]:
    t0 = time.monotonic()
    while len(_received(log)) < n and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    return _received(log)


def test_genuine_holder_gets_its_signal_and_a_free_lock_says_no_trainer(holder, procs) -> None:
    run, proc, log = holder
    first, extra = _genuine(run)
    assert extra["pidns"] == os.stat("/proc/self/ns/pid").st_ino
    assert extra["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    res = _signal_cli(run, "checkpoint")
    assert res.stdout.startswith(f"sent SIGUSR1 to pid {proc.pid}"), res.stdout + res.stderr
    assert _wait_received(log, 1) == ["SIGUSR1"]
    res = _signal_cli(run, "stop")
    assert f"sent SIGTERM to pid {proc.pid}" in res.stdout, res.stderr
    assert _wait_received(log, 2) == ["SIGUSR1", "SIGTERM"]
    proc.kill()
    proc.wait()
    # The dead holder's content is still in LOCK, and its pid is free (or reused): nobody is signalled.
    assert (run / LOCK_NAME).read_text().startswith(first)
    stderr = _refused(_signal_cli(run, "stop"))
    assert "no trainer is running" in stderr and "no process is training this run" in stderr


FORGERIES = {
    # name: (first line, JSON fields over the genuine ones or None for no JSON line, words of the refusal)
    "pid 0 (the caller's process group)": ("0", {"pid": 0}, "process group"),
    "pid -N (a process group)": ("-{sleeper_pgid}", {"pid": "-"}, "process group"),
    "pid 2**40": (str(2**40), {"pid": 2**40}, "beyond the largest pid"),
    "pid 2**70, no JSON line": (str(2**70), None, "beyond the largest pid"),
    "a megabyte of digits": ("9" * 1_000_000, None, "beyond the largest pid"),
    "not a number": ("abc", {"pid": "abc"}, "not a pid"),
    "JSON disagrees with the first line": ("{holder}", {"pid": "{sleeper}"}, "JSON line"),
    "an unrelated live process": ("{sleeper}", {"pid": "{sleeper}"}, "does not have this run's LOCK open"),
    "an unrelated live process, old LOCK without JSON": ("{sleeper}", None, "does not have this run's LOCK open"),
    "the holder's pid on another host": ("{holder}", {"hostname": "elsewhere.example"}, "on host 'elsewhere.example'"),
    "a sleeper's pid on another host": ("{sleeper}", {"pid": "{sleeper}", "hostname": "gpu-99"}, "on host 'gpu-99'"),
    "another boot or machine": ("{sleeper}", {"pid": "{sleeper}", "boot_id": "00000000-dead-beef-0000-000000000000"},
                                "rebooted"),
    "another pid namespace": ("{sleeper}", {"pid": "{sleeper}", "pidns": 4026531999}, "another pid namespace"),
    "deeply nested JSON": ("{sleeper}", "[" * 200_000, "does not have this run's LOCK open"),
    "absurd start time": ("{sleeper}", {"pid": "{sleeper}", "started": 10**400}, "does not have this run's LOCK open"),
}


def _fill(value, holder_pid: int, sleeper: subprocess.Popen):
    if isinstance(value, str):
        if value == "-":
            return -os.getpgid(sleeper.pid)
        text = value.format(holder=holder_pid, sleeper=sleeper.pid, sleeper_pgid=os.getpgid(sleeper.pid))
        return int(text) if text.lstrip("-").isdigit() and len(text) < 30 and value != text else text
    return value


@pytest.mark.parametrize("case", [c if i == 0 else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(FORGERIES)])
def test_forged_lock_is_refused_and_nobody_is_signalled(holder, procs, case: str) -> None:
    run, proc, log = holder
    sleeper = _sleeper(procs)
    first, extra, words = FORGERIES[case]
    _, genuine = _genuine(run)
    first = str(_fill(first, proc.pid, sleeper))
    if isinstance(extra, dict):
        fields = {**genuine, **{k: _fill(v, proc.pid, sleeper) for k, v in extra.items()}}
        _forge(run, first, fields)
    elif isinstance(extra, str):  # raw text for the JSON line
        with open(run / LOCK_NAME, "r+") as f:
            f.truncate(0)
            f.write(first + "\n" + extra + "\n")
    else:
        _forge(run, first, None)
    for action in ("checkpoint", "stop"):
        stderr = _refused(_signal_cli(run, action))
        assert words in stderr, stderr
    time.sleep(0.2)  # a signal sent by mistake would have been delivered by now
    assert sleeper.poll() is None, "an unrelated process was signalled"
    assert proc.poll() is None and _received(log) == [], "the holder was signalled on a forged LOCK"
    assert is_locked(run)


@pytest.mark.slow
def test_a_process_with_lock_open_but_not_holding_it_is_refused(holder, procs) -> None:
    run, proc, log = holder
    reader = subprocess.Popen([sys.executable, "-c", READER, str(run)], stdout=subprocess.PIPE, text=True, env=ENV,
                              start_new_session=True)
    procs.append(reader)
    assert next_line(reader, 20) == f"open {reader.pid}"
    _, genuine = _genuine(run)
    _forge(run, str(reader.pid), {**genuine, "pid": reader.pid})
    stderr = _refused(_signal_cli(run, "stop"))
    assert "does not hold its lock" in stderr
    time.sleep(0.2)
    assert reader.poll() is None and _received(log) == []


@pytest.mark.slow
def test_dead_pid_is_refused(holder, procs) -> None:
    run, proc, log = holder
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not pid_alive(gone.pid)
    _, genuine = _genuine(run)
    _forge(run, str(gone.pid), {**genuine, "pid": gone.pid})
    stderr = _refused(_signal_cli(run, "checkpoint"))
    assert "no process has that pid" in stderr or "does not have this run's LOCK open" in stderr
    assert _received(log) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_lock_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if kind == "fifo":
        os.mkfifo(run / LOCK_NAME)
    elif kind == "symlink":
        target = tmp_path / "elsewhere"
        target.write_text(f"{os.getpid()}\n")
        (run / LOCK_NAME).symlink_to(target)
    else:
        (run / LOCK_NAME).mkdir()
    stderr = _refused(_signal_cli(run, "stop"), library_hint=False)
    assert "lock file" in stderr
    with pytest.raises(BadInput):
        read_lock_holder(run, wait=0)
    with pytest.raises(BadInput):
        RunLock(run).acquire()


def test_signal_holder_in_process_refuses_the_callers_own_pid(holder) -> None:
    run, proc, log = holder
    _, genuine = _genuine(run)
    _forge(run, str(os.getpid()), {**genuine, "pid": os.getpid()})
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        with pytest.raises(BadInput) as refused:
            signal_holder(run, signal.SIGUSR1, wait=0)
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [] and "this very process" in refused.value.message
    assert refused.value.exit_code == 2 and refused.value.hint and "Checkpointer" in refused.value.hint
    assert _received(log) == []


def test_signal_holder_in_process_signals_its_own_lock(tmp_path: Path) -> None:
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        with RunLock(tmp_path) as lock:
            info = signal_holder(tmp_path, signal.SIGUSR1)
            assert info == lock.info
        with pytest.raises(NotRunning):
            signal_holder(tmp_path, signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [signal.SIGUSR1]


def test_read_lock_holder_never_raises_anything_but_badinput(holder) -> None:
    # The reader `ripresa inspect` uses: huge, negative, nested content gives a typed error.
    run, proc, log = holder
    _, genuine = _genuine(run)
    for first, second in [(str(2**70), json.dumps(genuine)), ("9" * 100_000, ""), ("-1", ""), ("0", ""),
                          (str(proc.pid), "[" * 100_000), (str(proc.pid), json.dumps({**genuine, "started": 10**400}))]:
        with open(run / LOCK_NAME, "r+") as f:
            f.truncate(0)
            f.write(first + "\n" + second + "\n")
        try:
            info = read_lock_holder(run, wait=0)
        except BadInput:
            continue
        assert info is not None and info.pid == proc.pid and info.started is None
        info.describe()


@pytest.mark.slow
def test_pivot_stop_trainer_refuses_a_forged_lock(holder, procs) -> None:
    from ripresa.engine.pivot import stop_trainer

    run, proc, log = holder
    sleeper = _sleeper(procs)
    _, genuine = _genuine(run)
    _forge(run, str(sleeper.pid), {**genuine, "pid": sleeper.pid})
    with pytest.raises(BadInput) as refused:
        stop_trainer(run, timeout=5)
    assert "not the trainer of this run" in refused.value.message
    time.sleep(0.2)
    assert sleeper.poll() is None and proc.poll() is None and _received(log) == []


@pytest.mark.slow
def test_signal_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys, ripresa.cli as cli\n"
        "rc = cli.main(['signal', sys.argv[1], 'stop'])\n"
        "print('rc', rc, 'torch', 'torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=ENV,
                         timeout=60)
    assert res.stdout.strip() == "rc 2 torch False", res.stdout + res.stderr
    assert "no trainer is running" in res.stderr
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "ripresa", "signal", str(tmp_path), "checkpoint"],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert res.returncode == 2
    imported = [line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")]
    assert "ripresa.io.lock" in imported and not [m for m in imported if m.split(".")[0] == "torch"]


@pytest.mark.slow
def test_every_public_name_still_imports() -> None:
    code = "import sys\nfrom ripresa import *\nimport ripresa\n" + "".join(
        f"from ripresa import {name}\nassert {name} is ripresa.{name}\n" for name in ripresa.__all__
    ) + "print(sorted(set(ripresa.__all__) - set(dir(ripresa))), 'torch' in sys.modules)\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[] True"  # torch came in with Checkpointer & co, on demand
    with pytest.raises(AttributeError):
        ripresa.no_such_name  # noqa: B018
    assert ripresa.__version__ and ripresa.Checkpointer.__name__ == "Checkpointer"


def test_lock_records_host_boot_and_namespace(tmp_path: Path) -> None:
    with RunLock(tmp_path):
        _, extra = _genuine(tmp_path)
    assert extra["hostname"] == socket.gethostname() and extra["pid"] == os.getpid()
    assert isinstance(extra["pidns"], int) and isinstance(extra["boot_id"], str)


@pytest.mark.slow
def test_fdinfo_and_proc_locks_name_the_real_holder(holder, procs) -> None:
    # The two kernel records signal_holder trusts, read for a real holder and a bystander.
    from ripresa.io.liveness import holds_lock as _holds_lock
    from ripresa.io.liveness import proc_locks_holder as _proc_locks_holder

    run, proc, log = holder
    st = os.stat(run / LOCK_NAME)
    sleeper = _sleeper(procs)
    assert _proc_locks_holder(proc.pid, st.st_ino) is True
    assert _proc_locks_holder(sleeper.pid, st.st_ino) is False
    assert _holds_lock(proc.pid, (st.st_dev, st.st_ino))[0] is True
    assert _holds_lock(sleeper.pid, (st.st_dev, st.st_ino))[0] is False


# The holder as an unprivileged user that made itself non-dumpable: its
# /proc/PID/fd is then root's, unreadable to the same user's `ripresa signal`,
# which must fall back to /proc/locks (world-readable) to recognise it.
NONDUMPABLE_HOLDER = """
import ctypes, os, signal, sys, time
from ripresa.io.lock import RunLock
log = sys.argv[2]
def on(sig, frame):
    with open(log, "a") as f:
        f.write(signal.Signals(sig).name + "\\n")
signal.signal(signal.SIGUSR1, on)
lock = RunLock(sys.argv[1]).acquire()
ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
print("locked", os.getpid(), flush=True)
while True:
    time.sleep(0.05)
"""

NONDUMPABLE_SLEEPER = """
import ctypes, os, time
ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
print("sleeping", os.getpid(), flush=True)
time.sleep(60)
"""

NOBODY = 65534
# setpriv, not Popen(user=...): the interpreter may live under a folder that
# only root can traverse, which setpriv's exec (done before it drops nothing it
# needs) still reaches; the child then runs with uid/gid 65534 and no capabilities.
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all"]


def _nobody_can_run_python() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    res = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import ripresa.io.lock, os; print(os.geteuid())"],
                         capture_output=True, text=True, env=ENV, timeout=60, cwd="/")
    return res.returncode == 0 and res.stdout.strip() == str(NOBODY)


@pytest.mark.slow
@pytest.mark.skipif(not _nobody_can_run_python(), reason="needs root, setpriv, and an interpreter user 65534 can run")
def test_unreadable_proc_fd_falls_back_to_the_kernel_lock_table(procs) -> None:
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ripresa-sig-"))
    try:
        os.chmod(base, 0o777)
        run = base / "run"
        run.mkdir()
        os.chown(run, NOBODY, NOBODY)
        log = base / "signals.txt"
        proc = subprocess.Popen([*AS_NOBODY, sys.executable, "-c", NONDUMPABLE_HOLDER, str(run), str(log)],
                                stdout=subprocess.PIPE, text=True, env=ENV, start_new_session=True, cwd=base)
        procs.append(proc)
        assert next_line(proc, 20) == f"locked {proc.pid}"  # setpriv execs: same pid
        probe = subprocess.run([*AS_NOBODY, sys.executable, "-c", f"import os; os.listdir('/proc/{proc.pid}/fd')"],
                               capture_output=True, text=True, env=ENV, timeout=60, cwd=base)
        if probe.returncode == 0:
            pytest.skip("this kernel lets the same user read a non-dumpable process's fds")
        # A bystander of the same user, non-dumpable too: only /proc/locks can tell it is no holder.
        sleeper = subprocess.Popen([*AS_NOBODY, sys.executable, "-c", NONDUMPABLE_SLEEPER], stdout=subprocess.PIPE,
                                   text=True, env=ENV, start_new_session=True, cwd=base)
        procs.append(sleeper)
        assert next_line(sleeper, 20) == f"sleeping {sleeper.pid}"

        def cli(action: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*AS_NOBODY, sys.executable, "-m", "ripresa", "signal", str(run), action],
                                  capture_output=True, text=True, env=ENV, timeout=60, cwd=base)

        res = cli("checkpoint")
        assert res.returncode == 0 and f"sent SIGUSR1 to pid {proc.pid}" in res.stdout, res.stderr
        assert _wait_received(log, 1) == ["SIGUSR1"]
        _, extra = _genuine(run)
        _forge(run, str(sleeper.pid), {**extra, "pid": sleeper.pid})
        res = cli("stop")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "not the trainer of this run" in res.stderr and "/proc/locks" in res.stderr
        time.sleep(0.2)
        assert sleeper.poll() is None and _received(log) == ["SIGUSR1"]
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.mark.slow
def test_torchrun_forwards_only_to_its_own_children(procs) -> None:
    # The launcher's forwarding: a real child gets the signal; a live process that
    # is not our child (a pid a reaped child may have left for reuse) does not.
    from ripresa.session.torchrun import _forward, _send_to_child, children

    child = subprocess.Popen(["sleep", "60"])
    procs.append(child)
    spawner = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    procs.append(spawner)
    grandchild = int(next_line(spawner, 20))
    try:
        assert child.pid in children() and grandchild not in children()
        _send_to_child(grandchild, signal.SIGTERM)
        _send_to_child(0, signal.SIGTERM)
        time.sleep(0.2)
        assert pid_alive(grandchild)
        previous = signal.getsignal(signal.SIGTERM)
        _forward(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == previous
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        os.kill(grandchild, signal.SIGKILL)
