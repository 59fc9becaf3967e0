"""A byte loaded is a byte verified (issue #19, class 2; the .dcp parts of class 4; convert and verify of class 3).

The attacker can write the run folder but holds no key. A ``.dcp`` generation
is checked (marker, signature, sizes, hashes), then loaded: a shard renamed
over between the two must never reach the model — the load re-reads every
file into memory while hashing it against the hashes the check verified, and
DCP reads only those buffers. The swap is made exactly between the check and
the load (the session's own check is wrapped), and, in the slow tier, by a
real concurrent process renaming files over the shard while loads run.

The ``.metadata`` unpickler is bounded by design: a memo index asking for
gigabytes costs one dict entry (RSS measured in a subprocess), a deep
structure of allowed classes is an IntegrityError (a resume falls back), a
key nested millions deep is refused before CPython hashes it (which would
crash the interpreter).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from support.helpers import rebless_dcp
from support.tiny import fit, mlp

import ripresa
from ripresa.cli import main as cli_main
from ripresa.core.state import Progress
from ripresa.errors import BadInput, IntegrityError
from ripresa.formats import dcp as dcp_fmt
from ripresa.formats import dcp_safe
from ripresa.io import auth
from ripresa.store.backend import DcpBackend
from ripresa.store.history import read_history
from ripresa.store.store import CheckpointStore, CheckpointWarning

KEY = b"ripresa-verified-bytes-test-key!"


pytestmark = pytest.mark.usefixtures("no_hmac_env")  # tests/conftest.py


def _toy(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = mlp(seed)  # tests/support/tiny.py
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _dcp_run(run: Path, steps: tuple[int, ...], *, key: bytes | None, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Real .dcp generations of a toy run (signed with ``key``), saved as an FSDP2 run's rank 0 commits them;
    returns each step's weights."""
    model, opt = _toy(seed)
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"toy": True})
    store = CheckpointStore(run, hmac_key=key)
    backend = DcpBackend(store)
    saved, done = {}, 0
    try:
        for step in steps:
            fit(model, opt, step - done)
            done = step
            backend.prepare(step)
            backend.write_part(step, state)
            gen = backend.capture(step, state, Progress(step=step), None)()
            assert gen.valid and gen.signature_verified == (key is not None), gen.reason
            saved[step] = _weights(model)
    finally:
        store.close()
    return saved


def _foreign_shard(tmp_path: Path, step: int) -> Path:
    """The attacker's shard: the same architecture trained elsewhere (same layout, other weights)."""
    _dcp_run(tmp_path / "foreign", (step,), key=None, seed=7)
    return tmp_path / "foreign" / dcp_fmt.dcp_name(step) / "__0_0.distcp"


def test_a_shard_swapped_after_the_check_is_refused_and_nothing_loads(tmp_path):
    run = tmp_path / "run"
    _dcp_run(run, (5,), key=KEY)
    foreign = _foreign_shard(tmp_path, 5)
    gen = dcp_fmt.check_dcp(run, 5, deep=True, require_signature=True, hmac_key=KEY)
    assert gen.valid and gen.signature_verified
    shard = gen.path / "__0_0.distcp"
    assert shard.stat().st_size == foreign.stat().st_size and shard.read_bytes() != foreign.read_bytes()
    os.rename(foreign, shard)  # no key needed: a rename over the shard, after the check
    model, opt = _toy(seed=3)
    before = _weights(model)
    doc = dcp_fmt.read_dcp_companion(gen.path, gen.companion_sha256)
    with pytest.raises(IntegrityError) as err:
        dcp_fmt.load_shards(model, opt, gen.path, files=gen.files, sizes=doc["files"], no_dist=True)
    assert "changed between its check and the load" in err.value.message and err.value.file == str(shard)
    assert err.value.expected == gen.files["__0_0.distcp"]
    assert _same(_weights(model), before)  # every file is verified before any item is loaded


