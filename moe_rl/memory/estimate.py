"""A run's per-GPU estimate (``estimate``), its rollout peaks with and without offload, and the
fit test."""

from __future__ import annotations

from moe_rl.config import RunConfig
from moe_rl.memory.device import MARGIN_GIB, stage_memory
from moe_rl.memory.learner_layout import Layout
from moe_rl.memory.sizes import GiB, kv_cache_bytes_per_token, param_counts
from moe_rl.memory.sync import PCIE_GBS, sync_traffic


def estimate(
    cfg: RunConfig, gpu_gib: float = 80.0, layout: Layout | None = None, gpus_per_node: int = 8
) -> dict[str, float]:
    """Per-GPU memory (GiB) of a run: learner state, training peak, rollout peak, vLLM KV tokens,
    host memory per node, weight-sync bytes and seconds.

    ``layout`` (default: the config's) places the learner (``stage_memory`` per pipeline stage);
    the learner keys below are those of the stage with the highest training peak (``peak_stage``),
    so they add up to ``train_peak_gib``. Rollout adds vLLM's whole budget (gpu_memory_utilization
    x GPU: bf16 weights over the vLLM TP group, ~2 GiB activations / CUDA graphs, the rest KV
    cache) to what the learner keeps resident then (the largest stage's
    ``learner_rollout_gib``: its whole state, or with parallel.offload_during_rollout only what is
    not offloaded); vLLM sleeps during training (sleep level 1: its weights wait in host memory).
    Host memory per node (``host_gib_per_node``): gpus_per_node x the largest stage's host bytes
    (CPU Adam's state, the offloaded state, vLLM's sleeping weights), beyond each process's own
    baseline."""
    m, v = cfg.model, cfg.rollout.vllm
    lay = layout or Layout.of(cfg.parallel)
    c = param_counts(m)
    stages = [stage_memory(cfg, lay, s) for s in range(lay.pp)]
    peak_stage = max(range(lay.pp), key=lambda s: stages[s]["train_peak"])
    top = stages[peak_stage]
    static_max = max(s["static"] for s in stages)
    resident_max = max(s["rollout_resident"] for s in stages)
    vllm = cfg.rollout.engine == "vllm"
    vllm_budget = v.gpu_memory_utilization * gpu_gib * GiB if vllm else 0.0
    vllm_weights = c["total"] * (2 if cfg.rollout.dtype == "bf16" else 4) / v.tensor_parallel
    kv_per_token = kv_cache_bytes_per_token(m, v.tensor_parallel)  # bf16
    kv_bytes = max(0.0, vllm_budget - vllm_weights - 2 * GiB)
    asleep = vllm_weights if vllm and v.sleep_level == 1 else 0.0
    host = max(s["host_optim"] + s["offloaded"] for s in stages) + asleep
    per_node = min(gpus_per_node, lay.world)
    stale = {"stale_weights_gib": top["stale"] / GiB} if cfg.rollout.staleness else {}  # k + 1 weight sets
    sync = sync_traffic(cfg, lay, gpus_per_node)
    return {
        "params_total_b": c["total"] / 1e9,
        "params_active_b": c["active"] / 1e9,
        "learner_params_per_gpu_b": (top["dense"] + top["expert"]) / 1e9,
        "dense_params_per_gpu_b": top["dense"] / 1e9,
        "expert_params_per_gpu_b": top["expert"] / 1e9,
        "weights_gib": top["weights"] / GiB,
        "grads_gib": top["grads"] / GiB,
        "optimizer_gib": top["optimizer"] / GiB,
        "reference_gib": top["reference"] / GiB,
        **stale,
        "learner_static_gib": top["static"] / GiB,
        "activations_gib": top["activations"] / GiB,
        "logits_gib": top["logits"] / GiB,
        "train_peak_gib": top["train_peak"] / GiB,
        "peak_stage": float(peak_stage),
        "learner_static_max_gib": static_max / GiB,
        "learner_rollout_gib": resident_max / GiB,
        "vllm_budget_gib": vllm_budget / GiB,
        "vllm_weights_gib": vllm_weights / GiB,
        "vllm_kv_tokens": kv_bytes / kv_per_token if vllm else 0.0,
        "rollout_peak_gib": (resident_max + vllm_budget) / GiB,
        "host_gib_per_node": host * per_node / GiB,
        "sync_gb_per_rank": sync["sync_bytes"] / 1e9,
        "sync_expert_gather_gb": sync["sync_expert_gather_bytes"] / 1e9,
        "sync_s": sync["sync_s"],
        "offload_s": 2 * max(s["offloaded"] for s in stages) / (PCIE_GBS * 1e9),
        "gpu_gib": gpu_gib,
    }


def rollout_peaks(cfg: RunConfig, gpu_gib: float = 80.0, layout: Layout | None = None) -> tuple[float, float]:
    """(without, with) parallel.offload_during_rollout: the rollout peak (GiB) of ``cfg`` otherwise
    unchanged."""
    from dataclasses import replace

    def peak(on: bool) -> float:
        run = replace(cfg, parallel=replace(cfg.parallel, offload_during_rollout=on))
        return estimate(run, gpu_gib, layout)["rollout_peak_gib"]

    return peak(False), peak(True)


def fits(cfg: RunConfig, est: dict[str, float], margin_gib: float = MARGIN_GIB) -> bool:
    """Both peaks within the GPU less ``margin_gib``, and (vLLM) KV cache for one full sequence."""
    room = est["gpu_gib"] - margin_gib
    kv_ok = cfg.rollout.engine != "vllm" or est["vllm_kv_tokens"] >= cfg.model.max_seq_len
    return est["train_peak_gib"] <= room and est["rollout_peak_gib"] <= room and kv_ok
