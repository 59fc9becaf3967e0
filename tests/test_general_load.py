"""The load path of a general generation (docs/FORMAT.md, "Reading (hostile-safe)"): one open of the tensor file,
the header parsed once per resume, reads into the tensors' own memory in pieces hashed in the same pass."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

import ripresa
from ripresa.errors import IntegrityError
from ripresa.formats import safetensors_file as st
from ripresa.store.general import GeneralBackend, general_paths
from ripresa.store.store import CheckpointStore


def _state() -> ripresa.TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(40)], torch.nn.Linear(3, 300))
    model[-1].to(torch.bfloat16)
    model.register_buffer("flags", torch.arange(7, dtype=torch.int16))
    return ripresa.TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _run(folder, steps: int) -> ripresa.TrainingState:
    state = _state()
    with ripresa.Checkpointer(folder, state, every=1, asynchronous=False, handle_signals=False) as ck:
        for step in range(ck.resume() + 1, steps + 1):
            state.optimizer.zero_grad()
            sum(p.float().sum() for p in state.model.parameters()).backward()
            state.optimizer.step()
            ck.step_done(step)
    return state


@pytest.mark.parametrize("piece", [7, 4096, st.READ_PIECE])
def test_any_piece_size_reads_the_same_bytes_and_the_same_digest(tmp_path, piece):
    """Small tensors gathered into one readv, tensors split across pieces: the tensors and the sha256 are those of
    the file's bytes, whatever the piece."""
    _run(tmp_path, 1)
    f, _, _ = general_paths(tmp_path, 1)
    raw = f.read_bytes()
    header, tensors, digest = st.read(f, piece=piece)
    assert digest == hashlib.sha256(raw).hexdigest() and len(tensors) > 80
    for e in header.entries:
        t = tensors[e.key]
        assert t.dtype == e.torch_dtype and tuple(t.shape) == e.shape
        assert st.as_bytes(t).numpy().tobytes() == raw[header.data_start + e.begin: header.data_start + e.end]


def test_one_header_parse_per_resume_and_a_header_changed_after_the_check_is_refused(tmp_path, monkeypatch):
    want = _run(tmp_path, 2)
    calls = []
    real = st.parse_header
    monkeypatch.setattr(st, "parse_header", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    again = _state()
    with ripresa.Checkpointer(tmp_path, again, every=0, handle_signals=False) as ck:
        assert ck.resume() == 2
    assert len(calls) == 1  # the resume's check parsed it; the load reused it (its bytes unchanged)
    for a, b in zip(want.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # a header changed between the check and the load: refused (and a resume falls back to the older generation)
    backend = GeneralBackend(CheckpointStore(tmp_path, writer=False))
    gen = backend.check_to_resume(2)
    f, _, _ = general_paths(tmp_path, 2)
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    assert raw[8 + n - 1:8 + n] == b" "  # the header's padding: still valid JSON after the edit
    raw[8 + n - 1] = ord("\t")
    f.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="header changed between its check and the load"):
        backend.load(gen, _state())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ripresa.Checkpointer(tmp_path, _state(), every=0, handle_signals=False) as ck:
            assert ck.resume() == 1
    assert any("generation 2" in str(w.message) for w in caught)
