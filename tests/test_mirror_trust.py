"""The mirror's trust rules (docs/MIRROR.md, "Trust"), with the real local store and the real S3 server (moto).

* one folder never redirects ripresa into another: a mirror target must BE a mirror (its ``RIPRESA_MIRROR``
  marker), a run folder or a folder of other files is refused and left byte for byte as it was, ``mirror.json``
  is followed by ``push`` only when the run's key authenticates it (or, without a key, when it names a mirror),
  and the target is locked while written;
* a local mirror never writes, reads or deletes through a planted symlink;
* the mirror's ``config.json`` is signed with the run's key, and a forged or unsigned one is refused under
  require-signature;
* a password in the endpoint's URL never reaches a file of the run folder, the mirror, an export, or the terminal.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tree_digest
from support.mirror_train import train

from ripresa.cli import main as cli_main
from ripresa.errors import BadInput, IntegrityError, LockHeld
from ripresa.io import auth
from ripresa.io.objstore import LOCK_KEY, LocalStore, RemoteUnavailable, open_store
from ripresa.io.redact import redact, redact_url
from ripresa.store.mirror import (
    CONFIG_SIG,
    MIRROR_MARKER,
    MIRROR_RECORD,
    MirrorSpec,
    MirrorTarget,
    local_generations,
    redacting,
)

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3, proxy

SECRET = "pw-Zx81qQ-never-written"
KEY = "k" * 32


def fast(url: str, **kw) -> MirrorSpec:
    return MirrorSpec(url, **{"timeout": 2.0, "attempts": 2, "backoff": 0.01, "max_backoff": 0.05, "close_timeout": 5.0,
                              **kw})


@pytest.fixture
def nokey(monkeypatch):
    for k in (auth.ENV_KEY, auth.ENV_KEY_FILE, auth.ENV_REQUIRE):
        monkeypatch.delenv(k, raising=False)


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under ``root`` (links not followed) whose bytes hold ``needle``."""
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            if p.is_file() and not p.is_symlink() and needle.encode() in p.read_bytes():
                found.append(str(p))
    return found


# ---------------------------------------------------------------------------- default tier


def test_local_store_never_writes_reads_or_deletes_through_a_planted_link(tmp_path):
    mirror, elsewhere = tmp_path / "mirror", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "__0_0.distcp").write_bytes(b"victim")
    (elsewhere / "victim.bin").write_bytes(b"victim")
    before = tree_digest(elsewhere)
    store = LocalStore(mirror, str(mirror))
    mirror.mkdir()
    (mirror / "step_000012.dcp").symlink_to(elsewhere)  # a folder link
    (mirror / "step_000016.safetensors").symlink_to(elsewhere / "victim.bin")  # a file link
    with pytest.raises(IntegrityError, match="symlink"):
        store.put_bytes("step_000012.dcp/__0_0.distcp", b"planted")
    with pytest.raises(IntegrityError, match="symlink"):
        store.get_bytes("step_000012.dcp/__0_0.distcp", limit=100)
    with pytest.raises(IntegrityError, match="symlink"):
        store.delete("step_000012.dcp/__0_0.distcp")
    with pytest.raises(IntegrityError, match="symlink"):
        store.get_bytes("step_000016.safetensors", limit=100)  # a link at the last name is refused too
    store.put_bytes("step_000016.safetensors", b"new")  # ... and written over: the link is replaced, not followed
    assert not (mirror / "step_000016.safetensors").is_symlink()
    assert (mirror / "step_000016.safetensors").read_bytes() == b"new"
    assert "step_000012.dcp/__0_0.distcp" not in store.list()
    assert tree_digest(elsewhere) == before and sorted(os.listdir(elsewhere)) == ["__0_0.distcp", "victim.bin"]
    # the writer lock: a second writer of the same mirror is refused while the first holds it
    first, second = MirrorTarget(store, explicit=True), MirrorTarget(LocalStore(mirror, str(mirror)), explicit=True)
    for link in ("step_000012.dcp", "step_000016.safetensors"):
        os.unlink(mirror / link)
    first.claim()
    assert (mirror / MIRROR_MARKER).is_file()
    with pytest.raises(LockHeld):
        second.claim()
    first.release()
    second.claim()
    second.release()


