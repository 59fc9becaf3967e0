"""The layout of a sharded general generation ``step_NNNNNN.shards/`` (docs/FORMAT.md, "Sharded general generations").

The folder is a Hugging Face sharded checkpoint: ``model-0000k-of-0000K.safetensors`` (each a
file of :mod:`ripresa.formats.safetensors_file`) and ``model.safetensors.index.json``
(``metadata.total_size``, ``weight_map``: tensor key -> shard), plus ``companion.json``, the
general companion whose ``tensors`` record lists every shard. :func:`plan` cuts the tensors into
contiguous, balanced shards; :func:`validate_companion` and :func:`validate_index` check what a
hostile folder may hold before anything is allocated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError
from . import general as general_fmt
from .naming import NameFormat
from .safetensors_file import layout

#: How sharded general generations are named: the folder ``step_NNNNNN.shards``, ``.shards.sha256`` (the
#: marker) and ``.shards.hmac`` beside it, ``.step_NNNNNN.shards.partial`` while it is written.
SHARDS_NAMES = NameFormat(".shards", folder=True, partial=True)
INDEX_NAME = "model.safetensors.index.json"
COMPANION_NAME = "companion.json"
LAYOUT = "shards"
#: Most shard files a generation may have (a hostile companion cannot ask for more).
MAX_SHARDS = 4096
_SHARD_RE = re.compile(r"^model-([0-9]{5})-of-([0-9]{5})\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def shard_name(k: int, count: int) -> str:
    """``model-00002-of-00004.safetensors`` for shard ``k`` (1-based) of ``count``, as Hugging Face names them."""
    return f"model-{k:05d}-of-{count:05d}.safetensors"


def plan(tensors: Mapping[str, torch.Tensor], count: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in file order (:func:`~ripresa.formats.safetensors_file.layout`), cut into at most ``count``
    contiguous shards of about equal bytes; whole tensors only, no empty shard (so maybe fewer than ``count``)."""
    ordered = layout(tensors)
    total = sum(t.numel() * t.element_size() for _, t in ordered)
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    done = 0
    for key, t in ordered:
        n = t.numel() * t.element_size()
        cut = total * len(shards) / count  # where the current shard should end
        # start a new shard when this tensor would take the current one further past its cut than short of it
        if shards[-1] and len(shards) < count and done + n - cut > cut - done:
            shards.append([])
        shards[-1].append((key, t))
        done += n
    return shards


def index_doc(step: int, shards: Sequence[Sequence[tuple[str, torch.Tensor]]], aliases: Mapping[str, str]) -> dict[str, Any]:
    """``model.safetensors.index.json``: Hugging Face's ``metadata.total_size`` and ``weight_map`` (an alias of a
    tied weight maps to its stored tensor's shard, as ``transformers`` writes it)."""
    count = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, 1):
        for key, t in shard:
            weight_map[key] = shard_name(k, count)
            total += t.numel() * t.element_size()
    for alias, target in aliases.items():
        weight_map[alias] = weight_map[target]
    return {"metadata": {"total_size": total, "format": general_fmt.FORMAT, "step": str(step)}, "weight_map": weight_map}


def index_bytes(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def companion_doc(step: int, records: Sequence[Mapping[str, Any]], aliases: Mapping[str, str],
                  encoded_state: Any) -> dict[str, Any]:
    """The companion of a sharded generation: the general companion with a ``shards`` record (name, sha256,
    size, count of each shard file, in order) in place of the one file's."""
    return {"format": general_fmt.FORMAT, "format_version": general_fmt.FORMAT_VERSION, "layout": LAYOUT,
            "tensors": {"step": step, "count": sum(r["count"] for r in records), "shards": [dict(r) for r in records]},
            "aliases": dict(aliases), "state": encoded_state}


def validate_companion(doc: Any, path: Path | None = None) -> None:
    """The envelope of a sharded companion, with types, before anything is decoded."""
    if not isinstance(doc, dict):
        raise IntegrityError("companion is not a JSON object", file=path, found=type(doc).__name__)
    if doc.get("format") != general_fmt.FORMAT or doc.get("layout") != LAYOUT:
        raise IntegrityError("not a ripresa sharded general companion", file=path,
                             expected={"format": general_fmt.FORMAT, "layout": LAYOUT},
                             found={"format": str(doc.get("format"))[:40], "layout": str(doc.get("layout"))[:40]})
    if doc.get("format_version") != general_fmt.FORMAT_VERSION:
        raise IntegrityError("unsupported companion version", file=path, expected=general_fmt.FORMAT_VERSION,
                             found=str(doc.get("format_version"))[:80])
    rec = doc.get("tensors")
    shards = rec.get("shards") if isinstance(rec, dict) else None
    if not isinstance(shards, list) or not 1 <= len(shards) <= MAX_SHARDS:
        raise IntegrityError("companion lacks its shards record", file=path,
                             expected=f"tensors.shards: 1..{MAX_SHARDS} records", found=str(rec)[:120])
    for k in ("step", "count"):
        v = rec.get(k)
        if type(v) is not int or v < 0:
            raise IntegrityError(f"companion's tensors.{k} is not a non-negative integer", file=path, found=repr(v)[:80])
    for i, r in enumerate(shards, 1):
        if (not isinstance(r, dict) or set(r) != {"name", "sha256", "size", "count"}
                or r["name"] != shard_name(i, len(shards)) or not isinstance(r["sha256"], str)
                or not _HEX64.match(r["sha256"]) or any(type(r[k]) is not int or r[k] < 0 for k in ("size", "count"))):
            raise IntegrityError(f"companion's shard record {i} is malformed", file=path,
                                 expected=f'{{"name": "{shard_name(i, len(shards))}", "sha256", "size", "count"}}',
                                 found=str(r)[:160])
    al = doc.get("aliases")
    if not isinstance(al, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in al.items()):
        raise IntegrityError("companion's 'aliases' is not a map of tensor keys", file=path, found=str(al)[:120])
    if not isinstance(doc.get("state"), dict):
        raise IntegrityError("companion lacks 'state'", file=path)


def validate_index(doc: Any, expected: Mapping[str, Any], path: Path | None = None) -> None:
    """The index must say exactly what the companion and the shards' headers say (``expected``:
    :func:`index_doc` of them): a loader without ripresa trusts it."""
    if doc != expected:
        found = doc.get("metadata") if isinstance(doc, dict) else type(doc).__name__
        raise IntegrityError("the shard index disagrees with the shards", file=path,
                             expected=expected["metadata"], found=str(found)[:160],
                             hint="it was edited after the commit; loaders outside ripresa would read other tensors")


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(k, count) of ``model-0000k-of-0000K.safetensors``; None for any other name."""
    m = _SHARD_RE.match(name)
    if m is None:
        return None
    k, count = int(m.group(1)), int(m.group(2))
    return (k, count) if 1 <= k <= count else None
