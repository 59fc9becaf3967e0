"""The companion JSON of a generation: everything an exact resume needs besides the weights (docs/FORMAT.md).

Random streams, data position, scheduler, scaler, progress, optimizer hyper-parameters, buffers,
config, versions and identity, beside the ``.bin`` (never inside it) with its sha256 and size.
Tensors are encoded losslessly (``{"__tensor__": dtype, "shape", "data"}``, floats via ``repr``),
tuples as ``{"__tuple__"}``, dicts with non-string keys as ``{"__dict__"}``. A companion read from
disk may be hostile (docs/FAULTS.md): :func:`loads_bounded` checks the nesting depth before the
parser recurses, :func:`decode_tree` checks every tagged node before it allocates, and raises only
:class:`~ripresa.errors.SchemaError`.
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
from ..io.fsio import MAX_JSON_COST, check_json_cost, read_small

FORMAT = "ripresa.companion"
FORMAT_VERSION = 1

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: A companion is small: random streams (~30 KB), hyper-parameters, progress, the
#: model's buffers and the user's objects, never a parameter or a moment (those are
#: in the ``.bin``). 64 MiB holds ~3 million float buffer values written as JSON,
#: far more than any model ripresa trains keeps in buffers; a larger file is refused
#: before it is read, and its parse is bounded by :data:`~ripresa.io.fsio.MAX_JSON_COST`
#: (docs/FAULTS.md, "Memory").
MAX_COMPANION_BYTES = 64 * 1024 * 1024


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


#: Most elements a shape may span, a zero dimension counted as one (2**48: beyond any tensor a run
#: holds, and small enough that every stride and byte count of it fits an int64).
MAX_SPAN = 2**48


def check_shape(shape: Any, where: str, *, file: str | Path | None = None) -> tuple[int, ...]:
    """The one bound on a shape read from a file (docs/FAULTS.md, "Shapes"): a list of at most
    :data:`MAX_NDIM` non-negative ints whose product, each zero counted as one, is at most
    :data:`MAX_SPAN`. A shape of zero elements has zero bytes, so no byte check bounds its other
    dimensions (``[0, 2**64]``): this one does, for every reader that yields a shape (companions,
    safetensors headers, DCP metadata), before anything is allocated or listed valid.
    Raises :class:`SchemaError`; returns the shape as a tuple."""
    if (not isinstance(shape, list | tuple) or len(shape) > MAX_NDIM
            or any(type(s) is not int or s < 0 for s in shape)):
        raise SchemaError(f"{where}: bad tensor shape", file=file, expected=f"<= {MAX_NDIM} non-negative ints",
                          found=brief(list(shape) if isinstance(shape, tuple) else shape),
                          hint="it was not written by ripresa; it is not used")
    span = 1
    for s in shape:
        span *= max(s, 1)
        if span > MAX_SPAN:
            raise SchemaError(f"{where}: tensor shape beyond any size", file=file,
                              expected="dimensions whose product (a zero counted as one) is <= 2**48",
                              found=brief(list(shape)),
                              hint="it was not written by ripresa (a zero-byte tensor of astronomic "
                                   "dimensions); it is not used")
    return tuple(shape)


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
                  max_depth: int = MAX_DEPTH, max_cost: int = MAX_JSON_COST) -> Any:
    """``json.loads`` that refuses a document nested deeper than ``max_depth`` or too costly to parse.

    The memory the parse would take is bounded first, from a pre-scan of the
    bytes (:func:`ripresa.io.fsio.check_json_cost`, at most ``max_cost``):
    a companion of tiny containers is refused before ``json.loads`` builds
    ~80 bytes of objects per byte of it. A hostile file of ``[[[[...`` makes a
    recursive walk hit Python's recursion limit: the parser's own
    ``RecursionError`` is caught here, and the parsed tree's depth is measured
    without recursion before anyone walks it. Raises :class:`IntegrityError`
    only (never ``RecursionError``/``ValueError``/``MemoryError``).
    """
    check_json_cost(raw, file, what, limit=max_cost, error=IntegrityError)
    try:
        doc = json.loads(raw)
    except RecursionError as exc:
        raise IntegrityError(f"{what} is malformed: nested too deeply", file=file, expected=f"<= {max_depth} levels",
                             found="deeper than the parser's recursion limit",
                             hint="it was not written by ripresa; it is not used") from exc
    except (ValueError, UnicodeDecodeError, MemoryError) as exc:
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
                          found=brief(obj))
    check_shape(shape, where)
    count = math.prod(shape)
    if count != len(data):
        raise SchemaError(f"{where}: tensor data length does not match its shape", expected=count, found=len(data),
                          hint="a declared shape must describe the data present")
    fits = _fits(dt)
    for x in data:
        if not fits(x):
            raise SchemaError(f"{where}: malformed tensor: its data does not fit its dtype", expected=str(dt).removeprefix("torch."),
                              found=repr(x)[:80], hint="the companion was edited or not written by ripresa")
    try:
        return torch.tensor(data, dtype=dt).reshape(shape)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:  # pragma: no cover - checked above
        raise SchemaError(f"{where}: tensor cannot be built", found=f"{type(exc).__name__}: {str(exc)[:120]}") from exc


def brief(obj: Any, limit: int = 120) -> str:
    """A short description of a (possibly huge or deep) parsed JSON value for an error message.

    ``str(obj)[:n]`` would first build the whole text of a 30 MB subtree (or recurse
    through a deep one); this walks at most a few levels and a few items of each.
    """
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxstring, r.maxother = 3, 4, 4, 4, limit, limit
    try:
        text = r.repr(obj)
    except (RecursionError, ValueError):  # pragma: no cover - reprlib is bounded by maxlevel
        text = f"<{type(obj).__name__}>"
    return text[:limit]


class RefBudget:
    """The cost model of a general companion's tensor references (docs/FORMAT.md, "References").

    A valid companion names each tensor of the file once, plus once for each
    alias of it (tied weights: ``aliases`` maps alias key -> stored key). A
    plain reference resolves to the tensor itself (no copy), a raw one to a view
    of its bytes, a list reference expands it into Python ints once: so the
    state a companion can build is bounded by the tensor file it verified
    (each int64 of a list: ~40 bytes of Python ints), whatever the companion
    says. :meth:`use` is called for each reference *before* it is resolved and
    refuses a key named more often than that with a :class:`SchemaError`
    (an :class:`IntegrityError`: a resume falls back to the previous generation).
    """

    def __init__(self, tensors: Mapping[str, Any], aliases: Mapping[str, str], path: Path | None = None) -> None:
        self.allowed: dict[str, int] = dict.fromkeys(tensors, 1)
        for target in aliases.values():
            if target in self.allowed:
                self.allowed[target] += 1
        self.uses: dict[str, int] = {}
        self.path = path

    def use(self, key: str, where: str) -> None:
        n = self.uses.get(key, 0) + 1
        allowed = self.allowed.get(key, 0)
        if n > allowed:
            raise SchemaError(f"{where}: tensor {brief(key, 80)} is referenced more often than the schema allows",
                              file=self.path, expected=f"at most {allowed} reference(s) (once, plus once per alias)",
                              found=f"reference number {n}",
                              hint="a companion that names one tensor many times was not written by ripresa "
                                   "(it would expand one stored tensor many times over); this generation is not used")
        self.uses[key] = n


class _Frame:
    """One container being decoded by :func:`decode_tree` (its explicit stack replaces recursion)."""

    __slots__ = ("kind", "out", "items", "depth", "key")

    def __init__(self, kind: str, out: Any, items: Any, depth: int) -> None:
        self.kind, self.out, self.items, self.depth, self.key = kind, out, items, depth, None


def _dict_pairs(pairs: list[Any], where: str) -> Any:
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) not in (str, int):
            raise SchemaError(f"{where}: malformed dict entry", expected="[str or int key, value]", found=brief(pair))
        yield pair[0], f"{where}.{pair[0]}", pair[1]


def decode_tree(obj: Any, where: str = "companion", *, refs: Callable[[dict[str, Any], str], Any] | None = None) -> Any:
    """Inverse of :func:`encode_tree`, validating every tagged node.

    Raises only :class:`SchemaError` (an :class:`IntegrityError`): a tree
    nested deeper than :data:`MAX_DEPTH`, a tagged node of the wrong form, a
    ``__dict__`` whose entries are not ``[key, value]`` pairs with str/int keys.
    ``refs(node, where)``, when given, decodes each ``{"__ref__": key, ...}``
    node (a tensor of a general generation's tensor file); without it such a
    node is an error. Iterative (an explicit stack, no recursion): however the
    tree is shaped, no ``RecursionError`` can escape.
    """

    def start(node: Any, at: str, depth: int) -> tuple[bool, Any]:
        """(True, value) for a leaf or tagged node, (False, frame) for a container to walk."""
        if depth > MAX_DEPTH:
            raise SchemaError(f"{at}: nested too deeply", expected=f"<= {MAX_DEPTH} levels")
        if isinstance(node, dict):
            if "__tensor__" in node:
                return True, decode_tensor(node, at)
            if "__ref__" in node:
                if refs is None:
                    raise SchemaError(f"{at}: a tensor reference outside a general generation", found=brief(node))
                return True, refs(node, at)
            if "__tuple__" in node:
                items = node["__tuple__"]
                if not isinstance(items, list) or len(node) != 1:
                    raise SchemaError(f"{at}: malformed tuple", expected='{"__tuple__": [...]}', found=brief(node))
                return False, _Frame("tuple", [], ((None, at, v) for v in items), depth)
            if "__dict__" in node:
                pairs = node["__dict__"]
                if not isinstance(pairs, list) or len(node) != 1:
                    raise SchemaError(f"{at}: malformed dict", expected='{"__dict__": [[key, value], ...]}',
                                      found=brief(node))
                return False, _Frame("dict", {}, _dict_pairs(pairs, at), depth)
            return False, _Frame("dict", {}, ((k, f"{at}.{k}", v) for k, v in node.items()), depth)
        if isinstance(node, list):
            return False, _Frame("list", [], ((None, at, v) for v in node), depth)
        if isinstance(node, float | int | str | bool) or node is None:
            return True, node
        raise SchemaError(f"{at}: not a JSON value", found=type(node).__name__)

    def store(frame: _Frame, key: Any, value: Any) -> None:
        if frame.kind == "dict":
            frame.out[key] = value
        else:
            frame.out.append(value)

    leaf, first = start(obj, where, 0)
    if leaf:
        return first
    stack: list[_Frame] = [first]
    end = object()
    while True:
        frame = stack[-1]
        item = next(frame.items, end)
        if item is end:
            stack.pop()
            value = tuple(frame.out) if frame.kind == "tuple" else frame.out
            if not stack:
                return value
            store(stack[-1], frame.key, value)
            continue
        key, at, child = item
        leaf, got = start(child, at, frame.depth + 1)
        if leaf:
            store(frame, key, got)
        else:
            got.key = key
            stack.append(got)


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
