"""The ``shards`` kind: a general generation as a Hugging Face sharded folder ``step_NNNNNN.shards/``.

Written by the general kind when its tensors reach ``SaveOptions.shard_threshold`` (each shard
written and hashed by its own worker, all covered by one marker written last); read back with every
shard verified by its own worker. Layout: :mod:`ripresa.formats.shards`; files, checks and limits:
docs/FORMAT.md, "Sharded general generations".
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.state import Progress, TrainingState, canonical_order, optimizer_record
from ..errors import IntegrityError, RipresaError, SaveFailed
from ..formats import companion as companion_fmt
from ..formats import general as general_fmt
from ..formats import safetensors_file as st
from ..formats import shards as shards_fmt
from ..formats.dcp import read_folder_marker
from ..formats.generation import Checks, Generation, reason_of
from ..formats.shards import COMPANION_NAME, INDEX_NAME, SHARDS_NAMES
from ..io import auth
from ..io.fsio import (
    fsync_dir,
    open_run_file,
    ops,
    read_small,
    sidecar_line,
    write_atomic,
)
from ..io.pieces import PieceBudget
from . import commit
from .base import BackendBase, load_full_into
from .commit import (
    Written,
    commit_generation,
    companion_checks,
    delete_files,
    malformed_companion,
    validate_state,
)
from .folder import RunFolder, default_shards
from .restore import Loaded, rest_proxy
from .tensor_writer import StagingArea, TensorFileWriter, run_writers

__all__ = ["KIND", "ShardsBackend", "capture_tensors", "shards_paths", "validate_shards"]

KIND = "shards"
#: Largest marker and index of a sharded generation (bytes): a few thousand shards at most.
MAX_MARKER_BYTES = 1 << 20
MAX_INDEX_BYTES = 64 * 1024 * 1024
#: The budget of all shard headers of one generation together (bytes): as large as one header may be
#: (:data:`~ripresa.formats.safetensors_file.MAX_HEADER`), shared by the pieces (docs/FAULTS.md,
#: "Many pieces, one budget"): a thousand shards each with a header just under the bound hold no more.
MAX_HEADERS_TOTAL = st.MAX_HEADER


def shards_paths(folder: Path, step: int) -> tuple[Path, Path]:
    """(``step_NNNNNN.shards`` folder, its marker ``step_NNNNNN.shards.sha256``) in ``folder``."""
    d = Path(folder) / SHARDS_NAMES.name(step)
    return d, SHARDS_NAMES.marker(folder, step)


def capture_tensors(state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *, to_cpu: bool,
                    plain_model_keys: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    """The general kind's split of ``state`` now: (key -> tensor, the companion's encoded state, aliases).
    Everything but model and optimizer is a snapshot; their tensors are taken by reference."""
    snap = rest_proxy(state).snapshot(progress, extra)  # small: copies of scheduler, data, streams, objects
    snap["model"] = dict(state.model.state_dict(keep_vars=True))
    snap["optimizer"] = canonical_order(state.optimizer.state_dict()) if state.optimizer is not None else None
    snap["optimizer_params"] = optimizer_record(state.model, state.optimizer)  # what the resume checks it against
    return general_fmt.split_state(snap, general_fmt.model_aliases(state.model), to_cpu=to_cpu,
                                   plain_model_keys=plain_model_keys)


def read_marker(marker: Path, folder_name: str) -> dict[str, str]:
    """``{file inside the folder: sha256}`` of a sharded generation's marker (``<sha256>  step_X.shards/<file>``)."""
    out = read_folder_marker(marker, folder_name, MAX_MARKER_BYTES)
    shards = [n for n in out if shards_fmt.parse_shard_name(n)]
    if set(out) - set(shards) != {COMPANION_NAME, INDEX_NAME} or not shards:
        raise IntegrityError("commit marker does not list a sharded generation", file=marker,
                             expected=[COMPANION_NAME, INDEX_NAME, "model-0000k-of-0000K.safetensors ..."],
                             found=sorted(out)[:8])
    return out


@dataclass
class ShardsValidation:
    generation: Generation
    state: Any = None


