"""Model sizes: parameter counts by kind, one attention block, the KV cache a token takes, FLOPs
per token and MFU."""

from __future__ import annotations

from moe_rl.config import ModelConfig

GiB = 2**30
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM dense bf16 peak (no sparsity)


def attention_params(m: ModelConfig) -> int:
    """Parameters of one attention block (moe_rl/weights/canonical.py's tensors): GQA q, k, v, o
    (+ q/k/v biases, + q/k norms) or MLA's q (low-rank or direct), kv_a, latent norms, kv_b, o."""
    H, N = m.hidden_size, m.num_attention_heads
    if m.mla:
        qk, C = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
        ql = m.q_lora_rank
        q = H * ql + ql + ql * N * qk if ql > 0 else H * N * qk
        return (
            q
            + H * (C + m.qk_rope_head_dim)
            + C
            + C * N * (m.qk_nope_head_dim + m.v_head_dim)
            + N * m.v_head_dim * H
        )
    D, G = m.head_dim, m.num_query_groups
    bias = (N + 2 * G) * D if m.attention_bias else 0
    return H * N * D * 2 + H * G * D * 2 + bias + (2 * D if m.qk_layernorm else 0)


def kv_cache_bytes_per_token(m: ModelConfig, tensor_parallel: int, bytes_per_value: int = 2) -> int:
    """KV-cache bytes one token takes on one engine GPU, all layers. GQA: K and V of the rank's
    kv heads (fewer heads than TP: replicated). MLA: the latent (kv_lora_rank) and the shared rope
    key (qk_rope_head_dim) once per layer, replicated on every TP rank (vLLM's MLA cache layout;
    DeepSeek-V3: 61 * 576 * 2 = 70 KiB a token)."""
    if m.mla:
        return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * bytes_per_value
    kv_heads = max(1, m.num_query_groups // tensor_parallel)
    return 2 * m.num_layers * kv_heads * m.head_dim * bytes_per_value


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters by kind: total, expert (routed experts), dense (everything else, shared experts
    and the expert bias included), active per token (dense + top-k experts), matmul_active (active
    minus the input embedding, which costs no FLOPs; tied, it is the output layer too)."""
    H, E = m.hidden_size, m.num_experts
    n_moe = len(m.moe_layers)
    expert = n_moe * E * 3 * H * m.moe_ffn_hidden_size
    S = m.moe_shared_expert_ffn_hidden_size
    per_moe_layer = E * H + (E if m.moe_router_expert_bias else 0)  # router, expert bias
    per_moe_layer += 3 * H * S + (H if m.moe_shared_expert_gate else 0)  # shared experts, their gate
    embeddings = (1 if m.tie_word_embeddings else 2) * m.vocab_size * H
    dense = (
        m.num_layers * (attention_params(m) + 2 * H)  # + the layer's 2 norms
        + m.first_k_dense * 3 * H * m.ffn_hidden_size
        + n_moe * per_moe_layer
        + embeddings
        + H
    )  # + routers, embedding / lm_head, final norm
    active = dense + n_moe * m.moe_router_topk * 3 * H * m.moe_ffn_hidden_size
    return {
        "total": dense + expert,
        "expert": expert,
        "dense": dense,
        "active": active,
        "matmul_active": active - (0 if m.tie_word_embeddings else m.vocab_size * H),
    }


def train_flops_per_token(m: ModelConfig) -> float:
    """Forward + backward: 6 x the active matmul parameters (attention score FLOPs not counted)."""
    return 6.0 * param_counts(m)["matmul_active"]


def forward_flops_per_token(m: ModelConfig) -> float:
    """One forward (rollout decode/prefill, or the log-prob passes): 2 x active matmul parameters."""
    return 2.0 * param_counts(m)["matmul_active"]


def mfu(
    m: ModelConfig,
    *,
    trained_tokens: float,
    forward_tokens: float,
    seconds: float,
    num_gpus: int,
    peak_tflops: float = H100_BF16_DENSE_TFLOPS,
) -> float:
    """Model FLOPs utilisation: achieved (6N per trained token + 2N per forward-only token) / peak."""
    flops = train_flops_per_token(m) * trained_tokens + forward_flops_per_token(m) * forward_tokens
    return flops / (seconds * num_gpus * peak_tflops * 1e12)


def _blocks(rows: int, cols: int, block: int = 128) -> int:
    return -(-rows // block) * -(-cols // block)


def fp8_linear_shapes(m: ModelConfig) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of the linear weights ``rollout.quantization=fp8`` holds in e4m3
    (moe_rl/rollout/fp8.py's rule: attention / MLA projections, dense, expert and shared-expert
    SwiGLU; never the router, expert bias, shared-expert gate, embeddings, LM head or norms)."""
    H, L, E = m.hidden_size, m.num_layers, m.num_experts
    n_moe = len(m.moe_layers)
    out: list[tuple[int, int, int]] = []
    if m.mla:
        N, qk = m.num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank > 0:
            out += [(L, m.q_lora_rank, H), (L, N * qk, m.q_lora_rank)]
        else:
            out += [(L, N * qk, H)]
        out += [(L, m.kv_lora_rank + m.qk_rope_head_dim, H)]
        out += [(L, N * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), (L, H, N * m.v_head_dim)]
    else:
        q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
        out += [(L, q, H), (2 * L, kv, H), (L, H, q)]
    if m.first_k_dense:
        out += [(2 * m.first_k_dense, m.ffn_hidden_size, H), (m.first_k_dense, H, m.ffn_hidden_size)]
    F, S = m.moe_ffn_hidden_size, m.moe_shared_expert_ffn_hidden_size
    out += [(2 * n_moe * E, F, H), (n_moe * E, H, F)]
    if S:
        out += [(2 * n_moe, S, H), (n_moe, H, S)]
    return out


def engine_fp8_bytes(m: ModelConfig, bytes_per_value: int = 2) -> int:
    """An FP8 engine's weights, whole model: 1 byte per quantized element plus one fp32 scale per
    128x128 block (a partial edge block counts as one), the other parameters at ``bytes_per_value``
    (rollout.dtype)."""
    shapes = fp8_linear_shapes(m)
    quantized = sum(n * r * c for n, r, c in shapes)
    scales = sum(n * _blocks(r, c) for n, r, c in shapes)
    return quantized + 4 * scales + (param_counts(m)["total"] - quantized) * bytes_per_value
