"""The Checkpointer's save pipeline (session/saving.py): picked once; each sidecar written once per save."""

from __future__ import annotations

import json

import pytest
import torch

import ripresa
from ripresa.session.saving import LocalPipeline


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, ripresa.TrainingState]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, ripresa.TrainingState(model=model, optimizer=opt, config={"toy": 1})


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_sidecar_is_written_once_per_save_with_the_saved_step(tmp_path, asynchronous):
    model, opt, state = _state()
    calls: list[int] = []
    ck = None

    def sidecar() -> dict:
        calls.append(ck.progress.step)
        return {"step": ck.progress.step}

    ck = ripresa.Checkpointer(tmp_path / "run", state, every=2, handle_signals=False, asynchronous=asynchronous,
                              sidecars={"side.json": sidecar}, save_on_close=False)
    assert type(ck.pipeline) is LocalPipeline and (ck.pipeline.writer is not None) == asynchronous
    start = ck.resume()
    for step in range(start + 1, 7):
        _step(model, opt)
        ck.step_done(step)
        if step % 2 == 0:
            assert json.loads((tmp_path / "run" / "side.json").read_text()) == {"step": step}
    assert calls == [2, 4, 6]  # once per save, never twice
    if not asynchronous:
        assert ck.save_now() is None and calls == [2, 4, 6]  # step 6 is committed: nothing is written again
    ck.close()
    assert ck.last_saved_step == 6
