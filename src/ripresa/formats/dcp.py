"""The ``.dcp`` byte layout: sharded FSDP2 generations written with ``torch.distributed.checkpoint``.

Names (``step_NNNNNN.dcp/``, ``.dcp.hmac``, ``.dcp.sha256``, ``.step_NNNNNN.dcp.partial``), the
companion ``ripresa.json``, the marker and the named checks (:func:`check_dcp`; ``deep`` reads
``.metadata`` through :mod:`ripresa.formats.dcp_safe`), and model/optimizer through DCP
(:func:`save_shards`, :func:`load_shards`: exactly the verified bytes): docs/FORMAT.md, "FSDP2
``step_NNNNNN.dcp/``". The commit (companion, rename, signature, marker last) is the one protocol
of every kind: :mod:`ripresa.store.dcp`; the sharded save and resume: docs/SHARDED.md.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput, IntegrityError, RipresaError, SchemaError
from ..io import auth
from ..io.fsio import (
    open_run_file,
    parse_json_bytes,
    parse_sha256sum_line,
    read_small,
    sha256_fd,
)
from ..io.pieces import PieceBudget
from . import companion as companion_fmt
from .generation import Checks, Generation, reason_of
from .naming import NameFormat

FORMAT = "ripresa.dcp"
FORMAT_VERSION = 1
COMPANION_NAME = "ripresa.json"

MAX_MARKER_BYTES = 1 << 20
MAX_COMPANION_BYTES = 256 * 1024 * 1024


def dcp_name(step: int) -> str:
    """``7`` → ``step_000007.dcp``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BadInput("invalid step for a .dcp name", expected="an int >= 0", found=repr(step))
    return f"step_{step:06d}.dcp"


#: How a ``.dcp`` generation is named: the folder ``step_NNNNNN.dcp``, ``.dcp.hmac`` and ``.dcp.sha256`` beside
#: it, ``.step_NNNNNN.dcp.partial`` while its shards are written.
DCP_NAMES = NameFormat(".dcp", folder=True, partial=True, namer=dcp_name)


def parse_dcp_name(name: str | os.PathLike[str]) -> int | None:
    """``step_000007.dcp`` → 7; None for anything else (only the canonical form)."""
    return DCP_NAMES.parse(name)


def dcp_paths(folder: Path, step: int) -> tuple[Path, Path]:
    """(``step_NNNNNN.dcp`` folder, its marker) in ``folder``."""
    d = Path(folder) / dcp_name(step)
    return d, d.with_name(d.name + ".sha256")


def signature_path(folder: Path, step: int) -> Path:
    """``step_NNNNNN.dcp.hmac`` beside the folder (written only with an HMAC key)."""
    return Path(folder) / (dcp_name(step) + auth.SUFFIX)


def partial_path(folder: Path, step: int) -> Path:
    """The folder every rank writes its shards into before the commit."""
    return Path(folder) / DCP_NAMES.partial_name(step)


def dcp_steps_on_disk(folder: Path) -> list[int]:
    """Steps with a ``.dcp`` folder or marker (committed or not), ascending."""
    steps: set[int] = set()
    if not Path(folder).is_dir():
        return []
    for entry in os.scandir(folder):
        s = DCP_NAMES.parse(entry.name)
        if s is None:
            s = DCP_NAMES.is_marker(entry.name)
        if s is not None:
            steps.add(s)
    return sorted(steps)


def read_folder_marker(marker: Path, folder_name: str, max_bytes: int = MAX_MARKER_BYTES) -> dict[str, str]:
    """Parse the marker of a folder kind (``.dcp``, ``.shards``): ``{file name inside the folder: sha256}``,
    from lines ``<sha256>  <folder_name>/<file>`` (read bounded, never through a link or a FIFO)."""
    if not os.path.lexists(marker):
        raise IntegrityError("missing commit marker: the generation was never committed", file=marker,
                             expected=f"{marker.name} written last", found="nothing", hint="an older generation will be used")
    raw = read_small(marker, "commit marker", max_bytes, error=IntegrityError)
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        lines = []
    out: dict[str, str] = {}
    for line in lines:
        parsed = parse_sha256sum_line(line, in_folder=True)
        folder, _, name = (parsed[1] if parsed else "").partition("/")
        if parsed is None or folder != folder_name or not name or name in out:
            raise IntegrityError("malformed commit marker", file=marker,
                                 expected=f"lines '<sha256>  {folder_name}/<file>'", found=repr(line[:160]),
                                 hint="the marker is damaged; this generation cannot be trusted")
        out[name] = parsed[0]
    return out


