"""Tools on a generation that lives only in the store (docs/MIRROR.md, "Tools on a generation that lives only in
the store").

A multi-node run's generations are whole only in the object store (each node keeps its own shards); the store's
layout is a mirror's. ``ripresa inspect URL`` and ``ripresa export URL --to DEST`` pull the newest committed
generation (or ``--step N``'s) verified into a private temporary folder, run the tool on it and remove the
folder; ``ripresa mirror pull`` lands a ``.dcp`` generation written by 4 ranks (every rank's files).

Default tier: a local ``file://`` store, in-process commands (a few seconds). Slow: a real 4-rank ``torchrun``
FSDP2 ``.dcp`` generation pulled from a folder store and from a real S3 server (moto on 127.0.0.1), and the
export from S3.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.helpers import must_not_block
from support.mirror_train import train

from ripresa.cli import main as cli_main
from ripresa.tools.from_store import TEMP_PREFIX

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3

LINE = re.compile(r"^(inspecting|exporting|converting) step (\d+) from (\S+) \(pulled [\d.]+ (?:bytes|KiB|MiB), (\d+) objects\)$")
LOOP = Path(__file__).resolve().parent / "fixtures" / "fsdp_loop.py"


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A folder store holding a run's generations 3 and 6 (general .safetensors) and its files, as a mirror (and a
    multi-node run's store) holds them; the run folder that wrote it is removed: the store is all there is."""
    base = tmp_path_factory.mktemp("store")
    train(base / "run", 6, 3, mirror=f"file://{base / 'store'}")
    shutil.rmtree(base / "run")
    assert sorted(p.name for p in (base / "store").glob("*.sha256")) == ["step_000003.safetensors.sha256",
                                                                       "step_000006.safetensors.sha256"]
    return base / "store"


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """A TMPDIR of the test's own; after the test, no pulled folder is left in it."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    yield tmp
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(TEMP_PREFIX)], "a pulled folder was left behind"


def copy_store(store: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "hostile"
    shutil.copytree(store, dst, symlinks=True)
    return dst


# ---------------------------------------------------------------------------------------- inspect, export


def test_inspect_a_store_url_pulls_the_newest_generation_verified_and_says_where_it_came_from(store, capsys,
                                                                                               private_tmp):
    url = f"file://{store}"
    assert cli_main(["inspect", url]) == 0
    out = capsys.readouterr().out
    m = LINE.match(out.splitlines()[0])
    assert m and m.group(1) == "inspecting" and m.group(2) == "6" and m.group(3) == url, out[:400]
    assert int(m.group(4)) >= 3  # the tensors, the companion, the marker (and the run's files)
    assert f"{url}/step_000006.safetensors" in out and str(private_tmp) not in out  # named by where it lives
    assert cli_main(["inspect", url, "--step", "3", "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["exit_code"] == 0 and doc["kind"] == "safetensors"
    assert doc["store"]["url"] == url and doc["store"]["step"] == 3
    gen_bytes = sum((store / n).stat().st_size for n in ("step_000003.safetensors", "step_000003.safetensors.json",
                                                         "step_000003.safetensors.sha256"))
    assert doc["store"]["bytes"] >= gen_bytes and doc["store"]["objects"] >= 3
    assert doc["path"] == f"{url}/step_000003.safetensors" and str(private_tmp) not in cap.out
    assert LINE.match(cap.err.strip().splitlines()[-1]).group(2) == "3"  # --json: the line on stderr
    # only an explicit scheme:// names a store: a path is inspected where it is, as before
    assert cli_main(["inspect", str(store / "step_000006.safetensors"), "--no-deep"]) == 0
    out = capsys.readouterr().out
    assert not LINE.match(out.splitlines()[0]) and str(store / "step_000006.safetensors") in out


def test_export_a_store_url_writes_a_verified_bundle_naming_the_store(store, tmp_path, capsys):
    url = f"file://{store}"
    assert cli_main(["export", url, "--to", str(tmp_path / "bundle"), "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert LINE.match(out.splitlines()[0]).group(2) == "3"
    manifest = json.loads((tmp_path / "bundle" / "export.json").read_text())
    assert manifest["source_run"] == url and manifest["step"] == 3
    exported = [p for p in (tmp_path / "bundle").rglob("step_000003.safetensors")]
    assert exported and sha(exported[0]) == sha(store / "step_000003.safetensors")  # the store's bytes
    assert cli_main(["export", "--verify", str(tmp_path / "bundle")]) == 0


def test_a_store_without_a_committed_generation_is_a_typed_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for url in (f"file://{tmp_path / 'empty'}", f"file://{tmp_path / 'absent'}"):
        assert cli_main(["inspect", url]) == 1
        err = capsys.readouterr().err
        assert "the store holds no committed generation" in err and "Traceback" not in err
    assert cli_main(["export", f"file://{tmp_path / 'empty'}", "--to", str(tmp_path / "b")]) == 1
    assert not (tmp_path / "b").exists()


def test_a_step_the_store_lacks_and_step_without_a_url_are_bad_input(store, tmp_path, capsys):
    assert cli_main(["inspect", f"file://{store}", "--step", "5"]) == 2
    assert "no committed generation of step 5" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    assert cli_main(["inspect", str(tmp_path / "run"), "--step", "3"]) == 2
    assert "--step needs a store URL" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "run"), str(tmp_path / "w.safetensors"), "--step", "3"]) == 2
    assert "--step needs a store URL" in capsys.readouterr().err


def test_a_full_tmpdir_is_exit_2_naming_tmpdir(store, tmp_path, capsys, monkeypatch):
    full = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)  # the pull's own check of the space it needs
    assert cli_main(["inspect", f"file://{store}"]) == 2
    err = capsys.readouterr().err
    assert "not enough disk space to pull" in err and "set TMPDIR" in err and "Traceback" not in err


def test_require_signature_refuses_an_unsigned_store(store, capsys, monkeypatch):
    from ripresa.io import auth

    monkeypatch.setenv(auth.ENV_KEY, "0123456789abcdef0123456789abcdef")
    monkeypatch.setenv(auth.ENV_REQUIRE, "0")  # recorded: the command sets it to 1, the teardown removes it
    assert cli_main(["inspect", f"file://{store}", "--require-signature"]) == 1
    err = capsys.readouterr().err
    assert "not signed, and signatures are required" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------- hostile stores


def _flip(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 1
    p.write_bytes(bytes(raw))


HOSTILE = {
    "a flipped byte": lambda s: _flip(s / "step_000006.safetensors"),
    "truncated": lambda s: os.truncate(s / "step_000006.safetensors", 100),
    "a companion missing": lambda s: os.unlink(s / "step_000006.safetensors.json"),
    "a link to the older tensors": lambda s: (os.unlink(s / "step_000006.safetensors"),
                                              os.symlink(s / "step_000003.safetensors", s / "step_000006.safetensors")),
    "a FIFO": lambda s: (os.unlink(s / "step_000006.safetensors"), os.mkfifo(s / "step_000006.safetensors")),
    "a marker naming a file outside": lambda s: (s / "step_000006.safetensors.sha256").write_text(
        f"{'0' * 64}  ../../etc/passwd\n"),
    "a marker of 10 MB": lambda s: (s / "step_000006.safetensors.sha256").write_bytes(b"0" * (10 << 20)),
}


@pytest.mark.parametrize("how", list(HOSTILE))
def test_a_hostile_newest_generation_is_refused_and_the_older_one_inspected(store, tmp_path, capsys, how):
    bad = copy_store(store, tmp_path)
    HOSTILE[how](bad)
    from ripresa.store.commit import CheckpointWarning

    with must_not_block(20), pytest.warns(CheckpointWarning, match=r"generation 6 not used: .*; step 3 is used"):
        code = cli_main(["inspect", f"file://{bad}", "--no-deep"])
    cap = capsys.readouterr()
    assert code == 0, cap.err[-2000:]
    assert LINE.match(cap.out.splitlines()[0]).group(2) == "3", cap.out[:400]
    assert "Traceback" not in cap.err + cap.out
    assert not os.path.exists("/etc/passwd.partial")


def test_refusals_in_the_store_s_history_are_not_this_pull_s(store, tmp_path, capsys):
    """The run's history in the store holds an old `mirror_refused` event (a past session's pull): only this
    pull's refusals are warned about."""
    import warnings

    from ripresa.store.commit import CheckpointWarning

    old = copy_store(store, tmp_path)
    man = json.loads((old / "run.json").read_bytes())
    end = man["history"][-1][2]
    line = json.dumps({"event": "mirror_refused", "step": 9, "file": "step_000009.safetensors",
                       "reason": "an old refusal", "url": "file:///elsewhere"}).encode() + b"\n"
    key = f"history/{end:012d}-{end + len(line):012d}.jsonl"
    (old / key).write_bytes(line)
    man["history"].append([key, end, end + len(line), hashlib.sha256(line).hexdigest()])
    (old / "run.json").write_bytes(json.dumps(man).encode())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli_main(["inspect", f"file://{old}", "--no-deep"]) == 0
    assert LINE.match(capsys.readouterr().out.splitlines()[0]).group(2) == "6"
    assert not [w for w in seen if issubclass(w.category, CheckpointWarning)], [str(w.message) for w in seen]