@pytest.mark.slow
def test_a_swapped_metadata_is_refused_too(tmp_path):
    """The .metadata DCP uses is the one hashed: swapping it after the check (for one naming other ranges) fails."""
    run = tmp_path / "run"
    _dcp_run(run, (5,), key=KEY)
    gen = dcp_fmt.check_dcp(run, 5, require_signature=True, hmac_key=KEY)
    md = dcp_safe.read_metadata(gen.path)
    first = next(iter(md.storage_data.values()))
    first.offset, first.length = 0, 1
    (gen.path / ".metadata.new").write_bytes(pickle.dumps(md))
    os.rename(gen.path / ".metadata.new", gen.path / ".metadata")
    model, opt = _toy()
    doc = dcp_fmt.read_dcp_companion(gen.path, gen.companion_sha256)
    with pytest.raises(IntegrityError, match="changed between its check and the load"):
        dcp_fmt.load_shards(model, opt, gen.path, files=gen.files, sizes=doc["files"], no_dist=True)


@pytest.mark.slow
def test_resume_under_require_signature_falls_back_when_a_shard_is_swapped_after_its_check(tmp_path, monkeypatch):
    """The session checks step 10 (signed, valid), then the attacker renames a foreign shard over it: the load
    refuses it, the resume falls back to step 5 with exactly step 5's weights, and what it saves next is that."""
    run = tmp_path / "run"
    saved = _dcp_run(run, (5, 10), key=KEY)
    foreign = _foreign_shard(tmp_path, 10)
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    original = DcpBackend.check_to_resume
    swapped = []

    def check_then_swap(self, step):
        gen = original(self, step)
        if step == 10 and not swapped:
            assert gen.valid and gen.signature_verified, gen.reason
            os.rename(foreign, gen.path / "__0_0.distcp")  # right after the check, right before the load
            swapped.append(step)
        return gen

    monkeypatch.setattr(DcpBackend, "check_to_resume", check_then_swap)
    model, opt = _toy(seed=3)
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"toy": True})
    ck = ripresa.Checkpointer(run, state, every=5, asynchronous=False, handle_signals=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ck.resume()
    assert swapped == [10]
    assert start == 5 and ck.resumed_from.step == 5
    assert _same(_weights(model), saved[5])
    assert any(issubclass(w.category, CheckpointWarning) and "changed between its check and the load" in str(w.message)
               for w in caught)
    events = read_history(run / ".loss.jsonl").events
    assert any(e["event"] == "skipped_generation" and "10" in e["reason"] for e in events)
    fit(model, opt, 1)
    ck.step_done(6)
    ck.close(final_save=True)  # a new signed generation: of the verified state, never of the foreign one
    gen6 = [g for g in ck.backend.generations() if g.step == 6]
    assert gen6 and gen6[0].valid and gen6[0].signature_verified
    # the reference: step 5 loaded from the genuine generation, one more step
    ref, ref_opt = _toy(seed=5)
    g5 = dcp_fmt.check_dcp(run, 5, deep=True, require_signature=True, hmac_key=KEY)
    doc5 = dcp_fmt.read_dcp_companion(g5.path, g5.companion_sha256)
    dcp_fmt.load_shards(ref, ref_opt, g5.path, files=g5.files, sizes=doc5["files"], no_dist=True)
    fit(ref, ref_opt, 1)
    again, again_opt = _toy(seed=6)
    state2 = ripresa.TrainingState(model=again, optimizer=again_opt, config={"toy": True})
    ck2 = ripresa.Checkpointer(run, state2, every=5, asynchronous=False, handle_signals=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck2.resume() == 6
    ck2.close(final_save=False)
    assert _same(_weights(again), _weights(ref))  # what was signed at step 6 descends from the verified step 5


@pytest.mark.slow
def test_a_real_concurrent_swapper_never_gets_foreign_weights_loaded(tmp_path):
    """A separate process renames the foreign shard and the genuine one over the shard in a loop while loads run:
    each load gets exactly the verified weights or an IntegrityError, never the foreign ones."""
    run = tmp_path / "run"
    saved = _dcp_run(run, (5,), key=KEY)
    foreign = _foreign_shard(tmp_path, 5)
    gen = dcp_fmt.check_dcp(run, 5, deep=True, require_signature=True, hmac_key=KEY)
    shard = gen.path / "__0_0.distcp"
    genuine, evil = tmp_path / "genuine.distcp", tmp_path / "evil.distcp"
    shutil.copyfile(shard, genuine)
    shutil.copyfile(foreign, evil)
    doc = dcp_fmt.read_dcp_companion(gen.path, gen.companion_sha256)
    stop = tmp_path / "STOP"
    swapper = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, shutil
        i = 0
        while not os.path.exists({str(stop)!r}):
            src = {str(evil)!r} if i % 2 == 0 else {str(genuine)!r}
            shutil.copyfile(src, {str(shard)!r} + ".tmp")
            os.rename({str(shard)!r} + ".tmp", {str(shard)!r})
            i += 1
    """)])
    outcomes = {"verified": 0, "refused": 0}
    try:
        for _ in range(60):
            model, opt = _toy(seed=3)
            try:
                dcp_fmt.load_shards(model, opt, gen.path, files=gen.files, sizes=doc["files"], no_dist=True)
            except IntegrityError as exc:
                assert "changed between its check and the load" in exc.message
                outcomes["refused"] += 1
                continue
            assert _same(_weights(model), saved[5]), "a load returned weights that are not the verified ones"
            outcomes["verified"] += 1
    finally:
        stop.touch()
        swapper.wait(timeout=60)
    assert outcomes["verified"] + outcomes["refused"] == 60
    assert outcomes["refused"] > 0, outcomes  # the swapper did race the loads


# ---------------------------------------------------------------- class 4: a bounded, iterative .metadata reader


#: 11 bytes: PROTO 2, NONE, LONG_BINPUT 0x0fffffff (a C unpickler sizes its memo table by the index: 2 GiB), POP, NONE, STOP.
MEMO_BOMB = b"\x80\x02N" + b"r" + struct.pack("<I", 0x0FFFFFFF) + b"0N."

_PROBE = """
import resource, sys, warnings
warnings.simplefilter("ignore")
from pathlib import Path
from ripresa.formats import dcp as dcp_fmt
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
gen = dcp_fmt.check_dcp(Path(sys.argv[1]), int(sys.argv[2]), deep=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(gen.valid, base // 1024, peak // 1024, gen.reason, sep="\\t")
"""


def _probe(run: Path, step: int) -> tuple[bool, int, int, str]:
    res = subprocess.run([sys.executable, "-c", _PROBE, str(run), str(step)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]  # no crash, no traceback
    valid, base, peak, reason = res.stdout.strip().splitlines()[-1].split("\t")
    return valid == "True", int(base), int(peak), reason


def _rss_kb(field: str) -> int:
    import re

    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def test_an_11_byte_memo_bomb_is_refused_in_bounded_memory(tmp_path):
    """The check of a generation whose .metadata is the bomb adds (almost) nothing to this process's peak RSS
    (the kernel's high-water mark is reset right before it: /proc/self/clear_refs)."""
    assert len(MEMO_BOMB) == 11
    run = tmp_path / "run"
    _dcp_run(run, (5,), key=None)
    (run / "step_000005.dcp" / ".metadata").write_bytes(MEMO_BOMB)
    rebless_dcp(run, 5)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pytest.skip("no /proc/self/clear_refs (Linux only): the slow subprocess probes measure the bombs")
    base = _rss_kb("VmRSS")
    gen = dcp_fmt.check_dcp(run, 5, deep=True)
    grown = (_rss_kb("VmHWM") - base) // 1024
    assert not gen.valid and "not a DCP index" in gen.reason
    assert grown < 32, f"the check allocated {grown} MB for 11 bytes (a C unpickler's memo table: 2048 MB)"


@pytest.mark.slow
def test_the_memo_bomb_in_a_fresh_process(tmp_path):
    run = tmp_path / "run"
    _dcp_run(run, (5,), key=None)
    (run / "step_000005.dcp" / ".metadata").write_bytes(MEMO_BOMB)
    rebless_dcp(run, 5)
    valid, base, peak, reason = _probe(run, 5)
    assert not valid and "not a DCP index" in reason
    # torch alone takes ~300-400 MB here, so the bound is on what the check adds
    assert peak - base < 32, f"the check allocated {peak - base} MB for 11 bytes (peak {peak} MB)"


def _deep_metadata(run: Path, step: int, depth: int) -> None:
    """The generation's real index, with a list nested ``depth`` levels deep as its planner_data (only builtins)."""
    p = run / dcp_fmt.dcp_name(step) / ".metadata"
    md = dcp_safe.read_metadata(p.parent)
    md.planner_data = "DEEPDEEPDEEP"
    raw = pickle.dumps(md, protocol=4)
    sentinel = b"\x8c\x0cDEEPDEEPDEEP"
    assert raw.count(sentinel) == 1
    p.write_bytes(raw.replace(sentinel, b"]" * depth + b"a" * (depth - 1)))
    rebless_dcp(run, step)


@pytest.mark.slow
def test_a_deep_metadata_of_allowed_classes_is_an_integrity_error_and_the_resume_falls_back(tmp_path):
    run = tmp_path / "run"
    saved = _dcp_run(run, (5, 10), key=None)
    _deep_metadata(run, 10, 200_000)
    gen = dcp_fmt.check_dcp(run, 10, deep=True)
    assert not gen.valid and "nesting deeper than" in gen.reason
    model, opt = _toy(seed=3)
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"toy": True})
    ck = ripresa.Checkpointer(run, state, every=5, asynchronous=False, handle_signals=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.resume() == 5
    assert _same(_weights(model), saved[5])
    assert any(".dcp generation 10 not used" in str(w.message) and "nesting deeper" in str(w.message) for w in caught)
    ck.close(final_save=False)


@pytest.mark.slow
@pytest.mark.parametrize("name,payload,found", [
    # a dict key nested a million tuples deep: CPython's tuple hash recurses in C with no guard (a segfault)
    ("deep key", b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"Ns.", "a key nested deeper than 32 levels"),
    # 20 million empty lists: bounded by the work units, not by the machine
    ("list flood", b"\x80\x04" + b"]" * 20_000_000 + b".", "work units"),
    # 20 million MEMOIZE: the memo is capped
    ("memo flood", b"\x80\x04N" + b"\x94" * 20_000_000 + b".", "memo entries"),
    # a container shared a million times (a "billion laughs" for any recursive consumer)
    ("shared", b"\x80\x04]\x94(" + b"h\x00" * 1_000_000 + b"l.", "reached twice"),
])
def test_metadata_bombs_are_refused_in_bounded_memory(tmp_path, name, payload, found):
    run = tmp_path / "run"
    _dcp_run(run, (5,), key=None)
    (run / "step_000005.dcp" / ".metadata").write_bytes(payload)
    rebless_dcp(run, 5)
    valid, base, peak, reason = _probe(run, 5)
    assert not valid and found in reason, reason
    assert peak < 1536, f"{name}: peak RSS {peak} MB"


@pytest.mark.slow
def test_a_real_index_costs_far_below_the_bounds(tmp_path):
    """The bounds leave room: a real index costs under one work unit per byte and nests 6 levels."""
    run = tmp_path / "run"
    _dcp_run(run, (5,), key=None)
    raw = (run / "step_000005.dcp" / ".metadata").read_bytes()
    u = dcp_safe.MetadataUnpickler(__import__("io").BytesIO(raw))
    md = u.load()
    assert u._units < len(raw) and len(u.memo) < 1000
    dcp_safe.check_shape(md, run / ".metadata", max_depth=7)
    with pytest.raises(IntegrityError, match="nesting deeper than 3"):
        dcp_safe.check_shape(md, run / ".metadata", max_depth=3)


# ---------------------------------------------------------------- class 3: convert and verify open safely


def test_convert_of_a_fifo_safetensors_is_refused_without_waiting(tmp_path, capsys):
    import threading

    src = tmp_path / "weights.safetensors"
    os.mkfifo(src)

    def unblock() -> None:  # had convert opened the FIFO blocking, this writer releases it (the test fails, not hangs)
        if not done.wait(20):
            with open(src, "wb") as f:
                f.write(b"\x08" + b"\x00" * 7 + b"{}      ")

    done = threading.Event()
    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    try:
        rc = cli_main(["convert", str(src), str(tmp_path / "o" / "step_000001.bin")])
    finally:
        done.set()
    err = capsys.readouterr().err
    assert rc == 2 and "not a regular file" in err and "FIFO" in err and "Traceback" not in err


@pytest.mark.slow
def test_convert_of_a_symlinked_or_tampered_safetensors_is_refused(tmp_path, capsys):
    from safetensors.torch import save_file

    model, _ = _toy()
    real = tmp_path / "real.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(real))
    link = tmp_path / "link" / "weights.safetensors"
    link.parent.mkdir()
    link.symlink_to(real)
    assert cli_main(["convert", str(link), str(tmp_path / "o" / "step_000001.bin")]) == 2
    assert "symlink" in capsys.readouterr().err
    loose = tmp_path / "loose" / "weights.safetensors"
    loose.parent.mkdir()
    shutil.copyfile(real, loose)
    (loose.parent / "weights.safetensors.sha256").write_text(f"{'0' * 64}  weights.safetensors\n")
    assert cli_main(["convert", str(loose), str(tmp_path / "o" / "step_000001.bin")]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err
    assert not (tmp_path / "o" / "step_000001.bin").exists()


def test_verify_reads_summary_json_without_following_links_or_waiting_on_a_fifo(tmp_path):
    from ripresa.verify.verify import saved_checkpoint

    out = tmp_path / "interrupted"
    out.mkdir()
    assert saved_checkpoint(out) == out / "checkpoint.pt"
    (out / "summary.json").write_text(json.dumps({"checkpoint": "ck/step_000004.bin"}))
    assert saved_checkpoint(out) == out / "ck" / "step_000004.bin"
    (out / "summary.json").write_text(json.dumps({"checkpoint": "../../etc/step_000004.bin"}))
    with pytest.raises(BadInput, match="outside its folder"):
        saved_checkpoint(out)
    (out / "summary.json").unlink()
    os.mkfifo(out / "summary.json")
    with pytest.raises(BadInput, match="not a regular file"):
        saved_checkpoint(out)
    (out / "summary.json").unlink()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"checkpoint": "x.bin"}))
    (out / "summary.json").symlink_to(elsewhere)
    with pytest.raises(BadInput, match="symlink"):
        saved_checkpoint(out)


@pytest.mark.slow
def test_an_explicit_dcp_path_is_checked_under_the_runs_own_signature_policy(tmp_path):
    """``--resume RUN/step_N.dcp`` through a store that requires signatures (set in code, not in the environment):
    an unsigned generation is refused; a signed one is accepted and its signature verified."""
    _dcp_run(tmp_path / "unsigned", (5,), key=None)
    _dcp_run(tmp_path / "signed", (5,), key=KEY)
    (tmp_path / "reader").mkdir()
    store = CheckpointStore(tmp_path / "reader", writer=False, require_signature=True, hmac_key=KEY)
    backend = DcpBackend(store)
    with pytest.raises(IntegrityError, match="not signed"):
        backend.at_path(tmp_path / "unsigned" / "step_000005.dcp")
    gen = backend.at_path(tmp_path / "signed" / "step_000005.dcp")
    assert gen.valid and gen.signature_verified
