"""One validation path (issue #10, classes 5 and 6): what `ripresa inspect --deep` calls valid, a resume
accepts; what it refuses, a resume refuses with a typed error (or skips for an older generation). Bounds are
checked before anything is allocated, and no traceback reaches a user.

Every hostile companion here is *hash-consistent*: its commit marker is recomputed, so only the structural
validation (ripresa.core.state.validate_saved_state, shared by store.check(deep=True), store.load and inspect)
stands between it and a resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import resource
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import pytest
import torch

import ripresa
from ripresa.cli import main as cli_main
from ripresa.errors import BadInput, IntegrityError, RipresaError
from ripresa.formats.bin_state import bin_arrays, companion_snapshot
from ripresa.store.retention import KeepLast
from ripresa.store.store import CheckpointStore


def _toy(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    gen = np.random.Generator(np.random.PCG64(seed))
    sampler = ripresa.EpochSampler(20, 4, generator=gen)
    return ripresa.TrainingState(model=model, optimizer=opt, scheduler=sched, data=sampler,
                                 rng=ripresa.RandomStreams(numpy={"g": gen}), config={"toy": True})


def _train(state, progress, n):
    for _ in range(n):
        ids = state.data.next_batch()
        state.optimizer.zero_grad()
        x = torch.arange(len(ids) * 4, dtype=torch.float32).reshape(-1, 4) / 10 + torch.randn(len(ids), 4)
        state.model(x).square().mean().backward()
        state.optimizer.step()
        state.scheduler.step()
        progress.step += 1


def make_run(folder, steps=(3, 6)):
    st, progress = _toy(), ripresa.Progress()
    with CheckpointStore(folder, retention=KeepLast(10)) as store:
        for s in steps:
            _train(st, progress, s - progress.step)
            # an int64 tensor for the tensor-* cases (the data position no longer holds one: docs/FORMAT.md)
            store.save(progress.step, bin_arrays(st), companion_snapshot(st, progress, extra={"ids": torch.arange(20)}))
    return folder


def tamper(folder, step, mutate):
    """Edit generation ``step``'s encoded companion state, then recompute its commit marker (plain sha256)."""
    comp = folder / f"step_{step:06d}.json"
    doc = json.loads(comp.read_bytes())
    mutate(doc["state"])
    raw = json.dumps(doc, separators=(",", ":")).encode()
    comp.write_bytes(raw)
    marker = folder / f"step_{step:06d}.bin.sha256"
    lines = marker.read_text().splitlines()
    bin_line = next(line for line in lines if line.endswith(".bin"))
    marker.write_text(f"{bin_line}\n{hashlib.sha256(raw).hexdigest()}  {comp.name}\n")


def run_cli(*args):
    """`ripresa ARGS` through the real entry point, in process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def resume(folder):
    """A Checkpointer's automatic resume into fresh objects: (step, the warnings it gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ripresa.Checkpointer(folder, _toy(seed=99), handle_signals=False, asynchronous=False) as ck:
            step = ck.resume()
    return step, [str(w.message) for w in caught]


def _perm(s):
    return s["extra"]["ids"]


def _set(path, value):
    def mutate(s):
        node = s
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return mutate


def _pairs(node):
    assert [k for k, _ in node["__dict__"]] == ["__ndarray__", "data"]
    return node["__dict__"]


def _nest(depth):
    v = 0
    for _ in range(depth):
        v = [v]
    return v


