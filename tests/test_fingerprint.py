"""The state fingerprint (docs/INSPECT.md, "The state fingerprint"; docs/FORMAT.md, "The state fingerprint").

One state written in every layout — an ANDREA ``.bin``, a general ``.safetensors`` generation, ``.shards`` at
K = 2 and 3, a ``.dcp`` (in process; world sizes 1 and 2 under torchrun in the slow tier), a plain DCP folder
written by ``torch.distributed.checkpoint.save`` without ripresa, a Hugging Face ``checkpoint-N`` layout (a real
``transformers.Trainer`` in the slow tier) — has one fingerprint, equal to the live state's; one flipped bit
changes the root and names its part; hostile inputs are refused with exit 1 or 2 and nothing hangs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ripresa_cli

import ripresa
from ripresa.cli import main as cli_main
from ripresa.core.state import Progress
from ripresa.errors import BadInput, IntegrityError
from ripresa.formats import dcp as dcp_fmt
from ripresa.formats.fingerprint import fingerprint_snapshot, fingerprint_state, live_items
from ripresa.formats.fingerprint_read import fingerprint_path
from ripresa.formats.torch_pt import save_checkpoint
from ripresa.io import merkle
from ripresa.store import dcp as store_dcp
from ripresa.store.restore import rest_proxy

STEP = 3
#: The parts every layout of a training state holds (a plain DCP or Hugging Face folder holds no more).
TRAINED = ("model", "optimizer", "steps", "hyper")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Linear(48, 16),
                            torch.nn.LayerNorm(16))
    m.register_buffer("seen", torch.zeros((), dtype=torch.int64))
    return m


def _state() -> ripresa.TrainingState:
    m = _model()
    st = ripresa.TrainingState(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2), config={"toy": 1})
    g = torch.Generator().manual_seed(1)
    for _ in range(STEP):  # gradients drawn, not computed: the state is what matters, and it stays cheap
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        st.optimizer.step()
        m.seen += 1
    return st


def _names_in_optimizer_order(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in opt.param_groups for p in g["params"]]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    """The same state in every layout, and the live state's fingerprint."""
    root = tmp_path_factory.mktemp("fp")
    st = _state()
    out: dict = {"state": st, "root": root}
    for name, kw in [("general", dict(format="general")), ("andrea", dict(format="andrea")),
                     ("shards2", dict(shard_threshold=1, shards=2)), ("shards3", dict(shard_threshold=1, shards=3))]:
        with ripresa.Checkpointer(root / name, st, every=STEP, asynchronous=False, handle_signals=False,
                                  save_on_close=False, **kw) as ck:
            ck.step_done(STEP)
    out["general"] = root / "general" / "step_000003.safetensors"
    out["bin"] = root / "andrea" / "step_000003.bin"
    out["shards2"], out["shards3"] = (root / f"shards{k}" / "step_000003.shards" for k in (2, 3))
    assert len(list(out["shards3"].glob("model-*.safetensors"))) == 3
    d = root / "dcp"
    d.mkdir()
    part = dcp_fmt.partial_path(d, STEP)
    dcp_fmt.save_shards(st.model, st.optimizer, part, no_dist=True)
    rest = rest_proxy(st).snapshot(Progress(step=STEP), None, include_parameters=False)
    store_dcp.commit_dcp(d, STEP, part, world_size=1, n_params=sum(p.numel() for p in st.model.parameters()),
                         state=rest, hmac_key=None)
    out["dcp"] = d / "step_000003.dcp"
    out["live"] = fingerprint_snapshot(st.snapshot(Progress(step=STEP)))
    (root / "pt").mkdir()
    save_checkpoint(root / "pt" / "checkpoint.pt", st.snapshot(Progress(step=STEP)))
    out["pt"] = root / "pt" / "checkpoint.pt"
    return out


