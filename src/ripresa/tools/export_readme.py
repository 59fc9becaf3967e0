"""The README of a ``.bin`` export bundle, from package data (``templates/export_readme.md``).

Written for someone who has never seen ripresa; the layout it explains:
docs/FORMAT.md ("Export bundles").
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from .._version import __version__
from ..store.store import Generation

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


def resume_readme(*, run: Path, gen: Generation, n_params: int, progress: dict[str, Any],
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


def inference_readme(*, run: Path, gen: Generation, n_params: int, shapes: list[tuple[str, list[int]]],
                      model_cfg: dict[str, Any], config: Any, created: str) -> str:
    settings = ", ".join(f"`{k}` = {v}" for k, v in model_cfg.items())
    out = [_part("inference-head", step=gen.step, run_name=run.name, version=__version__, created=created,
                 run_path=run.resolve(), bin=gen.bin.name, bin_sha256=gen.bin_sha256, n_params=f"{n_params:,}",
                 snippet=SAFETENSORS_SNIPPET.rstrip("\n"), settings=settings)]
    out += [_part("shape-row", name=name, shape=shape) for name, shape in shapes]
    out.append(_part("inference-end"))
    return "".join(out)
