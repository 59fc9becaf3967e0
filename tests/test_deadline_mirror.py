"""A deadline with a mirror (docs/CADENCE.md "Deadline", docs/MIRROR.md): stop, save, upload, export before it.

Default tier: a plain ``Checkpointer`` loop (general format) with a real
local-path mirror: the plan at the stop used the mirror's measured upload,
the stop generation's marker is in the mirror before ``deadline_done``, and
the export (``export_run``, no model factory) ran and verifies, all before
the deadline. Long tier: ``ripresa train --deadline <now+60 s> --mirror
s3://...`` against the real moto server of tests/support/s3fixtures.py.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
import torch
from conftest import ripresa_cli

import ripresa
from ripresa.store.history import read_history
from ripresa.store.mirror import MirrorSpec
from ripresa.tools.export import export_run, verify_export

pytest_plugins = ["support.s3fixtures"]  # the fixtures moto, s3


def _index(events: list[dict], name: str, **match) -> int:
    return next(i for i, e in enumerate(events) if e["event"] == name and all(e.get(k) == v for k, v in match.items()))


def test_deadline_with_a_local_mirror_uploads_the_final_generation_then_exports_before_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = ripresa.TrainingState(model=model, optimizer=opt, config={"steps": 10_000})
    run, remote = tmp_path / "run", tmp_path / "other-disk" / "mirror"
    bundle = run / "exports" / "deadline"
    deadline = time.time() + 10.0  # the tail alone is >= 7 s (margin 5 s, export estimate 2 s): the stop comes ~3 s in
    ckpt = ripresa.Checkpointer(run, state, every=2, mirror=MirrorSpec(str(remote), backoff=0.02, max_backoff=0.2),
                                deadline=datetime.fromtimestamp(deadline, UTC), handle_signals=False,
                                on_deadline=lambda step: export_run(run, bundle, step=step, show_progress=False))
    ckpt.resume()
    x = torch.randn(32, 8)
    stopped, step = False, 0
    while not stopped and step < 5000:
        step += 1
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)
        stopped = ckpt.step_done(step, loss=loss.item())
        if ckpt.last_saved_step == 2 and ckpt.mirror.last_upload_seconds is None:  # the first save: let its upload finish
            for _ in range(500):
                if ckpt.mirror.last_upload_seconds is not None:
                    break
                time.sleep(0.01)
    ckpt.close()
    finished = time.time()
    events = read_history(run / ".loss.jsonl").events
    print([e for e in events if "event" in e and e["event"] != "start"])  # shown when the test fails
    assert stopped and ckpt.deadline.stopped_at_step == step
    stop, done = events[_index(events, "deadline_stop")], events[_index(events, "deadline_done")]
    uploads = [e for e in events if e["event"] == "mirror_uploaded"]
    assert uploads[0]["step"] == 2 and uploads[-1]["step"] == step
    # the plan at the stop used a measured upload (checkpointer.mirror.last_upload_seconds), not an estimate
    assert "upload" not in stop["estimated"] and "save" not in stop["estimated"]
    assert any(abs(stop["upload_s"] - e["seconds"]) <= 0.001 for e in uploads[:-1])
    # the final generation was uploaded (marker last) before deadline_done, then the export ran
    assert _index(events, "mirror_uploaded", step=step) < _index(events, "deadline_done")
    assert (remote / f"step_{step:06d}.safetensors.sha256").read_bytes() == (run / f"step_{step:06d}.safetensors.sha256").read_bytes()
    assert done["mirror_drained"] is True and 0 < done["drain_budget_s"] <= deadline - stop["time"]
    assert done["export"] == str(bundle) and done["met"] is True and finished < deadline
    assert verify_export(bundle)["reload"]["step"] == step


@pytest.mark.slow
def test_ripresa_train_deadline_with_an_s3_mirror_stops_saves_uploads_exports_before_it(tmp_path, s3):
    """`ripresa train --deadline <now+60 s> --mirror s3://...` (real moto server): all done before the deadline."""
    run = tmp_path / "run"
    deadline = datetime.now(UTC) + timedelta(seconds=60)
    text = deadline.isoformat(timespec="seconds").replace("+00:00", "Z")
    res = ripresa_cli("train", "--run", run, "--config", "tiny", "--threads", "1", "--set", "train.batch_size=4",
                      "--no-audit", "--quiet", "--steps", "10000000", "--every", "auto", "--mtbf", "1h", "--deadline", text,
                      "--mirror", s3.url, timeout=180)
    finished = datetime.now(UTC)
    assert res.returncode == 0, res.stderr
    assert "stopped for the deadline" in res.stdout
    events = read_history(run / ".loss.jsonl").events
    stop, done = events[_index(events, "deadline_stop")], events[_index(events, "deadline_done")]
    print(f"stopped at step {stop['step']}: {stop}; {done}")
    step = stop["step"]
    assert "upload" not in stop["estimated"] and stop["upload_s"] >= 0
    assert _index(events, "mirror_uploaded", step=step) < _index(events, "deadline_done")
    keys = s3.keys()
    marker = f"step_{step:06d}.bin.sha256"
    assert s3.get(marker) == (run / marker).read_bytes()
    assert all(name in keys for name in (f"step_{step:06d}.bin", f"step_{step:06d}.json"))
    assert done["mirror_drained"] is True and done["met"] is True
    assert finished < deadline.replace(microsecond=0), "the process exited after the deadline"
    bundle = run / "exports" / f"deadline-step_{step:06d}"
    check = ripresa_cli("export", "--verify", bundle, "--json", timeout=120)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["reload"]["step"] == step
