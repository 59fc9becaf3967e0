"""Typed errors of ripresa.

Every error carries four facts a user needs to act on it: the *file* involved,
what was *expected*, what was *found*, and a *hint*. Only the CLI turns these
into exit codes (docs/FAULTS.md):

* ``0`` success;
* ``1`` a check failed: integrity (hash, size, schema, unsafe content),
  identity (versions, code, data), verification mismatch — :class:`CheckFailed`;
* ``2`` bad input or work that could not be completed: missing or unreadable
  file, wrong arguments, existing output folder, missing dependency, a save
  that failed, a run folder locked by another writer — :class:`BadInput`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class RipresaError(Exception):
    """Base of all ripresa errors. ``exit_code`` is what the CLI exits with."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        expected: Any = None,
        found: Any = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.file = str(file) if file is not None else None
        self.expected = expected
        self.found = found
        self.hint = hint

    def __str__(self) -> str:
        lines = [self.message]
        if self.file is not None:
            lines.append(f"  file:     {self.file}")
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.found is not None:
            lines.append(f"  found:    {self.found}")
        if self.hint:
            lines.append(f"  hint:     {self.hint}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly view, for ``--json`` outputs and reports."""
        return {
            "error": type(self).__name__,
            "message": self.message,
            "file": self.file,
            "expected": None if self.expected is None else str(self.expected),
            "found": None if self.found is None else str(self.found),
            "hint": self.hint,
            "exit_code": self.exit_code,
        }


# ---- exit code 2: bad input, or the work could not be completed -------------


class BadInput(RipresaError):
    """Wrong arguments, a missing or unreadable file, a file of the wrong kind."""

    exit_code = 2


class OutputExists(BadInput):
    """An output folder or file that must not exist yet already exists."""


class MissingDependency(BadInput):
    """An optional package needed for this operation is not installed."""


class SaveFailed(BadInput):
    """A save could not be completed; the previous generation is untouched."""


class LockHeld(BadInput):
    """Another process holds the run folder's writer lock."""


# ---- exit code 1: a check failed ---------------------------------------------


class CheckFailed(RipresaError):
    """A verification failed: the input is readable but not what it must be."""

    exit_code = 1


class IntegrityError(CheckFailed):
    """Hash, size, commit marker, schema or safety check of a saved file failed."""


class SchemaError(IntegrityError):
    """A checkpoint's content does not have the expected keys, types or shapes."""


class IdentityMismatch(CheckFailed):
    """Versions, code or data differ from those the checkpoint was written with."""


class VerificationFailed(CheckFailed):
    """The resume-verification protocol found a divergence."""
