"""Megatron parameter names of one rank, as megatron-core 0.16's local spec names them, for any
EP/PP layout (TP does not change names, only shapes). The dist test checks this list against real
GPTModels (EP=2, TP=2, PP=2), so the exhaustive unit test can shard over layouts it cannot build."""

from __future__ import annotations

from moe_rl.config import ModelConfig

_ATTN = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight")
_QK_NORM = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def megatron_names(cfg: ModelConfig, ep_size: int, pp_rank: int = 0, pp_size: int = 1) -> list[str]:
    """Sorted names of one rank's parameters (layers numbered locally on its stage)."""
    per_stage = cfg.num_layers // pp_size
    names = []
    if pp_rank == 0:
        names.append("embedding.word_embeddings.weight")
    if pp_rank == pp_size - 1:
        names += ["decoder.final_layernorm.weight", "output_layer.weight"]
    for local in range(per_stage):
        pre = f"decoder.layers.{local}."
        names += [pre + s for s in _ATTN + (_QK_NORM if cfg.qk_layernorm else ())]
        names.append(pre + "pre_mlp_layernorm.weight")
        if pp_rank * per_stage + local < cfg.first_k_dense:
            names += [pre + "mlp.linear_fc1.weight", pre + "mlp.linear_fc2.weight"]
            continue
        names.append(pre + "mlp.router.weight")
        for j in range(cfg.num_experts // ep_size):
            names += [f"{pre}mlp.experts.local_experts.{j}.linear_fc{n}.weight" for n in (1, 2)]
    return sorted(names)
