"""A background save with a staging budget writes its live head while the loop waits: the head must be hashed
before the loop goes on, or the next step's values end in the digest (a committed file, a wrong sha256)."""

from __future__ import annotations

import time

import torch

import ripresa
from ripresa.io import fsio
from ripresa.store.general import validate_general
from ripresa.store.retention import KeepLast


def test_a_save_whose_live_head_changes_right_after_the_wait_commits_the_right_sha256(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 16 MB: hashed on the helper thread, behind the write
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ripresa.TrainingState(model=model, optimizer=opt)
    with ripresa.Checkpointer(tmp_path, state, every=1, staging_budget=1024, handle_signals=False,
                              retention=KeepLast(10)) as ck:
        ck.resume()
        for step in range(1, 4):
            fsio._hasher().submit(time.sleep, 0.3)  # the hash helper busy: the save's hashing lags its writes
            ck.step_done(step)  # the live head (the weight, beyond the 1 kB budget) is written before it returns
            with torch.no_grad():
                model.weight.add_(1.0)  # ... and the loop changes it at once
        ck.close(final_save=False)
    for step in range(1, 4):
        g = validate_general(tmp_path, step, deep=True).generation
        assert g.valid, (step, g.reason)
