"""A run's measured summary from its metrics.jsonl: step time, tokens/s, MFU, routing agreement
(scripts/gpu_smoke_summary.py)."""

from __future__ import annotations

import numpy as np

from moe_rl.config import RunConfig
from moe_rl.memory.sizes import H100_BF16_DENSE_TFLOPS, mfu


def summarize_run(
    rows: list[dict],
    cfg: RunConfig,
    *,
    prompt_tokens: float,
    num_gpus: int = 1,
    peak_tflops: float = H100_BF16_DENSE_TFLOPS,
    skip: int = 1,
) -> dict[str, float]:
    """Step time, tokens/s, MFU and routing agreement from a run's metrics.jsonl rows.

    The first ``skip`` steps (compilation, allocator warm-up) are left out. Tokens per step: every
    sequence's prompt (``prompt_tokens``, mean per sequence: metrics.jsonl logs response lengths
    only) plus its response. Each token is trained once (6N) and goes through forward-only passes
    2N each: the rollout, the old-log-prob pass, and the reference pass when algo.kl_coef > 0.
    ``sync_s`` is the mean weight-sync seconds (``time/sync_s``). ``learner_mfu`` counts the learner's
    passes only (old log-probs, reference, update) over their
    own time (``time/old_logprob_s`` + ``time/reference_s`` + ``time/update_s``); ``peak_gib`` is the largest
    ``mem/peak_gib`` (CUDA runs) and ``reward_first``/``reward_last`` the mean reward of the first
    and last quarter of the steps (warm-up included)."""
    all_rows = rows
    rows = rows[skip:] if len(rows) > skip else rows
    if not rows:
        raise ValueError("no metrics rows to summarize")
    n = len(rows)
    step_s = sum(r["time/step_s"] for r in rows) / n
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    tokens = seqs * (prompt_tokens + sum(r["rollout/response_len_mean"] for r in rows) / n)
    forward_passes = 2 + (cfg.algo.kl_coef > 0)
    out = {
        "steps": float(n),
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "mfu": mfu(
            cfg.model,
            trained_tokens=tokens,
            forward_tokens=forward_passes * tokens,
            seconds=step_s,
            num_gpus=num_gpus,
            peak_tflops=peak_tflops,
        ),
    }
    for key in ("routing/flip_router_frac", "routing/flip_token_frac", "corr/k3_kl", "reward/mean"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key] = sum(vals) / len(vals)
    if "routing/flip_router_frac" in out:
        out["routing_agreement"] = 1.0 - out["routing/flip_router_frac"]
    if all("time/update_s" in r for r in rows):
        # time/reference_s: the reference pass, timed apart from the old one since the step package
        learner_s = (
            sum(r["time/old_logprob_s"] + r.get("time/reference_s", 0.0) + r["time/update_s"] for r in rows)
            / n
        )
        out["learner_s"] = learner_s
        out["learner_mfu"] = mfu(
            cfg.model,
            trained_tokens=tokens,
            forward_tokens=(forward_passes - 1) * tokens,
            seconds=learner_s,
            num_gpus=num_gpus,
            peak_tflops=peak_tflops,
        )
    syncs = [r["time/sync_s"] for r in rows if "time/sync_s" in r]
    if syncs:
        out["sync_s"] = sum(syncs) / len(syncs)
    peaks = [r["mem/peak_gib"] for r in all_rows if "mem/peak_gib" in r]
    if peaks:
        out["peak_gib"] = max(peaks)
    rewards = [r["reward/mean"] for r in all_rows if "reward/mean" in r]
    if rewards:
        q = max(1, len(rewards) // 4)
        out["reward_first"], out["reward_last"] = sum(rewards[:q]) / q, sum(rewards[-q:]) / q
    return out


# the trainer's memory-timeline spans (moe_rl/timing.py) behind each device phase of the estimate
# (moe_rl/memory/phases.py PEAK_PHASES; a colocated run has no async phase)
SPANS_OF_PHASE = {
    "train": ("old_logprob", "mismatch_split", "prepare", "reference", "update"),
    "sync": ("first sync", "sync"),
    "generate": ("rollout",),
}


def phase_device_peaks(timeline: list[dict], samples: list[tuple[float, float]]) -> dict[str, float]:
    """The device's highest sampled use (GiB) inside each phase's spans, over every step and rank.

    ``timeline``: a run's memory_timeline.jsonl records (``t0``, ``t1``: a span's wall-clock
    bounds); ``samples``: (unix time, used MiB) pairs, nvidia-smi's every 200 ms in
    scripts/gpu_smoke.sh (every pool on the device: vLLM's too). A phase without a sample inside
    any of its spans is left out (a span shorter than the sampling period can fall between two)."""
    if not samples:
        return {}
    t, used = (np.asarray(x, dtype=np.float64) for x in zip(*sorted(samples)))
    out = {}
    for phase, names in SPANS_OF_PHASE.items():
        spans = [(r["t0"], r["t1"]) for r in timeline if r["phase"] in names and "t0" in r]
        if not spans:
            continue
        t0, t1 = np.asarray(spans, dtype=np.float64).T
        lo, hi = np.searchsorted(t, t0, "left"), np.searchsorted(t, t1, "right")
        inside = [used[a:b].max() for a, b in zip(lo, hi) if b > a]
        if inside:
            out[phase] = max(inside) / 1024
    return out
