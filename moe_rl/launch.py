"""Start the training ranks: torch's elastic launch on one machine, or nothing under torchrun.

`moe-rl train` starts `parallel.nproc` local ranks with torch.distributed's elastic launcher (the
same machinery as `torchrun --standalone`). Under an external `torchrun`/Slurm launch the
environment already names the rank, and the worker runs directly.
"""

from __future__ import annotations

import os
import uuid

import torch

from moe_rl.config import RunConfig


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def run_worker(cfg: RunConfig) -> None:
    """One rank's whole life: patches, process groups, the training loop, teardown."""
    import megatron_patches
    from moe_rl import dist, trainer

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        # share the CPU cores between local ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.setup_logging(int(os.environ.get("RANK", "0")))
    megatron_patches.apply_all()
    dims = dist.init_distributed(cfg.parallel, cfg.seed)
    try:
        trainer.train(cfg, dims)
    finally:
        dist.shutdown()


def spawn_local(fn, nproc: int, *args):
    """Run ``fn(*args)`` on ``nproc`` local ranks (torch's elastic launcher, as `torchrun
    --standalone`); returns {rank: return value}. Also used by the benchmarks in scripts/."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=str(uuid.uuid4()), rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
        max_restarts=0, start_method="spawn", monitor_interval=0.5,
    )
    return elastic_launch(lc, fn)(*args)


def launch(cfg: RunConfig) -> None:
    if under_torchrun():
        run_worker(cfg)
        return
    spawn_local(run_worker, cfg.parallel.nproc, cfg)
