"""Fault matrix, family 6: authenticated checkpoints (HMAC-SHA256 per generation).

A sha256 marker detects a change but not who made it: anyone who can write
the folder can rewrite the marker. With a key (``RIPRESA_HMAC_KEY`` or
``RIPRESA_HMAC_KEY_FILE``) every generation gets ``step_NNNNNN.bin.hmac``,
written right before the marker, and a reader with ``require_signature``
(``RIPRESA_REQUIRE_SIGNATURE=1``, ``--require-signature``) trusts only
generations signed with that key. The attacks below are made by someone who
can write the run folder and knows the format but not the key; each must be
refused, with the resume falling back to the newest validly signed generation.
What the signature does *not* protect against is tested as such: deleting the
newest generations (rollback) and a key thief.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import subprocess
import sys
import warnings
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
)
from support.helpers import sha256_file
from support.tiny import mlp_state

import ripresa
from ripresa.cli import main as cli_main
from ripresa.errors import BadInput, IntegrityError
from ripresa.io import auth
from ripresa.store.history import read_history
from ripresa.store.store import CheckpointStore, generation_paths

N = 500
OTHER_KEY = b"another-key-that-is-long-enough!"


pytestmark = pytest.mark.usefixtures("clean_fault_ops", "no_hmac_env")  # tests/conftest.py


def _signed_run(folder: Path, steps=(1, 2), key: bytes = KEY) -> Path:
    with CheckpointStore(folder, hmac_key=key) as store:
        for s in steps:
            store.save(s, arrays_for(s, N), companion_for(s))
    return folder


def _remark(folder: Path, step: int) -> None:
    """What an attacker without the key can do: make the sha256 marker match again."""
    b, c, mk = generation_paths(folder, step)
    mk.write_text(f"{sha256_file(b)}  {b.name}\n{sha256_file(c)}  {c.name}\n")


def _companion_points_at_bin(folder: Path, step: int) -> None:
    import json

    b, c, _ = generation_paths(folder, step)
    doc = json.loads(c.read_bytes())
    doc["bin"]["sha256"] = sha256_file(b)
    c.write_bytes(json.dumps(doc, separators=(",", ":")).encode())


# ---------------------------------------------------------------- attacks

def _tamper_bin(folder):
    b, _, _ = generation_paths(folder, 2)
    data = bytearray(b.read_bytes())
    data[100:104] = np.float32(1e6).tobytes()  # a "better" weight
    b.write_bytes(bytes(data))
    _companion_points_at_bin(folder, 2)
    _remark(folder, 2)


def _tamper_companion(folder):
    _, c, _ = generation_paths(folder, 2)
    c.write_bytes(c.read_bytes().replace(b"generation 2 by 0", b"generation 2 by 9"))
    _remark(folder, 2)


def _unsigned_newer(folder):
    with CheckpointStore(folder) as store:  # ripresa itself, without the key: a valid but unsigned generation
        store.save(3, arrays_for(3, N), companion_for(3))


def _signed_with_other_key(folder):
    with CheckpointStore(folder, hmac_key=OTHER_KEY) as store:
        store.save(3, arrays_for(3, N), companion_for(3))


def _swap_generations(folder):
    """Generation 1's files renamed to step 2 (signature included)."""
    for suffix in (".bin", ".json", ".bin.sha256", ".bin.hmac"):
        (folder / f"step_000002{suffix}").unlink()
        shutil.copy(folder / f"step_000001{suffix}", folder / f"step_000002{suffix}")


def _swap_signature(folder):
    shutil.copy(folder / "step_000001.bin.hmac", folder / "step_000002.bin.hmac")


def _forge_mac(folder):
    sig = folder / "step_000002.bin.hmac"
    text = sig.read_text()
    sig.write_text(text[: text.index("mac=") + 4] + "0" * 64 + "\n")


def _sign_with_guessed_key(folder):
    """The attacker signs a tampered .bin with a key of their own, keeping our key id."""
    _tamper_bin(folder)
    b, c, _ = generation_paths(folder, 2)
    line = auth.signature_line(b"guessed-key-guessed-key-guessed!", 2, b.name, sha256_file(b), c.name, sha256_file(c)).decode()
    kid = auth.key_id(KEY)
    sig = folder / "step_000002.bin.hmac"
    sig.write_text(line.replace(line.split("key=")[1][:16], kid))


