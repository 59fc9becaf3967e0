"""What a mirror does: ONE contract (docs/MIRROR.md; docs/ARCHITECTURE.md, "Storage backends").

A mirror is a second store holding a run's committed generations, each under the object names of its run
folder (:mod:`~ripresa.store.mirror.layout`). Whoever drives one (the trainer's thread, ``ripresa mirror push``,
and, as the mirror grows past one machine, each node for the ranks it holds) keeps these four promises:

- **list**: :meth:`MirrorContract.committed` names the generations the store holds *committed*: those whose
  marker object (``<main>.sha256``) is listed. Objects without their marker are a half upload: never used.
- **plan**: :meth:`MirrorContract.plan` says, from the local committed generations and the store's listing,
  what an upload round uploads, what is in the store already, what the remote retention does not need and what
  is damaged locally (:class:`~ripresa.store.mirror.plan.UploadPlan`): ``mirror status`` prints the very plan
  ``mirror push`` carries out.
- **upload**: :meth:`MirrorContract.upload` copies one committed generation: the files its kind names
  (:func:`ripresa.store.kinds.generation_files`, from the local marker) first, each hashed as it is read and
  compared with the local marker's sha256 (a file changed since its commit is refused, never uploaded), then
  its signature, then **the marker object last**: a reader never sees a marker whose objects are not whole.
- **pull**: :meth:`MirrorContract.pull` lands the newest remote generation (or one step's) that verifies: every
  object compared with the remote marker's sha256, the generation given the checks of a resume in a staging
  folder, then moved into the run folder, marker last (docs/MIRROR.md, "A pull lands only what it verified").

No part of a mirror knows a kind's files: a generation's files are its marker's lines, each checked by the
registry of kinds (:mod:`ripresa.store.kinds`) to be that generation's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from ...formats.generation import Generation
from ..store import CheckpointStore
from .plan import UploadPlan

__all__ = ["MirrorContract"]


@runtime_checkable
class MirrorContract(Protocol):
    """What a mirror of one run folder does (the module doc says each promise in full)."""

    def committed(self) -> dict[str, int]:
        """The committed generations the store holds now (a fresh listing): main name → step."""

    def plan(self, local: Mapping[str, int] | None = None) -> UploadPlan:
        """The plan of the next upload round, for the local committed generations ``local`` (main name →
        step; None: the run folder's)."""

    def upload(self, main: str, step: int) -> None:
        """Upload committed generation ``main`` (of ``step``): its files, each checked against the local marker's
        sha256, then its signature, then its marker **last**. A local generation that cannot be uploaded (a
        malformed marker, a file changed or gone) is refused and recorded, never half-committed."""

    def pull(self, ckpt: CheckpointStore, *, step: int | None = None) -> Generation | None:
        """Land the newest verified remote generation (or ``step``'s) in this mirror's run folder, ``ckpt`` (its
        store, under its writer lock); None when the store holds none."""