def test_every_ripresa_layout_has_the_live_states_fingerprint(layouts):
    """.bin (named from its companion), general, .shards K=2 and K=3, .dcp, checkpoint.pt: the live state's root."""
    live = layouts["live"]
    for key in ("general", "bin", "shards2", "shards3", "dcp", "pt"):
        f = fingerprint_path(layouts[key])
        assert f.root == live.root, (key, f.differences(live)[:5])
        assert f.parts == live.parts
    assert set(TRAINED) <= set(live.parts) and {"rng", "progress", "data"} <= set(live.parts)
    # the probe's cheap form: live tensors, no snapshot copy
    st = layouts["state"]
    mine = fingerprint_state(live_items(st.model, st.optimizer))
    assert all(mine.parts[p] == live.parts[p] for p in TRAINED)


def _counted(used: list[bool], found):
    used.append(found is not None)
    return found


def test_a_dcp_hashed_in_place_and_loaded_give_one_root(layouts, monkeypatch):
    """A .dcp's plain archives are hashed in place; the load path (any other archive) gives the same root."""
    from ripresa.formats import fingerprint_dcp

    used: list[bool] = []
    real = fingerprint_dcp.chunk_range
    monkeypatch.setattr(fingerprint_dcp, "chunk_range", lambda *a, **k: _counted(used, real(*a, **k)))
    assert fingerprint_path(layouts["dcp"]).root == layouts["live"].root and used and all(used)
    monkeypatch.setattr(fingerprint_dcp, "chunk_range", lambda *a, **k: None)
    assert fingerprint_path(layouts["dcp"]).root == layouts["live"].root


def test_an_item_is_hashed_in_place_only_when_it_is_the_plain_archive(tmp_path):
    """chunk_range: a torch.save of a contiguous tensor gives its values' bytes; a transposed view, another dtype,
    a pickle naming another global or a 2^32 memo index (11 bytes) give None (the item is then loaded)."""
    import io
    import zipfile

    from ripresa.formats.fingerprint_distcp import chunk_range

    def ranged(obj_or_raw, dtype=torch.float32, sizes=(3, 4)):
        p = tmp_path / "item"
        if isinstance(obj_or_raw, bytes):
            p.write_bytes(obj_or_raw)
        else:
            torch.save(obj_or_raw, p)
        fd = os.open(p, os.O_RDONLY)
        try:
            r = chunk_range(fd, 0, p.stat().st_size, str(p), dtype, sizes)
            return None if r is None else os.pread(fd, r.length, r.offset)
        finally:
            os.close(fd)

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert ranged(t) == t.numpy().tobytes()
    column_major = torch.arange(12, dtype=torch.float32).reshape(4, 3).t()  # (3, 4), strides (1, 3)
    assert column_major.shape == (3, 4) and ranged(column_major) is None
    assert ranged(t, dtype=torch.float64) is None and ranged(t, sizes=(4, 3)) is None
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02Nr" + (2**32 - 2).to_bytes(4, "little") + b".")
        zf.writestr("archive/byteorder", b"little")
    assert ranged(buf.getvalue()) is None
    assert ranged(_Payload(tmp_path / "ran")) is None and not (tmp_path / "ran").exists()


