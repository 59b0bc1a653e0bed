"""dist tier: the colocated sliced sync (moe_rl/weights/slice_stream.py) on 4 ranks, in two layouts
the 8-rank test (test_weight_stream.py (e), learner TP 2 = engine TP 2 or 4) does not show:

- PP 2 x EP 2 (TP 1, each stage 2 data-parallel ranks holding 2 experts of 4 each), engines of vLLM
  TP 4 (world rank r hosts TP rank r: rank r + 2, its pipeline peer, another slice) and TP 2
  (pipeline peers host the same slice). The piece bound is one local expert per EP rank, so each
  MoE layer's experts travel in two pieces.
- learner TP 4 (expert-TP 4), engines of TP 2: an engine slice joins two learner TP pieces, which
  for row-parallel tensors (o_proj, down_proj) are not slabs along dim 0, so they land through
  the receive buffer beside the rank's own piece (4 query groups and 56 vocabulary rows, which
  megatron splits over TP 4; vLLM's padded rows give the engine ranks 32 and 24).

Checked on every rank, for both engines: ``WeightSync``'s ``weight_sync/bytes`` equals
``sync_receive_bytes(cfg, rank)``; a test engine that narrows what it is handed as vLLM's loaders
do holds exactly what it holds after the whole stream narrowed (``engine_slice``), and that is
the learner's weights' slice; the rank receives fewer bytes from other ranks than in the whole
stream. The 8-rank layout with TP 2 is in test_weight_stream.py (e).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from tests.dist_harness import run_ranks
from tests.models import TINY_MOE_L4

WORLD = 4
MHA = dataclasses.replace(TINY_MOE_L4, num_query_groups=4, vocab_size=56)  # TP 4 splits 56 rows
LAYOUTS = {  # name: (TP, PP, EP, engine TPs, model)
    "pp2_ep2": (1, 2, 2, (4, 2), TINY_MOE_L4),
    "tp4": (4, 1, 1, (2,), MHA),
}


class _NarrowingEngine:
    """Keeps what it is handed (full shapes, ``placed``) narrowed to its shard, as vLLM loads."""

    def __init__(self, shard, model) -> None:
        self.shard, self.model, self.w = shard, model, {}

    def load_weights(self, weights) -> None:
        from moe_rl.weights.engine_shard import engine_slice

        for chunk in weights:
            self.w.update({n: t.clone() for n, t in engine_slice(chunk, self.shard, self.model).items()})


class _Bounded:
    def __init__(self, learner, bound: int) -> None:
        self.learner, self.bound = learner, bound

    def iter_canonical_layers(self, bound_bytes=None, engines=None):
        return self.learner.iter_canonical_layers(self.bound, engines=engines)


def _received(fn) -> int:
    """Bytes this rank receives from other ranks while ``fn`` runs (all-gathers less its input,
    broadcasts it does not send, all-to-all parts from others)."""
    import torch.distributed as tdist

    got, real = [0], (tdist.all_gather_into_tensor, tdist.broadcast, tdist.all_to_all_single)

    def gather(out, inp, group=None, **kw):
        got[0] += (out.numel() - inp.numel()) * out.element_size()
        return real[0](out, inp, group=group, **kw)

    def broadcast(t, src, group=None, **kw):
        got[0] += 0 if tdist.get_rank() == src else t.numel() * t.element_size()
        return real[1](t, src, group=group, **kw)

    def all_to_all(out, inp, out_sizes=None, in_sizes=None, group=None, **kw):
        got[0] += (sum(out_sizes) - out_sizes[tdist.get_rank(group)]) * out.element_size()
        return real[2](out, inp, out_sizes, in_sizes, group=group, **kw)

    tdist.all_gather_into_tensor, tdist.broadcast, tdist.all_to_all_single = gather, broadcast, all_to_all
    try:
        fn()
    finally:
        tdist.all_gather_into_tensor, tdist.broadcast, tdist.all_to_all_single = real
    return got[0]


def _worker(rank: int, layout: str) -> dict:
    from moe_rl import dist
    from moe_rl.config import Schedule, load_config
    from moe_rl.learner.learner import Learner
    from moe_rl.pipeline.weight_sync import WeightSync, colocated_slices
    from moe_rl.weights.canonical import random_canonical_weights
    from moe_rl.weights.engine_shard import engine_shard, engine_slice, placed, sync_receive_bytes

    tp, pp, ep, engine_tps, MODEL = LAYOUTS[layout]
    weights = random_canonical_weights(MODEL, seed=0)
    par = ParallelConfig(
        nproc=WORLD, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, distributed_optimizer=False
    )
    ctx = dist.init_distributed(par, seed=7)
    learner = Learner(MODEL, par, OptimConfig(lr=1e-3), ctx, weights, monitor=False)
    expert = weights["model.layers.1.mlp.experts.0.up_proj.weight"]
    bound = 3 * expert.numel() * expert.element_size() * ep  # one local expert of each EP rank
    out: dict = {"layout": (ctx.pp_rank, ctx.ep_rank, ctx.tp_rank)}
    for engine_tp in engine_tps:
        keys = ["parallel.nproc=4", "rollout.engine=vllm", f"rollout.vllm.tensor_parallel={engine_tp}"]
        cfg = dataclasses.replace(load_config(None, [*keys, "rollout.dtype=fp32"]), model=MODEL)
        shard, engines = engine_shard(cfg, rank), colocated_slices(cfg)
        sliced, whole = _NarrowingEngine(shard, MODEL), _NarrowingEngine(shard, MODEL)
        sync = WeightSync.from_config(cfg, Schedule.from_config(cfg), sliced, _Bounded(learner, bound), ctx)
        counted = sync.sync()["weight_sync/bytes"].value.item()
        whole.load_weights(
            placed(engine_slice(c, shard, MODEL), shard, MODEL) for c in learner.iter_canonical_layers(bound)
        )
        want = engine_slice(weights, shard, MODEL)
        consume = lambda it: [None for _ in it]  # noqa: E731
        out[engine_tp] = {
            "counted": counted,
            "expected": sync_receive_bytes(cfg, rank),
            "same_as_whole": sorted(sliced.w) == sorted(whole.w)
            and all(torch.equal(sliced.w[n], whole.w[n]) for n in whole.w),
            "learner": sorted(sliced.w) == sorted(want)
            and all(torch.equal(sliced.w[n], want[n]) for n in want),
            "received": _received(lambda: consume(learner.iter_canonical_layers(bound, engines=engines))),
            "received_whole": _received(lambda: consume(learner.iter_canonical_layers(bound))),
        }
    dist.shutdown()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_colocated_slices_are_the_whole_stream_narrowed(layout, capsys):
    tp, pp, ep, engine_tps, _ = LAYOUTS[layout]
    results = run_ranks(_worker, WORLD, layout)
    assert sorted(r["layout"] for r in results) == sorted(
        (p, e, t) for p in range(pp) for e in range(ep) for t in range(tp)
    ) * (WORLD // (tp * pp * ep))
    for rank, r in enumerate(results):
        with capsys.disabled():
            print(
                f"\n{layout} rank {rank} (pp, ep, tp) {r['layout']}: "
                + "; ".join(
                    f"engine TP {tp}: handed {r[tp]['counted']:.0f} B (expected {r[tp]['expected']}), "
                    f"from other ranks {r[tp]['received']} B (whole stream {r[tp]['received_whole']} B)"
                    for tp in engine_tps
                )
            )
        for e in engine_tps:
            c = r[e]
            assert c["counted"] == c["expected"], (rank, e, c)
            assert c["same_as_whole"] and c["learner"], (rank, e, c)
            assert 0 < c["received"] < c["received_whole"], (rank, e, c)
        assert len(engine_tps) == 1 or r[4]["counted"] < r[2]["counted"], (rank, r)
