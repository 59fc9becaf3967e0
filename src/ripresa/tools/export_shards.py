"""``ripresa export`` of a sharded general generation (``step_NNNNNN.shards/`` + marker).

Called by :func:`ripresa.tools.export.export_run` with the protocol of every export (the kit of
:mod:`ripresa.tools.bundle`): deep-checked before any copy, every file copied hashed against the
marker, ``MANIFEST.sha256`` last, then read back and reloaded. A resume bundle keeps the folder as it
is (``checkpoint/step_NNNNNN.shards/``: Hugging Face's sharded layout, loadable without ripresa); an
inference bundle is one ``model.safetensors``, as for a general generation. docs/FORMAT.md ("Export
bundles"), docs/OPERATIONS.md ("Large states: .shards generations and the tools").
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import IntegrityError
from ..formats.generation import Generation
from ..formats.shards import COMPANION_NAME, INDEX_NAME, SHARDS_NAMES
from ..io.fsio import parse_json_bytes
from ..store.backend import backend_of, latest_valid_of, registered
from ..store.shards import KIND, validate_shards
from ..store.store import CheckpointStore
from .bundle import (
    INFERENCE,
    MANIFEST_JSON,
    RESUME,
    Bundle,
    Verifier,
    as_dict,
    check_dest,
    copy_metrics,
    copy_signature,
    exporter_versions,
    json_bytes,
    make_dest,
    meter,
    now,
    safe_rel,
    size_or_zero,
    source_run,
)
from .export_general import run_config, write_inference
from .models import ModelFactory


def shards_source(run: Path, step: int | None) -> Generation | None:
    """The sharded generation to export, deep-checked, or None when the export is of another kind.

    ``step``: the ``.shards`` generation of that step when the run has one and no ``.bin`` of the same step;
    None: the newest valid generation of the run when it is a ``.shards`` one (a damaged newer one of any kind
    is skipped with a warning).
    """
    if not Path(run).is_dir():
        return None
    store = CheckpointStore(run, writer=False)
    backend = backend_of(KIND, store)
    steps = backend.steps_on_disk()
    if not steps:
        return None
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step not in steps or step in store.steps_on_disk():
            return None
        gen = backend.check(step, deep=True)
        if not gen.valid:
            raise IntegrityError(f".shards generation {step} is damaged or uncommitted: not exported", file=gen.path,
                                 expected="a committed generation whose files match its marker", found=gen.reason,
                                 hint="export another step (`ripresa inspect RUN` shows which are valid)")
        return gen
    newest = latest_valid_of(run, tuple(registered()), deep=True, store=store)
    return newest if newest is not None and newest.kind == KIND else None


def _key(run: Path) -> bytes | None:
    store = CheckpointStore(run, writer=False)
    return store.hmac_key if store.require_signature else None


def export_shards(run: Path, dest: Path, gen: Generation, *, model_factory: ModelFactory | None = None,
                  inference: bool = False, show_progress: bool = True, verify: Verifier) -> dict[str, Any]:
    """Export ``.shards`` generation ``gen`` (deep-checked) of ``run`` into the new folder ``dest``; ``verify``."""
    t0 = time.monotonic()
    run, dest = Path(run), Path(dest)
    check_dest(dest, run)
    assert gen.valid and gen.size is not None and gen.files
    marker_sha = _marker_sha(gen)
    dest_created = make_dest(dest)
    total = 0 if inference else gen.size + sum(size_or_zero(p) for p in (
        gen.marker, run / "config.json", run / ".loss.jsonl", run / ".samples.json", run / ".state.json"))
    with meter(total, f"export step {gen.step}", show_progress) as advance:
        bundle = Bundle(dest, advance)
        try:
            info = (_write_inference if inference else _write_resume)(bundle, run, gen, marker_sha)
            manifest = bundle.commit(INFERENCE if inference else RESUME, gen.step, info["manifest_extra"])
        except BaseException:
            bundle.abort(dest_created)
            raise
    verification = verify(dest, model_factory, show_progress, info.get("tensors"))
    return {
        "kind": manifest["kind"], "run": str(run), "dest": str(dest), "step": gen.step,
        "source": {"format": KIND, "folder": str(gen.path), "marker_sha256": marker_sha, "files_sha256": dict(gen.files),
                   "size": gen.size, "n_params": int(info["n_params"] or verification["reload"].get("n_params") or 0),
                   "verified_before_copy": True, "skipped": []},
        "files": manifest["files"], "bytes": manifest["total_bytes"], "seconds": round(time.monotonic() - t0, 3),
        "verified": bool(verification["verified"]), "verification": verification, "notes": info["notes"],
        "exit_code": 0,
    }


def _marker_sha(gen: Generation) -> str:
    """The sha256 of the generation's marker (it commits to every file of the folder), read as committed."""
    from ..io.fsio import read_small
    from ..store.shards import MAX_MARKER_BYTES

    return hashlib.sha256(read_small(gen.marker, "commit marker", MAX_MARKER_BYTES, error=IntegrityError)).hexdigest()


