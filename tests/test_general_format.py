"""The general generation format (docs/FORMAT.md, "General generation"): any model and optimizer, exact resume.

Also a script: ``python tests/test_general_format.py CASE RUN STEPS EVERY SLEEP`` trains CASE in
RUN up to STEPS (resuming what is there) and writes ``final.pt`` (the kill-and-resume proofs).
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

import ripresa
from ripresa.core.rng import RandomStreams
from ripresa.core.state import TrainingState
from ripresa.errors import BadInput, IntegrityError, SaveFailed
from ripresa.formats import general as general_fmt
from ripresa.formats import safetensors_file as st
from ripresa.store.general import general_paths, validate_general

CASES = ("bf16", "sgd_nesterov", "amsgrad", "bn_tied", "lion")


from support.cases import Lion  # noqa: E402  (tests/ is on the path under pytest and as a script)


class Tied(torch.nn.Module):
    """Embedding and output head sharing one weight, a BatchNorm with persistent running statistics."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.bn = torch.nn.BatchNorm1d(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.bn(self.emb(x)))


def build(case: str) -> TrainingState:
    torch.manual_seed(0)
    if case == "bn_tied":
        model: torch.nn.Module = Tied()
    else:
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if case == "bf16":
        model = model.to(torch.bfloat16)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif case == "sgd_nesterov":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    elif case == "amsgrad":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    elif case == "bn_tied":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif case == "lion":
        opt = Lion(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:  # pragma: no cover
        raise ValueError(case)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    return TrainingState(model=model, optimizer=opt, scheduler=sched, rng=RandomStreams(), config={"case": case})


def one_step(case: str, state: TrainingState) -> float:
    """One optimizer step on a batch drawn from the (restored) global torch stream."""
    model, opt = state.model, state.optimizer
    opt.zero_grad()
    if case == "bn_tied":
        x = torch.randint(0, 16, (12,))
        loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 16, (12,)))
    else:
        dtype = next(model.parameters()).dtype
        x = torch.randn(12, 6).to(dtype)
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    state.scheduler.step()
    return float(loss.detach())


#: The format each case asks for (auto: the general format; said explicitly where the .bin could hold the state).
FORMATS = {"bn_tied": "general"}


def train(case: str, run: Path, total: int, every: int, *, sleep: float = 0.0, fmt: str | None = None,
          asynchronous: bool = True, ddp: bool = False) -> TrainingState:
    state = build(case)
    if ddp:  # under torchrun: gradients all-reduced, each rank its own data stream
        state.model = torch.nn.parallel.DistributedDataParallel(state.model)
        torch.manual_seed(1000 + torch.distributed.get_rank())
    fmt = fmt or FORMATS.get(case, "auto")
    ck = ripresa.Checkpointer(run, state, every=every, handle_signals=False, format=fmt, asynchronous=asynchronous)
    start = ck.resume()
    for step in range(start + 1, total + 1):
        loss = one_step(case, state)
        ck.step_done(step, loss=loss)
        if sleep:
            time.sleep(sleep)
    ck.close()
    return state