def read_dcp_marker(marker: Path, folder_name: str) -> dict[str, str]:
    """Parse a ``.dcp`` marker: ``{file name inside the folder: sha256}``, the companion among them."""
    out = read_folder_marker(marker, folder_name)
    if COMPANION_NAME not in out:
        raise IntegrityError("commit marker does not list the companion", file=marker, expected=COMPANION_NAME, found=sorted(out)[:8])
    return out


#: Largest parameter count a companion may claim.
MAX_N_PARAMS = 1 << 48


def read_dcp_companion(folder: Path, expected_sha256: str | None = None, *, checks: Checks | None = None) -> dict[str, Any]:
    """Read (and hash-check) ``ripresa.json`` of a ``.dcp`` folder; return the raw document.

    One bounded read (no symlink, no FIFO, at most :data:`MAX_COMPANION_BYTES`),
    then every field checked before it is used: ``step``, ``world_size`` (and
    ``state.extra.distributed`` against it, see
    :func:`ripresa.core.schema.check_distributed_record`), ``n_params``,
    ``files``. Deep nesting, malformed fields and wrong types are all an
    :class:`~ripresa.errors.IntegrityError`.
    """
    import hashlib

    checks = Checks() if checks is None else checks
    p = Path(folder) / COMPANION_NAME
    with checks.run("companion sha256", expected=expected_sha256) as f:
        raw = read_small(p, "companion", MAX_COMPANION_BYTES, error=IntegrityError)
        f["found"] = hashlib.sha256(raw).hexdigest()
        if expected_sha256 is not None and f["found"] != expected_sha256:
            raise IntegrityError("companion sha256 mismatch", file=p, expected=expected_sha256,
                                 found=f["found"], hint="the companion changed after the commit")
    with checks.run("companion schema", expected=FORMAT):
        return _companion_fields(parse_json_bytes(raw, p, "companion", error=IntegrityError), p)


def _companion_fields(doc: Any, p: Path) -> dict[str, Any]:
    """Every field of a parsed ``.dcp`` companion checked before it is used."""
    from ..core.schema import MAX_WORLD_SIZE, check_distributed_record

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SchemaError("not a ripresa .dcp companion", file=p, expected=FORMAT,
                          found=str(doc.get("format"))[:80] if isinstance(doc, dict) else type(doc).__name__)
    if doc.get("format_version") != FORMAT_VERSION or isinstance(doc.get("format_version"), bool):
        raise SchemaError("unsupported .dcp companion version", file=p, expected=FORMAT_VERSION,
                          found=str(doc.get("format_version"))[:40])
    for key, typ, lo, hi in (("step", int, 0, 10**12), ("world_size", int, 1, MAX_WORLD_SIZE),
                             ("n_params", int, 0, MAX_N_PARAMS), ("files", dict, 0, 1 << 20), ("state", dict, 0, None)):
        v = doc.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise SchemaError(f"companion's '{key}' is missing or has the wrong type", file=p, expected=typ.__name__,
                              found=type(v).__name__)
        n = v if typ is int else len(v)
        if n < lo or (hi is not None and n > hi):
            raise SchemaError(f"companion's '{key}' is out of range", file=p, expected=f"{lo}..{hi}", found=str(n)[:40])
    for name, size in doc["files"].items():
        if not _FILE_NAME_RE.match(name) or type(size) is not int or not 0 <= size < 1 << 50:
            raise SchemaError("companion's 'files' holds a malformed entry", file=p,
                              expected="{file name: size in bytes}", found=f"{name[:80]!r}: {str(size)[:40]}")
    extra = doc["state"].get("extra")
    rec = extra.get("distributed") if isinstance(extra, dict) else None
    check_distributed_record(rec, file=p, world_size=doc["world_size"] if rec is not None else None)
    return doc


_FILE_NAME_RE = re.compile(r"^[^/\x00-\x1f\x7f]{1,255}$")


