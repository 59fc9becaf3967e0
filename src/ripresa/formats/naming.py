"""How a kind of generation names its files in a run folder: one grammar, ``step_NNNNNN<suffix>``.

Each kind (docs/FORMAT.md; docs/ARCHITECTURE.md, "Storage backends") has one :class:`NameFormat`
(``.bin``: :mod:`ripresa.formats.andrea_bin`, ``.dcp``: :mod:`ripresa.formats.dcp`, general:
:mod:`ripresa.store.general`); nothing else in ripresa parses a generation's file name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..core.numbers import checked_number
from ..errors import IntegrityError

__all__ = ["MARKER_SUFFIX", "SIGNATURE_SUFFIX", "NameFormat"]

#: The commit marker of a generation: its main name plus this suffix (``sha256sum`` lines).
MARKER_SUFFIX = ".sha256"
#: The HMAC signature of a generation: its main name plus this suffix (docs/SECURITY.md).
SIGNATURE_SUFFIX = ".hmac"


@dataclass(frozen=True)
class NameFormat:
    """The file names of one kind: ``step_NNNNNN<suffix>`` and the files beside it.

    ``suffix``: the main file's (or folder's) suffix (``.bin``). ``companion``: the
    companion's name relative to the main name: ``"+.json"`` appends
    (``step_000007.safetensors.json``), ``".json"`` replaces the suffix
    (``step_000007.json``), None: no companion beside it (a folder kind keeps it
    inside). ``folder``: the main name is a folder (its files are ``main/<file>``).
    ``partial``: a folder kind's in-progress name, ``.<main>.partial``.
    ``canonical``: only the exact name :meth:`name` writes parses (steps and names map
    one to one); ``max_step``: the largest step a name may carry. ``namer``: the
    format's own ``name(step)`` (its own error for a bad step), used by :meth:`name`.
    """

    suffix: str
    companion: str | None = None
    folder: bool = False
    partial: bool = False
    canonical: bool = True
    max_step: int | None = None
    namer: Callable[[int], str] | None = field(default=None, repr=False, compare=False)
    _main: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_main", re.compile(r"step_([0-9]{6,})" + re.escape(self.suffix)))

    # ---- one generation's names
    def name(self, step: int) -> str:
        """The main file's (or folder's) name of ``step``: ``step_000007.bin``."""
        if self.namer is not None:
            return self.namer(step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bad step {step!r}")
        return f"step_{step:06d}{self.suffix}"

    def parse(self, name: str | os.PathLike[str]) -> int | None:
        """The step a main name carries (a path is reduced to its name); None when it is not one."""
        base = Path(name).name
        m = self._main.fullmatch(base)
        if m is None:
            return None
        try:  # the one checked conversion (docs/FAULTS.md, "Numbers read from files"): a name beyond int64 is not ours
            step = checked_number(m.group(1), file=None, field="a generation's step", lo=0, hi=2**63 - 1, text=True)
        except IntegrityError:
            return None
        if self.canonical and (f"step_{step:06d}{self.suffix}" != base or self.max_step is not None and step > self.max_step):
            return None
        return step

    def companion_name(self, main: str) -> str | None:
        """The companion beside ``main`` (None: a folder kind's companion is inside its folder)."""
        if self.companion is None:
            return None
        if self.companion.startswith("+"):
            return main + self.companion[1:]
        return main[: -len(self.suffix)] + self.companion

    def files(self, step: int) -> tuple[str, ...]:
        """Every name of ``step``'s generation in the run folder: main, companion, signature, marker."""
        main = self.name(step)
        comp = self.companion_name(main)
        return (main, *((comp,) if comp else ()), main + SIGNATURE_SUFFIX, main + MARKER_SUFFIX)

    def paths(self, folder: Path, step: int) -> tuple[Path, Path | None, Path]:
        """(main, companion beside it or None, marker) of ``step`` in ``folder``."""
        main = Path(folder) / self.name(step)
        comp = self.companion_name(main.name)
        return main, (main.with_name(comp) if comp else None), main.with_name(main.name + MARKER_SUFFIX)

    def marker(self, folder: Path, step: int) -> Path:
        return Path(folder) / (self.name(step) + MARKER_SUFFIX)

    def signature(self, folder: Path, step: int) -> Path:
        return Path(folder) / (self.name(step) + SIGNATURE_SUFFIX)

    def partial_name(self, step: int) -> str:
        """A folder kind's in-progress folder: ``.step_000007.dcp.partial``."""
        return f".{self.name(step)}.partial"

    # ---- recognising names
    def main_of(self, name: str) -> tuple[str, int] | None:
        """(main name, step) of the generation a run-folder file (or a ``main/<file>`` of a folder kind)
        belongs to: the main file, its companion, signature or marker; None when it is none of this kind's."""
        head, sep, inner = name.partition("/")
        if sep:
            if not self.folder or not inner or "/" in inner:
                return None
            step = self.parse(head)
            return (head, step) if step is not None else None
        for tail in ("", MARKER_SUFFIX, SIGNATURE_SUFFIX):
            if tail and not name.endswith(tail):
                continue
            main = name[: len(name) - len(tail)]
            step = self.parse(main)
            if step is not None:
                return main, step
        if self.companion is not None:
            comp_tail = self.companion[1:] if self.companion.startswith("+") else self.companion
            if name.endswith(comp_tail):
                main = (name[: -len(comp_tail)] if self.companion.startswith("+")
                        else name[: -len(comp_tail)] + self.suffix)
                step = self.parse(main)
                if step is not None and self.companion_name(main) == name:
                    return main, step
        return None

    def holds(self, main: str, name: str) -> bool:
        """Whether ``name`` (relative to the run folder, as a commit marker names it) is one of generation
        ``main``'s data files: a folder kind's ``main/<file>`` (every rank's part, the metadata), another kind's
        main file or companion beside it; never a marker or a signature (the mirror uploads and pulls what this
        says: :func:`ripresa.store.kinds.generation_files`)."""
        of = self.main_of(name)
        return (of is not None and of[0] == main and not name.endswith((MARKER_SUFFIX, SIGNATURE_SUFFIX))
                and self.folder == ("/" in name))

    def owns(self, name: str) -> int | None:
        """The step of the generation file ``name`` (a name in the run folder) belongs to, or None."""
        of = self.main_of(name)
        return of[1] if of is not None else None

    def is_marker(self, name: str) -> int | None:
        """The step of a commit marker's name (``step_000007.bin.sha256``), or None."""
        return self.parse(name[: -len(MARKER_SUFFIX)]) if name.endswith(MARKER_SUFFIX) else None

    def is_partial(self, name: str) -> bool:
        """Whether ``name`` is an in-progress folder of this kind (``.step_000007.dcp.partial``)."""
        return (self.partial and name.startswith(".") and name.endswith(".partial")
                and self.parse(name[1 : -len(".partial")]) is not None)

    def steps(self, folder: Path) -> list[int]:
        """Steps with any file of this kind in ``folder`` (committed or not), ascending."""
        if not Path(folder).is_dir():
            return []
        found = set()
        for entry in os.scandir(folder):
            step = self.owns(entry.name)
            if step is not None:
                found.add(step)
        return sorted(found)
