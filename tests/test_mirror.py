"""The mirror (docs/MIRROR.md) against a real S3 server (moto, on 127.0.0.1, started here) and a real TCP fault proxy.

Every generation that counts is compared bitwise: ``digest`` is the sha256 of
the weights, the optimizer state and the next draws of every random stream
(tests/support/mirror_train.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, ripresa_cli
from support.helpers import history_events
from support.mirror_train import train

from ripresa.cli import main as cli_main
from ripresa.errors import CheckFailed
from ripresa.io import auth
from ripresa.store.mirror import MirrorSpec, local_generations

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3, proxy

MIRROR_TRAIN = Path(__file__).resolve().parent / "support" / "mirror_train.py"


def fast(url: str, **kw) -> MirrorSpec:
    return MirrorSpec(url, **{"timeout": 5.0, "attempts": 6, "backoff": 0.02, "max_backoff": 0.2, "close_timeout": 30.0,
                              **kw})


# ---------------------------------------------------------------------------- default tier


def test_local_path_mirror_resumes_a_new_folder_bitwise(tmp_path):
    remote = tmp_path / "other-disk" / "mirror"
    ref = train(tmp_path / "ref", 12, 3)
    first = train(tmp_path / "a", 6, 3, mirror=str(remote), fmt="andrea")  # a path ...
    assert first["last_upload_seconds"] is not None
    assert sorted(local_generations(remote)) == ["step_000003.bin", "step_000006.bin"]
    assert (remote / "config.json").is_file()
    shutil.rmtree(tmp_path / "a")  # the machine is gone
    again = train(tmp_path / "b", 12, 3, mirror=remote.as_uri(), fmt="andrea")  # ... or a file:// URL
    assert (again["start"], again["resumed"]) == (6, "step_000006.bin")
    assert again["digest"] == ref["digest"]
    assert [e["step"] for e in history_events(tmp_path / "b", "mirror_pulled")] == [6]
    assert sorted(local_generations(remote).values()) == [3, 6, 9, 12]


def test_hostile_remote_markers_and_oversized_objects_are_refused(tmp_path):
    remote = tmp_path / "mirror"
    train(tmp_path / "a", 8, 4, mirror=str(remote))
    good = (remote / "step_000008.safetensors.sha256").read_text()
    # a marker that names a file outside the run folder, one that names another generation's files,
    # and an object larger than its listing (a local mirror lists the real size: it grew after the marker)
    (remote / "step_000020.safetensors.sha256").write_text(good.replace("step_000008.safetensors.json", "../../escape"))
    (remote / "step_000016.safetensors.sha256").write_text(good)
    for suffix in ("", ".json"):
        shutil.copy(remote / f"step_000008.safetensors{suffix}", remote / f"step_000012.safetensors{suffix}")
    (remote / "step_000012.safetensors.sha256").write_text(good.replace("000008", "000012"))
    with open(remote / "step_000012.safetensors", "ab") as f:
        f.write(b"\0" * 1024)
    out = train(tmp_path / "new", 8, 4, mirror=str(remote))
    assert out["resumed"] == "step_000008.safetensors"
    refused = {e["step"]: e["reason"] for e in history_events(tmp_path / "new", "mirror_refused")}
    assert set(refused) == {20, 16, 12} and "malformed commit marker" in refused[20] + refused[16]
    assert not (tmp_path / "escape").exists() and not list((tmp_path / "new").glob("step_0000[12]*"))


def test_s3_multipart_upload_is_completed_only_when_the_sha256_matches(tmp_path, s3):
    from ripresa.errors import IntegrityError
    from ripresa.io.objstore import open_store

    store = open_store(s3.url)
    store.multipart_threshold = store.part_size = 5 << 20  # S3's smallest part
    data = os.urandom(12 << 20)
    src = tmp_path / "step_000001.bin"
    src.write_bytes(data)
    assert store.put_file(src.name, src, sha256=hashlib.sha256(data).hexdigest()) == len(data)
    assert s3.get(src.name) == data  # three parts: 5 + 5 + 2 MiB
    with pytest.raises(IntegrityError, match="does not match its commit marker"):
        store.put_file("step_000002.bin", src, sha256="0" * 64)
    assert "step_000002.bin" not in s3.keys()  # aborted, never completed
    assert not s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    with pytest.raises(IntegrityError, match="larger than allowed"):
        store.get_bytes(src.name, limit=1 << 20)  # a bounded read refuses it before reading it


@pytest.mark.slow
def test_s3_mirror_then_resume_on_a_new_machine_in_a_fresh_process_is_bitwise(tmp_path, s3):
    ref = train(tmp_path / "ref", 16, 4)
    a = train(tmp_path / "a", 8, 4, mirror=fast(s3.url))
    assert s3.committed() == [4, 8]
    keys = s3.keys()
    assert {"config.json", "step_000008.safetensors", "step_000008.safetensors.json",
            "step_000008.safetensors.sha256"} <= set(keys)
    uploads = history_events(tmp_path / "a", "mirror_uploaded")
    assert [e["step"] for e in uploads] == [4, 8] and a["last_upload_seconds"] > 0
    shutil.rmtree(tmp_path / "a")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    res = subprocess.run([sys.executable, str(MIRROR_TRAIN), "--run", str(tmp_path / "new"), "--steps", "16",
                          "--every", "4", "--mirror", s3.url], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert (out["start"], out["resumed"]) == (8, "step_000008.safetensors")
    assert out["digest"] == ref["digest"]
    assert s3.committed() == [4, 8, 12, 16]


@pytest.mark.slow
def test_5xx_throttling_timeouts_and_resets_are_retried_training_never_stops(tmp_path, s3, proxy):
    ref = train(tmp_path / "ref", 24, 3)
    faults = ["500", "503", "stall", "reset", "500"]

    run = tmp_path / "run"
    train(run, 3, 3, mirror=fast(s3.url))

    def feed() -> None:  # once this session uploads, one fault every 0.2 s (each drops the live connections)
        while len(history_events(run, "mirror_uploaded")) < 2:
            time.sleep(0.02)
        for f in faults:
            proxy.arm(f)
            time.sleep(0.2)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    out = train(run, 24, 3, mirror=fast(s3.url, timeout=1.0, attempts=12), sleep=0.1)
    feeder.join()
    assert out["step"] == 24 and out["digest"] == ref["digest"]  # training went on, untouched
    assert proxy.injected == faults
    retries = history_events(tmp_path / "run", "mirror_retry")
    text = " ".join(f"{e['error']} {e.get('found')}" for e in retries)
    assert len(retries) >= len(faults), retries
    assert "HTTP 500 InternalError" in text and "HTTP 503 SlowDown" in text and "Timeout" in text, text
    # some hit an upload (a generation's objects, or the run's own files: history segments, manifest), not only listings
    assert any(e["step"] is not None or e["object"].startswith(("history/", "run.json", "files/")) for e in retries)
    assert not history_events(tmp_path / "run", "mirror_outage")  # every fault was retried within its round
    # nothing lost: every generation the policy keeps is in the store, byte for byte what the local markers vouch for
    assert s3.committed() == [9, 12, 15, 18, 21, 24]
    for name in local_generations(tmp_path / "run"):  # 18, 21, 24 (local keep_last=3)
        marker = (tmp_path / "run" / (name + ".sha256")).read_bytes()
        assert s3.get(name + ".sha256") == marker
        for line in marker.decode().splitlines():
            digest, _, obj = line.partition("  ")
            assert hashlib.sha256(s3.get(obj)).hexdigest() == digest
    pulled = train(tmp_path / "new", 24, 3, mirror=fast(s3.url))
    assert pulled["resumed"] == "step_000024.safetensors" and pulled["digest"] == ref["digest"]


@pytest.mark.slow
def test_store_unreachable_local_retention_keeps_pending_then_push_uploads_them(tmp_path, s3, proxy, capsys):
    run = tmp_path / "run"
    train(run, 3, 3, mirror=fast(s3.url), keep=3)
    assert s3.committed() == [3]
    proxy.mode = "down"  # the store is unreachable from now on
    out = train(run, 18, 3, mirror=fast(s3.url, timeout=1.0, attempts=2, close_timeout=0.5), keep=3)
    assert out["step"] == 18
    # five saves while the store was down: local keep_last=3, yet all are kept (this session could not even
    # list the store, so step 3 is kept too)
    assert sorted(local_generations(run).values()) == [3, 6, 9, 12, 15, 18]
    assert history_events(run, "mirror_outage") and history_events(run, "mirror_pending")[-1]["steps"] == [3, 6, 9, 12, 15, 18]
    # said at once on stderr (the first listing is tried once), with the hint; training went on
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "training goes on" in err and f"ripresa mirror push {run}" in err, err
    assert s3.committed() == [3]
    proxy.mode = "pass"
    assert cli_main(["mirror", "push", str(run)]) == 0  # the URL from RUN/mirror.json
    assert s3.committed() == [3, 6, 9, 12, 15, 18]
    # nothing pending any more: the next save's retention goes back to keep_last=3
    train(run, 21, 3, mirror=fast(s3.url), keep=3)
    assert sorted(local_generations(run).values()) == [15, 18, 21]
    assert s3.committed() == [6, 9, 12, 15, 18, 21]  # the mirror's own policy: twice the local keep_last


def test_a_flipped_remote_byte_is_refused_and_the_previous_generation_used(tmp_path, s3):
    ref = train(tmp_path / "ref", 8, 4)
    train(tmp_path / "a", 8, 4, mirror=fast(s3.url))
    name = "step_000008.safetensors"
    data = bytearray(s3.get(name))
    data[len(data) // 2] ^= 0x01
    s3.put(name, bytes(data))
    out = train(tmp_path / "new", 8, 4, mirror=fast(s3.url))
    assert (out["start"], out["resumed"]) == (4, "step_000004.safetensors")
    assert out["digest"] == ref["digest"]  # steps 5..8 retrained from 4: the same state
    refused = history_events(tmp_path / "new", "mirror_refused")
    assert [e["step"] for e in refused] == [8] and "differs from its marker" in refused[0]["reason"]


def test_objects_without_a_marker_are_never_used_then_cleaned_by_the_next_writer(tmp_path, s3):
    train(tmp_path / "a", 8, 4, mirror=fast(s3.url))
    for suffix in ("", ".json"):  # a half upload of step 12: data objects, no marker
        s3.put(f"step_000012.safetensors{suffix}", s3.get(f"step_000008.safetensors{suffix}"))
    assert cli_main(["mirror", "status", str(tmp_path / "a"), "--json"]) == 0
    out = train(tmp_path / "new", 8, 4, mirror=fast(s3.url))
    assert out["resumed"] == "step_000008.safetensors"
    cleaned = history_events(tmp_path / "new", "mirror_cleaned")
    assert [e["step"] for e in cleaned] == [12]
    assert not [k for k in s3.keys() if k.startswith("step_000012")]


def test_signed_run_signature_travels_forged_or_unsigned_refused(tmp_path, s3, monkeypatch):
    monkeypatch.setenv(auth.ENV_KEY, "k" * 32)
    train(tmp_path / "a", 8, 4, mirror=fast(s3.url))
    assert "step_000008.safetensors.hmac" in s3.keys()
    monkeypatch.setenv(auth.ENV_REQUIRE, "1")
    ok = train(tmp_path / "b", 8, 4, mirror=fast(s3.url))
    assert ok["resumed"] == "step_000008.safetensors"
    # a forged signature (another key) on the newest: refused, the previous one used
    forged = s3.get("step_000008.safetensors.hmac").replace(auth.key_id(b"k" * 32).encode(), auth.key_id(b"x" * 32).encode())
    s3.put("step_000008.safetensors.hmac", forged)
    out = train(tmp_path / "c", 8, 4, mirror=fast(s3.url))
    assert out["resumed"] == "step_000004.safetensors"
    assert "signed with another key" in history_events(tmp_path / "c", "mirror_refused")[0]["reason"]
    # no signature at all under require-signature: nothing verifies, a typed refusal (exit 1), not a restart at 0
    for k in list(s3.keys()):
        if k.endswith(".hmac"):
            s3.delete(k)
    with pytest.raises(CheckFailed, match="verifies"):
        train(tmp_path / "d", 8, 4, mirror=fast(s3.url))


def test_mirror_cli_status_pull_and_typed_errors(tmp_path, s3, monkeypatch, capsys):
    train(tmp_path / "a", 8, 4, mirror=fast(s3.url))
    assert cli_main(["mirror", "status", str(tmp_path / "a"), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["local"], st["remote"], st["pending"], st["half_uploaded"]) == ([4, 8], [4, 8], [], [])
    assert cli_main(["mirror", "pull", str(tmp_path / "inspect"), "--mirror", s3.url, "--step", "4"]) == 0
    assert sorted(local_generations(tmp_path / "inspect")) == ["step_000004.safetensors"]
    assert (tmp_path / "inspect" / "config.json").is_file()
    assert cli_main(["inspect", str(tmp_path / "inspect"), "--json"]) == 0
    capsys.readouterr()
    # typed errors: exit 2 for a bad URL, missing credentials, missing boto3; exit 1 when nothing verifies
    assert cli_main(["mirror", "status", str(tmp_path / "a"), "--mirror", "ftp://host/x"]) == 2
    assert cli_main(["mirror", "status", str(tmp_path / "a"), "--mirror", "s3://Not_A_Bucket/x"]) == 2
    with monkeypatch.context() as m:
        m.delenv("AWS_ACCESS_KEY_ID")
        m.delenv("AWS_SECRET_ACCESS_KEY")
        assert cli_main(["mirror", "status", str(tmp_path / "a")]) == 2
        assert "no credentials" in capsys.readouterr().err
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "boto3", None)
        assert cli_main(["mirror", "status", str(tmp_path / "a")]) == 2
        assert "ripresa[s3]" in capsys.readouterr().err
    for k in s3.keys():
        if k.endswith(".json") and k.startswith("step_"):
            s3.put(k, s3.get(k) + b" ")
    assert cli_main(["mirror", "pull", str(tmp_path / "none"), "--mirror", s3.url]) == 1
    assert "none of the 2 remote generation(s) verifies" in capsys.readouterr().err


# ---------------------------------------------------------------------------- long tier


@pytest.mark.slow
def test_sigkill_in_the_middle_of_an_upload_leaves_objects_without_marker_ignored_then_cleaned(tmp_path, s3, proxy):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen([sys.executable, str(MIRROR_TRAIN), "--run", str(run), "--steps", "400", "--every", "4",
                             "--mirror", s3.url, "--sleep", "0.05", "--timeout", "30"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while 4 not in s3.committed():
            assert proc.poll() is None and time.time() - t0 < 120, proc.stderr.read() if proc.poll() is not None else ""
            time.sleep(0.05)
        proxy.slow_bps = 4000  # the next uploads crawl
        half = None
        while half is None:
            assert proc.poll() is None and time.time() - t0 < 240
            keys = s3.keys()
            for k in keys:
                if k.endswith(".safetensors") and k + ".sha256" not in keys:
                    half = int(k[5:11])
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # in the middle of that generation's upload
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proxy.slow_bps = None
    committed = s3.committed()
    assert half not in committed and committed
    shutil.rmtree(run)
    out = train(tmp_path / "new", max(committed), 4, mirror=fast(s3.url))
    assert out["resumed"] == f"step_{max(committed):06d}.safetensors"
    assert half in [e["step"] for e in history_events(tmp_path / "new", "mirror_cleaned")]
    assert not [k for k in s3.keys() if k.startswith(f"step_{half:06d}")]


@pytest.mark.slow
def test_ripresa_train_mirror_on_a_blank_machine_needs_no_config(tmp_path, s3):
    common = ["--every", "2", "--no-audit", "--quiet", "--threads", "1", "--device", "cpu"]
    a = ripresa_cli("train", "--run", tmp_path / "a", "--config", "tiny", "--steps", "4", "--mirror", s3.url, *common,
                    cwd=REPO)
    assert a.returncode == 0, a.stderr[-3000:]
    assert {2, 4} <= set(s3.committed()) and "config.json" in s3.keys()
    shutil.rmtree(tmp_path / "a")
    b = ripresa_cli("train", "--run", tmp_path / "b", "--steps", "6", "--mirror", s3.url, *common, cwd=REPO)  # the end step
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resumed" in b.stdout and "at step 4" in b.stdout
    ref = ripresa_cli("train", "--run", tmp_path / "ref", "--config", "tiny", "--steps", "6", *common, cwd=REPO)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert (tmp_path / "b" / "step_000006.bin").read_bytes() == (tmp_path / "ref" / "step_000006.bin").read_bytes()


@pytest.mark.slow
def test_a_sharded_dcp_generation_is_mirrored_and_pulled_deep_checked(tmp_path, s3):
    import torch

    from ripresa.core.state import Progress, TrainingState
    from ripresa.formats import dcp
    from ripresa.store.dcp import commit_dcp
    from ripresa.store.mirror import Mirror
    from ripresa.store.restore import rest_proxy
    from ripresa.store.retention import KeepLast
    from ripresa.store.store import CheckpointStore

    run = tmp_path / "run"
    run.mkdir()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    part = dcp.partial_path(run, 5)
    dcp.save_shards(model, opt, part, no_dist=True)  # one rank's shards, as an FSDP2 run writes them
    rest = rest_proxy(TrainingState(model=model, optimizer=opt)).snapshot(Progress(step=5), None, include_parameters=False)
    assert commit_dcp(run, 5, part, world_size=1, n_params=10, state=rest).valid
    mirror = Mirror(fast(s3.url), run, local_retention=KeepLast(3))
    assert mirror.round() and s3.committed() == [5]
    assert {"step_000005.dcp/.metadata", "step_000005.dcp/__0_0.distcp", "step_000005.dcp/ripresa.json"} <= set(s3.keys())
    new = tmp_path / "new"
    with CheckpointStore(new) as store:  # a blank machine's mirror, on the same store
        gen = Mirror(fast(s3.url), new, local_retention=KeepLast(3)).pull(store)
    assert gen.valid and gen.deep_checked and gen.kind == "dcp"
    for name in ("__0_0.distcp", ".metadata", "ripresa.json"):
        assert (new / "step_000005.dcp" / name).read_bytes() == (run / "step_000005.dcp" / name).read_bytes()
