"""Fault matrix, family 1: SIGKILL at every system-call boundary and at byte offsets.

A real process (a fork of the test process, so no interpreter start per case)
saves with ``install_crash_hook`` (``tests/support/ripresa_faults.py``) — the
same code ``RIPRESA_CRASH_AT`` runs — and is killed with SIGKILL *before* and *after* each operation of the
save protocol (open, each write, each fsync, each rename, each folder fsync,
each retention unlink), or once exactly N bytes of one file are on disk.
Then a reader must find a committed generation, bitwise equal to what was
saved: the old one if the kill came before the marker's rename, the new one
after it; every generation the deep check calls valid must load bitwise
equal; and the next writer start leaves no temporary and saves again.

``tests/test_store.py`` already kills at random *moments* and injects
``OSError`` at every operation; this matrix adds the exact boundaries,
before/after, byte offsets, signed generations, ``checkpoint.pt``, sidecar
files and the history.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import same_generation, valid_steps
from faults.common import (
    KEY,
    Tally,
    arrays_for,
    companion_for,
    in_child,
    pick,
    recover_and_check,
    reset_ops,
    same_tree,
    scale,
    spread,
    temporaries,
    tiny_pt_state,
)
from support.ripresa_faults import fault_env, install_crash_hook, install_fail_hook

from ripresa.errors import RipresaError
from ripresa.formats.torch_pt import load_checkpoint, save_checkpoint
from ripresa.io import fsio
from ripresa.store.history import History, read_history
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore

N = 3000  # params: a 36 KB .bin, four writes (header, weights, m, v)
#: A .bin whose regions are >= 1 MiB each: fsio hashes them in its helper thread while they are written.
N_LARGE = 300_000
KILLED = -signal.SIGKILL


pytestmark = pytest.mark.usefixtures("clean_fault_ops")  # tests/conftest.py


# ---------------------------------------------------------------- the generation save

def _prepare(folder: Path, signed: bool, n: int = N) -> None:
    """Generations 1 and 2 committed; the save under test writes 3 and retention drops 1."""
    key = KEY if signed else None
    with CheckpointStore(folder, retention=KeepLast(2), hmac_key=key) as store:
        for s in (1, 2):
            store.save(s, arrays_for(s, n), companion_for(s))


def _save3(folder: Path, signed: bool, n: int = N) -> None:
    with CheckpointStore(folder, retention=KeepLast(2), hmac_key=KEY if signed else None) as store:
        store.save(3, arrays_for(3, n), companion_for(3))


def _record_save(tmp: Path, signed: bool, n: int = N) -> list[fsio.RecordedOp]:
    probe = tmp / f"probe-{signed}"
    _prepare(probe, signed, n)
    seen: list[fsio.RecordedOp] = []
    fsio.ops.recorder = seen.append
    try:
        _save3(probe, signed, n)
    finally:
        fsio.ops.recorder = None
    shutil.rmtree(probe)
    return seen


def _phase(rec: fsio.RecordedOp, previous: str) -> str:
    """Which file of the protocol an operation belongs to (folder fsyncs: the file before them)."""
    name = os.path.basename(rec.dst or rec.path)
    if rec.op == "fsync_dir":
        return previous
    if rec.op == "unlink":
        return "retention"
    for suffix, phase in ((".bin.sha256", "marker"), (".bin.hmac", "signature"), (".json", "companion"), (".bin", "bin")):
        if suffix in name:
            return phase
    return previous


FAMILY = {
    "bin": ("kill: generation .bin", "SIGKILL before/after each op of the .bin, and at byte offsets"),
    "companion": ("kill: generation companion .json", "SIGKILL before/after each op of the companion, byte offsets"),
    "marker": ("kill: commit marker .bin.sha256", "SIGKILL around the marker (the commit point), byte offsets"),
    "signature": ("kill: signature .bin.hmac", "SIGKILL around the HMAC signature file, byte offsets"),
    "retention": ("kill: retention (unlinks)", "SIGKILL around each unlink of an old generation"),
}


def _kill_specs(ops: list[fsio.RecordedOp]) -> list[tuple[str, str, int]]:
    """(spec, phase, ops completed when the kill lands) for every boundary."""
    specs = []
    counts: dict[str, int] = {}
    phase = "bin"
    for i, rec in enumerate(ops):
        counts[rec.op] = counts.get(rec.op, 0) + 1
        phase = _phase(rec, phase)
        specs.append((f"{rec.op}:{counts[rec.op]}", phase, i))
        specs.append((f"after:{rec.op}:{counts[rec.op]}", phase, i + 1))
    return specs


def _byte_specs(ops: list[fsio.RecordedOp], rnd: random.Random, per_file: int) -> list[tuple[str, str, int]]:
    """``bytes:N@TEMP`` kills inside each written file (first byte, last byte, random ones)."""
    sizes: dict[str, int] = {}
    first_op: dict[str, int] = {}
    for i, rec in enumerate(ops):
        if rec.op == "write":
            name = os.path.basename(rec.path)
            sizes[name] = sizes.get(name, 0) + len(rec.data or b"")
            first_op.setdefault(name, i)
    specs = []
    for name, size in sizes.items():
        # ".step_000003.bin.tmp.PID.RAND" -> "step_000003.bin.tmp": the same file in the child
        stem = name[1:].split(".tmp.")[0] + ".tmp"
        phase = _phase(fsio.RecordedOp("write", name), "bin")
        for n in spread(rnd, 0, size, per_file, must=(0, 1, 7, 8, size - 1)):
            specs.append((f"bytes:{n}@{stem}", phase, first_op[name]))
    return specs


def _marker_rename_index(ops: list[fsio.RecordedOp]) -> int:
    return next(i for i, r in enumerate(ops) if r.op == "rename" and (r.dst or "").endswith("step_000003.bin.sha256"))


@pytest.mark.parametrize(("signed", "n"), [pytest.param(False, N, id="unsigned"),  # the default tier's sample
                                           pytest.param(True, N, id="signed", marks=pytest.mark.slow),
                                           pytest.param(False, N_LARGE, id="large-regions", marks=pytest.mark.slow)])
def test_sigkill_at_every_boundary_and_byte_offset_of_a_generation_save(tmp_path, signed, n):
    ops = _record_save(tmp_path, signed, n)
    commit = _marker_rename_index(ops)
    rnd = random.Random(11 + signed + n)
    boundaries = _kill_specs(ops)
    small = n == N and not signed
    cases = pick(boundaries, 24 if small else 8) + pick(_byte_specs(ops, rnd, scale(3, 40)), 10 if small else 5)
    tallies = {phase: Tally(*FAMILY[phase]) for phase in FAMILY}
    base = tmp_path / "base"
    _prepare(base, signed, n)
    for k, (spec, phase, done) in enumerate(cases):
        folder = tmp_path / f"case{k}"
        shutil.copytree(base, folder)

        def child(folder=folder, spec=spec):
            install_crash_hook(spec)
            _save3(folder, signed, n)

        code = in_child(child)
        label = f"{'signed ' if signed else ''}{'large ' if n != N else ''}{spec}"
        if code != KILLED:
            tallies[phase].add(False, label, f"the child was not killed (exit {code})")
            continue
        committed = spec.startswith("bytes:") is False and done > commit
        v = recover_and_check(folder, n, floor=3 if committed else 2, newest_possible=3,
                              key=KEY if signed else None, exact=3 if committed else 2)
        if v.ok:
            # The next start: the writer removes the dead writer's temporaries and saves again.
            with CheckpointStore(folder, retention=KeepLast(2), hmac_key=KEY if signed else None) as store:
                left = temporaries(folder)
                store.save(4, arrays_for(4, n), companion_for(4))
            v = recover_and_check(folder, n, floor=4, newest_possible=4, key=KEY if signed else None, exact=4)
            if left:
                v.ok, v.why = False, f"temporaries left after the next start: {left}"
        tallies[phase].add(v.ok, label, v.why)
        shutil.rmtree(folder)
    for t in tallies.values():
        if t.cases:
            t.record()
    for t in tallies.values():
        if t.cases:
            t.check()
    assert sum(t.cases for t in tallies.values()) == len(cases)


# ---------------------------------------------------------------- checkpoint.pt

STATE = tiny_pt_state()


def _save_pt(folder: Path) -> None:
    save_checkpoint(folder / "checkpoint.pt", STATE)


@pytest.mark.slow
def test_sigkill_at_every_boundary_of_a_checkpoint_pt_save(tmp_path):
    """``checkpoint.pt`` is written into a new folder (the verification contract):
    after a kill it is either committed and bitwise equal, or refused with a
    clear error — never a damaged file that loads."""
    probe = tmp_path / "probe"
    probe.mkdir()
    ops: list[fsio.RecordedOp] = []
    fsio.ops.recorder = ops.append
    try:
        _save_pt(probe)
    finally:
        fsio.ops.recorder = None
    commit = next(i for i, r in enumerate(ops) if r.op == "rename" and (r.dst or "").endswith(".sha256"))
    rnd = random.Random(5)
    specs = [(s, i) for s, _, i in _kill_specs(ops)]
    size = sum(len(r.data or b"") for r in ops if r.op == "write" and "checkpoint.pt.tmp" in r.path)
    specs = pick(specs, 12) + [(f"bytes:{n}@checkpoint.pt.tmp", 0) for n in spread(rnd, 0, size, scale(6, 60), must=(0, size - 1))]
    tally = Tally("kill: checkpoint.pt + .sha256", "SIGKILL at each op boundary / byte offset of save_checkpoint")
    for k, (spec, done) in enumerate(specs):
        folder = tmp_path / f"case{k}"
        folder.mkdir()

        def child(folder=folder, spec=spec):
            install_crash_hook(spec)
            _save_pt(folder)

        code = in_child(child)
        committed = not spec.startswith("bytes:") and done > commit
        ok, why = code == KILLED, f"exit {code}"
        if ok:
            try:
                ck = load_checkpoint(folder / "checkpoint.pt")
            except RipresaError as exc:
                ok, why = not committed, f"committed checkpoint refused: {exc.message}"
            except Exception as exc:
                ok, why = False, f"unclear error {type(exc).__name__}: {exc}"
            else:
                ok, why = same_tree(ck.state, STATE), "loaded but differs from what was saved"
        if ok:
            _save_pt(folder)  # the next attempt cleans up and commits
            ok = same_tree(load_checkpoint(folder / "checkpoint.pt").state, STATE) and not temporaries(folder)
            why = "the next save did not commit cleanly"
        tally.add(ok, spec, why)
        shutil.rmtree(folder)
    tally.check()


# ---------------------------------------------------------------- sidecar files (write_atomic)

def test_sigkill_at_every_boundary_of_a_sidecar_rewrite(tmp_path):
    """``.state.json``/``config.json`` are rewritten with ``write_atomic``: after a kill a
    reader sees the complete old or the complete new content, never a mix or nothing."""
    old = json.dumps({"arms": {"a": 0.5, "b": 0.5}, "version": 1}, indent=1).encode() * 40
    new = json.dumps({"arms": {"a": 0.7, "b": 0.3}, "version": 2}, indent=1).encode() * 40
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / ".state.json").write_bytes(old)
    ops: list[fsio.RecordedOp] = []
    fsio.ops.recorder = ops.append
    try:
        fsio.write_atomic(probe / ".state.json", [new[:1000], new[1000:]])
    finally:
        fsio.ops.recorder = None
    rename = next(i for i, r in enumerate(ops) if r.op == "rename")
    rnd = random.Random(3)
    specs = [(s, i) for s, _, i in _kill_specs(ops)]
    specs += [(f"bytes:{n}@.state.json.tmp", 0) for n in spread(rnd, 0, len(new), scale(4, 40), must=(0, 999, 1000))]
    tally = Tally("kill: sidecar files (write_atomic)", "SIGKILL around each op / byte of a sidecar rewrite")
    for k, (spec, done) in enumerate(specs):
        folder = tmp_path / f"case{k}"
        folder.mkdir()
        (folder / ".state.json").write_bytes(old)

        def child(folder=folder, spec=spec):
            install_crash_hook(spec)
            fsio.write_atomic(folder / ".state.json", [new[:1000], new[1000:]])

        code = in_child(child)
        want = new if (not spec.startswith("bytes:") and done > rename) else old
        got = (folder / ".state.json").read_bytes()
        fsio.clean_temporaries(folder)
        tally.add(code == KILLED and got == want and not temporaries(folder), spec,
                  f"exit {code}, content {'old' if got == old else 'new' if got == new else 'TORN'}")
        shutil.rmtree(folder)
    tally.check()


# ---------------------------------------------------------------- the history

def _append_forever(path: Path, ready_w: int) -> None:
    view = read_history(path) if path.exists() else None
    step = max(view.steps) + 1 if view and view.steps else 1  # a resumed run goes on
    h = History(path)
    os.write(ready_w, b"1")
    while True:
        h.step(step, loss=1.0 / step, lr=1e-3)
        if step % 10 == 0:
            h.sync()
            h.event("checkpoint", step=step)
        step += 1


def test_sigkill_during_history_appends(tmp_path):
    """A process appending to ``.loss.jsonl`` killed at random moments, then a
    torn append cut at every byte offset: readers keep every committed line, skip
    the torn one, and the next writer appends readable lines after it."""
    tally = Tally("kill: history append (.loss.jsonl)", "SIGKILL mid-appends + a torn append cut at every byte")
    rnd = random.Random(9)
    path = tmp_path / "kills" / ".loss.jsonl"
    path.parent.mkdir()
    for k in range(scale(6, 60)):
        before = read_history(path).steps if path.exists() else {}
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.close(r)
            try:
                _append_forever(path, w)
            finally:
                os._exit(3)
        os.close(w)
        os.read(r, 1)
        os.close(r)
        time.sleep(rnd.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        view = read_history(path)
        steps = sorted(view.steps)
        # SIGKILL keeps the page cache: every line written before is still there, unchanged
        ok = all(view.steps.get(s) == rec for s, rec in before.items())
        ok = ok and steps == list(range(1, len(steps) + 1)) and len(view.skipped_lines) <= k + 1
        tally.add(ok, f"kill {k}", f"steps {steps[:3]}..{steps[-3:]}, skipped {view.skipped_lines}")
    # A torn append at every byte offset of one line.
    base = tmp_path / "base.jsonl"
    h = History(base)
    for s in range(1, 6):
        h.step(s, loss=float(s))
    h.sync()
    h.close()
    committed = read_history(base)
    line = json.dumps({"step": 6, "loss": 6.0, "lr": 0.001, "time": 1.0}, separators=(",", ":")).encode() + b"\n"
    for cut in range(len(line) + 1):
        p = tmp_path / f"torn{cut}.jsonl"
        p.write_bytes(base.read_bytes() + line[:cut])
        view = read_history(p)
        ok = all(view.steps.get(s) == committed.steps[s] for s in committed.steps)
        ok = ok and (sorted(view.steps) == ([1, 2, 3, 4, 5, 6] if cut == len(line) else [1, 2, 3, 4, 5]))
        h = History(p)  # the next writer terminates the torn line
        h.step(6, loss=6.5)
        h.close()
        view = read_history(p)
        ok = ok and view.steps[6]["loss"] == 6.5 and all(view.steps[s] == committed.steps[s] for s in committed.steps)
        tally.add(ok, f"cut at byte {cut}", "committed lines changed or the next append unreadable")
    tally.check()


# ---------------------------------------------------------------- the environment route in real processes

SCRIPT = """
import sys
from pathlib import Path
from ripresa.io.fsio import write_atomic
out = Path(sys.argv[1])
write_atomic(out / "a.json", [b"A" * 5000])
write_atomic(out / "b.json", [b"B" * 3000, b"b" * 3000])
print("done")
"""


@pytest.mark.parametrize(("spec", "a", "b"), [
    ("after:rename:1", b"A" * 5000, None),
    pytest.param("fsync:2", b"A" * 5000, None, marks=pytest.mark.slow),
    pytest.param("bytes:6500", b"A" * 5000, None, marks=pytest.mark.slow),
    pytest.param("after:fsync_dir:2", b"A" * 5000, b"B" * 3000 + b"b" * 3000, marks=pytest.mark.slow),
])
def test_ripresa_crash_at_kills_a_real_process(tmp_path, spec, a, b):
    """``RIPRESA_CRASH_AT`` in a fresh interpreter: exit by SIGKILL, exactly the files expected."""
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **fault_env(crash_at=spec)))
    assert res.returncode == KILLED, res.stderr
    assert "done" not in res.stdout
    assert ((tmp_path / "a.json").read_bytes() if (tmp_path / "a.json").exists() else None) == a
    assert ((tmp_path / "b.json").read_bytes() if (tmp_path / "b.json").exists() else None) == b
    if spec.startswith("bytes:"):
        (tmp_file,) = [p for p in tmp_path.iterdir() if fsio.is_temp_name(p.name)]
        assert tmp_file.stat().st_size == 6500 - 5000  # killed in the middle of the first 3000-byte write


UNHARMED = """
import sys
from pathlib import Path
import numpy as np
from ripresa.formats.andrea_bin import BinArrays
from ripresa.io.fsio import write_atomic
from ripresa.session.distributed import fault_point
from ripresa.store.store import CheckpointStore
out = Path(sys.argv[1])
write_atomic(out / "a.json", [b"A" * 5000])
w = np.arange(3000, dtype=np.float32)
store = CheckpointStore(out / "run")
fault_point("after_shards", 2, 0)
store.save(2, BinArrays((w,), (w + 1,), (w + 2,)), {"progress": {"step": 2}})
store.close()
print("done")
"""


@pytest.mark.slow
def test_inherited_fault_variables_without_the_support_path_do_nothing(tmp_path):
    """A process that inherits the fault variables but not ``tests/support`` on its path saves unharmed:
    ripresa itself never reads them (a real interpreter, a real ``write_atomic`` and ``CheckpointStore.save``)."""
    faults = fault_env(crash_at="fsync:1", fail_at="any:1+", dist_fault="after_shards:0:2")
    env = {k: v for k, v in {**os.environ, **faults}.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", UNHARMED, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert "done" in res.stdout
    assert (tmp_path / "a.json").read_bytes() == b"A" * 5000
    assert [g.step for g in CheckpointStore(tmp_path / "run", writer=False).generations() if g.valid] == [2]
    # the same crash variable *with* the support path: the hook fires at the first fsync
    (tmp_path / "x").mkdir()
    env = {k: v for k, v in env.items() if k not in faults}
    res = subprocess.run([sys.executable, "-c", UNHARMED, str(tmp_path / "x")], capture_output=True, text=True,
                         timeout=300, env=dict(env, **fault_env(crash_at="fsync:1")))
    assert res.returncode == KILLED, res.stderr
    assert "done" not in res.stdout and not (tmp_path / "x" / "a.json").exists()


def test_production_code_reads_no_fault_variable():
    """The injectors' variables appear nowhere in ``src/`` (they are test support, docs/FAULTS.md)."""
    src = Path(__file__).resolve().parents[1] / "src"
    hits = [f"{p}: {name}" for p in src.rglob("*.py") for name in ("RIPRESA_CRASH_AT", "RIPRESA_FAIL_AT", "RIPRESA_DIST_FAULT")
            if name in p.read_text()]
    assert hits == []


