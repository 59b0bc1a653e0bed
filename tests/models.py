"""The tiny model configs the tests share: one definition each, named by shape (L layers).

``TINY_MOE_L*``: 50-token vocabulary, hidden 64, 4 heads in 2 query groups, 4 experts top-2,
layer 0 dense: the learner, replay and checkpoint tests over gloo. ``MICRO_MOE``: the smallest
model that still routes (hidden 8, 2 layers, all MoE). ``DEFAULT_WIDTH_L3``: the default widths,
3 layers (memory estimates and layer specs, never built)."""

from __future__ import annotations

import dataclasses

from moe_rl.config import ModelConfig

TINY_MOE_L3 = ModelConfig(
    vocab_size=50,
    hidden_size=64,
    num_layers=3,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=96,
    moe_ffn_hidden_size=48,
    num_experts=4,
    moe_router_topk=2,
    first_k_dense=1,
    max_seq_len=32,
)
TINY_MOE_L4 = dataclasses.replace(TINY_MOE_L3, num_layers=4)
TINY_MOE_L6 = dataclasses.replace(TINY_MOE_L3, num_layers=6)
TINY_MOE_L2_ALL_MOE = dataclasses.replace(TINY_MOE_L3, num_layers=2, first_k_dense=0)

MICRO_MOE = ModelConfig(
    vocab_size=16,
    hidden_size=8,
    num_layers=2,
    num_attention_heads=2,
    num_query_groups=1,
    head_dim=4,
    ffn_hidden_size=8,
    moe_ffn_hidden_size=4,
    num_experts=4,
    moe_router_topk=2,
    max_seq_len=16,
)

DEFAULT_WIDTH_L3 = ModelConfig(vocab_size=50, num_layers=3, first_k_dense=1, num_experts=4, moe_router_topk=2)


def hf_tiny(**overrides: object) -> ModelConfig:
    """The HF-parity models (built-in engine, HF checkpoints): vocab 40, hidden 64, 3 layers (layer
    0 dense), 4 heads / 2 kv groups, 8 experts top-2; ``overrides`` replace fields."""
    base = ModelConfig(
        vocab_size=40,
        hidden_size=64,
        num_layers=3,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=96,
        moe_ffn_hidden_size=32,
        num_experts=8,
        moe_router_topk=2,
        first_k_dense=1,
        rope_theta=10000.0,
        norm_eps=1e-6,
        max_seq_len=64,
    )
    return dataclasses.replace(base, **overrides)


# DeepSeek-V3 / GLM-4.5-shaped router on TINY_MOE_L3's widths: sigmoid scores with an expert bias,
# 12 experts in 4 groups of 3, 3 groups per token, top-6 (not a power of two; 6 // 3 = 2 as HF's
# group score needs), routed scaling 2.5, a shared expert; layer 0 dense.
TINY_SIGMOID_L3 = dataclasses.replace(
    TINY_MOE_L3,
    num_experts=12,
    moe_router_topk=6,
    moe_ffn_hidden_size=16,
    moe_router_score_function="sigmoid",
    moe_router_expert_bias=True,
    moe_router_num_groups=4,
    moe_router_group_topk=3,
    moe_router_scaling_factor=2.5,
    moe_shared_expert_ffn_hidden_size=24,
)
# Qwen2-MoE-shaped: softmax without renormalisation (norm_topk_prob false), top-3 of 6, a shared
# expert behind its sigmoid gate.
TINY_QWEN2_L3 = dataclasses.replace(
    TINY_MOE_L3,
    num_experts=6,
    moe_router_topk=3,
    norm_topk_prob=False,
    moe_shared_expert_ffn_hidden_size=40,
    moe_shared_expert_gate=True,
)
