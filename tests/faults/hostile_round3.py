"""The hostile-folder fuzzer's families of issue #29, round three (docs/FAULTS.md, section 9).

Mutations of the fixtures of :mod:`faults.hostile_folders` (same signature: folder, target, rng,
context), each doing what an attacker without the run key can (every plain sha256 recomputed):

* ``linked_shards`` / ``copied_shards`` / ``linked_dcp`` (:data:`F_PIECES`): many bounded pieces
  adding up — every shard name of a ``.shards`` generation a hard link of one shard whose
  ``__metadata__`` is padded, or copies of it whose headers together pass the generation's budget;
  two files of a ``.dcp`` generation one inode;
* ``zero_shape`` (:data:`F_SHAPE`): a zero-byte tensor of astronomic dimensions (``[0, 2**64]``, ...)
  in every shape-bearing file: a general ``.safetensors`` (companion resealed), a shard of a
  ``.shards`` generation (companion and index made to agree), a companion's tagged tensor (a run's
  or a mirror's ``step_N.json``), a ``.dcp`` ``.metadata`` (an entry added);
* ``bad_number`` (:data:`F_NUMBERS`): NaN, ±Infinity, 2.5, 10**400, -10**4000 in a numeric field of
  every run-folder JSON file (config.json, .state.json, companions, a mirror's run.json,
  retention_metrics.json planted) and a history line.

The default tier samples one case per family (:data:`SAMPLE_ROUND_THREE`); the large pads and the
copies run in the whole matrix only (``RIPRESA_FAULTS_FULL=1``, ``make test-faults``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import struct
from pathlib import Path
from typing import Any

from faults.common import FULL

F_PIECES = "hostile folders: pieces adding up (hard links, huge totals)"
F_SHAPE = "hostile folders: zero-byte tensors of astronomic shapes"
F_NUMBERS = "hostile folders: numbers beyond range in run-folder files"
FAMILIES = (F_PIECES, F_SHAPE, F_NUMBERS)
WHAT = {
    F_PIECES: "every shard name of a .shards generation a hard link of one shard with a padded __metadata__ "
              "(1 MiB; 61 MiB x 38 in the full matrix) or copies of it past the headers' budget, two .dcp files "
              "one inode: refused (the inode rule, the budget across pieces), RSS bounded",
    F_SHAPE: "a zero-byte tensor of shape [0, 2**64] / [7, 0, 2**62] / [0, 2**16 x 4] in a general .safetensors, "
             "a shard, a companion's tagged tensor (run and mirror), a .dcp .metadata: a typed error, never the "
             "last-resort report; a mirror pull lands nothing it did not verify",
    F_NUMBERS: "NaN, +-Infinity, 2.5, 10**400, -10**4000 in config.json, .state.json, companions, the mirror's "
               "run.json, retention_metrics.json and a history line: a typed error or a skipped value",
}
SHAPES = ([0, 2**64], [7, 0, 2**62], [0] + [2**16] * 4)
NUMBERS = ("NaN", "Infinity", "-Infinity", "2.5", "1" + "0" * 400, "-" + "9" * 4000)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _remark(folder: Path) -> None:
    """Every line of every commit marker of ``folder`` rewritten with the sha256 of the file it names."""
    for marker in sorted(folder.rglob("*.sha256")):
        if marker.is_symlink() or not marker.is_file():
            continue
        out = []
        for line in marker.read_text(errors="replace").splitlines():
            m = re.match(r"^([0-9a-f]{64})( [ *])(.+)$", line)
            target = marker.parent / m.group(3) if m else None
            if m and target is not None and target.is_file() and not target.is_symlink():
                line = f"{_sha(target)}{m.group(2)}{m.group(3)}"
            out.append(line)
        marker.write_text("\n".join(out) + "\n")


def _header(p: Path) -> tuple[dict, bytes]:
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(p: Path, head: dict, data: bytes) -> None:
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % 8)
    tmp = p.with_name(p.name + ".new")
    tmp.write_bytes(struct.pack("<Q", len(text)) + text + data)
    os.replace(tmp, p)


def _shards_agree(d: Path, names: list[str]) -> None:
    """The companion's shard records and the index made to say what the shard files ``names`` say."""
    comp = d / "companion.json"
    doc = json.loads(comp.read_text())
    recs, weight_map, total = [], {}, 0
    for n in names:
        head, data = _header(d / n)
        keys = [k for k in head if k != "__metadata__"]
        recs.append({"name": n, "sha256": _sha(d / n), "size": (d / n).stat().st_size, "count": len(keys)})
        weight_map.update(dict.fromkeys(keys, n))
        total += len(data)
    doc["tensors"]["shards"], doc["tensors"]["count"] = recs, sum(r["count"] for r in recs)
    comp.write_text(json.dumps(doc, separators=(",", ":")))
    index = {"metadata": {"total_size": total, "format": doc["format"], "step": str(doc["tensors"]["step"])},
             "weight_map": {**weight_map, **{a: weight_map[t] for a, t in doc["aliases"].items() if t in weight_map}}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _many_shards(folder: Path, rel: str, rng: random.Random, *, links: bool) -> str:
    d = folder / rel.split("/")[0]
    old = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    first = d / old[0]
    head, data = _header(first)
    if links:
        k, pad = (38, 61 << 20) if FULL and rng.random() < 0.5 else (rng.choice([3, 8]), 1 << 20)
    else:
        k, pad = (3, 40 << 20) if FULL else (2, 1 << 20)
    head["__metadata__"]["pad"] = "p" * pad
    for n in old:
        os.unlink(d / n)
    names = [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    _write_st(d / names[0], head, data)
    for n in names[1:]:
        if links:
            os.link(d / names[0], d / n)
        else:
            (d / n).write_bytes((d / names[0]).read_bytes())
    _shards_agree(d, names)
    marker = folder / (d.name + ".sha256")
    marker.write_text("".join(f"{_sha(d / n)}  {d.name}/{n}\n" for n in sorted(os.listdir(d))))
    return f"{k} shard names, {'hard links of' if links else 'copies of'} one shard with a {pad >> 20} MiB " \
           f"__metadata__, companion/index/marker recomputed"


def m_linked_shards(folder: Path, rel: str, rng: random.Random, ctx: Any) -> str:
    return _many_shards(folder, rel, rng, links=True)


def m_copied_shards(folder: Path, rel: str, rng: random.Random, ctx: Any) -> str:
    return _many_shards(folder, rel, rng, links=False)


def m_linked_dcp(folder: Path, rel: str, rng: random.Random, ctx: Any) -> str:
    """One file of a .dcp generation replaced by a hard link of another of its files; marker recomputed."""
    d = folder / rel.split("/")[0]
    names = sorted(os.listdir(d))
    src, dst = rng.sample(names, 2)
    os.unlink(d / dst)
    os.link(d / src, d / dst)
    _remark(folder)
    return f"{dst} a hard link of {src}, marker recomputed"


def m_zero_shape(folder: Path, rel: str, rng: random.Random, ctx: Any) -> str:
    """A zero-byte tensor of an astronomic shape in the shape-bearing file ``rel``; everything resealed."""
    p = folder / rel
    shape = rng.choice(SHAPES)
    if p.name.endswith(".safetensors"):
        head, data = _header(p)
        head["zz_zero"] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data)]}
        _write_st(p, head, data)
        if p.parent.name.endswith(".shards"):
            _shards_agree(p.parent, sorted(n for n in os.listdir(p.parent) if n.endswith(".safetensors")))
        else:
            comp = p.with_name(p.name + ".json")
            doc = json.loads(comp.read_text())
            doc["tensors"].update(sha256=_sha(p), size=p.stat().st_size, count=doc["tensors"]["count"] + 1)
            comp.write_text(json.dumps(doc, separators=(",", ":")))
        _remark(folder)
        return f"tensor zz_zero of shape {shape} and zero bytes, companion and marker recomputed"
    if p.name == ".metadata":
        import torch
        from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

        md = pickle.loads(p.read_bytes())  # the fixture's own file (trusted here), written back with one entry more
        md.state_dict_metadata["zz_zero"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                  torch.Size(shape if shape[1] < 2**63 else [0, 2**62]),
                                                                  [])
        p.write_bytes(pickle.dumps(md))
        comp = p.parent / "ripresa.json"
        doc = json.loads(comp.read_text())
        doc["files"][".metadata"] = p.stat().st_size
        comp.write_text(json.dumps(doc, separators=(",", ":")))
        _remark(folder)
        return f".metadata entry zz_zero of shape {list(md.state_dict_metadata['zz_zero'].size)}, marker recomputed"
    text = p.read_text()
    new, n = re.subn(r'"shape":\[[^\]]*\],"data":\[[^\]]*\]', '"shape":' + json.dumps(shape).replace(" ", "")
                     + ',"data":[]', text, count=1)
    if not n:
        return m_bad_number(folder, rel, rng, ctx)
    p.write_text(new)
    _remark(folder)
    return f"first tagged tensor: shape {shape}, no data, marker recomputed"


