"""ModelConfig -> Hugging Face ``config.json``, per model family: the writing direction, for export
and for the HF checkpoints the tests build. The reading direction (config.json -> the ``model:``
section, the family table ``FAMILIES``) is the config's: ``moe_rl/config/hf_model.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moe_rl.config.hf_model import FAMILIES, YARN_KEYS, family_problem

if TYPE_CHECKING:
    from moe_rl.config import ModelConfig


def _gqa_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"head_dim": cfg.head_dim}


def _qwen3_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_gqa_config(cfg),
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.first_k_dense)),
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _mixtral_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_gqa_config(cfg),
        "intermediate_size": cfg.moe_ffn_hidden_size,
        "num_local_experts": cfg.num_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def _sigmoid_router_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "n_routed_experts": cfg.num_experts,
        "n_shared_experts": cfg.moe_shared_expert_ffn_hidden_size // cfg.moe_ffn_hidden_size,
        "first_k_dense_replace": cfg.first_k_dense,
        "n_group": max(1, cfg.moe_router_num_groups),
        "topk_group": max(1, cfg.moe_router_group_topk),
        "routed_scaling_factor": cfg.moe_router_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "num_nextn_predict_layers": 0,  # the learner trains no MTP head: the export has none
    }


def _deepseek_v3_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_sigmoid_router_config(cfg),
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_interleave": True,
        "attention_bias": False,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


def _glm4_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_gqa_config(cfg),
        **_sigmoid_router_config(cfg),
        "use_qk_norm": cfg.qk_layernorm,
        "attention_bias": cfg.attention_bias,
    }


def _qwen2_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": cfg.moe_shared_expert_ffn_hidden_size,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.first_k_dense)),
        "qkv_bias": cfg.attention_bias,
        "use_sliding_window": False,
    }


def _rope_config(cfg: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_type == "yarn":
        rope["rope_type"] = "yarn"
        rope.update({hf_key: getattr(cfg, ours) for hf_key, ours in YARN_KEYS.items()})
    if cfg.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    return rope


# family-specific ModelConfig -> config.json keys, one per FAMILIES entry
WRITERS: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe_config,
    "mixtral": _mixtral_config,
    "deepseek_v3": _deepseek_v3_config,
    "glm4_moe": _glm4_moe_config,
    "qwen2_moe": _qwen2_moe_config,
}


def hf_config_dict(cfg: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """The config.json transformers loads for ``cfg`` (``cfg.hf_family``; the inverse of
    ``load_hf_config``, moe_rl/config/hf_model.py)."""
    problem = family_problem(cfg)
    if problem:
        raise ValueError(problem)
    family = FAMILIES[cfg.hf_family]
    return {
        "architectures": [family.architecture],
        "model_type": cfg.hf_family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "num_experts_per_tok": cfg.moe_router_topk,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": _rope_config(cfg),
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "router_aux_loss_coef": cfg.router_aux_loss_coeff,
        "dtype": dtype_name,
        **WRITERS[cfg.hf_family](cfg),
    }
