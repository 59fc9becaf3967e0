"""ripresa: crash-safe, verifiable checkpoints and exact resume for PyTorch runs.

"Checkpoint" in ripresa always means a *resume point* saved to disk — never
activation checkpointing (recomputing activations in backward to save memory).
"""

__version__ = "0.1.0"

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
from .rng import RandomStreams
from .state import Progress, Stateful, TrainingState
from .trajectory import Trajectory, read_trajectory

__all__ = [
    "__version__",
    "BadInput",
    "CheckFailed",
    "Checkpoint",
    "EpochSampler",
    "IdentityMismatch",
    "IntegrityError",
    "LockHeld",
    "MissingDependency",
    "OutputExists",
    "Progress",
    "RandomStreams",
    "RipresaError",
    "SaveFailed",
    "SchemaError",
    "Stateful",
    "TrainingState",
    "Trajectory",
    "read_trajectory",
    "VerificationFailed",
    "load_checkpoint",
    "save_checkpoint",
]
