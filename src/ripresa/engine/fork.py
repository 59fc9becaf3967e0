"""``ripresa fork``: an audit fork — a hash-verified copy of one generation into a new run.

The new run folder gets generation N (and nothing later), copied and
re-hashed against the parent's commit marker; the parent's history up to N;
the parent's config with the overrides applied (``--set``); a ``lineage.json``
(parent run, step, hashes, overrides); and a ``fork`` event. Two forks of the
same step start from identical weights, m and v. ``ripresa train --run DIR``
then continues it under its own settings; ``ripresa compare`` tells which
converges lower.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._version import __version__
from ..core.numbers import checked_number
from ..errors import BadInput, IntegrityError, OutputExists, RipresaError
from ..io import auth
from ..io.fsio import (
    StagedFile,
    copy_hashing,
    fsync_dir,
    open_run_file,
    parse_json_bytes,
    read_small,
    sidecar_line,
    write_atomic,
)
from ..store.history import HISTORY_NAME, History, HistoryReader
from ..store.store import CheckpointStore, generation_paths
from .gpt.config import apply_sets, validate

#: Largest run ``config.json`` read (bytes).
CONFIG_MAX = 1 << 20


def _copy_verified(src: Path, dst: Path, expected_sha256: str) -> None:
    """Copy ``src`` (opened with :func:`~ripresa.io.fsio.open_run_file`: no symlink, no FIFO) and check its sha256."""
    fd = open_run_file(src, "parent generation file", error=IntegrityError)
    try:
        with StagedFile(dst) as out:
            digest = copy_hashing(fd, out, what="parent generation file", path=src)
            if digest.sha256 != expected_sha256:
                raise IntegrityError("copy does not match the parent's commit marker", file=src,
                                     expected=expected_sha256, found=digest.sha256,
                                     hint="the parent changed during the fork")
            out.publish()
    finally:
        os.close(fd)


def _read_signature(parent_bin: Path, step: int) -> bytes | None:
    """The bytes of the parent generation's ``.bin.hmac`` (validated form), or ``None`` if it has none.

    Copied unchanged with the generation, so a fork of a signed run stays
    signed (``docs/FORMAT.md``). A symlink, FIFO, malformed line or a line for
    another step is refused (:class:`~ripresa.errors.IntegrityError`).
    """
    sig = auth.signature_path(parent_bin)
    if not os.path.lexists(sig):
        return None
    raw = read_small(sig, "generation signature", auth.MAX_SIGNATURE, error=IntegrityError)
    _, sig_step, _ = auth.read_signature(sig)
    if sig_step != step:
        raise IntegrityError("the generation's signature names another step", file=sig, expected=step,
                             found=sig_step, hint="the signature was moved or forged; this generation cannot be trusted")
    return raw


def read_run_config(path: Path, *, error: type[RipresaError] = BadInput) -> dict[str, Any]:
    """A run folder's ``config.json``: :func:`~ripresa.io.fsio.read_json_small`, a JSON object, bounded."""
    raw = read_small(path, "run config (config.json)", CONFIG_MAX, error=error)
    auth.check_run_file(path, raw)  # signed, or refused under require-signature (docs/FAULTS.md, "Trust model")
    cfg = parse_json_bytes(raw, path, "run config (config.json)", error=error)
    if not isinstance(cfg, dict):
        raise error("run config is not a JSON object", file=path, expected="a JSON object",
                    found=type(cfg).__name__, hint="the run's config.json is damaged")
    return cfg


def _open_history(parent: Path) -> Any:
    """The parent's history opened once (:func:`~ripresa.io.fsio.open_run_file`: a link or FIFO is
    refused before anything is written), or None when it has none. Streamed later by :func:`_copy_history_up_to`
    (a file object: its descriptor is closed even when the fork fails before the copy)."""
    hist = parent / HISTORY_NAME
    if not os.path.lexists(hist):
        return None
    return os.fdopen(open_run_file(hist, "history (.loss.jsonl)"), "rb", buffering=0)


