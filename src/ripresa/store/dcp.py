"""The ``.dcp`` kind: sharded FSDP2 generations, every rank writes its shards, rank 0 commits.

Byte layout, companion and checks: :mod:`ripresa.formats.dcp` and docs/FORMAT.md (``.dcp``);
the sharded save and resume: docs/SHARDED.md. The commit goes through the one protocol of
every kind (:func:`~ripresa.store.commit.commit_generation`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..core.state import Progress, TrainingState
from ..errors import BadInput, IntegrityError, SaveFailed
from ..formats import dcp as dcp_fmt
from ..formats.dcp import COMPANION_NAME, DCP_NAMES, dcp_paths, encode_companion, signature_path
from ..formats.generation import Generation
from ..io import auth
from ..io.fsio import ops, sha256_file, sidecar_line, write_atomic
from . import commit
from .base import BackendBase
from .commit import Written, commit_generation, delete_files
from .restore import Loaded, rest_proxy

__all__ = ["DcpBackend", "clean_partials", "commit_dcp", "delete_dcp"]


def clean_partials(folder: Path) -> list[Path]:
    """Remove ``.step_NNNNNN.dcp.partial`` folders left by interrupted saves (rank 0, at start)."""
    return commit.clean_partials(folder, DCP_NAMES)


def delete_dcp(folder: Path, step: int) -> None:
    """Remove a ``.dcp`` generation, marker first (it reads as uncommitted if interrupted), then its signature."""
    d, mk = dcp_paths(Path(folder), step)
    delete_files(mk, signature_path(Path(folder), step))
    ops.rmtree(d)


def commit_dcp(folder: Path, step: int, partial: Path, *, world_size: int, n_params: int, state: dict[str, Any],
               hmac_key: bytes | None = None) -> Generation:
    """Rank 0, after every rank wrote its shards into ``partial``: companion, rename, signature, marker (last).

    With ``hmac_key`` the signature ``step_NNNNNN.dcp.hmac`` (every file's
    sha256, :func:`ripresa.io.auth.dcp_message`) is durable before the marker.
    """
    folder = Path(folder)
    final, marker = dcp_paths(folder, step)

    def write() -> Written:
        files = {e.name: e.stat().st_size for e in os.scandir(partial) if e.is_file(follow_symlinks=False)}
        if ".metadata" not in files:
            raise SaveFailed("DCP wrote no .metadata", file=partial, hint="the sharded save did not complete")
        write_atomic(partial / COMPANION_NAME, [encode_companion(step, world_size, n_params, files, state)])
        ops.fsync_dir(partial)
        if os.path.lexists(marker) or os.path.lexists(final):
            # Re-saving a step: uncommit the old generation first (after the new companion is durable), so no
            # reader ever pairs the old marker with new files.
            delete_dcp(folder, step)
            ops.fsync_dir(folder)
        ops.rename(partial, final)
        hashes = {name: sha256_file(final / name).sha256 for name in sorted(os.listdir(final))}
        return Written([sidecar_line(h, f"{final.name}/{name}") for name, h in hashes.items()],
                       lambda k: auth.dcp_signature_line(k, step, final.name, hashes))

    try:
        return commit_generation(
            folder, step, marker=marker, signature=signature_path(folder, step), key=hmac_key, write=write,
            check=lambda: dcp_fmt.check_dcp(folder, step, require_signature=hmac_key is not None, hmac_key=hmac_key),
            what=".dcp generation", file=final, before=lambda: None, sync=ops.fsync_dir)
    except OSError as exc:
        raise SaveFailed(f"writing the .dcp generation {step} failed: {exc}", file=final,
                         hint="the previous generation is intact") from exc


class DcpBackend(BackendBase):
    """``step_NNNNNN.dcp`` folders (FSDP2), around :mod:`ripresa.formats.dcp`; every rank writes its shards."""

    kind = "dcp"
    label = ".dcp generation"
    written_by = ".dcp ones are written by sharded FSDP2 runs"
    collective = True
    background = True  # rank 0 commits in the background once every rank's shards are durable
    names = DCP_NAMES

    @property
    def node_part(self) -> bool:
        """The folder holds one node's part of each generation (committed through the store,
        docs/DISTRIBUTED.md): the run folder's ``node_part``, set by the session in that mode."""
        return bool(getattr(self.store, "node_part", False))

    @property
    def fetch(self) -> Callable[[Path, str, str, int | None], Any] | None:
        """``fetch(folder, name, sha256, size)`` lands a file of a node's part that a load needs (the run folder's ``fetch``)."""
        return getattr(self.store, "fetch", None)

    def steps_on_disk(self) -> list[int]:
        return dcp_fmt.dcp_steps_on_disk(self.folder)

    def check(self, step: int, *, deep: bool = False, folder: Path | None = None) -> Generation:
        return dcp_fmt.check_dcp(folder or self.folder, step, deep=deep,
                                require_signature=self.store.require_signature or None,
                                hmac_key=self.store.hmac_key if self.store.require_signature else None,
                                part=self.node_part)

    # -- a node's part of a generation committed through the store (docs/DISTRIBUTED.md) -----------------
    #: The files every node's part holds (the others: the shards of its own ranks, or fetched when read)
    part_common = (COMPANION_NAME, ".metadata")

    def part_files(self, step: int) -> tuple[Path, list[str]]:
        """The files this node's ranks wrote for ``step`` (its partial folder): the node's part to upload."""
        part = dcp_fmt.partial_path(self.folder, step)
        names = sorted(e.name for e in os.scandir(part) if e.is_file(follow_symlinks=False) and e.name != COMPANION_NAME)
        return part, names

    def seal_part(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                  world_size: int, sizes: Mapping[str, int]) -> str:
        """Rank 0: the companion, written into its partial folder, naming every node's files (``sizes``)."""
        rest = rest_proxy(state).snapshot(progress, extra, include_parameters=False)
        n = sum(p.numel() for p in state.model.parameters())
        part = dcp_fmt.partial_path(self.folder, step)
        if ".metadata" not in sizes:
            raise SaveFailed("DCP wrote no .metadata", file=part, hint="the sharded save did not complete")
        write_atomic(part / COMPANION_NAME, [dcp_fmt.encode_companion(step, world_size, n, dict(sizes), rest)])
        ops.fsync_dir(part)
        return COMPANION_NAME

    def marker_of(self, step: int, hashes: Mapping[str, str]) -> tuple[str, bytes, tuple[str, bytes] | None]:
        """The marker's name and bytes (and the signature's, with a key) for a generation of these files."""
        final, marker = dcp_paths(self.folder, step)
        lines = b"".join(sidecar_line(hashes[name], f"{final.name}/{name}") for name in sorted(hashes))
        key = self.store.hmac_key
        sig = None if key is None else (signature_path(self.folder, step).name,
                                        auth.dcp_signature_line(key, step, final.name, dict(hashes)))
        return marker.name, lines, sig

    def land_part(self, step: int, marker: bytes, signature: bytes | None) -> None:
        """Every node: its partial folder becomes ``step_NNNNNN.dcp`` (its part), the signature, the marker
        last — the store's very marker, so the part reads as the generation with files absent."""
        final, mk = dcp_paths(self.folder, step)
        part = dcp_fmt.partial_path(self.folder, step)
        if os.path.lexists(mk) or os.path.lexists(final):
            delete_dcp(self.folder, step)
            ops.fsync_dir(self.folder)
        if part.is_dir():
            ops.rename(part, final)
        else:
            final.mkdir()
        ops.fsync_dir(final)
        if signature is not None:
            write_atomic(signature_path(self.folder, step), [signature])
        write_atomic(mk, [marker])
        ops.fsync_dir(self.folder)

    def at_path(self, path: Path) -> Generation:
        src = Path(path)
        step = self.step_of(src)
        if step is None:
            raise BadInput("not a step_NNNNNN.dcp folder", file=src, expected="step_NNNNNN.dcp", found=src.name)
        gen = self.check(step, deep=True, folder=src.parent)  # the run's signature policy holds for an explicit path too
        if not gen.valid:
            raise IntegrityError(f"cannot resume from .dcp generation {step}: {gen.reason}", file=src,
                                 hint="check it with `sha256sum -c` from its folder")
        return gen

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        dcp = dcp_fmt
        n = sum(p.numel() for p in state.model.parameters())
        if gen.companion_sha256 is None:
            raise IntegrityError("the .dcp generation was not checked before its load", file=gen.path,
                                 expected="the marker hashes of its check", found="none")
        doc = dcp.read_dcp_companion(gen.path, gen.companion_sha256)
        if doc["n_params"] != n:
            raise IntegrityError("the .dcp generation holds another number of parameters than the model",
                                 file=gen.path, expected=n, found=doc["n_params"], hint="build the model from the run's config.json")

        def load_weights(model: Any, optimizer: Any, saved: Mapping[str, Any], sharded: bool) -> None:
            # exactly the bytes the check verified: every file re-read into memory and re-hashed against the
            # marker hashes the check found (signed under require-signature), never re-opened by DCP
            fetch = None if self.fetch is None else (lambda name, sha, size, f=self.fetch, p=gen.path: f(p, name, sha, size))
            dcp.load_shards(model, optimizer, gen.path, files=gen.files, sizes=doc["files"], no_dist=not sharded,
                            fetch=fetch)

        return Loaded(dcp.decode_state(doc, gen.path), False, load_weights, gen.companion, validated=True)

    def prepare(self, step: int) -> None:
        self.abandon(step)

    def write_part(self, step: int, state: TrainingState) -> None:
        dcp_fmt.save_shards(state.model, state.optimizer, dcp_fmt.partial_path(self.folder, step))

    def commit_for(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                   stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        dcp = dcp_fmt
        rest = rest_proxy(state).snapshot(progress, extra, include_parameters=False)
        n = sum(p.numel() for p in state.model.parameters())
        folder, key = self.folder, self.store.hmac_key

        def commit() -> Generation:
            return commit_dcp(folder, step, dcp.partial_path(folder, step), world_size=world_size, n_params=n,
                              state=rest, hmac_key=key)

        return commit

    def abandon(self, step: int) -> None:
        part = dcp_fmt.partial_path(self.folder, step)
        if part.exists():
            ops.rmtree(part)

    def delete(self, step: int) -> None:
        delete_dcp(self.folder, step)

    def clean(self) -> list[Path]:
        return clean_partials(self.folder)
