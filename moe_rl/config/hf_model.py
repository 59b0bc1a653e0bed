"""Hugging Face ``config.json`` -> ModelConfig fields, per model family: the reading direction (no
torch: the loader derives the ``model:`` section of an ``init_weights=hf:DIR`` run from it). The
writing direction, ModelConfig -> config.json for export, is ``moe_rl/weights/hf_config.py``.

A family is one ``model_type`` (== ``ModelConfig.hf_family``): how its config.json keys map onto
the typed fields, which fields it cannot vary, how its tensor names differ from the canonical ones
(HF Qwen3-MoE's plus DeepSeek-V3's, ``moe_rl/weights/canonical.py``). Anything the learner cannot
represent exactly is refused, naming the key and the file; what a family maps to is in
docs/models.md 2. Every value is read by type through one reader (``Keys``, hf_json.py): a boolean
is a JSON boolean, an integer a JSON integer, a number either; ``"false"`` or 4.6 where those
belong is refused naming the file and the key, never coerced.

- ``qwen3_moe``, ``mixtral``: softmax Top-K routers, GQA (docs/design.md 9).
- ``deepseek_v3`` (also Kimi-K2's config.json: ``model_type`` ``kimi_k2`` with ``architectures``
  ``DeepseekV3ForCausalLM``, read as this architecture and exported as ``deepseek_v3``): MLA, YaRN,
  sigmoid scores + ``e_score_correction_bias``, group-limited Top-K, ``routed_scaling_factor``,
  shared experts, dense first layers. MTP layers (``num_nextn_predict_layers``) are not trained:
  import skips their tensors (one log line), export writes ``num_nextn_predict_layers: 0``.
- ``glm4_moe``: the DeepSeek-V3 router and shared experts with GQA, partial RoPE, q/k/v biases and
  optional q/k norms; MTP as for DeepSeek-V3.
- ``qwen2_moe``: softmax Top-K without renormalisation by default, a shared expert behind a sigmoid
  gate (its ``mlp.shared_expert.*`` are canonical ``mlp.shared_experts.*``), q/k/v biases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_rl.config.hf_json import CONFIG, Keys, hf_keys, read_hf_config, refuse, require

if TYPE_CHECKING:
    from moe_rl.config.model import ModelConfig

# model_type of configs that are another family's architecture under their own name
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}  # Kimi-K2: architectures ["DeepseekV3ForCausalLM"]


def _first_k_dense(hf: Keys, num_layers: int, num_experts: int) -> int:
    """Qwen-MoE makes layer i MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0; the learner represents exactly the pattern "first k layers dense, the rest MoE"."""
    step = hf.get("decoder_sparse_step", int, 1) or 1
    mlp_only = set(hf.get("mlp_only_layers", list, [], items=int))
    dense = [i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0 or num_experts == 0]
    k = len(dense)
    if dense != list(range(k)) or k >= num_layers:
        key = "decoder_sparse_step" if step != 1 else "mlp_only_layers"
        raise refuse(
            hf.path,
            key,
            hf.raw.get(key),
            f"dense layers {dense} are not the first k of {num_layers} "
            "with at least one MoE layer after them (the learner's first_k_dense pattern)",
        )
    return k


def _first_k_replace(hf: Keys, default: int) -> int:
    """DeepSeek-V3 / GLM-4.5: ``first_k_dense_replace`` dense layers, then MoE in every layer."""
    require(hf, "moe_layer_freq", int, lambda v: v in (None, 1), "only an MoE layer every layer is supported")
    k = hf.get("first_k_dense_replace", int, default)
    layers = hf.get("num_hidden_layers", int)
    if not 0 <= k < layers:
        why = f"must leave at least one MoE layer of num_hidden_layers={layers}"
        raise refuse(hf.path, "first_k_dense_replace", k, why)
    return k


YARN_KEYS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_position",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
}
# transformers' yarn defaults for a key that is absent (None): mscale / mscale_all_dim None and 0
# compute the same attention factor (``if mscale and mscale_all_dim``)
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def _rope_fields(hf: Keys, default_theta: float, yarn_ok: bool, partial_default: float):
    """RoPE base, YaRN scaling and partial rotary from ``rope_parameters`` (transformers 5) or the
    hub's ``rope_scaling`` + top-level ``rope_theta`` / ``partial_rotary_factor``."""
    rope = hf.sub("rope_parameters")
    if not rope.raw and hf.get("rope_scaling", dict, {}):
        rope = hf.sub("rope_scaling")
    type_key = "rope_type" if rope.raw.get("rope_type") is not None else "type"
    kind = rope.get(type_key, str, "default")
    out: dict[str, Any] = {"rope_scaling_type": "none"}
    if kind == "yarn" and yarn_ok:
        out["rope_scaling_type"] = "yarn"
        require(
            rope,
            "attention_factor",
            float,
            lambda v: v is None,
            "an explicit YaRN attention factor is not supported",
        )
        require(
            rope, "truncate", bool, lambda v: v is True, "only the truncated YaRN ramp is supported", True
        )
        rope.get("factor", float)  # required: YaRN's scaling factor
        for hf_key, ours in YARN_KEYS.items():
            if hf_key == "original_max_position_embeddings":
                out[ours] = rope.get(hf_key, int, None) or hf.get("max_position_embeddings", int)
            else:
                out[ours] = rope.get(hf_key, float, _YARN_DEFAULTS.get(hf_key, 1.0))
    elif kind != "default":
        what = "plain RoPE or YaRN" if yarn_ok else "only plain RoPE is supported"
        raise refuse(hf.path, f"{rope.prefix}{type_key}", kind, f"{what} (this family)")
    theta = rope.get("rope_theta", float, None)
    theta = hf.get("rope_theta", float, default_theta) if theta is None else theta
    if theta != int(theta):  # megatron's rotary_base is an int
        raise refuse(hf.path, "rope_theta", theta, "the learner needs an integer RoPE base")
    out["rope_theta"] = theta
    partial = rope.get("partial_rotary_factor", float, None)
    out["partial_rotary_factor"] = (
        hf.get("partial_rotary_factor", float, partial_default) if partial is None else partial
    )
    return out