def _copy_history_up_to(parent: Path, f: Any, step: int, history: History) -> int:
    """Append the parent's lines that belong to steps <= ``step`` to ``history``, in order; return how many.

    One streaming pass over the descriptor :func:`_open_history` opened (and closes):
    memory is one line (at most :data:`~ripresa.store.history.MAX_LINE`), whatever
    the parent's history holds; an over-long or out-of-range line is skipped.
    """
    if f is None:
        return 0
    n = 0
    try:
        for _, obj in HistoryReader(parent / HISTORY_NAME).read_from(f.fileno()):
            if obj is None:
                continue
            at = obj.get("step", obj.get("from_step"))
            if isinstance(at, int) and not isinstance(at, bool) and at <= step:
                history.append(obj)
                n += 1
    finally:
        f.close()
    return n


def fork(parent: Path, step: int, into: Path, sets: Sequence[str] = ()) -> dict[str, Any]:
    parent, into = Path(parent), Path(into)
    if into.exists() and (not into.is_dir() or any(into.iterdir())):
        raise OutputExists("fork destination is not empty", file=into, expected="a new or empty folder",
                           hint="choose a new --into folder")
    store = CheckpointStore(parent, writer=False)
    if step not in store.steps_on_disk() and step in _dcp_steps(parent):
        return _fork_dcp(parent, step, into, sets)
    if step not in store.steps_on_disk():
        raise BadInput(f"the parent has no generation {step}", file=parent,
                       expected=sorted({g.step for g in store.generations() if g.valid} | set(_dcp_steps(parent))),
                       found=step)
    gen = store.check(step, deep=True)
    if not gen.valid:
        raise IntegrityError(f"generation {step} of the parent is not valid: {gen.reason}", file=gen.bin)
    cfg = read_run_config(parent / "config.json")
    cfg = apply_sets(cfg, sets)
    if any(s.startswith("mixture.") for s in sets):
        cfg["mixture"]["phase"] = checked_number(cfg["mixture"].get("phase", 0), file="config.json", field="mixture.phase", lo=0, hi=2**31 - 1, error=BadInput) + 1  # a new policy: fresh bandit
    validate(cfg)
    b, c, mk = generation_paths(parent, step)
    signature = _read_signature(b, step)
    history_fd = _open_history(parent)  # refuses a FIFO or symlinked history before anything is written
    into.mkdir(parents=True, exist_ok=True)
    nb, nc, nmk = generation_paths(into, step)
    assert gen.bin_sha256 and gen.companion_sha256
    _copy_verified(b, nb, gen.bin_sha256)
    _copy_verified(c, nc, gen.companion_sha256)
    if signature is not None:  # written before the marker, as a save does
        write_atomic(auth.signature_path(nb), [signature], sync_dir=False)
    fsync_dir(into)
    write_atomic(nmk, [sidecar_line(gen.bin_sha256, nb.name), sidecar_line(gen.companion_sha256, nc.name)])
    lineage = {
        "parent_run": str(parent.resolve()), "step": step, "bin": nb.name, "bin_sha256": gen.bin_sha256,
        "companion_sha256": gen.companion_sha256, "signed": signature is not None,
        "overrides": list(sets), "created": time.time(),
        "ripresa": __version__,
    }
    write_atomic(into / "lineage.json", [json.dumps(lineage, indent=2).encode() + b"\n"])
    auth.write_signed_run_file(into / "config.json", json.dumps(cfg, indent=2).encode() + b"\n")
    history = History(into / HISTORY_NAME)
    _copy_history_up_to(parent, history_fd, step, history)
    history.event("fork", step=step, parent_step=step, parent_run=str(parent.resolve()), bin_sha256=gen.bin_sha256,
                  overrides=list(sets))
    history.sync()
    history.close()
    check = CheckpointStore(into, writer=False).check(step, deep=True)
    if not check.valid:
        raise IntegrityError(f"the forked generation does not verify: {check.reason}", file=into)
    return {"into": str(into), "step": step, "bin_sha256": gen.bin_sha256, "overrides": list(sets),
            "command": f"ripresa train --run {into}", "warnings": _warnings(cfg, step)}


def _warnings(cfg: dict[str, Any], step: int) -> list[str]:
    """What the fork's config will do that its author probably did not mean (a learning rate below its floor)."""
    from .gpt.train import lr_floor_warning

    floor = lr_floor_warning(cfg["train"], step)
    return [floor] if floor else []


