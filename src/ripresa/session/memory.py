"""The memory tier in a session: which steps it captures, the optimizer's wait, the resume from it, its end.

``Checkpointer(memory_every=k)`` keeps a complete generation of every k-th step in shared memory
(:mod:`ripresa.store.memory`). At ``step_done(N)`` everything but the parameters and the
optimizer's state is copied on the loop (the random streams, the data position, the buffers a
forward may change); the parameters and moments are copied by the tier's thread while step
N+1's forward and backward run, and the optimizer's ``step`` of N+1 waits until that copy is
done (a pre-hook on the optimizer; without an optimizer, ``step_done`` waits). A SIGKILLed run
started again with the same command resumes from it when it is intact, of this boot, user and
run, and newer than the newest disk generation. docs/TIERS.md.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState
from ..errors import RipresaError
from ..store.commit import CheckpointWarning
from ..store.memory import MemoryTier, MemoryUnusable, discard, newest, promote
from ..store.shards import capture_tensors

__all__ = ["MemorySession", "MemoryTierWarning"]


class MemoryTierWarning(CheckpointWarning):
    """The memory tier turned itself off, or a memory generation was not used; the disk tier goes on."""


class MemorySession:
    """The memory tier of one single-process session (``every`` steps apart)."""

    def __init__(self, every: int, run_dir: Path, state: TrainingState, event: Callable[..., Any]) -> None:
        self.every, self.run_dir, self.state, self.event = int(every), Path(run_dir), state, event
        self.tier: MemoryTier | None = None
        self.off: str | None = None
        self._hook: Any = None
        self.captures = 0
        #: Seconds the loop waited per capture: at the capture (the previous one still hashing; the copies of
        #: the rest), and at the optimizer's step (the copy not finished).
        self.capture_stalls: list[float] = []
        self.step_waits: list[float] = []
        self._settled_s = 0.0  # waited in before_record() for the capture in flight: part of the next capture's stall
        try:
            self.tier = MemoryTier(self.run_dir)
        except (MemoryUnusable, OSError) as exc:
            self._turn_off(exc)

    # ---------------------------------------------------------------- resume
    def resume(self, newest_disk: int | None, hmac_key: bytes | None) -> int | None:
        """Promote the newest trusted memory generation newer than ``newest_disk`` into the run folder (a general
        generation, committed); its step, or None. What was not used is one warning line each."""
        found, notes = newest(self.run_dir, above=newest_disk)
        for note in notes:
            warnings.warn(note, MemoryTierWarning, stacklevel=4)
            self.event("memory_generation_skipped", reason=note)
        if found is None:
            return None
        t0 = time.perf_counter()
        promote(found, self.run_dir, hmac_key=hmac_key)
        self.event("memory_resume", step=found.step, newest_disk=newest_disk, slot=found.slot.name,
                   written=found.written, seconds=round(time.perf_counter() - t0, 4))
        return found.step

    def forget(self) -> None:
        """A fresh start or a resume from a named generation: the memory generations belong to another past."""
        if self.tier is not None:
            self.tier.invalidate()
        else:
            discard(self.run_dir)

    # ---------------------------------------------------------------- each step
    def due(self, step: int) -> bool:
        return self.tier is not None and self.every > 0 and step % self.every == 0

    def before_record(self, step: int) -> None:
        """Before step ``step``'s history line, when ``step`` is due for a capture: the capture in flight committed.

        The wait the capture of ``step`` makes anyway (one in flight at most), made before the line: a SIGKILL
        after the line of step N finds the capture of N-1 committed (at most one step redone at
        ``memory_every=1``), not N-2 with the hash of N-1 still running (docs/TIERS.md)."""
        tier = self.tier
        if tier is None or tier.job is None or not self.due(step):
            return
        t0 = time.perf_counter()
        try:
            tier.settle()
        except (MemoryUnusable, OSError) as exc:
            self._turn_off(exc)
            return
        self._settled_s += time.perf_counter() - t0

    def capture(self, step: int, progress: Progress) -> None:
        """Hand step ``step`` to the tier: copies of the rest now, the parameters and moments on its thread."""
        tier = self.tier
        assert tier is not None
        t0 = time.perf_counter()
        try:
            tensors, encoded, aliases = capture_tensors(self.state, progress, None, to_cpu=False, plain_model_keys=False)
            live = self._live_storages()
            taken: dict[str, torch.Tensor] = {}
            live_keys: set[str] = set()
            for key, t in tensors.items():
                if t.numel() and t.untyped_storage().data_ptr() in live:
                    taken[key] = t  # changed only by the optimizer's step, which waits for the copy
                    live_keys.add(key)
                else:
                    taken[key] = t.clone()  # buffers a forward may change, and the like: copied now
            tier.capture(step, taken, encoded, aliases, live_keys)
        except (MemoryUnusable, OSError) as exc:
            self._turn_off(exc)
            return
        self.captures += 1
        self.capture_stalls.append(time.perf_counter() - t0 + self._settled_s)
        self._settled_s = 0.0
        if self._hook is None and self.state.optimizer is not None:
            self._hook = self.state.optimizer.register_step_pre_hook(self._before_optimizer_step)
        if self.state.optimizer is None:
            self.step_waits.append(tier.wait_copied())  # nothing tells when the loop changes the weights

    def _live_storages(self) -> set[int]:
        """Storages only the optimizer's step changes: the parameters and the optimizer's per-parameter state."""
        out = {p.untyped_storage().data_ptr() for p in self.state.model.parameters()}
        opt = self.state.optimizer
        if opt is not None:
            for per in opt.state.values():
                if isinstance(per, dict):
                    out.update(v.untyped_storage().data_ptr() for v in per.values() if isinstance(v, torch.Tensor))
        return out

    def _before_optimizer_step(self, _opt: Any, _args: Sequence[Any], _kwargs: dict[str, Any]) -> None:
        tier = self.tier
        if tier is not None:
            self.step_waits.append(tier.wait_copied())

    def wait(self) -> None:
        """Before the loop's thread changes the state outside the optimizer's step (a save, the end): the copy done."""
        if self.tier is not None:
            self.tier.wait_copied()

    # ---------------------------------------------------------------- end
    def close(self, *, normal: bool) -> None:
        """A normal end removes the memory generations (the disk holds the last step); an error path keeps them
        (the next start may resume from them)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.tier is not None:
            if self.captures:
                stalls = sorted(self.capture_stalls)
                self.event("memory_tier", captures=self.captures,
                           stall_median=round(stalls[len(stalls) // 2], 6),
                           optimizer_wait_max=round(max(self.step_waits, default=0.0), 6),
                           copy_s=round(self.tier.last_copy_s, 6), hash_s=round(self.tier.last_hash_s, 6))
            self.tier.close(remove=normal)
            self.tier = None
        elif normal and self.off is None:
            discard(self.run_dir)

    def _turn_off(self, exc: BaseException) -> None:
        why = exc.message if isinstance(exc, RipresaError) else f"{type(exc).__name__}: {exc}"
        detail = str(exc) if isinstance(exc, RipresaError) else why
        self.off = why
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.tier is not None:
            tier, self.tier = self.tier, None
            try:
                tier.close(remove=True)
            except OSError:
                pass
        self.event("memory_tier_off", reason=why[:300])
        warnings.warn(f"the memory tier is off, the disk tier goes on: {detail}", MemoryTierWarning, stacklevel=4)
