"""The resolved config of an ANDREA run (``config.json``): model, training, data, mixture, audit.

Resolution order: a named config (``tiny``, ``andrea-12m``, ``andrea-120m``)
or a TOML file (same sections, optional ``base = "tiny"``), or — when neither
is given and the run folder has one — the run's own ``config.json``; then each
``--set section.key=value`` (value parsed as JSON, else taken as a string);
then validation (the model shape, the mixture policy against the arms).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...core.numbers import checked_number
from ...errors import BadInput, IntegrityError, SchemaError
from ...io.fsio import read_small
from .model import CONFIGS, TRAIN_DEFAULTS, GPTConfig, from_config_dict
from .sources import BUILTIN_SOURCES

#: Steps a named run trains for by default (the ANDREA-120M run: 200K steps).
MAX_STEPS = {"tiny": 2000, "andrea-12m": 200_000, "andrea-120m": 200_000}

DEFAULT_PROMPTS = ["def ", "The ", "import ", "class Simple"]


def did_you_mean(word: str, choices: Sequence[str]) -> str | None:
    """``"did you mean 'x'?"`` for the nearest valid names of a typo (difflib), or None when none is near."""
    near = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    if not near:
        return None
    return "did you mean " + " or ".join(repr(n) for n in near) + "?"


def named_config(name: str) -> dict[str, Any]:
    if name not in CONFIGS:
        raise BadInput("unknown config", expected=sorted(CONFIGS) + ["FILE.toml"], found=name,
                       hint=did_you_mean(name, sorted(CONFIGS)))
    train = TRAIN_DEFAULTS[name].to_dict()
    train.update({"max_steps": MAX_STEPS[name], "seed": 1337, "every": 100})
    return {
        "name": name,
        "model": CONFIGS[name].to_dict(),
        "train": train,
        "data": {"sources": list(BUILTIN_SOURCES)},
        "mixture": {"floors": {}, "caps": {}, "phase": 0},
        "audit": {"enabled": True, "prompts": list(DEFAULT_PROMPTS), "max_new_tokens": 48, "temperature": 0.8, "top_k": 40},
    }


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


#: A config file is a few KiB; refuse anything larger before reading it.
MAX_CONFIG_BYTES = 1 << 20


def load_config_file(path: Path, *, run_file: bool = False) -> dict[str, Any]:
    """A .toml or .json config (a run's ``config.json``): bounded read, no symlink/FIFO, depth-bounded parse.

    ``run_file``: a run folder's own ``config.json``, which a resume trusts: checked against its signature
    (refused unsigned under require-signature; docs/FAULTS.md, "Trust model")."""
    from ...formats.companion import loads_bounded
    from ...io import auth

    if not os.path.lexists(path):
        raise BadInput("config file not found", file=path, expected="a .toml or .json file", found="nothing")
    data = read_small(path, "config file", MAX_CONFIG_BYTES)
    if run_file:
        auth.check_run_file(path, data)
    try:
        if path.suffix == ".toml":
            raw = tomllib.loads(data.decode("utf-8"))
        else:
            raw = loads_bounded(data, file=path, what="config file", max_depth=16)
    except IntegrityError as exc:
        raise BadInput(exc.message, file=path, expected=exc.expected, found=exc.found, hint=exc.hint) from None
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        raise BadInput("config file is not valid TOML/JSON", file=path, found=str(exc)[:200]) from None
    if not isinstance(raw, dict):
        raise BadInput("config file is not a table/object", file=path, found=type(raw).__name__)
    base = raw.pop("base", "tiny") if path.suffix == ".toml" else None
    if base is not None and not isinstance(base, str):
        raise BadInput("config 'base' must be a config name", file=path, expected=sorted(CONFIGS), found=repr(base)[:80])
    return _merge(named_config(base), raw) if base else raw


def apply_sets(cfg: dict[str, Any], sets: Sequence[str]) -> dict[str, Any]:
    """``section.key=value`` overrides; value parsed as JSON when it parses."""
    cfg = copy.deepcopy(cfg)
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise BadInput("bad --set", expected="section.key=value", found=repr(item))
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        node = cfg
        parts = key.split(".")
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p), dict):
                sections = sorted(k for k, v in node.items() if isinstance(v, dict))
                near = did_you_mean(".".join([*parts[:i], p]), [".".join([*parts[:i], s]) for s in sections])
                raise BadInput("--set names an unknown section", expected=sections, found=key,
                               hint=near or "e.g. --set train.lr=1e-3 or --set model.n_layer=4")
            node = node[p]
        if parts[-1] not in node and parts[0] not in ("mixture",):
            prefix = ".".join(parts[:-1])
            names = [f"{prefix}.{k}" if prefix else k for k in node]
            if not prefix:  # a key without its section (--set lr=...): every section's keys too
                names += [f"{sec}.{k}" for sec, v in cfg.items() if isinstance(v, dict) for k in v]
            raise BadInput("--set names an unknown key", expected=sorted(node), found=key,
                           hint=_nearest_key(key, names))
        node[parts[-1]] = value
    return cfg


def _nearest_key(key: str, names: Sequence[str]) -> str | None:
    """The nearest valid ``section.key`` names of a typo, matched on the key's last part."""
    leaf = key.rpartition(".")[2]
    leaves = difflib.get_close_matches(leaf, sorted({n.rpartition(".")[2] for n in names}), n=3, cutoff=0.7)
    hits = sorted((n for n in names if n.rpartition(".")[2] in leaves), key=lambda n: leaves.index(n.rpartition(".")[2]))
    return "did you mean " + " or ".join(repr(n) for n in hits[:3]) + "?" if hits else None


def resolve_config(config: str | None, sets: Sequence[str], run_dir: Path | None, extra_sources: Sequence[str] = ()) -> dict[str, Any]:
    """The resolved config (see the module doc); validated."""
    existing = run_dir / "config.json" if run_dir is not None else None
    if config is None and existing is not None and existing.is_file():
        cfg = load_config_file(existing, run_file=True)
    elif config is None:
        cfg = named_config("tiny")
    elif config in CONFIGS:
        cfg = named_config(config)
    elif not os.path.lexists(config):  # neither a preset nor a file: name the presets (and the nearest one)
        near = did_you_mean(config, sorted(CONFIGS))
        raise BadInput("unknown config: neither a preset nor a file", file=config,
                       expected=f"a preset ({', '.join(sorted(CONFIGS))}) or a .toml/.json file",
                       found="no preset of this name, no file at this path",
                       hint=near or "a preset's name, or the path of a config file (docs/ENGINE.md)")
    else:  # a file the user names (a link to it is the user's choice): resolved; a run's own config.json is not
        cfg = load_config_file(Path(config).resolve())
    cfg = apply_sets(cfg, sets)
    for spec in extra_sources:
        if spec not in cfg["data"]["sources"]:
            cfg["data"]["sources"].append(spec)
    validate(cfg)
    return cfg


def model_for_generation(model_cfg: Any, n_params: int, *, file: str | Path | None = None) -> GPTConfig:
    """The model shape of a config, checked against a generation's parameter count before anything is built.

    The call site for export, convert, ledger/generate and train: ranges and
    the :data:`~ripresa.engine.gpt.model.MAX_PARAMS` cap are checked by
    :class:`GPTConfig` (:class:`BadInput`), then the count computed
    arithmetically must equal ``n_params`` (the ``.bin`` header's or a
    companion's), else :class:`IntegrityError` — a config that disagrees with
    the weights it is meant to load never allocates a model.
    """
    mconf = from_config_dict(model_cfg)
    if mconf.param_count() != n_params:
        raise SchemaError("the config's model does not match the checkpoint's parameter count", file=file,
                             expected=f"{n_params:,} parameters (the generation's)",
                             found=f"{mconf.param_count():,} parameters (the config's model shape)",
                             hint="use the run's own config.json; the model is not built")
    return mconf


def validate(cfg: dict[str, Any]) -> None:
    for section in ("model", "train", "data", "mixture", "audit"):
        if not isinstance(cfg.get(section), dict):
            raise BadInput(f"config lacks section '{section}'", expected=section, found=sorted(cfg))
    from_config_dict(cfg["model"])
    t = cfg["train"]
    for key in ("batch_size", "max_steps", "every", "seed", "warmup_steps"):  # docs/FAULTS.md, "Numbers read from files"
        checked_number(t.get(key), file="config.json", field=f"train.{key}", lo=1 if key == "batch_size" else 0,
                       hi=2**31 - 1 if key == "batch_size" else 2**63 - 1, error=BadInput)
    for key in ("lr", "min_lr", "weight_decay", "grad_clip"):
        checked_number(t.get(key), file="config.json", field=f"train.{key}", lo=0, hi=sys.float_info.max,
                       integer=False, error=BadInput)
    for key in ("phase",):
        if key in cfg["mixture"]:
            checked_number(cfg["mixture"][key], file="config.json", field=f"mixture.{key}", lo=0, hi=2**31 - 1,
                           error=BadInput)
    if not cfg["data"].get("sources"):
        raise BadInput("config names no data source", expected="data.sources = [...]")
    from ..mixture import MixturePolicy

    # caps and floors name arms of this config (a fork's --set is refused here, not at the fork's first start)
    arms = [str(spec).partition("=")[0] for spec in cfg["data"]["sources"]]
    MixturePolicy.from_dict({k: v for k, v in cfg["mixture"].items() if k in ("floors", "caps")}).validate(arms)