def _qwen3_moe_fields(hf: Keys) -> dict[str, Any]:
    require(
        hf,
        "norm_topk_prob",
        bool,
        lambda v: v is True,
        "the learner renormalises the Top-K gate weights (softmax over the top-k logits)",
        False,
    )
    require(
        hf, "use_sliding_window", bool, lambda v: not v, "sliding-window attention is not supported", False
    )
    require(
        hf,
        "shared_expert_intermediate_size",
        int,
        lambda v: not v,
        "Qwen3-MoE has no shared experts; this checkpoint does",
        0,
    )
    require(hf, "attention_bias", bool, lambda v: not v, "attention biases are not supported", False)
    num_experts = hf.get("num_experts", int, None)
    num_experts = hf.get("num_local_experts", int, 0) if num_experts is None else num_experts
    return {
        "ffn_hidden_size": hf.get("intermediate_size", int),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", int),
        "num_experts": num_experts,
        "qk_layernorm": True,
        "first_k_dense": _first_k_dense(hf, hf.get("num_hidden_layers", int), num_experts),
    }


def _mixtral_fields(hf: Keys) -> dict[str, Any]:
    """Every Mixtral layer is MoE (``intermediate_size`` is the expert's), so the dense FFN size
    is not described; routing is softmax over all experts, Top-K, renormalised: the same gates as
    the learner's softmax over the top-k logits."""
    require(hf, "sliding_window", int, lambda v: v is None, "sliding-window attention is not supported")
    require(hf, "router_jitter_noise", float, lambda v: not v, "router jitter noise is not implemented", 0.0)
    require(hf, "attention_bias", bool, lambda v: not v, "attention biases are not supported", False)
    return {
        "moe_ffn_hidden_size": hf.get("intermediate_size", int),
        "num_experts": hf.get("num_local_experts", int),
        "qk_layernorm": False,
        "first_k_dense": 0,
    }


