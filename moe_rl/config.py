"""The typed config tree and its loader: the single source of truth for every run.

Dataclasses define fields, defaults and validation. YAML files (``configs/*.yaml``) and dotted
command-line overrides (``rollout.temperature=0.8``) only override them. Loading goes through
OmegaConf's structured configs, so an unknown key or a wrong type fails before any work starts,
naming the full dotted key; cross-field checks in ``__post_init__`` name the keys too. Renamed keys
keep working for one release through one table (``DEPRECATED_KEYS``), with a one-line warning.
Megatron's own argument names appear only in ``moe_rl/learner/setup.py``.

Near the bottom of the package: imports only pure modules (no torch, no megatron;
tests/test_style.py): the names configs validate against (``moe_rl.names``), the rejection-option
grammar (``moe_rl.rejection``), the layout arithmetic (``moe_rl.layout``) and what the vLLM engine
cannot do (``moe_rl.rollout.vllm_rules``). What depends on the machine (CUDA, Transformer Engine,
vllm installed) is checked when a run starts, in ``moe_rl/preflight.py``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_rl.errors import ConfigError  # re-exported
from moe_rl.layout import check_layout, data_parallel_size
from moe_rl.names import (
    ADVANTAGE_NAMES,
    GROUP_ADVANTAGE_NAMES,
    HF_FAMILY_NAMES,
    IS_LEVEL_NAMES,
    KL_ESTIMATOR_NAMES,
    LENGTH_NEUTRAL_NAMES,
    SAFE_SET_RULE_NAMES,
    TRM_KL_SOURCE_NAMES,
    TRM_REFERENCE_NAMES,
)
from moe_rl.rejection import parse_rs_spec
from moe_rl.rollout.vllm_rules import check_vllm


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def _check_finite(cfg: Any, prefix: str) -> None:
    """Every float field of one config dataclass is finite (``optim.lr=inf`` is refused here, not
    trained on)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{prefix}.{f.name}': {value} is not a finite number")


