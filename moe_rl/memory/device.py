"""Bytes on one GPU of a pipeline stage while the learner trains: weights, grads, optimizer
state, activations, logits, and what offload moves."""

from __future__ import annotations

import math

from moe_rl.config import ModelConfig, RunConfig
from moe_rl.memory.learner_layout import Layout, stage_params
from moe_rl.memory.sizes import param_counts

MARGIN_GIB = 4.0  # left free on every GPU: CUDA context, NCCL buffers, allocator fragmentation


def layer_activations(m: ModelConfig, lay: Layout, dense_layer: bool = False) -> float:
    """Elements one layer's forward saves per micro-batch token on one GPU (flash attention: no
    S^2 term). Per token: norms/residuals 4H (both norms' inputs and outputs), q/k/v (Q+2G)D,
    attention context QD; an MoE MLP: router logits 2E (fp32: 2 bf16 elements per expert) and per
    selected expert its input H, fc1 output 2F and activation F, and a shared expert's 3S; a dense
    MLP 3F. MLA instead of q/k/v: the q and kv latents (q_lora_rank, kv_lora_rank + rope dim),
    q and k of (nope + rope) per head, v and the context of v_head_dim per head.
    Under sequence parallelism (on whenever TP > 1) every term is divided by TP: norms, residuals
    and the router see S / TP positions, attention Q / TP heads, a dense MLP F / TP columns, and an
    expert-TP group all-gathers its routed tokens, so each ETP rank keeps ETP x the tokens' inputs
    and F / ETP of their fc1 columns: k (ETP H + 3F) / TP."""
    H, D, Q, G = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    if m.mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
        attn = 4 * H + latents + 2 * Q * qk + 2 * Q * m.v_head_dim
    else:
        attn = 4 * H + (Q + 2 * G) * D + Q * D
    mlp = (
        3 * m.ffn_hidden_size
        if dense_layer
        else 2 * m.num_experts
        + m.moe_router_topk * (lay.expert_tp * H + 3 * m.moe_ffn_hidden_size)
        + 3 * m.moe_shared_expert_ffn_hidden_size
    )
    return (attn + mlp) / lay.tp


def micro_batches(cfg: RunConfig, lay: Layout) -> int:
    """Micro-batches per optimizer step on one rank: a minibatch's sequences / micro_batch_size."""
    r, a = cfg.rollout, cfg.algo
    seqs = max(1, r.prompts_per_step // lay.dp) * r.samples_per_prompt // a.num_minibatches
    return max(1, math.ceil(seqs / a.micro_batch_size))


def stage_memory(cfg: RunConfig, lay: Layout, stage: int) -> dict[str, float]:
    """Bytes on one GPU of pipeline stage ``stage`` while it trains, and while the engine generates.

    State: bf16 (fp32) weights 2 (4) B per param, fp32 grads 4 B (grad_reduce_in_fp32, not
    sharded), Adam m, v (+ fp32 main params with bf16 weights) 12 (8) B, sharded by the
    distributed optimizer over DP (dense) and expert-DP (experts); a frozen reference copy of the
    weights when algo.kl_coef > 0; with rollout.staleness=k > 0, the k + 1 full canonical weight
    sets the rollout keeps on every rank (every expert, in the weights' dtype). With
    ``optim.cpu_adam`` the optimizer lives on the host for the whole run (its bytes per element of
    the shard ``host_optim_elems``: moe_rl/memory/host.py), none on the device. With
    ``parallel.offload_during_rollout`` the device optimizer bytes, the
    grads and the weights (either engine holds its own copy) leave the GPU while the engine
    generates (``offloaded``, moe_rl/learner/offload.py): ``rollout_resident`` is what the learner
    keeps then (the reference and the stale sets stay). Activations:
    micro_batch_size x max_seq_len tokens per micro-batch (``layer_activations``, bf16: 2 B, fp32:
    4 B); 1F1B keeps up to PP - stage micro-batches in flight (stage 0: PP). Full recomputation
    keeps only each in-flight
    micro-batch's layer inputs (H / TP per token and layer) plus one layer's full set.
    Logits (last stage): vocab-parallel [tokens, V / TP]: the output layer's (bf16) logits plus
    fp32 tensors the log-prob / entropy pass saves for its backward (log-softmax and softmax;
    with TP > 1 also exp(z - max)) and one fp32 gradient of the same shape."""
    m = cfg.model
    layers = lay.stage_layers(m.num_layers)
    dense, expert = stage_params(m, lay, stage, layers)
    w_bytes, opt_bytes, act_bytes = (2, 12, 2) if m.precision in ("bf16", "fp8") else (4, 8, 4)
    shard_d, shard_e = (lay.dp, lay.expert_dp) if cfg.parallel.distributed_optimizer else (1, 1)
    weights, grads = (dense + expert) * w_bytes, (dense + expert) * 4
    opt_elems = dense / shard_d + expert / shard_e  # the rank's optimizer shard
    optim = 0.0 if cfg.optim.cpu_adam else opt_bytes * opt_elems
    reference = weights if cfg.algo.kl_coef > 0 else 0.0
    k = cfg.rollout.staleness
    stale = (
        (k + 1) * param_counts(m)["total"] * w_bytes if k > 0 else 0.0
    )  # moe_rl/pipeline/simulated_staleness.py
    start, n = sum(layers[:stage]), layers[stage]
    n_dense = max(0, min(start + n, m.first_k_dense) - start)
    per_dense, per_moe = layer_activations(m, lay, True), layer_activations(m, lay, False)
    in_flight = min(lay.pp - stage, micro_batches(cfg, lay))
    if m.recompute:
        elems = in_flight * n * m.hidden_size / lay.tp + max(
            per_moe if n > n_dense else 0, per_dense if n_dense else 0
        )
    else:
        elems = in_flight * (n_dense * per_dense + (n - n_dense) * per_moe)
    tokens = cfg.algo.micro_batch_size * m.max_seq_len
    acts = act_bytes * elems * tokens
    saved = 3 if lay.tp > 1 else 2
    logits = tokens * m.vocab_size / lay.tp * (act_bytes + 4 * (saved + 1)) if stage == lay.pp - 1 else 0.0
    static = weights + grads + optim + reference + stale
    offloaded = 0.0
    if cfg.parallel.offload_during_rollout:
        offloaded = optim + grads + weights  # learner/offload.py moves these four kinds
    return {
        "layers": n,
        "in_flight": in_flight,
        "dense": dense,
        "expert": expert,
        "weights": weights,
        "grads": grads,
        "optimizer": optim,
        "host_optim_elems": opt_elems,
        "reference": reference,
        "stale": stale,
        "static": static,
        "activations": acts,
        "logits": logits,
        "train_peak": static + acts + logits,
        "offloaded": offloaded,
        "rollout_resident": static - offloaded,
    }
