"""The model and its parallel layout: ``ModelConfig``, ``ParallelConfig`` and ``ARCH_FIELDS``, the
fields that init weights, HF checkpoints and route records must match."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.checks import check, check_finite, one_of
from moe_rl.names import HF_FAMILY_NAMES


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE-style decoder: RMSNorm, RoPE, GQA, SwiGLU experts, softmax Top-K router."""

    vocab_size: int = 0  # 0: taken from the task tokenizer
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 2  # key/value heads (GQA)
    head_dim: int = 32
    ffn_hidden_size: int = 256  # dense (non-MoE) layers
    moe_ffn_hidden_size: int = 128  # each expert
    num_experts: int = 8
    moe_router_topk: int = 2
    first_k_dense: int = 0  # the first N layers are dense MLPs (DeepSeek-style)
    # --- Attention variants (HF config.json names in the comments) ---
    attention_bias: bool = False  # attention_bias (GLM-4.5) / always on for qwen2_moe: q,k,v biases
    partial_rotary_factor: float = 1.0  # partial_rotary_factor (GLM-4.5: 0.5): RoPE on that share of head_dim
    # Multi-latent attention (DeepSeek-V3, Kimi-K2) when kv_lora_rank > 0; head_dim is then unused
    kv_lora_rank: int = 0  # kv_lora_rank: 0 = not MLA
    q_lora_rank: int = 0  # q_lora_rank: 0 (HF null) = q projected directly, no low-rank q
    qk_nope_head_dim: int = 0  # qk_nope_head_dim
    qk_rope_head_dim: int = 0  # qk_rope_head_dim
    v_head_dim: int = 0  # v_head_dim
    # rope_scaling {type: yarn, factor, original_max_position_embeddings, beta_fast, beta_slow,
    # mscale, mscale_all_dim} (DeepSeek-V3's YaRN); "none" = plain RoPE
    rope_scaling_type: str = "none"  # none | yarn
    rope_scaling_factor: float = 1.0  # rope_scaling.factor
    rope_original_max_position: int = 0  # rope_scaling.original_max_position_embeddings
    rope_beta_fast: float = 32.0  # rope_scaling.beta_fast
    rope_beta_slow: float = 1.0  # rope_scaling.beta_slow
    rope_mscale: float = 1.0  # rope_scaling.mscale
    rope_mscale_all_dim: float = 0.0  # rope_scaling.mscale_all_dim
    # --- Router and experts variants ---
    # scoring_func: softmax (Qwen, Mixtral) | sigmoid (DeepSeek-V3, GLM-4.5)
    moe_router_score_function: str = "softmax"
    norm_topk_prob: bool = True  # norm_topk_prob: the K gate weights renormalised to 1 (qwen2_moe: false)
    # e_score_correction_bias (topk_method noaux_tc): added to the scores to select, never to weight
    moe_router_expert_bias: bool = False
    # how the expert bias moves during RL: frozen (bit-identical, slime / Megatron-Bridge's choice for
    # GLM and Kimi) | native (megatron's aux-loss-free update from the routes the learner used)
    expert_bias_update: str = "frozen"
    moe_router_num_groups: int = 0  # n_group: 0 = no group-limited top-k
    moe_router_group_topk: int = 0  # topk_group: groups a token may pick experts from
    moe_router_scaling_factor: float = 1.0  # routed_scaling_factor: multiplies the K gate weights
    # shared experts: n_shared_experts * moe_intermediate_size (DeepSeek, GLM) or
    # shared_expert_intermediate_size (qwen2_moe); 0 = none
    moe_shared_expert_ffn_hidden_size: int = 0
    moe_shared_expert_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate(x)) scales the shared expert
    tie_word_embeddings: bool = False  # tie_word_embeddings: lm_head is the embedding matrix
    qk_layernorm: bool = True  # Qwen3 normalises q and k per head
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 64
    router_aux_loss_coeff: float = 0.0  # switch load-balancing loss; 0 = off
    recompute: bool = False  # full activation recomputation in the learner (routes are replayed again)
    # HF model family of import/export (moe_rl/config/hf_model.py FAMILIES): qwen3_moe | mixtral |
    # deepseek_v3 (also Kimi-K2) | glm4_moe | qwen2_moe; derived from config.json with init_weights=hf:DIR
    hf_family: str = "qwen3_moe"
    # Learner kernels and precision (moe_rl/learner/te_spec.py). te and fp8 need CUDA and Transformer
    # Engine; that is checked when a run starts (preflight.check_launch), so GPU recipes still load anywhere.
    transformer_impl: str = "local"  # local: megatron's own modules (CPU) | te: Transformer Engine spec
    precision: str = "fp32"  # fp32 | bf16 | fp8 (TE linears in FP8, bf16 params, fp32 main params)
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise (megatron-core Fp8Recipe names)
    fp8_format: str = "hybrid"  # hybrid: e4m3 forward, e5m2 gradients | e4m3 everywhere

    def __post_init__(self) -> None:
        check_finite(self, "model")
        for name in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
            "moe_ffn_hidden_size",
            "num_experts",
            "moe_router_topk",
            "max_seq_len",
        ):
            check(getattr(self, name) > 0, f"model.{name}", "must be > 0")
        check(self.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = from the tokenizer)")
        check(
            self.moe_router_topk <= self.num_experts,
            "model.moe_router_topk",
            f"top-k {self.moe_router_topk} > model.num_experts {self.num_experts}",
        )
        check(
            self.num_attention_heads % self.num_query_groups == 0,
            "model.num_query_groups",
            f"{self.num_query_groups} does not divide model.num_attention_heads {self.num_attention_heads}",
        )
        check(
            0 <= self.first_k_dense < self.num_layers,
            "model.first_k_dense",
            f"must be in [0, model.num_layers={self.num_layers}) so at least one layer is MoE",
        )
        check(self.router_aux_loss_coeff >= 0, "model.router_aux_loss_coeff", "must be >= 0")
        one_of(self.transformer_impl, "model.transformer_impl", ("local", "te"))
        one_of(self.precision, "model.precision", ("fp32", "bf16", "fp8"))
        # mxfp8 / nvfp4 are Blackwell-only (docs/gpu_stack.md 3); custom needs a quantizer factory
        one_of(self.fp8_recipe, "model.fp8_recipe", ("delayed", "tensorwise", "blockwise"))
        one_of(self.fp8_format, "model.fp8_format", ("hybrid", "e4m3"))
        one_of(self.hf_family, "model.hf_family", HF_FAMILY_NAMES)
        self._check_variants()
        check(
            self.precision != "fp8" or self.transformer_impl == "te",
            "model.precision",
            "fp8 GEMMs come from Transformer Engine: set model.transformer_impl=te",
        )

    def _check_variants(self) -> None:
        """Attention / router variant fields (DeepSeek-V3, GLM-4.5, Qwen2-MoE) are consistent."""
        check(0 < self.partial_rotary_factor <= 1, "model.partial_rotary_factor", "must be in (0, 1]")
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check(getattr(self, name) >= 0, f"model.{name}", "must be >= 0")
        if self.mla:
            for name in ("qk_rope_head_dim", "v_head_dim"):
                check(
                    getattr(self, name) > 0, f"model.{name}", "must be > 0 with MLA (model.kv_lora_rank > 0)"
                )
        one_of(self.rope_scaling_type, "model.rope_scaling_type", ("none", "yarn"))
        check(self.rope_scaling_factor >= 1, "model.rope_scaling_factor", "must be >= 1")
        self._check_attention_variants()
        one_of(self.moe_router_score_function, "model.moe_router_score_function", ("softmax", "sigmoid"))
        one_of(self.expert_bias_update, "model.expert_bias_update", ("frozen", "native"))
        check(self.moe_router_num_groups >= 0, "model.moe_router_num_groups", "must be >= 0")
        if self.moe_router_num_groups > 1:
            G = self.moe_router_num_groups
            check(
                self.num_experts % G == 0,
                "model.moe_router_num_groups",
                f"{G} does not divide model.num_experts {self.num_experts}",
            )
            check(
                0 < self.moe_router_group_topk <= G,
                "model.moe_router_group_topk",
                f"must be in [1, model.moe_router_num_groups={G}]",
            )
            check(
                self.moe_router_topk <= self.moe_router_group_topk * (self.num_experts // G),
                "model.moe_router_topk",
                f"{self.moe_router_topk} > experts in {self.moe_router_group_topk} groups "
                f"of {self.num_experts // G}",
            )
        check(self.moe_router_scaling_factor > 0, "model.moe_router_scaling_factor", "must be > 0")
        check(
            self.moe_shared_expert_ffn_hidden_size >= 0,
            "model.moe_shared_expert_ffn_hidden_size",
            "must be >= 0",
        )
        check(
            not self.moe_shared_expert_gate or self.moe_shared_expert_ffn_hidden_size > 0,
            "model.moe_shared_expert_gate",
            "needs shared experts (model.moe_shared_expert_ffn_hidden_size > 0)",
        )
        self._check_router_buildable()

    def _check_router_buildable(self) -> None:
        """Router combinations megatron-core 0.16.1 (the learner) cannot build the HF way are refused
        (moe_rl/routing/gating.py is the semantics both the learner and the built-in engine run)."""
        sigmoid = self.moe_router_score_function == "sigmoid"
        check(
            not sigmoid or self.norm_topk_prob or self.moe_router_topk == 1,
            "model.norm_topk_prob",
            "false is built with softmax scores only: megatron-core 0.16.1 renormalises sigmoid gates",
        )
        check(
            not self.moe_router_expert_bias or sigmoid,
            "model.moe_router_expert_bias",
            "needs model.moe_router_score_function=sigmoid (megatron-core 0.16.1 biases sigmoid scores only)",
        )
        check(
            self.expert_bias_update == "frozen" or self.moe_router_expert_bias,
            "model.expert_bias_update",
            "native updates the expert bias: needs model.moe_router_expert_bias=true",
        )
        if self.moe_router_num_groups > 1:
            check(
                sigmoid,
                "model.moe_router_num_groups",
                "group-limited top-k is built with sigmoid scores only (DeepSeek-V3, GLM-4.5)",
            )
            per_group = self.moe_router_topk // self.moe_router_group_topk
            check(
                per_group == 2,
                "model.moe_router_group_topk",
                "megatron-core 0.16.1 scores a group by its best model.moe_router_topk // "
                f"model.moe_router_group_topk experts (here {per_group}), HF DeepSeek-V3 / GLM-4.5 by its "
                "best 2: needs that quotient to be 2",
            )

    def _check_attention_variants(self) -> None:
        """Combinations the learner (megatron-core 0.16.1) and the built-in engine compute alike."""
        rot = self.qk_rope_head_dim if self.mla else int(self.head_dim * self.partial_rotary_factor)
        check(
            rot > 0 and rot % 2 == 0,
            "model.qk_rope_head_dim" if self.mla else "model.partial_rotary_factor",
            f"RoPE rotates {rot} dims per head: must be even and > 0",
        )
        if self.mla:
            check(self.qk_nope_head_dim > 0, "model.qk_nope_head_dim", "must be > 0 with MLA")
            # DeepSeek-V3's attention_bias puts biases on q_a/kv_a/o_proj: not built
            check(not self.attention_bias, "model.attention_bias", "q/k/v biases are for GQA, not with MLA")
            check(self.partial_rotary_factor == 1, "model.partial_rotary_factor", "must be 1 with MLA")
            # transformers' q_a/kv_a_layernorm use eps 1e-6 whatever rms_norm_eps; megatron uses one eps
            check(
                self.norm_eps == 1e-6, "model.norm_eps", "must be 1e-6 with MLA (DeepSeek-V3's latent norms)"
            )
        if self.rope_scaling_type == "yarn":
            # megatron-core 0.16.1 builds YaRN inside MLA; GPTModel's yarn path for GQA is not wired here
            check(self.mla, "model.rope_scaling_type", "yarn is built for MLA (DeepSeek-V3) only")
            check(
                self.rope_original_max_position > 0,
                "model.rope_original_max_position",
                "must be > 0 with yarn",
            )
            # transformers and megatron-core agree on YaRN's cos/sin factor only in these cases
            check(
                self.rope_mscale == 1 if self.rope_mscale_all_dim == 0 else self.rope_mscale != 0,
                "model.rope_mscale",
                f"{self.rope_mscale} with rope_mscale_all_dim {self.rope_mscale_all_dim}: must be 1 when "
                "mscale_all_dim is 0, else non-zero",
            )

    @property
    def mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V3 / Kimi-K2)."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> list[int]:
        """Global (0-based) numbers of the MoE layers."""
        return list(range(self.first_k_dense, self.num_layers))


