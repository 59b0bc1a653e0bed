"""dist tier: token-budget micro-batches (algo.max_tokens_per_micro_batch) give the fixed-size path's
log-probs, recorded routes (in batch order), replayed log-probs and gradients, to float tolerance,
on 2 gloo ranks with EP=2. One spawn runs every check."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.learner.parallel_cases import GRAD_RTOL, LOGP_TOL, RECORD, REPLAY, nll_entropy_loss, random_routes
from tests.models import TINY_MOE_L3 as MODEL


def _data(rank: int):
    g = torch.Generator().manual_seed(50 + rank)
    lens_B = torch.tensor([14, 9, 12, 5, 14, 7, 3, 11])
    pos_S = torch.arange(14)
    tokens_BS = torch.randint(3, MODEL.vocab_size, (8, 14), generator=g) * (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, (pos_S[None] >= 2) & (pos_S[None] < lens_B[:, None])


def _passes(learner, rank: int) -> dict:
    tokens_BS, lens_B, mask_BS = _data(rank)
    plain = TrainBatch(tokens_BS, lens_B)
    native = learner.forward_logprobs(plain, 0.8, 4, RECORD)
    forced = random_routes(lens_B, learner.route_header)
    replayed = learner.forward_logprobs(plain.replace(routes=forced), 0.8, 4, REPLAY)
    learner.forward_backward(
        TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS, routes=forced), nll_entropy_loss, 0.8, 4, REPLAY
    )
    return {
        "logp": native.stats.logp_BS,
        "entropy": native.stats.entropy_BS,
        "spi": native.stats.sum_pi_sq_BS,
        "recorded": native.routing.recorded.ids_NLK,
        "rows": native.routing.recorded.rows_B,
        "replayed": replayed.stats.logp_BS,
        "grads": learner.canonical_grads(),
    }


def _worker(rank: int):
    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    weights = random_canonical_weights(MODEL, seed=0)
    par = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    fixed = _passes(Learner(MODEL, par, OptimConfig(), ctx, weights, monitor=False), rank)
    budget = _passes(
        Learner(MODEL, par, OptimConfig(), ctx, weights, monitor=False, max_tokens_per_micro_batch=30), rank
    )
    # columns past a sequence's own length hold whatever its micro-batch's padding gave (out of every
    # mask, on either path); the sequence's own positions must agree
    _, lens_B, _ = _data(rank)
    real_BS = torch.arange(14)[None] < lens_B[:, None]
    out = {
        k: float(((fixed[k] - budget[k]) * real_BS).abs().max())
        for k in ("logp", "entropy", "spi", "replayed")
    }
    out["routes_equal"] = torch.equal(fixed["recorded"], budget["recorded"]) and torch.equal(
        fixed["rows"], budget["rows"]
    )
    out["grad_rel"] = max(
        float(
            (fixed["grads"][k] - budget["grads"][k]).abs().max()
            / fixed["grads"][k].abs().max().clamp(min=1e-12)
        )
        for k in fixed["grads"]
    )
    out["replay_moves_logp"] = float((fixed["logp"] - fixed["replayed"]).abs().max())
    dist.shutdown()
    return out


@pytest.mark.dist
def test_token_budget_equals_fixed_size_micro_batches() -> None:
    for r in run_ranks(_worker, 2):
        assert r["routes_equal"]
        assert max(r["logp"], r["entropy"], r["spi"], r["replayed"]) < LOGP_TOL, r
        assert r["grad_rel"] < GRAD_RTOL, r
        assert r["replay_moves_logp"] > 1e-3  # forced routes really were replayed
