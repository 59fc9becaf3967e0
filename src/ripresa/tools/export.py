"""``ripresa export``: a recoverable bundle of one generation, checked by reading it back.

A resume bundle (the generation, config, metrics, identities, a README for
someone who has never seen ripresa, a manifest) or an inference export
(``model.safetensors`` only). The source generation is verified before
anything is copied, every file is copied through
:func:`~ripresa.io.fsio.copy_hashing` and ``MANIFEST.sha256`` is written last
(the bundle's commit marker); :func:`verify_export` re-hashes and reloads it.
Every file is opened with :func:`~ripresa.io.fsio.open_run_file`, so a link
or special file refuses the export instead of leaking into the bundle.
Layout and protocol: docs/FORMAT.md ("Export bundles"); refusals:
docs/FAULTS.md §7.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..errors import (
    BadInput,
    IntegrityError,
    MissingDependency,
    OutputExists,
    RipresaError,
    SchemaError,
)
from ..formats.andrea_bin import BYTES_PER_PARAM, HEADER_SIZE, bin_name, read_bin
from ..io import auth
from ..io.fsio import (
    Digest,
    StagedFile,
    copy_hashing,
    fsync_dir,
    open_run_file,
    parse_json_bytes,
    read_small,
    sha256_fd,
    sidecar_line,
)
from ..store.store import CheckpointStore, CheckpointWarning, Generation, not_used
from .models import ModelFactory

#: ``format`` of MANIFEST.json and export.json.
EXPORT_FORMAT = "ripresa.tools.export"
EXPORT_FORMAT_VERSION = 1
MANIFEST_JSON = "MANIFEST.json"
MANIFEST_SHA = "MANIFEST.sha256"
#: Copies and re-hashes of at least this many bytes in all show a progress bar.
PROGRESS_MIN_BYTES = 64 << 20
#: Prompt of the forward pass / generation that proves a reload.
PROBE_TEXT = b"def main():\n    print('hello')\n"
PROBE_PROMPT = b"The "

#: Largest JSON file of a run or a bundle read whole (config, lineage, manifest...).
JSON_MAX = 16 << 20
#: Largest companion read whole.
COMPANION_MAX = 64 << 20

RESUME = "resume"
INFERENCE = "inference"


# ----------------------------------------------------------------------------- helpers


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False).encode() + b"\n"


@contextmanager
def _meter(total: int, label: str, enabled: bool) -> Iterator[Any]:
    """A progress line in bytes for large jobs (ripresa.console.progress: on stderr, a TTY only); a no-op otherwise."""
    if not enabled or total < PROGRESS_MIN_BYTES:
        yield lambda n, desc=None: None
        return
    from ..console import progress as console_progress

    progress = console_progress("bytes")
    task = progress.add_task(label, total=total)

    def advance(n: int, desc: str | None = None) -> None:
        progress.update(task, advance=n, **({"description": desc} if desc else {}))

    with progress:
        yield advance


def _load_json(path: Path, what: str, exc_type: type[RipresaError] = BadInput) -> Any:
    """A small JSON file of a run or bundle (:func:`~ripresa.io.fsio.read_small`: no link, no FIFO, bounded)."""
    return parse_json_bytes(read_small(path, what, JSON_MAX, error=exc_type), path, what, error=exc_type)


def _as_dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _size_or_zero(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _model_section(config: Any) -> dict[str, Any] | None:
    if isinstance(config, dict) and isinstance(config.get("model"), dict):
        return config["model"]
    return None


def _build_model(factory: ModelFactory, model_cfg: dict[str, Any], where: Path, n_params: int) -> Any:
    """The model of ``model_cfg``, built only once its parameter count (computed, nothing allocated)
    equals ``n_params`` (what the ``.bin`` / safetensors holds): a config cannot make the export
    allocate more than the checkpoint's own size."""
    return factory.build_model(model_cfg, n_params, where)


def _param_table(model: torch.nn.Module) -> list[dict[str, Any]]:
    """name, shape, offset and numel of each parameter, in ``model.parameters()`` order."""
    names = {id(p): n for n, p in model.named_parameters()}
    out, off = [], 0
    for p in model.parameters():
        out.append({"name": names[id(p)], "shape": list(p.shape), "offset": off, "numel": p.numel()})
        off += p.numel()
    return out


def _load_weights(model: torch.nn.Module, weights: np.ndarray, where: Path) -> None:
    """Copy a flat float32 weights region into ``model.parameters()``, in order."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if weights.size != n:
        raise SchemaError("the .bin holds another number of parameters than the model of config.json", file=where,
                          expected=n, found=int(weights.size), hint="config.json must be the one the run trained with")
    off = 0
    with torch.no_grad():
        for p in params:
            k = p.numel()
            p.copy_(torch.from_numpy(np.ascontiguousarray(weights[off : off + k], dtype=np.float32)).view_as(p))
            off += k


def _probe_forward(model: torch.nn.Module, where: Path) -> dict[str, Any]:
    """One forward pass on a few bytes; logits must be finite. Returns the probe's loss."""
    block = model.config.block_size
    raw = PROBE_TEXT[: block + 1]
    x = torch.tensor([list(raw[:-1])], dtype=torch.long)
    y = torch.tensor([list(raw[1:])], dtype=torch.long)
    model.eval()
    with torch.no_grad():
        logits, loss = model(x, y)
    if tuple(logits.shape) != (1, x.size(1), model.config.vocab_size):
        raise SchemaError("the reloaded model gives logits of an unexpected shape", file=where,
                          expected=[1, x.size(1), model.config.vocab_size], found=list(logits.shape))
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        raise IntegrityError("the reloaded model gives non-finite logits", file=where, expected="finite logits",
                             found=f"{bad} NaN/Inf of {logits.numel()}", hint="the exported weights hold NaN/Inf")
    return {"forward": "ok", "probe_bytes": x.size(1), "probe_loss": round(float(loss), 6), "logits_finite": True}


# ----------------------------------------------------------------------------- writing


