"""Run a trainer with two test-only levers on the memory tier (tests/test_memory_integrations.py).

    python tests/support/memory_harness.py -m ripresa train ARGS...     # the CLI
    python tests/support/memory_harness.py SCRIPT ARGS...               # a script, as ``python SCRIPT ARGS``

* ``RIPRESA_TEST_KILL_AFTER_STEP=K``: a real SIGKILL of this process right after
  ``Checkpointer.step_done(K)`` returned (step K's capture handed to the tier's
  thread, perhaps not yet copied or hashed: the worst moment for the tier).
* ``RIPRESA_TEST_COPY_DELAY=S`` (with ``RIPRESA_TEST_COPY_DELAY_FROM=N``: the
  captures of step N on only): the tier's thread sleeps S seconds before it
  copies a capture. The loop's next optimizer step must wait for the copy (the
  optimizer's step pre-hook): without that wait the slot would hold the next
  step's parameters beside this step's counters, and a resume from it would
  not be bitwise.

Neither lever is part of ripresa: the package reads neither variable.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

from ripresa.session.checkpointer import Checkpointer
from ripresa.store.memory import MemoryTier

_kill = os.environ.get("RIPRESA_TEST_KILL_AFTER_STEP")
_delay = os.environ.get("RIPRESA_TEST_COPY_DELAY")

if _kill:
    _at = int(_kill)
    _step_done = Checkpointer.step_done

    def step_done(self, step, **metrics):  # type: ignore[no-untyped-def]
        out = _step_done(self, step, **metrics)
        if step == _at:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    Checkpointer.step_done = step_done  # type: ignore[method-assign]

if _delay:
    _seconds = float(_delay)
    _from = int(os.environ.get("RIPRESA_TEST_COPY_DELAY_FROM") or 0)
    _run = MemoryTier._run

    def slow_run(self, job, *args, **kwargs):  # type: ignore[no-untyped-def]
        if job.step >= _from:
            time.sleep(_seconds)
        return _run(self, job, *args, **kwargs)

    MemoryTier._run = slow_run  # type: ignore[method-assign]


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
