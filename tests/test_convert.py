"""`ripresa convert`: .dcp / .bin generation / plain .bin / checkpoint.pt / safetensors, verified bitwise."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ripresa.tools.convert as convert_mod
from ripresa.cli import main
from ripresa.engine.gpt.factory import GPT_FACTORY
from ripresa.tools.convert import compare, convert, load


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> Path:
    """A real 4-step generation of the tiny GPT (single process), the source of every conversion."""
    root = tmp_path_factory.mktemp("convert")
    text = root / "text.txt"
    text.write_text(inspect.getsource(json.decoder) * 3)
    run = root / "run"
    res = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(run), "--config", "tiny", "--quiet",
                          "--threads", "1", "--no-audit", "--steps", "4", "--every", "4", "--set", "train.batch_size=4",
                          "--set", f'data.sources=["text={text}"]'], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    return run / "step_000004.bin"


def cli(*args) -> int:
    return main(["convert", *map(str, args)])


def test_bin_to_dcp_to_bin_is_byte_identical(gen, tmp_path, capsys):
    assert cli(gen, tmp_path / "a" / "step_000004.dcp") == 0
    assert "compared bitwise (full state): identical" in capsys.readouterr().out
    res = subprocess.run(["sha256sum", "-c", "step_000004.dcp.sha256"], cwd=tmp_path / "a", capture_output=True, text=True)
    assert res.returncode == 0
    assert cli(tmp_path / "a" / "step_000004.dcp", tmp_path / "b" / "step_000004.bin") == 0
    back = tmp_path / "b" / "step_000004.bin"
    assert back.read_bytes() == gen.read_bytes()  # weights, m, v, header: the same bytes
    assert back.with_suffix(".json").read_bytes() == gen.with_suffix(".json").read_bytes()  # and the companion


@pytest.mark.slow
def test_bin_to_pt_to_bin_and_plain_and_safetensors(gen, tmp_path, capsys):
    r = convert(gen, tmp_path / "c.pt", model_factory=GPT_FACTORY)
    assert r["verified"] and r["dest_kind"] == "pt" and r["compared"] == "full"
    assert convert(tmp_path / "c.pt", tmp_path / "d" / "step_000004.bin", model_factory=GPT_FACTORY)["verified"]
    assert (tmp_path / "d" / "step_000004.bin").read_bytes() == gen.read_bytes()
    assert compare(load(gen, model_factory=GPT_FACTORY), load(tmp_path / "d" / "step_000004.bin", model_factory=GPT_FACTORY), "full") == []
    # A plain .bin holds the generation's exact bytes (no companion), and converts back to plain.
    assert convert(gen, tmp_path / "plain.bin", model_factory=GPT_FACTORY)["compared"] == "moments"
    assert (tmp_path / "plain.bin").read_bytes() == gen.read_bytes()
    assert cli(tmp_path / "plain.bin", tmp_path / "plain2.bin", "--config", "tiny", "--json") == 0
    assert json.loads(capsys.readouterr().out)["source_kind"] == "plain-bin"
    # Weights only.
    assert convert(gen, tmp_path / "w.safetensors", model_factory=GPT_FACTORY)["compared"] == "weights"
    assert compare(load(gen, model_factory=GPT_FACTORY), load(tmp_path / "w.safetensors", model_factory=GPT_FACTORY), "weights") == []


def test_refusals_and_integrity(gen, tmp_path, capsys):
    assert cli(gen, tmp_path / "plain.bin") == 0
    # Missing state is never invented: a plain .bin cannot become a complete checkpoint.
    assert cli(tmp_path / "plain.bin", tmp_path / "x.pt", "--config", "tiny") == 2
    assert "never invented" in capsys.readouterr().err
    assert cli(gen, tmp_path / "plain.bin") == 2  # the destination exists
    assert cli(gen, tmp_path / "x.txt") == 2  # unknown format
    assert cli(gen, tmp_path / "e" / "step_000005.bin") == 2  # a generation's name carries its step
    # A damaged source is refused (exit 1), never converted.
    bad = tmp_path / "bad"
    shutil.copytree(gen.parent, bad, ignore=shutil.ignore_patterns("LOCK"))
    with open(bad / gen.name, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert cli(bad / gen.name, tmp_path / "f.pt") == 1
    assert not (tmp_path / "f.pt").exists()


@pytest.mark.slow
def test_a_difference_after_writing_fails_the_command(gen, tmp_path, monkeypatch, capsys):
    from ripresa.io.fsio import sha256_file, write_sidecar

    real = convert_mod.write
    resign = {"on": False}

    def corrupting(lo, dest, kind):
        real(lo, dest, kind)
        with open(dest, "r+b") as f:  # a plain .bin: flip one bit of the last element of v
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        if resign["on"]:
            write_sidecar(dest, sha256_file(dest))  # a consistent lie: only the bitwise comparison can tell

    monkeypatch.setattr(convert_mod, "write", corrupting)
    assert cli(gen, tmp_path / "p.bin") == 1
    assert "sha256 mismatch" in capsys.readouterr().err
    resign["on"] = True
    assert cli(gen, tmp_path / "q.bin") == 1
    err = capsys.readouterr().err
    assert "differs from the source" in err and "exp_avg_sq" in err
