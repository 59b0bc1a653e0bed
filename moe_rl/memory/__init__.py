"""Back-of-envelope arithmetic for sizing runs: parameter counts, per-GPU memory, FLOPs and MFU.

Used by the recipes' memory comments (tests/test_configs.py recomputes them), by ``moe-rl
estimate`` (a config's numbers, per pipeline stage, and the ranked layouts of ``choose_layout``),
and by ``scripts/gpu_smoke_summary.py`` (MFU). Estimates, not measurements: every assumption is
written next to the number it produces.

One job a module, imports pointing down this list:

    sizes      parameter counts, attention and KV-cache bytes, FLOPs and MFU
    learner_layout  the learner layout (``Layout``) and the parameters one GPU of a stage holds
    device     a stage's bytes on the device while it trains (``stage_memory``), the margin
    host       host bytes per rank: CPU Adam as megatron-core allocates it, offload, vLLM asleep,
               pinned rounding; CPU Adam's seconds a step
    phases     device bytes at each phase of the colocated step (``COLOCATED_ORDER``)
    sync       the weight sync's bytes per engine rank and its seconds (line rate, the peers' range)
    estimate   a run's estimate (``estimate``), the rollout peaks, ``fits``, a rank's host bytes
    ranking    the layouts ranked for a node count, and the table of them
    runs       a run's measured summary (``summarize_run``)
"""

from moe_rl.memory.device import MARGIN_GIB, layer_activations, micro_batches, stage_memory
from moe_rl.memory.estimate import (
    estimate,
    fits,
    host_bytes_per_rank,
    phase_peak_gib,
    rollout_peaks,
    unfit_phase,
)
from moe_rl.memory.host import (
    CPU_ADAM_ELEMS_PER_S_PER_CORE,
    DGX_H100_USABLE_HOST_GIB,
    HOST_CORES_PER_RANK,
    cpu_adam_seconds,
    pinned,
)
from moe_rl.memory.learner_layout import Layout, stage_params
from moe_rl.memory.phases import COLOCATED_ORDER, PEAK_PHASES, engine_weight_bytes, phase_bytes
from moe_rl.memory.ranking import (
    Ranked,
    candidate_layouts,
    choose_layout,
    format_estimate,
    layout_table,
    rank_layouts,
)
from moe_rl.memory.runs import summarize_run
from moe_rl.memory.sizes import (
    H100_BF16_DENSE_TFLOPS,
    GiB,
    attention_params,
    forward_flops_per_token,
    kv_cache_bytes_per_token,
    mfu,
    param_counts,
    train_flops_per_token,
)
from moe_rl.memory.sync import IB_GBS, NVLINK_GBS, PCIE_GBS, PEER_SYNC_S, peer_sync_range, sync_traffic

__all__ = [
    "COLOCATED_ORDER",
    "CPU_ADAM_ELEMS_PER_S_PER_CORE",
    "DGX_H100_USABLE_HOST_GIB",
    "HOST_CORES_PER_RANK",
    "PEAK_PHASES",
    "cpu_adam_seconds",
    "host_bytes_per_rank",
    "engine_weight_bytes",
    "phase_bytes",
    "phase_peak_gib",
    "pinned",
    "unfit_phase",
    "GiB",
    "H100_BF16_DENSE_TFLOPS",
    "IB_GBS",
    "MARGIN_GIB",
    "NVLINK_GBS",
    "PCIE_GBS",
    "PEER_SYNC_S",
    "Layout",
    "Ranked",
    "attention_params",
    "candidate_layouts",
    "choose_layout",
    "estimate",
    "fits",
    "format_estimate",
    "forward_flops_per_token",
    "kv_cache_bytes_per_token",
    "layer_activations",
    "layout_table",
    "mfu",
    "micro_batches",
    "param_counts",
    "peer_sync_range",
    "rank_layouts",
    "rollout_peaks",
    "stage_memory",
    "stage_params",
    "summarize_run",
    "sync_traffic",
    "train_flops_per_token",
]