def decode_state(doc: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The decoded companion state of a ``.dcp`` generation; a malformed tree is an IntegrityError."""
    p = Path(folder) / COMPANION_NAME
    try:
        state = companion_fmt.decode_tree(doc["state"])
        if isinstance(state, dict) and "format" in state:  # the one structural check a resume also runs
            from ..core.state import validate_saved_state

            validate_saved_state(state, where=p)
        return state
    except RipresaError:
        raise
    except (RecursionError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
            RuntimeError, MemoryError) as exc:
        raise IntegrityError("companion is malformed: its state cannot be decoded", file=p,
                             expected="a ripresa companion (tagged tensors, tuples, dicts)",
                             found=f"{type(exc).__name__}: {str(exc)[:160]}",
                             hint="it was not written by ripresa (or was edited); this generation cannot be trusted") from None


def check_dcp(folder: Path, step: int, *, deep: bool = False, require_signature: bool | None = None,
              hmac_key: bytes | None = None, part: bool = False) -> Generation:
    """Validate one ``.dcp`` generation through named checks (:class:`~ripresa.formats.generation.Check`).

    In order: ``marker present``, ``marker format``; under ``require_signature``
    (``None``: from ``RIPRESA_REQUIRE_SIGNATURE``) ``signature`` over the
    marker's hashes, before anything else is parsed; ``folder files`` (the
    folder holds exactly the marker's files, all regular); ``companion
    sha256`` and ``companion schema`` (one read); ``companion step``,
    ``companion files``, ``file sizes``; with ``deep``, ``file sha256``
    (every file re-hashed), ``companion state`` (the decoded state) and
    ``metadata`` (the ``.metadata`` through the restricted reader,
    :func:`ripresa.formats.dcp_safe.read_metadata`, the same check
    :func:`load_shards` makes before DCP runs). A missing key under
    require-signature raises :class:`~ripresa.errors.BadInput`.

    ``part``: the folder is one node's part of a generation committed through the store (docs/DISTRIBUTED.md):
    it may lack shard files of the marker (never the companion or ``.metadata``, never a file the marker does
    not name); the files it holds are checked as above, the absent ones are listed in ``Generation.absent``.
    """
    from .dcp_safe import VerifiedFiles, read_metadata

    d, mk = dcp_paths(Path(folder), step)
    c = d / COMPANION_NAME
    require = auth.require_signature_from_env() if require_signature is None else bool(require_signature)
    key = None
    if require:
        key = hmac_key if hmac_key is not None else auth.load_key()
        if key is None:
            raise auth.missing_key_error("require_signature (RIPRESA_REQUIRE_SIGNATURE)")
    checks = Checks()
    try:
        with checks.run("marker present", expected=mk.name):
            if not os.path.lexists(mk):
                read_dcp_marker(mk, d.name)  # raises: missing commit marker
        with checks.run("marker format", expected=f"'<sha256>  {d.name}/<file>' lines"):
            hashes = read_dcp_marker(mk, d.name)
        if key is not None:  # authenticate before parsing anything else
            with checks.run("signature", expected=signature_path(Path(folder), step).name):
                auth.verify_dcp(key, signature_path(Path(folder), step), step, d.name, hashes)
        with checks.run("folder files", expected=sorted(hashes)[:8]) as f:
            if d.is_symlink() or not d.is_dir():
                raise IntegrityError("the .dcp folder is missing", file=d, expected="a folder", found="nothing or not a folder")
            present = {e.name: e for e in os.scandir(d)}
            files = PieceBudget(f"the files of {d.name}", 1 << 62)
            absent = sorted(set(hashes) - set(present)) if part else []
            if absent and ({COMPANION_NAME, ".metadata"} & set(absent) or set(present) - set(hashes)):
                raise IntegrityError("a node's part of a .dcp generation lacks its companion or .metadata, or holds "
                                     "a file its marker does not name", file=d, expected=sorted(hashes)[:8],
                                     found=sorted(present)[:8], hint="land them from the store first")
            if set(present) | set(absent) != set(hashes):
                raise IntegrityError("the .dcp folder's files differ from its marker's", file=d, expected=sorted(hashes)[:8],
                                     found=sorted(present)[:8], hint="a file was added or removed after the commit")
            for name, e in present.items():
                if e.is_symlink() or not e.is_file(follow_symlinks=False):
                    raise IntegrityError("a .dcp file is not a regular file", file=d / name)
                files.inode(e.stat(follow_symlinks=False), d / name)  # no file counted twice (hard links)
            f["found"] = sorted(present)[:8]
        doc = read_dcp_companion(d, hashes[COMPANION_NAME], checks=checks)
        with checks.run("companion step", expected=step) as f:
            if doc["step"] != step:
                raise IntegrityError("the companion names another step", file=c, expected=step, found=doc["step"])
            f["found"] = doc["step"]
        with checks.run("companion files", expected=sorted(set(hashes) - {COMPANION_NAME})[:8]) as f:
            if set(doc["files"]) != set(hashes) - {COMPANION_NAME}:
                raise IntegrityError("the companion lists other files than the marker", file=c,
                                     expected=sorted(set(hashes) - {COMPANION_NAME})[:8], found=sorted(doc["files"])[:8])
            f["found"] = sorted(doc["files"])[:8]
        total = 0
        with checks.run("file sizes") as f:
            for name, size in doc["files"].items():
                if name in absent:
                    continue
                actual = present[name].stat(follow_symlinks=False).st_size
                if actual != size:
                    raise IntegrityError("a .dcp file has the wrong size", file=d / name, expected=size, found=actual,
                                         hint="truncated or modified after the commit")
                total += actual
            f["found"] = total
        if deep:
            meta_raw = b""
            with checks.run("file sha256", expected=f"{len(hashes)} files as the marker says"):
                for name, want in hashes.items():
                    if name in absent:
                        continue
                    if name == ".metadata":  # hashed while read: the bytes checked below are the bytes hashed
                        meta_raw = bytes(VerifiedFiles(d, hashes, doc["files"]).read(name))
                        continue
                    fd = open_run_file(d / name, ".dcp file", error=IntegrityError)
                    try:
                        got = sha256_fd(fd, what=".dcp file", path=d / name).sha256
                    finally:
                        os.close(fd)
                    if got != want:
                        raise IntegrityError("sha256 mismatch: a .dcp file changed after it was committed", file=d / name,
                                             expected=want, found=got, hint="bit rot or an edit; an older generation will be used")
            with checks.run("companion state"):
                decode_state(doc, d)  # a deep check proves the state decodes (the resume will not fail on it)
            with checks.run("metadata"):
                # restricted, bounded unpickler; every storage entry inside the folder's shards (committed sizes)
                read_metadata(d, raw=meta_raw, sizes=doc["files"])
    except RipresaError as exc:
        return Generation(step, "dcp", d, c, mk, valid=False, reason=reason_of(exc), checks=tuple(checks))
    return Generation(step, "dcp", d, c, mk, valid=True, size=total, world_size=doc["world_size"], files=hashes,
                      deep_checked=deep, signature_verified=key is not None, checks=tuple(checks), absent=tuple(absent))


def dcp_generations(folder: Path, *, deep: bool = False) -> list[Generation]:
    return [check_dcp(folder, s, deep=deep) for s in dcp_steps_on_disk(folder)]


# ---- writing ----------------------------------------------------------------------


def encode_companion(step: int, world_size: int, n_params: int, files: dict[str, int], state: dict[str, Any]) -> bytes:
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step), "world_size": int(world_size),
           "n_params": int(n_params), "files": dict(sorted(files.items())), "state": companion_fmt.encode_tree(state)}
    return companion_fmt.dumps(doc)


# ---- model and optimizer through DCP ------------------------------------------------------


def _quiet_dcp():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    return ctx


def save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: Path, *, no_dist: bool = False) -> None:
    """``dcp.save`` of model and optimizer (keyed by parameter name) into ``path`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
    else:
        sd = {"model": get_model_state_dict(model)}
    ctx = _quiet_dcp()
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True), no_dist=no_dist)
    finally:
        ctx.__exit__(None, None, None)


def shard_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state DCP saves: ``{"model": ..., "optim": ...}`` keyed by parameter name (DTensors on FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


class ShardStager:
    """Copies a rank's shards out of the live tensors (the only stall of an asynchronous sharded save).

    The host buffers are allocated at the first save — pinned on CUDA — and
    reused by every later one (one save is in flight at a time, so the
    previous write is finished before they are overwritten); a state whose
    structure changed gets new buffers. The staged dict shares no storage
    with the live model or optimizer, so training may go on while it is
    written.
    """

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned
        self._cache: dict[str, Any] | None = None

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._cache is not None:
            try:
                return _copy_state_dict(sd, self._cache)
            except Exception:  # CompanionMismatch and kin: the structure changed
                self._cache = None  # another structure (a new optimizer state): new buffers
        self._cache = _create_cpu_state_dict(sd, pin_memory=self.pinned)
        return _copy_state_dict(sd, self._cache)


def write_shards_async(staged: dict[str, Any], path: Path, *, group: Any,
                       after_write: Any = None) -> Any:
    """Start ``dcp.async_save`` of a staged dict into ``path``; return its future (collective on ``group``).

    DCP writes and fsyncs each rank's file (``sync_files``) in a background
    thread, gathers every rank's result, then rank 0 writes ``.metadata``:
    the future of rank 0 succeeds only once every rank's shards are durable.
    ``after_write()`` runs on each rank once its own shards are written and
    before that gather (a fault hook point).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import AsyncStager

    class _Staged(AsyncStager):
        """Passes on the dict :class:`ShardStager` already staged (nothing is staged twice)."""

        _synchronize_after_execute = False

        def stage(self, sd: Any) -> Any:
            return sd

        def synchronize_staging(self) -> None:
            return None

        def close(self) -> None:
            return None

    class _Writer(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            fut.wait()
            if after_write is not None:
                after_write()
            return fut

    ctx = _quiet_dcp()
    try:
        return dcp.async_save(staged, storage_writer=_Writer(str(path), sync_files=True), process_group=group,
                              async_stager=_Staged())  # type: ignore[arg-type]
    finally:
        ctx.__exit__(None, None, None)


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: Path, *,
                files: Mapping[str, str], sizes: Mapping[str, int], no_dist: bool = False,
                fetch: Any = None) -> None:
    """``dcp.load`` of exactly the verified bytes into the live model and optimizer (any number of ranks).

    ``files`` is ``{file name: sha256}`` as the generation's check verified
    it (:attr:`~ripresa.formats.generation.Generation.files`: the commit
    marker, authenticated by the signature under require-signature) and
    ``sizes`` the companion's committed sizes. Every file DCP needs is read
    once, into memory, while hashed (:class:`~ripresa.formats.dcp_safe.VerifiedFiles`),
    and DCP reads only those buffers: a shard swapped or edited after the
    check is an :class:`~ripresa.errors.IntegrityError` and nothing of the
    generation is loaded. Through
    :class:`~ripresa.formats.dcp_safe.SafeFileSystemReader` and
    :class:`~ripresa.formats.dcp_safe.SafeLoadPlanner`: the ``.metadata`` is
    unpickled by the restricted, bounded reader and checked first (a
    refusal raises here, before DCP runs), every item is loaded with
    ``weights_only=True``. ``fetch(name, sha256, size)``: lands a file the folder lacks (a node's part of a generation
    committed through the store, docs/DISTRIBUTED.md) before it is read; only the files this rank's load
    reads are fetched, and each is verified like the others.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from .dcp_safe import SafeFileSystemReader, SafeLoadPlanner, VerifiedFiles, unwrap

    if not files or ".metadata" not in files:
        raise IntegrityError("a .dcp load needs the sha256 of every file its check verified", file=path,
                             expected="the generation's marker hashes", found=sorted(files)[:8])
    reader = SafeFileSystemReader(path, VerifiedFiles(path, files, sizes, fetch=fetch))  # .metadata through the restricted unpickler
    reader.read_metadata()  # refuses a hostile .metadata with its own error, before DCP runs
    ctx = _quiet_dcp()
    try:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer)
            sd: dict[str, Any] = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            sd = {"model": get_model_state_dict(model)}
            dcp.load(sd, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
            set_model_state_dict(model, sd["model"])
    except RipresaError:
        raise
    except (Exception, _checkpoint_exception()) as exc:
        inner = unwrap(exc)
        if inner is not None:
            raise inner from None
        raise IntegrityError("the .dcp generation could not be loaded into the model", file=path,
                             found=f"{type(exc).__name__}: {str(exc).splitlines()[-1][:300] if str(exc) else ''}",
                             hint="build the same architecture as the run that saved (see its config)") from None
    finally:
        ctx.__exit__(None, None, None)


def _checkpoint_exception() -> type[BaseException]:
    """DCP's ``CheckpointException`` (a ``BaseException``: ``except Exception`` misses it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def optimizer_state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> dict[str, Any]:
    """An index-keyed ``optimizer.state_dict()`` → the name-keyed form of ``get_state_dict``."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    fqn = [names[id(p)] for p in order]
    state = {fqn[int(i)]: dict(v) for i, v in osd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[int(i)] for i in g["params"]]}
              for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_full_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, full: dict[str, Any]) -> None:
    """Load a complete (unsharded) snapshot's model and optimizer into a possibly sharded model.

    Every rank passes the full tensors; ``set_state_dict(full_state_dict=True)``
    keeps each rank's shard (FSDP2) or the whole tensor (replicated).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(model, dict(full["model"]), options=opts)
        return
    osd = optimizer_state_by_name(model, optimizer, full["optimizer"])
    set_state_dict(model, optimizer, model_state_dict=dict(full["model"]), optim_state_dict=osd, options=opts)
