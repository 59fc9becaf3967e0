"""``ripresa export`` of a general generation (``step_NNNNNN.safetensors`` + companion + marker).

Called by :func:`ripresa.tools.export.export_run` for a ``Checkpointer``'s
default format, with the same protocol as a ``.bin`` export (the kit of
:mod:`ripresa.tools.bundle`): deep-checked before any copy, every file copied
hashed, ``MANIFEST.sha256`` last, then read back and reloaded. No model is
built (a general run's model is the user's code). Resume bundles, ``--inference``
(tied weights written under each name): docs/FORMAT.md ("Export bundles", "Keys").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..errors import IntegrityError, MissingDependency, SchemaError
from ..formats.generation import Generation
from ..io.fsio import Digest, parse_json_bytes, read_small
from ..store.backend import backend_of, latest_valid_of, registered
from ..store.general import general_paths, validate_general
from ..store.store import CheckpointStore
from .bundle import (
    INFERENCE,
    JSON_MAX,
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
from .export_hf import README as HF_README
from .export_hf import drop_tied, hf_config, transformers_record
from .models import ModelFactory

#: ``source`` of an inference manifest's ``weights`` written from a general generation.
GENERAL = "general"


def general_source(run: Path, step: int | None) -> Generation | None:
    """The general generation to export, deep-checked, or None when the export is of another kind.

    ``step``: the general generation of that step when the run has one and no
    ``.bin`` of the same step; None: the newest valid generation of the run
    when it is a general one (a damaged newer one of any kind is skipped with
    a warning, as for a ``.bin``).
    """
    if not Path(run).is_dir():
        return None
    store = CheckpointStore(run, writer=False)
    general = backend_of("st", store)
    steps = general.steps_on_disk()
    if not steps:
        return None
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step not in steps or step in store.steps_on_disk():
            return None
        gen = general.check(step, deep=True)
        if not gen.valid:
            raise IntegrityError(f"general generation {step} is damaged or uncommitted: not exported", file=gen.path,
                                 expected="a committed generation whose files match its marker", found=gen.reason,
                                 hint="export another step (`ripresa inspect RUN` shows which are valid)")
        return gen
    newest = latest_valid_of(run, tuple(registered()), deep=True, store=store)
    return newest if newest is not None and newest.kind == GENERAL else None


def _loaded_state(run: Path, gen: Generation) -> dict[str, Any]:
    """The generation's state, every tensor read while hashed (and equal to what the deep check saw)."""
    store = CheckpointStore(run, writer=False)
    key = store.hmac_key if store.require_signature else None
    v = validate_general(run, gen.step, load=True, key=key, raise_first=True)
    if dict(v.generation.files) != dict(gen.files):
        raise IntegrityError("the generation changed since it was checked", file=gen.path,
                             expected=dict(gen.files), found=dict(v.generation.files),
                             hint="a live run re-saved this step meanwhile; export again")
    return v.state


def run_config(run: Path, companion_cfg: Any) -> tuple[bytes | None, str]:
    """(config.json bytes or None, where from): the run's ``config.json``, else the generation's config."""
    path = run / "config.json"
    if os.path.lexists(path):
        raw = read_small(path, "the run's config.json", JSON_MAX)  # no link, no FIFO
        parse_json_bytes(raw, path, "the run's config.json")
        return raw, "run"
    if isinstance(companion_cfg, dict) and companion_cfg:
        return json_bytes(companion_cfg), "generation"
    return None, "none"


