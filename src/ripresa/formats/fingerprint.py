"""The state fingerprint: one Merkle hash of a training state whatever its layout (docs/FORMAT.md, "The state
fingerprint"; docs/INSPECT.md, "The state fingerprint").

The state is first given canonical names (:func:`canonical_leaves`), then hashed by :mod:`ripresa.io.merkle`:

* ``model/<state_dict name>`` — every tensor of the model's ``state_dict`` (parameters and buffers; a tied weight
  under each of its names);
* ``optimizer/<parameter name>/<entry>`` — each per-parameter optimizer tensor but the step (``exp_avg``,
  ``exp_avg_sq``, ``momentum_buffer``, ...), keyed by the parameter's *name*, never its index;
* ``steps/<parameter name>`` — each per-parameter step counter;
* ``hyper/<group>`` — each parameter group's hyper-parameters, its ``params`` as names;
* ``progress``, ``scheduler``, ``scaler``, ``data``, ``objects``, ``rng``, ``extra``: their tensors by path
  (components as in the general format's keys), their other values as canonical JSON leaves;
* ``identity/...`` — config, versions, code and data identity, lineage.

A part is the first component of a name; the fingerprint holds the root (over every leaf) and one digest per part,
so two layouts that hold different parts (a ``.bin`` has no random streams) still say "same weights and moments".
:func:`fingerprint_state` hashes a mapping of canonical names already made (the probe's live tensors);
:func:`fingerprint_snapshot` a ``TrainingState.snapshot()``-schema state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import IntegrityError
from ..io.merkle import FileRange, Leaf, leaf_digests, node_digest
from .general import key_of

#: Parts in the order they are shown (any other part follows, sorted).
PARTS = ("model", "optimizer", "steps", "hyper", "progress", "scheduler", "scaler", "data", "objects", "rng",
         "extra", "identity")
#: Top-level keys of a saved state that describe the layout, not the state: never hashed.
SKIPPED = ("format", "format_version", "optimizer_params")
#: Top-level keys gathered under ``identity/``.
IDENTITY = ("config", "versions", "code", "data_identity", "lineage")
#: The short form of a digest shown beside each part (hex characters).
SHORT = 16


@dataclass(frozen=True)
class Fingerprint:
    """The fingerprint of one state: ``root`` (hex sha256 over every leaf), ``parts`` (part -> hex digest),
    ``leaves`` (name -> hex digest), ``counts`` and ``nbytes`` per part, and ``notes`` (how names were made)."""

    root: str
    parts: dict[str, str]
    leaves: dict[str, str]
    counts: dict[str, int]
    nbytes: dict[str, int]
    notes: tuple[str, ...] = ()
    layout: str = "state"

    def same_parts(self, other: Fingerprint) -> list[str]:
        """The parts both hold with equal digests."""
        return [p for p in self.parts if other.parts.get(p) == self.parts[p]]

    def differences(self, other: Fingerprint) -> list[str]:
        """Leaf names that differ (or that one holds and not the other) within the parts both hold; sorted."""
        common = set(self.parts) & set(other.parts)
        names = {n for n in (set(self.leaves) | set(other.leaves)) if part_of(n) in common}
        return sorted(n for n in names if self.leaves.get(n) != other.leaves.get(n))

    def compare(self, other: Fingerprint, *, named: int = 5) -> dict[str, Any]:
        """Which parts both hold, which are equal, which differ (their first ``named`` differing value names),
        which only one holds; ``same_state``: every part both hold is equal."""
        both = [p for p in self.parts if p in other.parts]
        diff = self.differences(other)
        differ = {p: [n for n in diff if part_of(n) == p][:named] for p in both if self.parts[p] != other.parts[p]}
        return {"same_root": self.root == other.root, "same_parts": [p for p in both if p not in differ],
                "differ": differ, "only_first": [p for p in self.parts if p not in other.parts],
                "only_second": [p for p in other.parts if p not in self.parts], "same_state": not differ}

    def verdict(self, other: Fingerprint) -> str:
        """One line for ``verify`` and the probe: ``same state ...`` or ``different state: part P differs first
        (value names)``."""
        c = self.compare(other)
        if c["same_root"]:
            return f"same state (fingerprint {self.root[:SHORT]}, every part equal)"
        if c["same_state"]:
            return (f"same state in the parts both hold ({', '.join(c['same_parts'])}; fingerprints "
                    f"{self.root[:SHORT]} and {other.root[:SHORT]} differ by the parts only one holds)")
        first = next(iter(c["differ"]))
        return (f"different state: part {first} differs first ({', '.join(c['differ'][first]) or 'its values'}); "
                f"equal: {', '.join(c['same_parts']) or 'none'}")

    def line(self) -> str:
        """One line: the root and each part's short digest."""
        parts = " ".join(f"{p}={d[:SHORT]}" for p, d in self.parts.items())
        return f"{self.root} ({parts})"

    def as_dict(self, *, leaves: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"root": self.root, "layout": self.layout, "parts": dict(self.parts),
                             "counts": dict(self.counts), "bytes": dict(self.nbytes), "notes": list(self.notes)}
        if leaves:
            d["leaves"] = dict(self.leaves)
        return d