class _Bundle:
    """Files written into the destination through StagedFile, remembered for the manifest."""

    def __init__(self, dest: Path, advance: Any) -> None:
        self.dest = dest
        self.files: dict[str, Digest] = {}
        self.created_dirs: list[Path] = []
        self.advance = advance

    def _target(self, rel: str) -> Path:
        path = self.dest / rel
        parent = path.parent
        missing = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for d in reversed(missing):
            d.mkdir()
            self.created_dirs.append(d)
            fsync_dir(d.parent)
        return path

    def copy(self, src: Path, rel: str, *, what: str, expected: Digest | str | None = None, keep: bool = False,
             error: type[RipresaError] = BadInput) -> bytes | None:
        """Stream ``src`` into ``DEST/rel``; the copy must hash to ``expected`` if given.

        ``src`` is opened with :func:`~ripresa.io.fsio.open_run_file`: a symlink
        (never followed), FIFO, socket, device or folder is refused with ``error``.
        """
        fd = open_run_file(src, what, error=error)
        try:
            final = self._target(rel)
        except BaseException:
            os.close(fd)
            raise
        kept: list[bytes] = []
        try:
            with StagedFile(final) as out:
                # The size at open: a file that shrinks meanwhile is an IntegrityError, a read error a BadInput.
                def on_chunk(piece: memoryview) -> None:
                    if keep:
                        kept.append(bytes(piece))
                    self.advance(len(piece), f"copy {rel}")

                digest = copy_hashing(fd, out, what=what, path=src, on_chunk=on_chunk, size=os.fstat(fd).st_size)
                if expected is not None:
                    exp_sha = expected if isinstance(expected, str) else expected.sha256
                    exp_size = None if isinstance(expected, str) else expected.size
                    if digest.sha256 != exp_sha or (exp_size is not None and digest.size != exp_size):
                        raise IntegrityError(
                            f"the copy of {what} does not match the source's committed hash", file=src,
                            expected=exp_sha if exp_size is None else f"{exp_sha} ({exp_size} bytes)",
                            found=f"{digest.sha256} ({digest.size} bytes)",
                            hint="the source changed while it was copied (a live run re-saved it, or the disk is failing); "
                                 "export again")
                out.publish()
        finally:
            os.close(fd)
        fsync_dir(final.parent)
        self.files[rel] = digest
        return b"".join(kept) if keep else None

    def write(self, rel: str, data: bytes) -> Digest:
        final = self._target(rel)
        with StagedFile(final) as out:
            out.write(data)
            digest = out.finish()
            out.publish()
        fsync_dir(final.parent)
        self.files[rel] = digest
        return digest

    def commit(self, kind: str, step: int, extra: dict[str, Any]) -> dict[str, Any]:
        """Write MANIFEST.json, then MANIFEST.sha256 (the bundle's commit marker) last."""
        entries = [{"path": rel, "size": d.size, "sha256": d.sha256} for rel, d in sorted(self.files.items())]
        manifest = {
            "format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "kind": kind, "step": step,
            "created": _now(), "ripresa": __version__,
            "files": entries, "total_bytes": sum(e["size"] for e in entries), **extra,
        }
        mdig = self.write(MANIFEST_JSON, _json_bytes(manifest))
        lines = [sidecar_line(d, rel) for rel, d in sorted(self.files.items()) if rel != MANIFEST_JSON]
        lines.append(sidecar_line(mdig, MANIFEST_JSON))
        self.write(MANIFEST_SHA, b"".join(lines))
        fsync_dir(self.dest)
        return manifest

    def abort(self, dest_created: bool) -> None:
        """Remove what this export wrote (best effort); DEST is left as it was."""
        for rel in list(self.files):
            try:
                os.unlink(self.dest / rel)
            except OSError:
                pass
        for d in reversed(self.created_dirs):
            try:
                d.rmdir()
            except OSError:
                pass
        if dest_created:
            try:
                self.dest.rmdir()
            except OSError:
                pass


def _check_dest(dest: Path, run: Path) -> None:
    if os.path.lexists(dest):
        if not dest.is_dir():
            raise OutputExists("export destination exists and is not a folder", file=dest,
                               expected="a new folder or an empty one", found="a file",
                               hint="choose another --to")
        try:
            names = sorted(os.listdir(dest))
        except OSError as exc:
            raise BadInput("export destination cannot be listed", file=dest, found=str(exc)) from exc
        if names:
            raise OutputExists("export destination is not empty", file=dest,
                               expected="a new folder or an empty one", found=f"{len(names)} entries: {names[:5]}",
                               hint="an export never overwrites or merges; choose a new --to folder")
        if dest.resolve() == run.resolve():
            raise OutputExists("export destination is the run folder", file=dest, expected="another folder")


def _select_generation(store: CheckpointStore, step: int | None) -> tuple[Generation, list[dict[str, Any]]]:
    """The generation to export, verified in full (sha256 of the whole .bin) before any copy."""
    steps = store.steps_on_disk()
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise BadInput("--step must be a non-negative integer", expected=">= 0", found=repr(step))
        if step not in steps:
            raise BadInput(f"the run has no generation for step {step}", file=store.folder / bin_name(step),
                           expected=f"one of the steps on disk: {steps}" if steps else "a generation",
                           found="nothing", hint="`ripresa inspect RUN` lists the generations")
        gen = store.check(step, deep=True)
        if not gen.valid:
            raise IntegrityError(f"generation {step} is damaged or uncommitted: not exported", file=gen.bin,
                                 expected="a committed generation whose files match its marker", found=gen.reason,
                                 hint="export another step (`ripresa inspect RUN` shows which are valid)")
        return gen, []
    skipped: list[dict[str, Any]] = []
    for s in reversed(steps):
        gen = store.check(s, deep=True)
        if gen.valid:
            return gen, skipped
        skipped.append({"step": s, "reason": gen.reason})
        warnings.warn(not_used("generation", s, gen.reason, gen.bin, then="an older one is exported"), CheckpointWarning,
                      stacklevel=3)
    if not steps:
        raise BadInput("the run folder holds no generation", file=store.folder,
                       expected="step_NNNNNN.bin + .json + .bin.sha256", found="nothing",
                       hint="train first, or send the trainer a checkpoint signal (`ripresa signal RUN checkpoint`)")
    raise IntegrityError("no valid generation in the run folder: nothing exported", file=store.folder,
                         expected="at least one committed generation", found="; ".join(f"{d['step']}: {d['reason']}" for d in skipped))


def _parse_source(spec: str, identity: dict[str, Any]) -> dict[str, Any]:
    name, sep, path = str(spec).partition("=")
    if sep:
        return {"name": name, "spec": spec, "kind": "file or folder", "path": path, "sha256": identity.get(name)}
    return {"name": spec, "spec": spec, "kind": "built-in (derived from the Python standard library)",
            "path": None, "sha256": identity.get(spec)}


def _choose_config(run: Path, companion_cfg: Any, n_params: int, model_factory: ModelFactory) -> tuple[bytes | None, Any, str]:
    """(config.json bytes to write or None, the config, where it came from).

    The run's ``config.json`` is used when its model matches the ``.bin``; else
    the generation's own config (from the companion), which it was trained with.
    The run's file is read once (:func:`~ripresa.io.fsio.read_small`: a symlink or
    FIFO is refused) and the bytes read are the bytes written to the bundle.
    """
    def matches(cfg: Any) -> bool:
        m = _model_section(cfg)
        if m is None:
            return False
        try:
            return model_factory.param_count(m) == n_params
        except (BadInput, TypeError, ValueError, OverflowError):
            return False

    run_cfg_path = run / "config.json"
    run_cfg = None
    run_raw = None
    if os.path.lexists(run_cfg_path):
        run_raw = read_small(run_cfg_path, "the run's config.json", JSON_MAX)
        run_cfg = parse_json_bytes(run_raw, run_cfg_path, "the run's config.json")
        if matches(run_cfg):
            return run_raw, run_cfg, "run"
    if matches(companion_cfg):
        return _json_bytes(companion_cfg), companion_cfg, "generation"
    if run_cfg is not None and _model_section(run_cfg) is not None:
        raise SchemaError("config.json's model does not match the .bin", file=run_cfg_path,
                          expected=f"a model of {n_params} parameters", found="another shape",
                          hint="the run's config.json was changed after this generation was saved")
    if run_cfg is not None:
        return run_raw, run_cfg, "run"
    if isinstance(companion_cfg, dict) and companion_cfg:
        return _json_bytes(companion_cfg), companion_cfg, "generation"
    return None, None, "none"