# ModelConfig fields that change tensor shapes or the function computed; max_seq_len and the aux-loss
# coefficient do not (RoPE has no parameters). Init weights, HF checkpoints and route records made
# for another architecture are refused by these (weights/warmstart.py, weights/hf.py, routing/record.py).
ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "ffn_hidden_size",
    "moe_ffn_hidden_size",
    "num_experts",
    "moe_router_topk",
    "first_k_dense",
    "qk_layernorm",
    "rope_theta",
    "norm_eps",
    "attention_bias",
    "partial_rotary_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_scaling_type",
    "rope_scaling_factor",
    "rope_original_max_position",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_mscale",
    "rope_mscale_all_dim",
    "moe_router_score_function",
    "norm_topk_prob",
    "moe_router_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_scaling_factor",
    "moe_shared_expert_ffn_hidden_size",
    "moe_shared_expert_gate",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class ParallelConfig:
    nproc: int = 2  # local ranks `moe-rl train` starts (ignored under an external torchrun)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 2
    # experts' own tensor parallelism (megatron's expert_tensor_parallel_size): 0 = tensor_parallel
    # (megatron's default); large MoE runs use 1 (whole experts per rank, EP across them)
    expert_tensor_parallel: int = 0
    # uneven pipeline stages: layers of the first / last stage (0 = an even split); the embedding
    # and the output layer make those stages heavier, so they get fewer layers
    layers_in_first_stage: int = 0
    layers_in_last_stage: int = 0
    virtual_pipeline: int = 1  # interleaved 1F1B model chunks per stage: only 1 is supported
    distributed_optimizer: bool = True
    token_dispatcher: str = "alltoall"  # alltoall (production-like) | allgather
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    # the learner's optimizer state, fp32 main params, gradient buffers and parameters leave
    # device memory while the engine generates, and come back before the learner's next pass
    # (moe_rl/learner/offload.py)
    offload_during_rollout: bool = False
    # ranks that only run rollout engines (the last N of the world; moe_rl/pipeline/placement.py): the other
    # nproc - N ranks run the megatron learner with the layout above. 0: every rank runs both (colocated)
    rollout_ranks: int = 0
    # the weight sync's gathered unit, MiB: a layer within it travels whole, a larger one as its
    # other tensors, then its experts in pieces of at most this many bytes, never a whole MoE layer
    # at once (moe_rl/weights/stream.py; moe_rl/memory/phases.py counts it at the sync phase)
    sync_bucket_mib: int = 512

    def __post_init__(self) -> None:
        check_finite(self, "parallel")
        check(
            self.sync_bucket_mib >= 1,
            "parallel.sync_bucket_mib",
            f"must be >= 1 (got {self.sync_bucket_mib})",
        )
        check(self.rollout_ranks >= 0, "parallel.rollout_ranks", f"must be >= 0 (got {self.rollout_ranks})")
        check(
            self.rollout_ranks < self.nproc,
            "parallel.rollout_ranks",
            f"{self.rollout_ranks} of parallel.nproc={self.nproc} ranks leaves no learner rank",
        )
        for name in ("nproc", "tensor_parallel", "pipeline_parallel", "expert_parallel", "virtual_pipeline"):
            check(getattr(self, name) >= 1, f"parallel.{name}", "must be >= 1")
        for name in ("expert_tensor_parallel", "layers_in_first_stage", "layers_in_last_stage"):
            check(getattr(self, name) >= 0, f"parallel.{name}", "must be >= 0 (0: the default)")
        # megatron's interleaved schedule needs one model chunk per virtual stage; the learner,
        # replay hooks and weight mapping hold one chunk per rank
        check(
            self.virtual_pipeline == 1,
            "parallel.virtual_pipeline",
            f"{self.virtual_pipeline}: virtual pipeline stages (interleaved 1F1B) are not supported; "
            f"use 1 and, for balance, parallel.layers_in_first_stage / layers_in_last_stage",
        )
        check(
            self.pipeline_parallel > 1 or self.layers_in_first_stage == self.layers_in_last_stage == 0,
            "parallel.layers_in_first_stage",
            "uneven stages need parallel.pipeline_parallel > 1",
        )
        one_of(self.token_dispatcher, "parallel.token_dispatcher", ("alltoall", "allgather"))
        one_of(self.backend, "parallel.backend", ("auto", "gloo", "nccl"))

    @property
    def learner_ranks(self) -> int:
        """Ranks that run the megatron learner: the world the layout (TP x PP x DP) divides."""
        return self.nproc - self.rollout_ranks

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size in effect."""
        return self.expert_tensor_parallel or self.tensor_parallel
