"""``ripresa export`` of a ``.bin`` generation (the GPT of ``ripresa train``): resume bundle or inference export.

Called by :func:`ripresa.tools.export.export_run`; the bundle kit is
:mod:`ripresa.tools.bundle`. The generation is verified before anything is
copied; the export is read back and reloaded into the model built from its
``config.json``. Layout and protocol: docs/FORMAT.md ("Export bundles").
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..console import MAX_LISTED
from ..errors import BadInput, IntegrityError, MissingDependency, SchemaError
from ..formats.andrea_bin import BYTES_PER_PARAM, HEADER_SIZE, bin_name, read_bin
from ..io.fsio import Digest, open_run_file, parse_json_bytes, read_small
from ..store.store import CheckpointStore, CheckpointWarning, Generation, not_used
from .bundle import (
    COMPANION_MAX,
    EXPORT_FORMAT,
    EXPORT_FORMAT_VERSION,
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
    load_json,
    make_dest,
    meter,
    now,
    safe_rel,
    size_or_zero,
    source_run,
)
from .export_readme import inference_readme, resume_readme
from .models import ModelFactory

#: Prompt of the forward pass / generation that proves a reload.
PROBE_TEXT = b"def main():\n    print('hello')\n"
PROBE_PROMPT = b"The "


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
        if len(skipped) <= MAX_LISTED:  # the rest are counted in the export's report (docs/INSPECT.md, "Long lists")
            warnings.warn(not_used("generation", s, gen.reason, gen.bin, then="an older one is exported"),
                          CheckpointWarning, stacklevel=3)
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
        return json_bytes(companion_cfg), companion_cfg, "generation"
    if run_cfg is not None and _model_section(run_cfg) is not None:
        raise SchemaError("config.json's model does not match the .bin", file=run_cfg_path,
                          expected=f"a model of {n_params} parameters", found="another shape",
                          hint="the run's config.json was changed after this generation was saved")
    if run_cfg is not None:
        return run_raw, run_cfg, "run"
    if isinstance(companion_cfg, dict) and companion_cfg:
        return json_bytes(companion_cfg), companion_cfg, "generation"
    return None, None, "none"


def export_bin(run: Path, dest: Path, *, model_factory: ModelFactory, step: int | None = None, inference: bool = False,
                show_progress: bool = True, store: CheckpointStore | None = None, verify: Verifier) -> dict[str, Any]:
    """Export one generation of ``run`` to the new folder ``dest``; verify it there (``verify``); return a report.

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
    check_dest(dest, run)
    gen, skipped = _select_generation(store, step)
    assert gen.size is not None and gen.bin_sha256 is not None and gen.companion_sha256 is not None
    n_params = (gen.size - HEADER_SIZE) // BYTES_PER_PARAM
    dest_created = make_dest(dest)
    total = 0 if inference else sum(size_or_zero(p) for p in (
        gen.bin, gen.companion, gen.marker, run / "config.json", run / ".loss.jsonl", run / ".samples.json", run / ".state.json"))
    with meter(total, f"export step {gen.step}", show_progress) as advance:
        bundle = Bundle(dest, advance)
        try:
            if inference:
                info = _write_inference(bundle, run, gen, n_params, model_factory)
            else:
                info = _write_resume(bundle, run, gen, n_params, model_factory)
            manifest = bundle.commit(INFERENCE if inference else RESUME, gen.step, info["manifest_extra"])
        except BaseException:
            bundle.abort(dest_created)
            raise
    verification = verify(dest, model_factory, show_progress, info.get("weights"))
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


def _write_resume(bundle: Bundle, run: Path, gen: Generation, n_params: int, model_factory: ModelFactory) -> dict[str, Any]:
    notes: list[str] = []
    rel_bin = f"checkpoint/{gen.bin.name}"
    rel_comp = f"checkpoint/{gen.companion.name}"
    rel_marker = f"checkpoint/{gen.marker.name}"
    assert gen.bin_sha256 and gen.companion_sha256 and gen.size is not None
    bundle.copy(gen.bin, rel_bin, what="the generation's .bin", expected=Digest(gen.bin_sha256, gen.size),
                error=IntegrityError)
    raw_comp = bundle.copy(gen.companion, rel_comp, what="the generation's companion", expected=gen.companion_sha256,
                           keep=True, error=IntegrityError)
    rel_sig = copy_signature(bundle, gen, "checkpoint")
    bundle.copy(gen.marker, rel_marker, what="the generation's commit marker", error=IntegrityError)
    assert raw_comp is not None
    doc = parse_json_bytes(raw_comp, gen.companion, "the generation's companion", error=IntegrityError)
    state = as_dict(doc.get("state")) if isinstance(doc, dict) else {}

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
        bundle.write("parameters.json", json_bytes({
            "what": "the parameters of the model, in model.parameters() order: each is a slice "
                    "[offset, offset + numel) of the weights region (and of m and v) of the .bin",
            "dtype": "float32, little-endian", "n_params": n_params, "parameters": params}))

    metrics = copy_metrics(bundle, run, notes)

    identity = as_dict(state.get("data_identity"))
    sources = _model_sources(state.get("config"), config)
    bundle.write("data.json", json_bytes({
        "what": "the data this checkpoint was trained on: each source and the sha256 of the bytes it served "
                "(a resume refuses different bytes unless --allow-data-change)",
        "data_identity": identity,
        "sources": [_parse_source(s, identity) for s in sources],
    }))
    bundle.write("versions.json", json_bytes({
        "what": "software that wrote this checkpoint (a resume compares python, torch, numpy, ripresa) "
                "and the identity of the training code",
        "versions": state.get("versions"), "code": state.get("code"), "exported_with": exporter_versions(),
    }))
    has_lineage = os.path.lexists(run / "lineage.json")
    if has_lineage:
        bundle.copy(run / "lineage.json", "lineage.json", what="the run's lineage.json")
    progress = as_dict(state.get("progress"))
    provenance = {
        "format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "kind": RESUME,
        "what": "a resume checkpoint: everything needed to continue the training exactly",
        "created": now(), "exported_with": f"ripresa {__version__}",
        "source_run": source_run(run), "step": gen.step, "progress": progress,
        "generation": {"bin": rel_bin, "companion": rel_comp, "marker": rel_marker, "signature": rel_sig,
                       "bin_sha256": gen.bin_sha256, "bin_size": gen.size, "companion_sha256": gen.companion_sha256,
                       "n_params": n_params},
        "config_from": cfg_from, "lineage_in_companion": state.get("lineage") or [],
        "metrics": metrics, "notes": notes,
    }
    bundle.write("export.json", json_bytes(provenance))
    readme = resume_readme(run=run, gen=gen, n_params=n_params, progress=progress, params=params,
                            metrics=metrics, has_lineage=has_lineage, config=config, state=state,
                            sources=[_parse_source(s, identity) for s in sources], created=provenance["created"])
    bundle.write("README.md", readme.encode())
    extra = {"generation": provenance["generation"]}
    return {"manifest_extra": extra, "notes": notes}