def validate_shards(folder: Path, step: int, *, deep: bool = False, load: bool = False, key: bytes | None = None,
                    raise_first: bool = False, workers: int | None = None) -> ShardsValidation:
    """The one validation of a sharded generation: named checks, each file read once.

    ``marker present``, ``marker format``, ``signature`` (with ``key``, before anything else
    is parsed), ``folder files`` (exactly the marker's, all regular), ``companion sha256``,
    ``companion schema``, ``shard headers`` (each header's hostile-safe checks, its format and
    step, the companion's record of it), ``index`` (the Hugging Face index says exactly what the
    shards say); with ``deep`` or ``load``: ``shard sha256`` (every shard read and hashed, each by
    its own worker, at most ``workers``, default one per CPU) and ``companion state``.
    """
    d, mk = shards_paths(Path(folder), step)
    c = d / COMPANION_NAME
    checks = Checks()
    out = ShardsValidation(Generation(step, KIND, d, c, mk, valid=False))
    try:
        with checks.run("marker present", expected=mk.name) as f:
            if not os.path.lexists(mk):
                read_marker(mk, d.name)  # raises: missing commit marker
            f["found"] = mk.name
        with checks.run("marker format", expected=f"'<sha256>  {d.name}/<file>' lines"):
            hashes = read_marker(mk, d.name)
        if key is not None:
            with checks.run("signature", expected=SHARDS_NAMES.signature(folder, step).name):
                auth.verify_dcp(key, SHARDS_NAMES.signature(folder, step), step, d.name, hashes)
        with checks.run("folder files", expected=sorted(hashes)[:8]) as f:
            if d.is_symlink() or not d.is_dir():
                raise IntegrityError("the .shards folder is missing", file=d, expected="a folder", found="nothing or not a folder")
            present = {e.name: e for e in os.scandir(d)}
            if set(present) != set(hashes):
                raise IntegrityError("the .shards folder's files differ from its marker's", file=d,
                                     expected=sorted(hashes)[:8], found=sorted(present)[:8],
                                     hint="a file was added or removed after the commit")
            pieces = PieceBudget(f"the shard headers of {d.name}", MAX_HEADERS_TOTAL)
            for name, e in sorted(present.items()):
                if e.is_symlink() or not e.is_file(follow_symlinks=False):
                    raise IntegrityError("a .shards file is not a regular file", file=d / name)
                pieces.inode(e.stat(follow_symlinks=False), d / name)  # no file counted twice (hard links)
            f["found"] = sorted(present)[:8]
        doc = companion_checks(
            checks, c, hashes[COMPANION_NAME],
            lambda p: read_small(p, "companion", general_fmt.MAX_COMPANION_BYTES, error=IntegrityError),
            general_fmt.FORMAT, shards_fmt.validate_companion)
        records = doc["tensors"]["shards"]
        names = [r["name"] for r in records]
        paths = [d / n for n in names]
        headers: list[st.Header] = []
        with checks.run("shard headers", expected=f"{len(records)} shards as the companion records") as f:
            if set(names) != set(hashes) - {COMPANION_NAME, INDEX_NAME}:
                raise IntegrityError("the companion records other shards than the marker", file=c,
                                     expected=sorted(set(hashes) - {COMPANION_NAME, INDEX_NAME})[:8], found=names[:8])
            for r, p in zip(records, paths, strict=True):
                # one shard open at a time (a hostile companion may list thousands); all headers kept together
                # stay within one budget, each charged before it is read
                h = st.read_header(p, charge=lambda n, p=p: pieces.take(n, p))
                want = {k: v for k, v in shards_fmt.shard_metadata(step).items() if k != "format_version"}
                got = {k: h.metadata.get(k) for k in want}
                if got != want:
                    raise IntegrityError("the shard names another format or step", file=p, expected=want, found=got)
                rec = {"sha256": hashes[r["name"]], "size": h.file_size, "count": len(h.entries)}
                if {k: r[k] for k in rec} != rec:
                    raise IntegrityError("companion and shard disagree", file=p, expected=rec,
                                         found={k: r[k] for k in rec})
                headers.append(h)
            f["found"] = {"shards": len(headers), "bytes": sum(h.file_size for h in headers)}
        if sum(len(h.entries) for h in headers) != doc["tensors"]["count"] or doc["tensors"]["step"] != step:
            raise IntegrityError("companion's tensors record disagrees with its shards", file=c,
                                 expected={"step": step, "count": sum(len(h.entries) for h in headers)},
                                 found={k: doc["tensors"][k] for k in ("step", "count")})
        with checks.run("index", expected=INDEX_NAME):
            raw = read_small(d / INDEX_NAME, "shard index", MAX_INDEX_BYTES, error=IntegrityError)
            if hashlib.sha256(raw).hexdigest() != hashes[INDEX_NAME]:
                raise IntegrityError("shard index sha256 mismatch", file=d / INDEX_NAME, expected=hashes[INDEX_NAME],
                                     hint="the index changed after the commit")
            index = companion_fmt.loads_bounded(raw, file=d / INDEX_NAME)
            expected = {"metadata": {"total_size": sum(h.data_size for h in headers), "format": general_fmt.FORMAT,
                                     "step": str(step)},
                        "weight_map": {**{e.key: n for n, h in zip(names, headers, strict=True) for e in h.entries}}}
            for alias, target in doc["aliases"].items():
                if target in expected["weight_map"]:
                    expected["weight_map"][alias] = expected["weight_map"][target]
            shards_fmt.validate_index(index, expected, d / INDEX_NAME)
        if deep or load:
            with checks.run("shard sha256", expected=f"{len(paths)} shards as the marker says"):
                def read(i: int) -> dict[str, torch.Tensor]:
                    fd = open_run_file(paths[i], "safetensors shard", error=IntegrityError)
                    try:  # the header checked above, still exactly those bytes, then the shard hashed as read
                        return st.read_fd(fd, paths[i], st.header_fd(fd, paths[i], headers[i]),
                                          expected_sha256=hashes[names[i]])[0]
                    finally:
                        os.close(fd)

                n = max(1, min(len(paths), workers or default_shards()))  # one per CPU at most
                with ThreadPoolExecutor(max_workers=n, thread_name_prefix="ripresa-shard") as pool:
                    parts = list(pool.map(read, range(len(paths))))
                tensors: dict[str, torch.Tensor] = {}
                for part in parts:
                    if tensors.keys() & part.keys():
                        raise IntegrityError("two shards hold the same tensor", file=d,
                                             found=sorted(tensors.keys() & part.keys())[:3])
                    tensors.update(part)
            with checks.run("companion state"), malformed_companion(c):
                out.state = general_fmt.join_state(doc, tensors, c)
                validate_state(out.state, c)
    except RipresaError as exc:
        if raise_first:
            raise
        out.generation = Generation(step, KIND, d, c, mk, valid=False, reason=reason_of(exc), checks=tuple(checks))
        return out
    out.generation = Generation(step, KIND, d, c, mk, valid=True, size=sum(h.file_size for h in headers), files=hashes,
                                deep_checked=deep or load, signature_verified=key is not None, checks=tuple(checks))
    return out


