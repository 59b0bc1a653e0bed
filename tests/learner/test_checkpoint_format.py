"""dist tier: the distributed optimizer's checkpoint format (moe_rl/learner/build.py
``OPTIM_CKPT_METADATA``: ``dp_reshardable``, each data-parallel rank's flat shard written as it is).

2 ranks, EP=2 (DP=2 for the dense parameters), distributed optimizer, three real Adam steps before the
save. Checked: a checkpoint records its format in megatron's content metadata; it loads into a
learner built from other weights with the weights and every Adam moment bitwise equal to the
saver's, and the next step after the load is bitwise equal to the saver's next step. A checkpoint
written in the format used before (``fully_reshardable``, no content metadata) still loads the
same way (``checkpoint.saved_format`` falls back to it)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from tests.dist_harness import run_ranks
from tests.learner.checkpoint_cases import batch, nll
from tests.models import TINY_MOE_L2_ALL_MOE as MODEL

MOMENTS = ("exp_avg", "exp_avg_sq")
SAVED_STEPS = 3


def _steps(learner) -> list[float]:
    """Each parameter's Adam step (torch Adam keeps one per parameter)."""
    opts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    return [float(st["step"]) for o in opts for st in o.optimizer.state.values()]


def _moments(learner) -> list[torch.Tensor]:
    opts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    return [
        st[k].clone()
        for o in opts
        for group in o.optimizer.param_groups
        for p in group["params"]
        for st in [o.optimizer.state[p]]
        for k in MOMENTS
    ]


def _legacy_save(learner, path) -> None:
    """What a checkpoint of the format before looked like: the old metadata, none recorded."""
    from megatron.core import dist_checkpointing

    from moe_rl.learner import checkpoint
    from moe_rl.learner.build import LEGACY_OPTIM_CKPT_METADATA

    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True)
    torch.distributed.barrier()
    state = checkpoint._sharded_state(learner, is_loading=False, metadata=LEGACY_OPTIM_CKPT_METADATA)
    dist_checkpointing.save(state, str(path))
    if torch.distributed.get_rank() == 0:
        (path / "trainer_state.json").write_text('{"step": 1}')
    torch.distributed.barrier()


def _worker(rank: int, root: str):
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from moe_rl import dist
    from moe_rl.learner import checkpoint
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    weights, other = random_canonical_weights(MODEL, seed=0), random_canonical_weights(MODEL, seed=1)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    par = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=True)
    ctx = dist.init_distributed(par, seed=7)
    a = Learner(MODEL, par, optim, ctx, weights)
    for i in range(SAVED_STEPS):  # not 1: the step megatron's load-time dummy step leaves
        assert not a.update(batch(rank + 4 * i), nll, 1.0, 4, lr=1e-2).skipped
    new = checkpoint.save(a, Path(root) / "new", 1, {})
    legacy = Path(root) / "legacy" / "step_000001"
    _legacy_save(a, legacy)
    saved_w, saved_m, saved_steps = a.export_canonical(), _moments(a), _steps(a)
    assert not a.update(batch(rank + 2), nll, 1.0, 4, lr=1e-2).skipped
    next_w = a.export_canonical()
    out = {
        "recorded": dist_checkpointing.load_content_metadata(str(new)),
        "legacy_recorded": dist_checkpointing.load_content_metadata(str(legacy)),
    }
    for name, path in (("new", new), ("legacy", legacy)):
        b = Learner(MODEL, par, optim, ctx, other)
        checkpoint.load(b, path)
        w, m, steps = b.export_canonical(), _moments(b), _steps(b)
        assert not b.update(batch(rank + 2), nll, 1.0, 4, lr=1e-2).skipped
        w2 = b.export_canonical()
        out[name] = {
            "weights_equal": all(torch.equal(w[k], saved_w[k]) for k in saved_w),
            "moments": len(m),
            "moments_equal": len(m) == len(saved_m) and all(torch.equal(x, y) for x, y in zip(m, saved_m)),
            "moments_nonzero": all(float(x.abs().max()) > 0 for x in m),
            "steps": steps,
            "saved_steps": saved_steps,
            "next_step_diff": max(float((w2[k] - next_w[k]).abs().max()) for k in next_w),
        }
    dist.shutdown()
    return out


@pytest.mark.dist
def test_checkpoint_format_recorded_and_both_formats_load_exactly(tmp_path):
    from moe_rl.learner.build import OPTIM_CKPT_METADATA

    for rank, res in enumerate(run_ranks(_worker, 2, str(tmp_path))):
        assert res["recorded"] == OPTIM_CKPT_METADATA, rank
        assert res["recorded"]["distrib_optim_sharding_type"] == "dp_reshardable"
        assert res["legacy_recorded"] is None, rank
        for name in ("new", "legacy"):
            r = res[name]
            where = f"rank {rank}, {name} format"
            assert r["weights_equal"] and r["moments"] > 0, where
            assert r["moments_equal"] and r["moments_nonzero"], where
            assert r["steps"] == r["saved_steps"] == [float(SAVED_STEPS)] * len(r["steps"]), where
            assert r["next_step_diff"] == 0.0, where
