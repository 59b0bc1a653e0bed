"""dist tier: the streaming weight sync (moe_rl/weights/stream.py) on PP=2 x TP=2 x DP=2 with
EP=2 (expert-TP = TP = 2, megatron's default): 8 ranks, each stage 2 TP x 2 EP ranks. The stream
runs with a piece bound (``parallel.sync_bucket_mib``, here in bytes) of one local expert per EP
rank, below a MoE layer's bytes, so each MoE layer's 4 experts travel in 2 pieces of 2.

Checked on every rank:
(a) exactness: the pieces of ``Learner.iter_canonical_layers`` are the embedding, each decoder
    layer (a MoE layer as its other tensors, then experts {0, 2}, then {1, 3}: local expert j of
    each EP rank) and the final norm + lm_head, in that order, each tensor once, every expert
    piece within the bound; joined they equal ``export_canonical()`` (the default bound: each
    layer whole) and the canonical weights the learner was loaded with, exactly; a
    built-in fp32 engine fed the stream holds exactly them.
(b) memory: the peak of the live CPU bytes during one streamed sync into a built-in engine
    whose weights already exist, above the start (torch.profiler's ``[memory]`` events: every
    allocation and free with its address, gloo's own buffers included; see ``_profiled``), is at
    most the largest piece's canonical bytes plus a stated slack, and a fraction of the full
    model. The slack: while a stacked expert projection [P, F, H] of a piece is gathered over EP
    the rank also holds its input [P / EP, F, H], and gloo gathers into a flat temporary of the
    output's size and copies out (ProcessGroupGloo; NCCL writes in place): slack = (1 + 1 / EP) x
    the largest projection piece. ``export_canonical`` (the whole model on every rank), measured
    the same way, holds several times more.
(c) vectorized collectives, counted from the profiler's c10d ops: one broadcast over PP per
    tensor kind of every piece (a piece's 3 x P expert tensors are 3 kinds, whatever P), and on
    each rank one all-gather per TP-split tensor of its stage's chunks plus two (expert-TP, EP)
    per stacked expert projection and piece: none per expert.
(d) each engine rank receives only its slice (moe_rl/weights/engine_shard.py), for engines of
    vLLM TP 2: colocated, the slices a learner rank hands its engine rank (rank r is TP rank r % 2),
    the whole stream narrowed; split, over a sync group of rank 0 (the root)
    and ranks 1-4 standing for 4 rollout ranks (2 engines of TP 2) with a bf16 wire, each rank sent
    its slices alone, point to point. The bytes counted on arrival equal ``sync_receive_bytes(cfg,
    engine rank)`` and every received tensor equals the learner's slice bit for bit (bf16: its
    cast), and no rank receives a tensor whole that TP splits (the vocabulary unevenly: 32 / 18
    rows of 50, vLLM's padding).
(e) the colocated sliced sync (moe_rl/weights/slice_stream.py, ``WeightSync.load_slices``) for
    engines of vLLM TP 2 (= learner TP: the TP slices are local, experts come over EP, a stage's
    pieces over PP) and TP 4 (each rank of a stage a different slice: KV heads replicated, the
    vocabulary in 16 / 16 / 16 / 2 rows, experts from every expert-TP x EP rank):
    ``weight_sync/bytes`` equals ``sync_receive_bytes(cfg, rank)``, and a test engine that
    narrows what it is handed as vLLM's loaders do holds, after the sync, exactly what it holds
    after the whole stream narrowed (``engine_slice``): the learner's slices. With engines of TP
    2, the live bytes while the sliced stream is consumed, and the bytes a rank receives from
    other ranks, stay below the whole stream's. (Pipeline peers hosting different slices:
    test_colocated_slices.py.)
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
ENGINE_TP, SPLIT_RECEIVERS = 2, 4  # vLLM TP 2; the split sync's rollout ranks: world ranks 1..4
ENGINE_TPS = (2, 4)  # the colocated sliced sync's engines (e)


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


def _layer(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def _expected_pieces(weights: dict) -> list[list[str]]:
    """The stream's pieces under a bound of one local expert per EP rank: the embedding; per
    layer its tensors but the experts, then local expert j of every EP rank (experts j and
    j + E / EP); the final norm and lm_head."""
    per = MODEL.num_experts // EP
    out = [["model.embed_tokens.weight"]]
    for i in range(MODEL.num_layers):
        layer = [k for k in weights if _layer(k) == i]
        out.append([k for k in layer if ".experts." not in k])
        for j in range(per):
            ids = {f".experts.{r * per + j}." for r in range(EP)}
            piece = [k for k in layer if any(e in k for e in ids)]
            out += [piece] if piece else []
    return out + [["model.norm.weight", "lm_head.weight"]]


def _cfg(dtype: str, engine_tp: int = ENGINE_TP):
    import dataclasses

    from moe_rl.config import load_config

    keys = {"parallel.nproc": WORLD, "rollout.engine": "vllm", "rollout.vllm.tensor_parallel": engine_tp}
    cfg = load_config(None, [f"{k}={v}" for k, v in {**keys, "rollout.dtype": dtype}.items()])
    return dataclasses.replace(cfg, model=MODEL)


def _received(got: dict, want: dict, wire) -> dict:
    """(bytes counted, every tensor equal bit for bit to the learner's slice in its wire dtype)."""
    same = sorted(got) == sorted(want) and all(
        got[n].dtype == wire(n, want[n].dtype) and torch.equal(got[n], want[n].to(got[n].dtype)) for n in want
    )
    return {"bytes": sum(t.numel() * t.element_size() for t in got.values()), "equal": same}


def _engine_slices(learner, weights: dict, rank: int, bound: int) -> dict:
    """(d): what engine ranks of vLLM TP 2 receive, colocated and split, against the count."""
    import datetime

    import torch.distributed as dist

    from moe_rl.pipeline.placement import Group
    from moe_rl.pipeline.weight_broadcast import broadcast_weights, receive_weights, wire_dtype
    from moe_rl.pipeline.weight_sync import split_slices
    from moe_rl.rollout.base import ENGINE_DTYPES
    from moe_rl.weights.engine_shard import engine_shard, engine_slice, sync_receive_bytes

    out: dict = {}
    colocated = _cfg("fp32")  # a colocated engine is handed the learner's fp32 tensors
    shard = engine_shard(colocated, rank)
    got = {
        n: t for c in learner.iter_canonical_layers(bound) for n, t in engine_slice(c, shard, MODEL).items()
    }
    want = engine_slice(weights, shard, MODEL)
    out["colocated"] = _received(got, want, lambda n, d: d) | {
        "expected": sync_receive_bytes(colocated, rank)
    }
    out["colocated_vocab_rows"] = got["model.embed_tokens.weight"].shape[0]

    split, members = _cfg("bf16"), tuple(range(SPLIT_RECEIVERS + 1))
    sync = None
    if rank in members:  # the sync group of a split world: built on the store, as placement.py does
        store = dist.PrefixStore("sync_test", dist.distributed_c10d._get_default_store())
        pg = dist.ProcessGroupGloo(store, rank, len(members), datetime.timedelta(seconds=120))
        sync = Group(pg, members, rank)
    stream = learner.iter_canonical_layers(bound)
    engine = ENGINE_DTYPES[split.rollout.dtype]
    if rank == 0:
        sliced = split_slices(split, SPLIT_RECEIVERS)  # what WeightSync sends the rollout ranks
        m = broadcast_weights(stream, sync, version=1, engine=engine, sliced=sliced)
        out["split_root_bytes"] = m["weight_sync/bytes"]
        out["split_expected"] = [sync_receive_bytes(split, i) for i in range(SPLIT_RECEIVERS)]
    elif sync is not None:  # rollout rank rank - 1 of the split layout, in step with the stream
        shard, pieces = engine_shard(split, rank - 1), iter(stream)
        next(pieces)  # the root sends a piece once the stream (collective) has made it
        _, received = receive_weights(sync, sliced=True)
        named = dict(next(received))
        for _ in pieces:
            named.update(next(received))
        assert next(received, None) is None  # the end marker
        wire = lambda n, d: wire_dtype(n, d, engine)  # noqa: E731
        out["split"] = _received(named, engine_slice(weights, shard, MODEL), wire) | {
            "counted": received.nbytes,
            "expected": sync_receive_bytes(split, rank - 1),
        }
    else:
        for _ in stream:
            pass
    return out


class _NarrowingEngine:
    """A colocated engine of one shard that loads as vLLM's loaders do: each tensor handed (full
    shape, ``placed``) narrowed to the shard's slice, kept."""

    def __init__(self, shard) -> None:
        self.shard, self.w = shard, {}

    def load_weights(self, weights) -> None:
        from moe_rl.weights.engine_shard import engine_slice

        for chunk in weights:
            self.w.update({n: t.clone() for n, t in engine_slice(chunk, self.shard, MODEL).items()})


class _Bounded:
    """The learner with the test's piece bound (WeightSync streams at the configured one)."""

    def __init__(self, learner, bound: int) -> None:
        self.learner, self.bound = learner, bound

    def iter_canonical_layers(self, bound_bytes=None, engines=None):
        return self.learner.iter_canonical_layers(self.bound, engines=engines)


def _wire_bytes(fn) -> int:
    """Bytes this rank receives from other ranks while ``fn`` runs: the outputs of its all-gathers
    less its own input, the broadcasts it does not send, the all-to-all parts from others."""
    import torch.distributed as tdist

    got, real = [0], (tdist.all_gather_into_tensor, tdist.broadcast, tdist.all_to_all_single)

    def gather(out, inp, group=None, **kw):
        got[0] += (out.numel() - inp.numel()) * out.element_size()
        return real[0](out, inp, group=group, **kw)

    def broadcast(t, src, group=None, **kw):
        got[0] += 0 if tdist.get_rank() == src else t.numel() * t.element_size()
        return real[1](t, src, group=group, **kw)

    def all_to_all(out, inp, out_sizes=None, in_sizes=None, group=None, **kw):
        mine = out_sizes[tdist.get_rank(group)]
        got[0] += (sum(out_sizes) - mine) * out.element_size()
        return real[2](out, inp, out_sizes, in_sizes, group=group, **kw)

    tdist.all_gather_into_tensor, tdist.broadcast, tdist.all_to_all_single = gather, broadcast, all_to_all
    try:
        fn()
    finally:
        tdist.all_gather_into_tensor, tdist.broadcast, tdist.all_to_all_single = real
    return got[0]


def _colocated_slices(learner, weights: dict, rank: int, bound: int, tmp: str) -> dict:
    """(e): the colocated sliced sync for engines of TP 2 and 4 against the whole stream."""
    from moe_rl.config import Schedule
    from moe_rl.pipeline.weight_sync import WeightSync, colocated_slices
    from moe_rl.weights.engine_shard import engine_shard, engine_slice, placed, sync_receive_bytes

    out: dict = {}
    for engine_tp in ENGINE_TPS:
        cfg = _cfg("fp32", engine_tp)
        shard, engines = engine_shard(cfg, rank), colocated_slices(cfg)
        sliced, whole = _NarrowingEngine(shard), _NarrowingEngine(shard)
        sync = WeightSync.from_config(
            cfg, Schedule.from_config(cfg), sliced, _Bounded(learner, bound), learner.dims
        )
        counted = sync.sync()["weight_sync/bytes"].value.item()
        whole.load_weights(
            placed(engine_slice(c, shard, MODEL), shard, MODEL) for c in learner.iter_canonical_layers(bound)
        )
        want = engine_slice(weights, shard, MODEL)
        out[engine_tp] = {
            "counted": counted,
            "expected": sync_receive_bytes(cfg, rank),
            "same_as_whole": sorted(sliced.w) == sorted(whole.w)
            and all(torch.equal(sliced.w[n], whole.w[n]) for n in whole.w),
            "learner": sorted(sliced.w) == sorted(want)
            and all(torch.equal(sliced.w[n], want[n]) for n in want),
        }
    engines = colocated_slices(_cfg("fp32", 2))
    consume = lambda it: [None for _ in it]  # noqa: E731
    out["sliced_wire"] = _wire_bytes(lambda: consume(learner.iter_canonical_layers(bound, engines=engines)))
    out["whole_wire"] = _wire_bytes(lambda: consume(learner.iter_canonical_layers(bound)))
    out["sliced_peak"] = min(
        _profiled(
            lambda: consume(learner.iter_canonical_layers(bound, engines=engines)),
            f"{tmp}/sl_{rank}_{i}.json",
        )[0]
        for i in range(3)
    )
    out["whole_peak"] = min(
        _profiled(lambda: consume(learner.iter_canonical_layers(bound)), f"{tmp}/wh_{rank}_{i}.json")[0]
        for i in range(3)
    )
    return out


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

    nbytes = {k: t.numel() * t.element_size() for k, t in weights.items()}
    bound = 3 * nbytes["model.layers.1.mlp.experts.0.up_proj.weight"] * EP  # one local expert a rank
    chunks = [dict(c) for c in learner.iter_canonical_layers(bound)]
    joined = {k: v for c in chunks for k, v in c.items()}
    expected_chunks = _expected_pieces(weights)
    exported = learner.export_canonical()
    exact = {
        "chunks": [sorted(c) for c in chunks] == [sorted(c) for c in expected_chunks],
        "once": sum(map(len, chunks)) == len(joined) == len(weights),
        "weights": all(torch.equal(joined[k], weights[k]) for k in weights),
        "export": sorted(exported) == sorted(weights)
        and all(torch.equal(exported[k], joined[k]) for k in weights),
        "bound": all(
            sum(nbytes[k] for k in c) <= bound for c in expected_chunks if any(".experts." in k for k in c)
        ),
    }
    del chunks, joined, exported
    slices = _engine_slices(learner, weights, ctx.rank, bound)
    colocated = _colocated_slices(learner, weights, ctx.rank, bound, tmp)

    engine = BuiltinEngine(MODEL, dtype="fp32", pad_id=0)
    engine.load_weights(random_canonical_weights(MODEL, seed=1))  # its own tensors exist from here on
    before = engine.model.w["model.layers.3.mlp.experts.gate_proj"].clone()
    peaks_ops = [
        _profiled(
            lambda: engine.load_weights(learner.iter_canonical_layers(bound)), f"{tmp}/stream_{rank}_{i}.json"
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

    chunk_bytes = [sum(nbytes[k] for k in c) for c in expected_chunks]
    projection = max(v for k, v in nbytes.items() if ".mlp.experts." in k) * EP  # a piece's
    first, n_local = learner.shard.layer_offset, len(learner.gpt.decoder.layers)
    stage_layers = range(first, first + n_local)
    owned = [c for c in expected_chunks if _layer(c[0]) in stage_layers] + (
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
        "slices": slices,
        "colocated": colocated,
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
        # one broadcast per kind: 3 per expert piece (2 a MoE layer) for its 3 x E / 2 expert tensors
        assert (
            r["broadcasts"]
            == r["num_kinds"]
            == r["num_tensors"] - 3 * (MODEL.num_experts - MODEL.num_experts // EP) * len(MODEL.moe_layers)
        ), (rank, r)
        assert r["allgathers"] == r["expected_allgathers"] > 0, (rank, r)
    _check_slices([r["slices"] for r in results], r0["full"])
    _check_colocated([r["colocated"] for r in results], r0["full"])


def _check_colocated(colocated: list[dict], full_fp32: int) -> None:
    """(e): each rank's counted bytes are sync_receive_bytes; the engine holds exactly what the
    whole stream gives it; consuming the sliced stream holds less than the whole one."""
    for rank, c in enumerate(colocated):
        print(
            f"colocated rank {rank}: "
            + ", ".join(
                f"engine TP {tp}: {c[tp]['counted']:.0f} B (expected {c[tp]['expected']})"
                for tp in ENGINE_TPS
            )
            + f"; stream peak sliced {c['sliced_peak']} B, whole {c['whole_peak']} B"
            + f"; from other ranks (engine TP 2) sliced {c['sliced_wire']} B, whole {c['whole_wire']} B"
        )
        for tp in ENGINE_TPS:
            assert c[tp]["counted"] == c[tp]["expected"], (rank, tp, c[tp])
            assert c[tp]["same_as_whole"] and c[tp]["learner"], (rank, tp, c[tp])
        assert c[2]["counted"] < 0.6 * full_fp32 and c[4]["counted"] < c[2]["counted"], (rank, c)
        assert 0 < c["sliced_peak"] < c["whole_peak"], (rank, c)
        assert 0 < c["sliced_wire"] < c["whole_wire"] / 2, (rank, c)  # deterministic: 0.41 measured


def _check_slices(slices: list[dict], full_fp32: int) -> None:
    """(d): the bytes each engine rank received are what sync_receive_bytes says, the tensors the
    learner's slices; TP 2 halves what a rank gets (bar the replicated norms and router)."""
    for rank, s in enumerate(slices):
        c = s["colocated"]
        assert c["equal"] and c["bytes"] == c["expected"], (rank, c)
        assert c["bytes"] < 0.6 * full_fp32, (rank, c)  # a slice, not the model
        assert s["colocated_vocab_rows"] == (32 if rank % ENGINE_TP == 0 else 18), rank
    root = slices[0]
    for i in range(SPLIT_RECEIVERS):
        got = slices[i + 1]["split"]
        print(f"split rollout rank {i}: received {got['counted']} B, sync_receive_bytes {got['expected']} B")
        assert (
            got["equal"] and got["counted"] == got["bytes"] == got["expected"] == root["split_expected"][i]
        ), (i, got)
        assert got["counted"] < 0.6 * full_fp32 / 2, (i, got)  # bf16, and a TP slice
    assert root["split_root_bytes"] == max(root["split_expected"])


@pytest.mark.unit
def test_pieces_keep_a_chunk_whole_within_the_bound_and_else_split_its_experts():
    from moe_rl.weights.stream import EXPERT_SLOT, Chunk, Kind, pieces

    f32 = torch.float32
    plain = Kind("model.layers.1.self_attn.q_proj.weight", (64, 64), f32)
    stacked = tuple(
        Kind(f"model.layers.1.mlp.experts.{EXPERT_SLOT}.{p}.weight", (8, 16, 32), f32)
        for p in ("down_proj", "gate_proj", "up_proj")
    )
    chunk = Chunk((1, 1), 0, (plain, *stacked))
    per_expert = 3 * 16 * 32 * 4
    assert [p.local for p in pieces(chunk, chunk.nbytes, ep_size=2)] == [(0, 4)]  # fits: whole
    split = pieces(chunk, 2 * 2 * per_expert, ep_size=2)  # 2 local experts of each of 2 EP ranks
    assert [p.local for p in split] == [None, (0, 2), (2, 4)]
    assert [p.expert_ids(8, 2) for p in split] == [[], [0, 1, 4, 5], [2, 3, 6, 7]]
    assert split[0].kinds == (plain,) and all(p.nbytes <= 2 * 2 * per_expert for p in split[1:])
    assert all(k.shape == (4, 16, 32) for p in split[1:] for k in p.kinds)  # one kind per projection
    assert [p.local for p in pieces(chunk, 1, ep_size=2)] == [None, (0, 1), (1, 2), (2, 3), (3, 4)]
