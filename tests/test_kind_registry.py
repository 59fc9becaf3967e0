"""A new kind of generation is one module and one registration line (docs/ARCHITECTURE.md, "Storage backends").

The ``.npz`` kind below (weights in ``step_NNNNNN.npz``, the rest in its companion, the one commit
protocol, the shared marker and companion checks) is registered with one ``register_backend`` line;
nothing else in ripresa changes, and the session saves and resumes it, the registry lists and
retains it, the signature check and ``ripresa inspect`` see it, and ``owner_of`` names its files.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

import ripresa
from ripresa.core.state import Progress, TrainingState
from ripresa.errors import IntegrityError, RipresaError
from ripresa.formats import companion as companion_fmt
from ripresa.formats.generation import Checks, Generation, reason_of
from ripresa.formats.naming import NameFormat
from ripresa.io import auth
from ripresa.io.fsio import StagedFile, read_small, sha256_file, sidecar_line
from ripresa.store.backend import (
    BackendBase,
    BackendSpec,
    backend_of,
    owner_of,
    register_backend,
    unregister_backend,
)
from ripresa.store.commit import (
    CheckpointWarning,
    Written,
    commit_generation,
    companion_checks,
    delete_files,
    marker_checks,
)
from ripresa.store.restore import Loaded
from ripresa.store.retention import KeepLast

FORMAT = "test.npz"


def _envelope(doc: object, path: Path) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("state"), dict):
        raise IntegrityError("not a .npz companion", file=path, expected=FORMAT, found=str(doc)[:80])


# ---- the whole kind: one module's worth ------------------------------------------------------


class NpzBackend(BackendBase):
    """``step_NNNNNN.npz`` (the model's tensors) + ``.npz.json`` (the rest) + ``.npz.sha256`` (the marker)."""

    kind = "npz"
    label = ".npz generation"
    written_by = ".npz ones are written by the test kind"
    names = NameFormat(".npz", companion="+.json")

    def check(self, step: int, *, deep: bool = False) -> Generation:
        f, c, mk = self.names.paths(self.folder, step)
        key, checks = self.store.signature_key(), Checks()
        try:
            f_sha, c_sha = marker_checks(checks, f, c, mk, step, key)
            with checks.run("npz sha256", expected=f_sha) as found:
                found["found"] = sha256_file(f).sha256
                if found["found"] != f_sha:
                    raise IntegrityError("sha256 mismatch: the .npz changed after it was committed", file=f,
                                         expected=f_sha, found=found["found"])
            companion_checks(checks, c, c_sha, lambda p: read_small(p, "companion", 1 << 20, error=IntegrityError),
                             FORMAT, _envelope)
        except RipresaError as exc:
            return Generation(step, self.kind, f, c, mk, valid=False, reason=reason_of(exc), checks=tuple(checks))
        return Generation(step, self.kind, f, c, mk, valid=True, size=f.stat().st_size, files={f.name: f_sha, c.name: c_sha},
                          deep_checked=True, signature_verified=key is not None, checks=tuple(checks))

    def at_path(self, path: Path) -> Generation:
        return self.check(self.names.parse(path))

    def load(self, gen: Generation, state: TrainingState) -> Loaded:
        with np.load(gen.path, allow_pickle=False) as z:
            model = {k: torch.from_numpy(z[k].copy()) for k in z.files}
        doc = companion_fmt.loads_bounded(gen.companion.read_bytes(), file=gen.companion)
        saved = companion_fmt.decode_tree(doc["state"])
        saved["model"] = model
        return Loaded(saved, True, lambda *a: None, gen.companion)

    def commit_for(self, step, state, progress, extra, *, stage=None, world_size=1):
        snap = state.snapshot(progress, extra)
        model = {k: v.detach().cpu().numpy() for k, v in snap.pop("model").items()}
        encoded = companion_fmt.encode_tree(snap)
        f, c, mk = self.names.paths(self.folder, step)

        def write() -> Written:
            buf = io.BytesIO()
            np.savez(buf, **model)
            with StagedFile(f) as ff:
                ff.write(buf.getvalue())
                fd = ff.finish()
                with StagedFile(c) as fc:
                    fc.write(companion_fmt.dumps({"format": FORMAT, "state": encoded}))
                    cd = fc.finish()
                    ff.publish()
                    fc.publish()
            return Written([sidecar_line(fd, f.name), sidecar_line(cd, c.name)],
                           lambda k: auth.signature_line(k, step, f.name, fd.sha256, c.name, cd.sha256))

        return lambda: commit_generation(self.folder, step, marker=mk, signature=auth.signature_path(f),
                                         key=self.store.hmac_key, write=write, check=lambda: self.check(step),
                                         what=".npz generation", file=f)

    def delete(self, step: int) -> None:
        f, c, mk = self.names.paths(self.folder, step)
        delete_files(mk, auth.signature_path(f), f, c)


# ---- its one registration line, and what the rest of ripresa does with it ---------------------------------


@pytest.fixture
def npz_kind():
    register_backend(BackendSpec("npz", NpzBackend, {"single": 1}, "npz"))
    try:
        yield
    finally:
        unregister_backend("npz")


def _toy() -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return TrainingState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config={"toy": True})


