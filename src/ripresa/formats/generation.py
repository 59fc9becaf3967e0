"""One generation of a run folder, and the named checks that decide whether it can be trusted.

Every kind of generation (``.bin`` + companion + marker, a ``.dcp`` folder +
marker, and any later kind) is described by the same :class:`Generation`
record, and every validation — a resume's check, a load, ``ripresa inspect`` —
produces the same list of :class:`Check` records: a name (``marker present``,
``companion sha256``, ``bin sha256``...), whether it passed, and on failure
what was expected and what was found (docs/ARCHITECTURE.md, "Storage
backends"). ``inspect`` only renders them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RipresaError


@dataclass(frozen=True)
class Check:
    """One named check of a generation: passed, or failed with what was expected and found."""

    name: str
    ok: bool
    expected: Any = None
    found: Any = None
    file: str | None = None
    message: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "expected": _plain(self.expected), "found": _plain(self.found),
                "file": self.file, "message": self.message}


def _plain(v: Any) -> Any:
    """A JSON-able form of an expected/found value (paths and other objects as text)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


@dataclass(frozen=True)
class Generation:
    """One generation of a run folder, of any kind, and whether it can be trusted.

    ``path`` is its main file (the ``.bin``, the ``.dcp`` folder); ``files``
    the sha256 its commit marker vouches for, by name (the ``.bin`` and the
    companion; every file of a ``.dcp`` folder); ``checks`` the named checks
    that decided ``valid`` (the first failure is ``reason``). ``foreign``: a
    bare ``.bin`` without companion or marker (``--resume`` of weights, m, v only).
    """

    step: int
    kind: str
    path: Path
    companion: Path
    marker: Path
    valid: bool
    reason: str | None = None
    size: int | None = None
    files: Mapping[str, str] = field(default_factory=dict)
    world_size: int | None = None
    deep_checked: bool = False
    signature_verified: bool = False
    checks: tuple[Check, ...] = ()
    foreign: bool = False
    #: Files the marker names that this folder does not hold: a node's part of a generation committed through
    #: the store (docs/DISTRIBUTED.md); a load fetches each one it needs from the store, verified.
    absent: tuple[str, ...] = ()

    @property
    def bin(self) -> Path:
        """The ``.bin`` of a ``bin`` generation (its main file)."""
        return self.path

    @property
    def bin_sha256(self) -> str | None:
        return self.files.get(self.path.name)

    @property
    def companion_sha256(self) -> str | None:
        return self.files.get(self.companion.name)

    @property
    def failed(self) -> Check | None:
        """The first check that failed (None for a valid generation)."""
        return next((c for c in self.checks if not c.ok), None)


def reason_of(exc: RipresaError) -> str:
    """The one-line reason a generation is invalid: the error's message, file and (short) found value."""
    reason = f"{exc.message}" + (f" ({exc.file})" if exc.file else "")
    if exc.found is not None and not isinstance(exc.found, dict):
        reason += f": found {str(exc.found)[:120]}"
    return reason


class Checks:
    """The named checks of one validation, in order.

    ``with checks.run("companion sha256", expected=...) as found: ...`` records
    a passed check (``found`` may be filled in) or, when the block raises a
    :class:`~ripresa.errors.RipresaError`, a failed one with the error's
    expected/found, and re-raises: a validation stops at its first failure.
    """

    def __init__(self) -> None:
        self.items: list[Check] = []

    @contextmanager
    def run(self, name: str, expected: Any = None) -> Iterator[dict[str, Any]]:
        found: dict[str, Any] = {}
        try:
            yield found
        except RipresaError as exc:
            self.items.append(Check(name, False, exc.expected if exc.expected is not None else expected, exc.found,
                                    None if exc.file is None else str(exc.file), exc.message))
            raise
        self.items.append(Check(name, True, expected, found.get("found")))

    def passed(self, name: str, expected: Any = None, found: Any = None) -> None:
        self.items.append(Check(name, True, expected, found))

    def __iter__(self) -> Iterator[Check]:
        return iter(self.items)