def test_a_redirect_into_a_run_folder_or_a_foreign_folder_is_refused_and_nothing_changes(tmp_path, nokey, capsys):
    victim = tmp_path / "victim"
    train(victim, 4, 2)  # another run: LOCK, .loss.jsonl, two generations
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    run = tmp_path / "run"
    train(run, 4, 2, mirror=str(tmp_path / "mirror"))
    assert (tmp_path / "mirror" / MIRROR_MARKER).is_file()
    for target, why in ((victim, "is a run folder"), (foreign, "not a mirror's")):
        before = tree_digest(target)
        (run / MIRROR_RECORD).write_text(json.dumps({"url": str(target)}))  # a planted redirect
        assert cli_main(["mirror", "push", str(run)]) == 2
        assert why in capsys.readouterr().err
        assert cli_main(["mirror", "push", str(run), "--mirror", str(target)]) == 2  # named explicitly: refused too
        capsys.readouterr()
        with pytest.raises(BadInput, match=why):  # and a session mirroring there
            train(tmp_path / "run2", 2, 2, mirror=str(target))
        assert tree_digest(target) == before
    assert sorted(local_generations(victim).values()) == [2, 4]
    # a mirror written before the marker existed (only a mirror's objects): adopted when named explicitly only
    legacy = tmp_path / "legacy"
    shutil.copytree(tmp_path / "mirror", legacy)
    (legacy / MIRROR_MARKER).unlink()
    (legacy / "LOCK").unlink()
    (run / MIRROR_RECORD).write_text(json.dumps({"url": str(legacy)}))
    assert cli_main(["mirror", "push", str(run)]) == 2
    assert "not marked as a mirror" in capsys.readouterr().err
    assert not (legacy / MIRROR_MARKER).exists()
    assert cli_main(["mirror", "push", str(run), "--mirror", str(legacy)]) == 0
    assert (legacy / MIRROR_MARKER).is_file()
    assert cli_main(["mirror", "push", str(run)]) == 0  # now a mirror: followed from mirror.json (no key)


def test_with_a_key_push_follows_only_an_authenticated_mirror_json(tmp_path, nokey, monkeypatch, capsys):
    monkeypatch.setenv(auth.ENV_KEY, KEY)
    a, b = tmp_path / "a", tmp_path / "b"
    train(a, 4, 4, mirror=str(tmp_path / "ma"))
    train(b, 8, 4, mirror=str(tmp_path / "mb"))
    rec = json.loads((a / MIRROR_RECORD).read_text())
    assert rec["key"] == auth.key_id(KEY.encode()) and len(rec["mac"]) == 64
    assert cli_main(["mirror", "push", str(a)]) == 0  # its own record: followed
    mb = tree_digest(tmp_path / "mb")
    # b's record (a mirror, authenticated for b) copied into a, and an edited one: neither is followed
    shutil.copy(b / MIRROR_RECORD, a / MIRROR_RECORD)
    assert cli_main(["mirror", "push", str(a)]) == 2
    assert "not authenticated" in capsys.readouterr().err
    (a / MIRROR_RECORD).write_text(json.dumps({**rec, "url": str(tmp_path / "mb")}))
    assert cli_main(["mirror", "push", str(a)]) == 2
    assert tree_digest(tmp_path / "mb") == mb and sorted(local_generations(tmp_path / "mb").values()) == [4, 8]