def _numeric_paths(doc: Any, limit: int = 400) -> list[tuple]:
    out: list[tuple] = []
    stack: list[tuple[Any, tuple]] = [(doc, ())]
    while stack and len(out) < limit:
        node, path = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, (*path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node[:64]))
        elif isinstance(node, int | float) and not isinstance(node, bool):
            out.append(path)
    return sorted(out, key=str)


def m_bad_number(folder: Path, rel: str, rng: random.Random, ctx: Any) -> str:
    """A number beyond range (NaN, ±Infinity, 2.5, 10**400, -10**4000) in a numeric field of ``rel``; the
    retention metrics file is planted when the run has none; a history gets a line; markers recomputed."""
    p = folder / rel
    num = rng.choice(NUMBERS)
    if rel.endswith(".jsonl"):
        key = rng.choice(["step", "loss", "tokens"])
        line = {"step": 3, "loss": 1.0, "tokens": 1024, "time": 1.0}
        text = json.dumps({**line, key: "@N@"}).replace('"@N@"', num)
        with open(p, "a") as f:
            f.write(text + "\n")
        _remark(folder)
        return f"history line with {key}={num[:20]}"
    if p.name == "retention_metrics.json" and not p.exists():
        p.write_text('{"schema": "ripresa.retention_metrics/1", "steps": {"4": {"val_loss": ' + num + "}}}\n")
        return f"retention_metrics.json planted with val_loss={num[:20]}"
    doc = json.loads(p.read_text())
    paths = _numeric_paths(doc)
    if not paths:
        return "no numeric field"
    path = rng.choice(paths)
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = "@N@"
    p.write_text(json.dumps(doc, separators=(",", ":")).replace('"@N@"', num))
    _remark(folder)
    return f"{'.'.join(map(str, path))[:80]} = {num[:20]}, markers recomputed"


