"""Hostile inputs, round three (docs/FAULTS.md, "Many pieces, one budget", "Shapes", "Numbers read from files";
docs/MIRROR.md, "A pull lands only what it verified").

Each class is a real folder crafted on disk the way an attacker without the run key can (every hash
recomputed), read through the real ``ripresa`` command in a subprocess and through a resume:

1. many bounded pieces: one shard file hard-linked under K shard names (each header under its bound,
   the sum K times it) and K distinct copies of a large header (the budget across pieces);
2. a zero-byte tensor of astronomic dimensions (``[0, 2**64]``) in a safetensors header: inspect,
   export, convert, a resume, and ``mirror pull`` from a local-path mirror (nothing unverified lands);
3. numbers beyond any range in run-folder files (retention metrics, config.json, a history line).

Every case must end in exit 1 or 2 with one typed paragraph (no "bug" report, no traceback).
The RSS-heavy variants are ``slow``; the default tier keeps one cheap sample per class.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ripresa

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers


def _state(seed: int = 0) -> ripresa.TrainingState:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    return ripresa.TrainingState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _run(folder: Path, steps: int = 2, **opts) -> None:
    state = _state()
    with ripresa.Checkpointer(folder, state, every=1, asynchronous=False, handle_signals=False, **opts) as ck:
        for s in range(ck.resume() + 1, steps + 1):
            state.optimizer.zero_grad()
            state.model(torch.ones(2, 4)).sum().backward()
            state.optimizer.step()
            ck.step_done(s)


def _cli(*args: str, cwd: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RIPRESA_DEBUG"}
    return subprocess.run([sys.executable, "-m", "ripresa", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**env, "COLUMNS": "200"})


def _main(*args: str) -> int:
    """A set-up step through the CLI's entry point in this process (no interpreter start)."""
    from ripresa.cli import main

    return main(list(args))


def _typed(p: subprocess.CompletedProcess, codes=(1, 2)) -> str:
    """Exit 1 or 2, one typed error paragraph: no traceback, no last-resort "bug" report."""
    out = p.stdout + p.stderr
    assert p.returncode in codes, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "unexpected" not in out.lower() and "a bug" not in out.lower(), out[-3000:]
    assert "error:" in out or "problem:" in out, out[-3000:]  # a command's error, or inspect's verdict
    return out


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _reseal(folder: Path, marker: Path) -> None:
    """Rewrite every line of a commit marker with the sha256 of the file it names (as an attacker can)."""
    lines = []
    for line in marker.read_text().splitlines():
        _, name = line.split("  ", 1)
        lines.append(f"{_sha(folder / name)}  {name}")
    marker.write_text("\n".join(lines) + "\n")


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(path: Path, head: dict, data: bytes) -> None:
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % 8)
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(struct.pack("<Q", len(text)) + text + data)
    os.replace(tmp, path)  # a new inode: hard links elsewhere keep the old file


def _zero_byte_huge_shape(folder: Path, step: int, shape=(0, 2**64)) -> None:
    """Add to general generation ``step`` a tensor of ``shape`` with zero bytes; companion and marker resealed."""
    st = folder / f"step_{step:06d}.safetensors"
    head, data = _header(st)
    head["evil"] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(data), len(data)]}
    _write_st(st, head, data)
    comp = folder / f"step_{step:06d}.safetensors.json"
    doc = json.loads(comp.read_text())
    doc["tensors"].update(sha256=_sha(st), size=st.stat().st_size, count=doc["tensors"]["count"] + 1)
    comp.write_text(json.dumps(doc, separators=(",", ":")))
    _reseal(folder, folder / f"step_{step:06d}.safetensors.sha256")


