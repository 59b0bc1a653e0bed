"""dist tier: the megatron learner with EP=2 over gloo against EP=1 on the same weights, and the
learner -> engine weight sync. One spawn of 2 ranks runs every check (the import costs ~10 s)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.models import TINY_MOE_L3 as MODEL

LOGP_TOL = 1e-5
GRAD_RTOL = 1e-5
SYNC_LOGP_TOL = 1e-4


def _data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)  # each rank is a DP rank: its own data
    tokens_BS = torch.randint(3, MODEL.vocab_size, (6, 14), generator=g)
    lens_B = torch.tensor([14, 9, 12, 5, 14, 7])
    pos_S = torch.arange(14)
    tokens_BS = torch.where(pos_S[None] < lens_B[:, None], tokens_BS, 0)
    mask_BS = (pos_S[None] >= 3) & (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, mask_BS


def _nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def _run(learner, rank):
    tokens_BS, lens_B, mask_BS = _data(rank)
    st = learner.forward_logprobs(TrainBatch(tokens_BS, lens_B), 1.0, micro_batch_size=4).stats
    learner.forward_backward(TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS), _nll, 1.0, 4)
    return st.logp_BS, st.entropy_BS, learner.canonical_grads()


def _zero_signal(mb, st, normalizer):
    """Every token rejected: a loss that depends on the weights with an exactly zero gradient."""
    return (st.logp_BS * (mb.loss_mask_BS & False)).sum() / normalizer, {}


def _skip_checks(learner, rank: int) -> dict:
    """After a real step (Adam has momentum): a minibatch with no signal on any rank is skipped
    and leaves the weights bitwise unchanged; signal on one rank only steps on both; with the skip
    off, the zero gradient's step moves them on Adam's momentum alone (why the skip exists)."""
    tokens_BS, lens_B, mask_BS = _data(rank)
    batch = TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)
    before = learner.export_canonical()
    out = learner.update(batch, _zero_signal, 1.0, 4, lr=1e-2)
    after = learner.export_canonical()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    one_rank = learner.update(batch, _nll if rank == 1 else _zero_signal, 1.0, 4, lr=1e-2)
    stepped = learner.export_canonical()
    moved_one_rank = max(float((stepped[k] - after[k]).abs().max()) for k in after)
    learner.skip_zero_grad = False  # optim.skip_zero_grad=false: the step is taken on momentum alone
    off = learner.update(batch, _zero_signal, 1.0, 4, lr=1e-2)
    momentum_moved = max(float((learner.export_canonical()[k] - stepped[k]).abs().max()) for k in stepped)
    return {
        "skipped": out.skipped,
        "grad_norm": out.grad_norm,
        "unchanged": unchanged,
        "one_rank_skipped": one_rank.skipped,
        "one_rank_grad_norm": one_rank.grad_norm,
        "moved_one_rank": moved_one_rank,
        "off_skipped": off.skipped,
        "off_grad_norm": off.grad_norm,
        "momentum_moved": momentum_moved,
    }


def _worker(rank: int):
    from megatron.core import parallel_state as ps

    from moe_rl import dist
    from moe_rl.corrections.correction_specs import DvpSpec
    from moe_rl.learner.learner import Learner
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights

    weights = random_canonical_weights(MODEL, seed=0)
    par2 = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=False)
    ctx2 = dist.init_distributed(par2, seed=7)
    ep2 = Learner(MODEL, par2, OptimConfig(lr=1e-2), ctx2, weights)
    assert len(ep2.gpt.decoder.layers[1].mlp.experts.local_experts) == 2  # experts really split
    logp2, ent2, grads2 = _run(ep2, rank)

    # learner -> engine sync after a real step of the distributed optimizer (which updates
    # parameter shards, then all-gathers them), then greedy decoding in fp32
    par2d = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=True)
    ep2 = Learner(MODEL, par2d, OptimConfig(lr=1e-2), ctx2, weights)
    tokens_BS, lens_B, mask_BS = _data(rank)
    ep2.update(TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS), _nll, 1.0, 4, lr=1e-2)
    exported = ep2.export_canonical()
    moved = max(float((exported[k] - weights[k]).abs().max()) for k in weights)
    engine = BuiltinEngine(MODEL, dtype="fp32", pad_id=0)
    engine.load_weights(exported)
    out = engine.generate([[1, 5, 6, 7], [1, 9, 8]], 2, SamplingParams(max_new_tokens=6, top_k=1), seed=3)
    seq_lens_B = out.prompt_lens_B + out.response_lens_B
    learner_logp_BS = ep2.forward_logprobs(
        TrainBatch(out.tokens_BS, seq_lens_B), 1.0, micro_batch_size=4
    ).stats.logp_BS
    with torch.no_grad():
        pos = torch.arange(out.tokens_BS.shape[1]).expand_as(out.tokens_BS)
        logits_BSV = ep2.gpt(out.tokens_BS, pos, None)
    greedy_BS = torch.cat([out.tokens_BS[:, :1], logits_BSV[:, :-1].argmax(-1)], 1)
    m = out.response_mask_BS
    # DVP and exact KL: the engine's support travels with the batch; fp32 on both sides agrees
    dvp = engine.generate(
        [[1, 5, 6, 7], [1, 9, 8]],
        4,
        SamplingParams(max_new_tokens=5, temperature=1.5, dvp=DvpSpec(0.2), return_dist=True),
        seed=4,
    )
    dvp_lens_B = dvp.prompt_lens_B + dvp.response_lens_B
    st = ep2.forward_logprobs(
        TrainBatch(dvp.tokens_BS, dvp_lens_B, safe_BSV=dvp.safe_BSV, rollout_dist_BSV=dvp.dist_logp_BSV),
        1.5,
        4,
    ).stats
    dm = dvp.response_mask_BS
    dvp_result = {
        "logp_diff": float((st.logp_BS - dvp.logprobs_BS)[dm].abs().max()),
        "restricted_gt_full": bool((st.logp_BS[dm] >= st.full_logp_BS[dm] - 1e-6).all()),
        "exact_kl_max": float(st.exact_kl_BS[dm].abs().max()),
    }
    sync = {
        "greedy_agree": bool((greedy_BS[m] == out.tokens_BS[m]).all()),
        "dvp": dvp_result,
        "logp_diff": float((learner_logp_BS - out.logprobs_BS)[m].abs().max()),
        "num_response_tokens": int(m.sum()),
        "weights_moved": moved,
    }

    sync["skip"] = _skip_checks(ep2, rank)

    ps.destroy_model_parallel()
    par1 = ParallelConfig(nproc=2, expert_parallel=1, distributed_optimizer=False)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    ctx1 = dist.ParallelDims.from_parallel_state()
    ep1 = Learner(MODEL, par1, OptimConfig(lr=1e-2), ctx1, weights)
    logp1, ent1, grads1 = _run(ep1, rank)
    grad_rel = max(
        float((grads2[k] - grads1[k]).abs().max() / grads1[k].abs().max().clamp(min=1e-12)) for k in grads1
    )
    router_grad = min(
        float(grads2[f"model.layers.{i}.mlp.gate.weight"].abs().sum()) for i in MODEL.moe_layers
    )
    result = {
        "logp_diff": float((logp2 - logp1).abs().max()),
        "ent_diff": float((ent2 - ent1).abs().max()),
        "grad_rel": grad_rel,
        "same_keys": sorted(grads1) == sorted(grads2),
        "num_keys": len(grads1),
        "router_grad_abs_sum": router_grad,
        "sync": sync,
        "exported_equal_across_ranks": None,
    }
    # NaN/Inf is refused before any weight changes
    before = {k: v.clone() for k, v in ep1.gpt.state_dict().items() if torch.is_tensor(v)}
    tokens_BS, lens_B, mask_BS = _data(rank)
    try:
        ep1.update(
            TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS),
            lambda mb, st, n: (_nll(mb, st, n)[0] * float("nan"), {}),
            1.0,
            4,
            lr=1e-2,
        )
        result["nan_error"] = None
    except FloatingPointError as e:
        result["nan_error"] = str(e)
    after = ep1.gpt.state_dict()
    result["unchanged_after_nan"] = all(torch.equal(before[k], after[k]) for k in before)
    flat = torch.cat([exported[k].flatten() for k in sorted(exported)])
    other = flat.clone()
    torch.distributed.all_reduce(other, op=torch.distributed.ReduceOp.MAX)
    result["exported_equal_across_ranks"] = bool(torch.equal(other, flat))
    dist.shutdown()
    return result


@pytest.mark.dist
def test_ep2_matches_ep1_and_engine_sync():
    results = run_ranks(_worker, 2)
    for rank, r in enumerate(results):
        assert r["same_keys"] and r["num_keys"] > 30, r
        assert r["logp_diff"] < LOGP_TOL, (rank, r)
        assert r["ent_diff"] < LOGP_TOL, (rank, r)
        assert r["grad_rel"] < GRAD_RTOL, (rank, r)
        assert r["router_grad_abs_sum"] > 0, (rank, r)
        assert r["exported_equal_across_ranks"], (rank, r)
        assert r["sync"]["num_response_tokens"] > 0 and r["sync"]["weights_moved"] > 1e-4
        assert r["sync"]["greedy_agree"], (rank, r)
        assert r["sync"]["logp_diff"] < SYNC_LOGP_TOL, (rank, r)
        assert r["sync"]["dvp"]["logp_diff"] < SYNC_LOGP_TOL and r["sync"]["dvp"]["restricted_gt_full"], r
        assert r["sync"]["dvp"]["exact_kl_max"] < 1e-5, r  # same weights, both fp32
        assert r["nan_error"] and "non-finite loss nan" in r["nan_error"], (rank, r)
        assert r["unchanged_after_nan"], (rank, r)
        skip = r["sync"]["skip"]
        assert skip["skipped"] and skip["grad_norm"] == 0.0 and skip["unchanged"], (rank, skip)
        assert not skip["one_rank_skipped"] and skip["one_rank_grad_norm"] > 0, (rank, skip)
        assert skip["moved_one_rank"] > 1e-4, (rank, skip)
        assert not skip["off_skipped"] and skip["off_grad_norm"] == 0.0 and skip["momentum_moved"] > 1e-4, (
            skip
        )