@pytest.mark.slow
def test_fail_at_and_dist_fault_fire_in_a_real_process(tmp_path):
    """``RIPRESA_FAIL_AT`` and ``RIPRESA_DIST_FAULT`` through ``sitecustomize``: the first ``fsync`` fails
    (the save refuses, nothing is published), and the named distributed point kills the process
    (but not in a restarted torchrun attempt); an invalid value stops the child with exit 2."""
    fail = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **fault_env(fail_at="fsync:1:EIO@a.json")))
    assert fail.returncode == 1 and "EIO" in fail.stderr and "done" not in fail.stdout, fail.stderr
    assert not (tmp_path / "a.json").exists() and list(tmp_path.iterdir()) == []
    point = "from ripresa.session.distributed import fault_point; fault_point('before_gather', 6, 1); print('alive')"
    dead = subprocess.run([sys.executable, "-c", point], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **fault_env(dist_fault="before_gather:1:6")))
    assert dead.returncode == KILLED and "alive" not in dead.stdout, dead.stderr
    for spec, restart in (("before_gather:0:6", "0"), ("after_shards:1:6", "0"), ("before_gather:1:6", "1")):
        alive = subprocess.run([sys.executable, "-c", point], capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, TORCHELASTIC_RESTART_COUNT=restart, **fault_env(dist_fault=spec)))
        assert alive.returncode == 0 and "alive" in alive.stdout, (spec, restart, alive.stderr)
    bad = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, **fault_env(crash_at="fsync:0")))
    assert bad.returncode == 2 and "ran" not in bad.stdout and "RIPRESA_CRASH_AT" in bad.stderr, bad.stderr