def _one_of(value: str, key: str, choices: tuple[str, ...] | list[str]) -> None:
    hint = (
        " (YAML reads unquoted on/off/yes/no as booleans: quote the value)"
        if value in ("True", "False")
        else ""
    )
    _check(value in choices, key, f"{value!r} is not one of {sorted(choices)}{hint}")


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
    # HF model family of import/export (moe_rl/weights/hf.py FAMILIES): qwen3_moe | mixtral (no q/k norm)
    hf_family: str = "qwen3_moe"
    # Learner kernels and precision (moe_rl/learner/te_spec.py). te and fp8 need CUDA and Transformer
    # Engine; that is checked when a run starts (preflight.check_launch), so GPU recipes still load anywhere.
    transformer_impl: str = "local"  # local: megatron's own modules (CPU) | te: Transformer Engine spec
    precision: str = "fp32"  # fp32 | bf16 | fp8 (TE linears in FP8, bf16 params, fp32 main params)
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise (megatron-core Fp8Recipe names)
    fp8_format: str = "hybrid"  # hybrid: e4m3 forward, e5m2 gradients | e4m3 everywhere

    def __post_init__(self) -> None:
        _check_finite(self, "model")
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
            _check(getattr(self, name) > 0, f"model.{name}", "must be > 0")
        _check(self.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = from the tokenizer)")
        _check(
            self.moe_router_topk <= self.num_experts,
            "model.moe_router_topk",
            f"top-k {self.moe_router_topk} > model.num_experts {self.num_experts}",
        )
        _check(
            self.num_attention_heads % self.num_query_groups == 0,
            "model.num_query_groups",
            f"{self.num_query_groups} does not divide model.num_attention_heads {self.num_attention_heads}",
        )
        _check(
            0 <= self.first_k_dense < self.num_layers,
            "model.first_k_dense",
            f"must be in [0, model.num_layers={self.num_layers}) so at least one layer is MoE",
        )
        _check(self.router_aux_loss_coeff >= 0, "model.router_aux_loss_coeff", "must be >= 0")
        _one_of(self.transformer_impl, "model.transformer_impl", ("local", "te"))
        _one_of(self.precision, "model.precision", ("fp32", "bf16", "fp8"))
        # mxfp8 / nvfp4 are Blackwell-only (docs/gpu_stack.md 3); custom needs a quantizer factory
        _one_of(self.fp8_recipe, "model.fp8_recipe", ("delayed", "tensorwise", "blockwise"))
        _one_of(self.fp8_format, "model.fp8_format", ("hybrid", "e4m3"))
        _one_of(self.hf_family, "model.hf_family", HF_FAMILY_NAMES)
        self._check_variants()
        _check(
            self.precision != "fp8" or self.transformer_impl == "te",
            "model.precision",
            "fp8 GEMMs come from Transformer Engine: set model.transformer_impl=te",
        )

    def _check_variants(self) -> None:
        """Attention / router variant fields (DeepSeek-V3, GLM-4.5, Qwen2-MoE) are consistent."""
        for name in _NOT_BUILT_YET:  # accepted by the tree, not yet by learner and engines
            default = ModelConfig.__dataclass_fields__[name].default
            _check(getattr(self, name) == default, f"model.{name}", f"only {default!r} is supported yet")
        _check(0 < self.partial_rotary_factor <= 1, "model.partial_rotary_factor", "must be in (0, 1]")
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check(getattr(self, name) >= 0, f"model.{name}", "must be >= 0")
        if self.mla:
            for name in ("qk_rope_head_dim", "v_head_dim"):
                _check(
                    getattr(self, name) > 0, f"model.{name}", "must be > 0 with MLA (model.kv_lora_rank > 0)"
                )
        _one_of(self.rope_scaling_type, "model.rope_scaling_type", ("none", "yarn"))
        _check(self.rope_scaling_factor >= 1, "model.rope_scaling_factor", "must be >= 1")
        self._check_attention_variants()
        _one_of(self.moe_router_score_function, "model.moe_router_score_function", ("softmax", "sigmoid"))
        _one_of(self.expert_bias_update, "model.expert_bias_update", ("frozen", "native"))
        _check(self.moe_router_num_groups >= 0, "model.moe_router_num_groups", "must be >= 0")
        if self.moe_router_num_groups > 1:
            G = self.moe_router_num_groups
            _check(
                self.num_experts % G == 0,
                "model.moe_router_num_groups",
                f"{G} does not divide model.num_experts {self.num_experts}",
            )
            _check(
                0 < self.moe_router_group_topk <= G,
                "model.moe_router_group_topk",
                f"must be in [1, model.moe_router_num_groups={G}]",
            )
            _check(
                self.moe_router_topk <= self.moe_router_group_topk * (self.num_experts // G),
                "model.moe_router_topk",
                f"{self.moe_router_topk} > experts in {self.moe_router_group_topk} groups "
                f"of {self.num_experts // G}",
            )
        _check(self.moe_router_scaling_factor > 0, "model.moe_router_scaling_factor", "must be > 0")
        _check(
            self.moe_shared_expert_ffn_hidden_size >= 0,
            "model.moe_shared_expert_ffn_hidden_size",
            "must be >= 0",
        )
        _check(
            not self.moe_shared_expert_gate or self.moe_shared_expert_ffn_hidden_size > 0,
            "model.moe_shared_expert_gate",
            "needs shared experts (model.moe_shared_expert_ffn_hidden_size > 0)",
        )

    def _check_attention_variants(self) -> None:
        """Combinations the learner (megatron-core 0.16.1) and the built-in engine compute alike."""
        rot = self.qk_rope_head_dim if self.mla else int(self.head_dim * self.partial_rotary_factor)
        _check(
            rot > 0 and rot % 2 == 0,
            "model.qk_rope_head_dim" if self.mla else "model.partial_rotary_factor",
            f"RoPE rotates {rot} dims per head: must be even and > 0",
        )
        if self.mla:
            _check(self.qk_nope_head_dim > 0, "model.qk_nope_head_dim", "must be > 0 with MLA")
            # DeepSeek-V3's attention_bias puts biases on q_a/kv_a/o_proj: not built
            _check(not self.attention_bias, "model.attention_bias", "q/k/v biases are for GQA, not with MLA")
            _check(self.partial_rotary_factor == 1, "model.partial_rotary_factor", "must be 1 with MLA")
            # transformers' q_a/kv_a_layernorm use eps 1e-6 whatever rms_norm_eps; megatron uses one eps
            _check(
                self.norm_eps == 1e-6, "model.norm_eps", "must be 1e-6 with MLA (DeepSeek-V3's latent norms)"
            )
        if self.rope_scaling_type == "yarn":
            # megatron-core 0.16.1 builds YaRN inside MLA; GPTModel's yarn path for GQA is not wired here
            _check(self.mla, "model.rope_scaling_type", "yarn is built for MLA (DeepSeek-V3) only")
            _check(
                self.rope_original_max_position > 0,
                "model.rope_original_max_position",
                "must be > 0 with yarn",
            )
            # transformers and megatron-core agree on YaRN's cos/sin factor only in these cases
            _check(
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


# Variant fields the learner and the engines cannot build yet: only their default is accepted.
_NOT_BUILT_YET = (
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

    def __post_init__(self) -> None:
        _check_finite(self, "parallel")
        for name in ("nproc", "tensor_parallel", "pipeline_parallel", "expert_parallel", "virtual_pipeline"):
            _check(getattr(self, name) >= 1, f"parallel.{name}", "must be >= 1")
        for name in ("expert_tensor_parallel", "layers_in_first_stage", "layers_in_last_stage"):
            _check(getattr(self, name) >= 0, f"parallel.{name}", "must be >= 0 (0: the default)")
        # megatron's interleaved schedule needs one model chunk per virtual stage; the learner,
        # replay hooks and weight mapping hold one chunk per rank
        _check(
            self.virtual_pipeline == 1,
            "parallel.virtual_pipeline",
            f"{self.virtual_pipeline}: virtual pipeline stages (interleaved 1F1B) are not supported; "
            f"use 1 and, for balance, parallel.layers_in_first_stage / layers_in_last_stage",
        )
        _check(
            self.pipeline_parallel > 1 or self.layers_in_first_stage == self.layers_in_last_stage == 0,
            "parallel.layers_in_first_stage",
            "uneven stages need parallel.pipeline_parallel > 1",
        )
        _one_of(self.token_dispatcher, "parallel.token_dispatcher", ("alltoall", "allgather"))
        _one_of(self.backend, "parallel.backend", ("auto", "gloo", "nccl"))

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size in effect."""
        return self.expert_tensor_parallel or self.tensor_parallel


@dataclass(frozen=True)
class LengthLRConfig:
    """Knobs of ``LengthLRScheduler`` (docs/math.md 5.2 [I]; all defaults unverified).

    Each step the scheduler observes the global mean response length x_k and:
    1. smooths it: ``smoothing="ema"``: L_k = (1 - ema_alpha) L_{k-1} + ema_alpha x_k, L_0 = x_0;
       ``smoothing="window"``: L_k = mean of the last ``window`` observations.
    2. compares it with a reference: ``reference="running_min"``: min_{j<=k} L_j (docs/math.md 5.2);
       ``reference="lookback"``: L_{k-lookback} (a relative slope over ``lookback`` steps; no
       trigger until that many smoothed values exist). ratio_k = L_k / reference.
    3. counts consecutive steps with ratio_k > ``surge_ratio`` (the first ``min_observations``
       observations and steps inside a cooldown do not count, and reset the count).
    4. triggers when the count reaches ``patience``: multiplier <- max(multiplier * decay_factor,
       min_multiplier), then no trigger for ``cooldown_steps`` steps. With ``rebase_after_trigger``
       the reference restarts from the current smoothed length, so the next trigger needs a new
       surge; without it a length that stays high decays again after every cooldown.
    A trigger when the multiplier is already at ``min_multiplier`` changes nothing and is not an
    event. The LR is then ``scheduled_lr(...)``: the base schedule (``lr_at``) times the
    multiplier, never below ``min(base, min_lr)``.
    """

    enabled: bool = False
    smoothing: str = "ema"  # ema | window
    ema_alpha: float = 0.1  # weight of the newest observation (ema)
    window: int = 10  # observations averaged (window)
    reference: str = "running_min"  # running_min | lookback
    lookback: int = 20  # steps back for reference="lookback"
    surge_ratio: float = 1.2  # trigger threshold on smoothed / reference (> 1)
    patience: int = 3  # consecutive steps above the threshold
    min_observations: int = 10  # no trigger before this many observations (smoother warm-up)
    decay_factor: float = 0.5  # multiplier <- multiplier * decay_factor on a trigger
    cooldown_steps: int = 50  # steps after a trigger during which nothing triggers
    min_multiplier: float = 0.1  # the multiplier's floor
    min_lr: float = 0.0  # floor on the decayed LR (never raises it above the base schedule)
    rebase_after_trigger: bool = True

    def __post_init__(self) -> None:
        _check_finite(self, "optim.length_lr")
        _one_of(self.smoothing, "optim.length_lr.smoothing", ("ema", "window"))
        _one_of(self.reference, "optim.length_lr.reference", ("running_min", "lookback"))
        _check(0 < self.ema_alpha <= 1, "optim.length_lr.ema_alpha", "must be in (0, 1]")
        for name in ("window", "lookback", "patience"):
            _check(getattr(self, name) >= 1, f"optim.length_lr.{name}", "must be >= 1")
        for name in ("min_observations", "cooldown_steps"):
            _check(getattr(self, name) >= 0, f"optim.length_lr.{name}", "must be >= 0")
        _check(self.surge_ratio > 1, "optim.length_lr.surge_ratio", "must be > 1")
        _check(0 < self.decay_factor < 1, "optim.length_lr.decay_factor", "must be in (0, 1)")
        _check(0 <= self.min_multiplier <= 1, "optim.length_lr.min_multiplier", "must be in [0, 1]")
        _check(self.min_lr >= 0, "optim.length_lr.min_lr", "must be >= 0")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 5e-5
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # a minibatch whose gradient is exactly 0 on every rank (all advantages 0, or every token
    # rejected) skips the optimizer step: Adam would otherwise take a near-full-size step on its
    # momentum alone (counted in train/skipped_minibatches); false: step anyway, as verl and
    # Megatron-LM do
    skip_zero_grad: bool = True
    length_lr: LengthLRConfig = field(default_factory=LengthLRConfig)  # decay on response-length surges

    def __post_init__(self) -> None:
        _check_finite(self, "optim")
        _check(self.lr > 0, "optim.lr", "must be > 0")
        _check(0 <= self.min_lr <= self.lr, "optim.min_lr", "must be in [0, optim.lr]")
        _one_of(self.lr_schedule, "optim.lr_schedule", ("constant", "cosine"))
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _check(self.clip_grad > 0, "optim.clip_grad", "must be > 0")
        for name in ("adam_beta1", "adam_beta2"):
            _check(0 <= getattr(self, name) < 1, f"optim.{name}", f"{getattr(self, name)} is not in [0, 1)")
        _check(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0 (got {self.weight_decay})")


@dataclass(frozen=True)
class VllmConfig:
    """The vLLM rollout engine (moe_rl/rollout/vllm_engine.py); used when rollout.engine=vllm."""

    tensor_parallel: int = 1  # consecutive ranks that share one colocated vLLM engine
    gpu_memory_utilization: float = 0.35  # vLLM's share of each GPU (weights + KV cache)
    sleep_level: int = 1  # between rollouts: 0 stay awake | 1 offload weights, drop KV | 2 drop both
    enforce_eager: bool = False  # no CUDA graphs (faster start, slower decode)
    max_model_len: int = 0  # 0: model.max_seq_len
    model_dir: str = ""  # HF dir vLLM starts from; "": init_weights' hf:DIR, else written from the learner
    # DVP (correction.dvp_threshold > 0): the largest safe set per position the engine can report;
    # vLLM returns the top dvp_max_safe + 1 log-probs per token, and a larger safe set is an error
    dvp_max_safe: int = 64

    def __post_init__(self) -> None:
        _check_finite(self, "rollout.vllm")
        _check(self.tensor_parallel >= 1, "rollout.vllm.tensor_parallel", "must be >= 1")
        _check(
            0 < self.gpu_memory_utilization < 1, "rollout.vllm.gpu_memory_utilization", "must be in (0, 1)"
        )
        _one_of(str(self.sleep_level), "rollout.vllm.sleep_level", ("0", "1", "2"))
        _check(self.max_model_len >= 0, "rollout.vllm.max_model_len", "must be >= 0")
        _check(self.dvp_max_safe >= 1, "rollout.vllm.dvp_max_safe", "must be >= 1")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "builtin"  # builtin (CPU or small GPU models) | vllm (CUDA; rollout.vllm)
    dtype: str = "bf16"  # the built-in engine's own numeric path: bf16 | fp32
    prompts_per_step: int = 32  # global, over all data-parallel ranks
    samples_per_prompt: int = 8
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    router_noise: float = (
        0.0  # std of Gaussian noise on the engine's router logits: dialled-in routing mismatch
    )
    staleness: int = 0  # generate with the policy of k updates ago (asynchronous pipelines); 0 = synced
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        _check_finite(self, "rollout")
        _one_of(self.engine, "rollout.engine", ("builtin", "vllm"))
        _one_of(self.dtype, "rollout.dtype", ("bf16", "fp32"))
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens"):
            _check(getattr(self, name) >= 1, f"rollout.{name}", "must be >= 1")
        _check(self.temperature > 0, "rollout.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        _check(self.router_noise >= 0, "rollout.router_noise", "must be >= 0")
        _check(self.staleness >= 0, "rollout.staleness", f"must be >= 0 (got {self.staleness})")


@dataclass(frozen=True)
class RoutingConfig:
    # off: learner routes natively (agreement with the rollout's routes is still measured)
    # r2:  the old-log-prob pass records the learner's routes; the update passes replay them
    # r3:  the rollout engine's routes are replayed in the old-log-prob and update passes
    replay: str = "off"
    # Replay in the reference (KL) pass too, so the KL term measures the policy change and not
    # routing noise between two forwards (all peers default to not replaying: docs/design.md 6.3).
    replay_reference: bool = True

    def __post_init__(self) -> None:
        _check_finite(self, "routing")
        _one_of(self.replay, "routing.replay", ("off", "r2", "r3"))


@dataclass(frozen=True)
class RejectionSpec:
    """One rejection rule of ``correction.rejection`` (AND-combined; grammar: ``moe_rl.rejection``).

    ``option`` is ``<agg>_<k1|k2|k3>`` (token_k1, seq_mean_k3, ...). k1 bounds rho: kept iff
    lower <= rho <= upper, and ``lower: 0`` means 1/upper (then upper >= 1); k2/k3 bound the
    aggregated estimate from above (upper > 0, no lower). YAML: ``{option: seq_sum_k1, lower: 0.5,
    upper: 2.0}``."""

    option: str = ""
    upper: float = 0.0
    lower: float = 0.0

    @property
    def bound(self) -> float | tuple[float, float]:
        """The bound as ``parse_rs_spec`` takes it: (lower, upper), or upper alone."""
        return (self.lower, self.upper) if self.lower else self.upper


@dataclass(frozen=True)
class TrmConfig:
    """Trust Region Masking (docs/math.md 3): whole sequences whose per-token divergence from the
    rollout policy exceeds a criterion are masked. Off unless a delta > 0 or ``length_neutral``."""

    max: float = 0.0  # max criterion delta on per-token k2 (0 = off); paper: 0.05 alone
    avg: float = 0.0  # average criterion delta on per-token k3 (0 = off); paper: 0.001 alone
    reference: str = "old"  # evaluate TRM against pi_old (cheaper) | theta (the paper's guarantee)
    # exact: per-token KL(pi_rollout || pi) from the engine's full distributions (the built-in
    # engine returns them; vLLM gives top-k only); sample: k2 (max) and k3 (avg) estimators
    kl: str = "sample"
    # length-neutral TRM (paper appendix): ln = LN-TRM, ser = SER (mean |rho - 1| <= threshold)
    length_neutral: str = "none"
    ln_threshold: float = 0.05  # delta_W (ln) or delta_SER (ser; the paper suggests 0.03-0.10)
    ln_eps: float = 0.05  # LN-TRM token weights min(1, (T-t) eps, sqrt((T-t) delta / 2))
    ln_delta: float = 0.001

    def __post_init__(self) -> None:
        _check_finite(self, "correction.trm")
        _check(self.max >= 0 and self.avg >= 0, "correction.trm.max", "TRM deltas must be >= 0")
        _one_of(self.reference, "correction.trm.reference", TRM_REFERENCE_NAMES)
        _one_of(self.kl, "correction.trm.kl", TRM_KL_SOURCE_NAMES)
        _one_of(self.length_neutral, "correction.trm.length_neutral", LENGTH_NEUTRAL_NAMES)
        _check(
            self.ln_threshold > 0 and self.ln_eps > 0 and self.ln_delta > 0,
            "correction.trm.ln_threshold",
            "length-neutral TRM parameters must be > 0",
        )

    @property
    def on(self) -> bool:
        return self.max > 0 or self.avg > 0 or self.length_neutral != "none"


@dataclass(frozen=True)
class CorrectionConfig:
    """Rollout correction (docs/math.md 2-3). Ratio bounds are on rho = pi_train / pi_rollout."""

    mode: str = "decoupled"  # decoupled: rollout->old by IS/RS, old->theta by the clip | bypass
    bypass_loss: str = "ppo_clip"  # bypass only: ppo_clip (ratio theta/rollout) | reinforce
    is_level: str = "none"  # none | token | sequence | geometric
    is_clip: float = 2.0  # one-sided truncation of the IS weights
    is_batch_normalize: bool = False  # divide the weights by their global batch mean
    rejection: list[RejectionSpec] = field(default_factory=list)  # rejection rules, AND-combined
    dual_clip_c: float = 0.0  # dual clip for A < 0 (verl clip_ratio_c); 0 = off
    trm: TrmConfig = field(default_factory=TrmConfig)
    # Dynamic Vocabulary Pruning: the engine samples only from a safe set per position and both
    # sides compute log-probs over it (docs/math.md 4; the paper's rule is a GAP, so it is a knob). 0 = off
    dvp_threshold: float = 0.0
    dvp_rule: str = (
        "relative"  # relative: p >= threshold * max p | top_p: smallest set with mass >= threshold
    )

    def __post_init__(self) -> None:
        _check_finite(self, "correction")
        _one_of(self.mode, "correction.mode", ("decoupled", "bypass"))
        _one_of(self.bypass_loss, "correction.bypass_loss", ("ppo_clip", "reinforce"))
        _one_of(self.is_level, "correction.is_level", ("none", *IS_LEVEL_NAMES))
        _check(self.is_clip >= 1, "correction.is_clip", "must be >= 1")
        _check(
            self.dual_clip_c == 0 or self.dual_clip_c > 1, "correction.dual_clip_c", "must be 0 (off) or > 1"
        )
        _check(0 <= self.dvp_threshold < 1, "correction.dvp_threshold", "must be in [0, 1)")
        _one_of(self.dvp_rule, "correction.dvp_rule", SAFE_SET_RULE_NAMES)
        _check(
            not (self.mode == "bypass" and self.bypass_loss == "ppo_clip" and self.is_level != "none"),
            "correction.is_level",
            "bypass ppo_clip applies no IS weight (the ratio already is one)",
        )
        for i, spec in enumerate(self.rejection):
            _check_finite(spec, f"correction.rejection[{i}]")
            try:
                parse_rs_spec([spec.option], [spec.bound])
            except ValueError as e:
                raise ConfigError(f"config key 'correction.rejection[{i}]': {e}") from None

    @property
    def rs_options(self) -> tuple[str, ...]:
        return tuple(s.option for s in self.rejection)

    @property
    def rs_bounds(self) -> tuple:
        """One bound per option, as ``parse_rs_spec`` / ``rejection_mask`` take them."""
        return tuple(s.bound for s in self.rejection)


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts, answers and rewards come from (moe_rl/tasks/; README "Train your own checkpoint").

    Built-in generated tasks (mixed uniformly) unless ``dataset`` names a JSONL or Parquet file of
    rows; ``prompt_key`` / ``answer_key`` / ``source_key`` are dotted paths into a row (verl:
    ``prompt`` as chat messages, ``reward_model.ground_truth``, ``data_source``)."""

    tasks: list[str] = field(default_factory=lambda: ["reverse", "sort", "copy"])
    min_len: int = 2
    max_len: int = 4
    dataset: str = ""  # JSONL or Parquet prompt rows; see moe_rl/tasks/rows.py
    # exact_match | char_accuracy | math | python:FILE.py:FUNCTION (called per sample; see
    # moe_rl/tasks/text_rewards.py)
    reward: str = "exact_match"
    # a dataset prompt that leaves no room for rollout.max_new_tokens within model.max_seq_len:
    # error (names file and row) | drop (skipped, counted in the log and rollout/prompts_dropped_too_long)
    overlong: str = "error"
    # builtin:char | hf:DIR (transformers AutoTokenizer) | auto: the init_weights=hf:DIR directory,
    # else builtin:char
    tokenizer: str = "auto"
    prompt_key: str = "prompt"  # a string, or a list of chat messages ({"role", "content"})
    answer_key: str = "answer"  # the ground truth (a string or a number)
    source_key: str = "data_source"  # label for per-source metrics; rows without it are "dataset"
    # the tokenizer's chat template: auto (a prompt of chat messages goes through it, a string prompt
    # is tokenized as is) | true (every prompt, a string as one user message) | false (refuse messages)
    apply_chat_template: str = "auto"
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    # a configured prompt limit: longer prompts are dropped at load (counted); 0: model.max_seq_len -
    # rollout.max_new_tokens, with task.overlong deciding
    max_prompt_tokens: int = 0
    val_dataset: str = ""  # validation rows (same keys); scored every log.val_every steps
    val_max_prompts: int = 0  # 0: every validation row
    reward_workers: int = 2  # processes scoring text rewards (math, python:...); 0: in the trainer's process
    reward_timeout_s: float = (
        10.0  # per sample; a reward that raises or times out scores 0 (reward/error_frac)
    )
    # DAPO soft overlong penalty: over the last `overlong_buffer` tokens before rollout.max_new_tokens the
    # reward drops linearly by up to `overlong_penalty` (0 = off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_finite(self, "task")
        _one_of(self.overlong, "task.overlong", ("error", "drop"))
        _check(len(self.tasks) > 0 or bool(self.dataset), "task.tasks", "empty and no task.dataset")
        _check(
            1 <= self.min_len <= self.max_len,
            "task.min_len",
            f"need 1 <= task.min_len ({self.min_len}) <= task.max_len ({self.max_len})",
        )
        _check(
            self.tokenizer in ("auto", "builtin:char", "hf") or self.tokenizer.startswith("hf:"),
            "task.tokenizer",
            f"{self.tokenizer!r} is not auto, builtin:char or hf:DIR",
        )
        for key in ("prompt_key", "answer_key", "source_key"):
            _check(
                bool(getattr(self, key)) and "" not in getattr(self, key).split("."),
                f"task.{key}",
                f"{getattr(self, key)!r} is not a dotted key path",
            )
        _check(self.reward != "", "task.reward", "must name a reward")
        # YAML reads an unquoted true/false as a boolean, stored here as 'True'/'False'
        object.__setattr__(self, "apply_chat_template", str(self.apply_chat_template).lower())
        _one_of(self.apply_chat_template, "task.apply_chat_template", ("auto", "true", "false"))
        for key in ("max_prompt_tokens", "val_max_prompts", "reward_workers", "overlong_buffer"):
            _check(getattr(self, key) >= 0, f"task.{key}", "must be >= 0")
        _check(self.reward_timeout_s > 0, "task.reward_timeout_s", "must be > 0")
        _check(self.overlong_penalty >= 0, "task.overlong_penalty", "must be >= 0")


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"
    grpo_std_norm: bool = True  # grpo only: divide by the group std (rloo never does)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0  # KL to the reference (initial) policy; 0 = no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3
    num_minibatches: int = 4  # optimizer steps per RL step: the batch is split into this many
    micro_batch_size: int = 64  # sequences per forward/backward on one rank
    # > 0: micro-batches formed by token count instead (sequences sorted by length, bucketed so each
    # micro-batch holds at most this many padded tokens; a longer sequence gets one of its own)
    max_tokens_per_micro_batch: int = 0

    def __post_init__(self) -> None:
        _check_finite(self, "algo")
        _one_of(self.advantage, "algo.advantage", ADVANTAGE_NAMES)
        _check(self.clip_low >= 0 and self.clip_high >= 0, "algo.clip_low", "clips must be >= 0")
        _one_of(self.kl_estimator, "algo.kl_estimator", KL_ESTIMATOR_NAMES)
        _check(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
        _check(self.num_minibatches >= 1, "algo.num_minibatches", "must be >= 1")
        _check(self.micro_batch_size >= 1, "algo.micro_batch_size", "must be >= 1")
        _check(self.max_tokens_per_micro_batch >= 0, "algo.max_tokens_per_micro_batch", "must be >= 0")


@dataclass(frozen=True)
class HealthConfig:
    """Health alarms (moe_rl/health.py): a warning event in events.jsonl, the log and the report
    when a condition holds for ``patience`` consecutive steps; never stops the run."""

    enabled: bool = True
    patience: int = 3  # consecutive steps a condition must hold
    # policy entropy (train/entropy, nats per token) >= this fraction of ln(vocab_size): uniform
    entropy_uniform_frac: float = 0.95
    entropy_zero: float = 1e-3  # policy entropy <= this: collapsed onto one token per position
    # and, always: every minibatch's gradient norm exactly 0 (train/grad_norm_max == 0)

    def __post_init__(self) -> None:
        _check_finite(self, "log.health")
        _check(self.patience >= 1, "log.health.patience", "must be >= 1")
        _check(0 < self.entropy_uniform_frac <= 1, "log.health.entropy_uniform_frac", "must be in (0, 1]")
        _check(self.entropy_zero >= 0, "log.health.entropy_zero", "must be >= 0")


@dataclass(frozen=True)
class LogConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "moe-rl"
    progress_bar: bool = True
    router_monitor: bool = True  # per-layer router-gradient monitor of the update passes
    router_margin_eps: float = 0.1  # Top-K margin under which a token counts as near the boundary
    health: HealthConfig = field(default_factory=HealthConfig)  # entropy / gradient alarms
    val_every: int = 0  # validation reward (greedy and sampled) on task.val_dataset every N steps; 0 = off

    def __post_init__(self) -> None:
        _check_finite(self, "log")
        _one_of(self.wandb_mode, "log.wandb_mode", ("offline", "online", "disabled"))
        _check(self.val_every >= 0, "log.val_every", "must be >= 0")


@dataclass(frozen=True)
class RunConfig:
    run_dir: str = "runs/default"
    resume: bool = False  # continue from run_dir's last checkpoint
    seed: int = 1234
    steps: int = 300
    checkpoint_every: int = 100  # 0 = only at the end
    init_weights: str = "builtin:warmstart"  # safetensors file, "builtin:warmstart", "hf:DIR" or "" (random)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "steps", "must be >= 1")
        _check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        m, p, r = self.model, self.parallel, self.rollout
        _check(
            r.max_new_tokens < m.max_seq_len,
            "rollout.max_new_tokens",
            f"{r.max_new_tokens} leaves no room for a prompt within model.max_seq_len={m.max_seq_len}",
        )
        check_layout(m, p)
        dp = self.data_parallel
        _check(
            r.prompts_per_step % dp == 0,
            "rollout.prompts_per_step",
            f"{r.prompts_per_step} prompts do not split over {dp} data-parallel ranks",
        )
        _check(
            self.task.val_max_prompts % dp == 0,
            "task.val_max_prompts",
            f"{self.task.val_max_prompts} prompts do not split over {dp} data-parallel ranks",
        )
        _check(
            r.samples_per_prompt >= 2 or self.algo.advantage not in GROUP_ADVANTAGE_NAMES,
            "rollout.samples_per_prompt",
            f"{self.algo.advantage} needs >= 2 samples per prompt",
        )
        per_rank = r.prompts_per_step // dp
        _check(
            per_rank % self.algo.num_minibatches == 0,
            "algo.num_minibatches",
            f"{self.algo.num_minibatches} minibatches do not split the {per_rank} prompts per rank",
        )
        if r.engine == "vllm":
            check_vllm(self)
        _check(
            self.algo.max_tokens_per_micro_batch == 0 or p.pipeline_parallel == 1,
            "algo.max_tokens_per_micro_batch",
            "token-budget micro-batches are tested with parallel.pipeline_parallel=1 only",
        )
        t = self.task
        _check(self.log.val_every == 0 or bool(t.val_dataset), "log.val_every", "needs task.val_dataset")
        room = self.model.max_seq_len - r.max_new_tokens
        _check(
            t.max_prompt_tokens <= room,
            "task.max_prompt_tokens",
            f"{t.max_prompt_tokens} leaves no room for rollout.max_new_tokens={r.max_new_tokens} within "
            f"model.max_seq_len={self.model.max_seq_len} (at most {room})",
        )
        _check(
            t.overlong_buffer < r.max_new_tokens,
            "task.overlong_buffer",
            f"{t.overlong_buffer} must be < rollout.max_new_tokens {r.max_new_tokens}",
        )
        _check(
            t.tokenizer in ("auto", "builtin:char")
            or t.tokenizer.startswith("hf:")
            and len(t.tokenizer) > 3
            or self.init_weights.startswith("hf:"),
            "task.tokenizer",
            f"{t.tokenizer!r} names the init_weights=hf:DIR directory, "
            f"but init_weights is {self.init_weights!r}",
        )

    @property
    def data_parallel(self) -> int:
        return data_parallel_size(self.parallel)


# Renamed keys, kept for one release: old dotted key -> new key (None: removed, the value is
# ignored). correction.rs + correction.rs_bounds (strings such as '0.5_2.0') together become
# correction.rejection, a list of typed RejectionSpec, merged after every input (file, overrides).
DEPRECATED_KEYS: dict[str, str | None] = {
    **{
        f"correction.trm_{k}": f"correction.trm.{k}"
        for k in ("max", "avg", "reference", "kl", "length_neutral", "ln_threshold", "ln_eps", "ln_delta")
    },
    "correction.rs": "correction.rejection",
    "correction.rs_bounds": "correction.rejection",
    "rollout.vllm.weight_sync": None,  # transfer was its one value
}
_RS_KEYS = ("correction.rs", "correction.rs_bounds")


def _warn_deprecated(where: str, old: str, new: str | None) -> None:
    """One line on stderr; ``where`` (the file or override) tells a run's own saved config.yaml
    from what the user typed."""
    what = f"use '{new}'" if new else "removed; its value is ignored"
    print(
        f"warning: {where}: config key '{old}' is deprecated: {what} (the old key goes in the next release)",
        file=sys.stderr,
    )


def _renamed_key(key: str) -> str:
    return DEPRECATED_KEYS.get(key) or key


def _rename_tree(tree: dict, legacy_rs: dict, where: str) -> dict:
    """Move the deprecated keys of one YAML mapping to their new keys (one warning each); the
    rs / rs_bounds values go to ``legacy_rs`` with ``where`` they were set (merged as
    correction.rejection after every input is read)."""
    for old, new in DEPRECATED_KEYS.items():
        head, _, leaf = old.rpartition(".")
        parent = tree
        for part in head.split("."):
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or leaf not in parent:
            continue
        value = parent.pop(leaf)
        _warn_deprecated(where, old, new)
        if old in _RS_KEYS:
            legacy_rs.update({old: value, "where": where})
        elif new is not None:
            *heads, last = new.split(".")
            node = tree
            for part in heads:
                node = node.setdefault(part, {})
            node[last] = value
    return tree


def _legacy_rejection(legacy_rs: dict) -> list[dict]:
    """correction.rs + correction.rs_bounds as correction.rejection, validated as they were."""
    options = list(legacy_rs.get("correction.rs") or [])
    raw = [str(b) for b in legacy_rs.get("correction.rs_bounds") or []]
    _check(bool(options) == bool(raw), "correction.rs_bounds", "give bounds exactly when rs is set")
    try:
        bounds = [tuple(float(v) for v in b.split("_")) if "_" in b else float(b) for b in raw]
        if not all(math.isfinite(v) for b in bounds for v in (b if isinstance(b, tuple) else (b,))):
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"config key 'correction.rs_bounds': {raw} are not finite numbers ('0.5_2.0' or '0.01')"
        ) from None
    try:
        parse_rs_spec(options, bounds)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config key 'correction.rs': {e}") from None
    bounds = bounds * len(options) if len(bounds) == 1 else bounds
    return [
        {"option": o, "lower": b[0], "upper": b[1]} if isinstance(b, tuple) else {"option": o, "upper": b}
        for o, b in zip(options, bounds)
    ]


def _check_rules(layer: DictConfig) -> DictConfig:
    """An unknown field of a ``correction.rejection`` rule, named with its index (OmegaConf's own
    error names the bare field only)."""
    rules = OmegaConf.select(layer, "correction.rejection", default=None)
    fields = [f.name for f in dataclasses.fields(RejectionSpec)]
    for i, rule in enumerate(rules if isinstance(rules, ListConfig) else []):
        for key in rule.keys() if isinstance(rule, DictConfig) else ():
            _check(
                key in fields, f"correction.rejection[{i}].{key}", f"not a field of a rejection rule {fields}"
            )
    return layer


def _override(base, item: str, legacy_rs: dict):
    """One ``key=value`` override as a layer to merge (None: a deprecated key held back or
    ignored). YAML 1.1 reads off/on/yes/no as booleans; a string-typed key
    (``routing.replay=off``) keeps the text as typed instead of becoming 'False', and an empty value
    (``init_weights=``, ``task.dataset=``) is the empty string, not None."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    if key.strip() in DEPRECATED_KEYS:
        old = key.strip()
        _warn_deprecated(f"override {item!r}", old, DEPRECATED_KEYS[old])
        if old in _RS_KEYS:
            value = OmegaConf.select(OmegaConf.from_dotlist([item]), old)
            legacy_rs.update(
                {
                    old: OmegaConf.to_container(value) if OmegaConf.is_config(value) else value,
                    "where": f"override {item!r}",
                }
            )
        if old in _RS_KEYS or DEPRECATED_KEYS[old] is None:
            return None
        key = DEPRECATED_KEYS[old]
        item = f"{key}={raw}"
    layer = _check_rules(OmegaConf.from_dotlist([item]))
    if isinstance(OmegaConf.select(base, key, default=None), str):
        if isinstance(OmegaConf.select(layer, key), bool) or raw.strip() == "":
            OmegaConf.update(layer, key, "" if raw.strip() == "" else raw)
    return layer


def _writable(node: Any) -> Any:
    """Clear the read-only flag on every node of ``node``; returns it.

    Frozen dataclasses make read-only nodes at every level. omegaconf 2.4's merge writes into
    them; 2.3's lifts the flag on the root only and fails on the first nested key ('Cannot set
    value of read-only config node'). The merged tree is thrown away after ``to_object``, which
    builds the frozen dataclasses again, so the result is the same on both versions."""
    if isinstance(node, DictConfig | ListConfig):
        OmegaConf.set_readonly(node, False)
        for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            if not OmegaConf.is_missing(node, key):
                _writable(node[key])
    return node


def _read_yaml(path: str | Path):
    """A config file's top-level mapping; ConfigError naming the file (and line) otherwise."""
    import yaml

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(p)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        lines = p.read_text(errors="replace").splitlines()
        line = lines[mark.line] if mark is not None and mark.line < len(lines) else ""
        tabs = " (a tab: indent YAML with spaces)" if "\t" in line[: mark.column + 1] else ""
        raise ConfigError(f"{where}: YAML syntax error: {e.problem}{tabs}") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(
            f"{path}: cannot read the YAML config ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if loaded is None:
        return {}
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(
            f"{path}: the top level is a {type(OmegaConf.to_container(loaded)).__name__}, "
            f"expected a mapping of config keys (e.g. 'steps: 100')"
        )
    return loaded


def _source_of(key: str | None, path: str | Path | None, overrides) -> str:
    """Which input set ``key``: the last override of it, else the file, else the defaults."""
    for item in reversed(list(overrides)):
        given = _renamed_key(item.split("=", 1)[0].strip())
        if key is not None and (given == key or key.startswith(given + "[")):
            return f"override {item!r}"
    return str(path) if path is not None else "defaults"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Embedded defaults <- YAML file <- dotted overrides; validated, or ConfigError naming the
    file (and line) or the override that is wrong, and the key. Deprecated keys are renamed
    (``DEPRECATED_KEYS``), one warning line each."""
    merged = _writable(OmegaConf.structured(RunConfig))
    where = "defaults"
    legacy_rs: dict = {}  # correction.rs / rs_bounds -> (value, where it was set)
    try:
        if path is not None:
            where = str(path)
            tree = _rename_tree(OmegaConf.to_container(_read_yaml(path)), legacy_rs, where)
            merged = _writable(OmegaConf.merge(merged, _check_rules(OmegaConf.create(tree))))
        base = merged
        for item in overrides:  # merged one at a time, so an error names its own override
            where = f"override {item!r}"
            layer = _override(base, item, legacy_rs)
            merged = merged if layer is None else _writable(OmegaConf.merge(merged, layer))
        if legacy_rs:  # the input that set rs or rs_bounds last is named in an error
            where = legacy_rs["where"]
            layer = OmegaConf.create({"correction": {"rejection": _legacy_rejection(legacy_rs)}})
            merged = _writable(OmegaConf.merge(merged, layer))
        where = "validation"
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0]
        if where == "validation":
            where = _source_of(key, path, overrides)
        raise ConfigError(f"{where}: config key '{key}': {first}") from None
    except ConfigError as e:
        if not str(e).startswith("config key"):
            raise
        if where == "validation":
            key = str(e).split("'")[1]
            where = _source_of(key, path, overrides)
        if where == "defaults":
            raise
        raise ConfigError(f"{where}: {e}") from None


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
