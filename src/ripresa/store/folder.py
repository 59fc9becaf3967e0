"""The run folder: one writer's lock, the HMAC key and signature policy, retention, pins, temporaries.

Every kind of generation lives in a :class:`RunFolder` (docs/FORMAT.md, docs/ARCHITECTURE.md);
:class:`~ripresa.store.store.CheckpointStore` is a run folder plus the ``.bin`` kind.
:meth:`RunFolder.retain` is the one place a retention policy deletes generations.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..errors import BadInput
from ..io import auth
from ..io.fsio import clean_temporaries, fsync_dir
from ..io.lock import RunLock
from .retention import DEFAULT_RETENTION, RetentionPolicy, plan_deletions

__all__ = ["DEFAULT_SHARD_THRESHOLD", "Retained", "RunFolder", "SaveOptions", "default_shards"]

#: Tensor bytes at or above which a general generation is written as shards (docs/FORMAT.md, "Sharded general
#: generations"): 2 GiB, about a 170M-parameter fp32 model with AdamW; below it one file hashes in about a second.
DEFAULT_SHARD_THRESHOLD = 2 << 30
#: Most shard files (and workers) chosen by default: more buys nothing once the disk is the floor.
MAX_DEFAULT_SHARDS = 8


def default_shards() -> int:
    """One shard (and one worker) per CPU this process may run on, 2 to :data:`MAX_DEFAULT_SHARDS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(2, min(cpus, MAX_DEFAULT_SHARDS))


@dataclass(frozen=True)
class SaveOptions:
    """How the general kind lays a generation out and stages it (docs/FORMAT.md, "Sharded general generations";
    docs/API.md, "Memory").

    ``shard_threshold``: tensor bytes at or above which a general generation is
    written as ``shards`` files of a ``step_NNNNNN.shards/`` folder, each written
    and hashed by its own worker (None: never sharded). ``shards``: how many
    (None: :func:`default_shards`). ``staging_budget``: bytes a background save
    may copy into staging (None: the whole state); the part beyond it is written
    by the training thread before it goes on.
    """

    shard_threshold: int | None = DEFAULT_SHARD_THRESHOLD
    shards: int | None = None
    staging_budget: int | None = None

    def __post_init__(self) -> None:
        for name, low in (("shard_threshold", 0), ("shards", 1), ("staging_budget", 0)):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"{name} must be None or an int >= {low}, got {v!r}")

    def shard_count(self, total_bytes: int) -> int:
        """0 for one ``.safetensors`` file, else the number of shard files for ``total_bytes`` of tensors."""
        if self.shard_threshold is None or total_bytes < self.shard_threshold:
            return 0
        return self.shards if self.shards is not None else default_shards()


class Retained(Protocol):
    """What :meth:`RunFolder.retain` needs of a kind: its generations (each checked) and how to delete one."""

    def generations(self, *, deep: bool = False) -> list[Any]: ...

    def delete(self, step: int) -> None: ...


class RunFolder:
    """A run folder: lock, HMAC key, signature policy, retention, pins and leftover temporaries.

    Args:
        folder: the run folder (created for a writer).
        retention: which generations to keep (applied after each durable save).
        writer: take the folder's writer lock and clean leftover temporaries.
            Readers (``ripresa inspect``) pass ``writer=False``.
        require_signature: treat unsigned or mis-signed generations as invalid
            (``None``: from ``RIPRESA_REQUIRE_SIGNATURE``). Needs a key.
        hmac_key: the key that signs saves and verifies signatures (``None``:
            from ``RIPRESA_HMAC_KEY`` / ``RIPRESA_HMAC_KEY_FILE``; a writer
            with a key signs every generation it saves).
    """

    def __init__(self, folder: str | Path, *, retention: RetentionPolicy = DEFAULT_RETENTION, writer: bool = True,
                 require_signature: bool | None = None, hmac_key: bytes | None = None) -> None:
        if not isinstance(folder, str | os.PathLike):
            raise TypeError(f"folder must be a path (str or os.PathLike), not {type(folder).__name__}")
        if not isinstance(retention, RetentionPolicy):
            raise TypeError(f"retention must be a RetentionPolicy (e.g. KeepLast(3)), not {retention!r:.80}; "
                            "parse a text spec with ripresa.store.retention.parse_retention")
        if require_signature is not None and not isinstance(require_signature, bool):
            raise TypeError(f"require_signature must be a bool or None, not {type(require_signature).__name__}")
        if hmac_key is not None:
            if not isinstance(hmac_key, bytes):
                raise TypeError(f"hmac_key must be bytes or None, not {type(hmac_key).__name__}")
            if len(hmac_key) < auth.MIN_KEY_BYTES:
                raise ValueError(f"hmac_key must hold at least {auth.MIN_KEY_BYTES} bytes, got {len(hmac_key)}")
        self.folder = Path(folder)
        self.retention = retention
        self.lock: RunLock | None = None
        #: steps retention must keep besides its policy (a mirror's pending uploads: docs/MIRROR.md), or None
        self.pinned: Callable[[Iterable[int]], Iterable[int]] | None = None
        #: The folder holds one node's part of each sharded generation, committed through the store
        #: (docs/DISTRIBUTED.md); ``fetch(folder, name, sha256, size)`` lands a file of a part that a load needs.
        self.node_part = False
        self.fetch: Callable[[Path, str, str, int | None], Any] | None = None
        #: The metrics recorded with each generation, for a metric retention policy (``KeepBest``): set by the
        #: ``Checkpointer``; None: none known.
        self.metrics: Callable[[], Mapping[int, Mapping[str, float]]] | None = None
        self.removed_temporaries: list[Path] = []
        #: how the general kind lays out and stages what it saves (sharding, staging budget)
        self.save_options = SaveOptions()
        self.require_signature = auth.require_signature_from_env() if require_signature is None else bool(require_signature)
        # A writer loads the key now (a misconfigured key fails at start, not at the
        # first save); a reader only when it must verify.
        self.hmac_key = hmac_key if hmac_key is not None else (
            auth.load_key() if writer or self.require_signature else None)
        if self.require_signature and self.hmac_key is None:
            raise auth.missing_key_error("require_signature (RIPRESA_REQUIRE_SIGNATURE)")
        if writer:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock(self.folder).acquire()
            self.removed_temporaries = clean_temporaries(self.folder, only_dead=False)
        elif not self.folder.is_dir():
            raise BadInput("run folder not found", file=self.folder, expected="an existing run folder", found="nothing")

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- policy
    def signature_key(self) -> bytes | None:
        """The key signatures are verified with, or None when they are not required."""
        if not self.require_signature:
            return None
        assert self.hmac_key is not None
        return self.hmac_key

    def require_writer(self) -> None:
        """Raise :class:`~ripresa.errors.BadInput` unless this folder was opened as its writer."""
        if self.lock is None:
            raise BadInput("this store was opened read-only", file=self.folder, hint="open with writer=True")

    def protected_steps(self, valid: Iterable[int]) -> set[int]:
        """The steps of ``valid`` that :attr:`pinned` keeps (a mirror's pending uploads)."""
        return set(self.pinned(list(valid))) if self.pinned is not None else set()

    def step_metrics(self) -> Mapping[int, Mapping[str, float]]:
        """The metrics recorded with each generation (:attr:`metrics`), or an empty mapping."""
        return self.metrics() if self.metrics is not None else {}

    def retain(self, kinds: Iterable[Retained], *, newest_valid: int, protected: Iterable[int] = ()) -> list[int]:
        """Apply :attr:`retention` to the valid generations of ``kinds`` together: one sequence of steps.

        Each dropped step is deleted by every kind that holds it, marker first; never
        ``newest_valid``, a ``protected`` step or a pinned one (a mirror's pending upload);
        uncommitted or damaged generations are never touched. Returns the steps deleted.
        """
        self.require_writer()
        holders: dict[int, list[Retained]] = {}
        for kind in kinds:
            for g in kind.generations():
                if g.valid:
                    holders.setdefault(g.step, []).append(kind)
        valid = sorted(holders)
        doomed = plan_deletions(valid, self.retention, newest_valid=newest_valid,
                                protected=(*protected, *self.protected_steps(valid)), metrics=self.step_metrics())
        for step in doomed:
            for kind in holders[step]:
                kind.delete(step)
        if doomed:
            fsync_dir(self.folder)
        return doomed