def part_of(name: str) -> str:
    return name.split("/", 1)[0]


def _order(parts: Sequence[str]) -> list[str]:
    known = [p for p in PARTS if p in parts]
    return known + sorted(set(parts) - set(known))


# ---- values -> leaves --------------------------------------------------------------


def _plain(v: Any) -> Any:
    """A JSON-able form of a non-tensor value, the same whatever the layout decoded it as (tuples as lists, dict
    keys as ``[key, value]`` pairs sorted by their JSON, non-finite floats as strings)."""
    if isinstance(v, bool) or v is None or isinstance(v, str | int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, Mapping):
        pairs = [[_plain(k), _plain(x)] for k, x in v.items()]
        return {"__map__": sorted(pairs, key=lambda p: json.dumps(p[0], sort_keys=True))}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, bytes):
        return {"__bytes__": v.hex()}
    return {"__repr__": type(v).__name__}


def json_leaf(name: str, value: Any) -> Leaf:
    raw = json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return Leaf(name, "json", (), [memoryview(raw)])


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def tensor_leaf(name: str, t: torch.Tensor, sources: Mapping[int, Sequence[FileRange]] | None = None) -> Leaf:
    """A tensor's leaf: its bytes in row-major order; a placeholder (``id`` in ``sources``) stands for file ranges."""
    if sources is not None and id(t) in sources:
        return Leaf(name, dtype_name(t.dtype), tuple(t.shape), list(sources[id(t)]))
    try:
        if t.is_meta or t.layout != torch.strided:
            raise TypeError(f"a {'meta' if t.is_meta else str(t.layout)} tensor has no bytes to hash")
        c = t.detach()
        if c.device.type != "cpu":
            c = c.to("cpu")
        c = c.contiguous()
        if c.numel() == 0:
            return Leaf(name, dtype_name(t.dtype), tuple(t.shape), [])
        raw = c.reshape(-1).view(torch.uint8)
        return Leaf(name, dtype_name(t.dtype), tuple(t.shape), [memoryview(raw.numpy()).cast("B")])
    except (TypeError, RuntimeError, NotImplementedError) as exc:
        raise IntegrityError(f"the bytes of {name!r} cannot be read", expected="a dense tensor",
                             found=f"{type(exc).__name__}: {str(exc)[:160]}",
                             hint="a tensor ripresa and torch's checkpoints never hold (sparse, quantized, meta)") from None


