"""Fault matrix, family 4: bad and hostile inputs.

* the committed fixtures of ``tests/fixtures/hostile/`` (made by
  ``tests/faults/make_hostile.py``): truncated and forged ``.bin`` headers,
  trailing bytes, NaN/Inf; ``checkpoint.pt`` pickles that name ``os.system``,
  ``exec``, ``subprocess``, numpy's ``_reconstruct``, forged storage sizes, a
  corrupt zip directory, zip-slip member names — each with a *matching*
  sidecar, refused without executing anything; sidecars, markers and
  companions with bad hex, wrong lengths, ``../`` and absolute paths, deep
  nesting, malformed tagged nodes;
* symlinks, FIFOs, folders and devices where files are expected (never a hang);
* 1,000 single-bit flips in a generation (``.bin``, companion, marker, signature):
  every one detected — or, for the one flip that keeps a marker's meaning
  (``sha256sum``'s binary-mode ``*``), harmless;
* truncations of a generation's ``.bin`` at random offsets;
* property-based fuzzing (hypothesis) of the header parser and of the
  companion schema: thousands of examples in the long run, a few hundred here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import socket
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from faults.common import (
    KEY,
    Tally,
    arrays_for,
    companion_for,
    latest_valid_quietly,
    quiet_store,
    same_tree,
    scale,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.helpers import must_not_block

from ripresa.errors import IntegrityError, RipresaError, SchemaError
from ripresa.formats import companion as companion_fmt
from ripresa.formats.andrea_bin import read_bin, read_header
from ripresa.formats.torch_pt import load_checkpoint
from ripresa.io import fsio
from ripresa.store.store import CheckpointStore, generation_paths

HOSTILE = Path(__file__).resolve().parent / "fixtures" / "hostile"
MANIFEST = json.loads((HOSTILE / "manifest.json").read_text())
PWNED = "PWNED_BY_RIPRESA_FIXTURE"
N = 300


pytestmark = pytest.mark.usefixtures("clean_fault_ops")  # tests/conftest.py


def _two_generations(folder: Path, *, key: bytes | None = None) -> None:
    with CheckpointStore(folder, hmac_key=key) as store:
        for s in (1, 2):
            store.save(s, arrays_for(s, N), companion_for(s))


def _refusal_ok(exc: BaseException, case: dict) -> tuple[bool, str]:
    want = {"IntegrityError": IntegrityError, "SchemaError": SchemaError}[case["expect"]]
    text = str(exc)
    ok = isinstance(exc, want) and exc.exit_code == 1 and case["match"].lower() in text.lower()
    return ok, f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _generation_refuses(folder: Path, step: int, match: str, *, key: bytes | None = None) -> tuple[bool, str]:
    """Generation ``step`` is invalid (reason mentions ``match``), its load raises a RipresaError,
    and a resume falls back to the generation before it, bitwise intact."""
    store = quiet_store(folder, require_signature=key is not None, hmac_key=key)
    with must_not_block(10):
        g = store.check(step, deep=True)
        if g.valid:
            return False, "accepted"
        try:
            store.load(step)
            return False, "load accepted it"
        except RipresaError:
            pass
        except Exception as exc:  # anything else is a crash on hostile input
            return False, f"load crashed: {type(exc).__name__}: {exc}"
        latest = latest_valid_quietly(store)
    if latest is None or latest.step != step - 1:
        return False, f"fallback found {latest and latest.step}"
    contents, comp = store.load(latest.step)
    exp = arrays_for(latest.step, N)
    if not np.array_equal(contents.weights, exp.weights[0]):
        return False, "fallback generation differs"
    return match.lower() in (g.reason or "").lower(), f"reason: {g.reason}"


# ---------------------------------------------------------------- the committed fixtures

def test_hostile_bin_fixtures():
    tally = Tally("hostile .bin files", "truncated 0..8 and mid-file, n_params 0/-1/2^31-1/mismatched, "
                  "negative step, trailing bytes, NaN/Inf")
    for case in (c for c in MANIFEST if c["family"] == "bin"):
        path = HOSTILE / case["name"]
        tracemalloc.start()
        try:
            with must_not_block(10):
                read_bin(path, expected_n=case.get("expected_n"), check_finite=case.get("check_finite", False))
            ok, why = case["expect"] == "load", "accepted"
        except RipresaError as exc:
            ok, why = _refusal_ok(exc, case) if case["expect"] != "load" else (False, str(exc))
        except Exception as exc:
            ok, why = False, f"crashed: {type(exc).__name__}: {exc}"
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        if peak > 1 << 20:  # a forged header never makes the reader allocate
            ok, why = False, f"allocated {peak} bytes"
        tally.add(ok, case["name"], why)
    tally.check()


def test_hostile_checkpoint_pt_fixtures(tmp_path, monkeypatch):
    ran: list[str] = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(f"os.system{a}") or 0)
    import subprocess

    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: ran.append(f"check_call{a}") or 0)
    monkeypatch.chdir(tmp_path)
    tally = Tally("hostile checkpoint.pt", "pickles naming os.system/exec/subprocess, numpy _reconstruct, forged "
                  "storage sizes, corrupt zip directory, zip slip — with matching sidecars")
    for case in (c for c in MANIFEST if c["family"] == "pt"):
        work = tmp_path / case["name"].removesuffix(".pt")
        work.mkdir()
        shutil.copy(HOSTILE / case["name"], work / "checkpoint.pt")
        side = (HOSTILE / (case["name"] + ".sha256")).read_text().replace(case["name"], "checkpoint.pt")
        (work / "checkpoint.pt.sha256").write_text(side)
        try:
            with must_not_block(10):
                load_checkpoint(work / "checkpoint.pt")
            ok, why = False, "accepted"
        except RipresaError as exc:
            ok, why = _refusal_ok(exc, case)
        except Exception as exc:
            ok, why = False, f"crashed: {type(exc).__name__}: {exc}"
        pwned = list(tmp_path.rglob(PWNED)) + list(Path.cwd().glob(PWNED))
        if ran or pwned or Path("/tmp/ripresa_zip_slip").exists():
            ok, why = False, f"EXECUTED: {ran} {pwned}"
        tally.add(ok, case["name"], why)
    tally.check()
    assert not ran


def test_hostile_sidecar_fixtures(tmp_path):
    tally = Tally("hostile sidecars (.sha256)", "bad/uppercase hex, short/long, ../ and absolute paths, other "
                  "names, two lines, CRLF, NUL, empty, huge, binary, wrong hash")
    for k, case in enumerate(c for c in MANIFEST if c["family"] == "sidecar"):
        work = tmp_path / f"s{k}"
        work.mkdir()
        shutil.copy(HOSTILE / "sidecar_target.bin", work / "target.bin")
        shutil.copy(HOSTILE / case["name"], work / "target.bin.sha256")
        try:
            with must_not_block(10):
                fsio.verify_against_sidecar(work / "target.bin")
            ok, why = False, "accepted"
        except RipresaError as exc:
            ok, why = _refusal_ok(exc, case)
        except Exception as exc:
            ok, why = False, f"crashed: {type(exc).__name__}: {exc}"
        tally.add(ok, case["name"], why)
    tally.check()


def _placeholders(text: bytes, folder: Path, step: int) -> bytes:
    b, c, _ = generation_paths(folder, step)
    bin_sha = hashlib.sha256(b.read_bytes()).hexdigest()
    comp_sha = hashlib.sha256(c.read_bytes()).hexdigest()
    return (text.replace(b"@BIN_SHA_UPPER@", bin_sha.upper().encode()).replace(b"@BIN_SHA@", bin_sha.encode())
            .replace(b"@COMP_SHA@", comp_sha.encode()).replace(b"@BIN_SIZE@", str(8 + 12 * N).encode())
            .replace(b"@N@", str(N).encode()))


def _rewrite_marker_for_companion(folder: Path, step: int) -> None:
    """An attacker who rewrites the companion also rewrites the marker to match."""
    b, c, mk = generation_paths(folder, step)
    mk.write_text(f"{hashlib.sha256(b.read_bytes()).hexdigest()}  {b.name}\n"
                  f"{hashlib.sha256(c.read_bytes()).hexdigest()}  {c.name}\n")


def test_hostile_marker_and_companion_fixtures(tmp_path):
    base = tmp_path / "base"
    _two_generations(base)
    tallies = {"marker": Tally("hostile commit markers", "one/three lines, swapped hashes, ../ and absolute "
                               "paths, another generation's names, bad/short/uppercase hex, empty, huge, binary"),
               "companion": Tally("hostile companions", "bad JSON/UTF-8, wrong envelope, ../ and absolute .bin "
                                  "names, bad sha/sizes/types, deep nesting, malformed tensors and tags "
                                  "(marker rewritten to match)")}
    for k, case in enumerate(c for c in MANIFEST if c["family"] in tallies):
        folder = tmp_path / f"g{k}"
        shutil.copytree(base, folder)
        b, c, mk = generation_paths(folder, 2)
        raw = _placeholders((HOSTILE / case["name"]).read_bytes(), folder, 2)
        if case["family"] == "marker":
            mk.write_bytes(raw)
        else:
            c.write_bytes(raw)
            _rewrite_marker_for_companion(folder, 2)
        ok, why = _generation_refuses(folder, 2, case["match"])
        tallies[case["family"]].add(ok, case["name"], why)
        shutil.rmtree(folder)
    for t in tallies.values():
        t.check()


def test_fixtures_are_what_the_generator_writes():
    """The committed manifest lists exactly the committed files (regenerate with make_hostile.py)."""
    names = {c["name"] for c in MANIFEST} | {c["name"] + ".sha256" for c in MANIFEST if c["family"] == "pt"}
    names |= {"manifest.json", "sidecar_target.bin"}
    assert names == {p.name for p in HOSTILE.iterdir()}
    assert sum(p.stat().st_size for p in HOSTILE.iterdir()) < 200_000


# ---------------------------------------------------------------- special files where files are expected

def _make_special(path: Path, kind: str, tmp: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "symlink-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink-fifo":
        fifo = tmp / f"fifo-{path.name}"
        os.mkfifo(fifo)
        path.symlink_to(fifo)
    elif kind == "symlink-dangling":
        path.symlink_to(tmp / "nothing-here")
    elif kind == "symlink-outside":
        path.symlink_to("/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd")
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        with contextlib.chdir(path.parent):  # AF_UNIX paths are short: bind the bare name
            s.bind(path.name)
        s.close()
    else:  # pragma: no cover
        raise AssertionError(kind)


KINDS = ["fifo", "folder", "symlink-dev-zero", "symlink-fifo", "symlink-dangling", "symlink-outside", "socket"]


def test_special_files_where_generation_files_are_expected(tmp_path):
    base = tmp_path / "base"
    _two_generations(base, key=KEY)
    tally = Tally("symlinks/FIFOs/folders/sockets as files", "each file of a generation (and checkpoint.pt, "
                  "its sidecar) replaced: refused, never a hang")
    for role in ("bin", "companion", "marker", "signature"):
        for kind in KINDS:
            folder = tmp_path / f"{role}-{kind}"
            shutil.copytree(base, folder, symlinks=True)
            b, c, mk = generation_paths(folder, 2)
            target = {"bin": b, "companion": c, "marker": mk, "signature": b.with_name(b.name + ".hmac")}[role]
            _make_special(target, kind, tmp_path)
            try:
                ok, why = _generation_refuses(folder, 2, "", key=KEY)
            except TimeoutError as exc:
                ok, why = False, str(exc)
            tally.add(ok, f"{role} as {kind}", why)
    for role in ("checkpoint.pt", "checkpoint.pt.sha256"):
        for kind in KINDS:
            folder = tmp_path / f"pt-{role}-{kind}"
            folder.mkdir()
            shutil.copy(HOSTILE / "pt_not_a_dict.pt", folder / "checkpoint.pt")
            (folder / "checkpoint.pt.sha256").write_text(f"{'0' * 64}  checkpoint.pt\n")
            _make_special(folder / role, kind, tmp_path)
            try:
                with must_not_block(10):
                    load_checkpoint(folder / "checkpoint.pt")
                ok, why = False, "accepted"
            except RipresaError as exc:
                ok, why = True, str(exc).splitlines()[0]
            except Exception as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            tally.add(ok, f"{role} as {kind}", why)
    tally.check()


def test_a_symlink_to_an_identical_copy_is_content_verified(tmp_path):
    """The marker vouches for content, not for inodes: a .bin symlinked to an identical copy is
    the same generation (documented); to a different file, it is refused."""
    _two_generations(tmp_path / "run")
    b, _, _ = generation_paths(tmp_path / "run", 2)
    copy = tmp_path / "elsewhere.bin"
    shutil.copy(b, copy)
    b.unlink()
    b.symlink_to(copy)
    store = quiet_store(tmp_path / "run")
    assert store.check(2, deep=True).valid
    copy.write_bytes(copy.read_bytes()[:-4] + b"\0\0\0\0")
    assert not store.check(2, deep=True).valid


# ---------------------------------------------------------------- bit flips and truncations

def _flip(path: Path, bit: int) -> bytes:
    data = path.read_bytes()
    buf = bytearray(data)
    buf[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(buf))
    return data


@pytest.mark.parametrize("signed", [pytest.param(False, id="unsigned"), pytest.param(True, id="signed", marks=pytest.mark.slow)])
def test_single_bit_flips_in_a_generation_are_all_detected(tmp_path, signed):
    key = KEY if signed else None
    run = tmp_path / "run"
    _two_generations(run, key=key)
    b, c, mk = generation_paths(run, 2)
    files = [b, c, mk] + ([b.with_name(b.name + ".hmac")] if signed else [])
    bits = [(f, i) for f in files for i in range(f.stat().st_size * 8)]
    rnd = random.Random(21 + signed)
    total = scale(1000, 5000) if not signed else scale(200, 1000)
    # every file gets its share (the small ones are not drowned by the .bin)
    chosen = []
    for f in files:
        own = [x for x in bits if x[0] == f]
        chosen += rnd.sample(own, min(len(own), -(-total // len(files))))
    tally = Tally("single-bit flips in a generation", "random bit flips in .bin, companion, marker (and .hmac): "
                  "detected, fallback to the previous generation")
    detected = harmless = 0
    store = quiet_store(run, require_signature=signed, hmac_key=key)
    for f, bit in chosen:
        original = _flip(f, bit)
        try:
            g = latest_valid_quietly(store)
            if g is not None and g.step == 1:
                detected += 1
                ok, why = True, ""
            elif g is not None and g.step == 2:  # not detected: must be a flip that changes nothing loaded
                contents, comp = store.load(2)
                exp = arrays_for(2, N)
                ok = np.array_equal(contents.weights, exp.weights[0]) and np.array_equal(contents.v, exp.v[0]) \
                    and np.array_equal(contents.m, exp.m[0]) and same_tree(comp, companion_for(2))
                harmless += ok
                why = "an undetected flip changed what was loaded"
            else:
                ok, why = False, f"no fallback ({g})"
        except Exception as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        finally:
            f.write_bytes(original)
        tally.add(ok, f"{f.name} bit {bit}", why)
    tally.detail = f"{'signed' if signed else 'unsigned'}: {detected} detected, {harmless} harmless (same meaning)"
    tally.check()
    assert harmless <= len([1 for f, _ in chosen if f == mk])  # only marker flips can be meaning-preserving


def test_truncating_a_generations_bin_at_random_offsets_falls_back(tmp_path):
    run = tmp_path / "run"
    _two_generations(run)
    b, _, _ = generation_paths(run, 2)
    data = b.read_bytes()
    rnd = random.Random(8)
    cuts = sorted(set(range(0, 9)) | set(rnd.sample(range(9, len(data)), scale(20, 300))))
    tally = Tally("truncated .bin in a generation", "the newest .bin cut at 0..8 and random offsets: fallback")
    for cut in cuts:
        b.write_bytes(data[:cut])
        ok, why = _generation_refuses(run, 2, "truncated" if cut >= 8 else "")
        tally.add(ok, f"cut at {cut}", why)
    b.write_bytes(data)
    tally.check()


# ---------------------------------------------------------------- property-based fuzzing

EXAMPLES = scale(300, 5000)
#: Examples run and failed by each fuzzer (recorded in the fault table by the last test of this file).
FUZZ: dict[str, list[int]] = {}


@contextlib.contextmanager
def counted(name: str):
    tried_failed = FUZZ.setdefault(name, [0, 0])
    tried_failed[0] += 1
    try:
        yield
    except BaseException:
        tried_failed[1] += 1
        raise
int32 = st.integers(-(2**31), 2**31 - 1)
edge = st.sampled_from([0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**30, 1000])


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(step=st.one_of(edge, int32), n=st.one_of(edge, int32, st.integers(1, 40)),
       body=st.binary(max_size=600), extra=st.integers(-3, 3), exact=st.booleans(),
       check_finite=st.booleans(), expected_n=st.one_of(st.none(), st.integers(1, 40)))
def test_fuzz_bin_reader(fuzz_dir, step, n, body, extra, exact, check_finite, expected_n):
    """read_bin on any bytes: a consistent result or a RipresaError, never a crash or a big allocation."""
    with counted("read_bin"):
        _fuzz_bin_reader(fuzz_dir, step, n, body, extra, exact, check_finite, expected_n)


def _fuzz_bin_reader(fuzz_dir, step, n, body, extra, exact, check_finite, expected_n):
    head = struct.pack("<ii", step, n)
    if exact and 1 <= n <= 40:  # a body of exactly the right size (plus a few bytes off)
        body = (body * (12 * n // max(len(body), 1) + 1))[: 12 * n] if body else bytes(12 * n)
        body = body[: max(0, len(body) + extra)] + bytes(max(0, extra))
    data = head + body
    path = fuzz_dir / "f.bin"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        c = read_bin(path, expected_n=expected_n, check_finite=check_finite)
    except RipresaError as exc:
        assert exc.exit_code in (1, 2)
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 * len(data) + (1 << 16)
    assert len(data) == 8 + 12 * c.n_params and c.step == step >= 0 and c.n_params == n
    assert expected_n in (None, n)
    assert c.weights.tobytes() + c.m.tobytes() + c.v.tobytes() == data[8:]
    if check_finite:
        assert np.isfinite(c.weights).all() and np.isfinite(c.m).all() and np.isfinite(c.v).all()


@settings(max_examples=scale(60, 600), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=st.one_of(edge, int32), n=st.one_of(edge, int32), size=st.one_of(st.integers(0, 64), st.integers(2**31, 2**40)))
def test_fuzz_header_of_huge_sparse_files_allocates_nothing(fuzz_dir, step, n, size):
    with counted("sparse headers"):
        _fuzz_sparse(fuzz_dir, step, n, size)


def _fuzz_sparse(fuzz_dir, step, n, size):
    path = fuzz_dir / "sparse.bin"
    with open(path, "wb") as f:
        f.write(struct.pack("<ii", step, n)[:size])
        f.truncate(size)
    tracemalloc.start()
    try:
        h = read_header(path)
        assert h.file_size == size and h.step == step and h.n_params == n
    except RipresaError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        path.unlink()
    assert peak < 1 << 16


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                      st.text(max_size=8), st.sampled_from(["__tensor__", "__tuple__", "__dict__", "float32", "bool"]))
json_tree = st.recursive(json_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=6), st.sampled_from(["__tensor__", "shape", "data", "__tuple__",
                                                                   "__dict__", "bin", "state"])), kids, max_size=4),
), max_leaves=20)
tagged = st.one_of(
    st.fixed_dictionaries({"__tensor__": st.one_of(st.sampled_from(["float32", "int64", "bool", "float64", "bfloat16"]),
                                                   st.text(max_size=5)),
                           "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), json_tree),
                           "data": st.one_of(st.lists(st.one_of(st.floats(), st.integers(-5, 5), st.booleans()),
                                                      max_size=8), json_tree)}),
    st.fixed_dictionaries({"__tuple__": json_tree}),
    st.fixed_dictionaries({"__dict__": st.one_of(st.lists(st.lists(json_tree, max_size=3), max_size=3), json_tree)}),
)


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("fuzzrun")
    _two_generations(run)
    return run


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(where=st.sampled_from(["whole", "state", "bin-field", "tagged"]), tree=json_tree, node=tagged,
       field=st.sampled_from(["name", "sha256", "size", "step", "n_params"]))
def test_fuzz_companion_schema(fuzz_run, where, tree, node, field):
    """Any companion (its marker rewritten to match): the store refuses with a RipresaError or
    loads it; never another exception, and a deep check that passes means the load succeeds."""
    with counted("companions through the store"):
        _fuzz_companion(fuzz_run, where, tree, node, field)


def _fuzz_companion(fuzz_run, where, tree, node, field):
    b, c, mk = generation_paths(fuzz_run, 2)
    original_c, original_mk = c.read_bytes(), mk.read_bytes()
    doc = json.loads(original_c)
    if where == "whole":
        doc = tree
    elif where == "state":
        doc["state"] = tree if isinstance(tree, dict) else {"x": tree}
    elif where == "tagged":
        doc["state"]["t"] = node
    else:
        doc["bin"][field] = tree
    try:
        c.write_bytes(json.dumps(doc, allow_nan=True).encode())
        _rewrite_marker_for_companion(fuzz_run, 2)
        store = quiet_store(fuzz_run)
        g = store.check(2, deep=True)
        try:
            store.load(2)
            loaded = True
        except RipresaError:
            loaded = False
        assert loaded or not g.valid, f"deep check passed but load failed: {doc!r:.300}"
        latest = latest_valid_quietly(store)
        assert latest is not None and latest.step in (1, 2)
    finally:
        c.write_bytes(original_c)
        mk.write_bytes(original_mk)


dtypes = st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                          torch.int16, torch.int8, torch.uint8, torch.bool])


@st.composite
def tensors(draw):
    dt = draw(dtypes)
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    numel = int(np.prod(shape)) if shape else 1
    if dt.is_floating_point:
        vals = draw(st.lists(st.floats(width=16 if dt in (torch.float16, torch.bfloat16) else 32 if dt == torch.float32 else 64,
                                       allow_nan=False), min_size=numel, max_size=numel))
    elif dt == torch.bool:
        vals = draw(st.lists(st.booleans(), min_size=numel, max_size=numel))
    else:
        info = torch.iinfo(dt)
        vals = draw(st.lists(st.integers(info.min, info.max), min_size=numel, max_size=numel))
    return torch.tensor(vals, dtype=torch.float64 if dt.is_floating_point else dt).to(dt).reshape(shape)


state_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**62), 2**62), st.floats(allow_nan=False),
                       st.text(max_size=6), tensors())
state_tree = st.recursive(state_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.tuples(kids, kids),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3), st.sampled_from(["__x__", "__tensor__"])),
                    kids, max_size=3),
), max_leaves=12)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(tree=state_tree)
def test_fuzz_companion_state_round_trips_bit_exactly(tree):
    """encode → JSON → decode gives back every state tree bit for bit (tensors, tuples, int keys...)."""
    with counted("state round trips"):
        raw = companion_fmt.dumps({"state": companion_fmt.encode_tree({"s": tree})})
        back = companion_fmt.decode_tree(json.loads(raw)["state"])["s"]
        assert same_tree(back, tree)


def test_fuzz_examples_are_recorded():
    """The fuzzers' volume and failures, in the fault table (runs after them: same file, later)."""
    t = Tally("property-based fuzzing (hypothesis)", "read_bin on arbitrary bytes, headers of huge sparse files, "
              "arbitrary companions through the store, state round trips")
    for name, (tried, failed) in sorted(FUZZ.items()):
        for k in range(tried):
            t.add(k >= failed, name, "a counterexample (see the test's failure)")
    t.detail = ", ".join(f"{name}: {tried}" for name, (tried, _) in sorted(FUZZ.items()))
    t.check()


