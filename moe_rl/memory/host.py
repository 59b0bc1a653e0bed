"""Host memory per rank: CPU Adam's state as megatron-core 0.16.1 allocates it, the learner state
offload parks there, vLLM's sleeping weights, each pinned buffer rounded up as torch's CUDA host
caching allocator rounds it; and CPU Adam's seconds per step from a measured throughput.

CPU Adam (``optim.cpu_adam``: megatron-core's HybridDeviceOptimizer with offload_fraction 1,
param_update_in_fp32 and, as moe_rl/learner/build.py sets it, the precision-aware distributed
optimizer, whose parameter groups are the rank's bf16 shards), per element of the rank's shard
(optimizer/cpu_offloading/hybrid_optimizer.py ``_get_sub_optimizer_param_groups`` and
``_set_sub_optimizer_grads``):

    fp32 main param    4 B  ``param.detach().clone().float()`` of the host copy (pageable)
    Adam m, v          8 B  torch AdamW's ``exp_avg`` / ``exp_avg_sq`` of the fp32 param (pageable)
    fp32 grad copy     4 B  ``torch.empty(..., pin_memory=pin_cpu_grads)`` (pinned: rounded)
    bf16 host copy     2 B  ``.cpu().pin_memory()``, dropped once the fp32 copy exists, but its
                            pinned block stays in the caching host allocator (rounded)

16 B live plus the cached 2 B: 18 B an element, not the 12 B of the GPU optimizer. The device's
fp32 grad buffers stay on the device (the D2H copy reads them).

Offload (``parallel.offload_during_rollout``, moe_rl/learner/offload.py) copies each storage it
moves into one pinned host buffer: megatron DDP's param buffers (one storage for the dense and
one for the expert parameters), the fp32 main-param shards and Adam's m and v (one tensor per
parameter shard); the grad buffers' contents are dropped, not copied: no host bytes. vLLM at sleep
level 1 backs every weight allocation up in a pinned host tensor (vLLM's CuMemAllocator): its
fused per-layer tensors (w13 and w2 of the layer's experts, the layer's attention) and the
embeddings.

Pinned rounding: torch's CachingHostAllocator rounds every pinned allocation up to the next power
of two (c10's ``PowerOf2Ceil``) and keeps freed blocks cached. Tensor sizes are modelled, not
listed: the experts' fc1 (2F / ETP x H) and fc2 (H x F / ETP) per expert, split over expert-DP;
the dense parameters as one block per layer of the stage.
"""

from __future__ import annotations

import math

from moe_rl.config import RunConfig
from moe_rl.memory.learner_layout import Layout
from moe_rl.memory.sizes import param_counts

# CPU Adam bytes per element of the rank's optimizer shard (module docstring)
CPU_ADAM_PAGEABLE_B = 12  # fp32 main param + Adam m, v
CPU_ADAM_PINNED_B = 6  # fp32 grad copy (4) + the cached bf16 host copy (2)

# torch.optim.AdamW(fused=True) on fp32 CPU tensors, elements a second on one core, measured by
# `python scripts/bench_cpu_adam.py` (docs/measurements.md 10); `moe-rl estimate
# --cpu-adam-gelems-per-s` overrides the per-rank figure
CPU_ADAM_ELEMS_PER_S_PER_CORE = 0.35e9
HOST_CORES_PER_RANK = 12  # an 8-GPU H100 node with 2 x 56 cores, some left to data and the launcher
# What the recipes may plan to use of a DGX H100's 2 TB (2,048 GB = 1,907 GiB; docs/design.md 14.1):
# the rest is the kernel's and firmware's reserve, each rank's own process (Python, torch, CUDA
# context, NCCL), the reward workers and the page cache that checkpoint reads and writes go through
DGX_H100_USABLE_HOST_GIB = 1700


def pinned(nbytes: float) -> float:
    """Bytes a pinned host allocation of ``nbytes`` takes: the next power of two (0 stays 0)."""
    return 0.0 if nbytes <= 0 else float(2 ** math.ceil(math.log2(nbytes)))


