"""Back-of-envelope arithmetic for sizing runs: parameter counts, per-GPU memory, FLOPs and MFU.

Used by the recipes' memory comments (tests/test_configs.py recomputes them), by ``moe-rl
estimate`` (a config's numbers, per pipeline stage, and the ranked layouts of ``choose_layout``),
and by ``scripts/gpu_smoke_summary.py`` (MFU). Estimates, not measurements: every assumption is
written next to the number it produces.

The learner layout (``Layout``) follows megatron-core: world = TP x PP x DP for the dense
parameters; within each pipeline stage the experts are split over EP x ETP ranks (expert tensor
parallelism splits each expert's matrices, megatron's ``expert_tensor_parallel_size``) and
replicated over expert-DP = world / (EP x ETP x PP). Uneven pipeline stages follow megatron's
``num_layers_in_first/last_pipeline_stage``: the middle stages split the remaining layers evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_rl.config import ModelConfig, ParallelConfig, RunConfig
from moe_rl.config.layout import pipeline_stage_layers

GiB = 2**30
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM dense bf16 peak (no sparsity)
MARGIN_GIB = 4.0  # left free on every GPU: CUDA context, NCCL buffers, allocator fragmentation


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


@dataclass(frozen=True)
class Layout:
    """A learner layout over ``world`` GPUs. ``etp`` 0 becomes TP (megatron's default);
    ``first`` / ``last`` 0 mean an even split (megatron's num_layers_in_first/last_pipeline_stage
    unset). With both set the PP - 2 middle stages split the remaining layers evenly."""

    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 0
    first: int = 0
    last: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "etp", self.etp or self.tp)

    @classmethod
    def of(cls, p: ParallelConfig) -> Layout:
        return cls(
            p.nproc,
            p.tensor_parallel,
            p.pipeline_parallel,
            p.expert_parallel,
            p.expert_tensor_parallel,
            p.layers_in_first_stage,
            p.layers_in_last_stage,
        )

    @property
    def expert_tp(self) -> int:
        return self.etp

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense parameters: world / (TP x PP)."""
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard: world / (EP x ETP x PP)."""
        return self.world // (self.ep * self.expert_tp * self.pp)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage (megatron's rule); ValueError when they do not split."""
        if self.pp == 1 and (self.first or self.last):
            raise ValueError("layers in the first/last stage need pipeline_parallel > 1")
        par = ParallelConfig(
            nproc=self.world,
            pipeline_parallel=self.pp,
            expert_parallel=1,
            layers_in_first_stage=self.first if self.pp > 1 else 0,
            layers_in_last_stage=self.last if self.pp > 1 else 0,
        )
        return list(pipeline_stage_layers(num_layers, par))

    def problems(self, m: ModelConfig) -> list[str]:
        """What megatron would refuse, one line each; empty when the layout is valid for ``m``."""
        tp, etp, out = self.tp, self.expert_tp, []
        if self.world % (tp * self.pp):
            return [f"TP*PP = {tp * self.pp} does not divide {self.world} GPUs"]
        if m.mla and m.transformer_impl == "te" and tp > 1:  # learner/build.py refuses it at build
            out.append(f"TP {tp}: MLA with model.transformer_impl=te is built with TP 1 only")
        for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
            if getattr(m, key) % tp:
                out.append(f"TP {tp} does not divide model.{key} {getattr(m, key)}")
        if m.moe_ffn_hidden_size % etp:
            out.append(f"ETP {etp} does not divide model.moe_ffn_hidden_size {m.moe_ffn_hidden_size}")
        if m.num_experts % self.ep:
            out.append(f"EP {self.ep} does not divide model.num_experts {m.num_experts}")
        if (self.world // self.pp) % (self.ep * etp):
            out.append(f"EP*ETP = {self.ep * etp} does not divide DP*TP = {self.world // self.pp}")
        try:
            stages = self.stage_layers(m.num_layers)
        except ValueError as e:
            out.append(str(e))
        else:  # routing replay and the router monitor run per stage (moe_rl/config/layout.py)
            if m.first_k_dense >= stages[0]:
                out.append(f"{m.first_k_dense} dense layers leave pipeline stage 0 without a MoE layer")
        return out

    def describe(self, num_layers: int) -> str:
        text = f"TP {self.tp} x EP {self.ep} x ETP {self.expert_tp} x PP {self.pp}"
        return text + (
            f" ({'/'.join(map(str, self.stage_layers(num_layers)))} layers)" if self.pp > 1 else ""
        )


def _stage_params(m: ModelConfig, lay: Layout, stage: int, layers: list[int]) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU of pipeline stage ``stage``.

    Dense: attention (GQA q/k/v/o and their biases; MLA's projections, which TP > 1 only builds
    with the local spec, which splits them all) and dense-MLP and shared-expert matrices split over
    TP (column / row parallel), the input embedding (first stage) and the output layer (last
    stage, with the final norm) split over TP by vocabulary rows; norms, routers, the expert bias
    and Qwen2-MoE's shared-expert gate replicated on every TP rank (megatron's TopKRouter weight
    is not split). Experts: the stage's MoE layers, whole experts over EP, each expert's matrices
    over ETP."""
    H, D, V, E = m.hidden_size, m.head_dim, m.vocab_size, m.num_experts
    start, n = sum(layers[:stage]), layers[stage]
    n_dense = max(0, min(start + n, m.first_k_dense) - start)
    n_moe = n - n_dense
    norms = (m.q_lora_rank + m.kv_lora_rank) if m.mla else (2 * D if m.qk_layernorm else 0)  # q/k or latent
    split = attention_params(m) - norms
    replicated = 2 * H + norms  # input + pre-MLP norms, q/k (MLA: latent) norms
    S = m.moe_shared_expert_ffn_hidden_size
    per_moe = E * H + (E if m.moe_router_expert_bias else 0) + 3 * H * S / lay.tp
    per_moe += H if m.moe_shared_expert_gate else 0
    dense = n * (split / lay.tp + replicated) + n_moe * per_moe + n_dense * 3 * H * m.ffn_hidden_size / lay.tp
    if stage == 0:
        dense += V * H / lay.tp
    if stage == lay.pp - 1:
        dense += V * H / lay.tp + H
    return dense, n_moe * E * 3 * H * m.moe_ffn_hidden_size / (lay.ep * lay.expert_tp)


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
    ``optim.cpu_adam`` the optimizer's bytes live on the host for the whole run (``host_optim``),
    none on the device. With ``parallel.offload_during_rollout`` the device optimizer bytes, the
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
    dense, expert = _stage_params(m, lay, stage, layers)
    w_bytes, opt_bytes, act_bytes = (2, 12, 2) if m.precision in ("bf16", "fp8") else (4, 8, 4)
    shard_d, shard_e = (lay.dp, lay.expert_dp) if cfg.parallel.distributed_optimizer else (1, 1)
    weights, grads = (dense + expert) * w_bytes, (dense + expert) * 4
    host_optim = opt_bytes * (dense / shard_d + expert / shard_e)
    optim = 0.0 if cfg.optim.cpu_adam else host_optim
    host_optim = host_optim if cfg.optim.cpu_adam else 0.0
    reference = weights if cfg.algo.kl_coef > 0 else 0.0
    k = cfg.rollout.staleness
    stale = (k + 1) * param_counts(m)["total"] * w_bytes if k > 0 else 0.0  # pipeline/simulated_staleness.py
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
        "host_optim": host_optim,
        "reference": reference,
        "stale": stale,
        "static": static,
        "activations": acts,
        "logits": logits,
        "train_peak": static + acts + logits,
        "offloaded": offloaded,
        "rollout_resident": static - offloaded,
    }


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
    stage_full = [sum(_stage_params(m, whole, s, layers)) for s in range(lay.pp)]
    total = param_counts(m)["total"]
    worst: dict[str, float] = {}
    for s in range(lay.pp):
        dense, expert = _stage_params(m, lay, s, layers)
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


def _splits(num_layers: int, pp: int):
    """(first, last) stage sizes to try: the even split (0, 0) when PP divides the layers, and
    every uneven one whose first and last stages are no larger than a middle stage (they also
    carry the embedding / the output layer and the logits)."""
    if pp == 1 or num_layers % pp == 0:
        yield 0, 0
    if pp == 1:
        return
    if pp == 2:
        yield from ((f, num_layers - f) for f in range(1, num_layers) if 2 * f != num_layers)
        return
    for mid in range(math.ceil(num_layers / pp), (num_layers - 2) // (pp - 2) + 1):
        rest = num_layers - mid * (pp - 2)
        yield from (
            (f, rest - f)
            for f in range(max(1, rest - mid), min(mid, rest - 1) + 1)
            if not f == rest - f == mid
        )


def candidate_layouts(m: ModelConfig, nodes: int, gpus_per_node: int) -> list[Layout]:
    """Every layout ``problems`` accepts on nodes x gpus_per_node GPUs: TP in {1, 2, 4, 8} within
    a node, PP any divisor of world / TP up to the layers (with every ``_splits`` split), EP any
    divisor of the experts, ETP 1 or TP."""
    world, out = nodes * gpus_per_node, []
    for tp in (t for t in (1, 2, 4, 8) if t <= gpus_per_node and world % t == 0):
        for pp in (p for p in range(1, min(world // tp, m.num_layers) + 1) if (world // tp) % p == 0):
            for ep in (e for e in range(1, m.num_experts + 1) if m.num_experts % e == 0):
                for etp in sorted({1, tp}):
                    for first, last in _splits(m.num_layers, pp):
                        lay = Layout(world, tp, pp, ep, etp, first, last)
                        if not lay.problems(m):
                            out.append(lay)
    return out


@dataclass(frozen=True)
class Ranked:
    layout: Layout
    est: dict[str, float]
    fits: bool


def rank_layouts(
    cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_gib: float = 80.0, margin_gib: float = MARGIN_GIB
) -> list[Ranked]:
    """``candidate_layouts`` estimated, one per (TP, EP, ETP, PP): the first/last split whose
    larger peak (training or rollout, the heaviest stage decides) is smallest. Ordered: the ones
    that fit (``fits``) first, by the rule: fewest pipeline stages (less bubble, fewer in-flight
    micro-batches), then smallest TP (its all-gathers / reduce-scatters run on every layer), ETP 1
    before ETP = TP (expert TP all-gathers the routed tokens), smallest EP (fewest ranks in each
    all-to-all), then the most headroom; the rest after them, smallest peak first."""
    best: dict[tuple[int, int, int, int], Ranked] = {}
    for lay in candidate_layouts(cfg.model, nodes, gpus_per_node):
        est = estimate(cfg, gpu_gib, lay)
        key = (lay.tp, lay.ep, lay.expert_tp, lay.pp)
        if key not in best or _peak(est) < _peak(best[key].est):
            best[key] = Ranked(lay, est, fits(cfg, est, margin_gib))

    def order(r: Ranked):
        rule = (r.layout.pp, r.layout.tp, r.layout.expert_tp, r.layout.ep) if r.fits else ()
        return (not r.fits, *rule, _peak(r.est))

    return sorted(best.values(), key=order)


def choose_layout(
    cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_gib: float = 80.0, margin_gib: float = MARGIN_GIB
) -> list[Ranked]:
    """The layouts that fit, best first (``rank_layouts``' rule); empty when none does."""
    return [r for r in rank_layouts(cfg, nodes, gpus_per_node, gpu_gib, margin_gib) if r.fits]


def _peak(est: dict[str, float]) -> float:
    return max(est["train_peak_gib"], est["rollout_peak_gib"])


def format_estimate(est: dict[str, float]) -> str:
    return "\n".join(f"{k:<26} {v:,.1f}" for k, v in est.items())


def layout_table(cfg: RunConfig, ranked: list[Ranked]) -> str:
    """A markdown table of ranked layouts (as in docs/gpu.md 7)."""
    rows = [
        "| layout (TP x EP x ETP x PP) | learner static | train peak | rollout peak | "
        "vLLM KV tokens | fits? |",
        "|---|---|---|---|---|---|",
    ]
    for r in ranked:
        e = r.est
        rows.append(
            f"| {r.layout.describe(cfg.model.num_layers)} | {e['learner_static_max_gib']:.1f} | "
            f"{e['train_peak_gib']:.1f} | {e['rollout_peak_gib']:.1f} | {e['vllm_kv_tokens']:,.0f} | "
            f"{'yes' if r.fits else 'no'} |"
        )
    return "\n".join(rows)


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
