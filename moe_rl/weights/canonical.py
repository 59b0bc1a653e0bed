"""Canonical weights: every tensor name of a model, its shape, and the strict checks of ingest.

Canonical names are the Hugging Face Qwen3-MoE hub names (``model.layers.3.mlp.experts.5.up_proj.
weight``) with every expert listed one by one. The learner exports exactly the dict of
:func:`canonical_param_shapes`; the engines, the HF file format and the warm start check what
they are given against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moe_rl.config import ModelConfig


def canonical_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor name of the model and its shape.

    Names are HF Qwen3-MoE's, extended with the DeepSeek-V3 hub names for what Qwen3-MoE lacks:
    multi-latent attention (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm``, ``kv_b_proj``), shared experts (``mlp.shared_experts.*``) and the expert bias
    (``mlp.gate.e_score_correction_bias``); Qwen2-MoE's shared-expert gate is
    ``mlp.shared_expert_gate.weight`` and attention biases are ``self_attn.{q,k,v}_proj.bias``.
    Each HF family maps its own names onto these (moe_rl/weights/hf.py).
    Experts are listed one by one (``mlp.experts.{e}.{gate,up,down}_proj.weight``), the hub
    layout that ``save_pretrained`` writes; ``q_norm``/``k_norm`` only when ``cfg.qk_layernorm``;
    no ``lm_head.weight`` when ``cfg.tie_word_embeddings``.
    """
    if cfg.vocab_size <= 0:
        raise ValueError("model.vocab_size must be > 0 to lay out weights (0 = not resolved yet)")
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes.update(_attention_shapes(cfg, p + "self_attn."))
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if i < cfg.first_k_dense:
            shapes.update(_mlp_shapes(p + "mlp.", cfg.ffn_hidden_size, H))
            continue
        E, Fm = cfg.num_experts, cfg.moe_ffn_hidden_size
        shapes[p + "mlp.gate.weight"] = (E, H)
        if cfg.moe_router_expert_bias:
            shapes[p + "mlp.gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            shapes.update(_mlp_shapes(p + f"mlp.experts.{e}.", Fm, H))
        if cfg.moe_shared_expert_ffn_hidden_size > 0:
            shapes.update(_mlp_shapes(p + "mlp.shared_experts.", cfg.moe_shared_expert_ffn_hidden_size, H))
            if cfg.moe_shared_expert_gate:
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def _mlp_shapes(p: str, F: int, H: int) -> dict[str, tuple[int, ...]]:
    """One SwiGLU MLP (dense layer, expert or shared expert) under prefix ``p``."""
    return {p + "gate_proj.weight": (F, H), p + "up_proj.weight": (F, H), p + "down_proj.weight": (H, F)}


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One attention block under prefix ``p`` (``model.layers.{i}.self_attn.``): GQA or MLA."""
    H, N = cfg.hidden_size, cfg.num_attention_heads
    if cfg.mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        out: dict[str, tuple[int, ...]] = {}
        if cfg.q_lora_rank > 0:
            out[p + "q_a_proj.weight"] = (cfg.q_lora_rank, H)
            out[p + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            out[p + "q_b_proj.weight"] = (N * qk, cfg.q_lora_rank)
        else:
            out[p + "q_proj.weight"] = (N * qk, H)
        out[p + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
        out[p + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        out[p + "kv_b_proj.weight"] = (N * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        out[p + "o_proj.weight"] = (H, N * cfg.v_head_dim)
        return out
    D = cfg.head_dim
    q_out, kv_out = N * D, cfg.num_query_groups * D
    out = {
        p + "q_proj.weight": (q_out, H),
        p + "k_proj.weight": (kv_out, H),
        p + "v_proj.weight": (kv_out, H),
        p + "o_proj.weight": (H, q_out),
    }
    if cfg.attention_bias:
        out.update({p + "q_proj.bias": (q_out,), p + "k_proj.bias": (kv_out,), p + "v_proj.bias": (kv_out,)})
    if cfg.qk_layernorm:
        out[p + "q_norm.weight"] = (D,)
        out[p + "k_norm.weight"] = (D,)
    return out


def check_canonical_weights(named: Mapping[str, Any], cfg: ModelConfig) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped tensor (strict ingest).
    ``named`` holds tensors, or what a file's header says of them (``weights/stored.py``)."""
    expected = canonical_param_shapes(cfg)
    missing = [k for k in expected if k not in named]
    if missing:
        raise ValueError(
            f"load_weights: missing tensor {missing[0]!r} ({len(missing)} missing in all: {missing[:5]})"
        )
    check = CanonicalCheck(cfg, expected)
    check.chunk(named)
    check.finish()


class CanonicalCheck:
    """Strict ingest of canonical weights that arrive in chunks: every expected tensor exactly
    once over all chunks, with its shape and a floating point dtype; errors name the tensor."""

    def __init__(self, cfg: ModelConfig, expected: dict[str, tuple[int, ...]] | None = None) -> None:
        self.expected = canonical_param_shapes(cfg) if expected is None else expected
        self.seen: set[str] = set()

    def chunk(self, named: Mapping[str, Any]) -> None:
        """Check one chunk before anything of it is used."""
        unexpected = [k for k in named if k not in self.expected]
        if unexpected:
            raise ValueError(
                f"load_weights: unexpected tensor {unexpected[0]!r} "
                f"({len(unexpected)} unexpected in all: {unexpected[:5]})"
            )
        again = [k for k in named if k in self.seen]
        if again:
            raise ValueError(f"load_weights: tensor {again[0]!r} given twice ({len(again)} in all)")
        for name, t in named.items():
            got, shape = tuple(t.shape), self.expected[name]
            if got != shape:
                raise ValueError(f"load_weights: tensor {name!r} has shape {got}, expected {shape}")
            if not t.dtype.is_floating_point:  # a tensor, or a header's StoredTensor (weights/stored.py)
                raise ValueError(
                    f"load_weights: tensor {name!r} has dtype {t.dtype}, expected a floating point dtype"
                )
        self.seen.update(named)

    def finish(self) -> None:
        """After the last chunk: nothing expected is missing."""
        missing = [k for k in self.expected if k not in self.seen]
        if missing:
            raise ValueError(
                f"load_weights: missing tensor {missing[0]!r} ({len(missing)} missing in all: {missing[:5]})"
            )


def random_canonical_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 canonical weights with O(1) activations and logits (tests, random init).

    Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2) so
    that a norm that is not applied (or applied in the wrong place) shows up in parity tests.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in canonical_param_shapes(cfg).items():
        if name.endswith("norm.weight"):  # all RMSNorm weights, incl. q_norm / k_norm
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # attention biases, the expert bias: small but not zero
            out[name] = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) * shape[1] ** -0.5
    return out