def _pieces(folder: Path, step: int, k: int, pad: int, *, hard_links: bool) -> None:
    """Turn the one-shard generation ``step`` into ``k`` shards that are all one file (hard links) or ``k`` copies
    of it, its ``__metadata__`` padded by ``pad`` bytes; companion, index and marker made to agree."""
    d = folder / f"step_{step:06d}.shards"
    one = d / "model-00001-of-00001.safetensors"
    head, data = _header(one)
    head["__metadata__"]["pad"] = "x" * pad
    _write_st(one, head, data)
    names = [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    first = d / names[0]
    os.rename(one, first)
    for n in names[1:]:
        if hard_links:
            os.link(first, d / n)
        else:
            (d / n).write_bytes(first.read_bytes())
    comp = d / "companion.json"
    doc = json.loads(comp.read_text())
    count = len([key for key in head if key != "__metadata__"])
    doc["tensors"]["shards"] = [{"name": n, "sha256": _sha(first), "size": first.stat().st_size, "count": count}
                                for n in names]
    doc["tensors"]["count"] = count * k
    comp.write_text(json.dumps(doc, separators=(",", ":")))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] = len(data) * k
    index["weight_map"] = {key: names[-1] for key in head if key != "__metadata__"}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    marker = folder / f"step_{step:06d}.shards.sha256"
    marker.write_text("".join(f"{_sha(d / n)}  {d.name}/{n}\n"
                              for n in sorted(["companion.json", "model.safetensors.index.json", *names])))