def delete_shards(folder: Path, step: int) -> None:
    """Remove a sharded generation: marker first (it reads as uncommitted if interrupted), signature, folder."""
    d, mk = shards_paths(Path(folder), step)
    delete_files(mk, SHARDS_NAMES.signature(folder, step))
    if d.is_dir() and not d.is_symlink():
        ops.rmtree(d)
    elif os.path.lexists(d):
        ops.unlink(d)


def clean_partials(folder: Path) -> list[Path]:
    """Remove ``.step_NNNNNN.shards.partial`` folders left by interrupted saves (the writer, at start)."""
    return commit.clean_partials(folder, SHARDS_NAMES)


class ShardsBackend(BackendBase):
    """``step_NNNNNN.shards/`` folders: a general generation in Hugging Face's sharded layout."""

    kind = KIND
    label = ".shards generation"
    written_by = ".shards ones are written for general states of SaveOptions.shard_threshold bytes or more"
    background = True
    names = SHARDS_NAMES

    def __init__(self, store: RunFolder, staging: StagingArea | None = None) -> None:
        super().__init__(store)
        self.staging = staging if staging is not None else StagingArea()

    def _key(self) -> bytes | None:
        return self.store.signature_key()

    def check(self, step: int, *, deep: bool = False) -> Generation:
        return validate_shards(self.folder, step, deep=deep, key=self._key()).generation

    def check_to_resume(self, step: int) -> Generation:
        return self.check(step)  # load() hashes every shard while reading it

    def at_path(self, path: Path) -> Generation:
        return self.checked_at(path, lambda folder, step: validate_shards(folder, step, key=self._key()).generation)

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        v = validate_shards(gen.path.parent, gen.step, load=True, key=self._key(), raise_first=True)
        return Loaded(v.state, True, load_full_into, gen.companion, validated=True)

    def commit_for(self, step: int, state: TrainingState, progress: Progress, extra: dict[str, Any] | None, *,
                   stage: Callable[[Any], Any] | None = None, world_size: int = 1) -> Callable[[], Generation]:
        tensors, encoded, aliases = capture_tensors(state, progress, extra, to_cpu=stage is None, plain_model_keys=True)
        opts = self.store.save_options
        count = opts.shards if opts.shards is not None else max(1, opts.shard_count(1 << 62))
        return self.commit_tensors(step, tensors, encoded, aliases, count, background=stage is not None)

    def commit_tensors(self, step: int, tensors: dict[str, torch.Tensor], encoded: Any, aliases: dict[str, str],
                       count: int, *, background: bool) -> Callable[[], Generation]:
        """Lay ``tensors`` out in ``count`` shards; a background save stages them now (within the staging budget,
        the live rest written before this returns); the returned call commits."""
        folder, key = self.folder, self.store.hmac_key
        files = shards_fmt.plan(tensors, count)
        partial = folder / SHARDS_NAMES.partial_name(step)
        live = [0] * len(files)
        if background:
            files, live = self.staging.stage(files, self.store.save_options.staging_budget)
        meta = shards_fmt.shard_metadata(step)
        writers = [TensorFileWriter(partial / shards_fmt.shard_name(k, len(files)), f, {**meta, "shard": f"{k}/{len(files)}"},
                                    live=lv, overlap=len(files) == 1)
                   for k, (f, lv) in enumerate(zip(files, live, strict=True), 1)]
        index = shards_fmt.index_doc(step, files, aliases)
        if any(live):  # the part beyond the staging budget is written now, while the loop waits
            _fresh_partial(partial)
            for w in writers:
                w.start()
            for w in writers:
                w.wait_live()

        def commit() -> Generation:
            return commit_shards(folder, step, partial, writers, index, aliases, encoded, key)

        return commit

    def abandon(self, step: int) -> None:
        part = self.folder / SHARDS_NAMES.partial_name(step)
        if part.exists():
            ops.rmtree(part)

    def delete(self, step: int) -> None:
        delete_shards(self.folder, step)

    def clean(self) -> list[Path]:
        return clean_partials(self.folder)