def _sigmoid_router(hf: Keys) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, the expert bias selects (noaux_tc), groups,
    the routed scaling factor; ``n_group`` 1 (or absent) is no group limit."""
    require(hf, "scoring_func", str, lambda v: v in (None, "sigmoid"), "only sigmoid scores (this family)")
    require(
        hf,
        "topk_method",
        str,
        lambda v: v in (None, "noaux_tc"),
        "only noaux_tc (the e_score_correction_bias selects, never weights)",
    )
    groups = hf.get("n_group", int, 1) or 1
    moe_ffn = hf.get("moe_intermediate_size", int)
    return {
        "ffn_hidden_size": hf.get("intermediate_size", int),
        "moe_ffn_hidden_size": moe_ffn,
        "num_experts": hf.get("n_routed_experts", int),
        "moe_router_score_function": "sigmoid",
        "moe_router_expert_bias": True,
        "norm_topk_prob": hf.get("norm_topk_prob", bool, True),
        "moe_router_num_groups": groups if groups > 1 else 0,
        "moe_router_group_topk": (hf.get("topk_group", int, 1) or 1) if groups > 1 else 0,
        "moe_router_scaling_factor": hf.get("routed_scaling_factor", float, 1.0) or 1.0,
        "moe_shared_expert_ffn_hidden_size": hf.get("n_shared_experts", int, 0) * moe_ffn,
    }


def _deepseek_v3_fields(hf: Keys) -> dict[str, Any]:
    require(hf, "attention_bias", bool, lambda v: not v, "MLA with biases is not supported", False)
    require(
        hf,
        "rope_interleave",
        bool,
        lambda v: v in (None, True),
        "the learner's MLA rotates interleaved pairs (DeepSeek-V3's own layout)",
    )
    # the family is multi-latent attention: 0 would build another model (then fail far from here)
    require(
        hf,
        "kv_lora_rank",
        int,
        lambda v: v is None or v > 0,
        "DeepSeek-V3 attention is multi-latent: must be > 0",
    )
    nope, rope = hf.get("qk_nope_head_dim", int), hf.get("qk_rope_head_dim", int)
    return {
        **_sigmoid_router(hf),
        "first_k_dense": _first_k_replace(hf, 3),
        "kv_lora_rank": hf.get("kv_lora_rank", int),
        "q_lora_rank": hf.get("q_lora_rank", int, 0),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": hf.get("v_head_dim", int),
        "head_dim": nope + rope,  # unused by MLA; the q/k head size, for the record
        "qk_layernorm": False,
        "attention_bias": False,
    }


def _glm4_moe_fields(hf: Keys) -> dict[str, Any]:
    return {
        **_sigmoid_router(hf),
        "first_k_dense": _first_k_replace(hf, 1),
        "qk_layernorm": hf.get("use_qk_norm", bool, False),
        "attention_bias": hf.get("attention_bias", bool, False),
    }


def _qwen2_moe_fields(hf: Keys) -> dict[str, Any]:
    require(
        hf, "use_sliding_window", bool, lambda v: not v, "sliding-window attention is not supported", False
    )
    require(
        hf,
        "shared_expert_intermediate_size",
        int,
        lambda v: v is not None and v > 0,
        "Qwen2-MoE has a gated shared expert in every MoE layer; its size must be > 0",
    )
    num_experts = hf.get("num_experts", int)
    return {
        "ffn_hidden_size": hf.get("intermediate_size", int),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size", int),
        "num_experts": num_experts,
        "norm_topk_prob": hf.get("norm_topk_prob", bool, False),
        "moe_shared_expert_ffn_hidden_size": hf.get("shared_expert_intermediate_size", int),
        "moe_shared_expert_gate": True,
        "qk_layernorm": False,
        "attention_bias": hf.get("qkv_bias", bool, True),
        "first_k_dense": _first_k_dense(hf, hf.get("num_hidden_layers", int), num_experts),
    }


# --------------------------------------------------------------------------------------------
# The families
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One HF model family: its config.json keys and its tensor names.

    ``renames``: (canonical-name regex, family name) pairs for ``re.sub``. ``fixed``: ModelConfig
    fields the family cannot vary (field -> its one value). ``requires``: (field, test, what the
    family needs) for the rest it constrains. ``mtp``: its checkpoints may hold multi-token
    prediction layers after the last decoder layer (``num_nextn_predict_layers``)."""

    architecture: str
    default_rope_theta: float
    fields: Callable[[Keys], dict[str, Any]]  # family-specific config.json -> ModelConfig fields
    renames: tuple[tuple[str, str], ...] = ()
    fixed: dict[str, Any] = field(default_factory=dict)
    requires: tuple[tuple[str, Callable[[Any], bool], str], ...] = ()
    yarn: bool = False
    partial_rotary_default: float = 1.0
    mtp: bool = False