def _peak_rss_mb(args: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    """Peak RSS (MB) of ``ripresa ARGS`` run alone in a fresh interpreter (RUSAGE_CHILDREN of a parent that
    runs nothing else, as tests/test_memory_bounds.py measures it)."""
    probe = textwrap.dedent(f"""
        import resource, subprocess, sys
        p = subprocess.run([sys.executable, "-m", "ripresa", *{args!r}], capture_output=True, text=True)
        sys.stdout.write(p.stdout); sys.stderr.write(p.stderr)
        print("RC", p.returncode)
        print("PEAK_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, timeout=600)
    peak = int(re.search(r"PEAK_KB (\d+)", out.stdout).group(1)) / 1024
    rc = int(re.search(r"RC (-?\d+)", out.stdout).group(1))
    return peak, subprocess.CompletedProcess(args, rc, out.stdout, out.stderr)


assert resource  # used by the probe's child


# ------------------------------------------------------------------- 1. many bounded pieces, one budget


def test_hard_linked_shards_are_refused_by_inspect_and_a_resume_falls_back(tmp_path):
    """Three shard names of one file (each header bounded, their sum three times it): `inspect` of the
    generation is exit 1 naming the inode rule, and a resume takes the previous generation."""
    run = tmp_path / "run"
    _run(run, 2, shard_threshold=0, shards=1)
    _pieces(run, 2, 3, 1 << 16, hard_links=True)
    out = _typed(_cli("inspect", str(run / "step_000002.shards")), codes=(1,))
    assert "two names of one file" in out
    state = _state(seed=5)
    with pytest.warns(Warning, match="two names of one file"), ripresa.Checkpointer(
            run, state, handle_signals=False, save_on_close=False) as ck:
        assert ck.resume() == 1


def test_shard_headers_share_one_budget(tmp_path, monkeypatch):
    """Distinct copies (no hard link) whose headers together pass the generation's budget: refused with
    the budget named (the budget lowered here so that the sample is cheap; the slow test uses the real one)."""
    from ripresa.store import shards as shards_store

    run = tmp_path / "run"
    _run(run, 2, shard_threshold=0, shards=1)
    _pieces(run, 2, 4, 1 << 16, hard_links=False)
    assert shards_store.validate_shards(run, 2).generation.valid  # within the real budget: a valid generation
    monkeypatch.setattr(shards_store, "MAX_HEADERS_TOTAL", 3 << 16)
    gen = shards_store.validate_shards(run, 2).generation
    assert not gen.valid and "exceed their budget" in gen.reason


#: Peak RSS allowed: the interpreter with torch (~250 MB) and one header at its bound being parsed (its bytes,
#: text and parsed metadata, ~4 × 61 MB), not K of them (unbounded before: ~2.3 GB for 38 links).
BOUND_MB = 800


@pytest.mark.slow
@pytest.mark.parametrize("hard_links", [True, False], ids=["hard-links", "copies"])
def test_many_large_shard_headers_keep_inspect_and_resume_memory_bounded(tmp_path, hard_links):
    """The attack of issue 29: 38 shard names of one 61 MB-header file (~2.3 GB peak before), and 6 distinct
    copies of it (3 × the budget): `inspect` and a resume refuse with a typed error under BOUND_MB."""
    run = tmp_path / "run"
    _run(run, 2, shard_threshold=0, shards=1)
    k = 38 if hard_links else 6
    _pieces(run, 2, k, 61 << 20, hard_links=hard_links)
    peak, p = _peak_rss_mb(["inspect", str(run / "step_000002.shards")], tmp_path)
    out = " ".join(_typed(p, codes=(1,)).split())
    assert ("two names of one file" if hard_links else "exceed their budget") in out
    assert peak < BOUND_MB, f"inspect peak RSS {peak:.0f} MB"
    code = textwrap.dedent(f"""
        import sys, warnings, torch, ripresa
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_hostile_round3_formats import _state
        warnings.simplefilter("ignore")
        with ripresa.Checkpointer({str(run)!r}, _state(5), handle_signals=False, save_on_close=False) as ck:
            print("RESUMED", ck.resume())
    """)
    probe = textwrap.dedent(f"""
        import resource, subprocess, sys
        p = subprocess.run([sys.executable, "-c", {code!r}], capture_output=True, text=True)
        sys.stdout.write(p.stdout); sys.stderr.write(p.stderr)
        print("PEAK_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert "RESUMED 1" in r.stdout, r.stdout + r.stderr
    assert int(re.search(r"PEAK_KB (\d+)", r.stdout).group(1)) / 1024 < BOUND_MB


def test_hard_linked_dcp_files_are_refused(tmp_path):
    """The inode rule for a .dcp generation's per-rank files: two names of one file are refused before any
    file is read (the check is `folder files`)."""
    from ripresa.formats.dcp import check_dcp

    d = tmp_path / "step_000001.dcp"
    d.mkdir()
    for name in ("__0_0.distcp", ".metadata", "ripresa.json"):
        (d / name).write_bytes(name.encode())
    (d / "__0_0.distcp").unlink()
    os.link(d / ".metadata", d / "__0_0.distcp")
    (tmp_path / "step_000001.dcp.sha256").write_text(
        "".join(f"{_sha(d / n)}  {d.name}/{n}\n" for n in sorted(os.listdir(d))))
    gen = check_dcp(tmp_path, 1)
    assert not gen.valid and "two names of one file" in gen.reason


def test_a_mirror_listing_has_a_total_budget(tmp_path, monkeypatch):
    """A local-path mirror whose folders hold more entries than the listing's total budget (junk names the
    listing skips count too): a typed error, not an unbounded walk."""
    from ripresa.io import folderstore
    from ripresa.io.objstore import open_store

    run = tmp_path / "run"
    _run(run, 1)
    assert _main("mirror", "push", str(run), "--mirror", str(tmp_path / "m")) == 0
    for i in range(40):
        (tmp_path / "m" / f"junk {i}").write_bytes(b"")
    monkeypatch.setattr(folderstore, "MAX_LISTED", 30)
    with pytest.raises(ripresa.errors.IntegrityError, match="exceed their budget"):
        open_store(str(tmp_path / "m")).list()


# ------------------------------------------------------------------ 2. zero-byte shapes beyond any size


def test_zero_byte_huge_shape_is_a_typed_error_in_inspect_convert_and_resume(tmp_path):
    run = tmp_path / "run"
    _run(run, 2, format="general")
    _zero_byte_huge_shape(run, 2)
    gen = run / "step_000002.safetensors"
    out = _typed(_cli("inspect", str(gen)), codes=(1,))
    assert "beyond any size" in out
    out = _typed(_cli("convert", str(gen), str(tmp_path / "w.safetensors")))
    assert "beyond any size" in out
    assert not (tmp_path / "w.safetensors").exists()
    state = _state(seed=5)
    with pytest.warns(Warning, match="beyond any size"), ripresa.Checkpointer(
            run, state, handle_signals=False, save_on_close=False) as ck:
        assert ck.resume() == 1


@pytest.mark.slow
@pytest.mark.parametrize("shape", [[0, 2**64], [7, 0, 2**62], [0] + [2**16] * 4], ids=["2^64", "2^62", "2^64-5d"])
def test_zero_byte_huge_shapes_in_export_and_the_newest_generation(tmp_path, shape):
    """`export` of the crafted generation (exit 1 or 2, typed) and `export` of the run (the previous one),
    `inspect --deep` of the run (the crafted one listed invalid), for several shapes."""
    run = tmp_path / "run"
    _run(run, 2, format="general")
    _zero_byte_huge_shape(run, 2, shape)
    out = _typed(_cli("export", str(run), "--step", "2", "--to", str(tmp_path / "bundle")))
    assert "beyond any size" in out
    p = _cli("export", str(run), "--to", str(tmp_path / "bundle1"))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    p = _cli("inspect", str(run), "--deep")
    assert "beyond any size" in p.stdout + p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("shape", [[0, 2**64], [2**40, 0, 2**40], [0] + [2**20] * 4], ids=["2^64", "2^80", "2^80-5d"])
def test_the_shape_bound_is_one_check_for_every_shape_source(tmp_path, shape):
    """The same bound refuses the shape in a safetensors header and in a companion's tagged tensor
    (formats/companion.check_shape), in a .dcp .metadata entry, and refuses a DCP chunk outside its tensor."""
    from ripresa.errors import IntegrityError
    from ripresa.formats import companion, safetensors_file

    p = tmp_path / "w.safetensors"
    _write_st(p, {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}, b"")
    with pytest.raises(IntegrityError, match="beyond any size"):
        safetensors_file.read(p)
    with pytest.raises(IntegrityError, match="beyond any size"):
        companion.decode_tensor({"__tensor__": "float32", "shape": shape, "data": []})
    companion.check_shape([0, 2**40], "ok")  # a zero-element shape within the bound stays valid
    # a .dcp .metadata entry (the same check), and a chunk that lies outside its tensor
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ripresa.formats.dcp_safe import check_metadata

    props = TensorProperties(dtype=torch.float32)
    size = torch.Size(shape if max(shape) < 2**63 else [0, 2**62])
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, size, [])}, storage_data={})
    with pytest.raises(IntegrityError, match="beyond any size"):
        check_metadata(md, tmp_path)
    chunk = ChunkStorageMetadata(torch.Size([0, 4]), torch.Size([2, 2]))
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, torch.Size([2, 4]), [chunk])},
                  storage_data={})
    with pytest.raises(IntegrityError, match="outside its tensor"):
        check_metadata(md, tmp_path)


