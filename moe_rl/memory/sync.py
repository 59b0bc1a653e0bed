"""The weight sync's traffic per rank and its seconds: line rate and the peers' measured range."""

from __future__ import annotations

from moe_rl.config import RunConfig
from moe_rl.memory.learner_layout import Layout, stage_params
from moe_rl.memory.sizes import param_counts

# Link bandwidths the sync and offload model assumes, GB/s one way per GPU (stated, not measured):
NVLINK_GBS = 450.0  # H100 SXM NVLink 4: 900 GB/s both ways per GPU
IB_GBS = 50.0  # one 400 Gb/s NDR InfiniBand NIC per GPU (8 per node)
PCIE_GBS = 55.0  # PCIe Gen5 x16: 64 GB/s nominal, ~55 achieved host <-> device


# Weight-sync seconds peers report per step (docs/design.md 14.3): about 1-7 s for a 30B MoE,
# 6-24 s from 235B to 1T parameters
PEER_SYNC_S = ((100e9, "30B-class MoE", 1.0, 7.0), (float("inf"), "235B-1T MoE", 6.0, 24.0))


def peer_sync_range(total_params: float) -> tuple[str, float, float]:
    """The peers' measured sync seconds for a model of ``total_params`` parameters."""
    return next((name, lo, hi) for limit, name, lo, hi in PEER_SYNC_S if total_params < limit)


def sync_traffic(cfg: RunConfig, lay: Layout, gpus_per_node: int = 8) -> dict[str, float]:
    """Bytes one engine rank receives in one weight sync, and the seconds at line rate.

    The sync streams from the learner's bf16 weights (moe_rl/memory/phases.py's order): the
    gathered unit is bounded by ``parallel.sync_bucket_mib`` and each engine rank receives only
    the tensors and slices its shard holds, from the learner ranks that hold them: a vLLM rank its
    TP slice of every tensor (the whole model / vLLM TP in the rollout dtype; replicated norms and
    routers counted once over TP, so a slight undercount), the built-in engine (unsharded) the
    whole model less what its own learner rank holds of the rank's stage. Seconds: bytes / link
    bandwidth (InfiniBand when the learner spans more than a node: the slices come from every EP
    and pipeline rank; NVLink inside one node), no overlap or protocol overhead: a lower bound.
    ``peer_sync_range`` gives the peers' measured seconds beside it."""
    m = cfg.model
    wb = 2 if cfg.rollout.dtype == "bf16" else 4
    total = param_counts(m)["total"]
    layers = lay.stage_layers(m.num_layers)
    if cfg.rollout.engine == "vllm":
        receive = total * wb / cfg.rollout.vllm.tensor_parallel
    else:
        own = min(sum(stage_params(m, lay, s, layers)) for s in range(lay.pp))
        receive = (total - own) * wb if cfg.parallel.rollout_ranks == 0 else total * wb
    link = IB_GBS if lay.world + cfg.parallel.rollout_ranks > gpus_per_node else NVLINK_GBS
    return {
        "sync_bytes": receive,
        "sync_bucket_bytes": float(cfg.parallel.sync_bucket_mib * 2**20),
        "sync_s": receive / (link * 1e9),
    }
