"""A run's ``config.json`` is signed with the run key when ripresa writes it, and checked before a resume trusts it
(docs/FAULTS.md, "Trust model"): a forged or unsigned one is refused under require-signature."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ripresa.io import auth

KEY = "0123456789abcdef0123456789abcdef"


def test_a_signed_run_file_verifies_and_a_forged_or_unsigned_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.ENV_KEY, KEY)
    cfg = tmp_path / "config.json"
    auth.write_signed_run_file(cfg, b'{"lr": 0.001}\n')
    auth.check_run_file(cfg, cfg.read_bytes(), require=True)
    with pytest.raises(auth.SignatureError, match="does not match"):
        auth.check_run_file(cfg, b'{"lr": 1000}\n', require=False)  # a forgery fails whenever a key can check it
    # a rewrite: every moment of it leaves a signature that matches the file (a kill between the renames)
    auth.write_signed_run_file(cfg, b'{"lr": 0.002}\n')
    assert len((tmp_path / "config.json.hmac").read_bytes().splitlines()) == 1
    both = auth.file_signature_line(KEY.encode(), "config.json", b'{"lr": 0.003}\n') + \
        auth.file_signature_line(KEY.encode(), "config.json", b'{"lr": 0.002}\n')
    (tmp_path / "config.json.hmac").write_bytes(both)  # the first rename done, the file not yet replaced
    auth.check_run_file(cfg, cfg.read_bytes(), require=True)
    os.unlink(tmp_path / "config.json.hmac")
    auth.check_run_file(cfg, cfg.read_bytes(), require=False)  # unsigned: used as it is without the flag
    with pytest.raises(auth.SignatureError, match="not signed"):
        auth.check_run_file(cfg, cfg.read_bytes(), require=True)
    monkeypatch.delenv(auth.ENV_KEY)
    auth.write_signed_run_file(cfg, b'{"lr": 0.004}\n')  # written without the key: no stale signature stays
    assert not (tmp_path / "config.json.hmac").exists()


@pytest.mark.slow
def test_a_forged_config_json_is_refused_by_a_signed_resume(tmp_path):
    env = dict(os.environ, RIPRESA_HMAC_KEY=KEY, PYTHONDONTWRITEBYTECODE="1")
    run = tmp_path / "r"
    base = [sys.executable, "-m", "ripresa", "train", "--run", str(run), "--every", "2", "--threads", "1", "--quiet",
            "--no-audit"]
    subprocess.run([*base, "--config", "tiny", "--steps", "4"], env=env, check=True, capture_output=True, timeout=600)
    assert (run / "config.json.hmac").is_file()
    ok = subprocess.run([*base, "--steps", "6", "--require-signature"], env=env, capture_output=True, text=True,
                        timeout=600)
    assert ok.returncode == 0, ok.stderr
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"]["lr"] = 1000.0  # an attacker without the key
    (run / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    bad = subprocess.run([*base, "--steps", "8", "--require-signature"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 1 and "signature does not match config.json" in bad.stderr, bad.stderr
    assert not (run / "step_000008.bin").exists()
