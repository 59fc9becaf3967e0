"""One validator per part of a saved state, run once per restore (docs/ARCHITECTURE.md, "One resume")."""

from __future__ import annotations

import collections
import sys

import torch

import ripresa

CHECKS = {"validate_saved_state", "check_structure", "check_identity", "check_optimizer_state"}


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, ripresa.TrainingState]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = ripresa.EpochSampler(10, batch_size=2, seed=1)
    return model, opt, ripresa.TrainingState(model=model, optimizer=opt, data=data, config={"toy": 1})


def test_a_general_resume_checks_each_part_once(tmp_path):
    model, opt, state = _state()
    with ripresa.Checkpointer(tmp_path / "run", state, every=2, handle_signals=False, asynchronous=False) as ck:
        ck.resume()
        for step in (1, 2):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            ck.step_done(step)
    model2, _, state2 = _state()
    calls: collections.Counter[str] = collections.Counter()

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_name in CHECKS and "ripresa" in frame.f_code.co_filename:
            calls[frame.f_code.co_name] += 1

    with ripresa.Checkpointer(tmp_path / "run", state2, every=2, handle_signals=False, asynchronous=False) as ck:
        sys.setprofile(count)
        try:
            step = ck.resume()
        finally:
            sys.setprofile(None)
        assert step == 2 and ck.resumed_from.path.name == "step_000002.safetensors"
        assert torch.equal(model2.weight, model.weight)
    assert dict(calls) == {name: 1 for name in CHECKS}  # the load checks the structure; the state, the rest
