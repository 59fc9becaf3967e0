"""The whole run survives the machine (docs/MIRROR.md "The run's own files"): the mirror carries ``.loss.jsonl``
(immutable byte-range segments), the sidecars, ``config.json``, ``lineage.json`` and ``archive/``, hash-checked
both ways; a blank machine's resume restores them, so the history covers the run from step 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, ripresa_cli

import ripresa
from ripresa.io.objstore import open_store
from ripresa.store.history import HISTORY_NAME, read_history
from ripresa.store.mirror import RUN_MANIFEST, MirrorSpec, RunManifest, restore_run

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3, proxy


def fast(url: str, **kw) -> MirrorSpec:
    return MirrorSpec(url, **{"timeout": 5.0, "attempts": 4, "backoff": 0.02, "max_backoff": 0.2, "close_timeout": 30.0,
                              **kw})


def session(run: Path, steps: int, mirror, *, before=None) -> int:
    """A small Checkpointer loop with a sidecar (.state.json) written beside each checkpoint; returns the resume step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"steps": steps})
    box = {"step": 0}
    ckpt = ripresa.Checkpointer(run, state, every=3, mirror=mirror, handle_signals=False,
                                sidecars={".state.json": lambda: {"bandit_at": box["step"]}})
    start = ckpt.resume()
    if before is not None:
        before(run)
    for step in range(start + 1, steps + 1):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        box["step"] = step
        ckpt.step_done(step, loss=loss.item())
    ckpt.close(final_save=True)
    return start


def remote_history(store) -> bytes:
    man = RunManifest.parse(store.get_bytes(RUN_MANIFEST, limit=1 << 20), "run.json")
    return b"".join(store.get_bytes(k, limit=e - s) for k, s, e, _ in man.history)


def test_a_blank_machine_resume_restores_the_whole_history_and_the_sidecars(tmp_path, s3):
    run = tmp_path / "run"

    def extras(run: Path) -> None:  # what the engine and ripresa pivot/fork leave beside the history
        (run / ".samples.json").write_text(json.dumps({"audits": [{"step": 3, "text": "ciao"}]}))
        (run / "lineage.json").write_text(json.dumps({"parent": "elsewhere", "step": 0}))
        (run / "archive" / "pivot_000003").mkdir(parents=True)
        (run / "archive" / "pivot_000003" / ".state.json").write_text('{"old": true}')

    session(run, 11, fast(s3.url), before=extras)
    original = read_history(run / HISTORY_NAME)
    keys = s3.keys()
    assert RUN_MANIFEST in keys and any(k.startswith("history/") for k in keys)
    store = open_store(s3.url)
    mirrored = remote_history(store)
    local = (run / HISTORY_NAME).read_bytes()
    assert local.startswith(mirrored) and len(mirrored) > len(local) // 2  # segments in order, whole lines
    sidecars = {n: (run / n).read_bytes() for n in (".samples.json", ".state.json", "lineage.json", "config.json",
                                                      "archive/pivot_000003/.state.json")}
    shutil.rmtree(run)  # the machine is gone

    new = tmp_path / "new"
    start = session(new, 14, fast(s3.url))
    assert start == 11  # the final generation (close) was uploaded with the history up to it
    view = read_history(new / HISTORY_NAME)
    assert sorted(view.steps) == list(range(1, 15))  # the whole run, from step 1
    for s in range(1, 12):
        assert view.steps[s]["loss"] == original.steps[s]["loss"]
    restored = [e for e in view.events if e["event"] == "history_restored"]
    assert len(restored) == 1 and restored[0]["pulled_step"] == 11 and restored[0]["through_step"] == 11
    assert restored[0]["bytes"] == len(mirrored) and not restored[0]["refused"]
    resume = [e for e in view.events if e["event"] == "resume"]
    assert resume[-1]["from_step"] == 11
    for name in (".samples.json", "lineage.json", "archive/pivot_000003/.state.json"):
        assert (new / name).read_bytes() == sidecars[name], name
    assert json.loads((new / ".state.json").read_text()) == {"bandit_at": 14}  # rewritten at the new checkpoints
    # and the new session mirrored on from there: the store's history is the new folder's beginning
    assert (new / HISTORY_NAME).read_bytes().startswith(remote_history(open_store(s3.url)))