def test_the_mirrors_config_json_is_signed_forged_or_unsigned_refused_under_require_signature(tmp_path, nokey,
                                                                                             monkeypatch, capsys):
    monkeypatch.setenv(auth.ENV_KEY, KEY)
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    train(run, 4, 4, mirror=str(mirror))  # the session writes the run's config.json; the mirror signs its copy
    good = (run / "config.json").read_bytes()
    assert (mirror / "config.json").read_bytes() == good
    auth.verify_file(KEY.encode(), (mirror / CONFIG_SIG).read_bytes(), "config.json", good, "x")
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    assert cli_main(["mirror", "pull", str(tmp_path / "ok"), "--mirror", str(mirror)]) == 0
    assert (tmp_path / "ok" / "config.json").read_bytes() == good
    (mirror / "config.json").write_bytes(json.dumps({"steps": 4, "lr": 1000, "every": 0}).encode())  # no key needed
    assert cli_main(["mirror", "pull", str(tmp_path / "forged"), "--mirror", str(mirror)]) == 1
    assert "signature does not match config.json" in capsys.readouterr().err
    assert not (tmp_path / "forged" / "config.json").exists()
    (mirror / CONFIG_SIG).unlink()
    assert cli_main(["mirror", "pull", str(tmp_path / "unsigned"), "--mirror", str(mirror)]) == 1
    assert "not signed" in capsys.readouterr().err
    assert not (tmp_path / "unsigned" / "config.json").exists()
    monkeypatch.delenv(auth.ENV_REQUIRE)
    monkeypatch.delenv(auth.ENV_KEY)  # an unsigned run's reader: taken as it is
    assert cli_main(["mirror", "pull", str(tmp_path / "plain"), "--mirror", str(mirror)]) == 0
    assert b'"lr": 1000' in (tmp_path / "plain" / "config.json").read_bytes()


def test_a_password_in_the_endpoint_never_reaches_a_file_or_the_terminal(tmp_path, s3, proxy, monkeypatch, capsys):
    good = f"http://user:{SECRET}@127.0.0.1:{proxy.url.rsplit(':', 1)[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", good)
    run = tmp_path / "run"
    train(run, 4, 4, mirror=fast(s3.url))  # the store reachable: uploads (the endpoint's userinfo unused by S3)
    assert s3.committed() == [4]
    proxy.mode = "down"  # unreachable: every retry and failure quotes the endpoint URL
    train(run, 8, 4, mirror=fast(s3.url, timeout=1.0, close_timeout=0.2))
    assert cli_main(["mirror", "status", str(run)]) == 2
    assert cli_main(["mirror", "push", str(run), "--mirror", s3.url]) == 2
    assert cli_main(["mirror", "status", str(run), "--mirror", f"s3://u:{SECRET}@bucket/p"]) == 2  # in the URL itself
    out = capsys.readouterr()
    assert "127.0.0.1" in out.err and "***" in out.err  # the errors are there, redacted
    history = (run / ".loss.jsonl").read_text()
    assert ("\"mirror_outage\"" in history or "\"mirror_retry\"" in history) and "***@127.0.0.1" in history
    with pytest.raises(RemoteUnavailable) as exc:  # the exception's own text, before any printing
        open_store(s3.url, timeout=1.0).list()
    assert "***@127.0.0.1" in str(exc.value) and SECRET not in str(exc.value)
    proxy.mode = "pass"
    assert not files_holding(run, SECRET) and SECRET not in out.out + out.err
    assert not [k for k in s3.keys() if SECRET.encode() in s3.get(k)]


def test_redact_masks_userinfo_query_secrets_and_secret_env_values():
    env = {"AWS_SECRET_ACCESS_KEY": "AKsecretvalue1234567890"}
    text = 'Could not connect to "http://u:p%40ss@h:9/b?list-type=2&X-Amz-Signature=abc&prefix=p" AKsecretvalue1234567890'
    out = redact(text, environ=env)
    assert "p%40ss" not in out and "abc" not in out and "AKsecretvalue" not in out
    assert "http://***@h:9/b?list-type=2&X-Amz-Signature=***&prefix=p" in out
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact("key=0123456789abcdef step=4") == "key=0123456789abcdef step=4"  # a signature line's key id stays
    seen: list[tuple[str, dict]] = []
    write = redacting(lambda name, **kw: seen.append((name, kw)))  # the mirror's history writer
    write("mirror_failed", error=f"boom at http://u:{SECRET}@h:9/x", steps=[1, 2], found={"url": f"ftp://{SECRET}@h"})
    assert SECRET not in repr(seen) and seen[0][1]["steps"] == [1, 2] and "http://***@h:9/x" in seen[0][1]["error"]


