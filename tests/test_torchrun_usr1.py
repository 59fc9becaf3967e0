"""``python -m ripresa.torchrun`` holds a SIGUSR1 for a rank that is still starting (docs/ARCHITECTURE.md).

SIGUSR1's default action ends a process: a rank that has not built its
Checkpointer yet (importing torch, joining the group) has no handler, so a
forwarded SIGUSR1 would kill it. The launcher's forwarder waits until the
rank catches the signal, then delivers it. Real child processes, real signals.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from ripresa.session import torchrun as launcher

CHILD = """
import signal, sys, time
time.sleep(float(sys.argv[1]))  # starting: no handler yet
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
t0 = time.monotonic()
while not got and time.monotonic() - t0 < 20:
    time.sleep(0.01)
print("usr1" if got else "none", flush=True)
"""


def test_a_sigusr1_forwarded_to_a_starting_rank_waits_for_its_handler():
    child = subprocess.Popen([sys.executable, "-c", CHILD, "1.0"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        assert not launcher.catches(child.pid, signal.SIGUSR1)  # still starting
        launcher._forward(signal.SIGUSR1, None)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0, child.returncode  # not ended by SIGUSR1's default action (-10)
    assert out.strip() == "usr1"  # and the signal was delivered once the handler existed


def test_a_rank_with_its_handler_gets_sigusr1_at_once():
    child = subprocess.Popen([sys.executable, "-c", CHILD, "0"], stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not launcher.catches(child.pid, signal.SIGUSR1):
            assert time.monotonic() - t0 < 20
            time.sleep(0.01)
        launcher._forward(signal.SIGUSR1, None)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0 and out.strip() == "usr1"