def _change_step_field(folder):
    sig = folder / "step_000002.bin.hmac"
    sig.write_text(sig.read_text().replace("step=2 ", "step=3 "))


def _truncate_mac(folder):
    sig = folder / "step_000002.bin.hmac"
    sig.write_text(sig.read_text()[:-10] + "\n")


def _garbage_signature(folder):
    (folder / "step_000002.bin.hmac").write_bytes(os.urandom(300))


def _huge_signature(folder):
    (folder / "step_000002.bin.hmac").write_bytes(b"ripresa-hmac-sha256 v1 " + b"a" * 10_000)


def _signature_removed(folder):
    (folder / "step_000002.bin.hmac").unlink()


def _replay_into_another_step(folder):
    """Generation 2's signed files presented as generation 3 (a newer step)."""
    for suffix in (".bin", ".json", ".bin.hmac"):
        shutil.copy(folder / f"step_000002{suffix}", folder / f"step_000003{suffix}")
    b, c, mk = generation_paths(folder, 3)
    mk.write_text(f"{sha256_file(b)}  {b.name}\n{sha256_file(c)}  {c.name}\n")


ATTACKS = {
    "tampered .bin, marker and companion fixed": (_tamper_bin, 1),
    "tampered companion, marker fixed": (_tamper_companion, 1),
    "newer unsigned generation": (_unsigned_newer, 2),
    "newer generation signed with another key": (_signed_with_other_key, 2),
    "generation 1 swapped in as generation 2": (_swap_generations, 1),
    "generation 1's signature on generation 2": (_swap_signature, 1),
    "forged MAC": (_forge_mac, 1),
    "tampered .bin signed with a guessed key": (_sign_with_guessed_key, 1),
    "step field of the signature changed": (_change_step_field, 1),
    "truncated MAC": (_truncate_mac, 1),
    "random bytes as signature": (_garbage_signature, 1),
    "huge signature file": (_huge_signature, 1),
    "signature deleted": (_signature_removed, 1),
    "signed generation replayed as a newer step": (_replay_into_another_step, 2),
}


def test_attacks_without_the_key_are_refused(tmp_path):
    tally = Tally("authenticated checkpoints (HMAC)", "tampering/swaps/forgeries by someone without the key: "
                  "refused under require_signature, fallback to the newest validly signed generation")
    for k, (name, (attack, expect)) in enumerate(ATTACKS.items()):
        folder = _signed_run(tmp_path / f"a{k}")
        attack(folder)
        store = quiet_store(folder, require_signature=True, hmac_key=KEY)
        try:
            g = latest_valid_quietly(store)
            ok = g is not None and g.step == expect and g.signature_verified
            contents, comp = store.load(g.step)
            exp = arrays_for(g.step, N)
            ok = ok and np.array_equal(contents.weights, exp.weights[0]) and comp["writer"] == 0
            for bad in range(expect + 1, 4):
                if os.path.exists(generation_paths(folder, bad)[0]):
                    with pytest.raises(IntegrityError):
                        store.load(bad)
            why = f"resumed from {g and g.step}"
        except Exception as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        tally.add(ok, name, why)
    tally.check()


def test_what_the_signature_does_not_protect(tmp_path):
    """Documented limits: a rollback by deletion is not detected, nor is a key thief's forgery;
    and a reader that does not require signatures does not check them."""
    folder = _signed_run(tmp_path / "rollback", steps=(1, 2, 3))
    for suffix in (".bin", ".json", ".bin.sha256", ".bin.hmac"):
        (folder / f"step_000003{suffix}").unlink()
    assert latest_valid_quietly(quiet_store(folder, require_signature=True, hmac_key=KEY)).step == 2  # not detected
    thief = _signed_run(tmp_path / "thief")
    _tamper_bin(thief)
    b, c, _ = generation_paths(thief, 2)
    (thief / "step_000002.bin.hmac").write_bytes(auth.signature_line(KEY, 2, b.name, sha256_file(b), c.name, sha256_file(c)))
    assert latest_valid_quietly(quiet_store(thief, require_signature=True, hmac_key=KEY)).step == 2  # forged
    lax = _signed_run(tmp_path / "lax")
    _tamper_bin(lax)
    assert latest_valid_quietly(quiet_store(lax)).step == 2  # without require_signature only sha256 is checked