# ---------------------------------------------------------------------------- long tier


@pytest.mark.slow
def test_an_s3_prefix_that_is_not_a_mirror_is_refused_and_left_alone(tmp_path, s3, nokey, capsys):
    s3.put("notes/readme.txt", b"someone else's")
    s3.put("holiday.jpg", b"\xff\xd8")
    before = s3.keys()
    run = tmp_path / "run"
    train(run, 8, 4, mirror=fast(s3.url))  # training goes on; nothing is written to the prefix
    assert s3.keys() == before
    failed = [json.loads(x) for x in (run / ".loss.jsonl").read_text().splitlines() if '"mirror_failed"' in x]
    assert failed and "not a mirror's" in failed[0]["error"]
    assert cli_main(["mirror", "push", str(run), "--mirror", s3.url]) == 2
    assert "not a mirror's" in capsys.readouterr().err
    assert s3.keys() == before
    # an empty prefix becomes a mirror; the planted redirect (no key) to a prefix that is not one is refused
    other = s3.url + "-other"
    assert cli_main(["mirror", "push", str(run), "--mirror", other]) == 0
    (run / MIRROR_RECORD).write_text(json.dumps({"url": s3.url}))
    assert cli_main(["mirror", "push", str(run)]) == 2
    assert s3.keys() == before


@pytest.mark.slow
def test_credentials_never_reach_an_export_or_a_subprocess_terminal(tmp_path, s3, proxy, nokey):
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://user:{SECRET}@127.0.0.1:{proxy.url.rsplit(':', 1)[1]}"}
    run = tmp_path / "run"
    train(run, 4, 4, mirror=fast(s3.url))
    proxy.mode = "down"
    os.environ["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL"]
    try:
        train(run, 8, 4, mirror=fast(s3.url, timeout=1.0, close_timeout=0.2))
    finally:
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
    outs = []
    for args in (["mirror", "status", str(run)], ["mirror", "push", str(run)], ["mirror", "status", str(run), "--json"],
                 ["export", str(run), "--to", str(tmp_path / "bundle")]):
        r = subprocess.run([sys.executable, "-m", "ripresa", *args], env=env, capture_output=True, text=True, timeout=300)
        outs.append(r.stdout + r.stderr)
    assert (tmp_path / "bundle").is_dir(), outs[-1]
    assert not files_holding(tmp_path / "bundle", SECRET) and not files_holding(run, SECRET)
    assert all(SECRET not in o for o in outs) and any("***@127.0.0.1" in o for o in outs)


def test_an_s3_mirror_is_locked_while_written_a_dead_writers_lease_is_taken_over(tmp_path, s3, nokey):
    first, second = (MirrorTarget(open_store(s3.url), explicit=True) for _ in range(2))
    first.claim()
    assert {MIRROR_MARKER, LOCK_KEY} <= set(s3.keys())
    with pytest.raises(LockHeld, match="another writer holds the mirror"):
        second.put_bytes("config.json", b"{}")
    assert "config.json" not in s3.keys()
    first.release()
    assert LOCK_KEY not in s3.keys()
    second.claim()
    second.release()
    # a writer killed on this host (its pid gone): its unexpired lease is taken over at once
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    s3.put(LOCK_KEY, json.dumps({"owner": "x", "host": socket.gethostname()[:64], "pid": int(dead.stdout),
                                 "expires": time.time() + 600}).encode())
    third = MirrorTarget(open_store(s3.url), explicit=True)
    third.claim()
    assert json.loads(s3.get(LOCK_KEY))["pid"] == os.getpid()
    third.release()