def test_mirror_pull_lands_nothing_it_did_not_verify(tmp_path):
    """A blank machine's `mirror pull` from a local-path mirror whose newest generation holds a zero-byte
    huge shape: that generation is not left in the new run folder; the older one lands, verified."""
    run, mirror, new = tmp_path / "run", tmp_path / "mirror", tmp_path / "new"
    _run(run, 2, format="general")
    assert _main("mirror", "push", str(run), "--mirror", str(mirror)) == 0
    _zero_byte_huge_shape(mirror, 2)  # the mirror's objects have the run folder's names
    p = _cli("mirror", "pull", str(new), "--mirror", str(mirror))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    left = sorted(os.listdir(new))
    assert not [n for n in left if n.startswith("step_000002")], left
    assert "step_000001.safetensors.sha256" in left
    assert not [n for n in left if "partial" in n], left


@pytest.mark.slow
def test_mirror_pull_of_only_unverifiable_generations_is_exit_1_and_leaves_none(tmp_path):
    run, mirror, new = tmp_path / "run", tmp_path / "mirror", tmp_path / "new"
    _run(run, 2, format="general")
    assert _main("mirror", "push", str(run), "--mirror", str(mirror)) == 0
    _zero_byte_huge_shape(mirror, 2)
    _zero_byte_huge_shape(mirror, 1, (3, 0, 2**60))
    out = _typed(_cli("mirror", "pull", str(new), "--mirror", str(mirror)), codes=(1,))
    assert "beyond any size" in out
    assert not [n for n in os.listdir(new) if n.startswith("step_") or "partial" in n], os.listdir(new)
    # and a resume that pulls (train --run on a blank machine) neither lands nor trains over them
    p = _cli("train", "--run", str(tmp_path / "blank"), "--mirror", str(mirror), "--steps", "3", "--quiet")
    _typed(p)
    assert not [n for n in os.listdir(tmp_path / "blank") if n.startswith("step_")] \
        if (tmp_path / "blank").exists() else True


# ------------------------------------------------------------------------ 3. numbers in run-folder files