def export_general(run: Path, dest: Path, gen: Generation, *, model_factory: ModelFactory | None = None, inference: bool = False,
                   show_progress: bool = True, verify: Verifier) -> dict[str, Any]:
    """Export general generation ``gen`` (deep-checked) of ``run`` into the new folder ``dest``; ``verify``; report."""
    t0 = time.monotonic()
    run, dest = Path(run), Path(dest)
    check_dest(dest, run)
    f, c, mk = general_paths(run, gen.step)
    f_sha, c_sha = gen.files.get(f.name), gen.files.get(c.name)
    assert gen.valid and gen.size is not None and f_sha is not None and c_sha is not None
    dest_created = make_dest(dest)
    total = 0 if inference else sum(size_or_zero(p) for p in (
        f, c, mk, run / "config.json", run / ".loss.jsonl", run / ".samples.json", run / ".state.json"))
    with meter(total, f"export step {gen.step}", show_progress) as advance:
        bundle = Bundle(dest, advance)
        try:
            info = (_write_inference if inference else _write_resume)(bundle, run, gen, f_sha, c_sha)
            manifest = bundle.commit(INFERENCE if inference else RESUME, gen.step, info["manifest_extra"])
        except BaseException:
            bundle.abort(dest_created)
            raise
    verification = verify(dest, model_factory, show_progress, info.get("tensors"))
    return {
        "kind": manifest["kind"], "run": str(run), "dest": str(dest), "step": gen.step,
        "source": {"format": GENERAL, "tensors": str(f), "tensors_sha256": f_sha, "tensors_size": gen.size,
                   "companion_sha256": c_sha, "n_params": int(info["n_params"] or verification["reload"].get("n_params") or 0),
                   "verified_before_copy": True,
                   "skipped": []},
        "files": manifest["files"], "bytes": manifest["total_bytes"], "seconds": round(time.monotonic() - t0, 3),
        "verified": bool(verification["verified"]), "verification": verification, "notes": info["notes"],
        "exit_code": 0,
    }


def _model_params(state: dict[str, Any]) -> int:
    model = state.get("model")
    return sum(int(t.numel()) for t in model.values() if isinstance(t, torch.Tensor)) if isinstance(model, dict) else 0


def _write_resume(bundle: Bundle, run: Path, gen: Generation, f_sha: str, c_sha: str) -> dict[str, Any]:
    notes: list[str] = []
    f, c, mk = general_paths(run, gen.step)
    rel = {"tensors": f"checkpoint/{f.name}", "companion": f"checkpoint/{c.name}", "marker": f"checkpoint/{mk.name}"}
    assert gen.size is not None
    bundle.copy(f, rel["tensors"], what="the generation's tensor file", expected=Digest(f_sha, gen.size),
                error=IntegrityError)
    raw = bundle.copy(c, rel["companion"], what="the generation's companion", expected=c_sha, keep=True,
                      error=IntegrityError)
    rel_sig = copy_signature(bundle, gen, "checkpoint")
    bundle.copy(mk, rel["marker"], what="the generation's commit marker", error=IntegrityError)
    assert raw is not None
    doc = parse_json_bytes(raw, c, "the generation's companion", error=IntegrityError)
    state = as_dict(doc.get("state")) if isinstance(doc, dict) else {}
    count = as_dict(doc.get("tensors")).get("count") if isinstance(doc, dict) else None
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
    generation = {"format": GENERAL, **rel, "signature": rel_sig, "tensors_sha256": f_sha, "tensors_size": gen.size,
                  "companion_sha256": c_sha, "tensor_count": count}
    provenance = {
        "format": "ripresa.tools.export", "format_version": 1, "kind": RESUME,
        "what": "a resume checkpoint (general format): everything needed to continue the training exactly",
        "created": now(), "exported_with": f"ripresa {__version__}", "source_run": source_run(run),
        "step": gen.step, "progress": as_dict(state.get("progress")), "generation": generation,
        "config_from": cfg_from, "lineage_in_companion": state.get("lineage") or [], "metrics": metrics, "notes": notes,
    }
    bundle.write("export.json", json_bytes(provenance))
    bundle.write("README.md", _README_RESUME.format(step=gen.step, f=f.name, c=c.name, mk=mk.name, run=run.resolve(),
                                                    count=count, metrics=", ".join(metrics) or "none",
                                                    lineage="lineage.json" if has_lineage else "none").encode())
    return {"manifest_extra": {"generation": generation}, "notes": notes, "n_params": None}


def _write_inference(bundle: Bundle, run: Path, gen: Generation, f_sha: str, c_sha: str) -> dict[str, Any]:
    return write_inference(bundle, run, gen, _loaded_state(run, gen), {
        "format": GENERAL, "name": gen.path.name, "sha256": f_sha, "size": gen.size, "companion_sha256": c_sha})