def _model_sources(gen_cfg: Any, run_cfg: Any) -> list[str]:
    for cfg in (gen_cfg, run_cfg):
        if isinstance(cfg, dict) and isinstance(cfg.get("data"), dict) and isinstance(cfg["data"].get("sources"), list):
            return [str(s) for s in cfg["data"]["sources"]]
    return []


def _write_inference(bundle: Bundle, run: Path, gen: Generation, n_params: int, model_factory: ModelFactory) -> dict[str, Any]:
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
    state = as_dict(doc.get("state")) if isinstance(doc, dict) else {}
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
    progress = as_dict(state.get("progress"))
    provenance = {
        "format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "kind": INFERENCE,
        "what": "an inference export: model weights only. NOT a resume checkpoint (no optimizer moments, "
                "random generator states, data position or LR schedule)",
        "created": now(), "exported_with": f"ripresa {__version__}",
        "source_run": source_run(run), "step": gen.step, "progress": progress,
        "source_bin": {"name": gen.bin.name, "sha256": gen.bin_sha256, "size": gen.size, "n_params": n_params},
        "config_from": cfg_from, "data_identity": state.get("data_identity"),
        "versions": state.get("versions"), "code": state.get("code"),
    }
    bundle.write("export.json", json_bytes(provenance))
    shapes = [(k, list(v.shape)) for k, v in tensors.items()]
    bundle.write("README.md", inference_readme(run=run, gen=gen, n_params=n_params, shapes=shapes,
                                                model_cfg=model_cfg, config=config,
                                                created=provenance["created"]).encode())
    extra = {"weights": {"file": "model.safetensors", "source_bin_sha256": gen.bin_sha256, "n_params": n_params}}
    return {"manifest_extra": extra, "notes": notes, "weights": contents.weights}


def reload_resume(dest: Path, manifest: dict[str, Any], model_factory: ModelFactory) -> dict[str, Any]:
    """Reload a ``.bin`` resume bundle: the store's full load, then one forward pass of the model of its config."""
    gen = as_dict(manifest.get("generation"))
    step = manifest.get("step")
    if not isinstance(step, int) or not isinstance(gen.get("bin"), str):
        raise IntegrityError(f"{MANIFEST_JSON} does not name the generation", file=dest / MANIFEST_JSON,
                             expected="step and generation.bin", found={"step": step, "generation": gen})
    bin_path = safe_rel(dest, gen["bin"], dest / MANIFEST_JSON)
    store = CheckpointStore(bin_path.parent, writer=False)
    contents, state = store.load(step, check_finite=True)
    progress = as_dict(state.get("progress"))
    if progress.get("step") != step or contents.step != step:
        raise IntegrityError("the exported generation describes another step", file=bin_path,
                             expected=step, found={"bin": contents.step, "companion": progress.get("step")})
    out: dict[str, Any] = {"loaded": bin_path.name, "step": contents.step, "n_params": contents.n_params,
                           "companion_keys": sorted(state)}
    cfg_path = dest / "config.json"
    cfg = load_json(cfg_path, "config.json", IntegrityError) if os.path.lexists(cfg_path) else None
    model_cfg = _model_section(cfg)
    check = getattr(model_factory, "check_resume_state", None)
    if check is not None and isinstance(cfg, dict):
        check(cfg, state, store.folder / f"{bin_path.stem}.json")  # what a resume of it would refuse, refused here
    if model_cfg is None:
        out["forward"] = "skipped: no config.json with a 'model' section (not a ripresa GPT run)"
        return out
    model = _build_model(model_factory, model_cfg, cfg_path, contents.n_params)
    _load_weights(model, contents.weights, bin_path)
    out.update(_probe_forward(model, bin_path))
    return out


def reload_inference(dest: Path, manifest: dict[str, Any], expected_weights: Any,
                      model_factory: ModelFactory) -> dict[str, Any]:
    """Reload a ``.bin`` inference export: safetensors' own loader into the model of its config, then a generation."""
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
    model_cfg = _model_section(load_json(cfg_path, "config.json", IntegrityError))
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
