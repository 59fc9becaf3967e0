"""ripresa: crash-safe, verifiable checkpoints and exact resume for PyTorch runs.

"Checkpoint" in ripresa always means a *resume point* saved to disk — never
activation checkpointing (recomputing activations in backward to save memory).
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__

# Public names, imported on first use (PEP 562): `import ripresa.cli` and
# `ripresa signal RUN stop` never import torch; `from ripresa import X` and
# `ripresa.X` work for every name in __all__ as before.
_LAZY: dict[str, str] = {
    "AsyncCheckpointWriter": "store.async_save",
    "StagingBuffers": "store.async_save",
    "EpochSampler": "core.data",
    "BadInput": "errors",
    "CheckFailed": "errors",
    "IdentityMismatch": "errors",
    "IntegrityError": "errors",
    "LockHeld": "errors",
    "MissingDependency": "errors",
    "OutputExists": "errors",
    "RipresaError": "errors",
    "SaveFailed": "errors",
    "SchemaError": "errors",
    "VerificationFailed": "errors",
    "Checkpoint": "formats.torch_pt",
    "load_checkpoint": "formats.torch_pt",
    "save_checkpoint": "formats.torch_pt",
    "History": "store.history",
    "read_history": "store.history",
    "RunLock": "io.lock",
    "read_lock_holder": "io.lock",
    "DEFAULT_RETENTION": "store.retention",
    "KeepEvery": "store.retention",
    "KeepLast": "store.retention",
    "KeepSteps": "store.retention",
    "parse_retention": "store.retention",
    "RandomStreams": "core.rng",
    "Checkpointer": "session.checkpointer",
    "ForeignCheckpointWarning": "session.checkpointer",
    "Progress": "core.state",
    "Stateful": "core.state",
    "TrainingState": "core.state",
    "CheckpointStore": "store.store",
    "CheckpointWarning": "store.store",
    "Generation": "store.store",
    "Trajectory": "verify.trajectory",
    "read_trajectory": "verify.trajectory",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from .core.data import EpochSampler
    from .core.rng import RandomStreams
    from .core.state import Progress, Stateful, TrainingState
    from .errors import (
        BadInput,
        CheckFailed,
        IdentityMismatch,
        IntegrityError,
        LockHeld,
        MissingDependency,
        OutputExists,
        RipresaError,
        SaveFailed,
        SchemaError,
        VerificationFailed,
    )
    from .formats.torch_pt import Checkpoint, load_checkpoint, save_checkpoint
    from .io.lock import RunLock, read_lock_holder
    from .session.checkpointer import Checkpointer, ForeignCheckpointWarning
    from .store.async_save import AsyncCheckpointWriter, StagingBuffers
    from .store.history import History, read_history
    from .store.retention import DEFAULT_RETENTION, KeepEvery, KeepLast, KeepSteps, parse_retention
    from .store.store import CheckpointStore, CheckpointWarning, Generation
    from .verify.trajectory import Trajectory, read_trajectory


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # `import ripresa; ripresa.io.fsio.X`: a submodule, as the former eager imports allowed.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "__version__",
    "AsyncCheckpointWriter",
    "BadInput",
    "CheckFailed",
    "Checkpoint",
    "CheckpointStore",
    "CheckpointWarning",
    "Checkpointer",
    "DEFAULT_RETENTION",
    "EpochSampler",
    "ForeignCheckpointWarning",
    "Generation",
    "History",
    "IdentityMismatch",
    "IntegrityError",
    "KeepEvery",
    "KeepLast",
    "KeepSteps",
    "LockHeld",
    "MissingDependency",
    "OutputExists",
    "Progress",
    "RandomStreams",
    "RipresaError",
    "RunLock",
    "SaveFailed",
    "SchemaError",
    "StagingBuffers",
    "Stateful",
    "Trajectory",
    "TrainingState",
    "VerificationFailed",
    "load_checkpoint",
    "parse_retention",
    "read_history",
    "read_lock_holder",
    "read_trajectory",
    "save_checkpoint",
]
