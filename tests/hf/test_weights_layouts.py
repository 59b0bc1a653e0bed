"""unit tier: the one megatron <-> canonical mapping over every EP/TP/PP layout, as pure tensor code.

Sharding a random canonical dict for every rank of a layout and merging all ranks' pieces back
gives the exact original (torch.equal). Megatron names come from ``tests/hf/layouts.py``, which the
dist test checks against real GPTModels."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_rl.config import ModelConfig
from moe_rl.weights.canonical import random_canonical_weights
from moe_rl.weights.megatron_shards import (
    Shard,
    canonical_to_megatron,
    megatron_to_canonical,
    merge_tensor_parallel,
)
from tests.hf.layouts import megatron_names
from tests.models import hf_tiny

# the HF-parity model at half its widths, 4 layers
CFG = hf_tiny(num_layers=4, hidden_size=32, head_dim=8, ffn_hidden_size=48, moe_ffn_hidden_size=16)
LAYOUTS = [
    (ep, tp, pp, etp) for ep, tp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2)) for etp in {1, tp}
]


def _even(pp: int) -> tuple[int, ...]:
    return (CFG.num_layers // pp,) * pp


def _shard_all(full, ep: int, tp: int, pp: int, etp: int):
    """{(pp_rank, ep_rank, tp_rank): megatron tensors of that rank}."""
    out = {}
    for pp_rank, ep_rank, tp_rank in itertools.product(range(pp), range(ep), range(tp)):
        shard = Shard.for_stage(_even(pp), pp_rank, tp_rank, tp, tp_rank % etp, etp)
        out[pp_rank, ep_rank, tp_rank] = canonical_to_megatron(
            full, megatron_names(CFG, ep, pp_rank, pp), CFG, ep_rank, ep, shard
        )
    return out


@pytest.mark.unit
@pytest.mark.parametrize(("ep", "tp", "pp", "etp"), LAYOUTS)
def test_shard_then_merge_is_exact(ep: int, tp: int, pp: int, etp: int) -> None:
    full = random_canonical_weights(CFG, seed=3)
    ranks = _shard_all(full, ep, tp, pp, etp)
    merged: dict[str, torch.Tensor] = {}
    for pp_rank, ep_rank in itertools.product(range(pp), range(ep)):
        pieces = [
            megatron_to_canonical(
                ranks[pp_rank, ep_rank, t],
                CFG,
                ep_rank,
                ep,
                Shard.for_stage(_even(pp), pp_rank, t, tp, t % etp, etp),
            )
            for t in range(tp)
        ]
        for name, t in merge_tensor_parallel(pieces, etp).items():
            assert name not in merged or torch.equal(merged[name], t), name  # replicas agree
            merged[name] = t
    assert sorted(merged) == sorted(full)
    for name, t in full.items():
        assert torch.equal(merged[name], t), name


@pytest.mark.unit
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_are_megatron_row_and_column_chunks(tp: int) -> None:
    """Megatron's TP split of a full (TP=1) tensor: qkv (groups are contiguous), embedding and
    output rows are plain row chunks, linear_proj a column chunk; fc1 is NOT (gate/up per rank)."""
    cfg = ModelConfig(**{**CFG.__dict__, "num_query_groups": 4})
    full = random_canonical_weights(cfg, seed=4)
    names = megatron_names(cfg, 1)
    whole = canonical_to_megatron(full, names, cfg, 0, 1)
    for r in range(tp):
        part = canonical_to_megatron(full, names, cfg, 0, 1, Shard(r, tp, r, tp))
        for name in (
            "decoder.layers.1.self_attention.linear_qkv.weight",
            "embedding.word_embeddings.weight",
            "output_layer.weight",
        ):
            assert torch.equal(part[name], whole[name].chunk(tp, 0)[r]), name
        assert torch.equal(
            part["decoder.layers.1.self_attention.linear_proj.weight"],
            whole["decoder.layers.1.self_attention.linear_proj.weight"].chunk(tp, 1)[r],
        )
        fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
        gate, up = whole[fc1].chunk(2, 0)
        assert torch.equal(part[fc1], torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]]))


@pytest.mark.unit
def test_pipeline_stage_numbers_layers_globally() -> None:
    full = random_canonical_weights(CFG, seed=5)
    last = canonical_to_megatron(full, megatron_names(CFG, 1, 1, 2), CFG, 0, 1, Shard.for_stage(_even(2), 1))
    assert "embedding.word_embeddings.weight" not in last and "output_layer.weight" in last
    assert torch.equal(
        last["decoder.layers.0.input_layernorm.weight"], full["model.layers.2.input_layernorm.weight"]
    )


@pytest.mark.unit
def test_indivisible_split_and_missing_tensor_are_named() -> None:
    full = random_canonical_weights(CFG, seed=6)
    names = megatron_names(CFG, 1)
    with pytest.raises(ValueError, match=r"tensor .* does not split over 3 ranks"):
        canonical_to_megatron(full, names, CFG, 0, 1, Shard(0, 3, 0, 1))
    del full["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.2.mlp.experts.5.up_proj.weight"):
        canonical_to_megatron(full, names, CFG, 0, 1)
