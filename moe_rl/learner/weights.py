"""One name/shard mapping between megatron-core's GPTModel (local spec) and canonical weights.

Canonical names are Hugging Face Qwen3-MoE names (``model.layers.3.mlp.experts.5.up_proj.weight``)
with every expert present. The same mapping serves warm-start loading, the learner -> rollout
engine weight sync (EP shards gathered) and, later, HF checkpoint import/export.

Layouts that differ between the two sides:
- megatron ``linear_qkv`` [G * (Q/G + 2) * D, H] interleaves per query group g: the Q/G query
  heads of g, then its key head, then its value head (G kv groups, Q heads, D head dim);
- megatron ``linear_fc1`` [2F, H] is cat(gate_proj, up_proj);
- megatron experts are local: global expert id = ep_rank * (E / ep_size) + local id.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from moe_rl.config import ModelConfig

_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MG_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

_SIMPLE_LAYER = {  # megatron suffix -> canonical suffix (within one layer)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_SIMPLE_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _split_qkv(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, h = cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
    qpg = cfg.num_attention_heads // g
    w_GXDH = w.view(g, qpg + 2, d, h)
    q = w_GXDH[:, :qpg].reshape(g * qpg * d, h)
    k = w_GXDH[:, qpg].reshape(g * d, h)
    v = w_GXDH[:, qpg + 1].reshape(g * d, h)
    return q, k, v


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    g, d, h = cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
    qpg = cfg.num_attention_heads // g
    return torch.cat([q.view(g, qpg, d, h), k.view(g, 1, d, h), v.view(g, 1, d, h)], dim=1).reshape(-1, h)


def _classify(name: str, n_local: int, ep_rank: int) -> tuple[str, str]:
    """How a megatron parameter maps: ("copy", canonical name), ("qkv", attention prefix) or
    ("fc1", prefix of the gate_proj/up_proj pair). Experts get their global id."""
    if name in _SIMPLE_TOP:
        return "copy", _SIMPLE_TOP[name]
    m = _MG_LAYER.match(name)
    if m is None:
        raise KeyError(f"no canonical name for megatron parameter {name!r}")
    pre, rest = f"model.layers.{int(m.group(1))}.", m.group(2)
    if rest in _SIMPLE_LAYER:
        return "copy", pre + _SIMPLE_LAYER[rest]
    if rest == "self_attention.linear_qkv.weight":
        return "qkv", pre + "self_attn."
    if rest == "mlp.linear_fc1.weight":
        return "fc1", pre + "mlp."
    e = _MG_EXPERT.match(rest)
    if e is None:
        raise KeyError(f"no canonical name for megatron parameter {name!r}")
    epre = f"{pre}mlp.experts.{ep_rank * n_local + int(e.group(1))}."
    return ("fc1", epre) if e.group(2) == "linear_fc1" else ("copy", epre + "down_proj.weight")


def megatron_to_canonical(local: dict[str, torch.Tensor], cfg: ModelConfig, ep_rank: int,
                          ep_size: int) -> dict[str, torch.Tensor]:
    """Rename this rank's megatron params; experts get their global ids (only local ones)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        kind, target = _classify(name, cfg.num_experts // ep_size, ep_rank)
        if kind == "copy":
            out[target] = t
        elif kind == "qkv":
            q, k, v = _split_qkv(t, cfg)
            out[target + "q_proj.weight"], out[target + "k_proj.weight"], out[target + "v_proj.weight"] = q, k, v
        else:
            out[target + "gate_proj.weight"], out[target + "up_proj.weight"] = t.chunk(2, dim=0)
    return out


def canonical_to_megatron(full: dict[str, torch.Tensor], megatron_names: list[str], cfg: ModelConfig,
                          ep_rank: int, ep_size: int) -> dict[str, torch.Tensor]:
    """Build this rank's megatron tensors (by name) from a full canonical dict.

    Raises KeyError naming the first canonical tensor that is missing."""

    def get(key: str) -> torch.Tensor:
        if key not in full:
            raise KeyError(f"canonical weights lack tensor {key!r}")
        return full[key]

    out: dict[str, torch.Tensor] = {}
    for name in megatron_names:
        kind, target = _classify(name, cfg.num_experts // ep_size, ep_rank)
        if kind == "copy":
            out[name] = get(target)
        elif kind == "qkv":
            out[name] = _join_qkv(get(target + "q_proj.weight"), get(target + "k_proj.weight"),
                                  get(target + "v_proj.weight"), cfg)
        else:
            out[name] = torch.cat([get(target + "gate_proj.weight"), get(target + "up_proj.weight")])
    return out


def gather_experts(canon_local: dict[str, torch.Tensor], cfg: ModelConfig, ep_size: int,
                   ep_group) -> dict[str, torch.Tensor]:
    """Complete a rank's canonical dict with every expert, gathered over the EP group.

    One all_gather per MoE layer and projection (experts stacked), not one per expert."""
    if ep_size == 1:
        return dict(canon_local)
    out = {k: v for k, v in canon_local.items() if ".mlp.experts." not in k}
    n_local = cfg.num_experts // ep_size
    ep_rank = dist.get_rank(ep_group)
    for i in cfg.moe_layers:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = [f"model.layers.{i}.mlp.experts.{ep_rank * n_local + j}.{proj}.weight" for j in range(n_local)]
            local_NXY = torch.stack([canon_local[k] for k in keys]).contiguous()
            full_EXY = local_NXY.new_empty((cfg.num_experts, *local_NXY.shape[1:]))
            dist.all_gather_into_tensor(full_EXY, local_NXY, group=ep_group)
            for e in range(cfg.num_experts):
                out[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] = full_EXY[e]
    return out