# What Qwen3-MoE and Mixtral checkpoints never have (a softmax-router GQA decoder, full RoPE).
_PLAIN = {
    "kv_lora_rank": 0,
    "moe_router_score_function": "softmax",
    "moe_router_expert_bias": False,
    "moe_router_num_groups": 0,
    "moe_router_scaling_factor": 1.0,
    "moe_shared_expert_ffn_hidden_size": 0,
    "attention_bias": False,
    "partial_rotary_factor": 1.0,
    "rope_scaling_type": "none",
}
_SIGMOID = {
    "moe_router_score_function": "sigmoid",
    "moe_router_expert_bias": True,
    "moe_shared_expert_gate": False,
}
_SHARED_IN_EXPERTS = (
    "moe_shared_expert_ffn_hidden_size",
    None,  # checked against moe_ffn_hidden_size in family_problem
    "is n_shared_experts * moe_intermediate_size (a multiple of model.moe_ffn_hidden_size)",
)

FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        default_rope_theta=10000.0,
        fields=_qwen3_moe_fields,
        fixed={**_PLAIN, "qk_layernorm": True, "norm_topk_prob": True},
    ),
    "mixtral": Family(
        "MixtralForCausalLM",
        default_rope_theta=1e6,
        fields=_mixtral_fields,
        renames=(
            (r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),
            (r"\.mlp\.experts\.(\d+)\.gate_proj\.weight$", r".block_sparse_moe.experts.\1.w1.weight"),
            (r"\.mlp\.experts\.(\d+)\.down_proj\.weight$", r".block_sparse_moe.experts.\1.w2.weight"),
            (r"\.mlp\.experts\.(\d+)\.up_proj\.weight$", r".block_sparse_moe.experts.\1.w3.weight"),
        ),
        fixed={**_PLAIN, "qk_layernorm": False, "norm_topk_prob": True, "first_k_dense": 0},
    ),
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM",
        default_rope_theta=10000.0,
        fields=_deepseek_v3_fields,
        fixed={**_SIGMOID, "qk_layernorm": False, "attention_bias": False, "partial_rotary_factor": 1.0},
        requires=(("kv_lora_rank", lambda v: v > 0, "has multi-latent attention (> 0)"), _SHARED_IN_EXPERTS),
        yarn=True,
        mtp=True,
    ),
    "glm4_moe": Family(
        "Glm4MoeForCausalLM",
        default_rope_theta=10000.0,
        fields=_glm4_moe_fields,
        fixed={**_SIGMOID, "kv_lora_rank": 0, "rope_scaling_type": "none"},
        requires=(_SHARED_IN_EXPERTS,),
        partial_rotary_default=0.5,  # transformers' Glm4MoeConfig default
        mtp=True,
    ),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM",
        default_rope_theta=10000.0,
        fields=_qwen2_moe_fields,
        renames=((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),),
        fixed={
            "kv_lora_rank": 0,
            "moe_router_score_function": "softmax",
            "moe_router_expert_bias": False,
            "moe_router_num_groups": 0,
            "moe_router_scaling_factor": 1.0,
            "moe_shared_expert_gate": True,
            "qk_layernorm": False,
            "partial_rotary_factor": 1.0,
            "rope_scaling_type": "none",
        },
        requires=(("moe_shared_expert_ffn_hidden_size", lambda v: v > 0, "has a shared expert (> 0)"),),
    ),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_problem(cfg: ModelConfig) -> str | None:
    """What ``cfg.hf_family`` cannot represent of ``cfg`` (one sentence naming the field), or None."""
    family = FAMILIES[cfg.hf_family]
    where = f"model.hf_family={cfg.hf_family!r}"
    for name, value in family.fixed.items():
        if getattr(cfg, name) != value:
            return f"model.{name}={getattr(cfg, name)!r}, but {where} always has {value!r}"
    for name, ok, what in family.requires:
        value = getattr(cfg, name)
        if ok is None:  # shared experts in units of one routed expert
            good = value % cfg.moe_ffn_hidden_size == 0
        else:
            good = ok(value)
        if not good:
            return f"model.{name}={value!r}, but {where} {what}"
    return None


