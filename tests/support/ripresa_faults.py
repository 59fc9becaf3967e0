"""Fault injectors for the tests: SIGKILL or ``OSError`` at chosen file operations, SIGKILL at distributed points.

Production code only *offers* hook points: ``ripresa.io.fsio.ops`` (``hook``,
``after_hook``, ``byte_budget``/``on_budget_spent``) and
``ripresa.session.distributed.fault_hook``. This module, which is no part of
the package, decides to crash or fail there (docs/FAULTS.md):

* :func:`install_crash_hook` — ``RIPRESA_CRASH_AT`` (SIGKILL at an exact
  system-call boundary or byte offset);
* :func:`install_fail_hook` — ``RIPRESA_FAIL_AT`` (an ``OSError`` such as EIO
  at chosen operations);
* :func:`install_dist_fault` — ``RIPRESA_DIST_FAULT`` (SIGKILL of one rank at a
  named point of a distributed save).

A test switches them on in a child process with :func:`fault_env`: the child's
environment gets the variables *and* this folder on ``PYTHONPATH``, whose
``sitecustomize.py`` calls :func:`install_from_env` when the interpreter
starts. A process that inherits the variables without this folder on its path
runs unharmed: ripresa itself never reads them. Forked children of the test
process call the ``install_*`` functions directly.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ripresa.errors import BadInput
from ripresa.io import fsio

#: This folder: put on a child's ``PYTHONPATH``, its ``sitecustomize.py`` installs the injectors.
SUPPORT = Path(__file__).resolve().parent
CRASH_AT = "RIPRESA_CRASH_AT"
FAIL_AT = "RIPRESA_FAIL_AT"
DIST_FAULT = "RIPRESA_DIST_FAULT"
#: The variables that switch injection on (read only by this module).
FAULT_VARS = (CRASH_AT, FAIL_AT, DIST_FAULT)

_OPS = ("open", "write", "fsync", "rename", "fsync_dir", "unlink", "any")


def fault_env(*, crash_at: str | None = None, fail_at: str | None = None, dist_fault: str | None = None,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to a child's environment so that its faults fire.

    Returns the given ``RIPRESA_CRASH_AT`` / ``RIPRESA_FAIL_AT`` /
    ``RIPRESA_DIST_FAULT`` and ``PYTHONPATH`` with this folder in front of
    ``base``'s (``os.environ`` by default), so that the child's
    ``sitecustomize`` installs the injectors; torchrun passes both on to its
    ranks. Use as ``env=dict(os.environ, **fault_env(crash_at="fsync:2"))``.
    With no fault named, only ``PYTHONPATH`` (a process that installs them
    itself later, e.g. the forking zygote of ``test_ledger.py``).
    """
    base = os.environ if base is None else base
    path = [str(SUPPORT)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SUPPORT)]
    env = {"PYTHONPATH": os.pathsep.join(path)}
    for name, value in ((CRASH_AT, crash_at), (FAIL_AT, fail_at), (DIST_FAULT, dist_fault)):
        if value is not None:
            env[name] = value
    return env


