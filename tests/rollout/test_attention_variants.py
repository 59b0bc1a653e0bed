"""The built-in engine's attention variants against transformers' own modules on the same weights:
multi-latent attention with YaRN (DeepseekV3Attention, q_lora_rank > 0 and 0), GLM-4.5's partial
rotary with q/k/v biases (Glm4MoeAttention) and Qwen2-MoE's biased GQA (Qwen2MoeAttention); fp32,
prefill and KV-cached step-by-step decode against one full forward (issue 25)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.config import ConfigError, ModelConfig
from moe_rl.rollout.builtin_model import BuiltinMoEModel, KVCache
from moe_rl.rollout.builtin_rope import rope_frequencies, rope_tables, softmax_scale
from moe_rl.weights.canonical import random_canonical_weights
from tests.hf_reference import hf_common
from tests.models import ODD_MLA_YARN, hf_tiny

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
LAYER = 1  # an MoE layer's attention (layer 0 is dense; attention is the same module everywhere)

# YaRN from 16 positions: a correction ramp inside the rope dims.
MLA = dict(
    ODD_MLA_YARN,
    qk_layernorm=False,
    rope_original_max_position=16,
    rope_beta_fast=32.0,
    rope_beta_slow=1.0,
)
GLM = dict(partial_rotary_factor=0.5, attention_bias=True, qk_layernorm=False, head_dim=16)
QWEN2 = dict(attention_bias=True, qk_layernorm=False)


def _layer_weights(w: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{layer}.self_attn."
    return {k[len(p) :]: v for k, v in w.items() if k.startswith(p)}


def _hf_attention(family: str, cfg: ModelConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(attention module, rotary embedding) of transformers for ``family``, fp32, eager."""
    common = dict(hf_common(cfg), attention_dropout=0.0)
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling_type == "yarn":
            rope = {
                "rope_type": "yarn",
                "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position,
                "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow,
                "mscale": cfg.rope_mscale,
                "mscale_all_dim": cfg.rope_mscale_all_dim,
            }
        hf_cfg = transformers.DeepseekV3Config(
            # MLA has no kv groups (eager repeat_kv)
            **{**common, "num_key_value_heads": cfg.num_attention_heads, "rope_parameters": rope},
            kv_lora_rank=cfg.kv_lora_rank,
            q_lora_rank=cfg.q_lora_rank or None,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_interleave=True,
            attention_bias=False,
        )
        attn, rot = m.DeepseekV3Attention(hf_cfg, LAYER), m.DeepseekV3RotaryEmbedding(hf_cfg)
    elif family == "glm4_moe":
        from transformers.models.glm4_moe import modeling_glm4_moe as m

        hf_cfg = transformers.Glm4MoeConfig(
            **common,
            head_dim=cfg.head_dim,
            partial_rotary_factor=cfg.partial_rotary_factor,
            attention_bias=cfg.attention_bias,
            use_qk_norm=cfg.qk_layernorm,
        )
        attn, rot = m.Glm4MoeAttention(hf_cfg, LAYER), m.Glm4MoeRotaryEmbedding(hf_cfg)
    else:
        from transformers.models.qwen2_moe import modeling_qwen2_moe as m

        hf_cfg = transformers.Qwen2MoeConfig(
            **common,
            qkv_bias=cfg.attention_bias,
        )
        attn, rot = m.Qwen2MoeAttention(hf_cfg, LAYER), m.Qwen2MoeRotaryEmbedding(hf_cfg)
        assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads  # qwen2_moe derives head_dim
    hf_cfg._attn_implementation = "eager"
    return attn.eval(), rot


