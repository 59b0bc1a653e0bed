"""dist tier: the megatron learner with pipeline parallelism (PP=2: stage 0 holds the embedding and
layers 0-1, stage 1 layers 2-3, the output layer and the loss; megatron's 1F1B schedule with p2p
over gloo) against PP=1 (DP=2, both ranks on the same data) on the same canonical weights. One
spawn of 2 ranks runs every check.

Checked, PP=2 vs PP=1, on both stages (every stage must return the same values): log-probs,
entropy and sum pi^2 (broadcast from the last stage); gradients in canonical names (gathered
from the owning stages); routes recorded per stage and joined; replay of the recorded routes (no
flips, same log-probs) and of forced random routes (same log-probs, same agreement metrics, the
same keys on both stages); per-micro-batch loss metrics; the router-gradient monitor's metrics;
one optimizer step (distributed optimizer): reported gradient norm and weights after it; a dist
checkpoint save + load round trip (weights equal, and the next step equal to the saver's).
Micro-batches have different lengths (the stages exchange shapes).

Tolerances (fp32): log-probs / entropy / sum pi^2 max |diff| < 1e-5; gradients max relative
diff < 1e-5 per tensor; weights after one Adam step max |diff| < 1e-6 (lr 1e-3)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.learner.parallel_cases import (
    GRAD_RTOL,
    LOGP_TOL,
    LR,
    REPLAY,
    batch_data,
    check_stepped_layout,
    compare_common,
    exported_exactly,
    nll_entropy_loss,
    random_routes,
    routing_passes,
    single_rank_reference,
    step_and_resume,
    update_pass,
)
from tests.models import TINY_MOE_L4 as MODEL


def _data():
    """The same batch on every rank; micro-batches of 4 are 13 and 11 long."""
    return batch_data(MODEL.vocab_size)


def _full_vocab_inputs(batch):
    """DVP safe sets and rollout distributions (generated positions >= 3), as the engine reports them."""
    g = torch.Generator().manual_seed(400)
    B, S, V = *batch.tokens_BS.shape, MODEL.vocab_size
    safe_BSV = torch.rand(B, S, V, generator=g) < 0.7
    dist_BSV = (
        torch.log_softmax(torch.randn(B, S, V, generator=g), -1) * (torch.arange(S) >= 3)[None, :, None]
    )
    return batch.replace(safe_BSV=safe_BSV, rollout_dist_BSV=dist_BSV)


def _run(learner, par_opt: ParallelConfig, ctx, weights, ckpt_dir: str | None) -> dict:
    tokens_BS, lens_B, mask_BS = _data()
    plain = TrainBatch(tokens_BS, lens_B)
    got, _, forced_routes = routing_passes(learner, plain)
    full_vocab = learner.forward_logprobs(_full_vocab_inputs(plain), 0.8, 4).stats
    got.update(update_pass(learner, plain.replace(loss_mask_BS=mask_BS, routes=forced_routes)))
    stepped = step_and_resume(MODEL, par_opt, ctx, weights, plain.replace(loss_mask_BS=mask_BS), ckpt_dir)
    extra = {
        k: v
        for k, v in full_vocab.fields().items()
        if k in ("exact_kl_BS", "full_logp_BS", "log_safe_mass_BS")
    }
    return {**got, **stepped, "dvp_logp": full_vocab.logp_BS, "extra": extra}


def _compare(pp: dict, ref: dict) -> dict:
    # the reference's DP ranks each run the batch twice (DP = world, PP = 1)
    return {
        **compare_common(pp, ref, 2),
        "dvp_logp_diff": float((pp["dvp_logp"] - ref["dvp_logp"]).abs().max()),
        "extra_diff": max(float((pp["extra"][k] - v).abs().max()) for k, v in ref["extra"].items()),
        "extra_keys": sorted(pp["extra"])
        == sorted(ref["extra"])
        == ["exact_kl_BS", "full_logp_BS", "log_safe_mass_BS"],
    }


def _recompute_grads(par: ParallelConfig, ctx, weights) -> dict:
    """The replayed update pass with full activation recomputation (routes served again from the
    FIFO while 1F1B interleaves micro-batches): gradients as without it."""
    import dataclasses

    from moe_rl.learner.learner import Learner

    learner = Learner(
        dataclasses.replace(MODEL, recompute=True), par, OptimConfig(lr=LR), ctx, weights, monitor=False
    )
    tokens_BS, lens_B, mask_BS = _data()
    routes = random_routes(lens_B, learner.route_header)
    learner.forward_backward(
        TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS, routes=routes), nll_entropy_loss, 0.8, 2, REPLAY
    )
    return learner.canonical_grads()


def _worker(rank: int, ckpt_dir: str, world: int, ep: int):
    from megatron.core import parallel_state as ps

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    weights = random_canonical_weights(MODEL, seed=0)
    par = ParallelConfig(nproc=world, pipeline_parallel=2, expert_parallel=ep, distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    assert (ctx.dp_size, ctx.ep_size, ps.get_pipeline_model_parallel_world_size()) == (world // 2, ep, 2)
    pp = Learner(MODEL, par, OptimConfig(lr=LR), ctx, weights)
    stage = {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "layers": len(pp.gpt.decoder.layers),
        "embedding": hasattr(pp.gpt, "embedding"),
        "output": hasattr(pp.gpt, "output_layer"),
        "moe_hooks": pp.replay.layer_ids,
    }
    pp_out = _run(
        pp, ParallelConfig(nproc=world, pipeline_parallel=2, expert_parallel=ep), ctx, weights, ckpt_dir
    )
    exported = pp.export_canonical()
    recompute = _recompute_grads(par, ctx, weights)
    recompute_rel = max(
        float((recompute[k] - pp_out["grads"][k]).abs().max() / pp_out["grads"][k].abs().max())
        for k in pp_out["grads"]
    )
    export_exact = exported_exactly(exported, weights)
    tokens_BS, lens_B, _ = _data()
    try:  # pipeline stages given different batches fail closed
        pp.forward_logprobs(TrainBatch(tokens_BS + rank, lens_B), 1.0, 4)
        mismatch_error = None
    except RuntimeError as e:
        mismatch_error = str(e)

    ctx1 = single_rank_reference(ep)
    ref = Learner(
        MODEL,
        ParallelConfig(nproc=world, expert_parallel=ep, distributed_optimizer=False),
        OptimConfig(lr=LR),
        ctx1,
        weights,
    )
    ref_out = _run(ref, ParallelConfig(nproc=world, expert_parallel=ep), ctx1, weights, None)
    result = {
        **_compare(pp_out, ref_out),
        **stage,
        **pp_out["ckpt"],
        "export_exact": export_exact,
        "recompute_rel": recompute_rel,
        "mismatch_error": mismatch_error,
    }
    dist.shutdown()
    return result


@pytest.mark.dist
@pytest.mark.parametrize("world, ep", [(2, 1), (4, 2)])  # (4, 2): DP=2 per stage, experts split over EP=2
def test_pp2_matches_pp1(tmp_path, world, ep):
    results = run_ranks(_worker, world, str(tmp_path / "ckpt"), world, ep)
    print({k: v for k, v in results[0].items() if k.endswith(("diff", "rel"))})
    stages = [results[0], results[-1]]  # megatron puts PP outermost: the first ranks are stage 0
    assert [r["moe_hooks"] for r in stages] == [[1], [2, 3]], results
    assert [(r["embedding"], r["output"], r["layers"]) for r in stages] == [
        (True, False, 2),
        (False, True, 2),
    ]
    for rank, r in enumerate(results):
        assert r["export_exact"], (rank, r)
        assert r["mismatch_error"] and "different token batches" in r["mismatch_error"], (rank, r)
        assert r["extra_keys"] and r["dvp_logp_diff"] < LOGP_TOL and r["extra_diff"] < LOGP_TOL, (rank, r)
        assert r["recompute_rel"] < GRAD_RTOL, (rank, r)
        check_stepped_layout(r, rank)