def _train(state: TrainingState) -> None:
    state.optimizer.zero_grad()
    state.model(torch.randn(8, 4)).pow(2).mean().backward()
    state.optimizer.step()


def test_a_registered_npz_kind_is_saved_listed_retained_resumed_and_inspected(npz_kind, tmp_path):
    from ripresa.tools.inspect import inspect_path

    state = _toy()
    with ripresa.Checkpointer(tmp_path, state, every=1, asynchronous=False, handle_signals=False,
                              retention=KeepLast(2)) as ck:
        assert ck.backend.kind == "npz"  # format="auto": the most preferred kind of the mode
        for step in range(1, 5):
            _train(state)
            ck.step_done(step)
    saved = {k: v.clone() for k, v in state.model.state_dict().items()}
    # retention (the registry's, after each commit): the two newest, every file of the others gone
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000003.npz", "step_000003.npz.json", "step_000003.npz.sha256",
        "step_000004.npz", "step_000004.npz.json", "step_000004.npz.sha256"]
    with ripresa.CheckpointStore(tmp_path, writer=False) as store:
        assert [(g.step, g.valid) for g in backend_of("npz", store).generations()] == [(3, True), (4, True)]
    assert owner_of("step_000004.npz.json")[:2] == (owner_of("step_000004.npz").spec, 4)
    assert owner_of("step_000004.npz.sha256").spec.kind == "npz" and owner_of("step_000004.npy") is None
    rows = inspect_path(tmp_path)["run"]["generations"]
    assert [(r["step"], r["kind"], r["valid"]) for r in rows] == [(3, "npz", True), (4, "npz", True)]

    fresh = _toy()
    with ripresa.Checkpointer(tmp_path, fresh, every=1, asynchronous=False, handle_signals=False) as ck:
        assert ck.resume() == 4 and ck.resumed_from.kind == "npz"
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, saved[k])

    # a flipped byte in the newest .npz: its named check fails and the resume falls back to step 3
    p = tmp_path / "step_000004.npz"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.warns(CheckpointWarning, match=r"\.npz generation 4 not used: sha256 mismatch"):
        with ripresa.Checkpointer(tmp_path, _toy(), every=1, asynchronous=False, handle_signals=False,
                                  save_on_close=False) as ck:
            assert ck.resume() == 3


def test_the_signature_check_and_the_names_go_through_the_kinds(npz_kind, tmp_path, monkeypatch):
    from ripresa.store.kinds import check_generation_file, spec_of
    from ripresa.store.mirror import main_of

    monkeypatch.setenv("RIPRESA_HMAC_KEY", "k" * 32)
    with ripresa.CheckpointStore(tmp_path) as store:  # a writer with a key signs what its kinds commit
        state = _toy()
        _train(state)
        assert backend_of("npz", store).save(1, state, Progress(step=1)).valid
    assert (tmp_path / "step_000001.npz.hmac").is_file()
    check_generation_file(tmp_path / "step_000001.npz")  # `ripresa inspect --require-signature FILE`
    check_generation_file(tmp_path / "step_000001.npz.json")
    (tmp_path / "step_000001.npz.hmac").unlink()
    with pytest.raises(auth.SignatureError, match="not trusted under --require-signature"):
        check_generation_file(tmp_path / "step_000001.npz")
    # every kind names its own files; old names still read
    assert [owner_of(n)[1:] for n in ("step_000007.bin", "step_000007.json", "step_000007.safetensors.json",
                                      "step_000007.dcp/.metadata", "step_000007.dcp.sha256")] == [
        (7, "step_000007.bin"), (7, "step_000007.bin"), (7, "step_000007.safetensors"),
        (7, "step_000007.dcp"), (7, "step_000007.dcp")]
    assert owner_of("step_0000007.bin") is None and owner_of("step_000007.bin/x") is None
    # a mirror's object keys: only main/<file> may hold a slash
    assert main_of("step_000007.dcp/.metadata") == ("step_000007.dcp", 7) and main_of("x/step_000007.bin") is None
    assert spec_of("st") is spec_of("general") and spec_of("general").naming.files(3) == (
        "step_000003.safetensors", "step_000003.safetensors.json", "step_000003.safetensors.hmac",
        "step_000003.safetensors.sha256")


@pytest.mark.parametrize("fmt", ["andrea", "general"])
def test_each_commit_is_retained_once_by_the_registry(fmt, tmp_path, monkeypatch):
    from ripresa.store.folder import RunFolder

    calls: list[list[str]] = []
    retain = RunFolder.retain

    def counted(self, kinds, **kw):
        kinds = list(kinds)
        calls.append(sorted(k.kind for k in kinds))
        return retain(self, kinds, **kw)

    monkeypatch.setattr(RunFolder, "retain", counted)
    state = _toy()
    with ripresa.Checkpointer(tmp_path, state, every=1, asynchronous=False, handle_signals=False, format=fmt,
                              retention=KeepLast(1), save_on_close=False) as ck:
        for step in (1, 2, 3):
            _train(state)
            ck.step_done(step)
    # one pass per commit (a .bin save used to retain twice), over the kinds of one sequence (bin + general + shards)
    assert calls == [["bin", "general", "shards"]] * 3
    assert len(list(tmp_path.glob("step_*.sha256"))) == 1