HOSTILE = {
    # tagged tensors
    "tensor-wrong-count": _set(["extra", "ids", "shape"], [21]),
    "tensor-unknown-dtype": _set(["extra", "ids", "__tensor__"], "complex128"),
    "tensor-negative-shape": _set(["extra", "ids", "shape"], [-20]),
    "tensor-huge-shape": _set(["extra", "ids", "shape"], [2**40, 2**40]),
    "tensor-zero-huge-shape": lambda s: _perm(s).update(shape=[0, 2**62], data=[]),
    "tensor-bad-elements": _set(["extra", "ids", "data"], lambda d: ["x"] * len(d)),
    "tensor-int-overflow": _set(["extra", "ids", "data"], lambda d: [2**70] * len(d)),
    "tensor-malformed-dict": _set(["optimizer", "state"], {"__dict__": [[0]]}),
    # random streams
    "rng-short-torch-state": _set(["rng", "torch_cpu"], {"__tensor__": "uint8", "shape": [100], "data": [0] * 100}),
    "rng-torch-state-wrong-dtype": _set(["rng", "torch_cpu", "__tensor__"], "int64"),
    # (an array inside a numpy state is a {"__ndarray__", "data"} dict, encoded as {"__dict__": [[k, v], ...]})
    "rng-mt-key-length": lambda s: _pairs(s["rng"]["numpy_legacy"]["state"]["key"])[1].__setitem__(
        1, _pairs(s["rng"]["numpy_legacy"]["state"]["key"])[1][1][:600]),
    "rng-mt-key-dtype": lambda s: _pairs(s["rng"]["numpy_legacy"]["state"]["key"])[0].__setitem__(1, "object"),
    "rng-numpy-wrong-type": _set(["rng", "numpy", "g", "state", "state"], "not an int"),
    "rng-numpy-unknown-bitgen": _set(["rng", "numpy", "g", "bit_generator"], "os.system"),
    "rng-python-short": _set(["rng", "python", "state"], lambda d: d[:10]),
    "rng-python-wrong-type": _set(["rng", "python", "gauss_next"], "x"),
    "rng-missing": lambda s: s["rng"].pop("torch_cpu"),
    # progress, data position, optimizer
    "progress-string": _set(["progress", "step"], "6"),
    "progress-overflow": _set(["progress", "samples_seen"], 2**70),
    "progress-not-dict": _set(["progress"], [6]),
    "data-cursor-out-of-range": _set(["data", "cursor"], 10**30),
    "data-cursor-type": _set(["data", "cursor"], "4"),
    "optimizer-step-shape": lambda s: s["optimizer"]["state"]["__dict__"][0][1].update(
        step={"__tensor__": "float32", "shape": [2], "data": [6.0, 6.0]}),
    "optimizer-groups-type": _set(["optimizer", "param_groups"], [5]),
    "deep-nesting": _set(["extra"], {"x": _nest(300)}),
}
SAMPLED = ("tensor-wrong-count", "rng-short-torch-state", "progress-string")


def _cases(sampled_only):
    for name in HOSTILE:
        marks = () if name in SAMPLED else (pytest.mark.slow,)
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_cases(False)))
def test_hostile_companion_is_refused_by_inspect_and_by_resume(tmp_path, name):
    """inspect --deep exits 1 (no traceback), store.load raises IntegrityError, and a resume falls back to the
    older valid generation; with no older one, the resume refuses with a typed error."""
    run = make_run(tmp_path / "run", steps=(3, 6))
    tamper(run, 6, HOSTILE[name])

    # the store's deep check and load agree: both refuse
    reader = CheckpointStore(run, writer=False)
    assert not reader.check(6, deep=True).valid
    with pytest.raises(IntegrityError):
        reader.load(6)
    assert reader.check(6, deep=False).valid or name == "deep-nesting"  # a shallow check reads no state

    # resume skips it for generation 3, with a warning naming generation 6
    step, said = resume(run)
    assert step == 3
    assert any("6" in m and "not used" in m for m in said), said

    # alone in its folder: inspect --deep exits 1, --json too, and a resume refuses with a typed error
    solo = make_run(tmp_path / "solo", steps=(6,))
    tamper(solo, 6, HOSTILE[name])
    code, out, err = run_cli("inspect", solo)
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    code, out, _ = run_cli("inspect", solo, "--json")
    assert code == 1 and json.loads(out)["run"]["resume_step"] is None
    try:
        step, said = resume(solo)
    except RipresaError as exc:  # refused at load: a typed integrity error
        assert isinstance(exc, IntegrityError)
    else:  # refused by the shallow check: skipped like a damaged generation (nothing restored from it)
        assert step == 0 and any("not used" in m for m in said), said


def test_a_valid_run_passes_inspect_deep_and_resumes(tmp_path):
    """The validation does not refuse what ripresa writes (the negative control of the test above)."""
    run = make_run(tmp_path / "run", steps=(3, 6))
    code, out, err = run_cli("inspect", run)
    assert code == 0, (out, err)
    assert resume(run)[0] == 6


def test_a_loop_whose_step_numbers_are_not_optimizer_steps_still_resumes(tmp_path):
    """The store's validation is structural: a loop that numbers its steps its own way (here: two
    ``step_done`` per optimizer update, as with gradient accumulation counted per micro-batch) has
    per-parameter optimizer steps != progress.step, and its committed generations must still verify
    and resume — a generation its own writer committed is never refused for it (docs/FAULTS.md)."""
    st, progress = _toy(), ripresa.Progress()
    run = tmp_path / "run"
    with CheckpointStore(run, retention=KeepLast(10)) as store:
        _train(st, progress, 3)
        progress.step *= 2  # 6 "steps" for 3 optimizer updates
        store.save(progress.step, bin_arrays(st), companion_snapshot(st, progress))
        assert store.check(6, deep=True).valid
    code, out, err = run_cli("inspect", run)
    assert code == 0, (out, err)
    assert resume(run)[0] == 6


