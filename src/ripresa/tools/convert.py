"""``ripresa convert SRC DEST``: one checkpoint, another format, verified bit for bit.

The format of each side is chosen by its name (a ``.dcp``, ``.bin``, general or
``.shards`` generation, a plain ``.bin``, a ``checkpoint.pt``, a weights-only
``.safetensors``); missing state is never invented. The conversion goes through
a live model and AdamW on the CPU, then the destination is read back and
compared with the source bitwise. Formats, what each holds, hostile sources and
signatures: docs/FORMAT.md ("Conversions").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.numbers import checked_number
from ..core.state import BIN_MOMENTS
from ..errors import (
    BadInput,
    CheckFailed,
    IntegrityError,
    MissingDependency,
    OutputExists,
    RipresaError,
    SchemaError,
)
from ..formats import dcp as dcp_fmt
from ..formats.andrea_bin import BIN_LACKS, parse_bin_name, read_bin, save_bin
from ..formats.bin_state import flatten_model_and_adamw, load_into_model_and_adamw
from ..io import auth
from ..io.fsio import StagedFile, fsync_dir, parse_json_bytes, read_sidecar, write_sidecar
from ..store.retention import KeepLast
from ..verify.compare import first_difference
from .models import ModelFactory

KINDS = ("dcp", "bin", "general", "shards", "plain-bin", "pt", "safetensors")
#: What each kind holds: "full" (a complete resume point), "moments" (weights, m, v, step), "weights".
HOLDS = {"dcp": "full", "bin": "full", "general": "full", "shards": "full", "pt": "full", "plain-bin": "moments",
         "safetensors": "weights"}
_RANK = {"weights": 0, "moments": 1, "full": 2}


@dataclass
class Loaded:
    """A checkpoint in memory: a live GPT (and AdamW), plus everything else it holds."""

    kind: str
    path: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    rest: dict[str, Any] | None  # the snapshot without model and optimizer (None: not held)
    step: int
    config: dict[str, Any] | None


def kind_of(path: Path, *, as_dest: bool = False) -> str:
    """The format of ``path`` from its name (and, for a source, its companion)."""
    name = path.name
    if name.endswith(".dcp") or (not as_dest and path.is_dir() and (path / ".metadata").is_file()):
        return "dcp"
    if name.endswith(".shards"):
        return "shards"
    if name.endswith(".bin"):
        if parse_bin_name(name) is None:
            return "plain-bin"
        if as_dest:
            return "bin"
        return "bin" if path.with_suffix(".json").exists() else "plain-bin"
    if name.endswith(".pt"):
        return "pt"
    if name.endswith(".safetensors"):
        from ..store.general import parse_general_name

        # step_NNNNNN.safetensors is a general generation (docs/FORMAT.md) when it is a destination or has its
        # companion; any other NAME.safetensors holds weights only.
        if parse_general_name(name) is not None and (as_dest or path.with_name(name + ".json").exists()):
            return "general"
        return "safetensors"
    raise BadInput("unknown checkpoint format", file=path,
                   expected="step_NNNNNN.dcp, step_NNNNNN.shards, step_NNNNNN.bin, step_NNNNNN.safetensors, NAME.bin, "
                            "NAME.pt or NAME.safetensors", found=name)


# ---- building the live objects -------------------------------------------------------------


def _model_config(config: dict[str, Any] | None, override: str | dict[str, Any] | None, path: Path,
                  factory: ModelFactory) -> dict[str, Any]:
    if isinstance(override, str):
        return factory.config(override)
    if isinstance(config, Mapping) and isinstance(config.get("model"), Mapping):
        return dict(config)
    if isinstance(override, dict):
        return override
    raise BadInput("this checkpoint does not say which model it holds", file=path,
                   expected="a companion/config with a 'model' section (an ANDREA GPT)",
                   hint="pass --config tiny | andrea-12m | andrea-120m | FILE.toml")



class _Shim:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer


def _split(full: Mapping[str, Any]) -> dict[str, Any]:
    """Everything but model and optimizer (those live in the model and AdamW, buffers included)."""
    rest = dict(full)
    rest["model"] = {}
    rest["optimizer"] = None
    return rest


# ---- reading ---------------------------------------------------------------------------------


def load(path: str | Path, *, model_factory: ModelFactory, config: str | dict[str, Any] | None = None,
         _written_here: bool = False) -> Loaded:
    """Read and verify a checkpoint of any supported kind into a live model (+ AdamW) of ``model_factory``.

    ``config`` names the model (``tiny``, a TOML file) and wins over the
    checkpoint's own; a resolved config dict is used only when the checkpoint
    has none (reading back a plain ``.bin`` written from a complete source).
    """
    src = Path(path)
    if not src.exists():
        raise BadInput("source not found", file=src, expected="an existing checkpoint", found="nothing")
    kind = kind_of(src)
    # Under require-signature only signed generations are sources; a destination this
    # command just wrote is read back to compare it, whatever its kind.
    require = auth.require_signature_from_env() and not _written_here
    if require and kind in _UNSIGNED:
        raise auth.unsigned_error(_UNSIGNED[kind], src, "this format carries no HMAC signature")
    return _LOADERS[kind](src, kind, require, config, model_factory)


def _load_bin(src: Path, kind: str, require: bool, config: str | dict[str, Any] | None, model_factory: ModelFactory) -> Loaded:
    """A ``.bin`` generation: its store's check and load, joined with its companion."""
    from ..formats.bin_state import join_state
    from ..store.store import CheckpointStore

    step = parse_bin_name(src.name)
    assert step is not None
    store = CheckpointStore(src.parent, writer=False, require_signature=require or None)
    gen = store.check(step)
    if not gen.valid:
        raise CheckFailed(f"the source generation is not valid: {gen.reason}", file=src)
    from ..formats import companion as companion_fmt
    from ..io.fsio import read_json_small

    doc = read_json_small(src.with_suffix(".json"), "companion", companion_fmt.MAX_COMPANION_BYTES, error=IntegrityError)
    saved = doc.get("state") if isinstance(doc, dict) else None
    cfg = _model_config(saved.get("config") if isinstance(saved, dict) else None, config, src, model_factory)
    rec = doc.get("bin") if isinstance(doc, dict) else None
    n_bin = rec.get("n_params") if isinstance(rec, dict) else None
    model, opt = _build_sized(model_factory, cfg, src, n_bin if type(n_bin) is int else None, exact=True)
    contents, comp = store.load(step, expected_n=sum(p.numel() for p in model.parameters()))
    full = join_state(_Shim(model, opt), contents, comp)  # type: ignore[arg-type]
    model.load_state_dict(full["model"], strict=True)
    opt.load_state_dict(full["optimizer"])
    return Loaded(kind, src, model, opt, _split(full), step, cfg)


