"""The ``.bin`` kind as a storage backend: ANDREA ``.bin`` + companion + marker (single process, DDP).

Files and checks: :mod:`ripresa.store.store` and docs/FORMAT.md; the backend protocol:
:mod:`ripresa.store.base` and docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState
from ..errors import BadInput, IntegrityError
from ..formats.generation import Generation
from ..io import auth
from .base import BackendBase, load_full_into
from .folder import RunFolder
from .restore import Loaded, Restored
from .store import BIN_NAMES, delete_bin, generation_paths, save_bin, validate_generation

__all__ = ["BinBackend", "ForeignCheckpointWarning"]


class ForeignCheckpointWarning(UserWarning):
    """A .bin without companion was resumed: weights, m, v only."""


class BinBackend(BackendBase):
    """``step_NNNNNN.bin`` + companion + marker (single process, DDP)."""

    kind = "bin"
    label = "generation"
    written_by = ".bin ones are written by single-process and DDP runs"
    background = True
    names = BIN_NAMES

    def __init__(self, store: RunFolder) -> None:
        super().__init__(store)
        self._staged: tuple[tuple[Any, ...], list[tuple[str, torch.Size]]] | None = None  # see staged_model

    def check(self, step: int, *, deep: bool = False) -> Generation:
        return validate_generation(self.folder, step, deep=deep, key=self.store.signature_key()).generation

    def check_to_resume(self, step: int) -> Generation:
        return self.check(step, deep=False)  # load() hashes the .bin while reading it

    def at_path(self, path: Path) -> Generation:
        src = Path(path)
        step = self.step_of(src)
        if step is None:
            raise BadInput("not a step_NNNNNN.bin", file=src, expected="step_NNNNNN.bin", found=src.name)
        b, c, mk = generation_paths(src.parent, step)
        if not os.path.lexists(c):
            if self.store.require_signature or auth.require_signature_from_env():
                raise auth.unsigned_error("a .bin without companion", src,
                                          "no companion, no commit marker and no signature (.bin.hmac)")
            return Generation(step, self.kind, src, c, mk, valid=True, foreign=True)
        key = RunFolder(src.parent, writer=False).signature_key()
        gen = validate_generation(src.parent, step, key=key).generation
        if not gen.valid:
            raise IntegrityError(f"cannot resume from generation {step}: {gen.reason}", file=src,
                                 hint="`ripresa inspect` shows the valid generations")
        return gen

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        from ..formats.bin_state import join_state

        n = sum(p.numel() for p in state.model.parameters())
        reader = self.store if gen.path.parent == self.folder else RunFolder(gen.path.parent, writer=False)
        v = validate_generation(gen.path.parent, gen.step, load=True, expected_n=n, key=reader.signature_key(),
                                raise_first=True)
        assert v.contents is not None
        return Loaded(join_state(state, v.contents, v.state), True, load_full_into, gen.companion)

    def restore(self, gen: Generation, state: TrainingState, *, restore_rng: bool, allow: Mapping[str, bool],
                rank: int | None = None, sharded: bool = False) -> Restored:
        if gen.foreign:
            return self._restore_foreign(gen.path, state, sharded)
        return super().restore(gen, state, restore_rng=restore_rng, allow=allow, rank=rank, sharded=sharded)

    def _restore_foreign(self, src: Path, state: TrainingState, sharded: bool) -> Restored:
        """Weights, m and v of a ``.bin`` without companion; data order and random streams start fresh."""
        from ..formats.andrea_bin import describe_missing, read_bin
        from ..formats.bin_state import load_into_model_and_adamw

        if sharded:
            raise BadInput("a foreign .bin (no companion) cannot be resumed into a sharded model", file=src,
                           hint="resume it in one process or with DDP, then continue from the generation it writes")
        contents = read_bin(src, expected_n=sum(p.numel() for p in state.model.parameters()))
        if state.optimizer is None:
            raise BadInput("a foreign .bin needs an AdamW optimizer to load m and v", file=src)
        notes = load_into_model_and_adamw(contents, state.model, state.optimizer)
        msg = (f"{src} has no companion: weights, m and v restored at step {contents.step}; data order and random "
               "streams start fresh, so this resume is only bit-equivalent modulo data randomness")
        warnings.warn(msg, ForeignCheckpointWarning, stacklevel=4)
        return Restored(Progress(step=contents.step), {}, event={"foreign": True, "lacks": describe_missing(src),
                                                                 "notes": notes})

    def commit_for(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                   stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        from ..formats.bin_state import bin_arrays, companion_snapshot

        arrays = bin_arrays(state)
        companion = companion_snapshot(state, progress, extra)
        self._staged = None
        if stage is not None:  # the background writer copies weights, m, v now; the write comes later
            arrays = stage(arrays)
            shapes = [(name, p.shape) for name, p in state.model.named_parameters()]  # model.parameters() order
            self._staged = (arrays.weights, shapes)
        store = self.store

        def commit() -> Generation:
            store.require_writer()
            return save_bin(self.folder, step, arrays, companion, hmac_key=store.hmac_key, key=store.signature_key())

        return commit

    def staged_model(self) -> dict[str, torch.Tensor] | None:
        """``{parameter name: view}`` of the weights the last background capture staged; None without one.

        Views of the writer's staging buffers (docs/API.md, ``on_staged``): valid until the next
        capture stages again, which first waits for the in-flight write.
        """
        if self._staged is None:
            return None
        region, shapes = self._staged
        flat = region[0] if len(region) == 1 else torch.cat([torch.as_tensor(c).reshape(-1) for c in region])
        out: dict[str, torch.Tensor] = {}
        off = 0
        for name, shape in shapes:
            k = math.prod(shape)
            out[name] = flat[off : off + k].view(shape)
            off += k
        return out

    def delete(self, step: int) -> None:
        self.store.require_writer()
        delete_bin(self.folder, step)
