"""dist tier: a checkpoint of a learner whose optimizer has never stepped (every minibatch so far
had zero gradient and was skipped) is written, loads, and resumes bit for bit.

megatron's DistributedOptimizer asserted on the empty Adam state when saving, and its FP32
optimizer dropped a shared step of 0 (its load then failed on the missing ``step``); see
``moe_rl/learner/checkpoint.py``. 2 ranks, EP=2, with and without the distributed optimizer."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from tests.dist_harness import run_ranks
from tests.learner.checkpoint_cases import batch, nll, zero_signal
from tests.models import TINY_MOE_L2_ALL_MOE as MODEL


def _worker(rank: int, root: str):
    from pathlib import Path

    from moe_rl import dist
    from moe_rl.learner import checkpoint
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    weights, other = random_canonical_weights(MODEL, seed=0), random_canonical_weights(MODEL, seed=1)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)  # decay: a zero-gradient Adam step would move weights
    out = {}
    ctx = None
    for distopt in (True, False):
        par = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=distopt)
        ctx = ctx or dist.init_distributed(par, seed=7)
        a = Learner(MODEL, par, optim, ctx, weights)
        skipped = a.update(batch(rank), zero_signal, 1.0, 4, lr=1e-2).skipped
        path = checkpoint.save(a, Path(root) / f"distopt_{distopt}", 1, {})
        saved_unchanged = all(torch.equal(v, weights[k]) for k, v in a.export_canonical().items())
        b = Learner(MODEL, par, optim, ctx, other)  # other weights: the load must overwrite them
        checkpoint.load(b, path)
        loaded_equal = all(torch.equal(v, weights[k]) for k, v in b.export_canonical().items())
        c = Learner(MODEL, par, optim, ctx, weights)  # never saved: the uninterrupted run
        for learner in (a, b, c):
            assert not learner.update(batch(rank), nll, 1.0, 4, lr=1e-2).skipped
        wa, wb, wc = (x.export_canonical() for x in (a, b, c))
        out[distopt] = {
            "skipped": skipped,
            "saved_unchanged": saved_unchanged,
            "loaded_equal": loaded_equal,
            "resumed_vs_uninterrupted": max(float((wb[k] - wc[k]).abs().max()) for k in wc),
            "saved_vs_uninterrupted": max(float((wa[k] - wc[k]).abs().max()) for k in wc),
            "moved": max(float((wc[k] - weights[k]).abs().max()) for k in wc),
            "files": sorted(p.name for p in path.iterdir())[:3],
        }
    dist.shutdown()
    return out


@pytest.mark.dist
def test_unstepped_checkpoint_saves_loads_and_resumes_exactly(tmp_path):
    for rank, res in enumerate(run_ranks(_worker, 2, str(tmp_path))):
        for distopt, r in res.items():
            where = f"rank {rank}, distributed_optimizer={distopt}"
            assert r["skipped"], where
            assert r["saved_unchanged"] and r["loaded_equal"], where
            assert r["moved"] > 1e-4, where  # the real step after the resume did move the weights
            assert r["resumed_vs_uninterrupted"] == 0.0, where
            assert r["saved_vs_uninterrupted"] == 0.0, where
    assert (tmp_path / "distopt_True" / "step_000001" / "trainer_state.json").is_file()