def test_a_run_whose_committed_generations_all_fail_is_refused_not_restarted(tmp_path):
    """Committed generations that all fail their checks are damage, not a new run: resume refuses
    (exit 1 from the CLI) instead of training again from step 0 over them; an uncommitted leftover
    alone (a kill during the first save) still starts a new run."""
    run = make_run(tmp_path / "run", steps=(3, 6))
    for step in (3, 6):  # the companions changed after their commit: each fails the shallow check
        comp = run / f"step_{step:06d}.json"
        comp.write_bytes(comp.read_bytes().replace(b'"step"', b'"stop"', 1))
    with pytest.raises(IntegrityError, match="none of the 2 committed generation"):
        resume(run)
    leftover = make_run(tmp_path / "leftover", steps=(3,))
    (leftover / "step_000003.bin.sha256").unlink()  # never committed
    assert resume(leftover)[0] == 0


def test_restore_refuses_a_scheduler_state_of_the_wrong_shape_with_a_typed_error(tmp_path):
    """What only the live objects can tell (a scheduler field of another type) is refused by restore with a
    SchemaError before any object changes — never a TypeError at the first step."""
    run = make_run(tmp_path / "run", steps=(3,))
    tamper(run, 3, _set(["scheduler", "step_size"], "three"))
    st = _toy(seed=99)
    before = [p.detach().clone() for p in st.model.parameters()]
    reader = CheckpointStore(run, writer=False)
    contents, comp = reader.load(3)
    from ripresa.formats.bin_state import join_state

    with pytest.raises(ripresa.errors.SchemaError, match="scheduler"):
        st.restore(join_state(st, contents, comp))
    assert all(torch.equal(a, b) for a, b in zip(before, st.model.parameters(), strict=True))


def test_cli_turns_an_unexpected_exception_into_one_paragraph_and_exit_2(tmp_path):
    """The last resort: a deeply nested config.json a command parses (RecursionError territory) never prints a
    traceback, whatever the command; RIPRESA_DEBUG=1 re-raises for developers."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    res = subprocess.run([sys.executable, "-m", "ripresa", "train", "--run", str(run), "--steps", "1", "--quiet",
                          "--no-audit"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "config" in res.stderr


def test_inspect_text_and_json_on_a_run_holding_dcp_generations(tmp_path):
    """`ripresa inspect` in text mode on a run with .dcp generations (was a KeyError in the renderer)."""
    from ripresa.formats import dcp as dcp_fmt
    from ripresa.store import dcp as store_dcp

    make_run(tmp_path, steps=(3,))
    for s in (4, 6):
        part = dcp_fmt.partial_path(tmp_path, s)
        dcp_fmt.save_shards(torch.nn.Linear(1, 3, bias=False), None, part, no_dist=True)  # a real tiny DCP save
        assert store_dcp.commit_dcp(tmp_path, s, part, world_size=1, n_params=3, state={"progress": {"step": s}}).valid
    shard = tmp_path / "step_000006.dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-5] + b"xxxxx")  # the newest is damaged (same size)
    code, out, err = run_cli("inspect", tmp_path)
    assert code == 0, (out, err)
    assert "dcp" in out and "INVALID" in out and "Traceback" not in out + err
    code, out, err = run_cli("inspect", tmp_path, "--no-deep")
    assert code == 0 and "dcp" in out, (out, err)
    code, out, err = run_cli("inspect", tmp_path, "--json")
    gens = json.loads(out)["run"]["generations"]
    assert [(g["step"], g["kind"]) for g in gens] == [(3, "bin"), (4, "dcp"), (6, "dcp")]
    assert [g["valid"] for g in gens] == [True, True, False]


# ------------------------------------------------------------------ checkpoint.pt zip directory


def _checkpoint(tmp_path):
    from ripresa.formats.torch_pt import save_checkpoint

    st, progress = _toy(), ripresa.Progress()
    _train(st, progress, 2)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, st.snapshot(progress))
    return path


def _rewrite(path, members):
    """Write ``members`` [(ZipInfo-like name, bytes, compress_type)] as the archive, and a matching sidecar."""
    with zipfile.ZipFile(path, "w") as z:
        for name, data, ctype in members:
            z.writestr(zipfile.ZipInfo(name), data, compress_type=ctype)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (path.parent / (path.name + ".sha256")).write_text(f"{digest}  {path.name}\n")


@pytest.mark.parametrize("fault", ["deflated", "outside", "two-folders"])
def test_checkpoint_pt_with_a_zip_torch_never_writes_is_refused_before_torch_load(tmp_path, fault):
    from ripresa.formats.torch_pt import load_checkpoint

    path = _checkpoint(tmp_path)
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i), zipfile.ZIP_STORED) for i in z.infolist()]
    if fault == "deflated":
        members = [(n, d, zipfile.ZIP_DEFLATED) for n, d, _ in members]
    elif fault == "outside":
        members[-1] = ("archive/../../etc/x", members[-1][1], zipfile.ZIP_STORED)
    else:
        members[-1] = ("other/" + members[-1][0].split("/", 1)[1], members[-1][1], zipfile.ZIP_STORED)
    _rewrite(path, members)
    with pytest.raises(IntegrityError, match="zip member"):
        load_checkpoint(path)
    code, out, err = run_cli("inspect", path)
    assert code == 1 and "Traceback" not in out + err


BOMB = r"""
import resource, sys, zipfile, hashlib
from pathlib import Path
p = Path(sys.argv[1])
from ripresa.formats.torch_pt import load_checkpoint
from ripresa.errors import IntegrityError
try:
    load_checkpoint(p)
