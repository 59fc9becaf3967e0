"""The companion ``step_NNNNNN.json`` of an ANDREA ``.bin`` (docs/FORMAT.md).

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

Every companion read from disk may be hostile (docs/FAULTS.md): it is parsed
with :func:`loads_bounded` (nesting depth checked before the parser recurses)
and decoded with :func:`decode_tree`, which checks each tagged node — dtype,
shape, element count and element types — before it allocates anything, and
raises only :class:`~ripresa.errors.SchemaError`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import IntegrityError, SchemaError
from ..io.fsio import read_small

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


def encode_tree(obj: Any, *, tensor: Callable[[tuple[Any, ...], torch.Tensor], Any] | None = None,
                int_list: Callable[[tuple[Any, ...], list[Any]], Any] | None = None,
                _path: tuple[Any, ...] = ()) -> Any:
    """State tree → JSON-able tree (lossless, see module doc).

    ``tensor(path, t)``, when given, encodes each tensor instead (a general
    generation replaces it by a reference to its key in the tensor file);
    ``path`` is the tuple of dict keys and list indices leading to it.
    ``int_list(path, items)``, when given, may encode a list instead (a
    general generation stores a long list of ints as a tensor); None keeps it.
    """
    if tensor is not None and isinstance(obj, torch.Tensor):
        return tensor(_path, obj)
    if int_list is not None and isinstance(obj, list):
        done = int_list(_path, obj)
        if done is not None:
            return done
    kw = {"tensor": tensor, "int_list": int_list}
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
            return {k: encode_tree(v, **kw, _path=(*_path, k)) for k, v in obj.items()}
        return {"__dict__": [[k, encode_tree(v, **kw, _path=(*_path, k))] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v, **kw, _path=(*_path, i)) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, **kw, _path=(*_path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, bool | int | str) or obj is None:
        return obj
    if isinstance(obj, float):
        return obj
    raise SchemaError(f"cannot encode a {type(obj).__name__} in a companion", hint="use primitives or tensors")


#: Deepest nesting of a companion's JSON (a real one is < 16 levels deep).
MAX_DEPTH = 64
#: Most dimensions of a tagged tensor.
MAX_NDIM = 32
_INT_RANGES = {
    torch.int64: (-(2**63), 2**63 - 1), torch.int32: (-(2**31), 2**31 - 1), torch.int16: (-(2**15), 2**15 - 1),
    torch.int8: (-128, 127), torch.uint8: (0, 255),
}


def tree_depth(obj: Any) -> int:
    """Deepest nesting of lists/dicts in a parsed JSON tree, computed without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            depth += 1
            deepest = max(deepest, depth)
            stack.extend((v, depth) for v in node if isinstance(v, dict | list))
    return deepest


