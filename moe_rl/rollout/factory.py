"""The rollout engine ``rollout.engine`` names, and the sampling parameters of ``rollout.*``."""

from __future__ import annotations

import torch

from moe_rl.config import RunConfig
from moe_rl.rollout.base import RolloutEngine
from moe_rl.types import SamplingParams


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
    )


def sampling_params(cfg: RunConfig, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """What the engine samples with; the full distributions are returned when a correction needs them."""
    r, c = cfg.rollout, cfg.correction
    exact_trm = c.trm.on and c.trm.kl == "exact"
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=tuple(stop_token_ids),
        dvp_threshold=c.dvp_threshold,
        dvp_rule=c.dvp_rule,
        return_dist=exact_trm or c.dvp_threshold > 0,
    )