def write_inference(bundle: Bundle, run: Path, gen: Generation, state: dict[str, Any],
                    source: dict[str, Any]) -> dict[str, Any]:
    """The inference bundle of a loaded general state (also a sharded one's): ``model.safetensors`` under the
    ``state_dict`` names, config, provenance, README. ``source``: format, name, sha256, size, companion_sha256
    of the generation (recorded in the file's metadata and ``export.json``)."""
    try:
        from safetensors.torch import save as st_save
    except ImportError as exc:  # pragma: no cover - safetensors is a dependency
        raise MissingDependency("an inference export needs safetensors", expected="pip install safetensors",
                                found="not installed") from exc
    f_sha = source["sha256"]
    model = state.get("model")
    if not isinstance(model, dict) or not model or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                           for k, t in model.items()):
        raise SchemaError("the generation holds no model state_dict", file=gen.path,
                          expected="tensors under model/<name> (docs/FORMAT.md, Keys)",
                          found=type(model).__name__ if not isinstance(model, dict) else f"{len(model)} entries")
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, t in model.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:  # a tied weight: its own copy, so load_state_dict(strict=True) works
            tied[name] = seen[ptr]
            tensors[name] = t.detach().clone().contiguous()
        else:
            if ptr is not None:
                seen[ptr] = name
            tensors[name] = t.detach().contiguous()
    hf = transformers_record(state.get("config"), gen.path)  # a transformers model: a from_pretrained folder
    if hf is not None:
        tensors = drop_tied(tensors, tied)
    n_params = sum(int(t.numel()) for t in tensors.values())
    metadata = {"format": "pt" if hf is not None else "ripresa.inference", "step": str(gen.step),
                "source": source["format"], "source_sha256": f_sha, "ripresa": __version__, "tensors": str(len(tensors)),
                "tied": json.dumps(tied, sort_keys=True)}
    try:
        data = st_save(tensors, metadata=metadata)
    except Exception as exc:  # safetensors' own errors (a dtype it cannot name)
        raise SchemaError("the model's tensors cannot be written as safetensors", file=gen.path,
                          found=f"{type(exc).__name__}: {exc}"[:200]) from exc
    bundle.write("model.safetensors", data)
    cfg_bytes, cfg_from = run_config(run, state.get("config"))
    if hf is not None:
        cfg_bytes, cfg_from = json_bytes(hf_config(hf)), "transformers"
    if cfg_bytes is not None:
        bundle.write("config.json", cfg_bytes)
    provenance = {
        "format": "ripresa.tools.export", "format_version": 1, "kind": INFERENCE,
        "what": "an inference export: the model's tensors only. NOT a resume checkpoint (no optimizer state, "
                "random generator states, data position or LR schedule)",
        "created": now(), "exported_with": f"ripresa {__version__}", "source_run": source_run(run),
        "step": gen.step, "progress": as_dict(state.get("progress")),
        "source": dict(source),
        "tied": tied, "config_from": cfg_from, "data_identity": state.get("data_identity"),
        "versions": state.get("versions"), "code": state.get("code"),
        **({"transformers": {"model_class": hf["model_class"], "tied_written_once": tied}} if hf is not None else {}),
    }
    bundle.write("export.json", json_bytes(provenance))
    if hf is not None:
        bundle.write("README.md", HF_README.format(cls=hf["model_class"], step=gen.step, run=run.resolve(),
                                                   n=len(tensors), tied=tied or "none").encode())
    shapes = "\n".join(f"    {k}: {str(t.dtype).removeprefix('torch.')} {list(t.shape)}" for k, t in list(tensors.items())[:40])
    if hf is None:
        bundle.write("README.md", _README_INFERENCE.format(step=gen.step, name=gen.path.name, run=run.resolve(),
                                                           n=len(tensors), n_params=f"{n_params:,}", shapes=shapes).encode())
    extra = {"weights": {"file": "model.safetensors", "source": source["format"], "source_sha256": f_sha,
                         "n_params": n_params}}
    return {"manifest_extra": extra, "notes": [], "tensors": tensors, "n_params": n_params}


# ----------------------------------------------------------------------------- verification (from verify_export)