def model_fields_from_hf(hf: dict, path: Path) -> dict[str, Any]:
    """ModelConfig fields of a parsed config.json (``path`` only names the file in errors); every
    key is read by type (``Keys``), CheckpointError names the file and the key.

    ``router_aux_loss_coef`` is not read: it weighs transformers' own training loss (normalised
    ``num_experts_per_tok`` times megatron's, and used only with ``output_router_logits``); the
    run's ``model.router_aux_loss_coeff`` is an RL training choice. Nor is
    ``max_position_embeddings``: ``model.max_seq_len`` is the run's sequence budget."""
    keys = Keys(hf, path)
    given_type = keys.get("model_type", str, None)
    model_type = MODEL_TYPE_ALIASES.get(given_type, given_type)
    supported = (*SUPPORTED_MODEL_TYPES, *MODEL_TYPE_ALIASES)
    require(keys, "model_type", str, lambda v: model_type in FAMILIES, f"supported: {supported}")
    family = FAMILIES[model_type]
    require(
        keys,
        "quantization_config",
        dict,
        lambda v: not v,
        "quantized weights (e.g. FP8 blocks with weight_scale_inv) are not read: dequantize to bf16 first",
    )
    require(keys, "hidden_act", str, lambda v: v == "silu", "experts must be SwiGLU (silu)", "silu")
    hidden, heads = keys.get("hidden_size", int), keys.get("num_attention_heads", int)
    return {
        **family.fixed,  # so a model.* key that contradicts the family is refused at load too
        "hf_family": model_type,
        "vocab_size": keys.get("vocab_size", int),
        "hidden_size": hidden,
        "num_layers": keys.get("num_hidden_layers", int),
        "num_attention_heads": heads,
        "num_query_groups": keys.get("num_key_value_heads", int, 0) or heads,
        "head_dim": keys.get("head_dim", int, 0) or hidden // max(heads, 1),
        "moe_router_topk": keys.get("num_experts_per_tok", int),
        "norm_eps": keys.get("rms_norm_eps", float),
        "tie_word_embeddings": keys.get("tie_word_embeddings", bool, False),
        **_rope_fields(keys, family.default_rope_theta, family.yarn, family.partial_rotary_default),
        **family.fields(keys),
    }


def load_hf_config(ckpt_dir: str | Path) -> dict[str, Any]:
    """ModelConfig fields from ``ckpt_dir/config.json``; CheckpointError names a refused key."""
    return model_fields_from_hf(read_hf_config(ckpt_dir), Path(ckpt_dir) / CONFIG)


def mtp_layers(ckpt_dir: str | Path) -> int:
    """``num_nextn_predict_layers`` of a DeepSeek-V3 / GLM-4.5 checkpoint (0 for other families)."""
    hf = hf_keys(ckpt_dir)
    model_type = hf.get("model_type", str, None)
    family = FAMILIES.get(MODEL_TYPE_ALIASES.get(model_type, model_type))
    return hf.get("num_nextn_predict_layers", int, 0) if family is not None and family.mtp else 0
