"""dist tier: the streaming weight sync (moe_rl/weights/stream.py) on PP=2 x TP=2 x DP=2 with
EP=2 (expert-TP = TP = 2, megatron's default): 8 ranks, each stage 2 TP x 2 EP ranks.

Checked on every rank:
(a) exactness: the chunks of ``Learner.iter_canonical_layers`` are the embedding, each decoder
    layer (every tensor of ``model.layers.<i>.``, all experts) and the final norm + lm_head, in that
    order, each tensor once; joined they equal ``export_canonical()`` and the canonical weights the
    learner was loaded with, exactly; a built-in fp32 engine fed the stream holds exactly them.
(b) memory: the peak of the live CPU bytes during one streamed sync into a built-in engine
    whose weights already exist, above the start (torch.profiler's ``[memory]`` events: every
    allocation and free with its address, gloo's own buffers included; see ``_profiled``), is at
    most the largest chunk's canonical bytes plus a stated slack, and a fraction of the full
    model. The slack: while a stacked expert projection [E, F, H] is gathered over EP the rank
    also holds its input [E / EP, F, H], and gloo gathers into a flat temporary of the output's
    size and copies out (ProcessGroupGloo; NCCL writes in place): slack = (1 + 1 / EP) x the
    largest projection. ``export_canonical`` (the whole model on every rank), measured the
    same way, holds several times more.
(c) vectorized collectives, counted from the profiler's c10d ops: one broadcast over PP per
    tensor kind of every chunk (a layer's 3 x E expert tensors are 3 kinds, whatever E), and on
    each rank one all-gather per TP-split tensor of its stage's chunks plus two (expert-TP, EP)
    per stacked expert projection: none per expert.
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from tests.dist_harness import run_ranks
from tests.models import TINY_MOE_L6 as MODEL
from tests.profiled_memory import profiled_peak

WORLD, TP, PP, EP = 8, 2, 2, 2


def _profiled(fn, trace: str) -> tuple[int, dict[str, int]]:
    """(peak live CPU bytes above the start while ``fn`` runs, count of each c10d op it ran).

    torch.profiler's ``[memory]`` events (chrome trace: address and signed size of every CPU
    allocation and free, from every thread the profiler covers) replayed in time order, each
    allocation live until its free. gloo's worker threads sometimes drop the last reference to a
    collective's input after the op (outside the profiler's scope), so that free is missing; a
    later allocation at the same address proves the block was freed by then, and a block never
    seen again counts as live to the end. A measurement can thus only overstate, by a few such
    buffers at random; the test keeps the least of five runs of the same sync (the sync itself
    is deterministic) and bounds every run by half the model (tests/profiled_memory.py)."""
    peak, events = profiled_peak(fn, trace)
    ops: dict[str, int] = {}
    for e in events:
        if e.get("name", "").startswith("c10d::"):
            ops[e["name"]] = ops.get(e["name"], 0) + 1
    return peak, ops


def _kinds(chunk: list[str]) -> set[str]:
    """The tensor kinds of a chunk's canonical names: a layer's experts stacked per projection."""
    return {re.sub(r"experts\.\d+\.", "experts.", k) for k in chunk}


def _worker(rank: int, tmp: str) -> dict:
    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.weights.canonical import random_canonical_weights
    from moe_rl.weights.megatron_shards import tp_split_dim

    weights = random_canonical_weights(MODEL, seed=0)
    par = ParallelConfig(
        nproc=WORLD, tensor_parallel=TP, pipeline_parallel=PP, expert_parallel=EP, distributed_optimizer=False
    )
    ctx = dist.init_distributed(par, seed=7)
    learner = Learner(MODEL, par, OptimConfig(lr=1e-3), ctx, weights, monitor=False)
    layout = (ctx.pp_rank, ctx.tp_rank, ctx.ep_rank, ctx.etp_size, ctx.dp_size)

    chunks = [dict(c) for c in learner.iter_canonical_layers()]
    joined = {k: v for c in chunks for k, v in c.items()}
    expected_chunks = [["model.embed_tokens.weight"]]
    expected_chunks += [
        [k for k in weights if k.startswith(f"model.layers.{i}.")] for i in range(MODEL.num_layers)
    ]
    expected_chunks += [["model.norm.weight", "lm_head.weight"]]
    exported = learner.export_canonical()
    exact = {
        "chunks": [sorted(c) for c in chunks] == [sorted(c) for c in expected_chunks],
        "once": sum(map(len, chunks)) == len(joined) == len(weights),
        "weights": all(torch.equal(joined[k], weights[k]) for k in weights),
        "export": sorted(exported) == sorted(weights)
        and all(torch.equal(exported[k], joined[k]) for k in weights),
    }
    del chunks, joined, exported

    engine = BuiltinEngine(MODEL, dtype="fp32", pad_id=0)
    engine.load_weights(random_canonical_weights(MODEL, seed=1))  # its own tensors exist from here on
    before = engine.model.w["model.layers.3.mlp.experts.gate_proj"].clone()
    peaks_ops = [
        _profiled(
            lambda: engine.load_weights(learner.iter_canonical_layers()), f"{tmp}/stream_{rank}_{i}.json"
        )
        for i in range(5)
    ]  # the same sync five times: a missed free can only overstate, keep the least
    stream_peak, stream_ops = min(peaks_ops, key=lambda p: p[0])
    slots = engine.model._slots
    exact["engine"] = (
        engine.model.loaded
        and all(torch.equal(slots[k], weights[k]) for k in weights)
        and not torch.equal(before, engine.model.w["model.layers.3.mlp.experts.gate_proj"])
    )
    export_peak, _ = _profiled(lambda: learner.export_canonical(), f"{tmp}/export_{rank}.json")

    nbytes = {k: t.numel() * t.element_size() for k, t in weights.items()}
    chunk_bytes = [sum(nbytes[k] for k in c) for c in expected_chunks]
    projection = max(v for k, v in nbytes.items() if ".mlp.experts." in k) * MODEL.num_experts
    first, n_local = learner.shard.layer_offset, len(learner.gpt.decoder.layers)
    owned = expected_chunks[first + 1 : first + n_local + 1] + (
        [expected_chunks[0]] if ctx.pp_rank == 0 else [expected_chunks[-1]] if ctx.pp_rank == PP - 1 else []
    )
    gathers = sum(
        (2 if ".experts." in k else 1)
        for c in owned
        for k in _kinds(c)
        if ".experts." in k or tp_split_dim(k) is not None
    )
    result = {
        "layout": layout,
        "exact": exact,
        "stream_peak": stream_peak,
        "export_peak": export_peak,
        "stream_peaks": [p for p, _ in peaks_ops],
        "max_chunk": max(chunk_bytes),
        "full": sum(chunk_bytes),
        "slack": projection + projection // EP,
        "broadcasts": stream_ops.get("c10d::broadcast_", 0),
        "num_kinds": sum(len(_kinds(c)) for c in expected_chunks),
        "num_tensors": len(weights),
        "allgathers": stream_ops.get("c10d::_allgather_base_", 0),
        "expected_allgathers": gathers,
        "ops": stream_ops,
    }
    dist.shutdown()
    return result


@pytest.mark.dist
def test_streamed_sync_is_exact_and_holds_one_layer(tmp_path, capsys):
    results = run_ranks(_worker, WORLD, str(tmp_path))
    r0 = results[0]
    with capsys.disabled():
        print(f"\nfull model {r0['full']} B, largest chunk {r0['max_chunk']} B, slack {r0['slack']} B")
        for rank, r in enumerate(results):
            print(
                f"rank {rank} (pp, tp, ep, etp, dp) {r['layout']}: "
                f"streamed sync peaks {r['stream_peaks']} B, "
                f"export_canonical peak {r['export_peak']} B, c10d ops {r['ops']}"
            )
    # the layout the test is about: 2 stages x 2 TP x 2 EP ranks, experts split over expert-TP too
    assert sorted(r["layout"] for r in results) == sorted(
        (p, t, e, 2, 2) for p in range(PP) for t in range(TP) for e in range(EP)
    )
    assert r0["max_chunk"] < r0["full"] / 4  # the model is clearly more than one layer
    for rank, r in enumerate(results):
        assert all(r["exact"].values()), (rank, r["exact"])
        assert 0 < r["stream_peak"] <= r["max_chunk"] + r["slack"], (rank, r)
        assert max(r["stream_peaks"]) < r["full"] / 2, (rank, r)
        assert r["export_peak"] > 2 * r["stream_peak"], (rank, r)  # what streaming saves, really measured
        # one broadcast per kind: 3 per MoE layer for its 3 x E expert tensors
        assert (
            r["broadcasts"]
            == r["num_kinds"]
            == r["num_tensors"] - 3 * (MODEL.num_experts - 1) * len(MODEL.moe_layers)
        ), (rank, r)
        assert r["allgathers"] == r["expected_allgathers"] > 0, (rank, r)
