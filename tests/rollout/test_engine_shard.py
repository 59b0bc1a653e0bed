"""What each engine rank holds of the canonical weights (moe_rl/weights/engine_shard.py): the TP
slices of every rank tile each split tensor exactly (KV heads replicated when fewer than the TP
ranks, the vocabulary padded to 64 x TP as vLLM pads it), an EP rank holds its experts only,
``placed`` puts a slice back where an engine that slices itself reads it, and
``sync_receive_bytes`` equals the bytes of the slices counted tensor by tensor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.weights.canonical import random_canonical_weights
from moe_rl.weights.engine_shard import (
    EngineShard,
    engine_shard,
    engine_slice,
    held,
    placed,
    slice_bounds,
    sync_receive_bytes,
)
from tests.models import TINY_MOE_L3 as MODEL

pytestmark = pytest.mark.unit


def _cfg(engine: str, tp: int, dtype: str = "bf16"):
    keys = {
        "parallel.nproc": 8,
        "rollout.engine": engine,
        "rollout.vllm.tensor_parallel": tp,
        "rollout.dtype": dtype,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in keys.items()])
    return dataclasses.replace(cfg, model=MODEL)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_tile_every_split_tensor_and_replicate_the_rest(tp):
    weights = random_canonical_weights(MODEL, seed=0)
    slices = [engine_slice(weights, EngineShard(tp, r), MODEL) for r in range(tp)]
    for name, full in weights.items():
        parts = [s[name] for s in slices]
        b = slice_bounds(name, tuple(full.shape), EngineShard(tp, 0), MODEL)
        if b is None:
            assert all(p is full for p in parts), name
            continue
        if name.endswith(("k_proj.weight", "v_proj.weight")) and tp > MODEL.num_query_groups:
            # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
            heads = full.chunk(MODEL.num_query_groups)
            assert all(
                torch.equal(p, heads[r * MODEL.num_query_groups // tp]) for r, p in enumerate(parts)
            ), name
            continue
        assert torch.equal(torch.cat(parts, b[0]), full), name  # the ranks' pieces, in rank order
    vocab = [s["model.embed_tokens.weight"].shape[0] for s in slices]
    per = 64 // tp  # 50 tokens padded to 64, 64 / TP rows a rank, the last clipped to the vocabulary
    assert vocab == [min(per, max(0, MODEL.vocab_size - r * per)) for r in range(tp)]


def test_an_ep_rank_holds_its_experts_only():
    weights = random_canonical_weights(MODEL, seed=0)
    got = engine_slice(weights, EngineShard(ep_size=2, ep_rank=1), MODEL)
    experts = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in got if ".mlp.experts." in n}
    assert experts == {2, 3}  # 4 experts over EP 2
    assert all(got[n] is weights[n] for n in got)  # whole, no TP
    assert not held("model.layers.1.mlp.experts.0.up_proj.weight", EngineShard(ep_size=2, ep_rank=1), 4)


def test_placed_puts_the_slice_where_the_engine_reads_it():
    weights = random_canonical_weights(MODEL, seed=0)
    shard = EngineShard(2, 1)
    back = placed(engine_slice(weights, shard, MODEL), shard, MODEL)
    again = engine_slice(back, shard, MODEL)
    assert sorted(back) == sorted(weights)
    for name, t in back.items():
        assert t.shape == weights[name].shape
        assert torch.equal(again[name], engine_slice(weights, shard, MODEL)[name]), name
    assert placed(weights, EngineShard(), MODEL) == weights


@pytest.mark.parametrize(
    "engine, tp, dtype", [("builtin", 1, "bf16"), ("vllm", 2, "bf16"), ("vllm", 4, "fp32")]
)
def test_sync_receive_bytes_counts_the_slices(engine, tp, dtype):
    cfg = _cfg(engine, tp, dtype)
    weights = random_canonical_weights(MODEL, seed=0)  # fp32, as an fp32 learner streams them
    router = ("mlp.gate.weight", "e_score_correction_bias")
    for r in range(2 * tp):  # two engines
        assert engine_shard(cfg, r) == EngineShard(tp, r % tp)
        mine = engine_slice(weights, engine_shard(cfg, r), MODEL)
        wire = {n: 4 if dtype == "fp32" or n.endswith(router) else 2 for n in mine}
        assert sync_receive_bytes(cfg, r) == sum(t.numel() * wire[n] for n, t in mine.items()), r
    full = sum(t.numel() for t in weights.values())
    if tp == 1:
        assert sync_receive_bytes(cfg, 0) == sum(
            t.numel() * (4 if n.endswith(router) else 2) for n, t in weights.items()
        )
    else:
        assert sync_receive_bytes(cfg, 0) < full * (4 if dtype == "fp32" else 2) * 0.75