def test_hostile_run_files_in_the_store_are_refused_and_nothing_escapes(tmp_path):
    remote, run = tmp_path / "mirror", tmp_path / "run"
    session(run, 7, fast(str(remote)))
    man = json.loads((remote / RUN_MANIFEST).read_text())
    assert len(man["history"]) >= 2
    store = open_store(str(remote))

    def restore(into: Path) -> tuple[dict | None, list[dict]]:
        into.mkdir()
        seen: list[dict] = []
        got = restore_run(store, into, event=lambda name, **kw: seen.append({"event": name, **kw}))
        return got, seen

    # a flipped byte in the last segment: the history comes back up to the segment before it
    last_key, start = man["history"][-1][0], man["history"][-1][1]
    data = bytearray((remote / last_key).read_bytes())
    data[len(data) // 2] ^= 1
    (remote / last_key).write_bytes(bytes(data))
    got, seen = restore(tmp_path / "a")
    assert got["history_bytes"] == start and got["refused"] == [last_key]
    assert (tmp_path / "a" / HISTORY_NAME).read_bytes() == (run / HISTORY_NAME).read_bytes()[:start]
    assert [e["file"] for e in seen if e["event"] == "mirror_refused"] == [last_key]
    # a manifest naming a path outside the run folder, or a link target: refused whole, nothing written
    for evil in ("../escape", "archive/../../escape", "/etc/passwd", "archive"):
        bad = dict(man, files={**man["files"], evil: list(man["files"]["config.json"])})
        (remote / RUN_MANIFEST).write_text(json.dumps(bad))
        into = tmp_path / f"evil{abs(hash(evil))}"
        got, seen = restore(into)
        assert got is None and seen[0]["event"] == "mirror_refused" and "malformed run manifest" in seen[0]["reason"]
        assert os.listdir(into) == [] and not (tmp_path / "escape").exists()
    # a history segment that claims more bytes than its name, or a gap: refused whole
    # (a missing first segment always; a missing middle one when the session uploaded three or more: with two,
    # first + last is the whole history, no gap)
    gaps = [man["history"][1:]] + ([[man["history"][0], man["history"][-1]]] if len(man["history"]) >= 3 else [])
    for i, history in enumerate(gaps):
        (remote / RUN_MANIFEST).write_text(json.dumps(dict(man, history=history)))
        assert restore(tmp_path / f"gap{i}")[0] is None
    # a link in place of a local sidecar is never read nor uploaded
    (run / ".samples.json").symlink_to("/etc/hostname")
    (remote / RUN_MANIFEST).write_text(json.dumps(man))
    session(run, 10, fast(str(remote)))
    man2 = json.loads((remote / RUN_MANIFEST).read_text())
    assert ".samples.json" not in man2["files"] and "config.json" in man2["files"]
    assert man2["history"][0] == man["history"][0]  # append-only: earlier segments stay as they were
    sha = hashlib.sha256((run / ".state.json").read_bytes()).hexdigest()
    assert man2["files"][".state.json"][0] == sha and (remote / "files" / sha).is_file()


@pytest.mark.slow
def test_ripresa_train_on_a_blank_machine_restores_the_run_so_plot_sees_it_from_step_1(tmp_path, s3):
    common = ["--every", "2", "--quiet", "--threads", "1", "--device", "cpu"]
    a = ripresa_cli("train", "--run", tmp_path / "a", "--config", "tiny", "--steps", "6", "--mirror", s3.url, *common,
                    cwd=REPO)
    assert a.returncode == 0, a.stderr[-3000:]
    before = {n: (tmp_path / "a" / n).read_bytes() for n in (".samples.json", ".state.json")
              if (tmp_path / "a" / n).exists()}
    shutil.rmtree(tmp_path / "a")
    b = ripresa_cli("train", "--run", tmp_path / "b", "--steps", "2", "--mirror", s3.url, *common, cwd=REPO)
    assert b.returncode == 0, b.stderr[-3000:]
    view = read_history(tmp_path / "b" / HISTORY_NAME)
    assert sorted(view.steps) == list(range(1, 9))
    assert any(e["event"] == "history_restored" and e["pulled_step"] == 6 for e in view.events)
    assert ".state.json" in before and (tmp_path / "b" / ".state.json").exists()
    png = tmp_path / "b.png"
    p = ripresa_cli("plot", tmp_path / "b", "--png", png, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    assert png.stat().st_size > 0
