"""Device bytes of one rank at every phase of a step, in the order the colocated step runs.

``COLOCATED_ORDER`` is the order the colocated step runs (issue 41.2; verl's and slime's colocated
loop): the learner trains; with ``parallel.offload_during_rollout`` its optimizer state and grads
leave the device; the engine's weights wake; the sync streams from the learner's bf16 weights, one
gathered unit of at most ``parallel.sync_bucket_mib`` at a time (a layer's experts in pieces, not a
whole MoE layer), each engine rank receiving only its shard (vLLM: its TP slice; split or
colocated: docs/design.md 14.3); the learner's
weights leave; the KV cache wakes; the engine generates (moe_rl/pipeline/offload_timeline.py runs
this order). Without offload nothing of the learner leaves, so every phase after ``train`` holds
its whole state.

What a phase holds on the heaviest stage's rank (the learner's bytes from ``stage_memory``):

    train        weights, grads, optimizer (0 with CPU Adam), reference, stale sets, activations,
                 logits; vLLM asleep (level 1: its weights on the host; level 2: discarded)
    offload      the learner's static state while it moves out (nothing new allocated)
    engine_wake  what stays of the learner + the engine's weights (vLLM: total / vLLM TP in the
                 rollout dtype; the built-in engine: its own whole model)
    sync         engine_wake + two gathered units (the one the learner ranks send, the one this
                 rank receives before the engine loads it)
    generate     what stays of the learner (reference, stale sets; everything without offload) +
                 vLLM's whole budget (gpu_memory_utilization x GPU: weights, KV cache) or the
                 built-in engine's weights
    async        rollout ranks of ``rollout.mode`` one_step_off / async (``parallel.rollout_ranks``
                 > 0) hold the engine's budget and one staged copy of the next weights (its shard)

With rollout ranks the learner ranks hold no engine: their sync phase is the learner's state and
the two gathered units, their generate phase what offload leaves.
"""

from __future__ import annotations

from moe_rl.config import RunConfig
from moe_rl.config.schedule import Schedule
from moe_rl.memory.sizes import GiB, engine_fp8_bytes, param_counts

COLOCATED_ORDER = ("train", "offload", "engine_wake", "sync", "learner_out", "kv_wake", "generate")
# the phases whose device peak is checked (learner_out and kv_wake lie below sync and generate)
PEAK_PHASES = ("train", "sync", "generate", "async")


def engine_weight_bytes(cfg: RunConfig) -> float:
    """One engine rank's weights: vLLM's TP shard, or the built-in engine's whole model."""
    wb = 2 if cfg.rollout.dtype == "bf16" else 4
    if cfg.rollout.quantization == "fp8":  # e4m3 linear weights + their block scales
        total = float(engine_fp8_bytes(cfg.model, wb))
    else:
        total = param_counts(cfg.model)["total"] * wb
    return total / cfg.rollout.vllm.tensor_parallel if cfg.rollout.engine == "vllm" else total


def phase_bytes(cfg: RunConfig, st: dict, vllm_budget: float) -> dict[str, float]:
    """Device bytes of one rank of a stage (``st``: its ``stage_memory``) at each of
    ``COLOCATED_ORDER``'s phases, and ``async`` (0 without rollout ranks)."""
    colocated = cfg.parallel.rollout_ranks == 0  # else the engines live on the rollout ranks only
    engine = engine_weight_bytes(cfg) if colocated else 0.0
    bucket = cfg.parallel.sync_bucket_mib * 2**20
    kept = st["rollout_resident"]  # what offload leaves of the learner (everything without offload)
    learner_at_sync = st["static"] - (
        st["optimizer"] + st["grads"] if cfg.parallel.offload_during_rollout else 0
    )
    vllm = cfg.rollout.engine == "vllm"
    budget = (vllm_budget if vllm else engine) if colocated else 0.0
    out = {
        "train": st["train_peak"],
        "offload": st["static"],
        "engine_wake": learner_at_sync + engine,
        "sync": learner_at_sync + engine + 2 * bucket,
        "learner_out": kept + engine,
        "kv_wake": kept + budget,
        "generate": kept + budget,
    }
    own = engine_weight_bytes(cfg)  # a rollout rank's engine, and the staged next weights beside it
    # the next weights arrive while it generates (one_step_off, async): batches in flight
    overlaps = Schedule.from_config(cfg).keeps_in_flight
    out["async"] = (vllm_budget if vllm else own) + own if overlaps else 0.0
    return out


def first_unfit(peaks: dict[str, float], room_bytes: float) -> str | None:
    """The first of ``PEAK_PHASES`` above ``room_bytes``, or None."""
    return next((p for p in PEAK_PHASES if peaks[p] > room_bytes), None)


def describe_phases(peaks: dict[str, float]) -> str:
    return ", ".join(f"{p} {peaks[p] / GiB:.1f}" for p in PEAK_PHASES)
