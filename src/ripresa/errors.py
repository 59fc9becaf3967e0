"""Typed errors of ripresa (docs/FAULTS.md, "Exit codes and the exception tree").

Every error carries the four facts a user needs to act on it: the *file* involved, what was
*expected*, what was *found*, and a *hint*. Three families, siblings under :class:`RipresaError`:
:class:`IntegrityError` (exit 1: a check failed), :class:`BadInput` (exit 2: bad input; its
:class:`IdentityMismatch` keeps exit 1) and :class:`SaveFailed` (exit 2: a save could not be
completed; the previous generation is untouched). :class:`UploadPending` (exit 3) is no failure of
the work: a run that ended with its final generation only on this machine (its mirror could not
be reached). Only the CLI turns ``exit_code`` into an exit code. Misuse of the Python API raises ``TypeError`` or ``ValueError``, not a ripresa error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .text import escape_terminal


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
        """The four facts, terminal-safe: a control character quoted from a file prints as a visible escape
        (docs/FAULTS.md, "Trust model"); file, expected and found stay on their one line each."""
        lines = [escape_terminal(self.message)]
        if self.file is not None:
            lines.append(f"  file:     {escape_terminal(self.file, newlines=False)}")
        if self.expected is not None:
            lines.append(f"  expected: {escape_terminal(self.expected, newlines=False)}")
        if self.found is not None:
            lines.append(f"  found:    {escape_terminal(self.found, newlines=False)}")
        if self.hint:
            lines.append(f"  hint:     {escape_terminal(self.hint)}")
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


# ---- exit code 1: a check failed ---------------------------------------------


class IntegrityError(RipresaError):
    """A check failed: the input is readable but not what it must be.

    Hash, size, commit marker, schema or safety check of a saved file, or a
    result that differs when read back.
    """

    exit_code = 1


class SchemaError(IntegrityError):
    """A checkpoint's content does not have the expected keys, types or shapes."""


class CheckFailed(IntegrityError):
    """A check of a whole result failed: no valid generation, a copy that differs when read back."""


# ---- exit code 2: bad input ---------------------------------------------------


class BadInput(RipresaError):
    """Wrong arguments, a missing or unreadable file, a file of the wrong kind."""

    exit_code = 2


class OutputExists(BadInput):
    """An output folder or file that must not exist yet already exists."""


class MissingDependency(BadInput):
    """An optional package needed for this operation is not installed."""


class LockHeld(BadInput):
    """Another process holds the run folder's writer lock."""


class IdentityMismatch(BadInput):
    """Versions, code or data differ from those the checkpoint was written with.

    The checkpoint is intact (not an :class:`IntegrityError`: a resume does not
    skip it for an older one) but refused for this run unless the change is
    allowed; exit code 1, like a failed check.
    """

    exit_code = 1


# ---- exit code 2: the work could not be completed -------------------------------


class SaveFailed(RipresaError):
    """A save could not be completed (full disk, I/O error); the previous generation is untouched."""

    exit_code = 2


# ---- exit code 3: done, but the final state is only on this machine ----------------


class UploadPending(RipresaError):
    """The run ended and its final generation is committed locally, but the mirror does not hold it.

    The store could not be reached before the end's bound (``--final-upload-timeout``), or a
    stop (SIGTERM) or a deadline left no time. Nothing is lost on this machine: ``ripresa mirror
    push RUN`` uploads it (the hint names the exact command). Its own exit code, 3, so that a
    wrapper that returns a rented machine on exit 0 keeps this one (docs/FAULTS.md, "Exit codes";
    docs/MIRROR.md, "The close").
    """

    exit_code = 3


# ---- exit code 4: a node of a multi-node run was lost ---------------------------------


class NodeLost(RipresaError):
    """A node of a multi-node run stopped answering: the surviving ranks stop, naming it.

    Raised on every surviving rank when a collective fails because a peer is gone (its launcher
    killed, its machine lost). Nothing committed is lost: the newest generation committed in the
    store stands; start the launcher again on every node (a fresh node resumes from the store).
    Its own exit code, 4, so that a wrapper restarts the run rather than reporting bad input
    (docs/DISTRIBUTED.md, "Losing a node"; docs/FAULTS.md, "Exit codes").
    """

    exit_code = 4
