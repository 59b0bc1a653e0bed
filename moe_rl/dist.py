"""Rank/world helpers and process-group setup: the one place that starts torch.distributed and
megatron-core's parallel state. Everything else receives groups as arguments."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.config import ParallelConfig
from moe_rl.errors import ConfigError
from moe_rl.pipeline.placement import init_placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelDims:
    """Ranks, sizes and process groups of every parallel dimension, read once from megatron's
    parallel state and passed to the learner, replay, monitor and metrics (nothing else asks
    ``parallel_state``). Groups are None where a dimension has one rank and nothing needs the
    group.

    dp: data parallel (ranks that hold different data); tp: tensor; pp: pipeline; ep: expert;
    etp: expert-tensor; edp: expert-data parallel (the ranks that hold the same experts);
    tp_dp: tensor x data (under sequence parallelism TP ranks route disjoint positions, so
    routing statistics sum over both); mp: model parallel (tensor x pipeline: the ranks that must
    be given the same batch)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    dp_group: Any = None
    tp_group: Any = None
    pp_group: Any = None
    ep_group: Any = None
    etp_group: Any = None
    edp_group: Any = None
    # expert-TP x EP x PP: the ranks that hold the experts of every stage between them
    expert_mp_group: Any = None
    tp_dp_group: Any = None
    mp_group: Any = None
    # the roles' ranks and the groups that link them (moe_rl/pipeline/placement.py); None: colocated, as
    # code that builds a learner directly (tests, export) has it
    placement: Any = None

    @property
    def is_main(self) -> bool:
        """The rank that writes the run directory: learner rank 0."""
        return self.rank == 0 and (self.placement is None or self.placement.is_learner)

    @property
    def is_rollout(self) -> bool:
        """A rank that only runs an engine (``parallel.rollout_ranks``): no megatron state."""
        return self.placement is not None and self.placement.is_rollout

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def from_parallel_state(cls) -> ParallelDims:
        """The dimensions megatron's ``initialize_model_parallel`` set up on this rank."""
        from megatron.core import parallel_state as ps

        cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=tp,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=pp,
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            dp_group=ps.get_data_parallel_group(),
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
            ep_group=ps.get_expert_model_parallel_group(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            edp_group=ps.get_expert_data_parallel_group(),
            expert_mp_group=ps.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
            tp_dp_group=ps.get_tensor_and_data_parallel_group(),
            mp_group=ps.get_model_parallel_group() if tp * pp > 1 else None,
        )


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)
    # megatron-core logs every buffer and parameter at INFO; keep its warnings only
    logging.getLogger("megatron").setLevel(logging.WARNING)


def init_distributed(par: ParallelConfig, seed: int) -> ParallelDims:
    """Start the default group from torchrun/elastic env vars and megatron's model-parallel groups.

    Must run after megatron_patches.apply_all() on CPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    backend = par.backend if par.backend != "auto" else ("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":  # one GPU per rank; a gloo run on a GPU machine asks for no device
        torch.cuda.set_device(local_rank)
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    if world != par.nproc:
        # Under an external torchrun the launcher decides the world size; the config must agree,
        # since batch splits and EP layout were validated against parallel.nproc.
        raise ConfigError(
            f"config key 'parallel.nproc' is {par.nproc} but the launcher started "
            f"{world} ranks; set parallel.nproc={world}"
        )
    # colocated: the default group is the whole world; split: each role's own (moe_rl/pipeline/placement.py)
    placement = init_placement(par.nproc, par.rollout_ranks, backend, datetime.timedelta(minutes=10))
    if placement.is_rollout:
        torch.manual_seed(seed)
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        return ParallelDims(dist.get_rank(), dist.get_world_size(), local_rank, device, placement=placement)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_parallel,
        pipeline_model_parallel_size=par.pipeline_parallel,
        expert_model_parallel_size=par.expert_parallel,
        expert_tensor_parallel_size=par.expert_tp,
    )
    # Router weights and CPU-initialised params use the default generator; megatron's tracker
    # forks per-rank expert and tensor-parallel streams from the same seed.
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return dataclasses.replace(ParallelDims.from_parallel_state(), placement=placement)


def shutdown(clean: bool = True) -> None:
    """Tear the process groups down. ``clean=False`` (this rank raised): nothing collective, not
    even a barrier, since a peer may be inside another collective or gone; the process is about
    to exit and takes its groups with it."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized() and clean:
        dist.barrier()
        if ps.model_parallel_is_initialized():
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