# ---------------------------------------------------------------- class 6 of issue #19: terminal escapes

#: What a hostile file plants for the terminal: a window-title OSC, clear screen, a cursor move, a bell,
#: a carriage return that overwrites the line, a C1 CSI, a bidi override, and rich markup (a link, a style).
TERMINAL_ATTACKS = ("\x1b]0;pwned\x07", "\x1b[2J", "\x1b[1;1H", "\x07", "\rOK", "\x9b31m", "\u202egnp.exe",
                    "[link=https://evil.example]click[/link]", "[bold red]FAKE OK[/]")


def test_escape_terminal_shows_every_control_character_and_keeps_text():
    from ripresa.text import escape_markup, escape_terminal, has_control, safe_console

    for attack in TERMINAL_ATTACKS:
        out = escape_terminal(attack)
        assert not has_control(out) and "\x1b" not in out and "\x07" not in out and "\r" not in out, repr(out)
    assert escape_terminal("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert escape_terminal("step 4\tok\nnext") == "step 4\tok\nnext"
    assert escape_terminal("a\nb", newlines=False) == "a\\nb"
    assert escape_terminal("caf\udce9") == "caf\\xe9"  # a surrogate-escaped byte of a file name
    assert escape_terminal("naïve ✓ 日本") == "naïve ✓ 日本"
    assert escape_markup("[link=x]y[/link]") == "\\[link=x]y\\[/link]"
    # a rich Console made by ripresa: no control character reaches the stream, from a string, a cell or a title
    import io

    from rich.table import Table

    buf = io.StringIO()
    con = safe_console(file=buf, force_terminal=False, width=200)
    t = Table(title="t \x1b[2J")
    t.add_row("cell \x1b]0;pwned\x07", "\x9b31m")
    con.print("line \x1b[1;1H", t)
    printed = buf.getvalue()
    assert not has_control(printed), repr(printed)
    assert "\\x1b]0;pwned\\x07" in printed and "\\x1b[2J" in printed


def test_errors_print_quoted_file_content_terminal_safe():
    exc = IntegrityError("bad companion \x1b[2J", file="run/step\x1b]0;x\x07.json", expected="a\nb",
                         found="\x1b[31mred\r  hint:     forged", hint="see \x07")
    text = str(exc)
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert len(text.splitlines()) == 5  # a newline in a file's value cannot forge another line of the report
    assert exc.as_dict()["found"] == "\x1b[31mred\r  hint:     forged"  # JSON keeps the value (json.dumps escapes it)


@pytest.mark.slow
def test_no_escape_sequence_reaches_the_terminal_from_a_run_folder(tmp_path):
    """A generation whose companion (resealed, as an attacker would) and file names carry escape sequences and
    rich markup: `ripresa inspect` of the folder and of the .bin prints none of them raw (issue #19, class 6)."""
    import subprocess
    import sys

    folder = tmp_path / "run"
    _two_generations(folder)
    b, c, _mk = generation_paths(folder, 2)
    doc = json.loads(c.read_text())
    planted = "".join(TERMINAL_ATTACKS)
    state = doc["state"]
    state["versions"] = {"torch\x1b]0;pwned\x07": planted, "python": planted}
    state["progress"] = dict(state.get("progress") or {}, note=planted)
    c.write_text(json.dumps(doc))
    _rewrite_marker_for_companion(folder, 2)
    (folder / f".step_000002.bin.tmp.{os.getpid()}.0000abcd").write_bytes(b"x")
    (folder / "step_000003.json").write_text('{"format": "ripresa.companion\x1b[2J", "x": "' + planted + '"}')
    (folder / "note\x1b]0;pwned\x07.txt").write_text(planted)
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    env.pop("FORCE_COLOR", None)
    for argv in (["inspect", str(folder)], ["inspect", str(b), "--deep"],
                 ["inspect", str(folder / "step_000003.json")]):
        res = subprocess.run([sys.executable, "-m", "ripresa", *argv], capture_output=True, env=env, timeout=120,
                             cwd=tmp_path)
        out = res.stdout + res.stderr
        assert b"Traceback" not in out, out.decode(errors="replace")[-2000:]
        assert res.returncode in (0, 1, 2)
        for bad in (b"\x1b", b"\x07", b"\x9b", "\u202e".encode(), b"\r"):
            assert bad not in out, (argv, bad, out.decode(errors="replace")[-3000:])
        assert b"https://evil.example" not in out or b"[link=" in out  # markup shown as text, never a hyperlink