def final_tensors(state: TrainingState) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer state, flattened by key (for a bitwise comparison)."""
    snap = state.snapshot(ripresa.Progress())
    tensors, encoded, _ = general_fmt.split_state({"model": snap["model"], "optimizer": snap["optimizer"]},
                                                 general_fmt.model_aliases(state.model))
    return {**tensors, "__rest__": torch.tensor(list(json.dumps(encoded, sort_keys=True).encode()), dtype=torch.uint8)}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(st.as_bytes(a[k]), st.as_bytes(b[k])), k


# ---- format choice at construction ------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_the_general_format_holds_what_the_bin_cannot_and_resumes_exactly(tmp_path, case):
    ref = train(case, tmp_path / "ref", 12, 3)
    train(case, tmp_path / "run", 6, 3)
    names = sorted(os.listdir(tmp_path / "run"))
    assert "step_000006.safetensors" in names and not any(n.endswith(".bin") for n in names), names
    resumed = train(case, tmp_path / "run", 12, 3)
    assert_bitwise_equal(final_tensors(ref), final_tensors(resumed))
    gen = validate_general(tmp_path / "run", 12, deep=True).generation
    assert gen.valid and gen.kind == "general"
    assert [c.name for c in gen.checks] == ["marker present", "marker format", "tensor header", "tensor step",
                                            "companion sha256", "companion schema", "companion record",
                                            "tensor sha256", "companion state"]


def test_format_andrea_refuses_a_bf16_model_at_construction_naming_it(tmp_path):
    state = build("bf16")
    with pytest.raises(BadInput, match=r"format='andrea' cannot hold this training state: parameter '0\.weight' "
                                       r"is not float32 \(found torch\.bfloat16\)"):
        ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False, format="andrea")
    # the folder was released: a session may open it at once
    ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False).close()
    with pytest.raises(BadInput, match="amsgrad"):
        ripresa.Checkpointer(tmp_path, build("amsgrad"), every=1, handle_signals=False, format="andrea")
    with pytest.raises(BadInput, match="SGD"):
        ripresa.Checkpointer(tmp_path, build("sgd_nesterov"), every=1, handle_signals=False, format="andrea")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False, format="zip")


def test_auto_is_the_general_format_and_a_bin_folder_goes_on_in_it_recording_the_format_change(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = TrainingState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with ripresa.Checkpointer(tmp_path / "auto", state, every=1, handle_signals=False) as ck:
        assert ck.backend.kind == "general"  # auto: the general format, even for a state the .bin holds
    with ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False, format="andrea") as ck:
        assert ck.backend.kind == "bin"
        ck.resume()
        state.optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        state.optimizer.step()
        ck.step_done(1)
    with ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False) as ck:
        assert ck.backend.kind == "general" and [b.kind for b in ck.backends] == ["general", "bin", "dcp", "shards"]
        assert ck.resume() == 1 and ck.resumed_from.kind == "bin"  # the .bin generation resumes
        state.optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        state.optimizer.step()
        ck.step_done(2)
    assert (tmp_path / "step_000001.bin").exists() and (tmp_path / "step_000002.safetensors").exists()
    events = [json.loads(line) for line in (tmp_path / ".loss.jsonl").read_text().splitlines()]
    changes = [e for e in events if e.get("event") == "format_change"]
    assert len(changes) == 1 and changes[0] == {**changes[0], "previous": "bin", "now": "general", "format": "auto"}
    with ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False) as ck:
        assert ck.resume() == 2 and ck.resumed_from.kind == "general"


def test_a_companion_stays_small_with_two_1024x1024_buffers(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model.register_buffer("mask_a", torch.rand(1024, 1024) > 0.5)
    model.register_buffer("mask_b", torch.randn(1024, 1024))
    state = TrainingState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with ripresa.Checkpointer(tmp_path, state, every=1, handle_signals=False) as ck:  # auto: the general format
        assert ck.backend.kind == "general"
        ck.resume()
        ck.step_done(1)
    f, c, _ = general_paths(tmp_path, 1)
    assert c.stat().st_size < 64 * 1024, c.stat().st_size
    assert b"__tensor__" not in c.read_bytes()  # no tensor as a list of numbers in the JSON
    _, tensors, _ = st.read(f)
    assert torch.equal(tensors["model/mask_a"], model.mask_a) and torch.equal(tensors["model/mask_b"], model.mask_b)


def test_tied_weights_are_stored_once_and_named_as_an_alias(tmp_path):
    state = train("bn_tied", tmp_path, 3, 3)
    f, c, _ = general_paths(tmp_path, 3)
    doc = json.loads(c.read_bytes())
    assert doc["aliases"] == {"model/head.weight": "model/emb.weight"}
    header = st.read_header(f)
    keys = {e.key for e in header.entries}
    assert "model/emb.weight" in keys and "model/head.weight" not in keys
    assert {"model/bn.running_mean", "model/bn.running_var", "model/bn.num_batches_tracked"} <= keys
    again = build("bn_tied")
    with ripresa.Checkpointer(tmp_path, again, every=0, handle_signals=False, format="general") as ck:
        assert ck.resume() == 3
    assert again.model.head.weight is again.model.emb.weight  # still tied after the restore
    assert torch.equal(again.model.emb.weight, state.model.emb.weight)


def test_keys_escape_slashes_tildes_and_int_like_strings():
    assert general_fmt.key_of(("optimizer", "state", 3, "exp_avg")) == "optimizer/state/3/exp_avg"
    assert general_fmt.key_of(("objects", "a/b~c", "3", "", -1)) == "objects/a~1b~0c/~s3/~s/-1"


def test_a_dtype_without_a_safetensors_name_round_trips_as_raw_bytes(tmp_path):
    z = torch.randn(3, 2, dtype=torch.complex64)
    tensors, encoded, _ = general_fmt.split_state({"extra": {"z": z}, "model": {}})
    assert tensors["extra/z"].dtype == torch.uint8
    assert encoded["extra"]["z"] == {"__ref__": "extra/z", "dtype": "complex64", "shape": [3, 2]}
    doc = general_fmt.companion_doc("x", "0" * 64, 0, 0, 1, {}, encoded)
    back = general_fmt.join_state(doc, tensors)
    assert torch.equal(back["extra"]["z"], z)


# ---- interoperability ----------------------------------------------------------------------


def test_safetensors_safe_open_reads_every_tensor_with_the_same_bytes(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    state = train("lion", tmp_path, 4, 2)
    f, _, _ = general_paths(tmp_path, 4)
    _, ours, _ = st.read(f)
    with safetensors.safe_open(str(f), "pt") as sf:
        keys = set(sf.keys())
        assert keys == set(ours)
        assert sf.metadata() == {"format": "ripresa.general", "format_version": "1", "step": "4"}
        for k in keys:
            theirs = sf.get_tensor(k)
            assert theirs.dtype == ours[k].dtype and theirs.shape == ours[k].shape
            assert torch.equal(st.as_bytes(theirs.contiguous()), st.as_bytes(ours[k])), k
    live = state.model.state_dict()
    for name, t in live.items():
        assert torch.equal(ours[f"model/{name}"], t)
    m = state.optimizer.state_dict()["state"][0]["momentum"]
    assert torch.equal(ours["optimizer/state/0/momentum"], m)
    assert ours["optimizer/state/0/step"].dtype == torch.int64 and int(ours["optimizer/state/0/step"]) == 4
    assert ours["rng/torch_cpu"].dtype == torch.uint8


def test_a_bf16_generation_reads_back_in_safetensors_too(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    state = train("bf16", tmp_path, 2, 2)
    f, _, _ = general_paths(tmp_path, 2)
    loaded = safetensors.load_file(str(f))
    assert loaded["model/0.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["model/0.weight"], state.model[0].weight)


# ---- hostile files ---------------------------------------------------------------------------


def _craft(path: Path, header: dict, data: bytes = b"", *, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


HOSTILE = {
    "huge header length": (lambda p: _craft(p, {}, length=2**63), "header length out of bounds"),
    "offsets outside the file": (
        lambda p: _craft(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
        "byte range outside the file's data"),
    "overlapping ranges": (
        lambda p: _craft(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
        "overlap"),
    "unknown dtype": (
        lambda p: _craft(p, {"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "unknown dtype"),
    "shape asking for terabytes": (
        lambda p: _craft(p, {"a": {"dtype": "F32", "shape": [2**20, 2**20, 2**10], "data_offsets": [0, 8]}},
                         b"\0" * 8),
        "shape beyond any size"),  # the one shape bound (formats/companion.check_shape), before the byte check
    "shape asking for more than its bytes": (
        lambda p: _craft(p, {"a": {"dtype": "F32", "shape": [2**10, 2**10], "data_offsets": [0, 8]}}, b"\0" * 8),
        "shape and dtype do not match"),
    "range asking for terabytes": (
        lambda p: _craft(p, {"a": {"dtype": "U8", "shape": [2**42], "data_offsets": [0, 2**42]}}, b"\0" * 8),
        "byte range outside the file's data"),
    "gap between ranges": (
        lambda p: _craft(p, {"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"\0" * 4),
        "gap"),
    "not json": (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{{{{"), "not valid JSON"),
    "too short": (lambda p: p.write_bytes(b"\1\2"), "shorter than its 8-byte header length"),
    "metadata not strings": (lambda p: _craft(p, {"__metadata__": {"a": 1}}), "__metadata__"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_crafted_header_is_an_integrity_error_naming_the_file_before_any_allocation(tmp_path, monkeypatch, name):
    make, message = HOSTILE[name]
    path = tmp_path / "step_000001.safetensors"
    make(path)

    def no_alloc(*a, **k):
        raise AssertionError("allocated a tensor for a hostile header")

    monkeypatch.setattr(torch, "empty", no_alloc)
    for read in (st.read_header, st.read):
        with pytest.raises(IntegrityError, match=message) as ei:
            read(path)
        assert str(path) in str(ei.value)


def test_a_hostile_tensor_file_fails_its_named_check_and_the_session_falls_back(tmp_path):
    train("sgd_nesterov", tmp_path, 4, 2)
    f, c, mk = general_paths(tmp_path, 4)
    _craft(f, {"__metadata__": {"format": "ripresa.general", "step": "4"},
               "a": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 4 * 2**40]}}, b"\0" * 8)
    import hashlib

    lines = mk.read_text().splitlines()
    lines[0] = f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}"
    mk.write_text("\n".join(lines) + "\n")
    gen = validate_general(tmp_path, 4).generation
    assert not gen.valid and gen.failed.name == "tensor header" and gen.failed.file == str(f)
    with pytest.warns(UserWarning, match=r"\.safetensors generation 4 not used"):
        with ripresa.Checkpointer(tmp_path, build("sgd_nesterov"), every=0, handle_signals=False) as ck:
            assert ck.resume() == 2


def test_a_companion_reference_to_a_missing_tensor_is_refused(tmp_path):
    train("sgd_nesterov", tmp_path, 2, 2)
    f, c, mk = general_paths(tmp_path, 2)
    doc = json.loads(c.read_bytes())
    doc["state"]["model"]["0.weight"] = {"__ref__": "model/nope"}
    c.write_bytes(json.dumps(doc).encode())
    import hashlib

    lines = mk.read_text().splitlines()
    lines[1] = f"{hashlib.sha256(c.read_bytes()).hexdigest()}  {c.name}"
    mk.write_text("\n".join(lines) + "\n")
    gen = validate_general(tmp_path, 2, deep=True).generation
    assert not gen.valid and gen.failed.name == "companion state"


def _long_number_lists(node, out, where=""):
    """Every JSON list of >= 64 numbers in ``node`` (where it is)."""
    if isinstance(node, dict):
        for k, v in node.items():
            _long_number_lists(v, out, f"{where}/{k}")
    elif isinstance(node, list):
        if len(node) >= 64 and all(isinstance(x, int | float) for x in node):
            out.append(where)
        for i, v in enumerate(node):
            _long_number_lists(v, out, f"{where}/{i}")
    return out


def test_random_stream_states_are_binary_and_restored_exactly(tmp_path):
    """Python's random state (625 words) and NumPy's legacy key (624) are I64 tensors of the file, referenced from
    a companion of a few KB; the resume restores them bit for bit; a malformed list reference is a SchemaError."""
    import numpy as np

    from ripresa.errors import SchemaError

    def make() -> TrainingState:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return TrainingState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                             rng=RandomStreams(python={"aug": random.Random(5)},
                                               numpy={"legacy": np.random.Generator(np.random.MT19937(3))}))

    state = make()
    random.seed(11)
    np.random.seed(12)
    random.random(), np.random.random()
    with ripresa.Checkpointer(tmp_path, state, every=0, handle_signals=False, asynchronous=False) as ck:
        ck.resume()
        ck.save_now()
    want = (random.random(), np.random.random(), state.rng.python["aug"].random(),
            state.rng.numpy["legacy"].random())
    f, c, _ = general_paths(tmp_path, 0)
    doc = json.loads(c.read_bytes())
    assert _long_number_lists(doc, []) == [] and c.stat().st_size < 4096, c.stat().st_size
    assert doc["state"]["rng"]["python"]["state"] == {"__ref__": "rng/python/state", "list": "int64"}
    _, tensors, _ = st.read(f)
    words = tensors["rng/python/state"]
    assert words.dtype == torch.int64 and words.shape == (625,)
    assert tensors["rng/python_random/aug/state"].shape == (625,)
    assert [k for k in tensors if k.startswith("rng/numpy")] and all(
        tensors[k].dtype == torch.int64 for k in tensors if k.startswith("rng/numpy"))
    random.seed(99)
    np.random.seed(99)
    again = make()
    with ripresa.Checkpointer(tmp_path, again, every=0, handle_signals=False) as ck:
        assert ck.resume() == 0 and ck.resumed_from is not None
    got = (random.random(), np.random.random(), again.rng.python["aug"].random(), again.rng.numpy["legacy"].random())
    assert got == want
    for bad in ({"__ref__": "rng/python/state", "list": "int32"}, {"__ref__": "rng/python/state", "list": None},
                {"__ref__": "model/weight", "list": "int64"}, {"__ref__": "rng/torch_cpu", "list": "int64"},
                {"__ref__": "rng/nope", "list": "int64"}):
        crafted = json.loads(c.read_bytes())
        crafted["state"]["rng"]["python"]["state"] = bad
        with pytest.raises(SchemaError):
            general_fmt.join_state(crafted, tensors, c)


def test_an_ops_hook_sees_the_general_commit_and_a_failure_keeps_the_old_generation(tmp_path):
    from ripresa.io.fsio import ops

    train("lion", tmp_path, 2, 2)
    seen: list[tuple[str, str]] = []

    def hook(op: str, path: str) -> None:
        seen.append((op, path))
        if op == "rename" and path.endswith("step_000004.safetensors.sha256"):
            raise OSError(28, "injected: no space")

    ops.hook = hook
    try:
        with pytest.warns(UserWarning, match="checkpoint at step 4 failed"):
            # the cadence save at step 4 fails (a warning); close()'s final save retries it, must succeed, fails too
            with pytest.raises(SaveFailed, match="rename into place failed"):
                train("lion", tmp_path, 4, 2, asynchronous=False)
    finally:
        ops.hook = None
    assert any(op == "rename" and p.endswith("step_000004.safetensors") for op, p in seen)
    assert validate_general(tmp_path, 2, deep=True).generation.valid
    assert not validate_general(tmp_path, 4).generation.valid


def test_signed_general_generations_verify_and_a_missing_signature_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RIPRESA_HMAC_KEY", "k" * 32)
    train("amsgrad", tmp_path, 2, 2)
    f, _, _ = general_paths(tmp_path, 2)
    assert Path(str(f) + ".hmac").exists()
    from ripresa.store.backend import backend_of
    from ripresa.store.store import CheckpointStore

    store = CheckpointStore(tmp_path, writer=False, require_signature=True)
    gen = backend_of("st", store).check(2)
    assert gen.valid and gen.signature_verified and "signature" in [c.name for c in gen.checks]
    Path(str(f) + ".hmac").unlink()
    gen = backend_of("st", store).check(2)
    assert not gen.valid and gen.failed.name == "signature"


# ---- a crash at every file operation of a general save ---------------------------------------------


def _continue_and_die_at(folder: Path, k: int) -> None:
    """Child: resume ``folder`` (step 2), train to 4 with a synchronous save, dying at the k-th file operation."""
    from ripresa.io.fsio import ops

    state = build("lion")
    ck = ripresa.Checkpointer(folder, state, every=2, handle_signals=False, asynchronous=False)
    ck.resume()
    seen = {"n": 0}

    def hook(op: str, path: str) -> None:
        seen["n"] += 1
        if seen["n"] == k:
            os._exit(9)

    ops.hook = hook
    for step in (3, 4):
        ck.step_done(step, loss=one_step("lion", state))
    ops.hook = None
    ck.close()
    os._exit(100 + seen["n"])  # no crash: report how many operations the save took


@pytest.mark.slow
def test_a_crash_at_every_file_operation_of_a_save_leaves_the_old_or_the_new_generation(tmp_path):
    import multiprocessing
    import shutil
    import warnings

    template = tmp_path / "template"
    train("lion", template, 2, 2)
    want = final_tensors(train("lion", tmp_path / "ref", 4, 2))
    ctx = multiprocessing.get_context("fork")

    def attempt(k: int) -> tuple[int, Path]:
        folder = tmp_path / f"k{k}"
        shutil.copytree(template, folder)
        proc = ctx.Process(target=_continue_and_die_at, args=(folder, k))
        proc.start()
        proc.join(120)
        assert proc.exitcode is not None, k
        return proc.exitcode, folder

    code, _ = attempt(10**6)
    n_ops = code - 100
    assert 10 < n_ops < 90, n_ops
    print(f"a general save of step 4 (and its retention) takes {n_ops} file operations")
    outcomes = set()
    for k in range(1, n_ops + 1):
        code, folder = attempt(k)
        assert code == 9, (k, code)
        state = build("lion")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ripresa.Checkpointer(folder, state, every=0, handle_signals=False) as ck:
                step = ck.resume()
        assert step in (2, 4), (k, step)
        if step == 4:
            assert_bitwise_equal(want, final_tensors(state))
        outcomes.add(step)
    assert outcomes == {2, 4}


# ---- a real SIGKILL at a random step, then a restart ------------------------------------------


def _script(case: str, run: Path, steps: int, every: int, sleep: float) -> list[str]:
    return [sys.executable, "-B", __file__, case, str(run), str(steps), str(every), str(sleep)]


def _final(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final.pt", weights_only=True)


def kill_and_resume(tmp_path: Path, case: str, seed: int | None = None) -> None:
    from conftest import popen, run, wait_for_step

    steps, every = 30, 3
    rnd = random.Random(seed)
    kill_at = rnd.randrange(4, 24)
    ref = run(_script(case, tmp_path / "ref", steps, every, 0.0))
    assert ref.returncode == 0, ref.stderr[-2000:]
    folder = tmp_path / "run"
    proc = popen(_script(case, folder, steps, every, 0.05))
    try:
        wait_for_step(folder, kill_at, proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (folder / "final.pt").exists()
    again = run(_script(case, folder, steps, every, 0.0))
    assert again.returncode == 0, again.stderr[-2000:]
    events = [json.loads(x) for x in (folder / ".loss.jsonl").read_text().splitlines() if x.startswith("{")]
    resumes = [e for e in events if e.get("event") == "resume"]
    assert resumes and resumes[-1]["file"].endswith(".safetensors"), (kill_at, resumes)
    assert_bitwise_equal(_final(tmp_path / "ref"), _final(folder))


@pytest.mark.slow  # the default tier's general-format SIGKILL sample is tests/test_cases.py's fp16 + GradScaler case
def test_sigkill_at_a_random_step_then_restart_is_bitwise_equal_lion(tmp_path):
    kill_and_resume(tmp_path, "lion")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bf16", "sgd_nesterov", "amsgrad", "bn_tied"])
def test_sigkill_at_a_random_step_then_restart_is_bitwise_equal(tmp_path, case):
    kill_and_resume(tmp_path, case)


@pytest.mark.slow
def test_ddp_writes_general_generations_and_resumes_every_rank_exactly(tmp_path):
    """Two gloo ranks under torchrun: SGD (not a .bin state) in DDP writes general generations with every rank's
    streams; a stop at step 6 and a restart end bitwise equal to an uninterrupted run."""
    from conftest import run

    def torchrun(folder: Path, steps: int) -> None:
        res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                   "sgd_nesterov", str(folder), str(steps), "3", "0"], env={"OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-3000:]

    torchrun(tmp_path / "ref", 12)
    torchrun(tmp_path / "run", 6)
    _, c, _ = general_paths(tmp_path / "run", 6)
    ranks = json.loads(c.read_bytes())["state"]["extra"]["distributed"]["ranks"]
    assert len(ranks) == 2 and ranks[1]["rng"]["torch_cpu"] == {"__ref__": "extra/distributed/ranks/1/rng/torch_cpu"}
    # every rank's copy of Python's random state is a tensor of the file too, not 625 JSON numbers
    assert ranks[1]["rng"]["python"]["state"] == {"__ref__": "extra/distributed/ranks/1/rng/python/state", "list": "int64"}
    assert c.stat().st_size < 8192, c.stat().st_size
    torchrun(tmp_path / "run", 12)
    assert_bitwise_equal(_final(tmp_path / "ref"), _final(tmp_path / "run"))


def main(argv: list[str]) -> None:
    case, run, steps, every, sleep = argv[0], Path(argv[1]), int(argv[2]), int(argv[3]), float(argv[4])
    ddp = "RANK" in os.environ
    if ddp:
        torch.distributed.init_process_group("gloo")
    state = train(case, run, steps, every, sleep=sleep, ddp=ddp)
    if not ddp or torch.distributed.get_rank() == 0:
        torch.save(final_tensors(state), run / "final.pt")
    if ddp:
        from ripresa.session.distributed import exit_rank

        exit_rank(0)  # not interpreter finalization: gloo can abort there (docs/ARCHITECTURE.md, "Distributed runs")


if __name__ == "__main__":
    main(sys.argv[1:])


def test_inspect_shows_general_generations_through_their_named_checks(tmp_path):
    from ripresa.tools.inspect import inspect_path

    train("sgd_nesterov", tmp_path, 4, 2)
    run = inspect_path(tmp_path)["run"]
    assert run["resume_step"] == 4
    rows = run["generations"]
    assert [(r["step"], r["kind"], r["valid"]) for r in rows] == [(2, "general", True), (4, "general", True)]
    assert rows[-1]["resume"] and rows[-1]["files"] == {"general": True, "companion": True, "marker": True}
    assert [c["name"] for c in rows[-1]["checks"]][-2:] == ["tensor sha256", "companion state"]
    f, _, _ = general_paths(tmp_path, 4)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 1
    f.write_bytes(bytes(raw))
    run = inspect_path(tmp_path)["run"]
    assert run["resume_step"] == 2
    assert run["generations"][-1]["checks"][-1]["name"] == "tensor sha256"
    assert not run["generations"][-1]["checks"][-1]["ok"]


# ---- ripresa convert: .bin <-> general ------------------------------------------------------------


def test_convert_bin_to_general_and_back_is_bitwise(tmp_path):
    from ripresa.engine.gpt.factory import GPT_FACTORY
    from ripresa.tools.convert import compare, convert, load

    cfg = GPT_FACTORY.config("tiny")
    model, opt = GPT_FACTORY.build(cfg)
    state = TrainingState(model=model, optimizer=opt, config=cfg)
    with ripresa.Checkpointer(tmp_path / "run", state, every=2, handle_signals=False, format="andrea") as ck:
        assert ck.backend.kind == "bin"
        ck.resume()
        for step in (1, 2):
            opt.zero_grad()
            x = torch.randint(0, cfg["model"]["vocab_size"], (2, 8))
            out = model(x)
            (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
            opt.step()
            ck.step_done(step)
    src = tmp_path / "run" / "step_000002.bin"
    r = convert(src, tmp_path / "g" / "step_000002.safetensors", model_factory=GPT_FACTORY)
    assert r["dest_kind"] == "general" and r["compared"] == "full" and r["verified"]
    assert validate_general(tmp_path / "g", 2, deep=True).generation.valid
    r = convert(tmp_path / "g" / "step_000002.safetensors", tmp_path / "b" / "step_000002.bin", model_factory=GPT_FACTORY)
    assert r["source_kind"] == "general" and r["dest_kind"] == "bin"
    assert (tmp_path / "b" / "step_000002.bin").read_bytes() == src.read_bytes()
    assert compare(load(src, model_factory=GPT_FACTORY), load(tmp_path / "b" / "step_000002.bin",
                                                               model_factory=GPT_FACTORY), "full") == []
