"""``python -m ripresa.torchrun``: ``torchrun`` that passes SIGUSR1 (and SIGTERM, SIGINT) on to every rank.

Same arguments as ``torchrun`` (abbreviated options refused: ``--run`` is never ``--run-path``).
The launcher forwards SIGTERM, SIGINT and SIGUSR1 to every rank and keeps supervising: the ranks
save the same step, then all continue (SIGUSR1) or all exit 0 (a stop), and so does the launcher.
SIGUSR1 never ends anything: blocked from the launcher's first line and in every rank until its
Checkpointer handles it. Ranks die with their launcher. The rules, moment by moment:
docs/ARCHITECTURE.md, "Signals through the launcher"; use: README.md and docs/SHARDED.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def children(pid: int | None = None) -> list[int]:
    """Pids of the direct children of ``pid`` (default: this process), from ``/proc``."""
    pid = os.getpid() if pid is None else pid
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return sorted(set(out))


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc/PID/stat``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state"
    except (OSError, ValueError, IndexError):
        return None


def _send_to_child(pid: int, signum: int) -> None:
    """Signal ``pid`` only if it is still this process's child (a reaped child's pid may be reused)."""
    if pid <= 0:
        return
    pidfd = None
    opener = getattr(os, "pidfd_open", None)
    if opener is not None and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = opener(pid)  # pinned before the parent check below
        except OSError:
            pidfd = None
    try:
        if parent_of(pid) != os.getpid():
            return
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(pid, signum)
    except OSError:  # exited meanwhile, or not ours to signal: nothing to forward
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)


#: How long a SIGUSR1 waits for a starting rank to install its handler (then it is dropped, never fatal).
USR1_WAIT_S = 300.0


def catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler installed for ``signum`` (``SigCgt`` of ``/proc/PID/status``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _send_when_caught(pid: int, signum: int) -> None:
    """Deliver ``signum`` once ``pid`` catches it; give up when it exits or after :data:`USR1_WAIT_S`."""
    deadline = time.monotonic() + USR1_WAIT_S
    while time.monotonic() < deadline and parent_of(pid) == os.getpid():
        if catches(pid, signum):
            _send_to_child(pid, signum)
            return
        time.sleep(0.05)


def blocks(pid: int, signum: int) -> bool:
    """Whether ``pid``'s main thread blocks ``signum`` (``SigBlk`` of ``/proc/PID/status``): it stays pending there."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(8192).splitlines():
                if line.startswith(b"SigBlk:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _forward(signum: int, frame: FrameType | None) -> None:
    for child in children():
        if signum == signal.SIGUSR1 and not catches(child, signum) and not blocks(child, signum):
            # not started by this launcher (its ranks start with SIGUSR1 blocked), no handler yet, and the
            # default action would end it: the signal waits until its Checkpointer installs the handler
            threading.Thread(target=_send_when_caught, args=(child, signum), daemon=True).start()
        else:
            _send_to_child(child, signum)  # caught, or blocked: pending until the rank's handler unblocks it


#: The environment variable that names a rank's launcher: ``PID:START``, its pid and its start time (clock ticks
#: since boot, field 22 of ``/proc/PID/stat``), so a reused pid never passes for it (:func:`bind_at_import`).
LAUNCHER_ENV = "RIPRESA_LAUNCHER_PID"
#: The parent-death signal the launcher gives each rank as it forks it, blocked there: ``import ripresa`` finds it
#: set (a fork clears it: only the launcher's own children carry it) and pending if the launcher has died since.
LAUNCHER_DEATH_SIGNAL = signal.SIGRTMIN + 6
#: The exit status of a rank that finds its launcher gone at ``import ripresa`` (docs/ARCHITECTURE.md,
#: "Signals through the launcher"): 2, the work was not completed.
ORPHAN_EXIT = 2
_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
#: The launcher this process was bound to at ``import ripresa`` (its pid), if any.
_BOUND: list[int] = []


def block_checkpoint_signal() -> None:
    """Block SIGUSR1 in this thread; threads and processes started from it afterwards inherit the block."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def _usr1_forwarder() -> None:
    while True:
        signal.sigwait({signal.SIGUSR1})
        _forward(signal.SIGUSR1, None)


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return int(stat[stat.rindex(b")") + 2 :].split()[19])  # fields from the 3rd on: starttime is the 22nd
    except (OSError, ValueError, IndexError):
        return None


def launcher_value(pid: int | None = None) -> str:
    """The value of :data:`LAUNCHER_ENV` that names ``pid`` (default: this process): ``PID:START``."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid)}"


def parse_identity(raw: str) -> tuple[int, int | None] | None:
    """``PID:START`` (or a bare ``PID``, as earlier launchers wrote it: then only the parent check applies)."""
    pid, sep, start = raw.partition(":")
    if not (0 < len(pid) <= 10 and pid.isascii() and pid.isdigit()) \
            or sep and not (0 < len(start) <= 20 and start.isascii() and start.isdigit()):
        return None
    return int(pid), int(start) if sep else None


def _libc():  # noqa: ANN202 - a ctypes library
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _death_signal() -> int:
    """This process's parent-death signal (0: none)."""
    import ctypes

    out = ctypes.c_int(0)
    try:
        if _libc().prctl(_PR_GET_PDEATHSIG, ctypes.byref(out), 0, 0, 0) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return out.value


def _orphan_line(launcher: int, what: str) -> None:
    """The line an orphaned rank prints before it exits with :data:`ORPHAN_EXIT` (never a silent end)."""
    from ..console import one_line

    line = one_line(f"the launcher of this rank (python -m ripresa.torchrun, pid {launcher}) {what}: this rank "
                    f"stops before it touches the run folder, exit {ORPHAN_EXIT}; hint: start the run again "
                    "with python -m ripresa.torchrun")
    try:
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass
    try:
        os.write(2, f"ripresa: error: {line}\n".encode(errors="replace"))
    except OSError:
        pass
    os._exit(ORPHAN_EXIT)


def bind_at_import() -> None:
    """``import ripresa`` in a rank of ``python -m ripresa.torchrun``: die with the launcher from here on.

    The variable (:data:`LAUNCHER_ENV`) is removed from ``os.environ`` first, always: nothing this process
    starts inherits it. It is trusted only in the launcher's own child: one whose parent-death signal is
    :data:`LAUNCHER_DEATH_SIGNAL` (the launcher sets it as it forks a rank; a fork clears it, so a child of
    a rank never has it), or whose parent is the process named, pid and start time (a bare pid: the parent's
    pid only). Such a rank is then SIGKILLed by the kernel when the launcher dies (``PR_SET_PDEATHSIG``,
    before any rendezvous); one whose launcher has died already prints one line and exits :data:`ORPHAN_EXIT`. Anywhere else (a stale,
    inherited or forged value) the variable is dropped and nothing happens (docs/ARCHITECTURE.md, "Signals
    through the launcher").
    """
    raw = os.environ.pop(LAUNCHER_ENV, "")
    parsed = parse_identity(raw)
    if not sys.platform.startswith("linux"):
        return
    if parsed is None:
        if not raw:
            _bind_elastic_rank()  # a rank of plain torchrun: die with its agent too
        return
    launcher, start = parsed
    forked_by_launcher = _death_signal() == LAUNCHER_DEATH_SIGNAL
    if forked_by_launcher and LAUNCHER_DEATH_SIGNAL in signal.sigpending():
        _orphan_line(launcher, "has ended")
    if os.getppid() != launcher or (start is not None and start_time(launcher) != start):
        if forked_by_launcher:  # its parent at fork is gone (the signal is on its way): the run has ended
            _orphan_line(launcher, "has ended")
        return  # not the launcher's child: a value inherited, left over or forged, dropped
    try:
        _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher or (forked_by_launcher and LAUNCHER_DEATH_SIGNAL in signal.sigpending()):
        _orphan_line(launcher, "ended as this rank bound to it")
    _BOUND[:] = [launcher]
    if forked_by_launcher:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {LAUNCHER_DEATH_SIGNAL})  # SIGKILL is its death signal now