def reload_resume(dest: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Reload a general resume bundle: the format's full validation of the copied generation."""
    gen = as_dict(manifest.get("generation"))
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(gen.get("tensors"), str):
        raise IntegrityError(f"{MANIFEST_JSON} does not name the generation", file=dest / MANIFEST_JSON,
                             expected="step and generation.tensors", found={"step": step, "generation": gen})
    path = safe_rel(dest, gen["tensors"], dest / MANIFEST_JSON)
    if path.name != general_paths(path.parent, step)[0].name:
        raise IntegrityError("the manifest names another generation file", file=path,
                             expected=general_paths(path.parent, step)[0].name, found=path.name)
    store = CheckpointStore(path.parent, writer=False)  # a required signature (RIPRESA_REQUIRE_SIGNATURE) is checked
    key = store.hmac_key if store.require_signature else None
    v = validate_general(path.parent, step, load=True, key=key, raise_first=True)  # every tensor hashed, state resolved
    progress = as_dict(v.state.get("progress"))
    if progress.get("step") != step:
        raise IntegrityError("the exported generation describes another step", file=path, expected=step,
                             found=progress.get("step"))
    return {"loaded": path.name, "step": step, "n_params": _model_params(v.state), "companion_keys": sorted(v.state),
        "forward": "skipped: a general run's model is the user's code (load it with Checkpointer.resume)"}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (bitwise comparison: NaN payloads and -0.0 count)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def reload_inference(dest: Path, manifest: dict[str, Any], expected: Any, source: str = GENERAL) -> dict[str, Any]:
    """Reload a general (or ``source``) inference export: safetensors' own loader, the step, bitwise equal to the
    source."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = dest / "model.safetensors"
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        raise IntegrityError("model.safetensors does not load", file=path, expected="a safetensors file",
                             found=f"{type(exc).__name__}: {exc}"[:200]) from exc
    step = manifest.get("step")
    if meta.get("step") != str(step) or meta.get("source") != source:
        raise IntegrityError("model.safetensors' metadata names another step or source", file=path,
                             expected={"step": str(step), "source": source},
                             found={"step": meta.get("step"), "source": meta.get("source")})
    if isinstance(expected, dict):
        same = set(expected) == set(tensors) and all(
            tensors[k].dtype == v.dtype and tensors[k].shape == v.shape and torch.equal(_bytes(tensors[k]), _bytes(v))
            for k, v in expected.items())
        if not same:
            raise IntegrityError("the reloaded tensors differ from the source generation", file=path,
                                 expected="bit-identical tensors under the same names", found="a difference")
    return {"loaded": path.name, "step": step, "tensors": len(tensors),
            "n_params": sum(int(v.numel()) for v in tensors.values()), "metadata": meta,
            "bit_identical_to_source": True if isinstance(expected, dict) else None,
            "forward": "skipped: a general run's model is the user's code "
                       "(model.load_state_dict(safetensors.torch.load_file('model.safetensors')))"}


_README_RESUME = """\
# A ripresa resume checkpoint (general format), step {step}

Exported from `{run}` by `ripresa export`. Every file is listed with its size
and sha256 in `MANIFEST.json` and `MANIFEST.sha256` (written last); check them
with `ripresa export --verify DEST` or `sha256sum -c MANIFEST.sha256`.

- `checkpoint/{f}`: every tensor of the training state ({count} tensors), a
  plain safetensors file: `safetensors.safe_open(path, "pt")` reads it without
  ripresa. Keys are paths in the state: `model/<state_dict name>`,
  `optimizer/state/<param index>/<name>`, `rng/torch_cpu`, ... (docs/FORMAT.md, "Keys").
- `checkpoint/{c}`: the companion, everything else (random streams, data
  position, scheduler, progress, versions), each tensor a reference to its key.
- `checkpoint/{mk}`: the commit marker (sha256 of both files).
- `config.json`, `versions.json`, `export.json`; metrics: {metrics}; lineage: {lineage}.

To resume: copy the files of `checkpoint/` into an empty run folder and run
the same training script on it: `Checkpointer(RUN, state).resume()` verifies
the marker and every hash, then restores the state exactly.
"""

_README_INFERENCE = """\
# A ripresa inference export, step {step}

The model's tensors of generation `{name}` of `{run}`: {n} tensors,
{n_params} values, in `model.safetensors` under their `state_dict` names (tied
weights are written once under each name). NOT a resume checkpoint: no
optimizer state, random streams or data position.

```python
from safetensors.torch import load_file
model.load_state_dict(load_file("model.safetensors"))  # strict: every name and shape must match
```

Tensors (first 40):
{shapes}
"""
