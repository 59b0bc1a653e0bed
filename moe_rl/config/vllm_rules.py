"""What the vLLM engine can and cannot give the learner, as rules on a config (pure: no vllm
import, so the config loader refuses a vLLM run on any machine; ``moe_rl/rollout/vllm/`` uses
``logprobs_mode`` to build the engine). What needs the machine (CUDA, vllm installed) is checked
when a run starts, in ``moe_rl/preflight.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.config.fp8_rules import fp8_block_refusal
from moe_rl.errors import ConfigError

if TYPE_CHECKING:
    from moe_rl.config import RunConfig


def logprobs_mode(temperature: float, top_k: int, top_p: float, dvp: bool = False) -> str:
    """vLLM's ``logprobs_mode`` whose sampled-token log-prob equals the learner's
    log softmax(logits / temperature) over the full vocabulary (with ``dvp``: over the DVP safe
    set); ValueError when none does. (Used by ``moe_rl/rollout/vllm/requests.py``.)"""
    if top_k == 0 and top_p >= 1.0:
        return "processed_logprobs"  # temperature (and the DVP mask) are the only processors
    if dvp:
        raise ValueError(
            f"with DVP the log-probs must come after the DVP mask and temperature "
            f"(processed_logprobs), and those would also be renormalised over top_k={top_k}, "
            f"top_p={top_p}, unlike the learner's safe-set log-probs: use top_k=0 top_p=1"
        )
    if temperature == 1.0:
        return "raw_logprobs"  # before top-k/top-p, so not renormalised; T = 1 needs no scaling
    raise ValueError(
        f"vLLM reports log-probs either before temperature (raw) or after top-k/top-p "
        f"renormalisation (processed); with temperature {temperature} and top_k={top_k}, "
        f"top_p={top_p} neither is the learner's full-vocabulary log softmax(z / T) "
        f"(vllm#42259). Use top_k=0 top_p=1, or temperature=1"
    )


def check_vllm(cfg: RunConfig) -> None:
    """rollout.engine=vllm: refuse (ConfigError), naming the key, what the vLLM engine cannot give
    the learner."""
    r, c, v = cfg.rollout, cfg.correction, cfg.rollout.vllm

    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"config key '{key}': {why} (rollout.engine=vllm)")

    try:
        logprobs_mode(r.temperature, r.top_k, r.top_p, dvp=c.dvp.on)
    except ValueError as e:
        refuse("rollout.top_p", str(e))
    if r.quantization == "fp8" and r.dtype != "bf16":
        refuse(
            "rollout.quantization",
            f"fp8 with rollout.dtype={r.dtype}: vLLM's online FP8 takes bf16 or fp16 activations; "
            f"use rollout.dtype=bf16",
        )
    if r.quantization == "fp8" and r.fp8_granularity == "block":  # per-tensor scales tile any shape
        bad = fp8_block_refusal(cfg.model, v.tensor_parallel)
        if bad is not None:
            refuse(*bad)
    if r.router_noise > 0:
        refuse("rollout.router_noise", "router-logit noise exists only in the built-in engine")
    if r.inflight_kv != "keep":
        refuse(
            "rollout.inflight_kv",
            f"{r.inflight_kv}: vLLM's in-flight updates keep the running requests' KV cache (keep); "
            f"the re-prefill is built for the built-in engine only",
        )
    if c.needs_full_dists:
        refuse(
            "correction.trm.kl",
            "exact TRM needs the rollout's full distributions; vLLM returns top-k "
            "log-probs only: use correction.trm.kl=sample",
        )
    p = cfg.parallel
    engine_ranks, which = (
        (p.rollout_ranks, "parallel.rollout_ranks") if p.rollout_ranks else (p.nproc, "parallel.nproc")
    )
    if engine_ranks % v.tensor_parallel:
        refuse(
            "rollout.vllm.tensor_parallel",
            f"{v.tensor_parallel} does not divide {which} {engine_ranks} "
            f"(each engine spans consecutive ranks)",
        )
    if cfg.model.num_attention_heads % v.tensor_parallel:
        refuse(
            "rollout.vllm.tensor_parallel",
            f"{v.tensor_parallel} does not divide model.num_attention_heads {cfg.model.num_attention_heads}",
        )
