"""The companion ``step_NNNNNN.json`` of an ANDREA ``.bin`` (DESIGN §3.1).

The ``.bin`` holds weights, m and v and a step; everything else an exact
resume needs — random streams, data position, scheduler, scaler, progress,
optimizer hyper-parameters, model buffers, config, versions, code and data
identity — lives in this JSON file, written beside the ``.bin`` (never inside
it) with the ``.bin``'s sha256 and size.

Tensors are encoded losslessly as ``{"__tensor__": dtype, "shape": [...],
"data": [...]}`` (floats via ``repr``, so float64 round-trips bit-exactly;
float32/bfloat16/float16 values are exactly representable in a double);
tuples as ``{"__tuple__": [...]}``; dicts with non-string keys (optimizer
state is keyed by parameter index) as ``{"__dict__": [[key, value], ...]}``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError, SchemaError
from ..fsio import require_regular_file

FORMAT = "ripresa.companion"
FORMAT_VERSION = 1

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: A companion is small (RNG states, buffers, hyper-parameters); refuse absurd
#: sizes before parsing (bytes).
MAX_COMPANION_BYTES = 256 * 1024 * 1024


def encode_tree(obj: Any) -> Any:
    """State tree → JSON-able tree (lossless, see module doc)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise SchemaError(f"cannot encode a tensor of dtype {t.dtype} in a companion")
        flat = t.reshape(-1)
        if t.dtype in (torch.bfloat16, torch.float16):
            flat = flat.float()
        return {"__tensor__": name, "shape": list(t.shape), "data": flat.tolist()}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") and k.endswith("__") for k in obj):
            return {k: encode_tree(v) for k, v in obj.items()}
        return {"__dict__": [[k, encode_tree(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v) for v in obj]}
    if isinstance(obj, list):
        return [encode_tree(v) for v in obj]
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, float):
        return obj
    raise SchemaError(f"cannot encode a {type(obj).__name__} in a companion", hint="use primitives or tensors")


def decode_tree(obj: Any, where: str = "companion") -> Any:
    """Inverse of :func:`encode_tree`, validating every tagged node."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            dt = _DTYPES.get(obj["__tensor__"])
            shape, data = obj.get("shape"), obj.get("data")
            if dt is None or not isinstance(shape, list) or not isinstance(data, list):
                raise SchemaError(f"{where}: malformed tensor", found=str(obj)[:120])
            if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in shape):
                raise SchemaError(f"{where}: bad tensor shape", found=shape)
            if math.prod(shape) != len(data):
                raise SchemaError(f"{where}: tensor data length does not match its shape", expected=math.prod(shape), found=len(data))
            return torch.tensor(data, dtype=dt).reshape(shape)
        if "__tuple__" in obj:
            return tuple(decode_tree(v, where) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: decode_tree(v, f"{where}.{k}") for k, v in obj["__dict__"]}
        return {k: decode_tree(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tree(v, where) for v in obj]
    return obj


def dumps(companion: Mapping[str, Any]) -> bytes:
    """Serialise a companion document (already encoded) to UTF-8 JSON bytes."""
    return json.dumps(companion, separators=(",", ":"), allow_nan=True).encode()


def read_companion(path: str | Path) -> dict[str, Any]:
    """Read and validate the companion's envelope; return the raw (encoded) document."""
    p = require_regular_file(path, "companion")
    size = p.stat().st_size
    if size > MAX_COMPANION_BYTES:
        raise IntegrityError("companion is implausibly large", file=p, expected=f"<= {MAX_COMPANION_BYTES} bytes", found=size)
    try:
        doc = json.loads(p.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError("companion is not valid JSON", file=p, found=str(exc)[:200], hint="the file is damaged") from exc
    validate_envelope(doc, p)
    return doc


def validate_envelope(doc: Any, path: Path | None = None) -> None:
    """The fields every companion must have, with their types."""
    if not isinstance(doc, dict):
        raise SchemaError("companion is not a JSON object", file=path, found=type(doc).__name__)
    if doc.get("format") != FORMAT:
        raise SchemaError("not a ripresa companion", file=path, expected=FORMAT, found=doc.get("format"))
    if doc.get("format_version") != FORMAT_VERSION:
        raise SchemaError("unsupported companion version", file=path, expected=FORMAT_VERSION, found=doc.get("format_version"))
    b = doc.get("bin")
    if not isinstance(b, dict):
        raise SchemaError("companion lacks its 'bin' record", file=path, expected="{name, sha256, size, step, n_params}")
    name, sha, size = b.get("name"), b.get("sha256"), b.get("size")
    if not isinstance(name, str) or "/" in name or "\\" in name or name in (".", "..") or not name:
        raise SchemaError("companion names an invalid .bin file", file=path, expected="a bare file name", found=repr(name))
    if not isinstance(sha, str) or not _HEX64.match(sha):
        raise SchemaError("companion's .bin sha256 is malformed", file=path, expected="64 lowercase hex", found=repr(sha)[:80])
    for key in ("size", "step", "n_params"):
        v = b.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SchemaError(f"companion's bin.{key} is not a non-negative integer", file=path, found=repr(v))
    if size != 8 + 12 * b["n_params"]:
        raise SchemaError("companion's .bin size disagrees with its n_params", file=path, expected=8 + 12 * b["n_params"], found=size)
    if not isinstance(doc.get("state"), dict):
        raise SchemaError("companion lacks 'state'", file=path)