def _load_general(src: Path, kind: str, require: bool, config: str | dict[str, Any] | None, model_factory: ModelFactory) -> Loaded:
    """A general generation: the format's full validation (every tensor hashed), loaded."""
    from ..store.general import parse_general_name, validate_general

    step = parse_general_name(src.name)
    assert step is not None
    key = auth.load_key() if require else None
    if require and key is None:
        raise auth.missing_key_error("require_signature (RIPRESA_REQUIRE_SIGNATURE)")
    try:
        v = validate_general(src.parent, step, load=True, key=key, raise_first=True)
    except IntegrityError as exc:
        raise CheckFailed(f"the source generation is not valid: {exc.message}", file=src, found=exc.found) from exc
    return _loaded_general(src, kind, v.state, step, config, model_factory)


def _load_shards(src: Path, kind: str, require: bool, config: str | dict[str, Any] | None, model_factory: ModelFactory) -> Loaded:
    """A sharded general generation (``step_NNNNNN.shards``): the kind's full validation (every shard hashed), loaded."""
    from ..formats.shards import SHARDS_NAMES
    from ..store.shards import validate_shards

    step = SHARDS_NAMES.parse(src.name)
    if step is None:
        raise BadInput("a .shards source must be named step_NNNNNN.shards", file=src, expected="step_NNNNNN.shards",
                       found=src.name)
    key = auth.load_key() if require else None
    if require and key is None:
        raise auth.missing_key_error("require_signature (RIPRESA_REQUIRE_SIGNATURE)")
    try:
        v = validate_shards(src.parent, step, load=True, key=key, raise_first=True)
    except IntegrityError as exc:
        raise CheckFailed(f"the source generation is not valid: {exc.message}", file=exc.file or src,
                          expected=exc.expected, found=exc.found) from exc
    return _loaded_general(src, kind, v.state, step, config, model_factory)