def test_a_plain_dcp_folder_and_a_hugging_face_layout_say_same_weights_and_moments(layouts, tmp_path):
    """Written without ripresa: DCP by name (get_state_dict) and by index, and model.safetensors + optimizer.pt of an
    optimizer with two groups in another order than the model's (named through param_names)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    live = layouts["live"]
    st = layouts["state"]
    msd, osd = get_state_dict(st.model, st.optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "by_name"), no_dist=True)
    f = fingerprint_path(tmp_path / "by_name")
    assert f.layout == "dcp" and all(f.parts[p] == live.parts[p] for p in TRAINED), f.differences(live)[:5]
    dcp.save({"model": st.model.state_dict(), "optimizer": st.optimizer.state_dict()},
             checkpoint_id=str(tmp_path / "by_index"), no_dist=True)
    names = _names_in_optimizer_order(st.model, st.optimizer)
    f = fingerprint_path(tmp_path / "by_index", param_names=names)
    assert all(f.parts[p] == live.parts[p] for p in TRAINED), f.differences(live)[:5]
    unnamed = fingerprint_path(tmp_path / "by_index")
    assert unnamed.parts["model"] == live.parts["model"] and unnamed.parts["optimizer"] != live.parts["optimizer"]
    assert any("position" in n for n in unnamed.notes) and "optimizer/@0/exp_avg" in unnamed.leaves

    # a Hugging Face checkpoint-N layout of the same weights, with an optimizer of two groups (no-decay first)
    m = _model()
    m.load_state_dict(st.model.state_dict())
    params = dict(m.named_parameters())
    small = [n for n, p in params.items() if p.dim() < 2]
    big = [n for n, p in params.items() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": [params[n] for n in small], "weight_decay": 0.0},
                             {"params": [params[n] for n in big], "weight_decay": 0.1}], lr=1e-2)
    by_name = dict(zip(_names_in_optimizer_order(st.model, st.optimizer),
                       st.optimizer.state_dict()["state"].values(), strict=True))
    opt.load_state_dict({"state": {i: by_name[n] for i, n in enumerate(small + big)},
                         "param_groups": [{**opt.state_dict()["param_groups"][0]},
                                          {**opt.state_dict()["param_groups"][1]}]})
    hf = tmp_path / "checkpoint-3"
    hf.mkdir()
    save_file(m.state_dict(), str(hf / "model.safetensors"), metadata={"format": "pt"})
    torch.save(opt.state_dict(), hf / "optimizer.pt")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": STEP}))
    f = fingerprint_path(hf, param_names=small + big)
    assert f.layout == "hf"
    assert all(f.parts[p] == live.parts[p] for p in ("model", "optimizer", "steps")), f.differences(live)[:5]
    assert f.parts["hyper"] != live.parts["hyper"]  # other groups: the hyper-parameters differ, and say so
    assert any("trainer_state.json" in n for n in f.notes)


def test_inspect_shows_the_fingerprint(layouts, capsys):
    """`ripresa inspect` of a valid generation: one line 'fingerprint: ROOT' and the JSON field."""
    from ripresa.tools.inspect import inspect_path

    assert inspect_path(layouts["shards3"])["fingerprint"]["root"] == layouts["live"].root
    assert inspect_path(layouts["shards3"], deep=False)["fingerprint"] is None
    assert cli_main(["inspect", str(layouts["bin"])]) == 0
    assert f"fingerprint: {layouts['live'].root}" in capsys.readouterr().out


def test_a_bin_without_companion_is_positional_unless_the_model_names_it(layouts, tmp_path):
    live = layouts["live"]
    bare = tmp_path / "step_000003.bin"
    shutil.copyfile(layouts["bin"], bare)
    f = fingerprint_path(bare)
    assert set(f.leaves) == {"model/@all", "optimizer/@all/exp_avg", "optimizer/@all/exp_avg_sq", "bin/step"}
    assert "positionally" in f.notes[0]
    named = fingerprint_path(bare, model=_model().to("meta"))
    assert named.parts["optimizer"] == live.parts["optimizer"]
    assert set(named.leaves) - set(live.leaves) == {"bin/step"}  # the buffer lives in the companion
    assert named.leaves["model/0.weight"] == live.leaves["model/0.weight"]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 1]))


def test_one_flipped_bit_changes_the_root_and_names_its_part(layouts, tmp_path, capsys):
    """A bit of m in a .bin copy: part optimizer, its leaf named; the CLI says 'different state' and exits 1
    (the CLI as a real process: the slow engine test)."""
    live = layouts["live"]
    src = layouts["bin"]
    for f in src.parent.glob("step_000003.*"):
        shutil.copyfile(f, tmp_path / f.name)
    n = (src.stat().st_size - 8) // 12
    _flip(tmp_path / src.name, 8 + 4 * n + 4 * 100)  # m[100]: the first Linear's weight
    f = fingerprint_path(tmp_path / src.name)
    assert f.root != live.root
    assert [p for p in f.parts if f.parts[p] != live.parts[p]] == ["optimizer"]
    assert f.differences(live) == ["optimizer/0.weight/exp_avg"]
    assert f.verdict(live).startswith("different state: part optimizer differs first (optimizer/0.weight/exp_avg)")
    assert fingerprint_path(layouts["dcp"]).verdict(live).startswith("same state (fingerprint")
    assert cli_main(["fingerprint", str(tmp_path / src.name), str(layouts["shards2"])]) == 1
    out = capsys.readouterr().out
    assert "different state" in out and "optimizer/0.weight/exp_avg" in out
    assert cli_main(["fingerprint", str(layouts["dcp"]), str(layouts["shards3"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["comparison"]["same_root"] and doc["fingerprints"][0]["root"] == live.root


def test_a_block_spanning_files_hashes_as_one_buffer(tmp_path):
    """The tree's blocks count from a leaf's first byte, whatever the segments (a tensor split over files)."""
    data = os.urandom(merkle.BLOCK + 12345)
    whole = merkle.Leaf("x", "uint8", (len(data),), [memoryview(data)])
    cut = [1000, merkle.BLOCK - 10, len(data)]
    fds = []
    segs: list[merkle.Segment] = []
    lo = 0
    for i, hi in enumerate(cut):
        p = tmp_path / f"piece{i}"
        p.write_bytes(b"pad" + data[lo:hi])
        fds.append(os.open(p, os.O_RDONLY))
        segs.append(merkle.FileRange(fds[-1], 3, hi - lo, str(p)))
        lo = hi
    try:
        split = merkle.Leaf("x", "uint8", (len(data),), segs)
        assert merkle.leaf_digests([whole], threads=1) == merkle.leaf_digests([split], threads=4)
        other = merkle.Leaf("x", "int8", (len(data),), [memoryview(data)])  # the same bytes, another dtype
        assert merkle.leaf_digests([other]) != merkle.leaf_digests([whole])
        os.truncate(tmp_path / "piece2", 10)  # a file that shrank after its check: a typed error, no hang
        with pytest.raises(IntegrityError, match="shorter"):
            merkle.leaf_digests([split])
    finally:
        for fd in fds:
            os.close(fd)


def test_logical_order_not_memory_order():
    """A transposed view hashes as its row-major values (what a save writes), never its storage order."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = t.t()
    assert fingerprint_state({"model/x": view}).root == fingerprint_state({"model/x": view.contiguous()}).root
    assert fingerprint_state({"model/x": view}).root != fingerprint_state({"model/x": t.reshape(4, 3)}).root
    with pytest.raises(IntegrityError, match="cannot be read"):
        fingerprint_state({"model/x": torch.eye(3).to_sparse()})