MUTATIONS = {"linked_shards": m_linked_shards, "copied_shards": m_copied_shards, "linked_dcp": m_linked_dcp,
             "zero_shape": m_zero_shape, "bad_number": m_bad_number}

#: (family, fixture, mutation, target, commands) of round three; ``None`` commands: every reader of the target.
PLAN = (
    (F_PIECES, "shards", "linked_shards", "step_000004.shards/companion.json",
     ("inspect shards --deep --json", "inspect", "train --resume", "export", "convert")),
    (F_PIECES, "shards", "copied_shards", "step_000004.shards/companion.json",
     ("inspect shards --deep --json", "train --resume")),
    (F_PIECES, "dcp", "linked_dcp", "step_000004.dcp/ripresa.json", ("inspect", "convert", "train --resume")),
    (F_SHAPE, "gen", "zero_shape", "step_000004.safetensors", None),
    (F_SHAPE, "shards", "zero_shape", "step_000004.shards/model-00001-of-00002.safetensors",
     ("inspect shards --deep --json", "train --resume", "export", "convert")),
    (F_SHAPE, "run", "zero_shape", "step_000004.json", ("inspect bin --deep --json", "train --resume", "export")),
    (F_SHAPE, "mirror", "zero_shape", "m/step_000004.json", ("mirror pull (blank machine)",)),
    (F_SHAPE, "dcp", "zero_shape", "step_000004.dcp/.metadata", None),
    (F_NUMBERS, "run", "bad_number", "config.json", ("train --run", "fork", "export")),
    (F_NUMBERS, "run", "bad_number", ".state.json", None),
    (F_NUMBERS, "run", "bad_number", ".loss.jsonl", ("plot", "inspect", "train --run")),
    (F_NUMBERS, "run", "bad_number", "step_000004.json", ("inspect bin --deep --json", "train --resume")),
    (F_NUMBERS, "run", "bad_number", "retention_metrics.json", ("train --run",)),
    (F_NUMBERS, "mirror", "bad_number", "m/run.json", ("mirror pull (blank machine)",)),
    (F_NUMBERS, "shards", "bad_number", "step_000004.shards/companion.json", ("inspect shards --deep --json",)),
)