def test_a_store_whose_every_generation_is_hostile_fails_with_exit_1(store, tmp_path, capsys):
    bad = copy_store(store, tmp_path)
    _flip(bad / "step_000006.safetensors")
    _flip(bad / "step_000003.safetensors")
    assert cli_main(["inspect", f"file://{bad}"]) == 1
    assert cli_main(["export", f"file://{bad}", "--to", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "none of the 2 remote generation(s) verifies" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_secrets_in_a_store_url_never_reach_the_output(tmp_path, capsys, monkeypatch):
    secret = "wJalrXUtnFEMIK7MDENGbPxRfiCYzzSECRET"
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)  # the URL's own redaction, not the environment's
    for url in (f"s3://AKIAEXAMPLE:{secret}@bucket-a/runs", f"file://{tmp_path}?token={secret}",
                f"file://user:{secret}@localhost{tmp_path}"):
        assert cli_main(["inspect", url]) == 2
        assert cli_main(["export", url, "--to", str(tmp_path / "b"), "--json"]) == 2
        cap = capsys.readouterr()
        assert secret not in cap.out + cap.err and "***" in cap.err, cap.err[-600:]


# ---------------------------------------------------------------------------------------- interrupted


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_tool_runs_removes_the_pulled_folder(store, capsys, monkeypatch, sig, private_tmp):
    """Ctrl-C or SIGTERM (a real signal to this process) while the tool reads the pulled generation: exit 2
    ("interrupted"), the temporary folder removed, SIGTERM's handler put back."""
    import ripresa.tools.inspect as inspect_mod

    seen = []

    def signalled(path, **kw):
        if not str(path).startswith(str(private_tmp / TEMP_PREFIX)):
            raise AssertionError(f"not a pulled generation: {path}")  # (no signal to the test's own process)
        seen.append([p.name for p in private_tmp.iterdir() if p.name.startswith(TEMP_PREFIX)])
        os.kill(os.getpid(), sig)
        time.sleep(10)
        raise AssertionError("the signal did not interrupt the tool")

    monkeypatch.setattr(inspect_mod, "inspect_path", signalled)
    before = signal.getsignal(signal.SIGTERM)
    assert cli_main(["inspect", f"file://{store}"]) == 2
    assert seen and len(seen[0]) == 1  # the pulled folder existed while the tool ran
    assert "interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


# ---------------------------------------------------------------------------------------- a .dcp of 4 ranks


def _dcp_of_toy(run: Path, step: int) -> None:
    """A real .dcp generation (one rank's shards: FSDP2's save without a process group), committed."""
    import torch

    from ripresa.core.state import Progress, TrainingState
    from ripresa.formats import dcp as dcp_fmt
    from ripresa.store.backend import DcpBackend
    from ripresa.store.store import CheckpointStore

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    run.mkdir(parents=True)
    with CheckpointStore(run) as st:
        dcp_fmt.save_shards(model, opt, dcp_fmt.partial_path(run, step), no_dist=True)
        DcpBackend(st).capture(step, TrainingState(model=model, optimizer=opt, config={"toy": True}),
                               Progress(step=step), None)()


def test_inspect_a_dcp_generation_from_a_folder_store(tmp_path, capsys):
    _dcp_of_toy(tmp_path / "run", 4)
    url = f"file://{tmp_path / 'store'}"
    assert cli_main(["mirror", "push", str(tmp_path / "run"), "--mirror", url]) == 0
    shutil.rmtree(tmp_path / "run")
    capsys.readouterr()
    assert cli_main(["inspect", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "dcp" and doc["dcp"]["valid"] and doc["store"]["step"] == 4


def _four_rank_dcp(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A real FSDP2 .dcp generation written by 4 torchrun ranks (gloo on CPU): step 2, and its files' sha256."""
    run = tmp_path / "ranks"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--",
                          str(LOOP), "--run", str(run), "--steps", "2", "--every", "2", "--sync"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    folder = run / "step_000002.dcp"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "ripresa.json"]
    return run, {n: sha(folder / n) for n in names}


def _pulled_whole(blank: Path, shas: dict[str, str]) -> None:
    from ripresa.formats import dcp as dcp_fmt

    gen = dcp_fmt.check_dcp(blank, 2, deep=True)
    assert gen.valid and gen.world_size == 4, gen.reason
    assert {n: sha(blank / "step_000002.dcp" / n) for n in shas} == shas  # every rank's files, bitwise


@pytest.mark.slow
def test_mirror_pull_lands_a_dcp_of_4_ranks_from_a_folder_store_and_from_s3(tmp_path, s3, capsys):
    """A generation written by 4 ranks, only in the store (the run folder removed, as on a multi-node run whose
    nodes each kept their own shards): `mirror pull` lands every rank's files verified, `inspect URL` reads it."""
    run, shas = _four_rank_dcp(tmp_path)
    folder_url = f"file://{tmp_path / 'store'}"
    for url in (folder_url, s3.url):
        assert cli_main(["mirror", "push", str(run), "--mirror", url]) == 0
    assert {f"step_000002.dcp/{n}" for n in shas} <= set(s3.keys())
    shutil.rmtree(run)
    for i, url in enumerate((folder_url, s3.url)):
        blank = tmp_path / f"blank{i}"
        assert cli_main(["mirror", "pull", str(blank), "--mirror", url]) == 0
        _pulled_whole(blank, shas)
        capsys.readouterr()
        assert cli_main(["inspect", url, "--json"]) == 0
        cap = capsys.readouterr()
        doc = json.loads(cap.out)
        assert doc["kind"] == "dcp" and doc["dcp"]["world_size"] == 4 and doc["exit_code"] == 0
        assert doc["store"] == {**doc["store"], "url": url, "step": 2}
        assert doc["store"]["bytes"] >= sum((tmp_path / "blank0" / "step_000002.dcp" / n).stat().st_size for n in shas)
        assert LINE.match(cap.err.strip().splitlines()[-1]).group(3) == url


@pytest.mark.slow
def test_a_rank_s_shard_changed_in_s3_is_refused_by_inspect_and_pull(tmp_path, s3, capsys):
    run, _ = _four_rank_dcp(tmp_path)
    assert cli_main(["mirror", "push", str(run), "--mirror", s3.url]) == 0
    raw = bytearray(s3.get("step_000002.dcp/__3_0.distcp"))
    raw[len(raw) // 2] ^= 1
    s3.put("step_000002.dcp/__3_0.distcp", bytes(raw))  # rank 3's node wrote (or the store holds) other bytes
    assert cli_main(["inspect", s3.url]) == 1
    assert cli_main(["mirror", "pull", str(tmp_path / "blank"), "--mirror", s3.url]) == 1
    err = capsys.readouterr().err
    assert "__3_0.distcp" in err and "differs from its marker" in err and "Traceback" not in err
    assert not (tmp_path / "blank" / "step_000002.dcp").exists()


@pytest.mark.slow
def test_export_from_s3_in_a_fresh_process(store, tmp_path, s3, private_tmp):
    """`ripresa export s3://...` as a program: the line, a verified bundle naming the store, no folder left."""
    for p in sorted(store.rglob("*")):
        if p.is_file() and p.name not in ("LOCK", "RIPRESA_MIRROR"):
            s3.put(str(p.relative_to(store)), p.read_bytes())
    env = {**os.environ, "TMPDIR": str(private_tmp)}
    res = subprocess.run([sys.executable, "-m", "ripresa", "export", s3.url, "--to", str(tmp_path / "bundle")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = LINE.match(res.stdout.splitlines()[0])
    assert m and m.group(2) == "6" and m.group(3) == s3.url
    assert json.loads((tmp_path / "bundle" / "export.json").read_text())["source_run"] == s3.url


@pytest.mark.slow
def test_convert_and_export_a_bin_generation_of_ripresa_train_from_a_store(tmp_path, capsys):
    """The bundled trainer's .bin generations, only in a folder store: `convert URL --step 2` and `export URL`
    (reloaded through the model factory, forward pass) work on the pulled generation and name the store."""
    url = f"file://{tmp_path / 'store'}"
    res = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(tmp_path / "run"), "--config", "tiny",
                          "--steps", "4", "--every", "2", "--quiet", "--threads", "1", "--no-audit", "--mirror", url],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    shutil.rmtree(tmp_path / "run")
    assert cli_main(["convert", url, str(tmp_path / "w.safetensors"), "--step", "2", "--json"]) == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert r["step"] == 2 and r["source"] == f"{url}/step_000002.bin" and r["verified"]
    assert LINE.match(cap.err.strip().splitlines()[-1]).group(1) == "converting"
    assert cli_main(["export", url, "--to", str(tmp_path / "bundle"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["step"] == 4 and r["run"] == url and r["store"]["step"] == 4
    assert r["verification"]["reload"]["forward"] == "ok"
    assert json.loads((tmp_path / "bundle" / "export.json").read_text())["source_run"] == url
