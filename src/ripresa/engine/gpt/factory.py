"""The ANDREA GPT as a :class:`~ripresa.tools.models.ModelFactory`: what ``cli`` passes to convert and export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import model_for_generation, resolve_config
from .model import GPT, from_config_dict
from .sources import check_sampler_state


class GPTFactory:
    def config(self, spec: str) -> dict[str, Any]:
        return resolve_config(spec, (), None)

    def build(self, cfg: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = GPT(from_config_dict(cfg["model"]))
        t = cfg.get("train", {})
        opt = model.configure_optimizer(float(t.get("lr", 1e-3)), float(t.get("weight_decay", 0.0)),
                                        tuple(t.get("betas", (0.9, 0.999))), "cpu")
        return model, opt

    def param_count(self, model_cfg: dict[str, Any]) -> int:
        return from_config_dict(model_cfg).param_count()

    def build_model(self, model_cfg: dict[str, Any], n_params: int, where: Path) -> torch.nn.Module:
        return GPT(model_for_generation(model_cfg, n_params, file=where))

    def check_resume_state(self, cfg: dict[str, Any], state: dict[str, Any], where: Path) -> None:
        """What a resume of ``cfg`` checks of the saved state beyond the model: the data sampler's sizes and counts."""
        data = state.get("data")
        if data is None:
            return
        model, train = cfg.get("model"), cfg.get("train")
        block = model.get("block_size") if isinstance(model, dict) else None
        batch = train.get("batch_size") if isinstance(train, dict) else None
        check_sampler_state(data, block_size=block if type(block) is int else None,
                            batch_size=batch if type(batch) is int else None, where=where)


GPT_FACTORY = GPTFactory()