def _write_resume(bundle: Bundle, run: Path, gen: Generation, marker_sha: str) -> dict[str, Any]:
    notes: list[str] = []
    folder = f"checkpoint/{gen.path.name}"
    raw = None
    for name, sha in sorted(gen.files.items()):
        kept = bundle.copy(gen.path / name, f"{folder}/{name}", what=f"the generation's {name}", expected=sha,
                           keep=name == COMPANION_NAME, error=IntegrityError)
        raw = kept if name == COMPANION_NAME else raw
    rel_sig = copy_signature(bundle, gen, "checkpoint")
    rel_marker = f"checkpoint/{gen.marker.name}"
    bundle.copy(gen.marker, rel_marker, what="the generation's commit marker", expected=marker_sha, error=IntegrityError)
    assert raw is not None
    doc = parse_json_bytes(raw, gen.path / COMPANION_NAME, "the generation's companion", error=IntegrityError)
    state = as_dict(doc.get("state"))
    tensors = as_dict(doc.get("tensors"))
    cfg_bytes, cfg_from = run_config(run, state.get("config"))
    if cfg_bytes is not None:
        bundle.write("config.json", cfg_bytes)
        if cfg_from == "generation":
            notes.append("config.json was taken from the generation's companion (the run has none)")
    else:
        notes.append("no config.json: neither the run nor the generation records one")
    metrics = copy_metrics(bundle, run, notes)
    bundle.write("versions.json", json_bytes({
        "what": "software that wrote this checkpoint and the identity of the training code and data",
        "versions": state.get("versions"), "code": state.get("code"), "data_identity": state.get("data_identity"),
        "exported_with": exporter_versions()}))
    has_lineage = os.path.lexists(run / "lineage.json")
    if has_lineage:
        bundle.copy(run / "lineage.json", "lineage.json", what="the run's lineage.json")
    shards = sorted(n for n in gen.files if n not in (COMPANION_NAME, INDEX_NAME))
    generation = {"format": KIND, "folder": folder, "marker": rel_marker, "signature": rel_sig,
                  "marker_sha256": marker_sha, "files_sha256": dict(gen.files), "size": gen.size,
                  "shards": len(shards), "tensor_count": tensors.get("count")}
    bundle.write("export.json", json_bytes({
        "format": "ripresa.tools.export", "format_version": 1, "kind": RESUME,
        "what": "a resume checkpoint (sharded general format): everything needed to continue the training exactly",
        "created": now(), "exported_with": f"ripresa {__version__}", "source_run": source_run(run),
        "step": gen.step, "progress": as_dict(state.get("progress")), "generation": generation,
        "config_from": cfg_from, "lineage_in_companion": state.get("lineage") or [], "metrics": metrics, "notes": notes,
    }))
    bundle.write("README.md", _README_RESUME.format(
        step=gen.step, d=gen.path.name, mk=gen.marker.name, run=run.resolve(), n=len(shards),
        count=tensors.get("count"), metrics=", ".join(metrics) or "none",
        lineage="lineage.json" if has_lineage else "none").encode())
    return {"manifest_extra": {"generation": generation}, "notes": notes, "n_params": None}


def _write_inference(bundle: Bundle, run: Path, gen: Generation, marker_sha: str) -> dict[str, Any]:
    v = validate_shards(run, gen.step, load=True, key=_key(run), raise_first=True)  # every shard hashed while read
    if dict(v.generation.files) != dict(gen.files):
        raise IntegrityError("the generation changed since it was checked", file=gen.path,
                             expected=dict(gen.files), found=dict(v.generation.files),
                             hint="a live run re-saved this step meanwhile; export again")
    return write_inference(bundle, run, gen, v.state, {
        "format": KIND, "name": gen.path.name, "sha256": marker_sha, "size": gen.size,
        "companion_sha256": gen.files[COMPANION_NAME]})


def reload_resume(dest: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Reload a sharded resume bundle: the kind's full validation of the copied folder (every shard hashed)."""
    gen = as_dict(manifest.get("generation"))
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(gen.get("folder"), str):
        raise IntegrityError(f"{MANIFEST_JSON} does not name the generation", file=dest / MANIFEST_JSON,
                             expected="step and generation.folder", found={"step": step, "generation": gen})
    path = safe_rel(dest, gen["folder"], dest / MANIFEST_JSON)
    if path.name != SHARDS_NAMES.name(step):
        raise IntegrityError("the manifest names another generation folder", file=path,
                             expected=SHARDS_NAMES.name(step), found=path.name)
    v = validate_shards(path.parent, step, load=True, key=_key(path.parent), raise_first=True)
    progress = as_dict(v.state.get("progress"))
    if progress.get("step") != step:
        raise IntegrityError("the exported generation describes another step", file=path, expected=step,
                             found=progress.get("step"))
    model = v.state.get("model")
    n_params = sum(int(t.numel()) for t in model.values() if hasattr(t, "numel")) if isinstance(model, dict) else 0
    return {"loaded": path.name, "step": step, "n_params": n_params, "companion_keys": sorted(v.state),
            "shards": len([n for n in (v.generation.files or {}) if n not in (COMPANION_NAME, INDEX_NAME)]),
            "forward": "skipped: a general run's model is the user's code (load it with Checkpointer.resume)"}


_README_RESUME = """\
# A ripresa resume checkpoint (sharded general format), step {step}

Exported from `{run}` by `ripresa export`. Every file is listed with its size
and sha256 in `MANIFEST.json` and `MANIFEST.sha256` (written last); check them
with `ripresa export --verify DEST` or `sha256sum -c MANIFEST.sha256`.

- `checkpoint/{d}/`: the generation as it was committed, in Hugging Face's
  sharded layout: {n} `model-0000k-of-0000K.safetensors` files ({count} tensors),
  `model.safetensors.index.json` (which shard holds each tensor) and
  `companion.json` (random streams, data position, scheduler, progress,
  versions). The model's tensors are under their `state_dict` names; the
  optimizer's under `optimizer/...` (docs/FORMAT.md, "Sharded general generations").
- `checkpoint/{mk}`: the commit marker (sha256 of every file of the folder).
- `config.json`, `versions.json`, `export.json`; metrics: {metrics}; lineage: {lineage}.

To resume: copy the contents of `checkpoint/` (the folder and its marker)
into an empty run folder and run the same training script on it:
`Checkpointer(RUN, state).resume()` verifies the marker and every shard, then
restores the state exactly.
"""

__all__ = ["export_shards", "reload_resume", "shards_source"]
