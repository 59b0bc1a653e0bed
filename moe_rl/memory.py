"""Back-of-envelope arithmetic for sizing runs: parameter counts, per-GPU memory, FLOPs and MFU.

Used by the recipes' memory comments (tests/test_configs.py recomputes them), by
``scripts/gpu_smoke_summary.py`` (MFU) and by ``moe-rl``-style inspection. Estimates, not
measurements: every assumption is written next to the number it produces.
"""

from __future__ import annotations

from moe_rl.config import ModelConfig, RunConfig

GiB = 2**30
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM dense bf16 peak (no sparsity)


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters by kind: total, expert (routed experts), dense (everything else), active per token
    (dense + top-k experts), matmul_active (active minus the input embedding, which costs no FLOPs)."""
    H, D, Q, G = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    attn = H * Q * D * 2 + H * G * D * 2 + 2 * H + (2 * D if m.qk_layernorm else 0)  # q, o, k, v, 2 norms
    n_moe = len(m.moe_layers)
    expert = n_moe * m.num_experts * 3 * H * m.moe_ffn_hidden_size
    dense = (m.num_layers * attn + m.first_k_dense * 3 * H * m.ffn_hidden_size + n_moe * m.num_experts * H
             + 2 * m.vocab_size * H + H)  # + routers, untied embedding / lm_head, final norm
    active = dense + n_moe * m.moe_router_topk * 3 * H * m.moe_ffn_hidden_size
    return {"total": dense + expert, "expert": expert, "dense": dense, "active": active,
            "matmul_active": active - m.vocab_size * H}


def train_flops_per_token(m: ModelConfig) -> float:
    """Forward + backward: 6 x the active matmul parameters (attention score FLOPs not counted)."""
    return 6.0 * param_counts(m)["matmul_active"]


def forward_flops_per_token(m: ModelConfig) -> float:
    """One forward (rollout decode/prefill, or the log-prob passes): 2 x active matmul parameters."""
    return 2.0 * param_counts(m)["matmul_active"]


def mfu(m: ModelConfig, *, trained_tokens: float, forward_tokens: float, seconds: float, num_gpus: int,
        peak_tflops: float = H100_BF16_DENSE_TFLOPS) -> float:
    """Model FLOPs utilisation: achieved (6N per trained token + 2N per forward-only token) / peak."""
    flops = train_flops_per_token(m) * trained_tokens + forward_flops_per_token(m) * forward_tokens
    return flops / (seconds * num_gpus * peak_tflops * 1e12)


def _activations(cfg: RunConfig, tokens: int) -> float:
    """Bytes of saved activations of one micro-batch on one GPU (bf16; flash attention, so no
    S^2 term). Per token and layer: norms/residual 4H, qkv (Q+2G)D, context QD, router logits (fp32)
    2E, and per selected expert its input H, fc1 output 2F and activation F. Full recomputation
    keeps only each layer's input (H) plus one layer's full set."""
    m, p = cfg.model, cfg.parallel
    H, D = m.hidden_size, m.head_dim
    per_layer = 4 * H + (m.num_attention_heads + 2 * m.num_query_groups) * D + m.num_attention_heads * D \
        + 2 * m.num_experts + m.moe_router_topk * (H + 3 * m.moe_ffn_hidden_size)
    layers = m.num_layers // p.pipeline_parallel
    elems = (H * layers + per_layer) if m.recompute else per_layer * layers
    return 2.0 * elems * tokens


def estimate(cfg: RunConfig, gpu_gib: float = 80.0) -> dict[str, float]:
    """Per-GPU memory (GiB) of a run: learner state, training peak, rollout peak, vLLM KV tokens.

    Learner: dense (non-expert) params split over TP*PP, experts over EP*TP*PP (expert TP = TP);
    bf16 (or fp32) params, fp32 grads (grad_reduce_in_fp32), Adam m, v (+ fp32 main params when
    bf16), sharded over the dense / expert data-parallel size by the distributed optimizer.
    Training adds one micro-batch's activations (micro_batch_size x max_seq_len tokens) and its
    fp32 logits three times over (logits, log-softmax, gradient). Rollout adds vLLM's whole budget
    (gpu_memory_utilization x GPU: bf16 weights over the vLLM TP group, the rest KV cache) while
    the learner's state stays resident; vLLM sleeps during training."""
    m, p, v = cfg.model, cfg.parallel, cfg.rollout.vllm
    c = param_counts(m)
    tp, pp, ep, world = p.tensor_parallel, p.pipeline_parallel, p.expert_parallel, p.nproc
    dense_pg, expert_pg = c["dense"] / (tp * pp), c["expert"] / (ep * tp * pp)
    dense_dp, expert_dp = world // (tp * pp), world // (ep * tp * pp)
    low = m.precision in ("bf16", "fp8")
    w_bytes, opt_bytes = (2, 12) if low else (4, 8)
    shard_d, shard_e = (dense_dp, expert_dp) if p.distributed_optimizer else (1, 1)
    weights = (dense_pg + expert_pg) * w_bytes
    grads = (dense_pg + expert_pg) * 4
    optim = dense_pg * opt_bytes / shard_d + expert_pg * opt_bytes / shard_e
    tokens = cfg.algo.micro_batch_size * m.max_seq_len
    acts = _activations(cfg, tokens)
    logits = 3 * 4.0 * tokens * m.vocab_size / tp
    static = weights + grads + optim
    vllm_budget = v.gpu_memory_utilization * gpu_gib * GiB if cfg.rollout.engine == "vllm" else 0.0
    vllm_weights = c["total"] * (2 if cfg.rollout.dtype == "bf16" else 4) / v.tensor_parallel
    kv_heads = max(1, m.num_query_groups // v.tensor_parallel)  # fewer KV heads than TP: replicated
    kv_per_token = 2 * m.num_layers * kv_heads * m.head_dim * 2  # K and V, bf16
    kv_bytes = max(0.0, vllm_budget - vllm_weights - 2 * GiB)  # ~2 GiB vLLM activations / graphs
    return {
        "params_total_b": c["total"] / 1e9, "params_active_b": c["active"] / 1e9,
        "learner_params_per_gpu_b": (dense_pg + expert_pg) / 1e9,
        "weights_gib": weights / GiB, "grads_gib": grads / GiB, "optimizer_gib": optim / GiB,
        "learner_static_gib": static / GiB, "activations_gib": acts / GiB, "logits_gib": logits / GiB,
        "train_peak_gib": (static + acts + logits) / GiB,
        "vllm_budget_gib": vllm_budget / GiB, "vllm_weights_gib": vllm_weights / GiB,
        "vllm_kv_tokens": kv_bytes / kv_per_token if cfg.rollout.engine == "vllm" else 0.0,
        "rollout_peak_gib": (static + vllm_budget) / GiB, "gpu_gib": gpu_gib,
    }


def format_estimate(est: dict[str, float]) -> str:
    return "\n".join(f"{k:<26} {v:,.1f}" for k, v in est.items())


def summarize_run(rows: list[dict], cfg: RunConfig, *, prompt_tokens: float, num_gpus: int = 1,
                  peak_tflops: float = H100_BF16_DENSE_TFLOPS, skip: int = 1) -> dict[str, float]:
    """Step time, tokens/s, MFU and routing agreement from a run's metrics.jsonl rows.

    The first ``skip`` steps (compilation, allocator warm-up) are left out. Tokens per step: every
    sequence's prompt (``prompt_tokens``, mean per sequence: metrics.jsonl logs response lengths
    only) plus its response. Each token is trained once (6N) and goes through forward-only passes
    2N each: the rollout, the old-log-prob pass, and the reference pass when algo.kl_coef > 0.
    ``learner_mfu`` counts the learner's passes only (old log-probs, reference, update) over their
    own time (``time/old_logprob_s`` + ``time/update_s``); ``peak_gib`` is the largest
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
    out = {"steps": float(n), "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
           "mfu": mfu(cfg.model, trained_tokens=tokens, forward_tokens=forward_passes * tokens, seconds=step_s,
                      num_gpus=num_gpus, peak_tflops=peak_tflops)}
    for key in ("routing/flip_router_frac", "routing/flip_token_frac", "corr/k3_kl", "reward/mean"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key] = sum(vals) / len(vals)
    if "routing/flip_router_frac" in out:
        out["routing_agreement"] = 1.0 - out["routing/flip_router_frac"]
    if all("time/update_s" in r for r in rows):
        learner_s = sum(r["time/old_logprob_s"] + r["time/update_s"] for r in rows) / n
        out["learner_s"] = learner_s
        out["learner_mfu"] = mfu(cfg.model, trained_tokens=tokens, forward_tokens=(forward_passes - 1) * tokens,
                                 seconds=learner_s, num_gpus=num_gpus, peak_tflops=peak_tflops)
    peaks = [r["mem/peak_gib"] for r in all_rows if "mem/peak_gib" in r]
    if peaks:
        out["peak_gib"] = max(peaks)
    rewards = [r["reward/mean"] for r in all_rows if "reward/mean" in r]
    if rewards:
        q = max(1, len(rewards) // 4)
        out["reward_first"], out["reward_last"] = sum(rewards[:q]) / q, sum(rewards[-q:]) / q
    return out
