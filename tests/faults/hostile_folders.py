"""The hostile-folder fuzzer (issue #10): mutate real run folders, bundles and ledgers, run every CLI reader.

Real fixtures, built once by the real CLI (:func:`build_fixtures`):

* ``run``    — a signed (``RIPRESA_HMAC_KEY``) ``ripresa train --run`` folder: two
  generations (steps 2, 4), ``.bin.hmac`` signatures, history, ``.state.json``,
  ``config.json``, ``LOCK``;
* ``bundle`` — ``ripresa export run --to bundle``;
* ``ledger`` — ``ripresa generate run --inputs in.txt --out ledger/out.jsonl``;
* ``dcp``    — ``ripresa convert run/step_000004.bin dcp/step_000004.dcp`` (a real DCP generation);
* ``pt``     — ``examples/regression/train.py``'s ``checkpoint.pt`` folder.

A :class:`Case` is (family, fixture, mutation, target file, command, seed). Each
mutation is a function of (folder, target, rng, context) that returns a
description, so a failure replays from its seed (:func:`run_case`). The command
runs as a real subprocess in its own session, under a time limit (a hang kills
its process group and fails) and with its peak RSS measured by ``os.wait4``.

Checks (:func:`run_case` returns the list of violations, empty = survived):
no ``Traceback`` in its output; no hang; peak RSS under :data:`RSS_LIMIT`; exit in
{1, 2} where the command reads the mutated file and the integrity contract
demands a refusal (``Case.strict``), else in {0, 1, 2}; no file of the case's
private tree outside the folder changed (hash, size, mtime) and nothing new
there; the private file's content never appears in the command's output or in
any file it wrote; the canary of a crafted pickle never created; the unrelated
victim process never signalled.

``signal`` with a forged ``LOCK``: every case runs the child with
``start_new_session=True``; a LOCK naming anything but the dedicated victim (pid
0, -1, 1, huge, dead) runs it inside a fresh pid namespace (``unshare --pid
--fork``), so a wrong ``kill`` reaches nothing outside it; where no pid
namespace can be made, those cases are skipped (counted as not run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
REGRESSION = REPO / "examples" / "regression" / "train.py"
#: The ripresa sources the commands run (another tree's ``src`` to fuzz an older version: the fuzzer's own check).
SRC = Path(os.environ.get("RIPRESA_FUZZ_SRC", str(REPO / "src")))
#: The run fixture's signing key (hex, 32 bytes).
KEY = "5f" * 32
#: A command slower than this hangs (seconds).
TIMEOUT = float(os.environ.get("RIPRESA_FUZZ_TIMEOUT", "45"))
#: Peak resident memory above this is an allocation dictated by a file (bytes).
RSS_LIMIT = int(1.5 * (1 << 30))
#: Virtual memory safety net (torch reserves a lot of address space; the real check is RSS).
AS_LIMIT = 8 << 30
NEST = 100_000
HUGE = ("1e400", str(10**400), "-1", str(2**63))
FINDINGS = Path(os.environ.get("RIPRESA_FUZZ_FINDINGS", "/tmp/fuzz_findings.md"))

F_SPECIAL = "hostile folders: symlinks/FIFOs/special files"
F_DAMAGE = "hostile folders: bit flips/truncations/swaps"
F_NEST = "hostile folders: deep nesting"
F_HUGE = "hostile folders: huge numbers/sizes"
F_PICKLE = "hostile folders: crafted pickles"
F_EXEC = "hostile folders: code executed (must be 0)"
F_LOCK = "hostile folders: LOCK pids"
FAMILIES = (F_SPECIAL, F_DAMAGE, F_NEST, F_HUGE, F_PICKLE, F_LOCK)
WHAT = {
    F_SPECIAL: "every file replaced by a symlink (private file outside, /dev/zero, /dev/urandom), a FIFO, a folder, "
               "a socket, or deleted; every reader under a time and RSS limit, nothing outside touched or leaked",
    F_DAMAGE: "bit flips, truncations, swapped files in real run folders, bundles, ledgers, .dcp and checkpoint.pt",
    F_NEST: "100k '[' in companions, config, history, ledger, MANIFEST.json, .dcp companion, LOCK (markers recomputed)",
    F_HUGE: "1e400, 10**400, -1, 2**63 in companions, history lines, config.json, LOCK, temp-file names; "
            "huge world_size/n_params/shapes; a sparse 1 GiB history line",
    F_PICKLE: "a crafted pickle as DCP .metadata (its own folder, planted at a .bin run's newest step) and as "
              "checkpoint.pt's data.pkl, markers recomputed: refused, canary never created",
    F_EXEC: "crafted-pickle cases whose payload ran (canary file created)",
    F_LOCK: "LOCK naming pid 0, -1, 1, 2**40, huge, dead, a live unrelated process (local and 'another host'), "
            "with the lock held: `ripresa signal` and `ripresa pivot` refuse, nothing signalled",
}


# ====================================================================== fixtures

@dataclass
class Fixtures:
    root: Path
    run: Path
    bundle: Path
    ledger: Path
    inputs: Path
    dcp: Path
    pt: Path

    def folder(self, kind: str) -> Path:
        return {"run": self.run, "bundle": self.bundle, "ledger": self.ledger, "dcp": self.dcp,
                "pt": self.pt, "planted": self.run}[kind]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIPRESA_")}
    env.update(PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", COLUMNS="120", PYTHONPATH=str(SRC))
    env.update(extra or {})
    return env


def _must(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    res = subprocess.run(argv, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"fixture command failed: {argv}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"


def build_fixtures(root: Path) -> Fixtures:
    """Build every fixture with the real CLI under ``root`` (once per session)."""
    root.mkdir(parents=True, exist_ok=True)
    fx = Fixtures(root, root / "run", root / "bundle", root / "ledger", root / "in.txt", root / "dcp", root / "pt")
    rp = [PY, "-m", "ripresa"]
    _must([*rp, "train", "--run", "run", "--config", "tiny", "--steps", "4", "--every", "2", "--threads", "1",
           "--quiet", "--no-audit"], root, {"RIPRESA_HMAC_KEY": KEY})
    _must([*rp, "export", "run", "--to", "bundle", "--step", "4"], root)
    fx.inputs.write_text("def \nThe \nimport \n")
    fx.ledger.mkdir()
    _must([*rp, "generate", "run", "--inputs", "in.txt", "--out", "ledger/out.jsonl", "--step", "4",
           "--max-new-tokens", "3", "--threads", "1", "--quiet"], root)
    _must([*rp, "convert", "run/step_000004.bin", "dcp/step_000004.dcp"], root)
    _must([PY, "-B", str(REGRESSION), "--steps", "3", "--output", "pt"], root)
    return fx


# ====================================================================== context of one case

@dataclass
class Ctx:
    """The world outside the mutated folder: a private tree, a canary path, the victim process."""

    outside: Path
    private: Path
    token: str
    canary: Path
    fx: Fixtures
    victim_pid: int = 0
    dead_pid: int = 0


def make_outside(base: Path, rng: random.Random) -> tuple[Path, Path, str]:
    out = base / "outside"
    (out / "sub").mkdir(parents=True)
    token = f"PRIVATE-{rng.getrandbits(64):016x}-DO-NOT-LEAK"
    private = out / "private.txt"
    private.write_text(f"{token}\n" * 4)
    (out / "sub" / "keys.json").write_text(json.dumps({"secret": token}))
    (out / "sub" / "history.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "secret": token}) + "\n")
    return out, private, token


def snapshot(folder: Path) -> dict[str, tuple]:
    """(kind, size, mtime_ns, sha256) of everything under ``folder`` (never following links)."""
    snap: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = ""
            if p.is_file() and not p.is_symlink():
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            snap[str(p.relative_to(folder))] = (st.st_mode >> 12, st.st_size, st.st_mtime_ns, digest)
    return snap


# ====================================================================== resealing (an attacker recomputes plain sha256)

def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def reseal(folder: Path, rel: str, _depth: int = 0) -> None:
    """Recompute every plain-sha256 record of ``folder/rel`` (markers, MANIFEST, companions), as an attacker would."""
    target = folder / rel
    if _depth > 4 or target.is_symlink() or not target.is_file():
        return
    sha, size = _sha(target), target.stat().st_size
    for marker in sorted(folder.rglob("*.sha256")):
        if marker.is_symlink() or not marker.is_file() or marker == target:
            continue
        lines = marker.read_text(errors="replace").splitlines(keepends=True)
        changed = False
        for i, line in enumerate(lines):
            m = re.match(r"^([0-9a-f]{64})( [ *])(.+?)(\r?\n?)$", line)
            if m and (marker.parent / m.group(3)).resolve() == target.resolve():
                lines[i] = f"{sha}{m.group(2)}{m.group(3)}{m.group(4)}"
                changed = True
        if changed:
            marker.write_text("".join(lines))
            reseal(folder, str(marker.relative_to(folder)), _depth + 1)
    man = folder / "MANIFEST.json"
    if man.is_file() and not man.is_symlink() and rel != "MANIFEST.json":
        with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
            doc = json.loads(man.read_text())
            hit = False
            for ent in doc.get("files", []) if isinstance(doc, dict) else []:
                if isinstance(ent, dict) and ent.get("path") == rel:
                    ent["sha256"], ent["size"], hit = sha, size, True
            if hit:
                man.write_text(json.dumps(doc, indent=2) + "\n")
                reseal(folder, "MANIFEST.json", _depth + 1)
    if rel.endswith(".bin"):
        comp = target.with_suffix(".json")
        if comp.is_file() and not comp.is_symlink():
            with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
                doc = json.loads(comp.read_text())
                doc["bin"]["sha256"], doc["bin"]["size"] = sha, size
                comp.write_text(json.dumps(doc, separators=(",", ":")))
                reseal(folder, str(comp.relative_to(folder)), _depth + 1)
    if target.parent.name.endswith(".dcp") and target.name != "ripresa.json":
        comp = target.parent / "ripresa.json"
        if comp.is_file() and not comp.is_symlink():
            with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
                doc = json.loads(comp.read_text())
                if target.name in doc["files"]:
                    doc["files"][target.name] = size
                    comp.write_text(json.dumps(doc, separators=(",", ":")))
                    reseal(folder, str(comp.relative_to(folder)), _depth + 1)


# ====================================================================== mutations

Mutation = Callable[[Path, str, random.Random, Ctx], str]


def _replace_special(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        p.unlink()


def m_bitflip(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    data = bytearray(p.read_bytes())
    if not data:
        p.write_bytes(bytes([rng.randrange(256)]))
        return "empty file: wrote one random byte"
    bit = rng.randrange(len(data) * 8)
    data[bit // 8] ^= 1 << (bit % 8)
    p.write_bytes(bytes(data))
    return f"flipped bit {bit % 8} of byte {bit // 8}"


def m_truncate(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    size = p.stat().st_size
    new = rng.randrange(size) if size else 0
    os.truncate(p, new)
    return f"truncated {size} -> {new} bytes"


def m_swap(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    partner = None
    m = re.search(r"step_(\d+)", rel)
    if m:
        others = sorted(q for q in p.parent.iterdir() if q.name.replace(m.group(0), "") == p.name.replace(m.group(0), "") and q != p)
        partner = others[0] if others else None
    if partner is None:
        same = sorted(q for q in p.parent.iterdir() if q.is_file() and q != p and q.suffix == p.suffix)
        partner = same[0] if same else None
    if partner is None:
        same = sorted(q for q in p.parent.iterdir() if q.is_file() and q != p)
        partner = rng.choice(same) if same else None
    if partner is None:
        return m_truncate(folder, rel, rng, ctx)
    tmp = p.with_name(p.name + ".swap")
    os.rename(p, tmp)
    os.rename(partner, p)
    os.rename(tmp, partner)
    return f"swapped with {partner.relative_to(folder)}"


def m_delete(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    _replace_special(folder / rel)
    return "deleted"


def m_symlink_private(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    _replace_special(p)
    p.symlink_to(ctx.private)
    return f"symlink to a private file outside ({ctx.private})"


def m_symlink_devzero(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    _replace_special(p)
    p.symlink_to("/dev/zero")
    return "symlink to /dev/zero"


def m_symlink_urandom(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    _replace_special(p)
    p.symlink_to("/dev/urandom")
    return "symlink to /dev/urandom"


def m_fifo(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    _replace_special(p)
    os.mkfifo(p)
    return "FIFO (nobody writes)"


def m_folder(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    _replace_special(p)
    p.mkdir()
    (p / "x").write_text("x")
    return "a folder"


def m_socket(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    _replace_special(p)
    short = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(short / "s"))
        s.close()
        os.rename(short / "s", p)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    return "a unix socket (nobody listening)"


def _nested() -> str:
    return "[" * NEST + "]" * NEST


def m_nest(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """100k '[' inside the JSON (object: a first key; JSONL: a line; LOCK: the JSON line), markers recomputed."""
    p = folder / rel
    text = p.read_text(errors="replace")
    if rel.endswith(".jsonl"):
        lines = text.splitlines(keepends=True)
        i = rng.randrange(len(lines) + 1)
        lines.insert(i, '{"step": 1, "deep": ' + _nested() + "}\n")
        p.write_text("".join(lines))
        where = f"a line at {i}"
    elif p.name == "LOCK":
        p.write_text(f"{ctx.victim_pid or 99999999}\n" + '{"pid": 1, "argv": ' + _nested() + "}\n")
        where = "the JSON line"
    else:
        s = text.lstrip()
        if s.startswith("{") and s[1:].lstrip() != "}":
            p.write_text('{"deep": ' + _nested() + ", " + s[1:])
        else:
            p.write_text(_nested())
        where = "a first key"
    reseal(folder, rel)
    return f"100k nested '[' as {where}, markers recomputed"


#: Where a huge number goes in each kind of JSON file (paths of keys; '*' = the first key; '#n' = list index).
HUGE_PATHS = {
    "config.json": [("model", "n_embd"), ("model", "n_layer"), ("model", "vocab_size"), ("model", "block_size"),
                    ("model", "n_head"), ("train", "batch_size")],
    "companion": [("bin", "n_params"), ("bin", "size"), ("bin", "step"), ("state", "progress", "step"),
                  ("state", "progress", "tokens_seen"), ("state", "data", "batch_size"), ("state", "data", "block_size")],
    ".state.json": [("total_pulls",), ("phase",), ("steps_in_phase",), ("hyper", "temperature")],
    "ripresa.json": [("world_size",), ("n_params",), ("step",), ("files", ".metadata"), ("files", "__0_0.distcp")],
    "MANIFEST.json": [("files", "#1", "size"), ("step",), ("format_version",)],
    "meta": [],
}


def _numeric_paths(doc, prefix=(), out=None, limit=400):
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(doc, dict):
        for k, v in doc.items():
            _numeric_paths(v, (*prefix, k), out, limit)
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:50]):
            _numeric_paths(v, (*prefix, f"#{i}"), out, limit)
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        out.append(prefix)
    return out


def _set(doc, path, value) -> bool:
    cur = doc
    for k in path[:-1]:
        if isinstance(k, str) and k.startswith("#") and isinstance(cur, list):
            i = int(k[1:])
            if i >= len(cur):
                return False
            cur = cur[i]
        elif isinstance(cur, dict) and k in cur:
            cur = cur[k]
        else:
            return False
    last = path[-1]
    if isinstance(cur, dict) and last in cur:
        cur[last] = value
        return True
    return False


def _huge_kind(rel: str) -> str:
    name = Path(rel).name
    if re.fullmatch(r"step_\d+\.json", name):
        return "companion"
    if name.endswith(".meta.json"):
        return "meta"
    return name


def m_huge(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """A huge/negative number in a JSON file, a history line, LOCK, a .bin header; markers recomputed."""
    p = folder / rel
    num = rng.choice(HUGE)
    if rel.endswith(".jsonl"):
        key = rng.choice(["step", "loss", "tokens", "time", "id"])
        if key == "step":
            line = '{"step": ' + num + ', "loss": 1.0, "tokens": 1024, "time": 1.0}'
        else:
            line = '{"step": 3, "loss": 1.0, "' + key + '": ' + num + ', "time": 1.0, "id": 1}'
        with open(p, "a") as f:
            f.write(line + "\n")
        reseal(folder, rel)
        return f"history/ledger line with {key}={num[:20]}"
    if p.name == "LOCK":
        p.write_text(f"{num}\n" + json.dumps({"pid": 1, "hostname": socket.gethostname(), "started": 1.0}) + "\n")
        return f"LOCK naming pid {num[:20]}"
    if rel.endswith(".bin"):
        data = bytearray(p.read_bytes())
        which = rng.choice(["n_params", "step"])
        val = rng.choice([2**31 - 1, -1, -(2**31)])
        off = 4 if which == "n_params" else 0
        data[off:off + 4] = val.to_bytes(4, "little", signed=True)
        p.write_bytes(bytes(data))
        reseal(folder, rel)
        return f".bin header {which}={val}, markers recomputed"
    doc = json.loads(p.read_text())
    kind = _huge_kind(rel)
    paths = [q for q in HUGE_PATHS.get(kind, []) if _set(json.loads(json.dumps(doc)), q, 0)]
    if not paths:
        paths = _numeric_paths(doc)
    if not paths:
        return m_nest(folder, rel, rng, ctx)
    path = rng.choice(paths)
    _set(doc, path, "@@HUGE@@")
    p.write_text(json.dumps(doc, separators=(",", ":")).replace('"@@HUGE@@"', num))
    reseal(folder, rel)
    return f"{'.'.join(map(str, path))} = {num[:20]}, markers recomputed"


def m_huge_shape(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """A tagged tensor in a companion declaring a huge shape (data unchanged), markers recomputed."""
    p = folder / rel
    text = p.read_text()
    shape = rng.choice([[2**40, 2**40], [2**31, 2**31, 2**31], [-1, 4], [10**30]])
    new, n = re.subn(r'"shape":\[[^\]]*\]', '"shape":' + json.dumps(shape).replace(" ", ""), text, count=1)
    if not n:
        return m_huge(folder, rel, rng, ctx)
    p.write_text(new)
    reseal(folder, rel)
    return f"first tagged tensor's shape = {shape}, markers recomputed"


def m_sparse_line(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """A single 1 GiB line (sparse: a few KB on disk) appended to a JSONL file."""
    p = folder / rel
    with open(p, "ab") as f:
        f.write(b'{"step": 3, "loss": 1.0, "pad": "')
        f.flush()
        os.truncate(p, p.stat().st_size + (1 << 30))
    with open(p, "ab") as f:
        f.write(b'"}\n{"step": 4, "loss": 1.0}\n')
    return "a sparse 1 GiB line"


def m_temp_names(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """Leftover temporaries whose pid field is huge/negative (``fsio.temp_name_for``'s pattern)."""
    nums = [str(10**200), str(2**63), "-1", "0", "99999999999999999999"]
    made = []
    for num in nums:
        name = f".step_000004.bin.tmp.{num}.{rng.getrandbits(32):08x}"
        (folder / name).write_bytes(b"x" * 16)
        made.append(name[:40])
    return f"temporaries named {made}"


class _Payload:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _payload(ctx: Ctx) -> bytes:
    import pickle

    return pickle.dumps({"a": _Payload(os.makedirs, (str(ctx.canary),))}, protocol=2)


def m_pickle_metadata(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """DCP ``.metadata`` replaced by a pickle whose payload creates the canary; marker and companion recomputed."""
    p = folder / rel
    p.write_bytes(_payload(ctx))
    reseal(folder, rel)
    return "crafted pickle as .metadata (payload: os.makedirs(canary)), marker recomputed"


def m_plant_dcp(folder: Path, rel: str, rng: random.Random, ctx: Ctx, *, crafted: bool = True) -> str:
    """A .dcp generation planted at the newest step of a single-process .bin run (crafted .metadata)."""
    step = 6
    name = f"step_{step:06d}.dcp"
    src = ctx.fx.dcp / "step_000004.dcp"
    dst = folder / name
    shutil.copytree(src, dst)
    doc = json.loads((dst / "ripresa.json").read_text())
    doc["step"] = step
    if crafted:
        (dst / ".metadata").write_bytes(_payload(ctx))
        doc["files"][".metadata"] = (dst / ".metadata").stat().st_size
    (dst / "ripresa.json").write_text(json.dumps(doc, separators=(",", ":")))
    lines = [f"{_sha(dst / n)}  {name}/{n}\n" for n in sorted(os.listdir(dst))]
    (folder / f"{name}.sha256").write_text("".join(lines))
    return f"{'crafted' if crafted else 'valid'} .dcp planted at step {step} (newest), marker recomputed"


def m_pickle_pt(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """checkpoint.pt's data.pkl replaced by a pickle whose payload creates the canary; sidecar recomputed."""
    p = folder / rel
    src = zipfile.ZipFile(io.BytesIO(p.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            body = _payload(ctx) if info.filename.endswith("data.pkl") else src.read(info.filename)
            z.writestr(info.filename, body)
    p.write_bytes(out.getvalue())
    reseal(folder, rel)
    return "crafted data.pkl (payload: os.makedirs(canary)), sidecar recomputed"


def m_deflate_pt(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """checkpoint.pt re-zipped with one member deflated and padded to 1 GiB of zeros (about 1 MB on disk;
    torch never writes a compressed member); sidecar recomputed."""
    p = folder / rel
    src = zipfile.ZipFile(io.BytesIO(p.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        members = [i for i in src.infolist() if "/data/" in i.filename]
        big = members[rng.randrange(len(members))].filename if members else None
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename == big:
                zi = zipfile.ZipInfo(info.filename)
                zi.compress_type = zipfile.ZIP_DEFLATED
                with z.open(zi, "w", force_zip64=True) as w:
                    w.write(data)
                    chunk = bytes(1 << 24)
                    for _ in range(64):
                        w.write(chunk)
            else:
                z.writestr(info.filename, data)
    p.write_bytes(out.getvalue())
    reseal(folder, rel)
    return f"member {big} deflated to 1 GiB ({p.stat().st_size} bytes on disk), sidecar recomputed"


#: LOCK content variants: name -> (content maker, needs a pid namespace)
def _lock_text(pid: str, extra: dict | None = None) -> str:
    return f"{pid}\n" + (json.dumps(extra) + "\n" if extra is not None else "")


def m_lock(variant: str) -> Mutation:
    def mutate(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
        host = socket.gethostname()
        local = {"hostname": host, "started": time.time() - 60, "argv": ["ripresa", "train"]}
        v, d = ctx.victim_pid, ctx.dead_pid
        text = {
            "pid0": _lock_text("0", {"pid": 0, **local}),
            "pid-1": _lock_text("-1", {"pid": -1, **local}),
            "pid1": _lock_text("1", {"pid": 1, **local}),
            "pid2^40": _lock_text(str(2**40), {"pid": 2**40, **local}),
            "pid10^400": _lock_text(str(10**400), local),
            "pid_dead": _lock_text(str(d), {"pid": d, **local}),
            "victim_local": _lock_text(str(v), {"pid": v, **local}),
            "victim_other_host": _lock_text(str(v), {"pid": v, "hostname": "another-host.example", "started": 1.0,
                                                     "argv": ["ripresa", "train"]}),
            "victim_bare": _lock_text(str(v)),
        }[variant]
        (folder / rel).write_text(text)
        return f"LOCK content {text.splitlines()[0][:24]!r} ({variant}), lock held by the fuzzer"

    mutate.__name__ = f"m_lock_{variant}"
    return mutate


LOCK_VARIANTS = ("pid0", "pid-1", "pid1", "pid2^40", "pid10^400", "pid_dead", "victim_local", "victim_other_host",
                 "victim_bare")

MUTATIONS: dict[str, Mutation] = {
    "bitflip": m_bitflip, "truncate": m_truncate, "swap": m_swap,
    "delete": m_delete, "symlink_private": m_symlink_private, "symlink_devzero": m_symlink_devzero,
    "symlink_urandom": m_symlink_urandom, "fifo": m_fifo, "folder": m_folder, "socket": m_socket,
    "nest": m_nest, "huge": m_huge, "huge_shape": m_huge_shape, "sparse_line": m_sparse_line,
    "temp_names": m_temp_names, "pickle_metadata": m_pickle_metadata, "plant_dcp": m_plant_dcp,
    "pickle_pt": m_pickle_pt, "deflate_pt": m_deflate_pt,
    **{f"lock_{v}": m_lock(v) for v in LOCK_VARIANTS},
}
#: Mutations that recompute the plain-sha256 records (what an attacker does): hashes pass, parsers are reached.
RESEALED = ("nest", "huge", "huge_shape", "sparse_line", "temp_names")
SPECIAL = ("delete", "symlink_private", "symlink_devzero", "symlink_urandom", "fifo", "folder", "socket")
DAMAGE = ("bitflip", "truncate", "swap")


# ====================================================================== commands

@dataclass(frozen=True)
class Command:
    name: str
    argv: tuple[str, ...]          # {F} folder, {O} out, {RUN} pristine run, {IN} inputs
    reads: tuple[str, ...]         # regexes of target paths it reads
    strict: tuple[str, ...] = ()   # regexes of targets whose damage it must refuse (exit 1 or 2)
    parses: tuple[str, ...] = ()   # regexes of targets whose *content* it interprets: a resealed hostile value
                                   # (markers recomputed, so hashes pass) must still be refused there
    env: tuple[tuple[str, str], ...] = ()
    lock: bool = False             # hold the flock of F/LOCK while it runs


GEN4 = r"step_000004\.(bin|json|bin\.sha256|bin\.hmac)$"
GEN4_NOSIG = r"step_000004\.(bin|json|bin\.sha256)$"
GEN4_DATA = r"step_000004\.(bin|json)$"
CONFIG = r"^config\.json$"
ANY = r".*"
RIP = (PY, "-m", "ripresa")
TRAIN = ("--steps", "1", "--every", "1", "--threads", "1", "--quiet", "--no-audit")

BUNDLE_PARSED = (r"^MANIFEST\.json$", r"^checkpoint/step_000004\.(bin|json)$", CONFIG)
PT = r"^checkpoint\.pt$"

COMMANDS: dict[str, dict[str, Command]] = {
    "run": {c.name: c for c in [
        Command("inspect", (*RIP, "inspect", "{F}"), (ANY,)),
        Command("inspect --no-deep --json", (*RIP, "inspect", "{F}", "--no-deep", "--json"), (ANY,)),
        Command("inspect bin --deep --json", (*RIP, "inspect", "{F}/step_000004.bin", "--deep", "--json"), (GEN4,), (GEN4_NOSIG,),
                (GEN4_DATA,)),
        Command("train --run", (*RIP, "train", "--run", "{F}", *TRAIN), (ANY,), parses=(CONFIG,)),
        Command("train --resume --require-signature", (*RIP, "train", "--run", "{O}/new", "--resume", "{F}/step_000004.bin",
                                                       "--require-signature", *TRAIN),
                (GEN4, r"config\.json$"), (GEN4,), (GEN4_DATA,), (("RIPRESA_HMAC_KEY", KEY),)),
        Command("train --resume", (*RIP, "train", "--run", "{O}/new", "--resume", "{F}/step_000004.bin", *TRAIN),
                (GEN4, r"config\.json$"), (GEN4_NOSIG,), (GEN4_DATA,)),
        Command("fork", (*RIP, "fork", "{F}", "--step", "4", "--into", "{O}/fork"), (ANY,), (GEN4_NOSIG,), (GEN4_DATA, CONFIG)),
        Command("export", (*RIP, "export", "{F}", "--to", "{O}/bundle", "--step", "4"), (ANY,), (GEN4_NOSIG,),
                (GEN4_DATA, CONFIG)),
        Command("convert", (*RIP, "convert", "{F}/step_000004.bin", "{O}/x.pt"), (GEN4, r"config\.json$"), (GEN4_NOSIG,),
                (GEN4_DATA,)),
        Command("plot", (*RIP, "plot", "{F}", "--png", "{O}/p.png"), (r"\.loss\.jsonl$", r"\.state\.json$", r"config\.json$", r"step_.*\.json$")),
        Command("compare", (*RIP, "compare", "{F}", "{RUN}", "--json"), (r"\.loss\.jsonl$", r"config\.json$", r"step_")),
        Command("generate", (*RIP, "generate", "{F}", "--inputs", "{IN}", "--out", "{O}/o.jsonl", "--step", "4",
                             "--max-new-tokens", "2", "--threads", "1", "--quiet"), (GEN4, r"config\.json$"), (GEN4_NOSIG,),
                (GEN4_DATA, CONFIG)),
        Command("signal", (*RIP, "signal", "{F}", "checkpoint"), (r"LOCK$",), (r"LOCK$",), lock=True),
        Command("pivot", (*RIP, "pivot", "{F}", "--caps", "stdlib-code=0.5", "--timeout", "5"), (r"LOCK$",), (r"LOCK$",),
                lock=True),
    ]},
    "bundle": {c.name: c for c in [
        Command("export --verify", (*RIP, "export", "--verify", "{F}"), (ANY,), (ANY,), BUNDLE_PARSED),
        Command("export --verify --json", (*RIP, "export", "--verify", "{F}", "--json"), (ANY,), (ANY,), BUNDLE_PARSED),
        Command("inspect checkpoint", (*RIP, "inspect", "{F}/checkpoint", "--json"), (r"checkpoint/",)),
        Command("train --resume", (*RIP, "train", "--run", "{O}/new", "--resume", "{F}/checkpoint/step_000004.bin", *TRAIN),
                (r"checkpoint/",), (r"checkpoint/step_000004\.(bin|json|bin\.sha256)$",), (r"checkpoint/step_000004\.(bin|json)$",)),
    ]},
    "ledger": {c.name: c for c in [
        # the ledger's own settings (else generate refuses it as another job's before reading it)
        Command("generate", (*RIP, "generate", "{RUN}", "--inputs", "{IN}", "--out", "{F}/out.jsonl", "--step", "4",
                             "--max-new-tokens", "3", "--threads", "1", "--quiet"), (ANY,)),
    ]},
    "dcp": {c.name: c for c in [
        Command("inspect", (*RIP, "inspect", "{F}"), (ANY,)),
        Command("inspect --json", (*RIP, "inspect", "{F}", "--json"), (ANY,)),
        Command("convert", (*RIP, "convert", "{F}/step_000004.dcp", "{O}/step_000004.bin"), (ANY,), (ANY,), (ANY,)),
        Command("train --resume", (*RIP, "train", "--run", "{O}/new", "--resume", "{F}/step_000004.dcp", *TRAIN), (ANY,), (ANY,),
                (ANY,)),
    ]},
    "planted": {c.name: c for c in [
        Command("train --run", (*RIP, "train", "--run", "{F}", *TRAIN), (ANY,)),
        Command("inspect", (*RIP, "inspect", "{F}"), (ANY,)),
        Command("inspect --json", (*RIP, "inspect", "{F}", "--json"), (ANY,)),
        Command("export", (*RIP, "export", "{F}", "--to", "{O}/bundle"), (ANY,)),
        Command("convert", (*RIP, "convert", "{F}/step_000006.dcp", "{O}/step_000006.bin"), (ANY,), (ANY,), (ANY,)),
        Command("generate", (*RIP, "generate", "{F}", "--inputs", "{IN}", "--out", "{O}/o.jsonl",
                             "--max-new-tokens", "2", "--threads", "1", "--quiet"), (ANY,)),
    ]},
    "pt": {c.name: c for c in [
        Command("inspect", (*RIP, "inspect", "{F}/checkpoint.pt", "--json"), (ANY,), (r"checkpoint\.pt(\.sha256)?$",), (PT,)),
        Command("inspect folder", (*RIP, "inspect", "{F}"), (ANY,)),
        Command("convert", (*RIP, "convert", "{F}/checkpoint.pt", "{O}/x.safetensors"), (ANY,), (r"checkpoint\.pt(\.sha256)?$",),
                (PT,)),
        Command("example resume", (PY, "-B", str(REGRESSION), "--steps", "1", "--output", "{O}/r", "--resume",
                                   "{F}/checkpoint.pt"), (ANY,), (r"checkpoint\.pt(\.sha256)?$",), (PT,)),
    ]},
}


# ====================================================================== cases

@dataclass(frozen=True)
class Case:
    family: str
    fixture: str
    mutation: str
    target: str
    command: str
    seed: int

    @property
    def cmd(self) -> Command:
        return COMMANDS[self.fixture][self.command]

    @property
    def strict(self) -> bool:
        """The command must refuse (exit 1 or 2): damage to a file it reads whole (hashes fail), or a resealed
        hostile value in a file whose content it interprets."""
        rxs = self.cmd.parses if self.mutation in RESEALED else self.cmd.strict
        return any(re.search(rx, self.target) for rx in rxs)

    @property
    def id(self) -> str:
        return f"{self.fixture}:{self.target}:{self.mutation}:{self.command}:{self.seed}"


def _targets(fx: Fixtures, kind: str) -> list[str]:
    folder = fx.folder(kind)
    out = []
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_dir() or re.search(r"step_000002\.", rel):  # the older generation stays intact (the fallback)
            continue
        out.append(rel)
    return out


def _readers(kind: str, target: str) -> list[str]:
    return [n for n, c in COMMANDS[kind].items() if not c.lock and any(re.search(rx, target) for rx in c.reads)]


#: (family, fixture, target, mutation, command): the reproduced classes of issue #10, run whatever the rotation picks.
ISSUE_CASES = [
    (F_SPECIAL, "run", ".loss.jsonl", "fifo", "train --run"),
    (F_SPECIAL, "run", ".loss.jsonl", "fifo", "fork"),
    (F_SPECIAL, "run", ".loss.jsonl", "symlink_private", "train --run"),
    (F_SPECIAL, "run", ".loss.jsonl", "symlink_private", "export"),
    (F_SPECIAL, "run", ".state.json", "symlink_private", "export"),
    (F_SPECIAL, "run", "config.json", "symlink_private", "fork"),
    (F_SPECIAL, "run", "step_000004.bin.hmac", "symlink_private", "export"),
    (F_SPECIAL, "run", "step_000004.json", "symlink_private", "export"),
    (F_SPECIAL, "run", "LOCK", "fifo", "train --run"),
    (F_HUGE, "run", ".loss.jsonl", "sparse_line", "train --run"),
    (F_HUGE, "run", ".loss.jsonl", "sparse_line", "plot"),
    (F_HUGE, "ledger", "out.jsonl", "sparse_line", "generate"),
    (F_HUGE, "run", "config.json", "huge", "train --run"),
    (F_HUGE, "run", "step_000004.json", "huge_shape", "train --resume"),
    (F_NEST, "run", "step_000004.json", "nest", "inspect bin --deep --json"),
    (F_NEST, "ledger", "out.jsonl", "nest", "generate"),
    (F_NEST, "bundle", "MANIFEST.json", "nest", "export --verify"),
    (F_NEST, "dcp", "step_000004.dcp/ripresa.json", "nest", "inspect"),
    (F_HUGE, "run", ".loss.jsonl", "huge", "plot"),
    (F_HUGE, "run", "LOCK", "temp_names", "train --run"),
]


def all_cases(fx: Fixtures, *, seed: int = 10, per_case: int = 3) -> list[Case]:
    """The whole matrix: every fixture file x every mutation that applies, each run by up to ``per_case``
    of the commands that read it (rotating, so that every (mutation family, command) pair is covered)."""
    rng = random.Random(seed)
    cases: list[Case] = []
    rot: dict[tuple[str, str], int] = {}

    def add(family: str, kind: str, mutation: str, target: str, n: int = per_case) -> None:
        readers = _readers(kind, target)
        if not readers:
            return
        k = rot.get((family, kind), 0)
        picked = [readers[(k + i) % len(readers)] for i in range(min(n, len(readers)))]
        rot[(family, kind)] = k + len(picked)
        for c in picked:
            cases.append(Case(family, kind, mutation, target, c, rng.randrange(1 << 30)))

    for kind in ("run", "bundle", "ledger", "dcp", "pt"):
        for t in _targets(fx, kind):
            # every file: a bit flip, a FIFO, a symlink to the private file; plus one rotating other damage
            # and one rotating other special file (each run by one reader, rotating over the readers)
            k = len(cases)
            for m in ("bitflip", DAMAGE[1 + k % 2]):
                add(F_DAMAGE, kind, m, t, 1)
            for m in ("symlink_private", "fifo", SPECIAL[(k // 2) % len(SPECIAL)]):
                add(F_SPECIAL, kind, m, t, 1)
            if re.search(r"\.(json|jsonl)$", t) or Path(t).name == "LOCK":
                add(F_NEST, kind, "nest", t, 2)
                if not t.endswith("MANIFEST.json") or kind == "bundle":
                    add(F_HUGE, kind, "huge", t, 2)
            if re.fullmatch(r"step_\d+\.json", Path(t).name) or t.endswith("checkpoint/step_000004.json"):
                add(F_HUGE, kind, "huge_shape", t, 2)
            if t.endswith(".jsonl"):
                add(F_HUGE, kind, "sparse_line", t, 2)
            if t.endswith(".bin"):
                add(F_HUGE, kind, "huge", t, 2)
    add(F_HUGE, "run", "temp_names", "LOCK", 3)
    for t in ("step_000004.json", "step_000004.bin.hmac", "step_000004.bin.sha256"):  # signatures mean signatures
        cases.append(Case(F_SPECIAL, "run", "delete", t, "train --resume --require-signature", rng.randrange(1 << 30)))
    # the classes of issue #10, always in the matrix whatever the rotation picked
    have = {(c.fixture, c.target, c.mutation, c.command) for c in cases}
    for fam, kind, target, mutation, command in ISSUE_CASES:
        if (kind, target, mutation, command) not in have:
            cases.append(Case(fam, kind, mutation, target, command, rng.randrange(1 << 30)))
    for c in COMMANDS["dcp"]:
        cases.append(Case(F_PICKLE, "dcp", "pickle_metadata", "step_000004.dcp/.metadata", c, rng.randrange(1 << 30)))
    for c in COMMANDS["planted"]:
        cases.append(Case(F_PICKLE, "planted", "plant_dcp", "step_000006.dcp", c, rng.randrange(1 << 30)))
    for c in COMMANDS["pt"]:
        cases.append(Case(F_PICKLE, "pt", "pickle_pt", "checkpoint.pt", c, rng.randrange(1 << 30)))
        cases.append(Case(F_HUGE, "pt", "deflate_pt", "checkpoint.pt", c, rng.randrange(1 << 30)))
    for v in LOCK_VARIANTS:
        cases.append(Case(F_LOCK, "run", f"lock_{v}", "LOCK", "signal", rng.randrange(1 << 30)))
    for v in ("pid0", "pid2^40", "victim_local", "victim_other_host", "victim_bare"):
        cases.append(Case(F_LOCK, "run", f"lock_{v}", "LOCK", "pivot", rng.randrange(1 << 30)))
    cases.append(Case(F_LOCK, "run", "lock_victim_local", "LOCK", "inspect --no-deep --json", rng.randrange(1 << 30)))
    cases.append(Case(F_LOCK, "run", "lock_pid2^40", "LOCK", "inspect", rng.randrange(1 << 30)))
    return cases


def sample_cases(cases: list[Case], n: int = 14, seed: int = 10) -> list[Case]:
    """A fixed sample: every crafted-pickle family entry point once, the dangerous LOCK pids, then a seeded
    draw spread over the other families."""
    rng = random.Random(seed)
    must = [c for c in cases if c.family == F_PICKLE and c.command in ("convert", "train --run")]
    must += [c for c in cases if c.family == F_LOCK and c.mutation in ("lock_pid0", "lock_victim_other_host", "lock_pid2^40")
             and c.command == "signal"]
    keys = [(k, t, m, c) for _, k, t, m, c in ISSUE_CASES]
    must += [c for c in cases if (c.fixture, c.target, c.mutation, c.command) in
             (keys[0], keys[2], keys[4], keys[11], keys[14])]
    must += [c for c in cases if c.mutation == "delete" and c.command == "train --resume --require-signature"][:1]
    rest = [c for c in cases if c not in must]
    by_family: dict[str, list[Case]] = {}
    for c in rest:
        by_family.setdefault(c.family, []).append(c)
    out = list(must)
    fams = sorted(by_family)
    while len(out) < n and any(by_family.values()):
        for f in fams:
            if by_family[f] and len(out) < n:
                out.append(by_family[f].pop(rng.randrange(len(by_family[f]))))
    return out


# ====================================================================== the victim and the sandbox

VICTIM_CODE = r"""
import os, signal, sys, time
log = sys.argv[1]
def on(sig, frame):
    with open(log, "a") as f:
        f.write(signal.Signals(sig).name + "\n")
for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on)
open(log + ".ready", "w").close()
while True:
    time.sleep(1)
"""


class Victim:
    """An unrelated live process: a LOCK may name it, nothing may signal it."""

    def __init__(self, base: Path):
        self.log = base / "victim.log"
        self.log.write_text("")
        self.proc = subprocess.Popen([PY, "-c", VICTIM_CODE, str(self.log)], start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while not Path(str(self.log) + ".ready").exists() and time.monotonic() - t0 < 30:
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def hit(self) -> str:
        got = self.log.read_text().strip()
        alive = self.proc.poll() is None
        if got or not alive:
            return f"victim pid {self.pid} signalled: {got.split() or ''} alive={alive}"
        return ""

    def reset(self) -> None:
        self.log.write_text("")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


_SANDBOX: list[str] | None = None


def pid_sandbox() -> list[str] | None:
    """argv prefix that runs a command in a fresh pid namespace, or None if this machine cannot."""
    global _SANDBOX
    if _SANDBOX is None:
        _SANDBOX = []
        exe = shutil.which("unshare")
        for prefix in ([exe, "--pid", "--fork", "--kill-child"], [exe, "--user", "--map-root-user", "--pid", "--fork", "--kill-child"]):
            if not exe:
                break
            try:
                res = subprocess.run([*prefix, "sh", "-c", "test $$ = 1"], capture_output=True, timeout=20)
            except (OSError, subprocess.SubprocessError):
                continue
            if res.returncode == 0:
                _SANDBOX = prefix
                break
    return _SANDBOX or None


# ====================================================================== running one case

@dataclass
class Outcome:
    case: Case
    description: str = ""
    rc: int | None = None
    rss_mib: float = 0.0
    hung: bool = False
    executed: bool = False
    skipped: str = ""
    problems: list[str] = field(default_factory=list)
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        return (f"{self.case.id} | {self.description} | rc={self.rc} rss={self.rss_mib:.0f}MiB | "
                + "; ".join(self.problems))


def _limits() -> None:  # pragma: no cover - child, before exec
    import resource

    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_argv(argv: list[str], cwd: Path, env: dict[str, str], out: Path, timeout: float = TIMEOUT):
    """Run ``argv`` in its own session; return (rc, hung, peak RSS bytes, stdout, stderr)."""
    with open(out / "stdout.txt", "wb") as so, open(out / "stderr.txt", "wb") as se:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=so, stderr=se,
                                start_new_session=True, preexec_fn=_limits)
    deadline = time.monotonic() + timeout
    hung = False
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            hung = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            pid, status, ru = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return (proc.returncode, hung, ru.ru_maxrss * 1024, (out / "stdout.txt").read_text(errors="replace"),
            (out / "stderr.txt").read_text(errors="replace"))


@contextlib.contextmanager
def _held_lock(path: Path):
    """Hold the exclusive flock of ``path`` (a regular file) from this process, as a live trainer would."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield False
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield True
    except OSError:
        yield False
    finally:
        os.close(fd)


def _scan_outputs(root: Path, token: str, skip: Path) -> list[str]:
    """Regular files under ``root`` (never following links; ``skip`` excluded) that contain ``token``."""
    hits = []
    tok = token.encode()
    for dirpath, _dirnames, filenames in os.walk(root):
        if Path(dirpath) == skip or skip in Path(dirpath).parents:
            continue
        for name in filenames:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
                if not (st.st_mode & 0o170000 == 0o100000) or st.st_size > (64 << 20):
                    continue
                if tok in p.read_bytes():
                    hits.append(str(p.relative_to(root)))
            except OSError:
                continue
    return hits


def run_case(case: Case, fx: Fixtures, work: Path, victim: Victim | None = None) -> Outcome:
    """Mutate a fresh copy of the fixture, run the command, check everything. The case dir is removed after."""
    out = Outcome(case)
    base = Path(tempfile.mkdtemp(prefix="c", dir=work))
    try:
        rng = random.Random(case.seed)
        outside, private, token = make_outside(base, rng)
        ctx = Ctx(outside, private, token, outside / "canary" / "PWNED", fx,
                  victim_pid=victim.pid if victim else 99999999, dead_pid=dead_pid())
        folder = base / "F"
        src = fx.folder(case.fixture)
        shutil.copytree(src, folder, symlinks=True)
        od = base / "O"
        od.mkdir()
        logs = base / "logs"
        logs.mkdir()
        mutation = MUTATIONS[case.mutation]
        out.description = mutation(folder, case.target, rng, ctx)
        before = snapshot(outside)
        cmd = case.cmd
        subst = {"{F}": str(folder), "{O}": str(od), "{RUN}": str(fx.run), "{IN}": str(fx.inputs)}
        argv = [subst.get(a, a) for a in cmd.argv]
        argv = [a.replace("{F}", str(folder)).replace("{O}", str(od)) for a in argv]
        sandboxed = case.mutation.startswith("lock_") and "victim" not in case.mutation and cmd.lock
        if sandboxed:
            prefix = pid_sandbox()
            if prefix is None:
                out.skipped = "no pid namespace on this machine (unshare --pid failed): not run"
                return out
            argv = [*prefix, *argv]
        env = _env(dict(cmd.env))
        if victim:
            victim.reset()
        with _held_lock(folder / "LOCK") if cmd.lock else contextlib.nullcontext(False):
            rc, hung, rss, so, se = run_argv(argv, base, env, logs)
        out.rc, out.hung, out.rss_mib = rc, hung, rss / (1 << 20)
        out.stderr_tail = "\n".join(se.strip().splitlines()[-6:])
        text = so + se
        if hung:
            out.problems.append(f"HANG: killed after {TIMEOUT:.0f} s")
        if "Traceback (most recent call last)" in text:
            last = [ln for ln in se.strip().splitlines() if ln.strip()][-1:] or ["?"]
            out.problems.append(f"TRACEBACK: {last[0][:200]}")
        if rss > RSS_LIMIT:
            out.problems.append(f"RSS {rss / (1 << 30):.2f} GiB > {RSS_LIMIT / (1 << 30):.1f} GiB")
        if not hung:
            allowed = {1, 2} if case.strict else {0, 1, 2}
            if rc not in allowed:
                out.problems.append(f"EXIT {rc} (want {sorted(allowed)}{', the command reads this file' if case.strict else ''})")
        if ctx.canary.exists() or ctx.canary.parent.exists():
            out.executed = True
            out.problems.append("EXECUTED: the crafted pickle's payload created the canary")
        after = snapshot(outside)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k) and not k.startswith("canary"))
        if changed:
            out.problems.append(f"OUTSIDE TOUCHED: {changed[:5]}")
        if token in text:
            out.problems.append("LEAK: the private file's content is in the command's output")
        leaks = _scan_outputs(base, token, outside)
        if leaks:
            out.problems.append(f"LEAK: the private file's content was copied into {leaks[:4]}")
        if victim and (why := victim.hit()):
            out.problems.append(f"SIGNALLED: {why}")
    except Exception as exc:  # the fuzzer itself failing is a failure to report, not to hide
        out.problems.append(f"FUZZER ERROR: {type(exc).__name__}: {exc}")
    finally:
        _rmtree(base)
    return out


def _rmtree(p: Path) -> None:
    for dirpath, dirnames, _ in os.walk(p):
        for d in dirnames:
            with contextlib.suppress(OSError):
                os.chmod(Path(dirpath) / d, 0o755)
    shutil.rmtree(p, ignore_errors=True)


def _progress(o: Outcome, done: int, total: int) -> None:
    """One line per finished case to ``RIPRESA_FUZZ_PROGRESS`` (a file), if set: follow a long matrix with tail -f."""
    path = os.environ.get("RIPRESA_FUZZ_PROGRESS")
    if path:
        with contextlib.suppress(OSError), open(path, "a") as f:
            f.write(f"{done}/{total} {'ok ' if o.ok else 'BAD'} {o.line()[:300]}\n")


def run_cases(cases: list[Case], fx: Fixtures, work: Path, *, workers: int = 1) -> list[Outcome]:
    """Every case; LOCK cases one at a time (a signalled victim must be attributable), others on ``workers``."""
    work.mkdir(parents=True, exist_ok=True)
    victim = Victim(work)
    pristine = {k: snapshot(fx.folder(k)) for k in ("run", "bundle", "ledger", "dcp", "pt")}
    try:
        lock_cases = [c for c in cases if c.family == F_LOCK or COMMANDS[c.fixture][c.command].lock]
        other = [c for c in cases if c not in lock_cases]
        results: list[Outcome] = []
        lock = threading.Lock()

        def one(c: Case) -> Outcome:
            o = run_case(c, fx, work, None)
            with lock:
                results.append(o)
                _progress(o, len(results), len(cases))
            return o

        if workers > 1:
            with ThreadPoolExecutor(workers) as ex:
                list(ex.map(one, other))
        else:
            for c in other:
                one(c)
        for c in lock_cases:
            o = run_case(c, fx, work, victim)
            results.append(o)
            _progress(o, len(results), len(cases))
            if victim.proc.poll() is not None:
                victim = Victim(work)
        for k, snap in pristine.items():
            now = snapshot(fx.folder(k))
            if now != snap:
                diff = sorted(x for x in set(now) | set(snap) if now.get(x) != snap.get(x))
                results.append(Outcome(Case(F_SPECIAL, k, "none", "(pristine fixture)", "(all)", 0),
                                       problems=[f"OUTSIDE TOUCHED: the pristine {k} fixture changed: {diff[:5]}"]))
        order = {c.id: i for i, c in enumerate(cases)}
        results.sort(key=lambda o: order.get(o.case.id, len(order)))
        return results
    finally:
        victim.stop()


# ====================================================================== figures and findings

def tallies(outcomes: list[Outcome]):
    """One :class:`faults.common.Tally` per family, plus the 'code executed' row."""
    from faults.common import Tally

    rows = {f: Tally(f, WHAT[f]) for f in FAMILIES}
    executed = Tally(F_EXEC, WHAT[F_EXEC])
    skipped = []
    for o in outcomes:
        if o.skipped:
            skipped.append(f"{o.case.id}: {o.skipped}")
            continue
        rows[o.case.family].add(o.ok, o.case.id, f"{o.description} | rc={o.rc} | " + "; ".join(o.problems))
        if o.case.family == F_PICKLE:
            executed.add(not o.executed, o.case.id, "EXECUTED")
    for t in rows.values():
        t.detail = f"{len(skipped)} skipped: {skipped[:3]}" if skipped and t.family == F_LOCK else ""
    return [t for t in rows.values() if t.cases] + ([executed] if executed.cases else [])


def write_findings(outcomes: list[Outcome], path: Path = FINDINGS, *, title: str = "") -> str:
    """Distinct failures (grouped by command + kind of problem) as Markdown; returns the text."""
    bad = [o for o in outcomes if not o.ok]
    groups: dict[tuple[str, str, str], list[Outcome]] = {}
    for o in bad:
        kinds = ",".join(sorted({p.split(":")[0].split(" ")[0] for p in o.problems}))
        groups.setdefault((o.case.fixture, o.case.command, kinds), []).append(o)
    lines = [f"# hostile-folder fuzzer findings {title}".rstrip(),
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {len(outcomes)} cases, {len(bad)} failing, "
             f"{len(groups)} distinct (fixture, command, problem) groups, "
             f"{sum(o.executed for o in outcomes)} executed, {sum(bool(o.skipped) for o in outcomes)} skipped",
             "",
             "Replay one: `.venv/bin/python -m pytest -q tests/test_hostile_folders.py -p no:cacheprovider "
             "-k replay` with `RIPRESA_FUZZ_CASE='ID'` (ID = fixture:target:mutation:command:seed)", ""]
    for (fixture, command, kinds), os_ in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"## {fixture} / `{command}` — {kinds} ({len(os_)} cases)")
        for o in os_[:4]:
            lines.append(f"- `{o.case.id}` — {o.description}; exit {o.rc}, RSS {o.rss_mib:.0f} MiB")
            lines.append(f"  - {'; '.join(o.problems)[:600]}")
            if o.stderr_tail:
                lines.append("  - stderr: `" + o.stderr_tail.replace("`", "'").replace("\n", " ⏎ ")[-500:] + "`")
        if len(os_) > 4:
            lines.append(f"- … and {len(os_) - 4} more: " + ", ".join(f"`{o.case.id}`" for o in os_[4:12]))
        lines.append("")
    text = "\n".join(lines) + "\n"
    with contextlib.suppress(OSError):
        path.write_text(text)
    return text


def find_case(case_id: str, cases: list[Case]) -> Case:
    """The case of an id printed in the findings (fixture:target:mutation:command:seed)."""
    for c in cases:
        if c.id == case_id:
            return c
    fixture, rest = case_id.split(":", 1)
    target, mutation, command, seed = rest.rsplit(":", 3)
    fam = next((c.family for c in cases if c.mutation == mutation), F_DAMAGE)
    return Case(fam, fixture, mutation, target, command, int(seed))


__all__ = ["Fixtures", "build_fixtures", "Case", "all_cases", "sample_cases", "run_cases", "run_case", "tallies",
           "write_findings", "find_case", "MUTATIONS", "COMMANDS", "FAMILIES"]