def _copy_signature(bundle: _Bundle, gen: Generation, rel_dir: str) -> str | None:
    """Copy the generation's ``.bin.hmac`` (unchanged, its form checked) if it has one; return its path in the bundle.

    A bundle of a signed run so stays signed (``docs/FORMAT.md``); the
    signature is listed in the manifest like every file.
    """
    sig = auth.signature_path(gen.bin)
    if not os.path.lexists(sig):
        return None
    read_small(sig, "the generation's signature", auth.MAX_SIGNATURE, error=IntegrityError)  # no link, no FIFO
    _, sig_step, _ = auth.read_signature(sig)  # one well-formed line
    if sig_step != gen.step:
        raise IntegrityError("the generation's signature names another step", file=sig, expected=gen.step,
                             found=sig_step, hint="the signature was moved or forged; nothing was exported")
    rel = f"{rel_dir}/{sig.name}"
    bundle.copy(sig, rel, what="the generation's signature", error=IntegrityError)
    return rel


# ----------------------------------------------------------------------------- export


def export_run(run: Path, dest: Path, *, model_factory: ModelFactory | None = None, step: int | None = None,
               inference: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Export one generation of ``run`` (see :func:`_export_run`); a sharded ``.dcp`` one is consolidated first.

    When the generation to export (``step``, or the newest valid one of the
    run) is a ``step_NNNNNN.dcp`` of an FSDP2 run, it is checked deeply
    (every file's sha256; ``.metadata`` through the restricted reader), read
    into one process and written as a ``.bin`` generation in a staging folder
    beside ``dest`` (``ripresa convert``: re-read and compared bitwise), which
    is then exported like any other and removed: the bundle resumes on any
    number of ranks, ``--inference`` gives consolidated safetensors
    (docs/SHARDED.md).
    """
    run, dest = Path(run), Path(dest)
    from .export_general import export_general, general_source

    general = general_source(run, step)  # a Checkpointer's default format (docs/FORMAT.md, "Export bundles")
    if general is not None:
        return export_general(run, dest, general, model_factory=model_factory, inference=inference,
                              show_progress=show_progress)
    if model_factory is None and run.is_dir():
        raise BadInput("exporting a .bin or .dcp generation needs the model factory", file=run,
                       expected="export_run(..., model_factory=GPT_FACTORY)", found="model_factory=None",
                       hint="only a general generation (a Checkpointer's default format) exports without one")
    sharded = _sharded_source(run, step)
    if sharded is None:
        return _export_run(run, dest, model_factory=model_factory, step=step, inference=inference,
                           show_progress=show_progress)
    import shutil
    import tempfile

    from .convert import convert

    _check_dest(dest, run)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.consolidate-", dir=dest.parent))
    try:
        convert(sharded.path, stage / bin_name(sharded.step), model_factory=model_factory)
        report = _export_run(run, dest, model_factory=model_factory, step=sharded.step, inference=inference,
                             show_progress=show_progress, store=CheckpointStore(stage, writer=False))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    report["source"]["consolidated_from"] = {"dcp": str(sharded.path), "world_size": sharded.world_size,
                                             "files_sha256": dict(sharded.files or {})}
    report["notes"].append(f"consolidated from the sharded generation {sharded.path.name} "
                           f"({sharded.world_size} rank(s)), compared bitwise after conversion")
    return report


def _sharded_source(run: Path, step: int | None) -> Generation | None:
    """The ``.dcp`` generation to export, deep-checked, or None when the export is of a ``.bin``."""
    from ..formats import dcp as dcp_fmt
    from ..store.backend import latest_valid_of

    dcp_steps = dcp_fmt.dcp_steps_on_disk(run) if run.is_dir() else []
    if not dcp_steps:
        return None
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step in CheckpointStore(run, writer=False).steps_on_disk() \
                or step not in dcp_steps:
            return None
        gen = dcp_fmt.check_dcp(run, step, deep=True)
        if not gen.valid:
            raise IntegrityError(f".dcp generation {step} is damaged or uncommitted: not exported", file=gen.path,
                                 expected="a committed generation whose files match its marker", found=gen.reason,
                                 hint="export another step (`ripresa inspect RUN` shows which are valid)")
        return gen
    newest = latest_valid_of(run, ("bin", "dcp"), deep=True)
    return newest if newest is not None and newest.kind == "dcp" else None


def _export_run(run: Path, dest: Path, *, model_factory: ModelFactory, step: int | None = None, inference: bool = False,
                show_progress: bool = True, store: CheckpointStore | None = None) -> dict[str, Any]:
    """Export one generation of ``run`` to the new folder ``dest``; verify it there; return a report.

    ``step=None`` exports the newest valid generation (a damaged newer one is
    skipped with a :class:`~ripresa.store.store.CheckpointWarning`). ``inference``
    writes a weights-only safetensors export instead of a resume bundle.

    Raises :class:`~ripresa.errors.OutputExists` (exit 2) for a non-empty
    ``dest``, :class:`~ripresa.errors.BadInput` (exit 2) for a missing run or
    step, :class:`~ripresa.errors.IntegrityError` (exit 1) for a damaged
    generation (before anything is copied) or a copy that does not verify.
    """
    t0 = time.monotonic()
    run, dest = Path(run), Path(dest)
    store = store if store is not None else CheckpointStore(run, writer=False)
    _check_dest(dest, run)
    gen, skipped = _select_generation(store, step)
    assert gen.size is not None and gen.bin_sha256 is not None and gen.companion_sha256 is not None
    n_params = (gen.size - HEADER_SIZE) // BYTES_PER_PARAM
    dest_created = make_dest(dest)
    total = 0 if inference else sum(_size_or_zero(p) for p in (
        gen.bin, gen.companion, gen.marker, run / "config.json", run / ".loss.jsonl", run / ".samples.json", run / ".state.json"))
    with _meter(total, f"export step {gen.step}", show_progress) as advance:
        bundle = _Bundle(dest, advance)
        try:
            if inference:
                info = _write_inference(bundle, run, gen, n_params, model_factory)
            else:
                info = _write_resume(bundle, run, gen, n_params, model_factory)
            manifest = bundle.commit(INFERENCE if inference else RESUME, gen.step, info["manifest_extra"])
        except BaseException:
            bundle.abort(dest_created)
            raise
    verification = verify_or_uncommit(dest, model_factory, show_progress, info.get("weights"))
    return {
        "kind": manifest["kind"],
        "run": str(run),
        "dest": str(dest),
        "step": gen.step,
        "source": {"bin": str(gen.bin), "bin_sha256": gen.bin_sha256, "bin_size": gen.size, "n_params": n_params,
                   "companion_sha256": gen.companion_sha256, "verified_before_copy": True, "skipped": skipped},
        "files": manifest["files"],
        "bytes": manifest["total_bytes"],
        "seconds": round(time.monotonic() - t0, 3),
        "verified": bool(verification["verified"]),
        "verification": verification,
        "notes": info["notes"],
        "exit_code": 0,
    }


def _write_resume(bundle: _Bundle, run: Path, gen: Generation, n_params: int, model_factory: ModelFactory) -> dict[str, Any]:
    notes: list[str] = []
    rel_bin = f"checkpoint/{gen.bin.name}"
    rel_comp = f"checkpoint/{gen.companion.name}"
    rel_marker = f"checkpoint/{gen.marker.name}"
    assert gen.bin_sha256 and gen.companion_sha256 and gen.size is not None
    bundle.copy(gen.bin, rel_bin, what="the generation's .bin", expected=Digest(gen.bin_sha256, gen.size),
                error=IntegrityError)
    raw_comp = bundle.copy(gen.companion, rel_comp, what="the generation's companion", expected=gen.companion_sha256,
                           keep=True, error=IntegrityError)
    rel_sig = _copy_signature(bundle, gen, "checkpoint")
    bundle.copy(gen.marker, rel_marker, what="the generation's commit marker", error=IntegrityError)
    assert raw_comp is not None
    doc = parse_json_bytes(raw_comp, gen.companion, "the generation's companion", error=IntegrityError)
    state = _as_dict(doc.get("state")) if isinstance(doc, dict) else {}

    cfg_bytes, config, cfg_from = _choose_config(run, state.get("config"), n_params, model_factory)
    if cfg_from == "run":
        assert cfg_bytes is not None
        bundle.write("config.json", cfg_bytes)
    elif cfg_bytes is not None:
        bundle.write("config.json", cfg_bytes)
        notes.append("config.json was taken from the generation's companion (the run's own config.json "
                     "is missing or describes another model)")
    else:
        notes.append("no config.json: neither the run nor the generation records one; the model cannot be rebuilt")
    if cfg_from != "none" and config != state.get("config"):
        notes.append("config.json (the run's current phase) differs from the config this generation was saved "
                     "with (kept in its companion, state.config): a pivot or an edit happened since")

    model_cfg = _model_section(config)
    params: list[dict[str, Any]] | None = None
    if model_cfg is not None:
        params = _param_table(_build_model(model_factory, model_cfg, run / "config.json", n_params))
        bundle.write("parameters.json", _json_bytes({
            "what": "the parameters of the model, in model.parameters() order: each is a slice "
                    "[offset, offset + numel) of the weights region (and of m and v) of the .bin",
            "dtype": "float32, little-endian", "n_params": n_params, "parameters": params}))

    metrics = copy_metrics(bundle, run, notes)

    identity = _as_dict(state.get("data_identity"))
    sources = _model_sources(state.get("config"), config)
    bundle.write("data.json", _json_bytes({
        "what": "the data this checkpoint was trained on: each source and the sha256 of the bytes it served "
                "(a resume refuses different bytes unless --allow-data-change)",
        "data_identity": identity,
        "sources": [_parse_source(s, identity) for s in sources],
    }))
    bundle.write("versions.json", _json_bytes({
        "what": "software that wrote this checkpoint (a resume compares python, torch, numpy, ripresa) "
                "and the identity of the training code",
        "versions": state.get("versions"), "code": state.get("code"), "exported_with": _exporter_versions(),
    }))
    has_lineage = os.path.lexists(run / "lineage.json")
    if has_lineage:
        bundle.copy(run / "lineage.json", "lineage.json", what="the run's lineage.json")
    progress = _as_dict(state.get("progress"))
    provenance = {
        "format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "kind": RESUME,
        "what": "a resume checkpoint: everything needed to continue the training exactly",
        "created": _now(), "exported_with": f"ripresa {__version__}",
        "source_run": str(run.resolve()), "step": gen.step, "progress": progress,
        "generation": {"bin": rel_bin, "companion": rel_comp, "marker": rel_marker, "signature": rel_sig,
                       "bin_sha256": gen.bin_sha256, "bin_size": gen.size, "companion_sha256": gen.companion_sha256,
                       "n_params": n_params},
        "config_from": cfg_from, "lineage_in_companion": state.get("lineage") or [],
        "metrics": metrics, "notes": notes,
    }
    bundle.write("export.json", _json_bytes(provenance))
    readme = _resume_readme(run=run, gen=gen, n_params=n_params, progress=progress, params=params,
                            metrics=metrics, has_lineage=has_lineage, config=config, state=state,
                            sources=[_parse_source(s, identity) for s in sources], created=provenance["created"])
    bundle.write("README.md", readme.encode())
    extra = {"generation": provenance["generation"]}
    return {"manifest_extra": extra, "notes": notes}


def _archived_files(run: Path) -> list[tuple[str, str, str]]:
    """(phase folder, file, name in the bundle) of every archived ``.samples.json`` / ``.state.json``.

    ``archive/`` and its phase folders are listed without following links: a
    symlink in place of ``archive/``, of a phase folder or of an archived file
    refuses the export (:class:`~ripresa.errors.BadInput`).
    """
    archive = run / "archive"
    if not os.path.lexists(archive):
        return []
    if os.path.islink(archive) or not archive.is_dir():
        raise BadInput("the run's archive/ is not a folder", file=archive, expected="a folder inside the run",
                       found="a symlink" if os.path.islink(archive) else "not a folder",
                       hint="ripresa never follows links inside a run folder; replace the link by the folder")
    out = []
    try:
        entries = sorted(os.scandir(archive), key=lambda e: e.name)
    except OSError as exc:
        raise BadInput("the run's archive/ cannot be listed", file=archive, found=str(exc)) from exc
    for entry in entries:
        if entry.is_symlink():
            raise BadInput("an entry of the run's archive/ is a symlink", file=entry.path, expected="a folder",
                           found="a symlink", hint="ripresa never follows links inside a run folder")
        if not entry.is_dir(follow_symlinks=False):
            continue
        for src, name in ((".samples.json", "samples.json"), (".state.json", "state.json")):
            if os.path.lexists(Path(entry.path) / src):
                out.append((entry.name, src, name))
    return out


def _model_sources(gen_cfg: Any, run_cfg: Any) -> list[str]:
    for cfg in (gen_cfg, run_cfg):
        if isinstance(cfg, dict) and isinstance(cfg.get("data"), dict) and isinstance(cfg["data"].get("sources"), list):
            return [str(s) for s in cfg["data"]["sources"]]
    return []


def _exporter_versions() -> dict[str, Any]:
    import platform

    return {"ripresa": __version__, "python": platform.python_version(), "torch": str(torch.__version__),
            "numpy": str(np.__version__)}


def _write_inference(bundle: _Bundle, run: Path, gen: Generation, n_params: int, model_factory: ModelFactory) -> dict[str, Any]:
    try:
        from safetensors.torch import save as st_save
    except ImportError as exc:  # pragma: no cover - safetensors is a dependency
        raise MissingDependency("an inference export needs safetensors", expected="pip install safetensors",
                                found="not installed") from exc
    notes: list[str] = []
    raw_comp = read_small(gen.companion, "the generation's companion", COMPANION_MAX, error=IntegrityError)
    import hashlib

    if hashlib.sha256(raw_comp).hexdigest() != gen.companion_sha256:
        raise IntegrityError("the companion changed since it was checked", file=gen.companion,
                             expected=gen.companion_sha256, found=hashlib.sha256(raw_comp).hexdigest())
    doc = parse_json_bytes(raw_comp, gen.companion, "the generation's companion", error=IntegrityError)
    state = _as_dict(doc.get("state")) if isinstance(doc, dict) else {}
    cfg_bytes, config, cfg_from = _choose_config(run, state.get("config"), n_params, model_factory)
    model_cfg = _model_section(config)
    if model_cfg is None:
        raise BadInput("an inference export needs the model's config", file=run / "config.json",
                       expected="a config.json with a 'model' section", found="none",
                       hint="only runs of `ripresa train` (the GPT) can be exported for inference")
    model = _build_model(model_factory, model_cfg, run / "config.json", n_params)  # the count is checked before anything is built
    contents = read_bin(gen.bin, expected_n=n_params, expected_sha256=gen.bin_sha256, check_finite=False)
    _load_weights(model, contents.weights, gen.bin)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    metadata = {"format": "ripresa.inference", "step": str(gen.step), "source_bin_sha256": gen.bin_sha256,
                "ripresa": __version__, "n_params": str(n_params), "model": json.dumps(model_cfg, sort_keys=True)}
    bundle.write("model.safetensors", st_save(tensors, metadata=metadata))
    if cfg_bytes is not None:
        bundle.write("config.json", cfg_bytes)
    progress = _as_dict(state.get("progress"))
    provenance = {
        "format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "kind": INFERENCE,
        "what": "an inference export: model weights only. NOT a resume checkpoint (no optimizer moments, "
                "random generator states, data position or LR schedule)",
        "created": _now(), "exported_with": f"ripresa {__version__}",
        "source_run": str(run.resolve()), "step": gen.step, "progress": progress,
        "source_bin": {"name": gen.bin.name, "sha256": gen.bin_sha256, "size": gen.size, "n_params": n_params},
        "config_from": cfg_from, "data_identity": state.get("data_identity"),
        "versions": state.get("versions"), "code": state.get("code"),
    }
    bundle.write("export.json", _json_bytes(provenance))
    shapes = [(k, list(v.shape)) for k, v in tensors.items()]
    bundle.write("README.md", _inference_readme(run=run, gen=gen, n_params=n_params, shapes=shapes,
                                                model_cfg=model_cfg, config=config,
                                                created=provenance["created"]).encode())
    extra = {"weights": {"file": "model.safetensors", "source_bin_sha256": gen.bin_sha256, "n_params": n_params}}
    return {"manifest_extra": extra, "notes": notes, "weights": contents.weights}


# ----------------------------------------------------------------------------- verification


def _safe_rel(dest: Path, rel: Any, manifest: Path) -> Path:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel \
            or any(part in ("", ".", "..") for part in rel.split("/")):
        raise IntegrityError("the manifest names a path outside the export", file=manifest,
                             expected="a relative path inside the folder", found=repr(rel))
    path = dest / rel
    for parent in [path, *path.parents]:
        if parent == dest:
            break
        if parent.is_symlink():
            raise IntegrityError("a file of the export is a symbolic link", file=parent,
                                 expected="a regular file", found="a symlink")
    return path


def _read_manifest(dest: Path) -> dict[str, Any]:
    """Parse MANIFEST.sha256 and MANIFEST.json and check they agree (both are required)."""
    msha, mjson = dest / MANIFEST_SHA, dest / MANIFEST_JSON
    if not os.path.lexists(msha):
        raise IntegrityError(f"{MANIFEST_SHA} is missing: this is not a complete export", file=msha,
                             expected=f"{MANIFEST_SHA}, written last by ripresa export", found="nothing",
                             hint="the export was interrupted or failed its verification; export again")
    lines: dict[str, str] = {}
    for i, line in enumerate(read_small(msha, MANIFEST_SHA, JSON_MAX, error=IntegrityError)
                             .decode("utf-8", "replace").splitlines(), 1):
        hexd, sep, rel = line.partition("  ")
        if not sep or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd) or rel in lines:
            raise IntegrityError(f"malformed line {i} in {MANIFEST_SHA}", file=msha,
                                 expected="'<sha256>  <relative path>'", found=repr(line[:160]))
        lines[rel] = hexd
    if MANIFEST_JSON not in lines:
        raise IntegrityError(f"{MANIFEST_SHA} does not vouch for {MANIFEST_JSON}", file=msha,
                             expected=f"a line for {MANIFEST_JSON}", found=sorted(lines)[:8])
    drop_page_cache_quiet(mjson)
    raw = read_small(mjson, MANIFEST_JSON, JSON_MAX, error=IntegrityError)  # read once: the bytes hashed are the bytes parsed
    found_sha = hashlib.sha256(raw).hexdigest()
    if found_sha != lines[MANIFEST_JSON]:
        raise IntegrityError(f"sha256 mismatch: {MANIFEST_JSON} changed after the export", file=mjson,
                             expected=lines[MANIFEST_JSON], found=found_sha)
    manifest = parse_json_bytes(raw, mjson, MANIFEST_JSON, error=IntegrityError)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT \
            or type(version) is not int or version != EXPORT_FORMAT_VERSION \
            or manifest.get("kind") not in (RESUME, INFERENCE) or not isinstance(manifest.get("files"), list):
        raise IntegrityError(f"{MANIFEST_JSON} is not a ripresa export manifest of a version this ripresa reads", file=mjson,
                             expected=f"format '{EXPORT_FORMAT}', format_version {EXPORT_FORMAT_VERSION}, "
                                      "kind resume|inference, files [...]",
                             found={k: repr(manifest.get(k))[:40] for k in ("format", "format_version", "kind")}
                             if isinstance(manifest, dict) else type(manifest).__name__)
    listed = {}
    for e in manifest["files"]:
        if not isinstance(e, dict) or not isinstance(e.get("size"), int) or not isinstance(e.get("sha256"), str):
            raise IntegrityError(f"malformed entry in {MANIFEST_JSON}", file=mjson, expected="{path, size, sha256}", found=repr(e)[:160])
        _safe_rel(dest, e.get("path"), mjson)
        listed[e["path"]] = e
    others = {k: v for k, v in lines.items() if k != MANIFEST_JSON}
    if set(others) != set(listed) or any(others[k] != listed[k]["sha256"] for k in listed):
        diff = sorted(set(others) ^ set(listed)) or sorted(k for k in listed if others[k] != listed[k]["sha256"])
        raise IntegrityError(f"{MANIFEST_SHA} and {MANIFEST_JSON} disagree", file=msha,
                             expected="the same files and hashes in both", found=diff[:8])
    return manifest


def drop_page_cache_quiet(path: Path) -> bool:
    """Drop ``path``'s cached pages if it is a regular file (no link followed); never raises."""
    try:
        fd = open_run_file(path, "file", error=IntegrityError)
    except RipresaError:
        return False
    try:
        return _fadvise_dontneed(fd)
    finally:
        os.close(fd)


def _fadvise_dontneed(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise") or not hasattr(os, "POSIX_FADV_DONTNEED"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def _hash_bundle_file(path: Path, what: str) -> tuple[Digest, bool]:
    """sha256 of a bundle's file, opened with :func:`~ripresa.io.fsio.open_run_file` (a link or FIFO fails, exit 1)."""
    fd = open_run_file(path, what, error=IntegrityError)
    try:
        dropped = _fadvise_dontneed(fd)
        digest = sha256_fd(fd, what=what, path=path)
        _fadvise_dontneed(fd)
    finally:
        os.close(fd)
    return digest, dropped


def verify_export(dest: Path, *, model_factory: ModelFactory | None = None, show_progress: bool = False, _expected_weights: Any = None) -> dict[str, Any]:
    """Re-hash every file of an export against its manifest, then reload it; return a report.

    Every file is read back from the disk (its cached pages dropped first,
    where the platform allows). A resume bundle is reloaded through
    :class:`~ripresa.store.store.CheckpointStore` (marker, companion and ``.bin``
    hashes, NaN/Inf check) into the GPT built from its ``config.json``, and one
    forward pass must give finite logits. An inference export is loaded with
    ``safetensors.torch.load_file`` into a fresh GPT (keys and shapes must
    match exactly) and generates a few bytes with an explicit generator.

    Raises :class:`~ripresa.errors.IntegrityError` (exit 1) naming the file,
    the expected and the found hash (or size) at the first mismatch;
    :class:`~ripresa.errors.BadInput` (exit 2) if ``dest`` is not a folder.
    """
    t0 = time.monotonic()
    dest = Path(dest)
    if not dest.is_dir():
        raise BadInput("export folder not found", file=dest, expected="a folder written by ripresa export",
                       found="nothing" if not os.path.lexists(dest) else "not a folder")
    manifest = _read_manifest(dest)
    total = sum(e["size"] for e in manifest["files"])
    dropped = True
    with _meter(total, "verify", show_progress) as advance:
        for e in manifest["files"]:
            path = _safe_rel(dest, e["path"], dest / MANIFEST_JSON)
            if not os.path.lexists(path):
                raise IntegrityError("a file of the export is missing", file=path,
                                     expected=f"{e['size']} bytes, sha256 {e['sha256']}", found="nothing")
            d, was_dropped = _hash_bundle_file(path, f"exported file {e['path']}")
            dropped = was_dropped and dropped
            if d.size != e["size"]:
                raise IntegrityError("size mismatch: the exported file is not the one that was written", file=path,
                                     expected=f"{e['size']} bytes", found=f"{d.size} bytes",
                                     hint="truncated or extended copy; export again")
            if d.sha256 != e["sha256"]:
                raise IntegrityError("sha256 mismatch: the exported file is not the one that was written", file=path,
                                     expected=e["sha256"], found=d.sha256, hint="the copy is damaged; export again")
            advance(d.size, f"verify {e['path']}")
    listed = {e["path"] for e in manifest["files"]} | {MANIFEST_JSON, MANIFEST_SHA}
    unlisted = sorted(str(p.relative_to(dest)) for p in dest.rglob("*")
                      if (p.is_file() or p.is_symlink()) and str(p.relative_to(dest)) not in listed)
    general = "general" in (_as_dict(manifest.get("generation")).get("format"), _as_dict(manifest.get("weights")).get("source"))
    if model_factory is None and not general:
        raise BadInput("verifying the export of a .bin generation needs the model factory", file=dest,
                       expected="verify_export(..., model_factory=GPT_FACTORY)", found="model_factory=None")
    if manifest["kind"] == RESUME:
        reload = _reload_resume(dest, manifest, model_factory)
    else:
        reload = _reload_inference(dest, manifest, _expected_weights, model_factory)
    return {
        "dest": str(dest), "kind": manifest["kind"], "step": manifest.get("step"),
        "files": len(manifest["files"]) + 2, "bytes": total, "hashes_checked": len(manifest["files"]) + 1,
        "page_cache_dropped": dropped, "unlisted": unlisted, "reload": reload,
        "verified": True, "seconds": round(time.monotonic() - t0, 3),
    }


def _reload_resume(dest: Path, manifest: dict[str, Any], model_factory: ModelFactory) -> dict[str, Any]:
    gen = _as_dict(manifest.get("generation"))
    if gen.get("format") == "general":
        from .export_general import reload_resume

        return reload_resume(dest, manifest)
    step = manifest.get("step")
    if not isinstance(step, int) or not isinstance(gen.get("bin"), str):
        raise IntegrityError(f"{MANIFEST_JSON} does not name the generation", file=dest / MANIFEST_JSON,
                             expected="step and generation.bin", found={"step": step, "generation": gen})
    bin_path = _safe_rel(dest, gen["bin"], dest / MANIFEST_JSON)
    store = CheckpointStore(bin_path.parent, writer=False)
    contents, state = store.load(step, check_finite=True)
    progress = _as_dict(state.get("progress"))
    if progress.get("step") != step or contents.step != step:
        raise IntegrityError("the exported generation describes another step", file=bin_path,
                             expected=step, found={"bin": contents.step, "companion": progress.get("step")})
    out: dict[str, Any] = {"loaded": bin_path.name, "step": contents.step, "n_params": contents.n_params,
                           "companion_keys": sorted(state)}
    cfg_path = dest / "config.json"
    model_cfg = _model_section(_load_json(cfg_path, "config.json", IntegrityError)) if os.path.lexists(cfg_path) else None
    if model_cfg is None:
        out["forward"] = "skipped: no config.json with a 'model' section (not a ripresa GPT run)"
        return out
    model = _build_model(model_factory, model_cfg, cfg_path, contents.n_params)
    _load_weights(model, contents.weights, bin_path)
    out.update(_probe_forward(model, bin_path))
    return out


def _reload_inference(dest: Path, manifest: dict[str, Any], expected_weights: Any,
                      model_factory: ModelFactory) -> dict[str, Any]:
    if _as_dict(manifest.get("weights")).get("source") == "general":
        from .export_general import reload_inference

        return reload_inference(dest, manifest, expected_weights)
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file
    except ImportError as exc:  # pragma: no cover
        raise MissingDependency("verifying an inference export needs safetensors", expected="pip install safetensors",
                                found="not installed") from exc
    path = dest / "model.safetensors"
    cfg_path = dest / "config.json"
    os.close(open_run_file(path, "model.safetensors", error=IntegrityError))  # no link, no FIFO (hashed above too)
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        raise IntegrityError("model.safetensors does not load", file=path, expected="a safetensors file",
                             found=f"{type(exc).__name__}: {exc}"[:200]) from exc
    model_cfg = _model_section(_load_json(cfg_path, "config.json", IntegrityError))
    if model_cfg is None:
        raise IntegrityError("config.json has no model section", file=cfg_path, expected="'model': {...}", found="none")
    model = _build_model(model_factory, model_cfg, cfg_path, sum(int(v.numel()) for v in tensors.values()))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if want != got:
        diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        raise SchemaError("model.safetensors does not match the model of config.json", file=path,
                          expected="the same tensor names and shapes", found=[(k, want.get(k), got.get(k)) for k in diff[:5]])
    model.load_state_dict(tensors, strict=True)
    step = manifest.get("step")
    if meta.get("step") != str(step):
        raise IntegrityError("model.safetensors' metadata names another step", file=path, expected=step, found=meta.get("step"))
    if expected_weights is not None:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        if flat.shape != expected_weights.shape or not np.array_equal(flat.view(np.uint32), expected_weights.view(np.uint32)):
            raise IntegrityError("the reloaded weights differ from the source .bin", file=path,
                                 expected="bit-identical float32 weights", found="a difference")
    out: dict[str, Any] = {"loaded": path.name, "step": step, "tensors": len(tensors),
                           "n_params": sum(int(v.numel()) for v in tensors.values()),
                           "metadata": meta, "bit_identical_to_source": expected_weights is not None or None}
    out.update(_probe_forward(model, path))
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([list(PROBE_PROMPT)], dtype=torch.long)
    y = model.generate(idx, 16, generator=gen, temperature=0.8, top_k=40)
    new = y[0, idx.size(1):].tolist()
    if len(new) != 16 or not all(0 <= b < 256 for b in new):
        raise IntegrityError("the reloaded model did not generate bytes", file=path, expected="16 byte values", found=new)
    out["sample"] = {"prompt": PROBE_PROMPT.decode(), "completion": bytes(new).decode("utf-8", "replace"), "seed": 0}
    return out


# ----------------------------------------------------------------------------- READMEs


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} bytes"  # pragma: no cover


NUMPY_SNIPPET = '''\
import json
import os

import numpy as np

path = "{bin}"
step, n = (int(x) for x in np.fromfile(path, dtype="<i4", count=2))  # header: int32 step, int32 n_params
assert os.path.getsize(path) == 8 + 12 * n, "a valid file is exactly 8 + 12 * n_params bytes"
weights, m, v = np.fromfile(path, dtype="<f4", offset=8).reshape(3, n)  # float32 weights, AdamW m, AdamW v
with open("parameters.json") as f:
    layout = json.load(f)["parameters"]  # name, shape, offset of each parameter inside `weights`
params = {{p["name"]: weights[p["offset"] : p["offset"] + p["numel"]].reshape(p["shape"]) for p in layout}}
print(f"step {{step}}, {{n:,}} parameters; {{layout[0]['name']}} has shape {{params[layout[0]['name']].shape}}")
'''

NUMPY_SNIPPET_BARE = '''\
import os

import numpy as np

path = "{bin}"
step, n = (int(x) for x in np.fromfile(path, dtype="<i4", count=2))  # header: int32 step, int32 n_params
assert os.path.getsize(path) == 8 + 12 * n, "a valid file is exactly 8 + 12 * n_params bytes"
weights, m, v = np.fromfile(path, dtype="<f4", offset=8).reshape(3, n)  # float32 weights, AdamW m, AdamW v
print(f"step {{step}}, {{n:,}} parameters")
'''

SAFETENSORS_SNIPPET = '''\
import json

import torch
from safetensors.torch import load_file

from ripresa.engine.gpt.model import GPT, from_config_dict

with open("config.json") as f:
    model = GPT(from_config_dict(json.load(f)["model"]))
model.load_state_dict(load_file("model.safetensors"))  # strict: every name and shape must match
prompt = torch.tensor([list("The ".encode())])
out = model.generate(prompt, 64, generator=torch.Generator().manual_seed(0), temperature=0.8, top_k=40)
print(bytes(out[0].tolist()).decode("utf-8", "replace"))
'''


@cache
def _readme_parts() -> dict[str, Template]:
    """The parts of templates/export_readme.md (package data), by name."""
    text = resources.files(__package__).joinpath("templates", "export_readme.md").read_text(encoding="utf-8")
    chunks = re.split(r"^@@part (\S+)\n", text, flags=re.M)
    return {name: Template(body) for name, body in zip(chunks[1::2], chunks[2::2], strict=True)}


def _part(part: str, **values: Any) -> str:
    return _readme_parts()[part].substitute(values)


def _resume_readme(*, run: Path, gen: Generation, n_params: int, progress: dict[str, Any],
                   params: list[dict[str, Any]] | None, metrics: list[str], has_lineage: bool,
                   config: Any, state: dict[str, Any], sources: list[dict[str, Any]], created: str) -> str:
    b, c, mk = gen.bin.name, gen.companion.name, gen.marker.name
    size = gen.size or 0
    versions = state.get("versions") or {}
    step = gen.step
    out = [_part("resume-head", step=step, run_name=run.name, version=__version__, created=created,
                 run_path=run.resolve())]
    if progress:
        shown = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in progress.items())
        out.append(_part("resume-progress", progress=shown))
    else:
        out.append(_part("no-progress"))
    out.append(_part("resume-files", bin=b, companion=c, marker=mk, size=f"{size:,}"))
    rows = [("row-config-gpt", params is not None), ("row-config", params is None and config is not None),
            ("row-parameters", params is not None), ("row-loss", "metrics/loss.jsonl" in metrics),
            ("row-samples", "metrics/samples.json" in metrics), ("row-state", "metrics/state.json" in metrics),
            ("row-archive", any(m.startswith("metrics/archive/") for m in metrics)), ("rows-identity", True),
            ("row-lineage", has_lineage), ("rows-end", True)]
    out += [_part(name) for name, wanted in rows if wanted]
    snippet = (NUMPY_SNIPPET if params is not None else NUMPY_SNIPPET_BARE).format(bin=f"checkpoint/{b}")
    out.append(_part("bin-layout", bin=b, step=step, n_params=f"{n_params:,}", size=f"{size:,}",
                     order=_part("order-parameters" if params else "order-plain").rstrip("\n"),
                     snippet=snippet.rstrip("\n")))
    if params is not None and isinstance(config, dict):
        shape = ", ".join(f"`{k}` = {v}" for k, v in config.get("model", {}).items())
        out.append(_part("gpt-shape", shape=shape))
    if params is None:
        out.append(_part("resume-own-model", step=step))
    else:
        cmds = ["mkdir -p runs/resumed", f"cp checkpoint/{b} checkpoint/{c} checkpoint/{mk} config.json runs/resumed/"]
        for name in ("loss.jsonl", "state.json", "samples.json"):
            if f"metrics/{name}" in metrics:
                cmds.append(f"cp metrics/{name} runs/resumed/.{name}")
        cmds.append("ripresa inspect runs/resumed        # optional: lists and checks the generation")
        cmds.append(f"ripresa train --run runs/resumed    # resumes at step {step}")
        out.append(_part("resume-gpt", version=__version__, commands="\n".join(cmds), step=step))
    out.append(_part("data-head"))
    if sources:
        out.append(_part("data-table"))
        for src in sources:
            where = f" (`{src['path']}`)" if src["path"] else ""
            out.append(_part("data-row", name=src["name"], where=where, kind=src["kind"],
                             sha256=src["sha256"] or "not recorded"))
        out.append(_part("data-table-end"))
        if any(src["path"] is None for src in sources):
            out.append(_part("data-builtin"))
        if any(src["path"] for src in sources):
            out.append(_part("data-paths"))
    else:
        out.append(_part("data-none"))
    out.append(_part("limits", device=versions.get("device", "an unrecorded device"), torch=versions.get("torch", "?"),
                     python=versions.get("python", "?")))
    return "".join(out)


def _inference_readme(*, run: Path, gen: Generation, n_params: int, shapes: list[tuple[str, list[int]]],
                      model_cfg: dict[str, Any], config: Any, created: str) -> str:
    settings = ", ".join(f"`{k}` = {v}" for k, v in model_cfg.items())
    out = [_part("inference-head", step=gen.step, run_name=run.name, version=__version__, created=created,
                 run_path=run.resolve(), bin=gen.bin.name, bin_sha256=gen.bin_sha256, n_params=f"{n_params:,}",
                 snippet=SAFETENSORS_SNIPPET.rstrip("\n"), settings=settings)]
    out += [_part("shape-row", name=name, shape=shape) for name, shape in shapes]
    out.append(_part("inference-end"))
    return "".join(out)


# ----------------------------------------------------------------------------- rendering


def render_export(report: dict[str, Any], console: Any = None) -> None:
    """A rich summary of an :func:`export_run` (or :func:`verify_export`) report."""
    from rich.markup import escape
    from rich.table import Table

    from ..text import safe_console

    console = console or safe_console()
    ver = report.get("verification", report)
    table = Table(title=f"ripresa export — {report.get('kind', '?')}", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")  # a path or a hash folds onto the next line, whole
    if "run" in report:
        table.add_row("source run", escape(report["run"]))
        src = report.get("source", {})
        table.add_row("step", f"{report['step']} ({src.get('n_params', 0):,} parameters, verified before copy)")
        for s in src.get("skipped", []):
            table.add_row("skipped", escape(f"step {s['step']}: {s['reason']}"))
    else:
        table.add_row("step", str(report.get("step")))
    table.add_row("destination", escape(str(report.get("dest"))))
    n_files = len(report["files"]) + 2 if isinstance(report.get("files"), list) else report.get("files")
    table.add_row("files", f"{n_files} ({_fmt_bytes(int(report.get('bytes', 0)))})")
    table.add_row("hashes", f"{ver.get('hashes_checked')} files re-read and re-hashed against the manifest"
                  + ("" if ver.get("page_cache_dropped") else " (page cache could not be dropped)"))
    r = ver.get("reload", {})
    reload_text = f"{r.get('loaded')} step {r.get('step')}, {r.get('n_params', 0):,} parameters; forward {r.get('forward')}"
    if "probe_loss" in r:
        reload_text += f" (probe loss {r['probe_loss']:.3f})"
    table.add_row("reload", escape(reload_text))
    if "sample" in r:
        table.add_row("sample", escape(repr(r["sample"]["prompt"] + r["sample"]["completion"])))
    if "seconds" in report:
        table.add_row("time", f"{report['seconds']:.2f} s")
    console.print(table)
    for note in report.get("notes", []):
        console.print(f"note: {escape(note)}")
    for name in ver.get("unlisted", []):
        console.print(f"[yellow]warning:[/] {escape(name)} is not in the manifest")
    if report.get("kind") == INFERENCE:
        console.print("[yellow]inference export: weights only — not a resume checkpoint[/]")
    if ver.get("verified"):
        console.print(f"[bold green]OK[/] {escape(str(report.get('dest')))} verified (exit 0)")
    else:  # pragma: no cover - a failed verification raises
        console.print(f"[bold red]FAILED[/] {escape(str(report.get('dest')))}")


def verify_or_uncommit(dest: Path, model_factory: Any, show_progress: bool, expected: Any) -> dict[str, Any]:
    """Verify a just-written bundle; one that does not verify loses its MANIFEST.sha256 (incomplete) and says so."""
    try:
        return verify_export(dest, model_factory=model_factory, show_progress=show_progress,
                             _expected_weights=expected)
    except RipresaError as exc:
        try:
            os.unlink(dest / MANIFEST_SHA)
            fsync_dir(dest)
        except OSError:
            pass
        note = f"the export in {dest} did not verify and is incomplete ({MANIFEST_SHA} removed): delete it and export again"
        exc.hint = f"{exc.hint}; {note}" if exc.hint else note
        raise


def copy_metrics(bundle: _Bundle, run: Path, notes: list[str]) -> list[str]:
    """Copy the run's sidecars and archived phases into ``metrics/``; the bundle paths written."""
    metrics: list[str] = []
    for src, rel in ((".loss.jsonl", "metrics/loss.jsonl"), (".samples.json", "metrics/samples.json"),
                     (".state.json", "metrics/state.json")):
        if os.path.lexists(run / src):  # a link or FIFO in its place is refused, never skipped
            bundle.copy(run / src, rel, what=f"the run's {src}")
            metrics.append(rel)
        elif src == ".loss.jsonl":
            notes.append("the run has no .loss.jsonl: no training history exported")
    for phase, src, name in _archived_files(run):
        rel = f"metrics/archive/{phase}/{name}"
        bundle.copy(run / "archive" / phase / src, rel, what=f"archived {src}")
        metrics.append(rel)
    return metrics


def make_dest(dest: Path) -> bool:
    """Create the (checked) export folder ``dest`` if it is missing, durably; whether it was created here."""
    if os.path.lexists(dest):
        return False
    try:
        dest.mkdir(parents=True)
    except OSError as exc:
        raise BadInput("export destination cannot be created", file=dest, found=str(exc)) from exc
    fsync_dir(dest.parent)
    return True