def install_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Install the injectors that ``RIPRESA_CRASH_AT``, ``RIPRESA_FAIL_AT`` and ``RIPRESA_DIST_FAULT`` name.

    Called by ``sitecustomize`` at interpreter start (and by forked children
    after they set their variables). A crash hook is installed before a fail
    hook, which chains to it.
    """
    environ = os.environ if environ is None else environ
    if environ.get(CRASH_AT):
        install_crash_hook(environ[CRASH_AT])
    if environ.get(FAIL_AT):
        install_fail_hook(environ[FAIL_AT])
    if environ.get(DIST_FAULT):
        install_dist_fault(environ[DIST_FAULT])


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _parse_target(text: str) -> tuple[str, str | None]:
    """``"3@.json"`` → ``("3", ".json")``."""
    target, _, where = text.partition("@")
    return target, (where or None)


def install_crash_hook(spec: str, *, kill: Callable[[], None] = _kill_self) -> None:
    """Crash this process at one point of its file operations (``RIPRESA_CRASH_AT``).

    ``spec`` (all forms take an optional ``@TEXT`` suffix: count only
    operations whose path contains ``TEXT``, e.g. ``@.json`` or
    ``@step_000002``):

    * ``op:N`` — SIGKILL right *before* the N-th ``op`` (``open``, ``write``,
      ``fsync``, ``rename``, ``fsync_dir``, ``unlink``, or ``any``);
    * ``after:op:N`` — SIGKILL right *after* the N-th ``op`` completed;
    * ``bytes:N`` — SIGKILL once writes have put exactly N bytes on disk (a
      write is cut there, so the kill can land in the middle of a write's
      buffer: a torn write).

    ``kill`` replaces the SIGKILL. Used by ``sitecustomize`` from the
    environment and by forked test children directly.
    """
    ops = fsio.ops
    raw = spec.strip()
    try:
        if raw.startswith("bytes:"):
            count, where = _parse_target(raw[len("bytes:"):])
            budget = int(count)
            if budget < 0:
                raise ValueError
            if where is None:
                ops.byte_budget = budget
                ops.on_budget_spent = kill
                return
            seen = {"bytes": 0}

            def before_write(name: str, path: str) -> None:
                if name == "write" and where in path:
                    # only this file's writes are cut: arm the budget for this call
                    ops.byte_budget = budget - seen["bytes"]
                    ops.on_budget_spent = kill
                elif ops.on_budget_spent is kill:
                    ops.byte_budget = None

            def after_write(name: str, path: str) -> None:
                if name == "write" and where in path and ops.byte_budget is not None:
                    seen["bytes"] = budget - ops.byte_budget

            ops.hook, ops.after_hook = before_write, after_write
            return
        when = "before"
        rest = raw
        if raw.startswith("after:"):
            when, rest = "after", raw[len("after:"):]
        op, _, n = rest.partition(":")
        count, where = _parse_target(n or "1")
        target = int(count)
        if op not in _OPS or target < 1:
            raise ValueError
    except ValueError:
        raise BadInput(
            f"invalid {CRASH_AT}",
            expected="op:N, after:op:N or bytes:N (op: " + ", ".join(_OPS) + "), optionally @TEXT",
            found=spec,
        ) from None
    counts = {"n": 0}

    def hook(name: str, path: str) -> None:
        if op != "any" and name != op:
            return
        if where is not None and where not in path:
            return
        counts["n"] += 1
        if counts["n"] == target:
            kill()

    if when == "before":
        ops.hook = hook
    else:
        ops.after_hook = hook


def install_fail_hook(spec: str) -> None:
    """Make chosen operations fail with an ``OSError`` (``RIPRESA_FAIL_AT``).

    ``spec``: ``op:N[-M|+][:ERRNO][@TEXT]`` — the N-th ``op`` (through the
    M-th, or every one from the N-th on with ``+``) raises
    ``OSError(ERRNO)`` *before* it runs; ``ERRNO`` is a name such as ``EIO``
    (the default), ``ENOSPC`` or ``EFBIG``; ``@TEXT`` counts only operations
    whose path contains ``TEXT``. Example: ``fsync:1-2:EIO@step_`` fails the
    fsync of the first generation's first two files. A real process so
    meets a failing disk without any mocking.
    """
    try:
        body, _, where = spec.strip().partition("@")
        parts = body.split(":")
        op, rng = parts[0], parts[1]
        code = getattr(errno, parts[2]) if len(parts) > 2 else errno.EIO
        if len(parts) > 3 or op not in _OPS:
            raise ValueError
        if rng.endswith("+"):
            first, last = int(rng[:-1]), None
        elif "-" in rng:
            a, b = rng.split("-")
            first, last = int(a), int(b)
        else:
            first = last = int(rng)
        if first < 1 or (last is not None and last < first):
            raise ValueError
    except (ValueError, IndexError, AttributeError):
        raise BadInput(
            f"invalid {FAIL_AT}",
            expected="op:N[-M|+][:ERRNO][@TEXT], e.g. fsync:1:EIO",
            found=spec,
        ) from None
    counts = {"n": 0}
    previous = fsio.ops.hook

    def hook(name: str, path: str) -> None:
        if previous is not None:
            previous(name, path)
        if op != "any" and name != op:
            return
        if where and where not in path:
            return
        counts["n"] += 1
        if counts["n"] >= first and (last is None or counts["n"] <= last):
            raise OSError(code, os.strerror(code), path)

    fsio.ops.hook = hook


def install_delay_hook(spec: str) -> Callable[[], None]:
    """Make chosen operations slow: ``op:SECONDS[@TEXT]`` sleeps before each ``op`` (whose path contains ``TEXT``).

    A save of known cost for the cadence tests (e.g. ``fsync:0.25@.bin.tmp``:
    each ``.bin``'s fsync takes 0.25 s more), in this process. Chains to the
    hook already installed; returns the function that uninstalls it.
    """
    try:
        body, _, where = spec.strip().partition("@")
        op, seconds = body.split(":")
        delay = float(seconds)
        if op not in _OPS or not 0 <= delay < 60:
            raise ValueError
    except ValueError:
        raise BadInput("invalid delay", expected="op:SECONDS[@TEXT], e.g. fsync:0.25@.bin.tmp", found=spec) from None
    previous = fsio.ops.hook

    def hook(name: str, path: str) -> None:
        if previous is not None:
            previous(name, path)
        if (op == "any" or name == op) and (not where or where in path):
            time.sleep(delay)

    fsio.ops.hook = hook

    def uninstall() -> None:
        fsio.ops.hook = previous

    return uninstall


def install_dist_fault(spec: str, *, kill: Callable[[], None] = _kill_self) -> None:
    """Kill rank ``RANK`` at ``POINT`` of the save of step ``STEP`` (``RIPRESA_DIST_FAULT=POINT:RANK:STEP``).

    Points: ``before_gather``, ``after_shards`` (synchronous saves), ``shards_written`` (asynchronous ones, in the
    background write, after the rank's file and before DCP gathers every rank's result; where
    ``ripresa.session.distributed.fault_point`` is called). Only in the first
    attempt of a ``torchrun --max-restarts`` group
    (``TORCHELASTIC_RESTART_COUNT`` = 0), so the restarted group completes.
    """
    try:
        point, rank, step = spec.split(":")
        target = (point, int(rank), int(step))
    except ValueError:
        raise BadInput(f"invalid {DIST_FAULT}", expected="POINT:RANK:STEP, e.g. after_shards:1:8", found=spec) from None
    from ripresa.session import distributed

    def hook(name: str, at_step: int, at_rank: int) -> None:
        if (name, at_rank, at_step) == target and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            kill()

    distributed.fault_hook = hook