def _walk(prefix: str, path: tuple[Any, ...], node: Any, out: list[tuple[str, Any]]) -> None:
    """Tensors at their path; a subtree without tensors as one value."""
    name = prefix + ("/" + key_of(path) if path else "")
    if isinstance(node, torch.Tensor):
        out.append((name, node))
        return
    if isinstance(node, Mapping) and _has_tensor(node):
        for k, v in node.items():
            _walk(prefix, (*path, k), v, out)
        return
    if isinstance(node, list | tuple) and _has_tensor(node):
        for i, v in enumerate(node):
            _walk(prefix, (*path, i), v, out)
        return
    out.append((name, node))


def _has_tensor(node: Any, depth: int = 0) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if depth > 64:
        return False
    if isinstance(node, Mapping):
        return any(_has_tensor(v, depth + 1) for v in node.values())
    if isinstance(node, list | tuple):
        return any(_has_tensor(v, depth + 1) for v in node)
    return False


def optimizer_names(state: Mapping[str, Any], param_names: Sequence[str] | None = None) -> tuple[dict[Any, str], list[str]]:
    """Index of the optimizer's ``state_dict`` -> parameter name, and notes.

    From, in order: ``param_names`` (the names in the optimizer's order, e.g. from the live model), the saved
    ``optimizer_params`` record, the param groups' own ``param_names`` (torch's named optimizers). An index none of
    them names is named ``@<index>`` (positional) and said in the notes; a name key (a ``.dcp``) is its own name.
    """
    names: dict[Any, str] = {}
    notes: list[str] = []
    opt = state.get("optimizer") or {}
    groups = opt.get("param_groups") if isinstance(opt, Mapping) else None
    order = [i for g in groups for i in g.get("params", [])] if isinstance(groups, list) else []
    if param_names is not None:
        names.update({i: n for i, n in zip(order or range(len(param_names)), param_names, strict=False)})
    rec = state.get("optimizer_params")
    if isinstance(rec, list):
        for r in rec:
            if isinstance(r, Mapping) and isinstance(r.get("name"), str) and not r["name"].startswith("#"):
                names.setdefault(r.get("index"), r["name"])
    if isinstance(groups, list):
        for g in groups:
            pn = g.get("param_names") if isinstance(g, Mapping) else None
            if isinstance(pn, list) and len(pn) == len(g.get("params", [])):
                for i, n in zip(g["params"], pn, strict=True):
                    if isinstance(n, str):
                        names.setdefault(i, n)
    st = opt.get("state") if isinstance(opt, Mapping) else None
    keys = list(st) if isinstance(st, Mapping) else []
    unnamed = [k for k in [*keys, *order] if not isinstance(k, str) and k not in names]
    if unnamed:
        notes.append(f"{len(set(unnamed))} optimizer entr{'y' if len(set(unnamed)) == 1 else 'ies'} named by position "
                     "(@index): the layout does not say which parameter each belongs to")
    return names, notes


def canonical_items(state: Mapping[str, Any], *, param_names: Sequence[str] | None = None) -> tuple[list[tuple[str, Any]], list[str]]:
    """(canonical name, tensor or value) of a saved state (the ``checkpoint.pt`` schema, docs/FORMAT.md), and notes.

    The optimizer's ``state`` may be keyed by index (named through :func:`optimizer_names`) or by parameter name
    (a ``.dcp``). Keys of :data:`SKIPPED` are not hashed.
    """
    out: list[tuple[str, Any]] = []
    names, notes = optimizer_names(state, param_names)

    def pname(k: Any) -> str:
        if isinstance(k, str):
            return k
        return names.get(k, f"@{k}")

    for top, value in state.items():
        if top in SKIPPED:
            continue
        if top == "model":
            for k, v in (value or {}).items():
                out.append((f"model/{k}", v))
        elif top == "optimizer":
            if not isinstance(value, Mapping):
                continue
            for k, entry in (value.get("state") or {}).items():
                for e, v in (entry or {}).items():
                    out.append((f"steps/{pname(k)}" if e == "step" else f"optimizer/{pname(k)}/{e}", v))
            for gi, g in enumerate(value.get("param_groups") or []):
                g = dict(g)
                g["params"] = [pname(i) for i in g.get("params", [])]
                g.pop("param_names", None)
                out.append((f"hyper/{gi}", g))
        elif top in IDENTITY:
            _walk(f"identity/{top}", (), value, out)
        else:
            _walk(str(top), (), value, out)
    return out, notes