def loads_bounded(raw: bytes | str, *, file: str | Path | None = None, what: str = "companion",
                  max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` that refuses a document nested deeper than ``max_depth``.

    A hostile file of ``[[[[...`` makes a recursive walk hit Python's recursion
    limit: the parser's own ``RecursionError`` is caught here, and the parsed
    tree's depth is measured without recursion before anyone walks it. Raises
    :class:`IntegrityError` only (never ``RecursionError``/``ValueError``).
    """
    try:
        doc = json.loads(raw)
    except RecursionError as exc:
        raise IntegrityError(f"{what} is malformed: nested too deeply", file=file, expected=f"<= {max_depth} levels",
                             found="deeper than the parser's recursion limit",
                             hint="it was not written by ripresa; it is not used") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{what} is not valid JSON", file=file, found=str(exc)[:200], hint="the file is damaged") from exc
    depth = tree_depth(doc)
    if depth > max_depth:
        raise IntegrityError(f"{what} is malformed: nested too deeply", file=file, expected=f"<= {max_depth} levels",
                             found=f"{depth} levels", hint="it was not written by ripresa; it is not used")
    return doc


def _fits(dt: torch.dtype) -> Any:
    """Predicate: a JSON value that can be an element of a tensor of dtype ``dt``."""
    if dt is torch.bool:
        return lambda x: type(x) is bool or (type(x) is int and x in (0, 1))
    if dt in _INT_RANGES:
        lo, hi = _INT_RANGES[dt]
        return lambda x: type(x) is int and lo <= x <= hi
    return lambda x: type(x) is float or (type(x) is int and -(2**1023) < x < 2**1023)


def decode_tensor(obj: Mapping[str, Any], where: str = "companion") -> torch.Tensor:
    """One tagged tensor node → tensor; dtype, shape, count and elements checked before allocating."""
    name = obj.get("__tensor__")
    dt = _DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise SchemaError(f"{where}: malformed tensor: unknown dtype", expected=sorted(_DTYPES), found=repr(name)[:80])
    shape, data = obj.get("shape"), obj.get("data")
    if not isinstance(shape, list) or not isinstance(data, list) or set(obj) != {"__tensor__", "shape", "data"}:
        raise SchemaError(f"{where}: malformed tensor", expected='{"__tensor__", "shape": [...], "data": [...]}',
                          found=str(obj)[:120])
    if len(shape) > MAX_NDIM or any(type(s) is not int or s < 0 for s in shape):
        raise SchemaError(f"{where}: bad tensor shape", expected=f"<= {MAX_NDIM} non-negative ints", found=str(shape)[:120])
    count = math.prod(shape)
    if count != len(data):
        raise SchemaError(f"{where}: tensor data length does not match its shape", expected=count, found=len(data),
                          hint="a declared shape must describe the data present")
    if 0 in shape and any(s > 2**31 for s in shape):
        raise SchemaError(f"{where}: bad tensor shape", expected="dimensions < 2**31", found=str(shape)[:120])
    fits = _fits(dt)
    for x in data:
        if not fits(x):
            raise SchemaError(f"{where}: malformed tensor: its data does not fit its dtype", expected=str(dt).removeprefix("torch."),
                              found=repr(x)[:80], hint="the companion was edited or not written by ripresa")
    try:
        return torch.tensor(data, dtype=dt).reshape(shape)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:  # pragma: no cover - checked above
        raise SchemaError(f"{where}: tensor cannot be built", found=f"{type(exc).__name__}: {str(exc)[:120]}") from exc


def decode_tree(obj: Any, where: str = "companion", *, refs: Callable[[dict[str, Any], str], Any] | None = None,
                _depth: int = 0) -> Any:
    """Inverse of :func:`encode_tree`, validating every tagged node.

    Raises only :class:`SchemaError` (an :class:`IntegrityError`): a tree
    nested deeper than :data:`MAX_DEPTH`, a tagged node of the wrong form, a
    ``__dict__`` whose entries are not ``[key, value]`` pairs with str/int keys.
    ``refs(node, where)``, when given, decodes each ``{"__ref__": key, ...}``
    node (a tensor of a general generation's tensor file); without it such a
    node is an error.
    """
    if _depth > MAX_DEPTH:
        raise SchemaError(f"{where}: nested too deeply", expected=f"<= {MAX_DEPTH} levels")
    d = _depth + 1
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return decode_tensor(obj, where)
        if "__ref__" in obj:
            if refs is None:
                raise SchemaError(f"{where}: a tensor reference outside a general generation", found=str(obj)[:120])
            return refs(obj, where)
        if "__tuple__" in obj:
            items = obj["__tuple__"]
            if not isinstance(items, list) or len(obj) != 1:
                raise SchemaError(f"{where}: malformed tuple", expected='{"__tuple__": [...]}', found=str(obj)[:120])
            return tuple(decode_tree(v, where, refs=refs, _depth=d) for v in items)
        if "__dict__" in obj:
            pairs = obj["__dict__"]
            if not isinstance(pairs, list) or len(obj) != 1:
                raise SchemaError(f"{where}: malformed dict", expected='{"__dict__": [[key, value], ...]}', found=str(obj)[:120])
            out: dict[Any, Any] = {}
            for pair in pairs:
                if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) not in (str, int):
                    raise SchemaError(f"{where}: malformed dict entry", expected="[str or int key, value]",
                                      found=str(pair)[:120])
                out[pair[0]] = decode_tree(pair[1], f"{where}.{pair[0]}", refs=refs, _depth=d)
            return out
        return {k: decode_tree(v, f"{where}.{k}", refs=refs, _depth=d) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tree(v, where, refs=refs, _depth=d) for v in obj]
    if isinstance(obj, float | int | str | bool) or obj is None:
        return obj
    raise SchemaError(f"{where}: not a JSON value", found=type(obj).__name__)


def dumps(companion: Mapping[str, Any]) -> bytes:
    """Serialise a companion document (already encoded) to UTF-8 JSON bytes."""
    return json.dumps(companion, separators=(",", ":"), allow_nan=True).encode()


def read_companion(path: str | Path) -> dict[str, Any]:
    """Read and validate the companion's envelope; return the raw (encoded) document.

    Read with :func:`ripresa.io.fsio.read_small` (no symlink, no FIFO, size bounded
    before anything is allocated) and parsed with :func:`loads_bounded`.
    """
    p = Path(path)
    doc = loads_bounded(read_small(p, "companion", MAX_COMPANION_BYTES, error=IntegrityError), file=p)
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
