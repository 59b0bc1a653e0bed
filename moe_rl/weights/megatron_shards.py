"""One name/shard mapping between megatron-core's GPTModel (local spec) and canonical weights.

Canonical names are Hugging Face Qwen3-MoE names (``model.layers.3.mlp.experts.5.up_proj.weight``)
with every expert present. The same mapping serves warm-start loading, the learner -> rollout
engine weight sync (``stream.py`` gathers the shards layer by layer) and HF checkpoint
import/export (``hf.py``).

Layouts that differ between the two sides:
- megatron ``linear_qkv`` [G * (Q/G + 2) * D, H] interleaves per query group g: the Q/G query
  heads of g, then its key head, then its value head (G kv groups, Q heads, D head dim);
- megatron ``linear_fc1`` [2F, H] is cat(gate_proj, up_proj);
- megatron experts are local: global expert id = ep_rank * (E / ep_size) + local id;
- shared experts (``mlp.shared_experts.linear_fc1/fc2``, TP-split like a dense MLP, replicated
  over EP) map to ``mlp.shared_experts.{gate,up,down}_proj``, their gate ``gate_weight`` to
  ``mlp.shared_expert_gate.weight``; the router's ``expert_bias`` buffer (replicated) to
  ``mlp.gate.e_score_correction_bias``.
- attention biases (GLM-4.5, Qwen2-MoE): ``linear_qkv.bias`` interleaved like its weight;
- multi-latent attention (DeepSeek-V3): plain copies under the hub names (``_MLA_LAYER``).

Tensor parallelism (``Shard``; ``etp`` is the expert tensor parallel size, megatron's default is
TP): column-parallel ``linear_qkv`` holds the rank's G/TP query groups, interleaved as above;
column-parallel ``linear_fc1`` holds cat(gate shard, up shard) of the rank (dense and experts);
row-parallel ``linear_proj``/``linear_fc2`` are split on the input dim; the vocab-parallel
embedding and output layer on vocab rows; norms and the router are replicated. On a rank,
``megatron_to_canonical`` returns canonical names holding that rank's pieces and
``merge_tensor_parallel`` joins the pieces of all TP ranks. Pipeline stages number their layers
locally from 0; ``Shard.layer_offset`` is the stage's first global layer (the embedding lives only
on the first stage, the final norm and output layer only on the last: only the names a stage has
are asked for).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig
from moe_rl.weights.stored import StoredWeights

_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MG_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

_SIMPLE_LAYER = {  # megatron suffix -> canonical suffix (within one layer)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    # the router's expert_bias is a buffer (moe_rl/learner/build.py): it travels with the weights
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# Multi-latent attention (megatron MLASelfAttention, local spec) -> DeepSeek-V3 hub names. Layouts are
# identical: linear_kv_down_proj rows are [latent C | shared rope key R] like kv_a_proj_with_mqa,
# linear_q_up_proj / linear_kv_up_proj rows are per head [nope | rope] / [k_nope | v] like q_b_proj /
# kv_b_proj, and megatron's MLA RoPE reads the rope dims interleaved as the hub checkpoints store them
# (learner/build.py _attention): every tensor is a plain copy. The local spec's down projections are
# column-parallel (split on their output rows under TP, gathered inside MLA).
_MLA_LAYER = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_SIMPLE_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class Shard:
    """One rank's tensor-parallel coordinates and its pipeline stage's first global layer."""

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int = 0  # expert tensor parallel (experts' fc1/fc2)
    etp_size: int = 1
    layer_offset: int = 0

    @staticmethod
    def for_stage(
        stage_layers: tuple[int, ...],
        pp_rank: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        etp_rank: int = 0,
        etp_size: int = 1,
    ) -> Shard:
        """Stage ``pp_rank`` of a split with ``stage_layers[p]`` layers on stage p
        (``layout.pipeline_stage_layers``) starts at the sum of the stages before it."""
        return Shard(tp_rank, tp_size, etp_rank, etp_size, sum(stage_layers[:pp_rank]))


NO_SHARD = Shard()


def tp_split_dim(canonical: str) -> int | None:
    """Dim along which TP splits a canonical tensor (experts by expert TP); None: replicated."""
    if canonical.endswith(
        ("norm.weight", "mlp.gate.weight", "e_score_correction_bias", "mlp.shared_expert_gate.weight")
    ):
        return None
    if canonical.endswith(("o_proj.weight", "down_proj.weight")):
        return 1  # row-parallel: split on the input dim
    return 0  # column-parallel q/k/v, gate/up; vocab-parallel embedding and lm_head


def _bounds(shape: tuple[int, ...], dim: int, rank: int, size: int, name: str) -> tuple[int, int]:
    """[start, stop) of TP rank ``rank``'s equal piece along ``dim``."""
    if shape[dim] % size:
        raise ValueError(f"tensor {name!r} dim {dim} of size {shape[dim]} does not split over {size} ranks")
    step = shape[dim] // size
    return rank * step, (rank + 1) * step


