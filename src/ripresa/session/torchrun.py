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


def _parent_of(pid: int) -> int | None:
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
        if _parent_of(pid) != os.getpid():
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
    while time.monotonic() < deadline and _parent_of(pid) == os.getpid():
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


#: The environment variable that tells a rank its launcher's pid (:func:`bind_to_launcher`).
LAUNCHER_ENV = "RIPRESA_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def block_checkpoint_signal() -> None:
    """Block SIGUSR1 in this thread; threads and processes started from it afterwards inherit the block."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def _usr1_forwarder() -> None:
    while True:
        signal.sigwait({signal.SIGUSR1})
        _forward(signal.SIGUSR1, None)


def bind_to_launcher() -> None:
    """In a rank of ``python -m ripresa.torchrun``: die with the launcher; if it is gone already, stop here.

    Does nothing outside such a rank (no :data:`LAUNCHER_ENV`), in a process
    that is not the launcher's direct child (a grandchild inherits the
    variable), or off Linux.
    """
    raw = os.environ.get(LAUNCHER_ENV, "")
    if not raw.isdigit() or not sys.platform.startswith("linux"):
        return
    launcher = int(raw)
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        from ..errors import BadInput

        raise BadInput(f"the launcher of this rank (pid {launcher}) has ended: this rank is an orphan and stops "
                       "before it touches the run folder", hint="start the run again with python -m ripresa.torchrun") from None
    except PermissionError:
        return
    if os.getppid() != launcher:
        return  # a grandchild of the launcher: not one of its ranks
    _die_with_parent(launcher)


def bind_at_import() -> None:
    """``import ripresa`` in a process of ``python -m ripresa.torchrun``'s run: a rank dies with the launcher
    from here on (``PR_SET_PDEATHSIG``, before any rendezvous: a rank whose launcher is killed while it
    starts would otherwise wait out ``init_process_group`` with a store that is gone); any process of the
    run (a rank, or one a rank started) whose launcher is gone already ends now, as the launcher's death
    ends the run (docs/ARCHITECTURE.md, "Signals through the launcher").
    """
    raw = os.environ.get(LAUNCHER_ENV, "")
    if not raw.isdigit() or not sys.platform.startswith("linux"):
        return
    launcher = int(raw)
    if os.getppid() == launcher:
        _die_with_parent(launcher)
        return
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:  # the run's launcher has ended: so has the run
        os.kill(os.getpid(), signal.SIGKILL)
    except PermissionError:
        return


def _die_with_parent(launcher: int) -> None:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # it died between the check and the prctl
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    # First: no moment without a disposition for the forwarded signals (SIGUSR1 is blocked until the
    # forwarder thread waits for it; ranks start with it blocked; SIGTERM/SIGINT are forwarded).
    block_checkpoint_signal()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    threading.Thread(target=_usr1_forwarder, name="ripresa-usr1", daemon=True).start()
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    from torch.distributed import run as trun

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
