"""What a tool needs to build the network a checkpoint holds: a model factory, passed in by the caller.

The tools (``convert``, ``export``) read and write checkpoints of any model; they
never import the engine. The caller (``cli``, the engine) passes the factory of
its model: :data:`ripresa.engine.gpt.factory.GPT_FACTORY` for the ANDREA GPT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch


class ModelFactory(Protocol):
    def config(self, spec: str) -> dict[str, Any]:
        """A run config (with a ``model`` section) from a preset name or a file (``convert --config``)."""
        ...

    def build(self, cfg: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model and optimizer of a run config (its ``model`` and ``train`` sections), on the CPU."""
        ...

    def param_count(self, model_cfg: dict[str, Any]) -> int:
        """The parameter count of a ``model`` section, nothing allocated."""
        ...

    def build_model(self, model_cfg: dict[str, Any], n_params: int, where: Path) -> torch.nn.Module:
        """The model of a ``model`` section, refused (naming ``where``) unless it has ``n_params`` parameters."""
        ...

    def check_resume_state(self, cfg: dict[str, Any], state: dict[str, Any], where: Path) -> None:
        """Optional: refuse (:class:`~ripresa.errors.SchemaError`) a saved state a resume of ``cfg`` would refuse
        beyond the model (e.g. the data position); ``export --verify`` calls it when the factory has it."""
        ...