def test_signature_format_and_constant_time_compare(tmp_path, monkeypatch):
    folder = _signed_run(tmp_path / "run")
    sig = (folder / "step_000002.bin.hmac").read_text()
    b, c, _ = generation_paths(folder, 2)
    msg = auth.message(2, b.name, sha256_file(b), c.name, sha256_file(c))
    assert sig == f"ripresa-hmac-sha256 v1 key={auth.key_id(KEY)} step=2 mac={hmac.new(KEY, msg, 'sha256').hexdigest()}\n"
    assert KEY.hex() not in sig and hashlib.sha256(KEY).hexdigest()[:16] not in sig
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert quiet_store(folder, require_signature=True, hmac_key=KEY).check(2).valid
    assert calls
    # commit order: the signature is durable before the marker is written
    from ripresa.io import fsio

    events = []
    fsio.ops.hook = lambda op, path: events.append((op, os.path.basename(path)))
    with CheckpointStore(folder, hmac_key=KEY) as store:
        store.save(3, arrays_for(3, N), companion_for(3))
    fsio.ops.hook = None
    renames = [n for op, n in events if op == "rename"]
    assert renames == ["step_000003.bin", "step_000003.json", "step_000003.bin.hmac", "step_000003.bin.sha256"]
    i_sig = events.index(("rename", "step_000003.bin.hmac"))
    assert ("fsync_dir", folder.name) == events[i_sig + 1]
    # re-saving a step withdraws the old marker and signature first; retention removes signatures too
    with CheckpointStore(folder, hmac_key=KEY, retention=ripresa.store.retention.KeepLast(1)) as store:
        store.save(3, arrays_for(3, N, 1), companion_for(3, 1))
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) == [
        "step_000003.bin", "step_000003.bin.hmac", "step_000003.bin.sha256", "step_000003.json"]
    assert quiet_store(folder, require_signature=True, hmac_key=KEY).check(3, deep=True).valid


def test_key_sources(tmp_path, monkeypatch):
    assert auth.load_key({}) is None
    assert auth.load_key({auth.ENV_KEY: "k" * 16}) == b"k" * 16
    with pytest.raises(BadInput, match="too short"):
        auth.load_key({auth.ENV_KEY: "short"})
    kf = tmp_path / "key"
    kf.write_bytes(b"x" * 32 + b"\n")
    kf.chmod(0o600)
    assert auth.load_key({auth.ENV_KEY_FILE: str(kf)}) == b"x" * 32
    with pytest.raises(BadInput, match="both"):
        auth.load_key({auth.ENV_KEY: "k" * 16, auth.ENV_KEY_FILE: str(kf)})
    with pytest.raises(BadInput, match="cannot open"):
        auth.load_key({auth.ENV_KEY_FILE: str(tmp_path / "missing")})
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(BadInput, match="not a regular file"):
        auth.load_key({auth.ENV_KEY_FILE: str(tmp_path / "fifo")})
    kf.chmod(0o644)
    with pytest.warns(UserWarning, match="readable by other users"):
        auth.load_key({auth.ENV_KEY_FILE: str(kf)})
    with pytest.raises(BadInput, match="RIPRESA_REQUIRE_SIGNATURE"):
        auth.require_signature_from_env({auth.ENV_REQUIRE: "maybe"})
    # required without a key: refused at once, whoever opens the store
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    with pytest.raises(BadInput, match="needs the HMAC key"):
        CheckpointStore(tmp_path, writer=False)
    # the environment route signs and verifies
    monkeypatch.setenv(auth.ENV_KEY_FILE, str(kf))
    kf.chmod(0o600)
    run = tmp_path / "envrun"
    with CheckpointStore(run) as store:
        store.save(1, arrays_for(1, N), companion_for(1))
    assert (run / "step_000001.bin.hmac").exists()
    assert CheckpointStore(run, writer=False).check(1).signature_verified