def _dcp_steps(parent: Path) -> list[int]:
    from ..formats import dcp as dcp_fmt

    return dcp_fmt.dcp_steps_on_disk(parent)


def _new_config(parent: Path, sets: Sequence[str]) -> dict[str, Any]:
    cfg = apply_sets(read_run_config(parent / "config.json"), sets)
    if any(s.startswith("mixture.") for s in sets):
        cfg["mixture"]["phase"] = checked_number(cfg["mixture"].get("phase", 0), file="config.json", field="mixture.phase", lo=0, hi=2**31 - 1, error=BadInput) + 1  # a new policy: fresh bandit
    validate(cfg)
    return cfg


def _fork_dcp(parent: Path, step: int, into: Path, sets: Sequence[str]) -> dict[str, Any]:
    """Fork a sharded generation: every file of ``step_NNNNNN.dcp`` copied and re-hashed against its marker.

    The parent generation is checked deeply first (every file's sha256, the
    companion, ``.metadata`` through the restricted reader); the copy lands in
    a partial folder, is renamed, the signature (if any) is copied, and the
    marker is written last, as a sharded save commits (docs/SHARDED.md).
    """
    from ..formats import dcp as dcp_fmt
    from ..io.fsio import ops

    gen = dcp_fmt.check_dcp(parent, step, deep=True)
    if not gen.valid or gen.files is None:
        raise IntegrityError(f".dcp generation {step} of the parent is not valid: {gen.reason}", file=gen.path)
    cfg = _new_config(parent, sets)
    src, src_marker = dcp_fmt.dcp_paths(parent, step)
    sig = dcp_fmt.signature_path(parent, step)
    signature = read_small(sig, "generation signature", auth.MAX_SIGNATURE, error=IntegrityError) if os.path.lexists(sig) else None
    history_fd = _open_history(parent)
    into.mkdir(parents=True, exist_ok=True)
    part = dcp_fmt.partial_path(into, step)
    part.mkdir()
    for name, sha in sorted(gen.files.items()):
        _copy_verified(src / name, part / name, sha)
    fsync_dir(part)
    dst, dst_marker = dcp_fmt.dcp_paths(into, step)
    ops.rename(part, dst)
    if signature is not None:  # written before the marker, as a save does
        write_atomic(dcp_fmt.signature_path(into, step), [signature], sync_dir=False)
    fsync_dir(into)
    marker_lines = [sidecar_line(h, f"{dst.name}/{name}") for name, h in sorted(gen.files.items())]
    write_atomic(dst_marker, marker_lines)
    marker_sha = hashlib.sha256(b"".join(marker_lines)).hexdigest()  # of the bytes written, not a re-read of the path
    lineage = {
        "parent_run": str(parent.resolve()), "step": step, "dcp": dst.name, "marker_sha256": marker_sha,
        "files_sha256": dict(sorted(gen.files.items())), "world_size": gen.world_size, "signed": signature is not None,
        "overrides": list(sets), "created": time.time(), "ripresa": __version__,
    }
    write_atomic(into / "lineage.json", [json.dumps(lineage, indent=2).encode() + b"\n"])
    auth.write_signed_run_file(into / "config.json", json.dumps(cfg, indent=2).encode() + b"\n")
    history = History(into / HISTORY_NAME)
    _copy_history_up_to(parent, history_fd, step, history)
    history.event("fork", step=step, parent_step=step, parent_run=str(parent.resolve()), dcp_marker_sha256=marker_sha,
                  overrides=list(sets))
    history.sync()
    history.close()
    check = dcp_fmt.check_dcp(into, step, deep=True)
    if not check.valid:
        raise IntegrityError(f"the forked .dcp generation does not verify: {check.reason}", file=dst)
    world = gen.world_size or 1
    return {"into": str(into), "step": step, "dcp_marker_sha256": marker_sha, "overrides": list(sets),
            "world_size": world, "warnings": _warnings(cfg, step),
            "command": f"python -m ripresa.torchrun --standalone --nproc_per_node={world} -m -- ripresa train "
                       f"--run {into} --shard fsdp  (or: ripresa train --run {into}, one process)"}