CASES = {
    "mla_yarn_q_lora": ("deepseek_v3", MLA),
    "mla_rope_direct_q": ("deepseek_v3", {**MLA, "q_lora_rank": 0, "rope_scaling_type": "none"}),
    "mla_yarn_direct_q": ("deepseek_v3", {**MLA, "q_lora_rank": 0}),
    "glm_partial_rotary_bias": ("glm4_moe", GLM),
    "qwen2_bias": ("qwen2_moe", QWEN2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, ModelConfig, BuiltinMoEModel, torch.nn.Module, object]:
    family, overrides = CASES[request.param]
    cfg = hf_tiny(**overrides)
    weights = random_canonical_weights(cfg, seed=7)
    model = BuiltinMoEModel(cfg, dtype=torch.float32)
    model.load_canonical(weights)
    attn, rot = _hf_attention(family, cfg)
    attn.load_state_dict(_layer_weights(weights, LAYER), strict=True)
    return request.param, cfg, model, attn, rot


def _causal_additive(T: int) -> torch.Tensor:
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


@pytest.mark.unit
def test_prefill_and_cached_decode_equal_transformers(case) -> None:
    name, cfg, model, attn, rot = case
    B, T, P = 2, 11, 4
    gen = torch.Generator().manual_seed(3)
    x_BTH = torch.randn(B, T, cfg.hidden_size, generator=gen)
    # rows start at different positions: RoPE (and YaRN's ramp) is exercised beyond position 16
    positions_BT = torch.arange(T)[None] + torch.tensor([[0], [13]])
    with torch.no_grad():
        cos, sin = rot(x_BTH, positions_BT)
        ref_BTH, _ = attn(x_BTH, (cos, sin), _causal_additive(T))

    valid_BS = torch.ones(B, T, dtype=torch.bool)
    ours_cos, ours_sin = rope_tables(positions_BT, cfg)
    full = model._attention(LAYER, x_BTH, ours_cos, ours_sin, model._attention_mask(valid_BS, 0, T), None, 0)
    diff = (full - ref_BTH).abs().max().item()
    assert diff < ATOL, f"{name}: prefill max |diff| {diff:.2e}"

    cache = KVCache.allocate(cfg, B, T, torch.float32, "cpu")
    parts = [
        model._attention(
            LAYER,
            x_BTH[:, :P],
            ours_cos[:, :P],
            ours_sin[:, :P],
            model._attention_mask(valid_BS[:, :P], 0, P),
            cache,
            0,
        )
    ]
    for j in range(P, T):
        s = slice(j, j + 1)
        mask = model._attention_mask(valid_BS[:, : j + 1], j, 1)
        parts.append(model._attention(LAYER, x_BTH[:, s], ours_cos[:, s], ours_sin[:, s], mask, cache, j))
    decoded = torch.cat(parts, dim=1)
    diff = (decoded - ref_BTH).abs().max().item()
    assert diff < ATOL, f"{name}: cached decode max |diff| {diff:.2e}"


@pytest.mark.unit
def test_yarn_numbers_closed_form() -> None:
    """YaRN's factors by hand: mscale(4, m) = 0.1 m ln 4 + 1; cos/sin factor the ratio, softmax scale
    times mscale(4, 0.7)^2; dims below the ramp keep theta^(-2i/R), those above are divided by 4."""
    cfg = hf_tiny(**MLA)
    ms = lambda m: 0.1 * m * math.log(4.0) + 1.0  # noqa: E731
    inv, factor = rope_frequencies(cfg)
    assert factor == pytest.approx(ms(0.9) / ms(0.7), rel=1e-12)
    assert softmax_scale(cfg) == pytest.approx(ms(0.7) ** 2 / math.sqrt(12 + 8), rel=1e-12)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    # R=8, orig 16: correction dims floor(8 ln(16/(64 pi)) / (2 ln 1e4)) < 0 -> 0 and ceil(...) = 1 for
    # beta_slow 1: dim 0 extrapolates (ramp 0), dims >= 1 interpolate (ramp 1).
    assert inv[0].item() == pytest.approx(plain[0].item(), rel=1e-6)
    torch.testing.assert_close(inv[1:], plain[1:] / 4.0, rtol=1e-6, atol=0)


@pytest.mark.unit
def test_mla_cache_holds_the_latent_only() -> None:
    cfg = hf_tiny(**MLA)
    cache = KVCache.allocate(cfg, 3, 9, torch.bfloat16, "cpu")
    assert [tuple(t.shape) for t in cache.k] == [(3, 1, 9, 20 + 8)] * cfg.num_layers
    assert cache.v == [] and cache.capacity == 9
    assert cache.repeat_rows(2).k[0].shape == (6, 1, 9, 28)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({**MLA, "attention_bias": True}, "model.attention_bias"),
        ({**MLA, "partial_rotary_factor": 0.5}, "model.partial_rotary_factor"),
        ({**MLA, "norm_eps": 1e-5}, "model.norm_eps"),
        ({"rope_scaling_type": "yarn", "rope_original_max_position": 16}, "model.rope_scaling_type"),
        ({**MLA, "rope_original_max_position": 0}, "model.rope_original_max_position"),
        ({**MLA, "rope_mscale": 0.9, "rope_mscale_all_dim": 0.0}, "model.rope_mscale"),
        ({"partial_rotary_factor": 0.1}, "model.partial_rotary_factor"),
        ({**MLA, "qk_rope_head_dim": 7}, "model.qk_rope_head_dim"),
    ],
)
def test_unbuildable_attention_combinations_are_refused(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        hf_tiny(**overrides)


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_attention_params_and_kv_bytes(name: str) -> None:
    """moe_rl.memory counts exactly the canonical attention tensors; MLA's cache is the latent."""
    from moe_rl.memory import attention_params, kv_cache_bytes_per_token
    from moe_rl.weights.canonical import canonical_param_shapes

    cfg = hf_tiny(**CASES[name][1])
    shapes = canonical_param_shapes(cfg)
    want = sum(math.prod(s) for k, s in shapes.items() if k.startswith("model.layers.1.self_attn."))
    assert attention_params(cfg) == want
    per_layer = (20 + 8) if cfg.mla else 2 * 2 * 16  # latent + rope key | K and V of 2 groups x 16
    assert kv_cache_bytes_per_token(cfg, tensor_parallel=2, bytes_per_value=2) == (
        3 * per_layer * 2 if cfg.mla else 3 * (per_layer // 2) * 2
    )


@pytest.mark.unit
@pytest.mark.parametrize("name", ["mla_yarn_q_lora", "glm_partial_rotary_bias"])
def test_engine_generation_equals_no_cache_scoring(name: str) -> None:
    """The engine's sampling path (prefill once, fan out, KV-cached decode) on MLA / partial RoPE:
    its log-probs equal a no-cache forward over the finished sequences."""
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.types import SamplingParams

    cfg = hf_tiny(**CASES[name][1])
    engine = BuiltinEngine(cfg, dtype="fp32", pad_id=0)
    engine.load_weights(random_canonical_weights(cfg, seed=7))
    batch = engine.generate(
        [[3, 1, 4, 1, 5], [9, 2]], 2, SamplingParams(max_new_tokens=6, temperature=1.0), seed=5
    )
    S = batch.tokens_BS.shape[1]
    valid_BS = torch.arange(S)[None] < (batch.prompt_lens_B + batch.response_lens_B)[:, None]
    full = engine.model.forward(batch.tokens_BS, torch.arange(S).expand_as(batch.tokens_BS), valid_BS).logits
    lp_BS = torch.zeros_like(batch.logprobs_BS)
    lp_BS[:, 1:] = torch.log_softmax(full[:, :-1], -1).gather(-1, batch.tokens_BS[:, 1:, None]).squeeze(-1)
    m = batch.response_mask_BS
    assert m.sum() > 0
    assert (batch.logprobs_BS - lp_BS)[m].abs().max().item() < ATOL
