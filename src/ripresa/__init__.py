"""ripresa: crash-safe, verifiable checkpoints and exact resume for PyTorch runs.

"Checkpoint" in ripresa always means a *resume point* saved to disk — never
activation checkpointing (recomputing activations in backward to save memory).

The public API is ``__all__`` below (docs/API.md, "Public API"); everything else
is imported from its module, e.g. ``ripresa.store.retention.KeepLast``.
"""

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

from ._version import __version__

_ENV = __import__("os").environ
if "RIPRESA_LAUNCHER_PID" in _ENV or "TORCHELASTIC_RUN_ID" in _ENV:  # a rank of a launcher (session/torchrun.py)
    from .session.torchrun import bind_at_import as _bind

    _bind()  # dies with its launcher (ripresa's, or torchrun's agent) from here on, before any rendezvous
del _ENV

# Public names, imported on first use (PEP 562): `import ripresa.cli` and
# `ripresa signal RUN stop` never import torch.
_LAZY: dict[str, str] = {
    "TrainingState": "core.state",
    "Stateful": "core.state",
    "Progress": "core.state",
    "ScriptState": "core.state",
    "RandomStreams": "core.rng",
    "EpochSampler": "core.data",
    "DistributedEpochSampler": "core.data",
    "StatefulLoader": "core.loader",
    "make_exact": "core.loader",
    "Checkpointer": "session.checkpointer",
    "save_checkpoint": "formats.torch_pt",
    "load_checkpoint": "formats.torch_pt",
    "CheckpointStore": "store.store",
    "verify_resume": "verify.verify",
    "Trajectory": "verify.trajectory",
    "RipresaError": "errors",
    "IntegrityError": "errors",
    "BadInput": "errors",
    "SaveFailed": "errors",
}

# Names the package root exported before the API was cut down (issue 11): they
# still resolve, with a DeprecationWarning that names their module, and are
# not in __all__, dir() or `from ripresa import *`. They leave the root in 0.2.
_DEPRECATED: dict[str, str] = {
    "AsyncCheckpointWriter": "store.async_save",
    "StagingBuffers": "store.async_save",
    "CheckFailed": "errors",
    "IdentityMismatch": "errors",
    "LockHeld": "errors",
    "MissingDependency": "errors",
    "OutputExists": "errors",
    "SchemaError": "errors",
    "Checkpoint": "formats.torch_pt",
    "History": "store.history",
    "read_history": "store.history",
    "RunLock": "io.lock",
    "read_lock_holder": "io.lock",
    "DEFAULT_RETENTION": "store.retention",
    "KeepEvery": "store.retention",
    "KeepLast": "store.retention",
    "KeepSteps": "store.retention",
    "parse_retention": "store.retention",
    "ForeignCheckpointWarning": "session.checkpointer",
    "CheckpointWarning": "store.store",
    "Generation": "store.store",
    "read_trajectory": "verify.trajectory",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from .core.data import DistributedEpochSampler, EpochSampler
    from .core.loader import StatefulLoader, make_exact
    from .core.rng import RandomStreams
    from .core.state import Progress, ScriptState, Stateful, TrainingState
    from .errors import BadInput, IntegrityError, RipresaError, SaveFailed
    from .formats.torch_pt import load_checkpoint, save_checkpoint
    from .session.checkpointer import Checkpointer
    from .store.store import CheckpointStore
    from .verify.trajectory import Trajectory
    from .verify.verify import verify_resume


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    module = _DEPRECATED.get(name)
    if module is not None:
        warnings.warn(f"ripresa.{name} is deprecated and leaves the package root in 0.2; "
                      f"import it from ripresa.{module}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f".{module}", __name__), name)
    # `import ripresa; ripresa.io.fsio.X`: a submodule, as the former eager imports allowed.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "__version__",
    # the state of a run
    "TrainingState",
    "Stateful",
    "Progress",
    "ScriptState",
    "RandomStreams",
    # the data position
    "EpochSampler",
    "DistributedEpochSampler",
    "StatefulLoader",
    "make_exact",
    # the training session over a run folder
    "Checkpointer",
    # one checkpoint.pt file
    "save_checkpoint",
    "load_checkpoint",
    # reading a run folder
    "CheckpointStore",
    # proving a resume exact: the verifier, and what a trainer writes for it
    "verify_resume",
    "Trajectory",
    # errors
    "RipresaError",
    "IntegrityError",
    "BadInput",
    "SaveFailed",
]
