"""Hugging Face transformers' Qwen3-MoE (and Mixtral) as the independent reference implementation in
tests: the HF config for one of our ModelConfigs, our canonical weights in HF v5's in-memory layout,
and a forward pass that captures the routers' Top-K ids."""

from __future__ import annotations

import torch
import transformers

from moe_rl.config import ModelConfig


def hf_common(cfg: ModelConfig) -> dict[str, object]:
    """The config.json keys every HF MoE family spells the same way, from our ModelConfig (plain
    RoPE: a family with YaRN replaces ``rope_parameters``)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )


def eager(hf_cfg: object) -> object:
    """The plainest HF code paths: eager attention and a per-expert loop."""
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    return hf_cfg


def hf_config(cfg: ModelConfig) -> object:
    """transformers' config of ``cfg``: Mixtral's for ``hf_family`` mixtral, else Qwen3-MoE's."""
    if cfg.hf_family == "mixtral":
        own = dict(intermediate_size=cfg.moe_ffn_hidden_size, num_local_experts=cfg.num_experts)
        cls, own = transformers.MixtralConfig, {**own, "sliding_window": None}
    else:
        cls, own = (
            transformers.Qwen3MoeConfig,
            dict(
                intermediate_size=cfg.ffn_hidden_size,
                moe_intermediate_size=cfg.moe_ffn_hidden_size,
                head_dim=cfg.head_dim,
                num_experts=cfg.num_experts,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=list(range(cfg.first_k_dense)),
                tie_word_embeddings=False,
                attention_bias=False,
            ),
        )
    return eager(cls(**hf_common(cfg), num_experts_per_tok=cfg.moe_router_topk, **own))


def canonical_to_hf_memory(named: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert canonical names -> HF v5 in-memory fused experts (gate rows first, then up)."""
    out = {k: v for k, v in named.items() if ".mlp.experts." not in k}
    for i in cfg.moe_layers:
        p = f"model.layers.{i}.mlp.experts."
        rng = range(cfg.num_experts)
        gate_EFH = torch.stack([named[f"{p}{e}.gate_proj.weight"] for e in rng])
        up_EFH = torch.stack([named[f"{p}{e}.up_proj.weight"] for e in rng])
        out[p + "gate_up_proj"] = torch.cat([gate_EFH, up_EFH], dim=1)
        out[p + "down_proj"] = torch.stack([named[f"{p}{e}.down_proj.weight"] for e in rng])
    return out


def hf_forward(
    model: object, cfg: ModelConfig, tokens_BS: torch.Tensor, valid_BS: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF logits [B, S, V] and captured Top-K ids [B, S, L_moe, K] of a right-padded batch."""
    captured: list[torch.Tensor] = []
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(lambda _m, _inp, out: captured.append(out[2]))
        for i in cfg.moe_layers
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens_BS, attention_mask=valid_BS.long()).logits
    finally:
        for h in hooks:
            h.remove()
    B, S = tokens_BS.shape
    return logits.float(), torch.stack([c.view(B, S, -1) for c in captured], dim=2)
