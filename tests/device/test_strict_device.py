"""device tier: real training steps on 2 CPU ranks in which any tensor that moe-rl creates without
an explicit device lands on ``meta`` (tests/device_check.py), so it cannot meet the model's
tensors: what a forgotten device does on a GPU, caught without one.

Covers the rollout (dynamic sampling's rounds, over-sampling's abort and partial rollouts),
old-log-prob, reference and update passes (replay off, r2, r3), the router monitor, the rollout
corrections (IS, rejection, TRM sample and exact, DVP), metrics, checkpoint save and resume; and
one tensor-parallel run (TP=2: sequence parallelism, vocabulary-parallel log-probs, TP-sliced
replay). MOE_RL_DEVICE_LIST=1 lists every
site instead of failing at the first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.dist_harness import run_ranks
from tests.e2e.helpers import deterministic, metrics

RUNS = {
    # dynamic sampling's rounds, and the data cursor the resumed run below restores (docs/sampling.md);
    # over-sampling's abort, resumed partial rollouts and their checkpoint (docs/sampling.md 6)
    "off": [
        "routing.replay=off",
        "checkpoint_every=1",
        "algo.dynamic_sampling.enabled=true",
        "algo.over_sampling.factor=2",
        "algo.over_sampling.on_abort=partial",
        "algo.over_sampling.check_every=2",
        "rollout.long_tail_frac=0.05",
    ],
    "r2": [
        "routing.replay=r2",
        "algo.kl_coef=0.01",
        "correction.is_level=token",
        "correction.rejection=[{option: seq_mean_k3, upper: 0.01}]",
        "correction.trm.max=0.05",
    ],
    "r3": [
        "routing.replay=r3",
        "correction.dvp_threshold=0.05",
        "correction.trm.avg=0.05",
        "correction.trm.kl=exact",
        "optim.length_lr.enabled=true",
    ],
}
TP2 = ["parallel.tensor_parallel=2", "parallel.expert_parallel=1", "routing.replay=r3", "algo.kl_coef=0.01"]
COMMON = [
    "steps=2",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "log.progress_bar=false",
    "log.wandb_mode=disabled",
]


def _worker(rank: int, root: str, redirect: bool = True) -> dict:
    import torch.distributed
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl import dist, trainer
    from moe_rl.config import load_config
    from tests.device_check import strict_device
    from tests.e2e.helpers import stopped_copy

    caught = {}
    dims = None
    for name, overrides in [
        *RUNS.items(),
        ("off_from1", [*RUNS["off"], "resume=true"]),  # step 1 again, from the first checkpoint's partials
        ("off_resumed", [*RUNS["off"], "resume=true", "steps=3"]),
        ("tp2", TP2),
    ]:
        run_dir = f"{root}/{name.removesuffix('_resumed')}"
        if name == "off_from1":  # "off" as a run stopped after its first checkpoint (step_000001) leaves it
            if rank == 0:
                stopped_copy(Path(root, "off"), Path(run_dir), 1)
            torch.distributed.barrier()
        cfg = trainer.preflight(
            load_config(None, [*COMMON, *overrides, f"run_dir={run_dir}"]), check_run_dir=False
        )
        if dims is None:
            dims = dist.init_distributed(cfg.parallel, cfg.seed)
        if name == "tp2":  # the same 2 ranks as one tensor-parallel model (sequence parallel, vocab-parallel)
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=2)
            dims = dist.ParallelDims.from_parallel_state()
        RouterReplay.clear_global_router_replay_instances()
        with strict_device(redirect) as mode:
            trainer.train(cfg, dims)
        caught[name] = sorted(mode.sites)
    dist.shutdown()
    return caught


@pytest.mark.device
def test_training_steps_create_every_tensor_where_it_is_used(tmp_path):
    results = run_ranks(_worker, 2, str(tmp_path), os.environ.get("MOE_RL_DEVICE_LIST") is None)
    for rank, caught in enumerate(results):
        # nothing slipped through (a meta tensor would have raised); the mode really intercepted
        # moe-rl's factories only where a device was left out, which must now be nowhere
        sites = sorted(set().union(*caught.values()))
        assert sites == [], f"rank {rank}: tensors made without a device at\n" + "\n".join(sites)
        assert sorted(caught) == sorted([*RUNS, "off_from1", "off_resumed", "tp2"])
    assert (tmp_path / "off" / "checkpoints" / "step_000003").is_dir()  # the resumed run saved its step
    # over-sampling's partial rollouts resume exactly (issue 46 point 2): step 1 resumed from the first
    # checkpoint, its pending groups read back, equals the uninterrupted run's step 1, metric for metric
    full, again = metrics(tmp_path / "off")[1], metrics(tmp_path / "off_from1")[1]
    assert again["sampling/resumed"] > 0 and again["sampling/resumed"] == full["sampling/resumed"]
    assert deterministic(again) == deterministic(full)