@pytest.mark.parametrize("value", ["1" + "0" * 400, "-" + "9" * 4000], ids=["10^400", "-10^4000"])
def test_a_number_beyond_range_in_the_retention_metrics_is_a_typed_error(tmp_path, value):
    """`retention_metrics.json` with 10**400 or -10**4000 (an OverflowError before) as a metric: the typed
    error of that file (BadInput, exit 2), through a resume with a metric retention policy."""
    from ripresa.store.retention import KeepBest

    run = tmp_path / "run"
    _run(run, 1)
    (run / "retention_metrics.json").write_text(
        '{"schema": "ripresa.retention_metrics/1", "steps": {"1": {"val_loss": ' + value + "}}}")
    with pytest.raises(ripresa.errors.BadInput, match="retention") as ei, ripresa.Checkpointer(
            run, _state(), handle_signals=False, save_on_close=False, retention=KeepBest("val_loss")) as ck:
        ck.resume()
    assert ei.value.exit_code == 2 and ei.value.file == str(run / "retention_metrics.json")


@pytest.mark.slow
@pytest.mark.parametrize("field,value", [
    ("lr", "1" + "0" * 400),
    ("weight_decay", "Infinity"), ("max_steps", "1" + "0" * 30)])
def test_a_number_beyond_range_in_config_json_is_a_typed_error(tmp_path, field, value):
    run = tmp_path / "run"
    p = _cli("train", "--run", str(run), "--config", "tiny", "--steps", "1", "--quiet")
    assert p.returncode == 0, p.stdout + p.stderr
    cfg = (run / "config.json").read_text()
    cfg = re.sub(rf'"{field}": [^,\n}}]+', f'"{field}": {value}', cfg, count=1)
    (run / "config.json").write_text(cfg)
    for name in os.listdir(run):
        if name == "config.json.hmac":
            os.unlink(run / name)
    out = _typed(_cli("train", "--run", str(run), "--steps", "2", "--quiet"), codes=(2,))
    assert f"train.{field}" in out


def test_a_huge_number_in_a_history_line_is_not_a_crash(tmp_path):
    """`.loss.jsonl` with a loss of 10**400 (float() of it: OverflowError): `inspect RUN` still reports."""
    from ripresa.engine.run_history import _as_float

    assert _as_float(10**400) != _as_float(10**400)  # NaN: a gap in the curve, never an OverflowError
    assert _as_float(1.5) == 1.5


def test_an_s3_listing_of_endless_pages_has_a_total_budget(monkeypatch):
    """A store that answers every listing page with nothing but "more to come" (or junk keys the listing
    skips): the pages together are bounded, a typed error instead of an endless walk; a listed size out of
    range is the checked conversion's typed error."""
    from ripresa.io import s3store

    calls = []

    class Endless:
        def __init__(self, contents):
            self.contents = contents

        def list_objects_v2(self, **kw):
            calls.append(kw)
            if len(calls) > 10_000:
                raise AssertionError("the listing never ends")
            return {"Contents": self.contents, "IsTruncated": True, "NextContinuationToken": f"t{len(calls)}"}

    store = s3store.S3Store.__new__(s3store.S3Store)
    store.bucket, store.prefix, store.url = "b", "p/", "s3://b/p"
    monkeypatch.setattr(s3store, "MAX_LISTED", 50)
    for contents in ([], [{"Key": "p/../junk", "Size": 1}] * 7):
        calls.clear()
        store.client = Endless(contents)
        with pytest.raises(ripresa.errors.IntegrityError, match="exceed their budget"):
            store.list()
        assert len(calls) <= 51
    store.client = Endless([{"Key": "p/config.json", "Size": -1}])
    with pytest.raises(ripresa.errors.IntegrityError, match="listing: Size"):
        store.list()


def test_the_step_lines_a_history_view_keeps_share_one_budget(tmp_path, monkeypatch):
    """`read_history` keeps one reduced record per step: each line is bounded, their sum is too."""
    from ripresa.store import history

    h = tmp_path / ".loss.jsonl"
    h.write_text("".join(json.dumps({"step": s, "loss": 1.0, **{f"m{i}": i for i in range(8)}}) + "\n"
                         for s in range(1, 200)))
    assert len(history.read_history(h).steps) == 199
    monkeypatch.setattr(history, "MAX_KEPT_FIELDS", 500)
    with pytest.raises(ripresa.errors.IntegrityError, match="exceed their budget"):
        history.read_history(h)