def _loaded_general(src: Path, kind: str, saved: dict[str, Any], step: int, config: str | dict[str, Any] | None,
                    model_factory: ModelFactory) -> Loaded:
    """A general (or sharded) generation's validated state in a live model and AdamW."""
    cfg = _model_config(saved.get("config"), config, src, model_factory)
    model, opt = _build_sized(model_factory, cfg, src, _numel(saved.get("model")))
    model.load_state_dict(saved["model"], strict=True)
    if saved.get("optimizer") is None:
        raise SchemaError("the generation has no optimizer state", file=src, hint="ripresa convert needs the optimizer")
    opt.load_state_dict(saved["optimizer"])
    return Loaded(kind, src, model, opt, _split(saved), step, cfg)


def _load_pt(src: Path, kind: str, require: bool, config: str | dict[str, Any] | None, model_factory: ModelFactory) -> Loaded:
    """A ``checkpoint.pt``: the restricted loader, verified against its sidecar."""
    from ..formats.torch_pt import load_checkpoint

    ck = load_checkpoint(src, require_signature=require)
    cfg = _model_config(ck.state.get("config"), config, src, model_factory)
    model, opt = _build_sized(model_factory, cfg, src, _numel(ck.state.get("model")))
    model.load_state_dict(ck.state["model"], strict=True)
    if ck.state.get("optimizer") is None:
        raise SchemaError("the checkpoint.pt has no optimizer state", file=src, hint="ripresa convert needs AdamW's m and v")
    opt.load_state_dict(ck.state["optimizer"])
    return Loaded(kind, src, model, opt, _split(ck.state), ck.step, cfg)


def _load_dcp(src: Path, kind: str, require: bool, config: str | dict[str, Any] | None, model_factory: ModelFactory) -> Loaded:
    """A ``.dcp`` generation: deep-checked, its verified shards loaded in one process."""
    step = dcp_fmt.parse_dcp_name(src.name)
    if step is None:
        raise BadInput("a .dcp source must be named step_NNNNNN.dcp", file=src, found=src.name)
    gen = dcp_fmt.check_dcp(src.parent, step, deep=True, require_signature=require)
    if not gen.valid:
        raise CheckFailed(f"the source .dcp generation is not valid: {gen.reason}", file=src)
    doc = dcp_fmt.read_dcp_companion(src, gen.files[dcp_fmt.COMPANION_NAME])
    rest = dcp_fmt.decode_state(doc, src)
    cfg = _model_config(rest.get("config"), config, src, model_factory)
    model, opt = model_factory.build(cfg)
    dcp_fmt.load_shards(model, opt, src, files=gen.files, sizes=doc["files"], no_dist=True)  # the bytes verified
    return Loaded(kind, src, model, opt, rest, step, cfg)