def canonical_piece(
    full: Mapping[str, torch.Tensor] | StoredWeights, key: str, dim: int | None, rank: int, size: int
) -> torch.Tensor:
    """TP rank ``rank``'s piece of canonical tensor ``key`` (all of it when ``dim`` is None or
    ``size`` 1): a view of an in-memory tensor, or only those rows/columns read from a file
    (``StoredWeights``, in the stored dtype)."""
    if isinstance(full, StoredWeights):
        if dim is None or size == 1:
            return full.read(key)
        return full.read(key, dim, *_bounds(full[key].shape, dim, rank, size, key))
    t = full[key]
    if dim is None or size == 1:
        return t
    start, stop = _bounds(tuple(t.shape), dim, rank, size, key)
    return t.narrow(dim, start, stop - start)


def _split_qkv(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local q, k, v rows of a (possibly TP-local) linear_qkv weight [rows, H] or bias [rows]; the
    group count comes from its shape."""
    d, rest = cfg.head_dim, tuple(w.shape[1:])
    qpg = cfg.num_attention_heads // cfg.num_query_groups
    g = w.shape[0] // ((qpg + 2) * d)
    w_GXD_ = w.view(g, qpg + 2, d, *rest)
    q = w_GXD_[:, :qpg].reshape(g * qpg * d, *rest)
    k = w_GXD_[:, qpg].reshape(g * d, *rest)
    v = w_GXD_[:, qpg + 1].reshape(g * d, *rest)
    return q, k, v


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of _split_qkv (weights or biases)."""
    d, rest = cfg.head_dim, tuple(k.shape[1:])
    g = k.shape[0] // d
    qpg = cfg.num_attention_heads // cfg.num_query_groups
    parts = [q.view(g, qpg, d, *rest), k.view(g, 1, d, *rest), v.view(g, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _classify(
    name: str, n_local: int, ep_rank: int, layer_offset: int = 0, mla: bool = False
) -> tuple[str, str]:
    """How a megatron parameter maps: ("copy", canonical name), ("qkv", attention prefix, with
    ("qkv_bias", ...) for its bias) or ("fc1", prefix of the gate_proj/up_proj pair). Experts get
    their global id, layers their global number; ``mla``: the attention is MLASelfAttention."""
    if name in _SIMPLE_TOP:
        return "copy", _SIMPLE_TOP[name]
    m = _MG_LAYER.match(name)
    if m is None:
        raise KeyError(f"no canonical name for megatron parameter {name!r}")
    pre, rest = f"model.layers.{layer_offset + int(m.group(1))}.", m.group(2)
    if mla and rest in _MLA_LAYER:  # before _SIMPLE_LAYER: q_layernorm is q_a_layernorm here
        return "copy", pre + _MLA_LAYER[rest]
    if rest in _SIMPLE_LAYER:
        return "copy", pre + _SIMPLE_LAYER[rest]
    if rest == "self_attention.linear_qkv.weight":
        return "qkv", pre + "self_attn."
    if rest == "self_attention.linear_qkv.bias":
        return "qkv_bias", pre + "self_attn."
    if rest == "mlp.linear_fc1.weight":
        return "fc1", pre + "mlp."
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return "fc1", pre + "mlp.shared_experts."
    e = _MG_EXPERT.match(rest)
    if e is None:
        raise KeyError(f"no canonical name for megatron parameter {name!r}")
    epre = f"{pre}mlp.experts.{ep_rank * n_local + int(e.group(1))}."
    return ("fc1", epre) if e.group(2) == "linear_fc1" else ("copy", epre + "down_proj.weight")


def _tp(target: str, shard: Shard) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that splits this canonical tensor."""
    return (shard.etp_rank, shard.etp_size) if ".mlp.experts." in target else (shard.tp_rank, shard.tp_size)


def megatron_to_canonical(
    local: dict[str, torch.Tensor], cfg: ModelConfig, ep_rank: int, ep_size: int, shard: Shard = NO_SHARD
) -> dict[str, torch.Tensor]:
    """Rename this rank's megatron params; experts get their global ids (only local ones).

    With TP > 1 every split tensor is this rank's piece (``merge_tensor_parallel`` joins them)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in local.items():
        kind, target = _classify(name, cfg.num_experts // ep_size, ep_rank, shard.layer_offset, cfg.mla)
        if kind == "copy":
            out[target] = t
        elif kind in ("qkv", "qkv_bias"):
            suffix = "weight" if kind == "qkv" else "bias"
            for proj, part in zip(("q_proj.", "k_proj.", "v_proj."), _split_qkv(t, cfg)):
                out[target + proj + suffix] = part
        else:
            out[target + "gate_proj.weight"], out[target + "up_proj.weight"] = t.chunk(2, dim=0)
    return out


def merge_tensor_parallel(
    pieces: list[dict[str, torch.Tensor]], etp_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Join the canonical pieces of the TP ranks of one (EP rank, PP stage), ordered by TP rank.

    Expert tensors are split over ``etp_size`` ranks (default: all of them); with ``etp_size``
    1 they are replicated over TP. Replicated tensors are taken from TP rank 0."""
    etp = len(pieces) if etp_size is None else etp_size
    out: dict[str, torch.Tensor] = {}
    for name, first in pieces[0].items():
        dim = tp_split_dim(name)
        n = etp if ".mlp.experts." in name else len(pieces)
        out[name] = first if dim is None or n == 1 else torch.cat([p[name] for p in pieces[:n]], dim=dim)
    return out


def canonical_to_megatron(
    full: Mapping[str, torch.Tensor] | StoredWeights,
    megatron_names: list[str],
    cfg: ModelConfig,
    ep_rank: int,
    ep_size: int,
    shard: Shard = NO_SHARD,
) -> dict[str, torch.Tensor]:
    """Build this rank's megatron tensors (by name) from a full canonical dict, or from the files
    of ``StoredWeights`` (then only this rank's tensors and TP slices are read).

    Raises KeyError naming the first canonical tensor that is missing."""

    def get(key: str) -> torch.Tensor:
        if key not in full:
            raise KeyError(f"canonical weights lack tensor {key!r}")
        return canonical_piece(full, key, tp_split_dim(key), *_tp(key, shard))

    out: dict[str, torch.Tensor] = {}
    for name in megatron_names:
        kind, target = _classify(name, cfg.num_experts // ep_size, ep_rank, shard.layer_offset, cfg.mla)
        if kind == "copy":
            out[name] = get(target)
        elif kind in ("qkv", "qkv_bias"):
            suffix = "weight" if kind == "qkv" else "bias"
            out[name] = _join_qkv(
                get(target + "q_proj." + suffix),
                get(target + "k_proj." + suffix),
                get(target + "v_proj." + suffix),
                cfg,
            )
        else:
            out[name] = torch.cat([get(target + "gate_proj.weight"), get(target + "up_proj.weight")])
    return out