def _fresh_partial(partial: Path) -> None:
    if os.path.lexists(partial):
        ops.rmtree(partial) if partial.is_dir() and not partial.is_symlink() else ops.unlink(partial)
    partial.mkdir()


def commit_shards(folder: Path, step: int, partial: Path, writers: list[TensorFileWriter], index: dict[str, Any],
                  aliases: dict[str, str], encoded: Any, key: bytes | None) -> Generation:
    """Every shard durable (each by its worker), companion and index, the folder renamed into place, its
    signature, the marker last (:func:`~ripresa.store.commit.commit_generation`)."""
    folder = Path(folder)
    final, marker = shards_paths(folder, step)

    def write() -> Written:
        digests = run_writers(writers)
        for w in writers:
            assert w.file is not None
            w.file.publish()
        records = [{"name": w.final.name, "sha256": dg.sha256, "size": dg.size, "count": len(w.tensors)}
                   for w, dg in zip(writers, digests, strict=True)]
        comp = write_atomic(partial / COMPANION_NAME,
                            [companion_fmt.dumps(shards_fmt.companion_doc(step, records, aliases, encoded))], sync_dir=False)
        idx = write_atomic(partial / INDEX_NAME, [shards_fmt.index_bytes(index)], sync_dir=False)
        fsync_dir(partial)
        if os.path.lexists(marker) or os.path.lexists(final):
            # Re-saving a step: uncommit the old generation first (after the new files are durable).
            delete_shards(folder, step)
            fsync_dir(folder)
        ops.rename(partial, final)
        hashes = {COMPANION_NAME: comp.sha256, INDEX_NAME: idx.sha256, **{r["name"]: r["sha256"] for r in records}}
        return Written([sidecar_line(h, f"{final.name}/{name}") for name, h in sorted(hashes.items())],
                       lambda k: auth.dcp_signature_line(k, step, final.name, hashes))

    try:
        if not any(w.started for w in writers):
            _fresh_partial(partial)
        return commit_generation(folder, step, marker=marker, signature=SHARDS_NAMES.signature(folder, step), key=key,
                                 write=write, check=lambda: validate_shards(folder, step).generation,
                                 what="sharded general generation", file=final, before=lambda: None)
    except BaseException as exc:
        for w in writers:
            w.discard()
        if os.path.lexists(partial):
            ops.rmtree(partial)
        if isinstance(exc, OSError):
            raise SaveFailed(f"writing the .shards generation {step} failed: {exc}", file=final,
                             hint="the previous generation is intact") from exc
        raise
