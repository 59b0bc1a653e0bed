"""Rank/world helpers and process-group setup: the one place that starts torch.distributed and
megatron-core's parallel state. Everything else receives groups as arguments."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
                        force=True)
    # megatron-core logs every buffer and parameter at INFO; keep its warnings only
    logging.getLogger("megatron").setLevel(logging.WARNING)


def init_distributed(par: ParallelConfig, seed: int) -> DistContext:
    """Start the default group from torchrun/elastic env vars and megatron's model-parallel groups.

    Must run after megatron_patches.apply_all() on CPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    backend = par.backend if par.backend != "auto" else ("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    world = dist.get_world_size()
    if world != par.nproc:
        # Under an external torchrun the launcher decides the world size; the config must agree,
        # since batch splits and EP layout were validated against parallel.nproc.
        raise ValueError(f"config key 'parallel.nproc' is {par.nproc} but the launcher started "
                         f"{world} ranks; set parallel.nproc={world}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_parallel,
        pipeline_model_parallel_size=par.pipeline_parallel,
        expert_model_parallel_size=par.expert_parallel,
    )
    # Router weights and CPU-initialised params use the default generator; megatron's tracker
    # forks per-rank expert and tensor-parallel streams from the same seed.
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return DistContext(
        rank=dist.get_rank(), world_size=world, local_rank=local_rank,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
    )


def shutdown() -> None:
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ranks (identity when torch.distributed is not initialised)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def comm_device(group) -> torch.device:
    """Where a collective's tensors must live: CUDA for an NCCL group, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's equally shaped ``t`` along dim 0, in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
