"""ripresa: crash-safe, verifiable checkpoints and exact resume for PyTorch runs.

"Checkpoint" in ripresa always means a *resume point* saved to disk — never
activation checkpointing (recomputing activations in backward to save memory).
"""

__version__ = "0.1.0"

from .async_save import AsyncCheckpointWriter, StagingBuffers
from .data import EpochSampler
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
from .history import History, read_history
from .lock import RunLock, read_lock_holder
from .retention import DEFAULT_RETENTION, KeepEvery, KeepLast, KeepSteps, parse_retention
from .rng import RandomStreams
from .session import Checkpointer, ForeignCheckpointWarning
from .state import Progress, Stateful, TrainingState
from .store import CheckpointStore, CheckpointWarning, Generation
from .trajectory import Trajectory, read_trajectory

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
