"""What a power cut can leave on disk, replayed from recorded file operations (ALICE-style).

:class:`Replay` consumes the :class:`ripresa.io.fsio.RecordedOp` records of a
save (``fsio.ops.recorder``) on top of a *baseline* (the folder's files before
the save, all durable) and tracks, in a deliberately weak persistence model:

* **file data**: each file (inode) has the bytes made durable by its last
  ``fsync`` and a list of *pending* writes since (offset + bytes);
* **the folder**: the durable name → inode table, as of the last folder
  ``fsync``, and the *pending* creations, renames and unlinks since.

POSIX promises nothing about pending operations after a power cut, so
:meth:`Replay.crash_state` builds one possible disk: the durable state, plus
any subset of the pending folder operations (applied in order, each one
independently), plus any subset of the pending writes of each file, where a
write may also be torn (only a prefix, cut at a 512-byte sector or anywhere)
or land with a *trashed block* (a 512-byte sector of garbage or zeros inside
the written range) — the "metadata persisted before data" and torn-sector
outcomes of real file systems. Durable bytes are never touched (that is bit
rot, a separate family). :func:`materialise` writes such a state into a fresh
folder for the real reader to recover from.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from ripresa.io.fsio import RecordedOp

SECTOR = 512


@dataclass
class Inode:
    synced: bytes
    pending: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class DirOp:
    kind: str  # create | rename | unlink
    name: str
    ino: int
    src: str | None = None


class Replay:
    """Replays recorded operations of one folder on a durable baseline."""

    def __init__(self, folder: Path, baseline: dict[str, bytes]) -> None:
        self.folder = Path(folder)
        self.inodes: dict[int, Inode] = {}
        self.durable: dict[str, int] = {}
        self.live: dict[str, int] = {}
        self.pending_dir: list[DirOp] = []
        for name, data in baseline.items():
            ino = self._new(data)
            self.durable[name] = ino
            self.live[name] = ino

    def _new(self, data: bytes = b"") -> int:
        ino = len(self.inodes)
        self.inodes[ino] = Inode(bytes(data))
        return ino

    def _name(self, path: str) -> str:
        p = Path(path)
        if p.parent != self.folder:
            raise AssertionError(f"operation outside the replayed folder: {path}")
        return p.name

    def apply(self, rec: RecordedOp) -> None:
        if rec.op == "fsync_dir":
            if Path(rec.path) != self.folder:
                raise AssertionError(f"fsync of another folder: {rec.path}")
            self.durable = apply_dir_ops(self.durable, self.pending_dir)
            self.pending_dir = []
            return
        name = self._name(rec.path)
        if rec.op == "open":
            ino = self._new()
            self.live[name] = ino
            self.pending_dir.append(DirOp("create", name, ino))
        elif rec.op == "write":
            assert rec.offset is not None and rec.data is not None
            self.inodes[self.live[name]].pending.append((rec.offset, rec.data))
        elif rec.op == "fsync":
            inode = self.inodes[self.live[name]]
            inode.synced = apply_writes(inode.synced, inode.pending)
            inode.pending = []
        elif rec.op == "rename":
            assert rec.dst is not None
            dst = self._name(rec.dst)
            ino = self.live.pop(name)
            self.live[dst] = ino
            self.pending_dir.append(DirOp("rename", dst, ino, src=name))
        elif rec.op == "unlink":
            ino = self.live.pop(name)
            self.pending_dir.append(DirOp("unlink", name, ino))
        else:  # pragma: no cover
            raise AssertionError(f"unknown operation {rec.op}")

    # ------------------------------------------------------------ possible disks
    def crash_state(self, mode: str, rnd: random.Random | None = None) -> dict[str, bytes]:
        """One disk a power cut could leave now. ``mode``:

        ``synced`` (only what was fsync'd), ``all`` (every pending operation
        made it: what SIGKILL leaves), ``meta-first`` (every folder operation,
        no pending data), ``data-first`` (all pending data, no folder
        operation), ``random`` (random subsets, torn writes, trashed blocks).
        """
        if mode == "random":
            assert rnd is not None
            dir_ops = [op for op in self.pending_dir if rnd.random() < 0.5]
        elif mode in ("all", "meta-first"):
            dir_ops = list(self.pending_dir)
        else:
            dir_ops = []
        names = apply_dir_ops(self.durable, dir_ops)
        out: dict[str, bytes] = {}
        for name, ino in names.items():
            inode = self.inodes[ino]
            if mode in ("synced", "meta-first") or not inode.pending:
                out[name] = inode.synced
            elif mode in ("all", "data-first"):
                out[name] = apply_writes(inode.synced, inode.pending)
            else:
                out[name] = apply_writes(inode.synced, [w for w in (mangle(w, rnd) for w in inode.pending) if w])
        return out

    def has_pending(self) -> bool:
        return bool(self.pending_dir) or any(i.pending for i in self.inodes.values())


def apply_dir_ops(table: dict[str, int], ops: list[DirOp]) -> dict[str, int]:
    d = dict(table)
    for op in ops:
        if op.kind == "create":
            d[op.name] = op.ino
        elif op.kind == "rename":
            d[op.name] = op.ino
            if op.src is not None and d.get(op.src) == op.ino:
                del d[op.src]
        elif op.kind == "unlink" and d.get(op.name) == op.ino:
            del d[op.name]
    return d


def apply_writes(base: bytes, writes: list[tuple[int, bytes]]) -> bytes:
    buf = bytearray(base)
    for off, data in writes:
        if len(buf) < off:
            buf.extend(bytes(off - len(buf)))
        buf[off : off + len(data)] = data
    return bytes(buf)


def mangle(write: tuple[int, bytes], rnd: random.Random) -> tuple[int, bytes] | None:
    """A pending write as it may have reached the disk: not at all, whole, torn, or with a trashed block."""
    off, data = write
    r = rnd.random()
    if r < 0.35:
        return None
    if r < 0.6 or len(data) == 0:
        return write
    if r < 0.8:  # torn: a prefix, at a sector boundary or anywhere
        cut = (rnd.randrange(len(data) // SECTOR + 1) * SECTOR) if rnd.random() < 0.5 else rnd.randrange(len(data))
        return (off, data[:cut])
    # a trashed block: one sector of the written range is garbage or zeros
    start_sector = off // SECTOR
    end_sector = (off + len(data) - 1) // SECTOR
    sector = rnd.randint(start_sector, end_sector)
    lo = max(sector * SECTOR, off) - off
    hi = min((sector + 1) * SECTOR, off + len(data)) - off
    junk = bytes(hi - lo) if rnd.random() < 0.5 else rnd.randbytes(hi - lo)
    return (off, data[:lo] + junk + data[hi:])


def snapshot(folder: Path, *, skip: tuple[str, ...] = ("LOCK",)) -> dict[str, bytes]:
    """The regular files of ``folder`` (the durable baseline before a save)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name not in skip}


def materialise(state: dict[str, bytes], folder: Path) -> Path:
    """Write a crash state into a fresh ``folder``."""
    folder.mkdir(parents=True)
    for name, data in state.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    return folder
