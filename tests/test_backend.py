"""The storage backend protocol (docs/ARCHITECTURE.md): named checks, a third backend, the .dcp commit through ops."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from support.tiny import tiny_state

import ripresa
from ripresa.core.state import TrainingState
from ripresa.errors import IntegrityError
from ripresa.formats import dcp as dcp_fmt
from ripresa.formats.andrea_bin import BinArrays
from ripresa.formats.generation import Check, Generation
from ripresa.formats.torch_pt import load_checkpoint, save_checkpoint
from ripresa.io.fsio import ops, parse_sha256sum, parse_sha256sum_line, verify_against_sidecar
from ripresa.store import dcp as store_dcp
from ripresa.store.backend import (
    BackendBase,
    BackendSpec,
    BinBackend,
    DcpBackend,
    StorageBackend,
    backends_for,
    register_backend,
    unregister_backend,
)
from ripresa.store.restore import Loaded
from ripresa.store.store import CheckpointStore, generation_paths, validate_generation
from ripresa.verify.compare import first_difference


def _arrays(n: int) -> BinArrays:
    g = np.random.default_rng(0)
    w, m, v = (g.standard_normal(n).astype(np.float32) for _ in range(3))
    return BinArrays((w,), (m,), (np.abs(v),))


def _toy() -> TrainingState:
    return tiny_state(config={"toy": True})  # tests/support/tiny.py


def _train(state: TrainingState) -> None:
    """One optimizer step (the progress and the optimizer describe the same instant)."""
    state.optimizer.zero_grad()
    state.model(torch.randn(8, 4)).pow(2).mean().backward()
    state.optimizer.step()


# ---- named checks ------------------------------------------------------------------------


def test_a_valid_generation_passes_every_named_check(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save(3, _arrays(10), {"progress": {"step": 3}})
        gen = store.check(3, deep=True)
    assert gen.valid and gen.kind == "bin" and gen.failed is None
    names = [c.name for c in gen.checks]
    assert names == ["marker present", "marker format", "bin header", "bin step", "companion sha256",
                     "companion schema", "companion record", "bin sha256", "companion state"]
    assert all(c.ok for c in gen.checks)
    sha = next(c for c in gen.checks if c.name == "bin sha256")
    assert sha.expected == sha.found == gen.bin_sha256


def test_a_broken_companion_fails_its_named_check_with_expected_and_found(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save(5, _arrays(10), {"progress": {"step": 5}})
    _, comp, _ = generation_paths(tmp_path, 5)
    comp.write_bytes(comp.read_bytes().replace(b'"step":5', b'"step":6'))
    reader = CheckpointStore(tmp_path, writer=False)
    gen = reader.check(5)
    assert not gen.valid
    failed = gen.failed
    assert isinstance(failed, Check) and failed.name == "companion sha256"
    assert re.fullmatch(r"[0-9a-f]{64}", failed.expected) and re.fullmatch(r"[0-9a-f]{64}", failed.found)
    assert failed.expected != failed.found and failed.file == str(comp)
    assert [c.name for c in gen.checks if c.ok] == ["marker present", "marker format", "bin header", "bin step"]
    # load() runs the same validation and raises that check's error
    with pytest.raises(IntegrityError, match="companion sha256 mismatch"):
        reader.load(5)
    # inspect renders the same named checks
    from ripresa.tools.inspect import inspect_path

    rows = inspect_path(tmp_path)["run"]["generations"]
    assert rows[0]["checks"][-1] == failed.as_dict()


def test_a_companion_that_fails_its_schema_names_the_check(tmp_path):
    with CheckpointStore(tmp_path) as store:
        store.save(2, _arrays(4), {"progress": {"step": 2}})
    b, comp, mk = generation_paths(tmp_path, 2)
    doc = json.loads(comp.read_bytes())
    doc["format_version"] = 99
    comp.write_bytes(json.dumps(doc).encode())
    import hashlib

    lines = mk.read_text().splitlines()
    lines[1] = f"{hashlib.sha256(comp.read_bytes()).hexdigest()}  {comp.name}"
    mk.write_text("\n".join(lines) + "\n")
    v = validate_generation(tmp_path, 2)
    assert not v.generation.valid
    assert v.generation.failed.name == "companion schema"
    assert v.generation.failed.expected == 1 and v.generation.failed.found == 99


def test_one_sha256sum_parser():
    h = "a" * 64
    assert parse_sha256sum_line(f"{h}  x.bin") == (h, "x.bin")
    assert parse_sha256sum_line(f"{h} *x.bin\n") == (h, "x.bin")
    assert parse_sha256sum_line(f"{h}  d/x") is None
    assert parse_sha256sum_line(f"{h}  d/x", in_folder=True) == (h, "d/x")
    assert parse_sha256sum_line(f"{h}  a/b/c", in_folder=True) is None
    assert parse_sha256sum_line(f"{h}  x\r") is None
    assert parse_sha256sum(f"{h}  a\n{h}  b\n".encode()) == [(h, "a"), (h, "b")]
    assert parse_sha256sum(b"\xff") is None


def test_one_tree_comparator_is_exact_for_convert():
    a = {"w": torch.ones(3), "opt": (1, 2.0, float("nan"))}
    assert first_difference(a, {"w": torch.ones(3), "opt": [1, 2.0, float("nan")]}, "s") is None
    assert "s.w" in first_difference(a, {"w": torch.zeros(3), "opt": (1, 2.0, float("nan"))}, "s")
    assert "float32" in first_difference({"w": torch.ones(3)}, {"w": torch.ones(3, dtype=torch.float64)})


# ---- the .dcp commit goes through the file-operation layer ---------------------------------


def test_an_ops_hook_sees_the_dcp_commit_renames_deletes_and_fsyncs(tmp_path):
    seen: list[tuple[str, str]] = []
    model = torch.nn.Linear(2, 2, bias=False)

    def commit(step: int) -> Generation:
        part = dcp_fmt.partial_path(tmp_path, step)
        dcp_fmt.save_shards(model, None, part, no_dist=True)
        return store_dcp.commit_dcp(tmp_path, step, part, world_size=1, n_params=4, state={"progress": {"step": step}})

    commit(1)
    ops.hook = lambda op, path: seen.append((op, path))
    try:
        gen = commit(1)  # a re-save: the old generation is deleted first
        dcp_fmt.partial_path(tmp_path, 9).mkdir()
        assert store_dcp.clean_partials(tmp_path) == [dcp_fmt.partial_path(tmp_path, 9)]
        store_dcp.delete_dcp(tmp_path, 1)
    finally:
        ops.hook = None
    assert gen.valid and gen.kind == "dcp"
    d, mk = dcp_fmt.dcp_paths(tmp_path, 1)
    part = dcp_fmt.partial_path(tmp_path, 1)
    assert ("rename", str(d)) in seen
    assert ("fsync_dir", str(part)) in seen and ("fsync_dir", str(tmp_path)) in seen
    assert seen.count(("rmtree", str(d))) == 2  # the re-save's old folder, then delete_dcp
    assert ("unlink", str(mk)) in seen
    assert ("rmtree", str(dcp_fmt.partial_path(tmp_path, 9))) in seen
    assert not d.exists() and not mk.exists()


def test_a_failing_ops_hook_fails_the_dcp_commit_and_keeps_the_old_generation(tmp_path):
    model = torch.nn.Linear(2, 2, bias=False)
    part = dcp_fmt.partial_path(tmp_path, 1)
    dcp_fmt.save_shards(model, None, part, no_dist=True)
    first = store_dcp.commit_dcp(tmp_path, 1, part, world_size=1, n_params=4, state={"progress": {"step": 1}})
    part = dcp_fmt.partial_path(tmp_path, 2)
    dcp_fmt.save_shards(model, None, part, no_dist=True)

    def hook(op: str, path: str) -> None:
        if op == "rename" and path.endswith("step_000002.dcp"):
            raise OSError(5, "injected")

    ops.hook = hook
    try:
        with pytest.raises(ripresa.SaveFailed, match="injected"):
            store_dcp.commit_dcp(tmp_path, 2, part, world_size=1, n_params=4, state={"progress": {"step": 2}})
    finally:
        ops.hook = None
    assert first.valid and dcp_fmt.check_dcp(tmp_path, 1, deep=True).valid
    assert not dcp_fmt.check_dcp(tmp_path, 2).valid


# ---- the registry: a third backend the session uses without change ------------------------


class PtBackend(BackendBase):
    """A small general-purpose backend: ``step_NNNNNN.pt`` (torch.save, weights_only) + ``.sha256``."""

    kind = "pt"
    label = ".pt generation"
    written_by = ".pt ones are written by the test backend"

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.folder = store.folder

    def _path(self, step: int, folder: Path | None = None) -> Path:
        return (folder or self.folder) / f"step_{step:06d}.pt"

    def step_of(self, path: Path) -> int | None:
        m = re.fullmatch(r"step_(\d{6})\.pt", Path(path).name)
        return int(m.group(1)) if m else None

    def steps_on_disk(self) -> list[int]:
        return sorted(s for e in os.scandir(self.folder) if (s := self.step_of(Path(e.name))) is not None)

    def check(self, step: int, *, deep: bool = False) -> Generation:
        p = self._path(step)
        mk = p.with_name(p.name + ".sha256")
        try:
            d = verify_against_sidecar(p)
        except ripresa.RipresaError as exc:
            return Generation(step, self.kind, p, p, mk, valid=False, reason=exc.message,
                              checks=(Check("pt sha256", False, None, exc.found, str(p), exc.message),))
        return Generation(step, self.kind, p, p, mk, valid=True, size=d.size, files={p.name: d.sha256},
                          deep_checked=True, checks=(Check("pt sha256", True, d.sha256, d.sha256),))

    def at_path(self, path: Path) -> Generation:
        return PtBackend(CheckpointStore(Path(path).parent, writer=False)).check(self.step_of(path))

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        return Loaded(load_checkpoint(gen.path).state, True, lambda *a: None, gen.path)

    def capture(self, step, state, progress, extra, *, stage=None, world_size=1):
        snap = state.snapshot(progress, extra)
        return lambda: (save_checkpoint(self._path(step), snap), self.check(step))[1]

    def delete(self, step: int) -> None:
        for p in (self._path(step).with_name(self._path(step).name + ".sha256"), self._path(step)):
            if p.exists():
                ops.unlink(p)


@pytest.fixture
def pt_backend():
    register_backend(BackendSpec("pt", PtBackend, {"single": 1}))
    try:
        yield
    finally:
        unregister_backend("pt")


def test_the_builtin_backends_satisfy_the_protocol_and_are_ordered_by_mode(tmp_path):
    with CheckpointStore(tmp_path) as store:
        single, ignored = backends_for("single", store)
        assert [b.kind for b in single] == ["general", "bin", "dcp", "shards"] and [b.kind for b in ignored] == []  # a .dcp newest resumes too
        assert [b.kind for b in backends_for("ddp", store)[0]] == ["general", "bin", "dcp", "shards"]
        assert [b.kind for b in backends_for("fsdp2", store)[0]] == ["dcp", "general", "bin", "shards"]  # 1 -> 2 resumes st too
        assert [b.kind for b in backends_for("fsdp2", store)[1]] == []
        # auto is the general format for any state; the .bin when asked for ("andrea") and the state fits it
        assert [b.kind for b in backends_for("single", store, state=_toy())[0]] == ["general", "bin", "dcp", "shards"]
        assert [b.kind for b in backends_for("single", store, state=_toy(), format="andrea")[0]] == ["bin", "general", "dcp", "shards"]
        assert [b.kind for b in backends_for("ddp", store, state=_toy(), format="andrea")[0]] == ["bin", "general", "dcp", "shards"]
        sgd = TrainingState(model=torch.nn.Linear(2, 2), optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
        assert [b.kind for b in backends_for("single", store, state=sgd)[0]] == ["general", "bin", "dcp", "shards"]
        from ripresa.store.general import GeneralBackend

        for b in (BinBackend(store), DcpBackend(store), PtBackend(store), GeneralBackend(store)):
            assert isinstance(b, StorageBackend)


def test_a_third_registered_backend_is_used_by_the_checkpointer(tmp_path, pt_backend):
    state = _toy()
    ck = ripresa.Checkpointer(tmp_path, state, every=2, asynchronous=True, handle_signals=False)
    assert [b.kind for b in ck.backends] == ["pt", "general", "bin", "dcp", "shards"] and ck.backend.kind == "pt"
    assert ck.resume() == 0
    for step in (1, 2):
        _train(state)
        ck.step_done(step)
    ck.close()
    assert {"step_000002.pt", "step_000002.pt.sha256"} <= set(os.listdir(tmp_path))
    assert not any(n.endswith(".bin") for n in os.listdir(tmp_path))
    want = {k: v.clone() for k, v in state.model.state_dict().items()}
    again = _toy()
    with torch.no_grad():
        for p in again.model.parameters():
            p.zero_()
    ck2 = ripresa.Checkpointer(tmp_path, again, every=0, handle_signals=False)
    assert ck2.resume() == 2
    assert ck2.resumed_from.kind == "pt"
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, want[k])
    ck2.close()


def test_a_damaged_third_backend_generation_falls_back_to_an_older_one(tmp_path, pt_backend):
    state = _toy()
    with ripresa.Checkpointer(tmp_path, state, every=1, asynchronous=False, handle_signals=False) as ck:
        ck.resume()
        for step in (1, 2):
            _train(state)
            ck.step_done(step)
    p = tmp_path / "step_000002.pt"
    raw = bytearray(p.read_bytes())
    raw[-10] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.warns(ripresa.CheckpointWarning, match=r"\.pt generation 2 not used"):
        with ripresa.Checkpointer(tmp_path, _toy(), every=0, handle_signals=False) as ck:
            assert ck.resume() == 1


def test_a_single_process_session_resumes_a_newest_dcp_and_its_retention_keeps_it(tmp_path):
    """A .dcp (as a 1-rank FSDP2 session writes it) newer than the .bin ones: a single process resumes it, exactly,
    saying so; its own retention (keep_last=1) deletes its own kind only, never the .dcp."""
    from ripresa.core.state import Progress
    from ripresa.session.checkpointer import OtherModeWarning
    from ripresa.store.backend import DcpBackend
    from ripresa.store.retention import KeepLast

    with ripresa.Checkpointer(tmp_path, _toy(), every=1, asynchronous=False, handle_signals=False) as ck:
        ck.resume()
        for step in (1, 2):
            _train(ck.state)
            ck.step_done(step)
    saved = _toy()
    for _ in range(7):
        _train(saved)
    with CheckpointStore(tmp_path) as store:
        dcp_fmt.save_shards(saved.model, saved.optimizer, dcp_fmt.partial_path(tmp_path, 7), no_dist=True)
        assert DcpBackend(store).capture(7, saved, Progress(step=7), None)().valid
    state = _toy()
    with pytest.warns(OtherModeWarning, match=r"resuming step_000007\.dcp"):
        with ripresa.Checkpointer(tmp_path, state, every=1, asynchronous=False, handle_signals=False,
                                  retention=KeepLast(1)) as ck:
            assert ck.resume() == 7 and ck.resumed_from.kind == "dcp"
            for a, b in zip(state.model.parameters(), saved.model.parameters(), strict=True):
                assert torch.equal(a, b)
            for a, b in zip(state.optimizer.state.values(), saved.optimizer.state.values(), strict=True):
                assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
            for step in (8, 9):
                _train(state)
                ck.step_done(step)
    assert dcp_fmt.check_dcp(tmp_path, 7, deep=True).valid
    mine = sorted(g.step for g in ck.backend.generations() if g.valid)
    assert mine == [9] and ck.backend.kind != "dcp"  # keep_last=1 of its own kind; the .dcp stays
