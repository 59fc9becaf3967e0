"""How ripresa starts its own child processes: always ripresa's own code (docs/FAULTS.md, "Child processes").

``python -m ripresa`` and every empty or relative ``PYTHONPATH`` entry put the working folder first on
``sys.path``, where a planted ``ripresa/`` package would run instead of ripresa. Every child that runs
ripresa's code (``pivot --restart``, ``demo``, the ranks of ``python -m ripresa.torchrun ... -m
ripresa``) is started through :func:`ripresa_argv` (``-P``) and :func:`child_env`
(``PYTHONSAFEPATH=1``, a ``PYTHONPATH`` without empty or relative entries, this package's folder in
front when it is not an installation folder). A user's own program (``ripresa verify -- python
train.py``) is not such a child: it is started as the user wrote it.
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
