"""How ripresa starts its own child processes: always ripresa's own code (docs/FAULTS.md, "Child processes").

``python -m ripresa`` puts the working folder first on ``sys.path``, and so does
every empty or relative entry of ``PYTHONPATH`` (Python makes them absolute
against the working folder). A ``ripresa/`` package planted in the folder a
user runs a command from (say, a hostile run folder they ``cd`` into) would
then run instead of ripresa. Every child that runs ripresa's code — ``pivot
--restart``, ``demo``, the ranks of ``python -m ripresa.torchrun ... -m
ripresa`` — is started through :func:`ripresa_argv` and :func:`child_env`:

* ``-P`` (Python 3.11+): nothing unsafe is prepended to ``sys.path``;
* ``PYTHONSAFEPATH=1`` in the child's environment, so that the same holds for
  the processes *it* starts with ``python -m`` (torchrun starts each rank as
  ``python -u -m ripresa``);
* ``PYTHONPATH`` without its empty and relative entries (each would be the
  working folder, or a folder inside it); absolute entries are kept, so test
  fault injection through ``PYTHONPATH`` (tests/support) still works;
* the folder this very ``ripresa`` package was imported from in front of
  ``PYTHONPATH`` when it is not an installation folder (``site-packages``), so
  the child runs the same ripresa as the parent (a source checkout included).

A user's own program (``ripresa verify -- python train.py``) is not such a
child: it is started as the user wrote it.
"""

from __future__ import annotations

import os
import site
import sys
from collections.abc import Mapping
from pathlib import Path

#: The environment variable that makes every ``python`` of the process tree behave as ``python -P``.
SAFE_PATH_ENV = "PYTHONSAFEPATH"


def _package_root() -> Path:
    """The folder that holds the ``ripresa`` package this process imported."""
    return Path(__file__).resolve().parents[2]


def _installation_dirs() -> set[Path]:
    dirs = set()
    for d in [*getattr(site, "getsitepackages", lambda: [])(), getattr(site, "getusersitepackages", lambda: "")()]:
        if d:
            dirs.add(Path(d).resolve())
    return dirs


def ripresa_argv(*args: str, module: str = "ripresa") -> list[str]:
    """``python -P -m MODULE ARGS``: this interpreter, ripresa's own code, nothing from the working folder."""
    return [sys.executable, "-P", "-m", module, *args]


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a child that runs ripresa (see the module doc); ``extra`` is added last."""
    env = dict(os.environ if base is None else base)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.isabs(p)]
    root = _package_root()
    if root not in _installation_dirs() and str(root) not in entries:
        entries.insert(0, str(root))
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        env.pop("PYTHONPATH", None)
    env[SAFE_PATH_ENV] = "1"
    env.update(extra)
    return env
