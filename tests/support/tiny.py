"""The tiny training state the tests share (tests/README.md, "Shared helpers").

:func:`tiny_state` builds a real ``ripresa.TrainingState`` of a tiny model, its
optimizer and, when asked, a scheduler, seeded so that two calls with the same
arguments hold the same bits. :func:`mlp_state` is the 8 -> 32 -> 8 autoencoder
the signature and hostile-DCP tests train; :func:`fit` takes its steps. Reach
the parts through the state (``state.model``, ``state.optimizer``,
``state.scheduler``); the ``tiny`` fixture of tests/conftest.py is the default.
"""

from __future__ import annotations

from typing import Any

import torch

import ripresa


def tiny_state(dims: tuple[int, int] = (4, 3), *, model: torch.nn.Module | None = None, seed: int | None = 0,
               optimizer: str = "adamw", lr: float = 1e-3, momentum: float = 0.0,
               scheduler: tuple[int, float] | None = None, **state_kw: Any) -> ripresa.TrainingState:
    """A ``TrainingState`` of ``model`` (default ``nn.Linear(*dims)``, built after ``torch.manual_seed(seed)``
    unless ``seed`` is None) with ``optimizer`` ``"adamw"`` or ``"sgd"`` (``lr``, SGD's ``momentum``) and, with
    ``scheduler=(step_size, gamma)``, a ``StepLR``; ``state_kw`` go to ``TrainingState`` (``config=``, ``data=``...)."""
    if seed is not None:
        torch.manual_seed(seed)
    if model is None:
        model = torch.nn.Linear(*dims)
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', not {optimizer!r}")
    sched = torch.optim.lr_scheduler.StepLR(opt, *scheduler) if scheduler is not None else None
    return ripresa.TrainingState(model=model, optimizer=opt, scheduler=sched, **state_kw)


def mlp(seed: int = 0) -> torch.nn.Module:
    """The 8 -> 32 -> 8 Tanh autoencoder (seeded)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def mlp_state(seed: int = 0, **state_kw: Any) -> ripresa.TrainingState:
    """:func:`mlp` with AdamW (lr 1e-3) in a ``TrainingState`` (``state_kw``: ``config=``...)."""
    return tiny_state(model=mlp(seed), seed=None, **state_kw)


def _batch() -> torch.Tensor:
    """The autoencoder's fixed batch (the same in every process)."""
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


def fit(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` full-batch AdamW steps of the autoencoder on its fixed batch."""
    x = _batch()
    for _ in range(steps):
        opt.zero_grad()
        (model(x) - x).pow(2).mean().backward()
        opt.step()
