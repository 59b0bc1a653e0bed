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
    """Bytes one learner rank receives in one weight sync, and the seconds the stated links take.

    The sync (moe_rl/weights/stream.py) walks the model a chunk (one decoder layer) at a time:
    the ranks of the owning pipeline stage join the chunk's TP pieces and all-gather its experts
    over EP (expert weights that live on other EP ranks reach every rank this way: each rank
    receives the (EP - 1) / EP of the stage's experts it does not hold), then the owning stage
    broadcasts the chunk over the pipeline group. So every rank receives the whole model in the
    rollout dtype and the engine (vLLM: each of its TP ranks) keeps its own slice. ``gather``:
    the own stage's bytes less the rank's shard (over NVLink when the TP x EP x ETP group is inside
    a node, else InfiniBand); ``broadcast``: the other stages' bytes (InfiniBand when the stages
    are on different nodes). Seconds: bytes / link bandwidth, the two phases in sequence, no
    overlap or protocol overhead: a lower bound."""
    m = cfg.model
    wb = 2 if cfg.rollout.dtype == "bf16" else 4
    layers = lay.stage_layers(m.num_layers)
    whole = Layout(world=lay.pp, pp=lay.pp, first=lay.first, last=lay.last)  # unsharded stages
    stage_full = [sum(stage_params(m, whole, s, layers)) for s in range(lay.pp)]
    total = param_counts(m)["total"]
    worst: dict[str, float] = {}
    for s in range(lay.pp):
        dense, expert = stage_params(m, lay, s, layers)
        gather = (stage_full[s] - dense - expert) * wb
        full_e = expert * lay.ep * lay.expert_tp
        experts_gathered = (full_e - expert) * wb
        broadcast = (total - stage_full[s]) * wb
        inside = max(lay.tp, lay.ep * lay.expert_tp) <= gpus_per_node
        across = lay.pp > 1 and lay.world > gpus_per_node
        seconds = gather / ((NVLINK_GBS if inside else IB_GBS) * 1e9) + broadcast / (
            (IB_GBS if across else NVLINK_GBS) * 1e9
        )
        row = {
            "sync_bytes": gather + broadcast,
            "sync_expert_gather_bytes": experts_gathered,
            "sync_gather_bytes": gather,
            "sync_broadcast_bytes": broadcast,
            "sync_s": seconds,
        }
        if not worst or row["sync_s"] > worst["sync_s"]:
            worst = row
    return worst