def canonical_leaves(items: Sequence[tuple[str, Any]], sources: Mapping[int, Sequence[FileRange]] | None = None) -> list[Leaf]:
    """Leaves of (name, value) pairs; two values under one name are refused (``ValueError``)."""
    leaves: list[Leaf] = []
    seen: set[str] = set()
    for name, v in items:
        if name in seen:
            raise ValueError(f"two values of the state are named {name!r}")
        seen.add(name)
        leaves.append(tensor_leaf(name, v, sources) if isinstance(v, torch.Tensor) else json_leaf(name, v))
    return leaves


def fingerprint_leaves(leaves: Sequence[Leaf], *, threads: int | None = None, notes: Sequence[str] = (),
                       layout: str = "state", progress: Callable[[int], None] | None = None) -> Fingerprint:
    """The :class:`Fingerprint` of ``leaves`` (root over all, one node per part)."""
    digests = leaf_digests(leaves, threads=threads, progress=progress)
    named = [(leaf.name, d) for leaf, d in zip(leaves, digests, strict=True)]
    by_part: dict[str, list[tuple[str, bytes]]] = {}
    nbytes: dict[str, int] = {}
    for leaf, (name, d) in zip(leaves, named, strict=True):
        p = part_of(name)
        by_part.setdefault(p, []).append((name, d))
        nbytes[p] = nbytes.get(p, 0) + leaf.nbytes
    order = _order(list(by_part))
    return Fingerprint(root=node_digest("root", named).hex(),
                       parts={p: node_digest(p, by_part[p]).hex() for p in order},
                       leaves={n: d.hex() for n, d in sorted(named)},
                       counts={p: len(by_part[p]) for p in order}, nbytes={p: nbytes[p] for p in order},
                       notes=tuple(notes), layout=layout)


def fingerprint_state(tensors: Mapping[str, Any], *, threads: int | None = None) -> Fingerprint:
    """The fingerprint of a mapping already in canonical names (``model/<name>``, ``optimizer/<param>/exp_avg``,
    ``steps/<param>``, ...: see the module doc); values are tensors (any device, any dtype) or JSON-able values."""
    return fingerprint_leaves(canonical_leaves(list(tensors.items())), threads=threads)


def fingerprint_snapshot(state: Mapping[str, Any], *, param_names: Sequence[str] | None = None,
                         threads: int | None = None) -> Fingerprint:
    """The fingerprint of a saved state (``TrainingState.snapshot()``, ``checkpoint.pt``'s dict, a loaded general
    generation). ``param_names``: the parameters' names in the optimizer's order, for a state without a record."""
    items, notes = canonical_items(state, param_names=param_names)
    return fingerprint_leaves(canonical_leaves(items), threads=threads, notes=notes)


def live_items(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Canonical names of a live model's ``state_dict`` and its optimizer's state (no copy): for
    :func:`fingerprint_state`, e.g. ``fingerprint_state(live_items(model, opt))`` after a step.
    Only the ``model``, ``optimizer``, ``steps`` and ``hyper`` parts."""
    state: dict[str, Any] = {"model": model.state_dict()}
    pnames: list[str] | None = None
    if optimizer is not None:
        by_id = {id(p): n for n, p in model.named_parameters()}
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        pnames = [by_id.get(id(p), f"@{i}") for i, p in enumerate(flat)]
        state["optimizer"] = optimizer.state_dict()
    items, _ = canonical_items(state, param_names=pnames)
    return dict(items)
