"""The rollout engine ``rollout.engine`` names (what it samples with:
``moe_rl.step.plan.sampling_params``)."""

from __future__ import annotations

import torch

from moe_rl.config import RunConfig
from moe_rl.rollout.base import RolloutEngine


def engine_tp(cfg: RunConfig) -> int:
    """Ranks per engine: vLLM's tensor parallel, 1 for the built-in engine."""
    return cfg.rollout.vllm.tensor_parallel if cfg.rollout.engine == "vllm" else 1


def build_engine(cfg: RunConfig, pad_id: int, device: torch.device | str = "cpu", dims=None) -> RolloutEngine:
    """builtin (CPU or small GPU models, on ``device``: the learner's) or vllm (CUDA, its own);
    ``dims``: the trainer's ranks (colocated: they generate at once). A learner rank of a split
    world talks to a stand-in instead (``moe_rl/pipeline/engines.py``)."""
    if cfg.rollout.engine == "vllm":
        from moe_rl.rollout.vllm.engine import VllmEngine  # vllm imports only where it is asked for

        # the trainer's ranks all generate at once (SPMD): a call several engines ask is shared out
        return VllmEngine(cfg, cfg.model, pad_id=pad_id, colocated=dims is not None)
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.rollout.prefix_cache import PrefixCachedEngine

    r = cfg.rollout
    cached = {"max_blocks": r.prefix_cache_blocks, "block_tokens": r.prefix_block_tokens}
    return (PrefixCachedEngine if r.prefix_cache_blocks else BuiltinEngine)(
        cfg.model,
        **(cached if r.prefix_cache_blocks else {}),
        dtype=cfg.rollout.dtype,
        pad_id=pad_id,
        device=device,
        router_logit_noise=cfg.rollout.router_noise,
        inflight_kv=cfg.rollout.inflight_kv,
        quantization=cfg.rollout.quantization,
        quantize=cfg.rollout.quantize,
        fp8_granularity=cfg.rollout.fp8_granularity,
        kv_cache_dtype=cfg.rollout.kv_cache_dtype,
    )