def _load_plain_bin(src: Path, kind: str, require: bool, config: str | dict[str, Any] | None, model_factory: ModelFactory) -> Loaded:
    """A plain ``.bin`` (no companion): weights, m and v."""
    # with a sidecar, the bytes loaded are the bytes hashed (one read), never a second open of the path
    expected = read_sidecar(src) if os.path.lexists(src.parent / (src.name + ".sha256")) else None
    cfg = _model_config(None, config, src, model_factory)
    size = src.stat().st_size  # a size hint only: read_bin opens and checks the file itself
    model, opt = _build_sized(model_factory, cfg, src, (size - 8) // 12 if size >= 8 and (size - 8) % 12 == 0 else None,
                              exact=True)
    contents = read_bin(src, expected_n=sum(p.numel() for p in model.parameters()), expected_sha256=expected)
    load_into_model_and_adamw(contents, model, opt)
    return Loaded(kind, src, model, opt, None, contents.step, cfg)


def _load_safetensors(src: Path, kind: str, require: bool, config: str | dict[str, Any] | None, model_factory: ModelFactory) -> Loaded:
    """A weights-only ``.safetensors``."""
    meta, tensors = _read_weights_safetensors(src)
    saved_cfg = parse_json_bytes(meta["config"].encode(), src, "safetensors config") if "config" in meta else None
    cfg = _model_config(saved_cfg, config, src, model_factory)
    model, _ = _build_sized(model_factory, cfg, src, _numel(tensors))
    model.load_state_dict(tensors, strict=True)
    return Loaded(kind, src, model, None, None, checked_number(meta.get("step", "0"), file=src, field="__metadata__.step", lo=0, hi=2**63 - 1,
                                                                             text=True), cfg)


#: The formats that carry no signature (refused as sources under require-signature), as messages name them.
_UNSIGNED = {"plain-bin": "a plain .bin", "safetensors": "a .safetensors", "pt": "a checkpoint.pt"}
#: How each kind is read (:func:`load`): (path, kind, whether a signature is required, --config, factory).
_LOADERS: dict[str, Callable[[Path, str, bool, str | dict[str, Any] | None, ModelFactory], Loaded]] = {
    "bin": _load_bin, "general": _load_general, "shards": _load_shards, "pt": _load_pt, "dcp": _load_dcp,
    "plain-bin": _load_plain_bin, "safetensors": _load_safetensors,
}