def bind_to_launcher() -> None:
    """In a rank's Checkpointer: a rank bound at ``import ripresa`` whose launcher has ended stops here."""
    if _BOUND and os.getppid() != _BOUND[0]:
        from ..errors import BadInput

        raise BadInput(f"the launcher of this rank (pid {_BOUND[0]}) has ended: this rank is an orphan and stops "
                       "before it touches the run folder", hint="start the run again with python -m ripresa.torchrun")


def _fork_rank(launcher: int, libc) -> None:  # noqa: ANN001 - a ctypes library
    """In a rank between fork and exec: its parent-death signal, blocked, pending at once if the launcher is gone."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {LAUNCHER_DEATH_SIGNAL})
    libc.prctl(_PR_SET_PDEATHSIG, int(LAUNCHER_DEATH_SIGNAL), 0, 0, 0)
    if os.getppid() != launcher:
        os.kill(os.getpid(), LAUNCHER_DEATH_SIGNAL)


def _rank_popen(popen):  # noqa: ANN001, ANN202
    """``popen`` (torchrun's way to start a rank) that starts it bound to this launcher (:func:`_fork_rank`)."""
    launcher, libc = os.getpid(), _libc()

    def start(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if kwargs.get("preexec_fn") is None and sys.platform.startswith("linux"):
            kwargs["preexec_fn"] = lambda: _fork_rank(launcher, libc)
        return popen(*args, **kwargs)

    return start


def main(argv: Sequence[str] | None = None) -> int:
    # First: no moment without a disposition for the forwarded signals (SIGUSR1 is blocked until the
    # forwarder thread waits for it; ranks start with it blocked; SIGTERM/SIGINT are forwarded).
    block_checkpoint_signal()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    threading.Thread(target=_usr1_forwarder, name="ripresa-usr1", daemon=True).start()
    os.environ[LAUNCHER_ENV] = launcher_value()
    from torch.distributed import run as trun

    try:  # each rank is forked bound to this launcher (bind_at_import); without the hook, its parent is checked
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as handler,
        )

        if callable(getattr(handler, "Popen", None)):
            handler.Popen = _rank_popen(handler.Popen)
    except ImportError:  # pragma: no cover - another torch: bind_at_import checks the parent's pid and start time
        pass

    parser = trun.get_args_parser()
    parser.allow_abbrev = False
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    # torchrun keeps SIGHUP/SIGQUIT (tear the group down); SIGTERM, SIGINT and SIGUSR1 are ours (above).
    args.signals_to_handle = "SIGHUP,SIGQUIT"
    if args.module and not args.no_python and (args.training_script == "ripresa"
                                                or args.training_script.startswith("ripresa.")):
        # torchrun starts each rank as `python -u -m ripresa`: the ranks run ripresa's own code,
        # never a ripresa/ planted in the working folder (docs/FAULTS.md, "Child processes")
        from ..io.child import child_env

        env = child_env()
        os.environ.clear()
        os.environ.update(env)
    trun.run(args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def _agent_parent() -> bool:
    """This process's parent is a torch elastic agent (its command line names torch.distributed.run or torchrun)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            cmd = f.read(4096)
    except OSError:
        return False
    return b"torch.distributed.run" in cmd or b"torchrun" in cmd


def _bind_elastic_rank() -> None:
    """``import ripresa`` in a rank of plain ``torchrun`` (``TORCHELASTIC_RUN_ID`` set, no ripresa launcher):
    SIGKILLed by the kernel when its agent dies. One whose agent died before (re-parented to init: torchrun's
    ranks are its own children) prints one line and exits :data:`ORPHAN_EXIT` before it joins any group; a rank
    started through a wrapper (another parent) is left alone (docs/DISTRIBUTED.md, "Losing a node")."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if _agent_parent():
        bind_to_agent()
    elif os.getppid() == 1:
        _orphan_agent_line()


def _orphan_agent_line() -> None:
    try:
        os.write(2, b"ripresa: error: the torchrun agent that started this rank has ended: this rank stops before "
                    b"it touches the run folder, exit 2; hint: start the node's torchrun again\n")
    except OSError:
        pass
    os._exit(ORPHAN_EXIT)


def bind_to_agent() -> bool:
    """A rank of a multi-node run under plain ``torchrun``: die with the agent that started it.

    torchrun starts each rank in a session of its own, so a SIGKILL of a node's launcher (a lost node, as
    an operator or a scheduler ends it) used to leave its ranks training on, unsupervised: the survivors
    never learned that the node was gone. The rank asks the kernel to SIGKILL it when its parent ends
    (``PR_SET_PDEATHSIG``), but only when that parent is a torch elastic agent (``TORCHELASTIC_RUN_ID`` set,
    the parent's command line names ``torch.distributed.run`` or ``torchrun``); a parent already gone
    (re-parented before the call) stops the rank at once. True when bound (docs/DISTRIBUTED.md, "Losing a node").
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if _death_signal() == int(signal.SIGKILL):  # bound at import (or by ripresa's launcher)
        if os.getppid() == 1:
            _orphan_agent_line()
        return True
    parent = os.getppid()
    if not _agent_parent():
        if parent == 1:  # re-parented: its agent has ended
            _orphan_agent_line()
        return False
    try:
        _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the agent ended before the binding took: this rank is an orphan already
        _orphan_agent_line()
    return True