def test_crash_spec_is_validated():
    for bad in ("nope:1", "write:0", "bytes:-1", "after:nope:1", "fsync:x", "bytes:x"):
        with pytest.raises(RipresaError, match="RIPRESA_CRASH_AT"):
            install_crash_hook(bad)
        reset_ops()
    for bad in ("fsync", "fsync:0", "fsync:2-1", "fsync:1:ENOTANERRNO", "disk:1"):
        with pytest.raises(RipresaError, match="RIPRESA_FAIL_AT"):
            install_fail_hook(bad)
        reset_ops()


LOOP = Path(__file__).resolve().parents[1] / "examples" / "loop" / "train.py"


@pytest.mark.slow
def test_loop_killed_at_protocol_boundaries_resumes_bit_exactly(tmp_path):
    """examples/loop/train.py killed by ``RIPRESA_CRASH_AT`` at boundaries of its
    saves, restarted each time: the final generation is bitwise the uninterrupted one."""
    steps, every = 120, 20
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    ref = tmp_path / "ref"
    res = subprocess.run([sys.executable, str(LOOP), "--run", str(ref), "--steps", str(steps), "--every", str(every)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    tally = Tally("kill: training loop end to end", "examples/loop/train.py killed at save boundaries, then resumed")
    # examples/loop writes general generations (format="auto"): a 24 KB tensor file
    for spec in ("after:rename:4", "fsync:5", "bytes:20000@.safetensors.tmp", "after:write:9", "fsync_dir:6",
                 "after:rename:12"):
        run = tmp_path / spec.replace(":", "_").replace("@", "_")
        killed = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", str(steps), "--every", str(every)],
                                capture_output=True, text=True, timeout=600, env=dict(env, **fault_env(crash_at=spec)))
        done = subprocess.run([sys.executable, str(LOOP), "--run", str(run), "--steps", str(steps), "--every", str(every)],
                              capture_output=True, text=True, timeout=600, env=env)
        ok = (killed.returncode == KILLED and done.returncode == 0 and valid_steps(run)[-1:] == [steps]
              and same_generation(ref, run, steps))
        hist = read_history(run / ".loss.jsonl")
        ok = ok and sorted(hist.steps) == list(range(1, steps + 1))
        tally.add(ok, spec, f"killed {killed.returncode}, resumed {done.returncode}: {done.stderr[-300:]}")
    tally.check()