#: (fixture, mutation, command) of round three that must refuse (exit 1 or 2).
MUST_REFUSE = {
    ("shards", "linked_shards", "inspect shards --deep --json"), ("shards", "copied_shards", "inspect shards --deep --json"),
    ("dcp", "linked_dcp", "convert"), ("gen", "zero_shape", "inspect file --deep --json"),
    ("shards", "zero_shape", "inspect shards --deep --json"), ("shards", "zero_shape", "convert"),
}

#: One cheap, telling case of each family in the default sample.
SAMPLE_ROUND_THREE = (
    (F_PIECES, "linked_shards", "inspect shards --deep --json"),
    (F_SHAPE, "zero_shape", "inspect file --deep --json"),
    (F_NUMBERS, "bad_number", "train --run"),
)


def cases(commands: dict[str, dict[str, Any]], readers, rng: random.Random) -> list[tuple[str, str, str, str, str]]:
    """(family, fixture, mutation, target, command) of every round-three case; ``readers(kind, target)`` lists
    the commands of a fixture that read a target."""
    out = []
    for fam, kind, mutation, target, cmds in PLAN:
        names = list(cmds) if cmds is not None else readers(kind, target)
        for c in names:
            if c in commands[kind]:
                out.append((fam, kind, mutation, target, c))
    return out


#: The refusal a pieces case must name, by mutation, for the commands that read the generation whole.
REASONS = {"linked_shards": "two names of one file", "linked_dcp": "two names of one file",
           **({"copied_shards": "exceed their budget"} if FULL else {})}  # the default's 2 small copies fit it


def check(mutation: str, command: str, rc: int, text: str, out_dir: Path) -> list[str]:
    """The round-three post-conditions beyond the fuzzer's generic ones: a pieces case names the inode rule
    or the budget (not some later symptom: the memory was taken by then); a pull leaves no unverified
    generation in the new run folder."""
    problems = []
    flat = " ".join(text.split())
    want = REASONS.get(mutation)
    if want is not None and command in READS_WHOLE and want not in flat:
        problems.append(f"REASON: the refusal does not name {want!r} (rc={rc})")
    if mutation == "zero_shape" and "(blank machine)" in command:
        blank = out_dir / "blank"
        left = sorted(n for n in os.listdir(blank) if n.startswith("step_000004") or "partial" in n) \
            if blank.is_dir() else []
        if left:
            problems.append(f"LANDED: the pull left {left[:4]} in the new run folder")
    return problems


#: Commands whose output names why the crafted generation is not used.
READS_WHOLE = ("inspect shards --deep --json", "convert", "train --resume", "export")