# ---- hostile inputs -----------------------------------------------------------------------------------


@pytest.fixture
def cli(capsys):
    """``ripresa fingerprint ARGS`` in this process (the CLI's one error path): (exit code, what it printed)."""
    def run(*args) -> tuple[int, str]:
        rc = cli_main(["fingerprint", *map(str, args)])
        out = capsys.readouterr()
        assert "Traceback" not in out.err, out.err[-2000:]
        return rc, out.out + out.err
    return run


def test_hostile_paths_are_refused_with_typed_errors(layouts, tmp_path, cli):
    link = tmp_path / "step_000003.bin"
    link.symlink_to(layouts["bin"])
    assert cli(link)[0] == 2
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    assert cli(fifo)[0] == 2
    # a FIFO in place of a shard: refused unread (never waited on)
    sh = tmp_path / "step_000003.shards"
    shutil.copytree(layouts["shards2"], sh)
    victim = sh / "model-00002-of-00002.safetensors"
    victim.unlink()
    os.mkfifo(victim)
    rc, out = cli(sh)
    assert rc == 1 and "not a regular file" in out
    # a truncated .bin, and a truncated general tensor file
    tb = tmp_path / "t" / "step_000003.bin"
    tb.parent.mkdir()
    tb.write_bytes(layouts["bin"].read_bytes()[:-7])
    rc, out = cli(tb)
    assert rc == 1 and "truncated" in out
    g = tmp_path / "g"
    g.mkdir()
    for f in layouts["general"].parent.glob("step_000003.safetensors*"):
        shutil.copyfile(f, g / f.name)
    with open(g / "step_000003.safetensors", "r+b") as fh:
        fh.truncate(os.path.getsize(g / "step_000003.safetensors") - 100)
    assert cli(g / "step_000003.safetensors")[0] == 1
    # a header length of 2^63 bytes: refused from the number alone
    h = tmp_path / "huge.safetensors"
    h.write_bytes((1 << 63).to_bytes(8, "little") + b"{}")
    rc, out = cli(h)
    assert rc == 1 and "header length" in out


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_pickles_are_refused_and_never_run(layouts, tmp_path, cli):
    """An optimizer.pt of a Hugging Face folder and a .dcp's .metadata that would run a command."""
    marker = tmp_path / "ran"
    hf = tmp_path / "checkpoint-3"
    hf.mkdir()
    shutil.copyfile(layouts["general"], hf / "model.safetensors")
    torch.save({"state": {0: _Payload(marker)}, "param_groups": []}, hf / "optimizer.pt")
    rc, out = cli(hf)
    assert rc == 1 and "optimizer.pt" in out and not marker.exists()
    d = tmp_path / "step_000003.dcp"
    shutil.copytree(layouts["dcp"], d)
    import pickle

    (d / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    rc, out = cli(d)
    assert rc == 1 and "not allowed" in out and not marker.exists()
    with pytest.raises(BadInput):
        fingerprint_path(tmp_path / "nothing")


def test_crafted_numbers_and_shapes_are_refused_before_anything_is_allocated(layouts, tmp_path, cli):
    """A .dcp whose metadata claims a 2^40-element tensor for one small chunk; an optimizer.pt that is no optimizer."""
    import pickle

    from ripresa.formats.dcp_safe import read_metadata

    d = tmp_path / "step_000003.dcp"
    shutil.copytree(layouts["dcp"], d)
    md = read_metadata(d)
    key = next(k for k in md.state_dict_metadata if k.endswith("0.weight"))
    md.state_dict_metadata[key].size = torch.Size([1 << 20, 1 << 20])
    (d / ".metadata").write_bytes(pickle.dumps(md))
    rc, out = cli(d)
    assert rc == 1 and "do not cover it exactly" in out
    hf = tmp_path / "checkpoint-3"
    hf.mkdir()
    shutil.copyfile(layouts["general"], hf / "model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [1, 2]}, hf / "optimizer.pt")
    rc, out = cli(hf)
    assert rc == 1 and "not shaped as a training state" in out


# ---- slow: real world sizes and a real Trainer ----------------------------------------------------------

_WRITE_DCP = textwrap.dedent('''
    import os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    from test_fingerprint import _model
    from ripresa.formats import dcp as dcp_fmt
    from ripresa.store import dcp as store_dcp
    torch.set_num_threads(1)
    folder, full = sys.argv[1], torch.load(sys.argv[2], weights_only=True)
    sharded = "RANK" in os.environ
    if sharded:
        dist.init_process_group("gloo")
    model = _model()
    if sharded:
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2], model[3]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dcp_fmt.load_full_into(model, opt, full)
    from pathlib import Path
    part = dcp_fmt.partial_path(Path(folder), 3)
    dcp_fmt.save_shards(model, opt, part, no_dist=not sharded)
    world = dist.get_world_size() if sharded else 1
    if not sharded or dist.get_rank() == 0:
        n = sum(p.numel() for p in _model().parameters())
        store_dcp.commit_dcp(Path(folder), 3, part, world_size=world, n_params=n,
                             state={"progress": {"step": 3}}, hmac_key=None)
    if sharded:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)
''')


@pytest.mark.slow
def test_dcp_written_at_world_sizes_1_and_2_has_the_same_fingerprint(layouts, tmp_path):
    """torchrun (gloo) 2 ranks, FSDP2-sharded (each weight split by rows across the ranks' files), and 1 process."""
    st = layouts["state"]
    full = tmp_path / "full.pt"
    torch.save({"model": st.model.state_dict(), "optimizer": st.optimizer.state_dict()}, full)
    script = tmp_path / "write_dcp.py"
    script.write_text(_WRITE_DCP)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tests = str(Path(__file__).resolve().parent)
    for world in (1, 2):
        out = tmp_path / f"ws{world}"
        out.mkdir()
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
               if world > 1 else [sys.executable]) + [str(script), str(out), str(full), tests]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    two = tmp_path / "ws2" / "step_000003.dcp"
    assert sorted(p.name for p in two.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    live = layouts["live"]
    from ripresa.formats import fingerprint_dcp

    real = fingerprint_dcp.chunk_range
    for world in (1, 2):
        used: list[bool] = []
        with pytest.MonkeyPatch.context() as mp:  # count the chunks hashed in place (row shards joined)
            mp.setattr(fingerprint_dcp, "chunk_range", lambda *a, used=used, **k: _counted(used, real(*a, **k)))
            f = fingerprint_path(tmp_path / f"ws{world}" / "step_000003.dcp")
        assert all(f.parts[p] == live.parts[p] for p in TRAINED), (world, f.differences(live)[:5])
        assert used and all(used), f"world size {world}: {sum(used)} of {len(used)} chunks hashed in place"


_TRAINER = textwrap.dedent('''
    import json, sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    import ripresa
    from ripresa.core.state import Progress
    torch.set_num_threads(1)
    out = sys.argv[1]
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=out, max_steps=2, save_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, logging_steps=100, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = [by_id[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]
    json.dump(names, open(out + "/names.json", "w"))
    st = ripresa.TrainingState(model=model, optimizer=trainer.optimizer)
    with ripresa.Checkpointer(out + "/ripresa", st, every=2, asynchronous=False, handle_signals=False,
                              save_on_close=False) as ck:
        ck.step_done(2)
''')


@pytest.mark.slow
def test_a_stock_trainer_checkpoint_folder_has_the_same_weights_and_moments(tmp_path):
    """transformers.Trainer's own checkpoint-2/ and a ripresa generation of the same model and optimizer."""
    pytest.importorskip("transformers")
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    names = json.loads((out / "names.json").read_text())
    hf = fingerprint_path(out / "checkpoint-2", param_names=names)
    mine = fingerprint_path(out / "ripresa" / "step_000002.safetensors")
    assert hf.layout == "hf"
    assert all(hf.parts[p] == mine.parts[p] for p in ("model", "optimizer", "steps")), hf.differences(mine)[:5]
    assert any("rng_state.pth" in n for n in hf.notes)


@pytest.mark.slow
def test_an_engine_run_and_its_conversions_have_one_root(tmp_path):
    """`ripresa train` (the ANDREA GPT: two parameter groups, so the .bin is named through the run's config.json),
    then `ripresa convert` to a general generation and a .dcp: the CLI says "same state" for each pair."""
    run = tmp_path / "run"
    res = ripresa_cli("train", "--run", run, "--config", "tiny", "--steps", "2", "--every", "2", timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    b = run / "step_000002.bin"
    for dest in (tmp_path / "c" / "step_000002.safetensors", tmp_path / "d" / "step_000002.dcp"):
        dest.parent.mkdir()
        res = ripresa_cli("convert", b, dest, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        res = ripresa_cli("fingerprint", b, dest, timeout=600)
        assert res.returncode == 0 and "the roots are equal" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
    res = ripresa_cli("fingerprint", b, "--json")
    assert "parameter names from the model given" in json.loads(res.stdout)["fingerprints"][0]["notes"]
