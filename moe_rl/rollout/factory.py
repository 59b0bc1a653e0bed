"""The rollout engine ``rollout.engine`` names (what it samples with:
``moe_rl.step.plan.sampling_params``)."""

from __future__ import annotations

import torch

from moe_rl.config import RunConfig
from moe_rl.rollout.base import RolloutEngine


def build_engine(cfg: RunConfig, pad_id: int, device: torch.device | str = "cpu") -> RolloutEngine:
    """builtin (CPU or small GPU models, on ``device``: the learner's) or vllm (CUDA, its own)."""
    if cfg.rollout.engine == "vllm":
        from moe_rl.rollout.vllm.engine import VllmEngine  # vllm imports only where it is asked for

        return VllmEngine(cfg, cfg.model, pad_id=pad_id)
    from moe_rl.rollout.builtin import BuiltinEngine

    return BuiltinEngine(
        cfg.model,
        dtype=cfg.rollout.dtype,
        pad_id=pad_id,
        device=device,
        router_logit_noise=cfg.rollout.router_noise,
        inflight_kv=cfg.rollout.inflight_kv,
    )