def _read_weights_safetensors(src: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """A weights-only ``.safetensors``: (its ``__metadata__``, its tensors), from one safe read.

    Opened once through the safe opener (a symlink, FIFO or folder is
    refused, never followed or waited on), the header validated against the
    file's size before anything is allocated, every tensor read and hashed in
    one pass; with a ``.sha256`` sidecar the digest of those very bytes must
    match it (:mod:`ripresa.formats.safetensors_file`).
    """
    from ..formats import safetensors_file as st_file
    from ..io.fsio import open_run_file

    expected = read_sidecar(src) if os.path.lexists(src.parent / (src.name + ".sha256")) else None
    fd = open_run_file(src, "safetensors file")  # a loose source: a refused open is bad input (exit 2)
    try:
        header = st_file.header_fd(fd, src)
        tensors, _ = st_file.read_fd(fd, src, header, expected_sha256=expected)
    finally:
        os.close(fd)
    return dict(header.metadata), tensors


def _numel(model_state: Any) -> int | None:
    """Elements of the tensors of a loaded model state (None when it is not a dict of tensors)."""
    if not isinstance(model_state, dict) or not all(isinstance(t, torch.Tensor) for t in model_state.values()):
        return None
    return sum(t.numel() for t in model_state.values())


def _build_sized(model_factory: Any, cfg: dict[str, Any], src: Path, n_file: int | None, *,
                 exact: bool = False) -> tuple[Any, Any]:
    """Build the model a config describes only once its size agrees with the source's.

    The parameter count is computed from the config by arithmetic
    (``model_factory.param_count``: nothing allocated) and compared with what
    the verified source holds (``n_file``: a companion's ``bin.n_params``
    checked against the ``.bin``'s size, or the elements of the loaded model
    state) *before* anything is built: a companion describing a 2 GB model
    beside a 1 MB file is refused at once, not built and then compared
    (docs/FAULTS.md, "Memory"). Model states that also hold buffers have more
    elements than parameters: only a config describing *more* than the source
    holds is refused here (``exact``: any other count, for a ``.bin`` whose
    size gives its parameter count); the exact check follows the build.
    """
    if n_file is not None:
        try:
            n_cfg = int(model_factory.param_count(cfg["model"]))
        except (KeyError, TypeError, ValueError, RipresaError) as exc:
            raise SchemaError("the model config cannot be sized", file=src, found=f"{type(exc).__name__}: {str(exc)[:160]}",
                              hint="the config saved with the checkpoint is malformed") from exc
        if n_cfg > n_file or (exact and n_cfg != n_file):
            raise SchemaError("the model config describes another number of parameters than the source holds",
                              file=src, expected=f"{'' if exact else 'at most '}{n_file} parameters (the source's)",
                              found=f"{n_cfg} parameters",
                              hint="the config does not belong to this checkpoint; nothing was built")
    return model_factory.build(cfg)


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a dependency of [safetensors]
        raise MissingDependency("safetensors is not installed", expected="pip install safetensors", found=str(exc)) from None
    return safetensors


# ---- writing ---------------------------------------------------------------------------------


def _snapshot(lo: Loaded) -> dict[str, Any]:
    """The complete snapshot (checkpoint.pt schema) of a loaded full checkpoint."""
    assert lo.rest is not None and lo.optimizer is not None
    full = dict(lo.rest)
    full["model"] = {k: v.detach().clone() for k, v in lo.model.state_dict().items()}
    full["optimizer"] = lo.optimizer.state_dict()
    return full


def _companion_state(lo: Loaded) -> dict[str, Any]:
    """The snapshot without parameters and moments (what a ``.bin``'s companion holds)."""
    full = _snapshot(lo)
    params = {n for n, _ in lo.model.named_parameters()}
    full["model"] = {k: v for k, v in full["model"].items() if k not in params}
    osd = dict(full["optimizer"])
    osd["state"] = {i: {k: v for k, v in s.items() if k not in BIN_MOMENTS} for i, s in osd["state"].items()}
    full["optimizer"] = osd
    return full


def write(lo: Loaded, dest: Path, kind: str) -> None:
    """Write ``lo`` as ``kind`` at ``dest`` (commit protocol; marker last)."""
    if _RANK[HOLDS[kind]] > _RANK[HOLDS[lo.kind]]:
        lacks = list(BIN_LACKS) if lo.kind == "plain-bin" else ["optimizer state (m, v, steps)", "everything but the weights"]
        raise BadInput(f"a {lo.kind} source holds less than a {kind} destination needs", file=lo.path,
                       expected=f"a source holding {HOLDS[kind]} state", found=f"{HOLDS[lo.kind]} only; it lacks: {'; '.join(lacks[:3])}",
                       hint="missing state is never invented; convert a complete generation instead")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _WRITERS[kind](lo, dest)


def _write_bin(lo: Loaded, dest: Path) -> None:
    """A ``.bin`` generation through its store (commit marker last)."""
    from ..store.store import CheckpointStore

    step = parse_bin_name(dest.name)
    if step != lo.step:
        raise BadInput("a .bin generation's name must carry its step", file=dest, expected=f"step_{lo.step:06d}.bin", found=dest.name)
    assert lo.optimizer is not None
    with CheckpointStore(dest.parent, retention=KeepLast(2**31 - 1)) as store:
        store.save(lo.step, flatten_model_and_adamw(lo.model, lo.optimizer), _companion_state(lo))


def _write_general(lo: Loaded, dest: Path) -> None:
    """A general generation (its commit protocol, signed when a key is configured)."""
    from ..formats import general as general_fmt
    from ..store.general import parse_general_name, save_general

    if parse_general_name(dest.name) != lo.step:
        raise BadInput("a general generation's name must carry its step", file=dest,
                       expected=f"step_{lo.step:06d}.safetensors", found=dest.name)
    tensors, encoded, aliases = general_fmt.split_state(_snapshot(lo), general_fmt.model_aliases(lo.model))
    save_general(dest.parent, lo.step, tensors, encoded, aliases, hmac_key=auth.load_key())


def _write_shards(lo: Loaded, dest: Path) -> None:
    """A sharded general generation (its commit protocol: every shard hashed, marker last; signed when a key is
    configured), one shard per CPU as a session writes it (:func:`~ripresa.store.folder.default_shards`)."""
    from ..formats import general as general_fmt
    from ..formats.shards import SHARDS_NAMES
    from ..store.folder import RunFolder, default_shards
    from ..store.shards import ShardsBackend

    if SHARDS_NAMES.parse(dest.name) != lo.step:
        raise BadInput("a .shards generation's name must carry its step", file=dest,
                       expected=f"step_{lo.step:06d}.shards", found=dest.name)
    tensors, encoded, aliases = general_fmt.split_state(_snapshot(lo), general_fmt.model_aliases(lo.model),
                                                        plain_model_keys=True)
    with RunFolder(dest.parent, writer=True, hmac_key=auth.load_key()) as store:
        ShardsBackend(store).commit_tensors(lo.step, tensors, encoded, aliases, default_shards(), background=False)()


def _write_plain_bin(lo: Loaded, dest: Path) -> None:
    """A plain ``.bin``: weights, m, v and the step only."""
    assert lo.optimizer is not None
    save_bin(dest, lo.step, *flatten_model_and_adamw(lo.model, lo.optimizer))


def _write_pt(lo: Loaded, dest: Path) -> None:
    """A ``checkpoint.pt`` and its sidecar."""
    from ..formats.torch_pt import save_checkpoint

    save_checkpoint(dest, _snapshot(lo))


def _write_dcp(lo: Loaded, dest: Path) -> None:
    """A ``.dcp`` generation: its shards in one process, then the commit (signed when a key is configured)."""
    step = dcp_fmt.parse_dcp_name(dest.name)
    if step != lo.step:
        raise BadInput("a .dcp generation's name must carry its step", file=dest, expected=f"step_{lo.step:06d}.dcp", found=dest.name)
    assert lo.rest is not None
    part = dcp_fmt.partial_path(dest.parent, step)
    if part.exists():
        import shutil

        shutil.rmtree(part)
    dcp_fmt.save_shards(lo.model, lo.optimizer, part, no_dist=True)
    rest = dict(lo.rest)
    rest["model"], rest["optimizer"] = {}, None
    world = checked_number(((rest.get("extra") or {}).get("distributed") or {}).get("world_size", 1), file=lo.path,
                           field="extra.distributed.world_size", lo=1, hi=2**20)
    from ..store.dcp import commit_dcp

    commit_dcp(dest.parent, step, part, world_size=world,
               n_params=sum(p.numel() for p in lo.model.parameters()), state=rest, hmac_key=auth.load_key())


def _write_safetensors(lo: Loaded, dest: Path) -> None:
    """A weights-only ``.safetensors`` and its sidecar."""
    st = _safetensors()
    tensors = {k: v.detach().contiguous() for k, v in lo.model.state_dict().items()}
    meta = {"format": "ripresa.weights", "step": str(lo.step), "config": json.dumps(lo.config or {}, sort_keys=True)}
    with StagedFile(dest) as f:
        f.write(st.torch.save(tensors, metadata=meta))
        digest = f.finish()
        f.publish()
    fsync_dir(dest.parent)
    write_sidecar(dest, digest)


#: How each kind is written (:func:`write`).
_WRITERS: dict[str, Callable[[Loaded, Path], None]] = {
    "bin": _write_bin, "general": _write_general, "shards": _write_shards, "plain-bin": _write_plain_bin,
    "pt": _write_pt, "dcp": _write_dcp, "safetensors": _write_safetensors,
}


# ---- comparing ---------------------------------------------------------------------------------


def _optimizer_tree(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name (comparable across kinds)."""
    return dcp_fmt.optimizer_state_by_name(model, opt, opt.state_dict())


def compare(a: Loaded, b: Loaded, holds: str) -> list[str]:
    """Differences between two loaded checkpoints, over what ``holds`` covers."""
    diffs = []
    d = first_difference(dict(a.model.state_dict()), dict(b.model.state_dict()), "model")
    if d:
        diffs.append(d)
    if holds in ("moments", "full") and a.optimizer is not None and b.optimizer is not None:
        if a.step != b.step:
            diffs.append(f"step: {a.step} vs {b.step}")
        sa, sb = _optimizer_tree(a.model, a.optimizer), _optimizer_tree(b.model, b.optimizer)
        keys = ("exp_avg", "exp_avg_sq", "step") if holds == "moments" else None
        for name in sa["state"]:
            ea, eb = sa["state"][name], sb["state"].get(name, {})
            ks = keys or tuple(set(ea) | set(eb))
            for k in ks:
                if k == "step" and holds == "moments":
                    same = float(ea[k]) == float(eb[k])
                    if not same:
                        diffs.append(f"optimizer.state.{name}.step: {float(ea[k])} vs {float(eb[k])}")
                    continue
                dd = first_difference(ea.get(k), eb.get(k), f"optimizer.state.{name}.{k}")
                if dd:
                    diffs.append(dd)
        if holds == "full":
            dd = first_difference(_groups(sa["param_groups"]), _groups(sb["param_groups"]), "optimizer.param_groups")
            if dd:
                diffs.append(dd)
    if holds == "full":
        dd = first_difference(_plain(a.rest), _plain(b.rest), "state")
        if dd:
            diffs.append(dd)
    return diffs


def _groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hyper-parameters with tuples as lists (DCP and JSON store a tuple as a list)."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def _plain(rest: Mapping[str, Any] | None) -> dict[str, Any]:
    r = dict(rest or {})
    r.pop("model", None)
    r.pop("optimizer", None)
    return r


# ---- the command -----------------------------------------------------------------------------------


def convert(src: str | Path, dest: str | Path, *, model_factory: ModelFactory, config: str | None = None) -> dict[str, Any]:
    """Convert ``src`` into ``dest``, then re-read ``dest`` and compare it bitwise with ``src``.

    Returns a report (kinds, step, what was compared). Raises
    :class:`~ripresa.errors.OutputExists` when ``dest`` exists,
    :class:`~ripresa.errors.BadInput` for an impossible conversion, and
    :class:`~ripresa.errors.CheckFailed` when the re-read differs.
    """
    src, dest = Path(src), Path(dest)
    dest_kind = kind_of(dest, as_dest=True)
    if dest.exists() or dest.is_symlink():
        raise OutputExists("destination already exists", file=dest, expected="a new path", found="an existing path",
                           hint="convert never overwrites; choose another name or remove it")
    lo = load(src, model_factory=model_factory, config=config)
    write(lo, dest, dest_kind)
    back = load(dest, model_factory=model_factory, config=config if config is not None else lo.config, _written_here=True)
    holds = HOLDS[dest_kind]
    diffs = compare(lo, back, holds)
    if diffs:
        raise CheckFailed("the written checkpoint differs from the source when read back", file=dest,
                          expected="bitwise equal", found="; ".join(diffs[:5]),
                          hint="the destination is kept for inspection; do not use it")
    n = sum(p.numel() for p in lo.model.parameters())
    return {"source": str(src), "source_kind": lo.kind, "dest": str(dest), "dest_kind": dest_kind, "step": lo.step,
            "n_params": n, "compared": holds, "verified": True}