def test_cli_require_signature(tmp_path, monkeypatch, capsys):
    signed = _signed_run(tmp_path / "signed")
    unsigned = tmp_path / "unsigned"
    with CheckpointStore(unsigned) as store:
        store.save(1, arrays_for(1, N), companion_for(1))
    monkeypatch.setenv(auth.ENV_REQUIRE, "0")  # restored after the test (the CLI sets it)
    assert cli_main(["inspect", str(signed), "--require-signature", "--no-deep"]) == 2  # no key
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    assert cli_main(["inspect", str(signed), "--require-signature"]) == 0
    assert cli_main(["inspect", str(unsigned), "--require-signature"]) == 1
    assert cli_main(["inspect", str(signed / "step_000002.bin"), "--require-signature"]) == 0
    _tamper_bin(signed)
    assert cli_main(["inspect", str(signed / "step_000002.bin"), "--require-signature"]) == 1
    err = capsys.readouterr().err
    assert "signature does not match" in err
    monkeypatch.delenv(auth.ENV_KEY)
    assert cli_main(["train", "--run", str(tmp_path / "t"), "--require-signature", "--steps", "1"]) == 2
    assert "needs the HMAC key" in capsys.readouterr().err


def _train(run: Path, total: int) -> ripresa.Checkpointer:
    state = mlp_state(config={"toy": True})  # tests/support/tiny.py
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    ck = ripresa.Checkpointer(run, state, every=5, asynchronous=False, handle_signals=False, format="andrea")
    start = ck.resume()
    for step in range(start + 1, total + 1):
        state.optimizer.zero_grad()
        loss = (state.model(x) - x).pow(2).mean()
        loss.backward()
        state.optimizer.step()
        ck.step_done(step, loss=loss.item())
    ck.close(final_save=True)
    return ck


def test_checkpointer_with_required_signatures_resumes_only_from_signed(tmp_path, monkeypatch):
    """The environment route a `ripresa train --require-signature` uses, on the Checkpointer."""
    monkeypatch.setenv(auth.ENV_KEY, KEY.decode())
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    run = tmp_path / "run"
    _train(run, 15)
    assert sorted(p.name for p in run.glob("step_*.hmac")) == ["step_000005.bin.hmac", "step_000010.bin.hmac",
                                                                 "step_000015.bin.hmac"]
    assert (run / "config.json.hmac").is_file()  # the run's settings are signed too (docs/FAULTS.md, "Trust model")
    _tamper_bin_at(run, 15)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = _train(run, 20)
    assert ck.resumed_from.step == 10
    assert any("signature does not match" in str(w.message) for w in caught)
    events = read_history(run / ".loss.jsonl").events
    assert any(e["event"] == "skipped_generation" and "signature" in e["reason"] for e in events)


def _tamper_bin_at(folder: Path, step: int) -> None:
    import json

    b, c, mk = generation_paths(folder, step)
    data = bytearray(b.read_bytes())
    data[-4:] = np.float32(3.0).tobytes()
    b.write_bytes(bytes(data))
    doc = json.loads(c.read_bytes())
    doc["bin"]["sha256"] = sha256_file(b)
    c.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    mk.write_text(f"{sha256_file(b)}  {b.name}\n{sha256_file(c)}  {c.name}\n")


@pytest.mark.slow
def test_ripresa_train_require_signature_end_to_end(tmp_path):
    """`ripresa train --require-signature` signs its generations and refuses a tampered newest one."""
    run = tmp_path / "run"
    keyfile = tmp_path / "key"
    keyfile.write_text("0123456789abcdef0123456789abcdef\n")
    keyfile.chmod(0o600)
    env = dict(os.environ, RIPRESA_HMAC_KEY_FILE=str(keyfile), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "ripresa", "train", "--run", str(run), "--config", "tiny", "--every", "2",
            "--no-audit", "--quiet", "--threads", "1", "--require-signature"]
    r = subprocess.run([*args, "--steps", "4"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in run.glob("step_*.hmac")) == ["step_000002.bin.hmac", "step_000004.bin.hmac"]
    _tamper_bin_at(run, 4)
    r = subprocess.run([*args, "--steps", "4"], capture_output=True, text=True, timeout=600, env=env)  # end step
    assert r.returncode == 0, r.stderr
    resume = [e for e in read_history(run / ".loss.jsonl").events if e["event"] == "resume"]
    assert resume[-1]["from_step"] == 2
    r = subprocess.run([sys.executable, "-m", "ripresa", "inspect", str(run), "--require-signature"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr  # the tampered generation was re-saved, signed