except IntegrityError as exc:
    print("refused:", exc.message)
print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_zip_bomb_checkpoint_pt_is_refused_from_its_directory_without_inflating(tmp_path):
    """A ~1 MB checkpoint.pt whose deflated member declares 1 GiB: refused from the zip directory; the child
    that loads it never inflates it (its peak RSS stays far below the declared size)."""
    path = tmp_path / "checkpoint.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        info = zipfile.ZipInfo("archive/data.pkl")
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            block = bytes(1 << 24)
            for _ in range(64):  # 1 GiB of zeros, ~1 MB on disk
                f.write(block)
    assert path.stat().st_size < 8 << 20
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (tmp_path / "checkpoint.pt.sha256").write_text(f"{digest}  checkpoint.pt\n")
    res = subprocess.run([sys.executable, "-c", BOMB, str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "refused: checkpoint's zip member is compressed" in res.stdout
    maxrss_kib = int(res.stdout.split("maxrss_kib")[1])
    assert maxrss_kib < 900 * 1024  # torch imported (~0.3-0.5 GiB), nothing of the declared 1 GiB


# ------------------------------------------------------------------ model shapes from a config

HUGE = r"""
import json, resource, sys
from ripresa.errors import BadInput
from ripresa.engine.gpt.model import GPT, from_config_dict
try:
    GPT(from_config_dict(json.loads(sys.argv[1])))
except BadInput as exc:
    print("refused:", exc.message)
"""


@pytest.mark.parametrize("shape", [
    {"n_layer": 96, "n_head": 64, "n_embd": 16384, "block_size": 1024},  # ~310 G parameters (the count)
    pytest.param({"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 10**12}, marks=pytest.mark.slow),  # one range
    pytest.param({"n_layer": 10**9, "n_head": 2, "n_embd": 64, "block_size": 64}, marks=pytest.mark.slow),
])
def test_a_config_describing_a_huge_model_is_refused_before_allocation(shape):
    res = subprocess.run([sys.executable, "-c", HUGE, json.dumps(shape)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "refused:" in res.stdout
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak_kib < 2 * 1024 * 1024  # a refused model allocates nothing (torch imported: well under 2 GiB)


def test_model_for_generation_refuses_a_config_that_disagrees_with_the_weights():
    from ripresa.engine.gpt.config import model_for_generation
    from ripresa.engine.gpt.model import CONFIGS

    tiny = CONFIGS["tiny"].to_dict()
    assert model_for_generation(tiny, CONFIGS["tiny"].param_count()).n_embd == tiny["n_embd"]
    with pytest.raises(IntegrityError, match="parameter count"):
        model_for_generation(tiny, CONFIGS["tiny"].param_count() + 1)
    with pytest.raises(BadInput):
        model_for_generation({**tiny, "n_embd": 10**9}, 1)


def test_inspect_and_store_refuse_a_companion_nested_too_deeply_without_recursing(tmp_path):
    """A companion of 100 000 nested lists (hash-consistent) is refused as IntegrityError, never RecursionError."""
    run = make_run(tmp_path / "run", steps=(3,))
    comp = run / "step_000003.json"
    doc = json.loads(comp.read_bytes())
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw = raw[:-1] + b',"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    comp.write_bytes(raw)
    marker = run / "step_000003.bin.sha256"
    bin_line = marker.read_text().splitlines()[0]
    marker.write_text(f"{bin_line}\n{hashlib.sha256(raw).hexdigest()}  {comp.name}\n")
    reader = CheckpointStore(run, writer=False)
    assert not reader.check(3, deep=False).valid
    with pytest.raises(IntegrityError, match="nested"):
        reader.load(3)
    code, out, err = run_cli("inspect", run)
    assert code == 1 and "Traceback" not in out + err
    assert os.path.exists(comp)
