"""A general generation's state: every tensor in ``step_NNNNNN.safetensors``, the rest in a JSON companion.

:func:`split_state` turns a complete snapshot into the file's tensors, keyed by their flattened path
(:func:`key_of`), and the companion's tree, where each tensor is a reference ``{"__ref__": key}``;
tied weights are stored once, a dtype safetensors cannot name is stored as raw ``U8`` bytes, a long
int list (a random stream's state) is an int64 tensor. :func:`join_state` is the inverse, checking
every reference before it resolves it. docs/FORMAT.md, "General generation" ("Keys", "Companion").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import SchemaError
from . import companion as companion_fmt
from .safetensors_file import NAMES, as_bytes, itemsize

FORMAT = "ripresa.general"
FORMAT_VERSION = 1
#: The companion of a general generation holds no tensor data: refuse a larger one before parsing (bytes).
MAX_COMPANION_BYTES = 16 * 1024 * 1024
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_INTLIKE = re.compile(r"^-?[0-9]+$")
_DTYPE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
#: A list of at least this many ints (all in int64's range) is stored as an int64 tensor of the file, never as
#: JSON numbers: Python's ``random`` state (625 words), NumPy's legacy key (624), their copies per rank.
MIN_LIST_REF = 64
#: ... and at most this many (a reader turns each back into a Python list: its memory is bounded).
MAX_LIST_REF = 1 << 22
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def key_part(k: Any) -> str:
    """One path component of a tensor key.

    An int key or list index is its decimal form; a str key has ``~`` written
    ``~0`` and ``/`` written ``~1`` (as JSON Pointer, RFC 6901), and one that
    is empty or reads as an integer is prefixed ``~s`` (so the str ``"3"`` is
    ``~s3`` and the int ``3`` is ``3``).
    """
    if isinstance(k, bool) or not isinstance(k, int | str):
        raise SchemaError(f"cannot name a tensor under a {type(k).__name__} key", found=repr(k)[:80])
    if isinstance(k, int):
        return str(k)
    s = k.replace("~", "~0").replace("/", "~1")
    return "~s" + s if s == "" or _INTLIKE.match(s) else s


def key_of(path: tuple[Any, ...]) -> str:
    """The tensor key of a path in the state tree: components joined by ``/`` (``optimizer/state/3/exp_avg``)."""
    return "/".join(key_part(k) for k in path)


def _view_id(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def model_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Model ``state_dict`` names that are the same view of the same storage as an earlier name (tied weights)."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        vid = _view_id(t)
        if vid in first:
            out[name] = first[vid]
        else:
            first[vid] = name
    return out


def plain_key_of(path: tuple[Any, ...]) -> str:
    """The key of a sharded generation (docs/FORMAT.md, "Sharded general generations"): a model tensor under its
    own ``state_dict`` name, as Hugging Face loaders look it up (``transformer.h.0.attn.weight``); any other, and a
    model name holding ``/``, as :func:`key_of` (always with a ``/``, so the two never meet)."""
    if len(path) == 2 and path[0] == "model" and isinstance(path[1], str) and path[1] and "/" not in path[1]:
        return path[1]
    return key_of(path)


def split_state(snapshot: Mapping[str, Any], aliases: Mapping[str, str] | None = None, *, to_cpu: bool = True,
                plain_model_keys: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    """(key -> tensor for the file, the companion's encoded state, alias key -> stored key).

    ``aliases``: :func:`model_aliases` of the live model (a snapshot's
    copies no longer share storage). Tensors come out contiguous (on the CPU
    unless ``to_cpu=False``: a caller copying them into staging itself), not
    copied when they already are; one of a dtype without a safetensors name as
    its uint8 bytes. ``plain_model_keys``: keys by :func:`plain_key_of` (a
    sharded generation), else :func:`key_of`.
    """
    aliases = dict(aliases or {})
    tensors: dict[str, torch.Tensor] = {}
    alias_keys: dict[str, str] = {}
    name_of = plain_key_of if plain_model_keys else key_of

    def encode(path: tuple[Any, ...], t: torch.Tensor) -> dict[str, Any]:
        if len(path) == 2 and path[0] == "model" and path[1] in aliases:
            target = name_of(("model", aliases[path[1]]))
            if target in tensors:
                alias_keys[name_of(path)] = target
                return {"__ref__": target}
        key = name_of(path)
        if key in tensors:  # only a plain model name can meet a top-level key of a low-level state
            raise SchemaError(f"two tensors of the state would be stored as {key!r}", found=key_of(path)[:120])
        t = (t.detach().to("cpu") if to_cpu else t.detach()).contiguous()
        if t.dtype in NAMES:
            tensors[key] = t
            return {"__ref__": key}
        try:
            tensors[key] = as_bytes(t)
        except RuntimeError as exc:
            raise SchemaError(f"cannot store tensor {key!r} of dtype {t.dtype}", found=str(exc)[:160],
                              hint="a general generation stores tensors whose bytes can be viewed as uint8") from exc
        return {"__ref__": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}

    def int_list(path: tuple[Any, ...], items: list[Any]) -> dict[str, Any] | None:
        if not MIN_LIST_REF <= len(items) <= MAX_LIST_REF or not all(type(x) is int and _I64_MIN <= x <= _I64_MAX for x in items):
            return None
        key = name_of(path)
        tensors[key] = torch.tensor(items, dtype=torch.int64)
        return {"__ref__": key, "list": "int64"}

    encoded = companion_fmt.encode_tree(dict(snapshot), tensor=encode, int_list=int_list)
    return tensors, encoded, alias_keys


def companion_doc(name: str, sha256: str, size: int, step: int, count: int, aliases: Mapping[str, str],
                  encoded_state: Any) -> dict[str, Any]:
    """The companion document (docs/FORMAT.md): the tensor file's record, the aliases, the state."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION,
            "tensors": {"name": name, "sha256": sha256, "size": size, "step": step, "count": count},
            "aliases": dict(aliases), "state": encoded_state}