def pinned_blocks(block_bytes: float, count: float) -> float:
    """``count`` pinned allocations of ``block_bytes`` each, rounded."""
    return pinned(block_bytes) * count


def _tensor_blocks(cfg: RunConfig, lay: Layout, st: dict, elem_bytes: float) -> float:
    """Pinned bytes of one host tensor per parameter shard of the stage, ``elem_bytes`` an element
    (module docstring: experts' fc1 and fc2 per expert, the dense parameters one block a layer)."""
    m = cfg.model
    shard_d, shard_e = (lay.dp, lay.expert_dp) if cfg.parallel.distributed_optimizer else (1, 1)
    HF = m.hidden_size * m.moe_ffn_hidden_size / lay.expert_tp
    local_experts = st["expert"] / (3 * HF) if HF else 0.0  # expert count x MoE layers of the stage
    experts = pinned_blocks(2 * HF * elem_bytes / shard_e, local_experts)
    experts += pinned_blocks(HF * elem_bytes / shard_e, local_experts)
    layers = max(1, st["layers"])
    return experts + pinned_blocks(st["dense"] / shard_d / layers * elem_bytes, layers)


def stage_host(cfg: RunConfig, lay: Layout, st: dict) -> dict[str, float]:
    """Host bytes of one rank of a stage (``st``: its ``stage_memory``), by owner."""
    elems = st["host_optim_elems"]
    cpu_adam = 0.0
    if cfg.optim.cpu_adam:
        cpu_adam = CPU_ADAM_PAGEABLE_B * elems + _tensor_blocks(cfg, lay, st, CPU_ADAM_PINNED_B)
    offload = 0.0
    if cfg.parallel.offload_during_rollout:
        w_bytes = st["weights"] / max(1.0, st["dense"] + st["expert"])
        offload = pinned(st["dense"] * w_bytes) + pinned(st["expert"] * w_bytes)  # DDP's param buffers
        if st["optimizer"]:  # GPU Adam: m, v (+ fp32 main params with bf16 weights) per shard tensor
            per_elem = st["optimizer"] / max(1.0, elems)
            offload += _tensor_blocks(cfg, lay, st, per_elem)
    return {"cpu_adam": cpu_adam, "offload": offload}


def vllm_asleep(cfg: RunConfig) -> float:
    """Host bytes of one vLLM rank's weights asleep at level 1: one pinned backup per fused tensor
    (per layer: the experts' w13 and w2 over vLLM TP, the rest of the layer; the embeddings)."""
    m, v = cfg.model, cfg.rollout.vllm
    if cfg.rollout.engine != "vllm" or v.sleep_level != 1:
        return 0.0
    wb = 2 if cfg.rollout.dtype == "bf16" else 4
    c, n_moe = param_counts(m), len(m.moe_layers)
    expert_layer = m.num_experts * m.hidden_size * m.moe_ffn_hidden_size * wb / v.tensor_parallel
    embed = m.vocab_size * m.hidden_size * wb / v.tensor_parallel
    n_embed = 1 if m.tie_word_embeddings else 2
    dense_layer = (c["dense"] * wb / v.tensor_parallel - n_embed * embed) / m.num_layers
    return (
        pinned_blocks(2 * expert_layer, n_moe)
        + pinned_blocks(expert_layer, n_moe)
        + pinned_blocks(dense_layer, m.num_layers)
        + pinned_blocks(embed, n_embed)
    )


def cpu_adam_seconds(elems: float, elems_per_s: float | None = None) -> float:
    """Seconds of one CPU Adam step over a rank's ``elems`` (its shard), at ``elems_per_s`` a rank
    (default: the measured one-core figure x HOST_CORES_PER_RANK)."""
    rate = elems_per_s or CPU_ADAM_ELEMS_PER_S_PER_CORE * HOST_CORES_PER_RANK
    return elems / rate
