"""One budget for a whole made of many pieces (docs/FAULTS.md, "Many pieces, one budget").

A reader that bounds each piece (a shard's header, a listing's page, a history's line) does not
bound their sum: K pieces each under the bound hold K times it. :class:`PieceBudget` is the
budget shared by all pieces of one whole (a generation's shard headers, a mirror's listing, a
history), charged before each piece is kept, and the inode rule of a generation's files: two
names of one file (hard links, ``st_dev``/``st_ino`` equal) are refused, since they would pass
as distinct pieces and multiply what one file on disk makes a reader hold.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import IntegrityError, RipresaError


class PieceBudget:
    """The total of what the pieces of one whole may take (bytes, entries, lines), and their inodes.

    ``what`` names the whole (``"the shard headers of step_000020.shards"``),
    ``total`` its budget, ``unit`` what is counted. :meth:`take` charges one
    piece before it is kept and raises ``error`` (default
    :class:`~ripresa.errors.IntegrityError`) naming the piece, the bound and
    the total reached; :meth:`inode` refuses a second name of an inode
    already seen among the pieces.
    """

    def __init__(self, what: str, total: int, *, unit: str = "bytes", hint: str | None = None,
                 error: type[RipresaError] = IntegrityError) -> None:
        self.what, self.total, self.unit, self.error = what, int(total), unit, error
        self.hint = hint or "no valid whole is this large: it was crafted; it is not used"
        self.used = 0
        self._inodes: dict[tuple[int, int], str] = {}

    def take(self, n: int, file: str | Path | None) -> None:
        """Charge ``n`` for the piece ``file``; beyond the budget: the typed error."""
        self.used += max(int(n), 0)
        if self.used > self.total:
            raise self.error(f"{self.what}: the pieces together exceed their budget", file=file,
                             expected=f"<= {self.total} {self.unit} for all pieces together",
                             found=f"{self.used} {self.unit} with this piece", hint=self.hint)

    def inode(self, st: os.stat_result, file: str | Path) -> None:
        """Refuse ``file`` when its inode is another piece's (a hard link, or the same file named twice)."""
        ident = (st.st_dev, st.st_ino)
        other = self._inodes.get(ident)
        if other is not None:
            raise self.error(f"{self.what}: two names of one file", file=file,
                             expected="distinct files (no hard links among a generation's files)",
                             found=f"the same inode as {other}",
                             hint="ripresa never writes hard links inside a generation: a file linked to "
                                  "another would count as two pieces; copy the files instead (cp, not cp -l)")
        self._inodes[ident] = str(file)