def validate_envelope(doc: Any, path: Path | None = None) -> None:
    """The fields a general companion must have, with their types (before anything is decoded)."""
    if not isinstance(doc, dict):
        raise SchemaError("companion is not a JSON object", file=path, found=type(doc).__name__)
    if doc.get("format") != FORMAT:
        raise SchemaError("not a ripresa general companion", file=path, expected=FORMAT, found=str(doc.get("format"))[:80])
    if doc.get("format_version") != FORMAT_VERSION:
        raise SchemaError("unsupported companion version", file=path, expected=FORMAT_VERSION,
                          found=str(doc.get("format_version"))[:80])
    rec = doc.get("tensors")
    if not isinstance(rec, dict):
        raise SchemaError("companion lacks its 'tensors' record", file=path, expected="{name, sha256, size, step, count}")
    name, sha = rec.get("name"), rec.get("sha256")
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
        raise SchemaError("companion names an invalid tensor file", file=path, expected="a bare file name", found=repr(name)[:80])
    if not isinstance(sha, str) or not _HEX64.match(sha):
        raise SchemaError("companion's tensor file sha256 is malformed", file=path, expected="64 lowercase hex",
                          found=repr(sha)[:80])
    for k in ("size", "step", "count"):
        v = rec.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SchemaError(f"companion's tensors.{k} is not a non-negative integer", file=path, found=repr(v)[:80])
    al = doc.get("aliases")
    if not isinstance(al, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in al.items()):
        raise SchemaError("companion's 'aliases' is not a map of tensor keys", file=path, found=str(al)[:120])
    if not isinstance(doc.get("state"), dict):
        raise SchemaError("companion lacks 'state'", file=path)


def join_state(doc: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], path: Path | None = None) -> dict[str, Any]:
    """The companion's state with every reference resolved to its tensor, each checked first.

    Every reference must name a tensor of the file (an alias: a stored key
    the companion's ``aliases`` lists), a raw one must have the byte count of
    its dtype and shape, and every tensor of the file must be referenced.
    Raises :class:`SchemaError` only.
    """
    aliases = doc["aliases"]
    for alias, target in aliases.items():
        if alias in tensors or target not in tensors:
            raise SchemaError("companion's aliases do not match the tensor file", file=path,
                              expected="alias keys absent from the file, targets present", found=f"{alias} -> {target}"[:160])
    used: set[str] = set()
    # The cost model of references (docs/FORMAT.md, "References"): a valid companion names each
    # tensor once, plus once per alias of it (tied weights); a list reference expands its tensor
    # into Python ints, so it is the one use of its key. Checked before anything is materialized:
    # a 3 KB companion naming one tensor a million times is refused, not expanded a million times.
    budget = companion_fmt.RefBudget(tensors, aliases, path)

    def ref(node: dict[str, Any], where: str) -> torch.Tensor | list[int]:
        key = node.get("__ref__")
        extra = set(node) - {"__ref__"}
        if not isinstance(key, str) or key not in tensors or extra not in (set(), {"dtype", "shape"}, {"list"}):
            raise SchemaError(f"{where}: a tensor reference that names no tensor of the file", file=path,
                              expected='{"__ref__": key of the file}', found=companion_fmt.brief(node, 160))
        used.add(key)
        t = tensors[key]
        budget.use(key, where)
        if not extra:
            return t
        if extra == {"list"}:  # a long list of ints, stored as a 1-D int64 tensor
            if (node["list"] != "int64" or t.dtype != torch.int64 or t.dim() != 1 or t.numel() > MAX_LIST_REF
                    or key in aliases.values()):
                raise SchemaError(f"{where}: malformed list reference", file=path,
                                  expected='{"__ref__": key of a 1-D I64 tensor, "list": "int64"}',
                                  found=f"{companion_fmt.brief(node, 120)} -> {t.dtype} {list(t.shape)}")
            return t.tolist()
        name, shape = node["dtype"], node["shape"]
        dt = getattr(torch, name, None) if isinstance(name, str) and _DTYPE_NAME.match(name) else None
        if (not isinstance(dt, torch.dtype) or not isinstance(shape, list) or len(shape) > companion_fmt.MAX_NDIM
                or any(type(s) is not int or s < 0 for s in shape) or t.dtype != torch.uint8 or t.dim() != 1):
            raise SchemaError(f"{where}: malformed raw tensor reference", file=path,
                              expected="a torch dtype name, a shape, a 1-D uint8 tensor", found=companion_fmt.brief(node, 160))
        count = 1
        for s in shape:
            count *= s
        if count * itemsize(dt) != t.numel():
            raise SchemaError(f"{where}: raw tensor bytes do not match its dtype and shape", file=path,
                              expected=count * itemsize(dt), found=t.numel())
        return t.view(dt).reshape(shape) if t.numel() else torch.empty(shape, dtype=dt)

    state = companion_fmt.decode_tree(doc["state"], "companion.state", refs=ref)
    stray = set(tensors) - used
    if stray:
        raise SchemaError("the tensor file holds tensors the companion does not reference", file=path,
                          found=sorted(stray)[:5], hint="it was edited or not written by ripresa")
    return state
