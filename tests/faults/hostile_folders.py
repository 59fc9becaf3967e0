"""The hostile-folder fuzzer (issue #10): mutate real run folders, bundles and ledgers, run every CLI reader.

Real fixtures, built once by the real CLI (:func:`build_fixtures`):

* ``run``    — a signed (``RIPRESA_HMAC_KEY``) ``ripresa train --run`` folder: two
  generations (steps 2, 4), ``.bin.hmac`` signatures, history, ``.state.json``,
  ``config.json``, ``LOCK``;
* ``bundle`` — ``ripresa export run --to bundle``;
* ``ledger`` — ``ripresa generate run --inputs in.txt --out ledger/out.jsonl``;
* ``dcp``    — ``ripresa convert run/step_000004.bin dcp/step_000004.dcp`` (a real DCP generation);
* ``pt``     — ``examples/regression/train.py``'s ``checkpoint.pt`` folder;
* ``shards`` — the run's generations converted to signed ``step_NNNNNN.shards/`` folders (Hugging Face's
  sharded layout: each shard, the index, ``companion.json``, the marker and signature), with the run's config.

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

from faults import hostile_round3 as r3

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
REGRESSION = REPO / "examples" / "regression" / "train.py"
LOOP = REPO / "examples" / "loop" / "train.py"
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
#: The password of the ``secret`` fixture's endpoint URL (each case adds its own, :attr:`Ctx.secret`).
FIXTURE_SECRET = "FuzzPw0rd-7c1e9a5b3d"
#: A closed local port: the S3 endpoint of the credential cases (connection refused at once).
CLOSED_PORT = 9

F_SPECIAL = "hostile folders: symlinks/FIFOs/special files"
F_DAMAGE = "hostile folders: bit flips/truncations/swaps"
F_NEST = "hostile folders: deep nesting"
F_HUGE = "hostile folders: huge numbers/sizes"
F_PICKLE = "hostile folders: crafted pickles"
F_EXEC = "hostile folders: code executed (must be 0)"
F_LOCK = "hostile folders: LOCK pids"
# issue #19, round two
F_MIRROR = "hostile folders: mirror objects and mirror.json"
F_CWD = "hostile folders: a ripresa/ package in the working folder"
F_SWAP = "hostile folders: shard swapped during a load (.dcp)"
F_BOMB = "hostile folders: memo, reference, JSON and history bombs"
F_SECRET = "hostile folders: URLs with credentials"
F_ESC = "hostile folders: escape sequences for the terminal"
FAMILIES = (F_SPECIAL, F_DAMAGE, F_NEST, F_HUGE, F_PICKLE, F_LOCK, F_MIRROR, F_CWD, F_SWAP, F_BOMB, F_SECRET, F_ESC,
            *r3.FAMILIES)  # issue #29, round three: tests/faults/hostile_round3.py
WHAT = {
    F_SPECIAL: "every file replaced by a symlink (private file outside, /dev/zero, /dev/urandom), a FIFO, a folder, "
               "a socket, or deleted; every reader under a time and RSS limit, nothing outside touched or leaked",
    F_DAMAGE: "bit flips, truncations, swapped files in real run folders, bundles, ledgers, .dcp and checkpoint.pt",
    F_NEST: "100k '[' in companions, config, history, ledger, MANIFEST.json, .dcp companion, LOCK (markers recomputed)",
    F_HUGE: "1e400, 10**400, -1, 2**63 in companions, history lines, config.json, LOCK, temp-file names; "
            "huge world_size/n_params/shapes; a sparse 1 GiB history line",
    F_PICKLE: "a crafted pickle as DCP .metadata (its own folder, planted at a .bin run's newest step) and as "
              "checkpoint.pt's data.pkl, markers recomputed: refused, canary never created",
    F_EXEC: "crafted-pickle and planted-package cases whose payload ran (canary file created)",
    F_LOCK: "LOCK naming pid 0, -1, 1, 2**40, huge, dead, a live unrelated process (local and 'another host'), "
            "with the lock held: `ripresa signal` and `ripresa pivot` refuse, nothing signalled",
    F_MIRROR: "a local mirror's markers naming files outside, 1 GiB markers/config/companion objects, objects that are "
              "symlinks, a forged config.json (lr=1000, every=0) under --require-signature, mirror.json naming "
              "another run folder or a mirror whose objects link outside, mirror.json nested/huge",
    F_CWD: "a ripresa/ package (and ripresa/torchrun.py) planted in the working folder of `pivot --restart`, `demo` "
           "and `train`: it never runs (canary), the detached trainer's RSS bounded too",
    F_SWAP: "a signed .dcp whose shard is replaced by another signed generation's right after ripresa closes it "
            "for the 1st/2nd/3rd time (watching /proc/PID/fd): under --require-signature a resume refuses or its "
            "next generation is bitwise the genuine one; convert refuses or writes the genuine weights",
    F_BOMB: "a 9-byte .dcp .metadata memo index (2 GiB), 20k nested OrderedDicts in .metadata (resume falls back), "
            "a general companion referencing a 4M-int64 tensor 100 times, a 24 MiB JSON companion of zeros, "
            "a 64 MiB history: RSS under 1.5 GiB",
    F_SECRET: "a password in AWS_ENDPOINT_URL's userinfo / in mirror.json's URL / in the AWS secret key: in no "
              "output stream and no file the command wrote (history events, exports)",
    F_ESC: "ESC/OSC/CSI/C1/BEL/CR/bidi and rich markup in companions, config, history, LOCK, .state.json, mirror.json "
           "and file names: no control byte of a file reaches stdout/stderr (checked for every case of every family)",
}
WHAT.update(r3.WHAT)


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
    mirror: Path | None = None   # run/ (mirror.json -> @F@/m) and m/ (a local mirror of it)
    sdcp: Path | None = None     # signed .dcp generations of steps 2 and 4
    gen: Path | None = None      # a general-format run (examples/loop)
    srun: Path | None = None     # a run whose mirror push ran with credentials in the endpoint URL
    ref_bin_sha: str = ""        # sha256 of sdcp's step 4 converted back to .bin (the genuine weights)
    ref_resume_sha: str = ""     # sha256 of step_000005.bin of a signed resume from sdcp's step 4 (one step)
    shards: Path | None = None   # signed .shards generations of steps 2 and 4, with the run's config

    def folder(self, kind: str) -> Path:
        return {"run": self.run, "bundle": self.bundle, "ledger": self.ledger, "dcp": self.dcp,
                "pt": self.pt, "planted": self.run, "mirror": self.mirror, "sdcp": self.sdcp, "gen": self.gen,
                "cwd": self.run, "secret": self.srun, "esc": self.run, "shards": self.shards}[kind]


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
    build_round_two(fx)
    build_shards(fx)
    return fx


def build_shards(fx: Fixtures) -> None:
    """A run folder of signed ``.shards`` generations (steps 2 and 4, converted from the run's), with its config."""
    fx.shards = fx.root / "shards"
    for step in (2, 4):
        _must([PY, "-m", "ripresa", "convert", f"run/step_{step:06d}.bin", f"shards/step_{step:06d}.shards"], fx.root,
              {"RIPRESA_HMAC_KEY": KEY})
    for name in ("config.json", "config.json.hmac"):
        shutil.copy2(fx.run / name, fx.shards / name)


def build_round_two(fx: Fixtures) -> None:
    """The fixtures of issue #19's families (mirror, signed .dcp, general run, credentials)."""
    root, rp = fx.root, [PY, "-m", "ripresa"]
    fx.mirror, fx.sdcp, fx.gen, fx.srun = root / "mir", root / "sdcp", root / "gen", root / "srun"
    shutil.copytree(fx.run, fx.mirror / "run", symlinks=True)
    _must([*rp, "mirror", "push", "mir/run", "--mirror", str(fx.mirror / "m")], root)
    (fx.mirror / "run" / "mirror.json").write_text(json.dumps({"url": "@F@/m"}) + "\n")
    for step in (2, 4):
        _must([*rp, "convert", f"run/step_{step:06d}.bin", f"sdcp/step_{step:06d}.dcp"], root, {"RIPRESA_HMAC_KEY": KEY})
    for name in ("config.json", "config.json.hmac"):  # a run folder of .dcp generations (fork reads it), signed
        shutil.copy2(fx.run / name, fx.sdcp / name)
    _must([*rp, "convert", "sdcp/step_000004.dcp", "sref/step_000004.bin"], root,
          {"RIPRESA_HMAC_KEY": KEY, "RIPRESA_REQUIRE_SIGNATURE": "1"})
    fx.ref_bin_sha = _sha(root / "sref" / "step_000004.bin")
    _must([*rp, "train", "--run", "sref/resumed", "--resume", "sdcp/step_000004.dcp", "--require-signature", *TRAIN], root,
          {"RIPRESA_HMAC_KEY": KEY})
    fx.ref_resume_sha = _sha(root / "sref" / "resumed" / "step_000005.bin")
    _must([PY, "-B", str(LOOP), "--run", "gen", "--steps", "4", "--every", "2"], root)
    shutil.copytree(fx.run, fx.srun, symlinks=True)
    # a push whose endpoint carries a password (the store is unreachable: the attempts are recorded as events)
    subprocess.run([*rp, "mirror", "push", "srun", "--mirror", "s3://fuzz-bucket/prefix"], cwd=root,
                   env=_env(_secret_env(FIXTURE_SECRET)), capture_output=True, timeout=600)


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
    secret: str = ""
    side: Path | None = None  # scratch outside every scanned tree (the swap's foreign shard)


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
    if target.parent.name.endswith(".shards") and target.name.endswith(".safetensors"):
        comp = target.parent / "companion.json"  # the companion records each shard's sha256 and size
        if comp.is_file() and not comp.is_symlink():
            with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
                doc = json.loads(comp.read_text())
                for rec in doc["tensors"]["shards"]:
                    if rec["name"] == target.name:
                        rec["sha256"], rec["size"] = sha, size
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

# ====================================================================== issue #19: round-two mutations

def _secret_env(secret: str) -> dict[str, str]:
    """An S3 endpoint whose URL carries a password (and the same password as the secret key)."""
    return {"AWS_ENDPOINT_URL": f"http://AKIAFUZZUSER:{secret}@127.0.0.1:{CLOSED_PORT}",
            "AWS_ACCESS_KEY_ID": "AKIAFUZZUSER", "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


def _sparse(p: Path, size: int, head: bytes = b"") -> None:
    _replace_special(p)
    with open(p, "wb") as f:
        f.write(head)
    os.truncate(p, size)


def _victim_run(ctx: Ctx) -> Path:
    """Another run folder, outside the mutated one (a mirror.json may name it): nothing may change in it."""
    other = ctx.outside / "other_run"
    if not other.exists():
        shutil.copytree(ctx.fx.run, other, symlinks=True)
    return other


def m_mirror_marker_outside(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """The mirror's marker names files outside the mirror (../, absolute), with their true hashes."""
    p = folder / rel
    sha = _sha(ctx.private)
    up = os.path.relpath(ctx.private, p.parent)
    lines = rng.choice([f"{sha}  {up}\n{sha}  {up}\n", f"{sha}  {ctx.private}\n{sha}  {ctx.private}\n",
                        f"{sha}  step_000004.bin\n{sha}  {up}\n"])
    p.write_text(lines)
    return f"mirror marker naming {lines.split()[1][:60]} (the private file's own sha256)"


def m_mirror_big_object(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """A mirror object turned into a sparse 1 GiB file (its marker line recomputed where it has one)."""
    p = folder / rel
    head = b'{"format": "ripresa.companion", "pad": "' if rel.endswith(".json") else b""
    size = (1 << 30) if not rel.endswith(".json") or "config" in rel else 300 << 20
    _sparse(p, size, head)
    if rel.endswith("step_000004.json"):
        reseal(folder / "m", "step_000004.json")
    return f"sparse {size >> 20} MiB object"


def m_mirror_symlink_object(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    p = folder / rel
    _replace_special(p)
    p.symlink_to(ctx.private if rng.random() < 0.5 else ctx.outside / "sub" / "keys.json")
    return f"mirror object is a symlink to a private file ({os.readlink(p)})"


def m_mirror_evil_config(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """config.json in the mirror (never signed) rewritten: lr = 1000, checkpoint every 0 steps."""
    p = folder / rel
    doc = json.loads(p.read_text())
    doc.setdefault("train", {})["lr"] = 1000.0
    doc.setdefault("checkpoint", {})["every"] = 0
    p.write_text(json.dumps(doc))
    return "mirror config.json forged: train.lr=1000, checkpoint.every=0"


def m_mirror_json_other_run(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """mirror.json names another run folder (outside): a push must not treat it as a mirror."""
    other = _victim_run(ctx)
    url = rng.choice([str(other), f"file://{other}"])
    (folder / rel).write_text(json.dumps({"url": url}) + "\n")
    return f"mirror.json names another run folder ({url})"


def m_mirror_linked_objects(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """The local mirror lacks generation 4; its object names are symlinks to files outside (a push writes them)."""
    m = folder / "m"
    _victim_run(ctx)
    targets = {"step_000004.bin": ctx.outside / "other_run" / "step_000004.bin",
               "step_000004.json": ctx.outside / "sub" / "keys.json",
               "step_000004.bin.sha256": ctx.outside / "other_run" / "step_000004.bin.sha256",
               "config.json": ctx.outside / "other_run" / "config.json"}
    for name, target in targets.items():
        _replace_special(m / name)
        (m / name).symlink_to(target)
    return "mirror objects of step 4 and config.json are symlinks into another run folder / a private file"


def m_mirror_json_nest(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    variant = rng.choice(["nest", "huge_url", "sparse", "not_object"])
    p = folder / rel
    if variant == "nest":
        p.write_text('{"url": ' + _nested() + "}")
    elif variant == "huge_url":
        p.write_text(json.dumps({"url": "s3://b/" + "a" * (1 << 20)}))
    elif variant == "sparse":
        _sparse(p, 1 << 30, b'{"url": "')
    else:
        p.write_text(json.dumps(["@F@/m"]))
    return f"mirror.json: {variant}"


PKG_INIT = """import os
os.makedirs({canary!r}, exist_ok=True)
raise SystemExit("planted ripresa package ran")
"""


def m_plant_package(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """A ripresa/ package (with __main__.py and torchrun.py) in the run folder, the command's working folder."""
    pkg = folder / "ripresa"
    pkg.mkdir()
    code = PKG_INIT.format(canary=str(ctx.canary))
    for name in ("__init__.py", "__main__.py", "torchrun.py", "cli.py"):
        (pkg / name).write_text(code)
    (folder / "ripresa.py").write_text(code)  # a module of the same name, for good measure
    return "ripresa/ package (+ ripresa.py) planted in the working folder"


def m_shard_swap(k: int) -> Mutation:
    def mutate(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
        return _arm_swap(folder, rel, ctx, k)

    mutate.__name__ = f"m_shard_swap{k}"
    return mutate


def _arm_swap(folder: Path, rel: str, ctx: Ctx, k: int) -> str:
    """Arm the swap: a hard link to another signed generation's shard waits in ``ctx.side``; the watcher of
    :func:`_swap_watcher` puts it in place (atomic rename) right after the command first closes the shard."""
    assert ctx.side is not None
    foreign = folder / "step_000002.dcp" / Path(rel).name
    os.link(foreign, ctx.side / "foreign")
    (ctx.side / "after").write_text(str(k))
    return f"{rel} to be replaced by step_000002.dcp's after its close number {k} (both signed)"


def _memo_bomb() -> bytes:
    import struct

    return b"\x80\x02N" + b"r" + struct.pack("<I", (1 << 27) + 1) + b"."  # LONG_BINPUT at index 2**27: a 2 GiB memo


def _deep_metadata(genuine: Path, where: str, depth: int = 20_000) -> bytes:
    """The genuine DCP Metadata with ``depth`` nested OrderedDicts (allowed classes only) as its ``planner_data``
    (unused by a load: the generation stays valid) or as a storage entry's ``transform_descriptors`` (invalid:
    ripresa never writes transforms), written opcode by opcode (no recursion in the writer)."""
    import pickle

    from ripresa.formats.dcp_safe import MetadataUnpickler

    md = MetadataUnpickler(io.BytesIO(genuine.read_bytes())).load()
    sentinel = "@@DEEP-NESTING-GOES-HERE@@"
    if where == "planner_data":
        md.planner_data = sentinel
    else:
        next(iter(md.storage_data.values())).transform_descriptors = sentinel
    raw = pickle.dumps(md, protocol=2)
    enc = sentinel.encode()
    import struct

    op = b"X" + struct.pack("<I", len(enc)) + enc
    assert raw.count(op) == 1, "sentinel not found once in the pickle"
    od = b"ccollections\nOrderedDict\n)R"
    deep = (od + b"X\x01\x00\x00\x00k") * depth + od + b"s" * depth
    return raw.replace(op, deep)


def m_memo_bomb(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    (folder / rel).write_bytes(_memo_bomb())
    reseal(folder, rel)
    return "9-byte .metadata whose LONG_BINPUT index asks for a 2 GiB memo, marker recomputed"


def m_deep_metadata(where: str) -> Mutation:
    def mutate(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
        (folder / rel).write_bytes(_deep_metadata(folder / rel, where))
        reseal(folder, rel)
        return f".metadata with 20k nested OrderedDicts (allowed classes) as {where}, marker recomputed"

    mutate.__name__ = f"m_deep_{where}"
    return mutate


def m_plant_bomb_dcp(kind: str) -> Mutation:
    def mutate(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
        m_plant_dcp(folder, rel, rng, ctx, crafted=False)
        dst = folder / "step_000006.dcp"
        data = _memo_bomb() if kind == "memo" else _deep_metadata(dst / ".metadata", "transform_descriptors")
        (dst / ".metadata").write_bytes(data)
        doc = json.loads((dst / "ripresa.json").read_text())
        doc["files"][".metadata"] = len(data)
        (dst / "ripresa.json").write_text(json.dumps(doc, separators=(",", ":")))
        lines = [f"{_sha(dst / n)}  step_000006.dcp/{n}\n" for n in sorted(os.listdir(dst))]
        (folder / "step_000006.dcp.sha256").write_text("".join(lines))
        return f".dcp planted at step 6 (newest) with a {kind} bomb as .metadata, marker recomputed"

    mutate.__name__ = f"m_plant_{kind}_dcp"
    return mutate


def _safetensors_add(path: Path, name: str, dtype: str, shape: list[int], data: bytes) -> int:
    """Append a tensor to a safetensors file (header rewritten); returns the new tensor count."""
    import struct

    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + body + data)
    return sum(1 for k in header if k != "__metadata__")


def m_ref_bomb(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """A general generation: a 4M-element int64 tensor added to the file, referenced 100 times as a list by the
    companion (each a Python list of 4M ints when resolved: ~14 GB); file, companion and marker recomputed."""
    st = folder / rel
    comp = st.with_name(st.name + ".json")
    count = _safetensors_add(st, "bomb", "I64", [1 << 22], bytes(8 << 22))
    doc = json.loads(comp.read_text())
    doc["tensors"].update(sha256=_sha(st), size=st.stat().st_size, count=count)
    refs = [{"__ref__": "bomb", "list": "int64"}] * 100
    doc["state"]["objects"] = {"bomb": refs}
    comp.write_text(json.dumps(doc, separators=(",", ":")))
    marker = st.with_name(st.name + ".sha256")
    marker.write_text(f"{_sha(st)}  {st.name}\n{_sha(comp)}  {comp.name}\n")
    return f"4M-int64 tensor referenced 100 times as a list ({comp.stat().st_size} byte companion), markers recomputed"


def m_json_bomb(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """64 MiB of `[],` in a companion (under the caps; each 3 bytes a 64-byte list when parsed whole: ~1.4 GB)."""
    p = folder / rel
    text = p.read_text()
    pad = "[" + "[]," * ((64 << 20) // 3) + "[]]"
    p.write_text('{"pad": ' + pad + ", " + text.lstrip()[1:])
    reseal(folder, rel)
    return "a 64 MiB array of empty lists as the companion's first key, markers recomputed"


def m_history_bomb(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """64 MiB of short valid history lines (each one kept whole would take ~1.8 GB)."""
    p = folder / rel
    line = '{"step":3,"loss":1.0,"time":1.0}\n'
    with open(p, "a") as f:
        chunk = line * 4096
        for _ in range((64 << 20) // len(chunk)):
            f.write(chunk)
    return f"{p.stat().st_size >> 20} MiB history of short lines"


def m_secret_none(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    return "nothing planted: the password is in the endpoint URL and the secret key (environment)"


def m_secret_mirror_json(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    url = rng.choice([f"s3://AKIAFUZZUSER:{ctx.secret}@fuzz-bucket/prefix", f"https://u:{ctx.secret}@h.example/x",
                      f"file://u:{ctx.secret}@/nonexistent/mirror"])
    (folder / rel).write_text(json.dumps({"url": url}) + "\n")
    return f"mirror.json URL with a password ({url.split(':')[0]})"


TERMINAL = "\x1b]0;pwned\x07\x1b[2J\x1b[1;1H\x9b31m\rFAKE\u202e[link=https://evil.example]x[/link][bold]"


def _esc_strings(doc, rng: random.Random, k: int) -> int:
    """Append :data:`TERMINAL` to up to ``k`` string values of ``doc`` (in place); returns how many."""
    spots = []

    def walk(node, depth=0):
        if depth > 40 or len(spots) > 2000:
            return
        if isinstance(node, dict):
            for key, v in node.items():
                if isinstance(v, str):
                    spots.append((node, key))
                else:
                    walk(v, depth + 1)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    spots.append((node, i))
                else:
                    walk(v, depth + 1)

    walk(doc)
    chosen = rng.sample(spots, min(k, len(spots)))
    for node, key in chosen:
        node[key] = node[key] + TERMINAL
    return len(chosen)


def m_escape(folder: Path, rel: str, rng: random.Random, ctx: Ctx) -> str:
    """Escape sequences and rich markup planted where ripresa prints what it read (markers recomputed)."""
    p = folder / rel
    name = p.name
    if name == ".loss.jsonl":
        with open(p, "a") as f:
            f.write(json.dumps({"event": "mirror_retry" + TERMINAL, "step": 3, "url": TERMINAL, "reason": TERMINAL,
                                "file": "step_000004.bin" + TERMINAL}) + "\n")
            f.write(json.dumps({"step": 5, "loss": 1.0, "time": 1.0, "arm": TERMINAL, "note": TERMINAL}) + "\n")
        return "history lines with escape sequences in event, url, reason, arm"
    if name == "LOCK":
        p.write_text(f"{ctx.dead_pid}\n" + json.dumps({"pid": ctx.dead_pid, "hostname": "h" + TERMINAL,
                                                      "argv": ["ripresa" + TERMINAL], "started": 1.0}) + "\n")
        return "LOCK with escape sequences in hostname and argv"
    if name == "(names)":
        made = [f"step_000009.bin{TERMINAL[:12]}", f"archive{TERMINAL[:12]}", f".step_000004.bin.tmp.{TERMINAL[:9]}",
                "step_000008.json\x1b[2J"]
        for n in made:
            (folder / n).write_bytes(TERMINAL.encode())
        return "files whose names carry escape sequences"
    if name == "mirror.json":
        p.write_text(json.dumps({"url": "/nonexistent/" + TERMINAL}) + "\n")
        return "mirror.json URL with escape sequences"
    doc = json.loads(p.read_text())
    n = _esc_strings(doc, rng, rng.choice([1, 3, 1000]))
    p.write_text(json.dumps(doc))
    reseal(folder, rel)
    return f"escape sequences appended to {n} string value(s), markers recomputed"


ROUND_TWO_MUTATIONS: dict[str, Mutation] = {
    "mirror_marker_outside": m_mirror_marker_outside, "mirror_big_object": m_mirror_big_object,
    "mirror_symlink_object": m_mirror_symlink_object, "mirror_evil_config": m_mirror_evil_config,
    "mirror_json_other_run": m_mirror_json_other_run, "mirror_linked_objects": m_mirror_linked_objects,
    "mirror_json_nest": m_mirror_json_nest, "plant_package": m_plant_package,
    **{f"shard_swap{k}": m_shard_swap(k) for k in (1, 2, 3)},
    "memo_bomb": m_memo_bomb, "deep_metadata": m_deep_metadata("planner_data"),
    "deep_transform": m_deep_metadata("transform_descriptors"), "plant_memo_dcp": m_plant_bomb_dcp("memo"),
    "plant_deep_dcp": m_plant_bomb_dcp("deep"), "ref_bomb": m_ref_bomb, "json_bomb": m_json_bomb,
    "history_bomb": m_history_bomb, "secret_none": m_secret_none, "secret_mirror_json": m_secret_mirror_json,
    "escape": m_escape,
}


MUTATIONS: dict[str, Mutation] = {
    "bitflip": m_bitflip, "truncate": m_truncate, "swap": m_swap,
    "delete": m_delete, "symlink_private": m_symlink_private, "symlink_devzero": m_symlink_devzero,
    "symlink_urandom": m_symlink_urandom, "fifo": m_fifo, "folder": m_folder, "socket": m_socket,
    "nest": m_nest, "huge": m_huge, "huge_shape": m_huge_shape, "sparse_line": m_sparse_line,
    "temp_names": m_temp_names, "pickle_metadata": m_pickle_metadata, "plant_dcp": m_plant_dcp,
    "pickle_pt": m_pickle_pt, "deflate_pt": m_deflate_pt,
    **{f"lock_{v}": m_lock(v) for v in LOCK_VARIANTS},
}
MUTATIONS.update(ROUND_TWO_MUTATIONS)
MUTATIONS.update(r3.MUTATIONS)
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
    in_folder: bool = False        # run with the mutated folder as the working folder (a user cd'ed into the run)
    timeout: float = 0.0           # seconds before it counts as hung (0: TIMEOUT)
    detached: bool = False         # it starts a detached trainer (pid in its output): watched, measured, killed
    expect: str = ""               # a post-condition of :data:`EXPECT` (e.g. the genuine weights, a fallback)


GEN4 = r"step_000004\.(bin|json|bin\.sha256|bin\.hmac)$"
GEN4_NOSIG = r"step_000004\.(bin|json|bin\.sha256)$"
GEN4_DATA = r"step_000004\.(bin|json)$"
CONFIG = r"^config\.json$"
ANY = r".*"
RIP = (PY, "-m", "ripresa")
#: ``--steps`` of a run folder is the step the run ends at (docs/FAULTS.md, "The end of a run"): 5 trains one
#: step past the fixtures' step 4 (a resume then a save), five on a blank folder.
TRAIN = ("--steps", "5", "--every", "1", "--threads", "1", "--quiet", "--no-audit")

#: The files of the .shards fixture's step 4 (S4_NOSIG: those a check without the key reads; S4_INDEX: the index,
#: which must say exactly what the shards say even when an attacker recomputed the marker).
S4 = r"^step_000004\.shards(/|\.sha256$|\.hmac$)"
S4_NOSIG = r"^step_000004\.shards(/|\.sha256$)"
S4_INDEX = r"^step_000004\.shards/model\.safetensors\.index\.json$"

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


# ---------------------------------------------------------------------- issue #19's commands
#: ripresa as a user's ``ripresa`` console script starts it: the working folder is not on sys.path (-P), so a
#: planted package can only run if ripresa itself starts a child that imports from the working folder.
RIPP = (PY, "-P", "-m", "ripresa")
SIGNED = (("RIPRESA_HMAC_KEY", KEY),)
SECRET_ENV = (("@SECRET_ENV@", "1"),)  # replaced by :func:`_secret_env` of the case's password
MIRROR_OBJ = r"^m/"
MIRROR_JSON = r"^run/mirror\.json$"

COMMANDS.update({
    "mirror": {c.name: c for c in [
        Command("mirror status", (*RIP, "mirror", "status", "{F}/run"), (MIRROR_JSON, MIRROR_OBJ)),
        Command("mirror status --json", (*RIP, "mirror", "status", "{F}/run", "--mirror", "{F}/m", "--json"), (MIRROR_OBJ,)),
        Command("mirror push", (*RIP, "mirror", "push", "{F}/run"), (MIRROR_JSON, MIRROR_OBJ)),
        Command("mirror pull (blank machine)", (*RIP, "mirror", "pull", "{O}/blank", "--mirror", "{F}/m"), (MIRROR_OBJ,)),
        Command("train --mirror --require-signature (blank machine)",
                (*RIP, "train", "--run", "{O}/blank", "--mirror", "{F}/m", "--require-signature", *TRAIN),
                (MIRROR_OBJ,), (), (r"^m/config\.json$",), SIGNED, timeout=90),
    ]},
    "sdcp": {c.name: c for c in [
        Command("convert (RIPRESA_REQUIRE_SIGNATURE=1)", (*RIP, "convert", "{F}/step_000004.dcp", "{O}/x.bin"), (ANY,),
                env=(*SIGNED, ("RIPRESA_REQUIRE_SIGNATURE", "1")), expect="genuine_weights"),
        Command("inspect --require-signature", (*RIP, "inspect", "{F}/step_000004.dcp", "--require-signature", "--json"),
                (ANY,), env=SIGNED),
        Command("fork (RIPRESA_REQUIRE_SIGNATURE=1)", (*RIP, "fork", "{F}", "--step", "4", "--into", "{O}/fork"), (ANY,),
                env=(*SIGNED, ("RIPRESA_REQUIRE_SIGNATURE", "1")), expect="genuine_fork"),
        Command("train --resume --require-signature", (*RIP, "train", "--run", "{O}/new", "--resume",
                                                       "{F}/step_000004.dcp", "--require-signature", *TRAIN),
                (ANY,), env=SIGNED, expect="genuine_resume", timeout=120),
    ]},
    "shards": {c.name: c for c in [
        Command("inspect", (*RIP, "inspect", "{F}"), (ANY,)),
        Command("inspect --no-deep --json", (*RIP, "inspect", "{F}", "--no-deep", "--json"), (ANY,)),
        Command("inspect shards --deep --json", (*RIP, "inspect", "{F}/step_000004.shards", "--deep", "--json"),
                (S4,), (S4_NOSIG,), (S4_INDEX,)),
        Command("inspect shards --require-signature", (*RIP, "inspect", "{F}/step_000004.shards", "--require-signature"),
                (S4,), (S4,), (S4,), SIGNED),
        Command("train --run", (*RIP, "train", "--run", "{F}", *TRAIN), (ANY,), parses=(CONFIG,)),
        Command("train --resume", (*RIP, "train", "--run", "{O}/new", "--resume", "{F}/step_000004.shards", *TRAIN),
                (S4, CONFIG), (S4_NOSIG,), (S4_INDEX,)),
        Command("train --resume --require-signature", (*RIP, "train", "--run", "{O}/new", "--resume",
                                                       "{F}/step_000004.shards", "--require-signature", *TRAIN),
                (S4, CONFIG), (S4,), (S4,), SIGNED),
        Command("export", (*RIP, "export", "{F}", "--to", "{O}/bundle", "--step", "4"), (ANY,), (S4_NOSIG,), (S4_INDEX,)),
        Command("export --inference", (*RIP, "export", "{F}", "--to", "{O}/inf", "--inference"), (ANY,)),
        Command("convert", (*RIP, "convert", "{F}/step_000004.shards", "{O}/step_000004.bin"), (S4,), (S4_NOSIG,),
                (S4_INDEX,)),
        Command("mirror push", (*RIP, "mirror", "push", "{F}", "--mirror", "{O}/m"), (ANY,)),
    ]},
    "gen": {c.name: c for c in [
        Command("inspect", (*RIP, "inspect", "{F}"), (ANY,)),
        Command("inspect file --deep --json", (*RIP, "inspect", "{F}/step_000004.safetensors", "--deep", "--json"), (ANY,)),
        Command("export", (*RIP, "export", "{F}", "--to", "{O}/bundle", "--step", "4"), (ANY,)),
        Command("example resume", (PY, "-B", str(LOOP), "--run", "{F}", "--steps", "5", "--every", "1"), (ANY,)),
    ]},
    "cwd": {c.name: c for c in [
        Command("pivot --restart", (*RIPP, "pivot", "{F}", "--caps", "stdlib-code=0.5", "--restart", "--timeout", "30"),
                (ANY,), in_folder=True, detached=True, timeout=120),
        Command("demo", (*RIPP, "demo", "--output", "{O}/demo"), (ANY,), in_folder=True, timeout=420),
        Command("train --run", (*RIPP, "train", "--run", "{F}", *TRAIN), (ANY,), in_folder=True),
        Command("verify", (*RIPP, "verify", "--output", "{O}/verify", "--steps", "6", "--cut", "3", "--json"), (ANY,),
                in_folder=True, timeout=300),
    ]},
    "secret": {c.name: c for c in [
        Command("mirror push s3 (password in endpoint)", (*RIP, "mirror", "push", "{F}", "--mirror", "s3://fuzz-bucket/p"),
                (ANY,), env=SECRET_ENV, timeout=120),
        Command("mirror status s3 (password in endpoint)",
                (*RIP, "mirror", "status", "{F}", "--mirror", "s3://fuzz-bucket/p"), (ANY,), env=SECRET_ENV, timeout=120),
        Command("train --mirror s3 (password in endpoint)",
                (*RIP, "train", "--run", "{F}", "--mirror", "s3://fuzz-bucket/p", *TRAIN), (ANY,), env=SECRET_ENV,
                timeout=150),
        Command("mirror status (mirror.json)", (*RIP, "mirror", "status", "{F}"), (ANY,), timeout=120),
        Command("mirror status --json (mirror.json)", (*RIP, "mirror", "status", "{F}", "--json"), (ANY,), timeout=120),
        Command("export (history of a pushed run)", (*RIP, "export", "{F}", "--to", "{O}/bundle", "--step", "4"), (ANY,)),
        Command("export --inference", (*RIP, "export", "{F}", "--to", "{O}/inf", "--inference"), (ANY,)),
    ]},
    "esc": {c.name: c for c in [
        Command("inspect", (*RIP, "inspect", "{F}"), (ANY,)),
        Command("inspect --no-deep", (*RIP, "inspect", "{F}", "--no-deep"), (ANY,)),
        Command("inspect bin --deep", (*RIP, "inspect", "{F}/step_000004.bin", "--deep"), (r"step_000004", r"^\(names\)$")),
        Command("plot", (*RIP, "plot", "{F}", "--png", "{O}/p.png"), (ANY,)),
        Command("compare", (*RIP, "compare", "{F}", "{RUN}"), (ANY,)),
        Command("advise", (*RIP, "advise", "{F}"), (r"\.loss\.jsonl$", CONFIG)),
        Command("fork", (*RIP, "fork", "{F}", "--step", "4", "--into", "{O}/fork"), (ANY,)),
        Command("export", (*RIP, "export", "{F}", "--to", "{O}/bundle", "--step", "4"), (ANY,)),
        Command("mirror status", (*RIP, "mirror", "status", "{F}"), (r"mirror\.json$", r"^\(names\)$")),
        Command("train --resume", (*RIP, "train", "--run", "{O}/new", "--resume", "{F}/step_000004.bin", *TRAIN), (ANY,)),
        Command("pivot", (*RIP, "pivot", "{F}", "--caps", "stdlib-code=0.5", "--timeout", "5"), (CONFIG, r"LOCK$", r"\.state")),
    ]},
})


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
        if (self.fixture, self.mutation, self.command) in MUST_REFUSE | r3.MUST_REFUSE:
            return True
        if self.family in ROUND_TWO + r3.FAMILIES:
            return False
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

    kinds = ("run", "bundle", "ledger", "dcp", "pt", "shards")

    def per_file(kind: str) -> None:
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
            if re.fullmatch(r"step_\d+\.json", Path(t).name) or t.endswith(("checkpoint/step_000004.json",
                                                                             ".shards/companion.json")):
                add(F_HUGE, kind, "huge_shape", t, 2)
            if t.endswith(".jsonl"):
                add(F_HUGE, kind, "sparse_line", t, 2)
            if t.endswith(".bin"):
                add(F_HUGE, kind, "huge", t, 2)

    for kind in kinds[:-1]:
        per_file(kind)
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
    cases += round_two_cases(rng)
    if fx.shards is not None:  # the .shards fixture (its own draws: the other fixtures' seeds stay as they were)
        rng = random.Random(seed * 1000 + 22)
        per_file("shards")
        for t in _targets(fx, "shards"):  # every file of step 4 x every special file and damage, by its inspector
            if t.startswith("step_000004.shards"):
                for m in SPECIAL + DAMAGE:
                    if not any(c.fixture == "shards" and (c.target, c.mutation, c.command) ==
                               (t, m, "inspect shards --deep --json") for c in cases):
                        cases.append(Case(F_SPECIAL if m in SPECIAL else F_DAMAGE, "shards", m, t,
                                          "inspect shards --deep --json", rng.randrange(1 << 30)))
    rng = random.Random(seed * 1000 + 29)  # issue #29's families: their own draws
    cases += [Case(fam, kind, mutation, target, c, rng.randrange(1 << 30))
              for fam, kind, mutation, target, c in r3.cases(COMMANDS, _readers, rng)]
    return cases


#: (fixture, mutation, command) that must refuse (exit 1 or 2), whatever the target.
MUST_REFUSE = {
    # class 5: config.json is not covered by any signature; a resume under --require-signature must not use it
    ("mirror", "mirror_evil_config", "train --mirror --require-signature (blank machine)"),
    # class 3: a mirror.json naming another run folder is not a mirror
    ("mirror", "mirror_json_other_run", "mirror push"),
    ("dcp", "memo_bomb", "convert"), ("dcp", "memo_bomb", "train --resume"),
    ("dcp", "deep_transform", "convert"), ("dcp", "deep_transform", "train --resume"),
}
#: The families of issue #19 refuse only where :data:`MUST_REFUSE` says (a valid oddity may load).
ROUND_TWO = (F_MIRROR, F_CWD, F_SWAP, F_BOMB, F_SECRET, F_ESC)


def round_two_cases(rng: random.Random) -> list[Case]:
    """The families of issue #19 (each case: fixture, mutation, target, command)."""
    out: list[Case] = []

    def add(fam: str, kind: str, mutation: str, target: str, commands) -> None:
        for c in commands:
            out.append(Case(fam, kind, mutation, target, c, rng.randrange(1 << 30)))

    mir = COMMANDS["mirror"]
    blank = ["mirror pull (blank machine)", "train --mirror --require-signature (blank machine)"]
    for t in ("m/step_000004.bin.sha256", "m/step_000002.bin.sha256"):
        add(F_MIRROR, "mirror", "mirror_marker_outside", t, blank)
    for t in ("m/step_000004.bin.sha256", "m/config.json", "m/step_000004.json", "m/step_000004.bin"):
        add(F_MIRROR, "mirror", "mirror_big_object", t, blank + (["mirror status --json"] if t.endswith("sha256") else []))
    for t in ("m/step_000004.bin", "m/config.json", "m/step_000004.bin.sha256", "m/step_000004.bin.hmac"):
        add(F_MIRROR, "mirror", "mirror_symlink_object", t, blank)
    add(F_MIRROR, "mirror", "mirror_evil_config", "m/config.json", ["train --mirror --require-signature (blank machine)"])
    add(F_MIRROR, "mirror", "mirror_json_other_run", "run/mirror.json", ["mirror push", "mirror push", "mirror status"])
    add(F_MIRROR, "mirror", "mirror_linked_objects", "m/step_000004.bin", ["mirror push", "mirror pull (blank machine)"])
    add(F_MIRROR, "mirror", "mirror_json_nest", "run/mirror.json", ["mirror status", "mirror push", "mirror status"])
    for m in ("bitflip", "truncate", "fifo"):
        add(F_MIRROR, "mirror", m, "m/step_000004.bin", blank[:1])
    assert all(c in mir for c in blank)

    for c in COMMANDS["cwd"]:
        add(F_CWD, "cwd", "plant_package", "ripresa/", [c])

    for k in (1, 2, 3):  # the swap after the shard's 1st, 2nd or 3rd close (whichever precedes a re-open)
        add(F_SWAP, "sdcp", f"shard_swap{k}", "step_000004.dcp/__0_0.distcp",
            ["convert (RIPRESA_REQUIRE_SIGNATURE=1)", "train --resume --require-signature",
             "fork (RIPRESA_REQUIRE_SIGNATURE=1)"] + (["inspect --require-signature"] if k == 1 else []))

    add(F_BOMB, "dcp", "memo_bomb", "step_000004.dcp/.metadata", list(COMMANDS["dcp"]))
    add(F_BOMB, "dcp", "deep_metadata", "step_000004.dcp/.metadata", ["train --resume", "inspect"])
    add(F_BOMB, "dcp", "deep_transform", "step_000004.dcp/.metadata", list(COMMANDS["dcp"]))
    add(F_BOMB, "planted", "plant_memo_dcp", "step_000006.dcp", ["train --run", "inspect", "export"])
    add(F_BOMB, "planted", "plant_deep_dcp", "step_000006.dcp", ["train --run", "inspect", "export"])
    add(F_BOMB, "gen", "ref_bomb", "step_000004.safetensors", list(COMMANDS["gen"]))
    add(F_BOMB, "run", "json_bomb", "step_000004.json",
        ["inspect bin --deep --json", "train --resume", "export", "inspect"])
    add(F_BOMB, "run", "history_bomb", ".loss.jsonl", ["plot", "compare", "fork", "train --run"])

    for c in ("mirror push s3 (password in endpoint)", "mirror status s3 (password in endpoint)",
              "train --mirror s3 (password in endpoint)", "export (history of a pushed run)", "export --inference"):
        add(F_SECRET, "secret", "secret_none", ".loss.jsonl", [c])
    add(F_SECRET, "secret", "secret_mirror_json", "mirror.json",
        ["mirror status (mirror.json)", "mirror status --json (mirror.json)", "mirror status (mirror.json)"])

    k = 0
    for t in ("step_000004.json", "config.json", ".loss.jsonl", "LOCK", ".state.json", "(names)", "mirror.json"):
        readers = [n for n, c in COMMANDS["esc"].items() if any(re.search(rx, t) for rx in c.reads)]
        picked = [readers[(k + i) % len(readers)] for i in range(min(5, len(readers)))]  # rotating: all are covered
        k += len(picked)
        add(F_ESC, "esc", "escape", t, picked)
    return out


#: One cheap, telling case of each family of issue #19 in the sample.
SAMPLE_ROUND_TWO = (
    (F_MIRROR, "mirror_json_other_run", "mirror push"),
    (F_CWD, "plant_package", "pivot --restart"),
    (F_SWAP, "shard_swap1", "train --resume --require-signature"),
    (F_BOMB, "memo_bomb", "convert"),
    (F_SECRET, "secret_mirror_json", "mirror status (mirror.json)"),
    (F_ESC, "escape", "inspect"),
)


#: The .shards fixture's cases always in the sample: (target, family).
SAMPLE_SHARDS = (("step_000004.shards/model-00001-of-00002.safetensors", F_DAMAGE),
                 ("step_000004.shards/model.safetensors.index.json", F_SPECIAL))


def only_fixtures(cases: list[Case], names: str | None = None) -> list[Case]:
    """The cases of the fixtures named in ``names`` (comma-separated; default ``RIPRESA_FUZZ_FIXTURES``; empty: all):
    e.g. ``RIPRESA_FUZZ_FIXTURES=shards`` runs the matrix of one fixture."""
    names = os.environ.get("RIPRESA_FUZZ_FIXTURES", "") if names is None else names
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    return [c for c in cases if c.fixture in wanted] if wanted else cases


def sample_cases(cases: list[Case], n: int = 20, seed: int = 10) -> list[Case]:
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
    for fam, mutation, command in SAMPLE_ROUND_TWO:
        must += [c for c in cases if c.family == fam and c.mutation == mutation and c.command == command][:1]
    for fam, mutation, command in r3.SAMPLE_ROUND_THREE:
        must += [c for c in cases if c.family == fam and c.mutation == mutation and c.command == command][:1]
    for target, family in SAMPLE_SHARDS:  # the sharded general kind: a damaged shard, a special file as its index
        must += [c for c in cases if c.fixture == "shards" and c.target == target and c.family == family][:1]
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


def run_argv(argv: list[str], cwd: Path, env: dict[str, str], out: Path, timeout: float = TIMEOUT,
             during: Callable[[int], Callable[[], None]] | None = None):
    """Run ``argv`` in its own session; return (rc, hung, peak RSS bytes, stdout, stderr).

    ``during(pid)``, when given, starts something that acts while the command runs (the shard swap) and
    returns the function that stops it."""
    with open(out / "stdout.txt", "wb") as so, open(out / "stderr.txt", "wb") as se:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=so, stderr=se,
                                start_new_session=True, preexec_fn=_limits)
    stop = during(proc.pid) if during else None
    try:
        return _wait_child(proc, timeout, out)
    finally:
        if stop:
            stop()


def _wait_child(proc: subprocess.Popen, timeout: float, out: Path):
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


def _swap_watcher(target: Path, foreign: Path, fired: list[str]) -> Callable[[int], Callable[[], None]]:
    """Watch ``/proc/PID/fd``: once the command has opened ``target`` and closed it again, replace ``target``
    (atomic rename of a hard link to ``foreign``) — the bytes a second open by path would read are foreign."""
    real = os.path.realpath(target)
    after = foreign.with_name("after")
    closes = int(after.read_text()) if after.is_file() else 1

    def start(pid: int) -> Callable[[], None]:
        stop = threading.Event()

        def watch() -> None:
            seen, closed = False, 0
            while not stop.is_set():
                try:
                    fds = os.listdir(f"/proc/{pid}/fd")
                except OSError:
                    return
                now = False
                for fd in fds:
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{pid}/fd/{fd}") == real:
                            now = True
                            break
                if now:
                    seen = True
                elif seen:
                    seen, closed = False, closed + 1
                    if closed >= closes:
                        tmp = foreign.with_name("foreign.tmp")
                        os.link(foreign, tmp)
                        os.replace(tmp, real)
                        fired.append(f"swapped after close number {closed}")
                        return
                time.sleep(0.0003)

        t = threading.Thread(target=watch, daemon=True)
        t.start()

        def halt() -> None:
            stop.set()
            t.join(5)

        return halt

    return start


def _tree_hwm(pid: int) -> int:
    """Peak RSS (VmHWM, bytes) of ``pid`` and of every live descendant: the largest one."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
    best, todo = 0, [pid]
    while todo:
        q = todo.pop()
        todo += kids.get(q, [])
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{q}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]) * 1024)
    return best


def _watch_detached(pid: int, canary: Path, seconds: float = 20.0) -> int:
    """A trainer the command left running (its own session): watch it for ``seconds`` (canary, peak RSS of its
    process tree), then kill its process group. Returns the peak RSS seen (bytes)."""
    peak, t0 = 0, time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            if not Path(f"/proc/{pid}").exists() or canary.parent.exists():
                break
            peak = max(peak, _tree_hwm(pid))
            time.sleep(0.25)
        peak = max(peak, _tree_hwm(pid))
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    return peak


def _secret_counts(root: Path, secrets: list[str]) -> dict[str, int]:
    """Occurrences of any of ``secrets`` per regular file under ``root`` (never following links)."""
    found: dict[str, int] = {}
    toks = [t.encode() for t in secrets if t]
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            with contextlib.suppress(OSError):
                st = p.lstat()
                if st.st_mode & 0o170000 != 0o100000 or st.st_size > (256 << 20):
                    continue
                data = p.read_bytes()
                n = sum(data.count(t) for t in toks)
                if n:
                    found[str(p.relative_to(root))] = n
    return found


#: (fixture, mutation, command) -> post-condition beyond the common checks.
EXPECT_CASES = {
    ("planted", "plant_memo_dcp", "train --run"): "fallback",
    ("planted", "plant_deep_dcp", "train --run"): "fallback",
}
#: Control characters that never appear in ripresa's output to a file or pipe unless a file put them there.
CONTROL_BYTES = ("\x1b", "\x9b", "\x07", "\u202e")


def _expect(what: str, case: Case, fx: Fixtures, rc: int | None, od: Path) -> list[str]:
    if what == "genuine_weights":  # a load under RIPRESA_REQUIRE_SIGNATURE gives the signed bytes or nothing
        out = od / "x.bin"
        if rc == 0 and (not out.is_file() or _sha(out) != fx.ref_bin_sha):
            return ["FOREIGN WEIGHTS: exit 0 under RIPRESA_REQUIRE_SIGNATURE but the converted weights are not "
                    "the signed generation's"]
    if what == "genuine_resume":  # one step from the signed generation, re-signed: bitwise the reference step
        out = od / "new" / "step_000005.bin"
        if rc == 0 and (not out.is_file() or _sha(out) != fx.ref_resume_sha):
            return ["FOREIGN WEIGHTS: a --require-signature resume exited 0 but its next generation is not the one "
                    "the signed generation gives (foreign weights were loaded and re-signed)"]
    if what == "genuine_fork":  # a fork copies and re-signs: every copied file must be the signed generation's
        src, dst = fx.sdcp / "step_000004.dcp", od / "fork" / "step_000004.dcp"
        if rc == 0:
            names = sorted(os.listdir(src))
            if not dst.is_dir() or sorted(os.listdir(dst)) != names or any(
                    _sha(src / n) != _sha(dst / n) for n in names):
                return ["FOREIGN WEIGHTS: a fork under RIPRESA_REQUIRE_SIGNATURE exited 0 but the generation it copied "
                        "and re-signed is not the signed one"]
    if what == "fallback" and rc != 0:
        return [f"NO FALLBACK: exit {rc}; a resume must skip the bad generation and use the previous one"]
    return []


def run_case(case: Case, fx: Fixtures, work: Path, victim: Victim | None = None) -> Outcome:
    """Mutate a fresh copy of the fixture, run the command, check everything. The case dir is removed after."""
    out = Outcome(case)
    base = Path(tempfile.mkdtemp(prefix="c", dir=work))
    try:
        rng = random.Random(case.seed)
        outside, private, token = make_outside(base, rng)
        ctx = Ctx(outside, private, token, outside / "canary" / "PWNED", fx,
                  victim_pid=victim.pid if victim else 99999999, dead_pid=dead_pid(),
                  secret=f"S3cr3tPw{rng.getrandbits(64):016x}", side=base / "side")
        ctx.side.mkdir()
        folder = base / "F"
        src = fx.folder(case.fixture)
        shutil.copytree(src, folder, symlinks=True)
        rec = folder / "run" / "mirror.json"
        if case.fixture == "mirror" and rec.is_file():
            rec.write_text(rec.read_text().replace("@F@", str(folder)))
        od = base / "O"
        od.mkdir()
        logs = base / "logs"
        logs.mkdir()
        mutation = MUTATIONS[case.mutation]
        out.description = mutation(folder, case.target, rng, ctx)
        before = snapshot(outside)
        cmd = case.cmd
        secrets = [ctx.secret, FIXTURE_SECRET] if case.family == F_SECRET else []
        secrets_before = _secret_counts(base, secrets) if secrets else {}
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
        extra_env = dict(cmd.env)
        if extra_env.pop("@SECRET_ENV@", None):
            extra_env.update(_secret_env(ctx.secret))
        env = _env(extra_env)
        if victim:
            victim.reset()
        timeout = cmd.timeout or TIMEOUT
        if case.family == F_BOMB:  # a bomb must not take the memory; parsing 64 MiB may take a while on 2 loaded cores
            timeout = max(timeout, 150.0)
        fired: list[str] = []
        during = (_swap_watcher(folder / case.target, ctx.side / "foreign", fired)
                  if case.mutation.startswith("shard_swap") else None)
        with _held_lock(folder / "LOCK") if cmd.lock else contextlib.nullcontext(False):
            rc, hung, rss, so, se = run_argv(argv, folder if cmd.in_folder else base, env, logs, timeout, during)
        if during:
            out.description += f" [{fired[0] if fired else 'the swap never fired: the shard was not closed that often'}]"
        if cmd.detached and (m := re.search(r"restarted the trainer \(pid (\d+)\)", so)):
            peak = _watch_detached(int(m.group(1)), ctx.canary)
            out.description += f" [detached trainer pid {m.group(1)}: peak RSS {peak / (1 << 20):.0f} MiB]"
            if peak > RSS_LIMIT:
                out.problems.append(f"RSS {peak / (1 << 30):.2f} GiB > {RSS_LIMIT / (1 << 30):.1f} GiB "
                                    "(the detached trainer)")
        out.rc, out.hung, out.rss_mib = rc, hung, rss / (1 << 20)
        out.stderr_tail = "\n".join(se.strip().splitlines()[-6:])
        text = so + se
        if hung:
            out.problems.append(f"HANG: killed after {timeout:.0f} s")
        if case.family in ROUND_TWO + r3.FAMILIES and "this is a bug in ripresa or an input it does not recognise" in se:
            last = [ln for ln in se.strip().splitlines() if "could not complete" in ln][:1] or ["?"]
            out.problems.append(f"UNTYPED: the last-resort report instead of a typed error: {last[0][:200]}")
        bad = [repr(c) for c in CONTROL_BYTES if c in text]
        if bad:
            out.problems.append(f"ESCAPE: control characters of a file reached stdout/stderr: {', '.join(bad)}")
        if secrets:
            if any(t in text for t in secrets):
                out.problems.append("SECRET: the password is in the command's output")
            now = _secret_counts(base, secrets)
            grew = sorted(k for k, n in now.items() if n > secrets_before.get(k, 0))
            if grew:
                out.problems.append(f"SECRET: the password was written into {grew[:4]}")
        if cmd.expect:
            out.problems += _expect(cmd.expect, case, fx, rc, od)
        if case.family in r3.FAMILIES:
            out.problems += r3.check(case.mutation, case.command, rc, text, od)
        if (what := EXPECT_CASES.get((case.fixture, case.mutation, case.command))):
            out.problems += _expect(what, case, fx, rc, od)
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
            out.problems.append("EXECUTED: the crafted pickle's or planted package's payload created the canary")
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
    pristine = {k: snapshot(fx.folder(k)) for k in ("run", "bundle", "ledger", "dcp", "pt", "mirror", "sdcp", "gen",
                                                     "secret", "shards") if fx.folder(k) is not None}
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
        if o.case.family in (F_PICKLE, F_CWD):
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
