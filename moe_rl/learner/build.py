"""The ONLY place that maps our config to megatron-core's TransformerConfig, GPTModel, DDP wrapper
and optimizer. Megatron's argument names appear nowhere else."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F

from moe_rl.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from moe_rl.config.layout import check_tied_embeddings

# The distributed optimizer's checkpoint format: 'dp_reshardable' writes each data-parallel rank's
# flat shard of the fp32 main params and Adam state as it is. 'fully_reshardable' (the format
# before) first unflattened them into model-shaped fp32 copies, which made the save the whole run's
# peak (2.9x what a rank holds; docs/measurements.md 8); a resume already requires the same layout
# (preflight check_resume), which is all dp_reshardable needs. No "chained_N." prefix so dense+expert
# optimizers keep stable keys. The format is saved in the checkpoint's content metadata and read
# back on load (moe_rl/learner/checkpoint.py), so checkpoints written before still load.
OPTIM_CKPT_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "chained_optim_avoid_prefix": True,
}
# what a checkpoint without content metadata (written before the switch) was saved with: it gathers
# the optimizer shards over the (gloo on CPU) DP group in its mem-efficient variant
LEGACY_OPTIM_CKPT_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}


def transformer_config(
    model: ModelConfig, par: ParallelConfig, *, bf16: bool = False, sequence_parallel: bool = False
):
    """``sequence_parallel``: the learner trains with it whenever TP > 1 (megatron refuses MoE + TP
    training without it); eval-only builders may leave it off."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    n_dense = model.first_k_dense
    attention = _attention(model, par)
    config_class = MLATransformerConfig if model.mla else TransformerConfig
    return config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        **attention,
        ffn_hidden_size=model.ffn_hidden_size,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_layer_freq=[0] * n_dense + [1] * (model.num_layers - n_dense),
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,  # o_proj and the MLPs have none in every family; q/k/v: _attention
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **_router(model),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if model.router_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.router_aux_loss_coeff,
        moe_token_dispatcher_type=par.token_dispatcher,
        # every router owns a RouterReplay; moe_rl.routing.replay drives it per pass
        moe_enable_routing_replay=True,
        tensor_model_parallel_size=par.tensor_parallel,
        # each TP rank then routes its own S / TP block of positions (moe_rl.routing.replay
        # slices the route targets to match)
        sequence_parallel=sequence_parallel and par.tensor_parallel > 1,
        pipeline_model_parallel_size=par.pipeline_parallel,
        **_pipeline(model, par, bf16),
        expert_model_parallel_size=par.expert_parallel,
        expert_tensor_parallel_size=par.expert_tp,
        # Our loss is already divided by the global token count (passed in), so megatron must
        # neither divide it again nor average grads over DP: it sums them (scaling factor 1).
        calculate_per_token_loss=True,
        init_method_std=0.02,
        # fusions are torch.compile'd C++ on CPU: slow to build, slower to run at this size
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # no CUDA graphs (cuda_graph_impl stays "none"); megatron's own default scope, "full", is
        # deprecated by megatron and warns on every config built with it
        cuda_graph_scope=[],
        **_recompute(model),
        **_precision(model, bf16),
    )


def _router(model: ModelConfig) -> dict:
    """The router and shared experts (semantics: moe_rl/routing/gating.py; the combinations
    megatron-core cannot build are refused by ModelConfig).

    softmax + norm_topk_prob: softmax over the top-k logits (== Qwen3's renormalised top-k);
    softmax without it (Qwen2-MoE): megatron's pre-softmax, the full softmax's K probabilities;
    sigmoid: megatron renormalises over the K (DeepSeek-V3 / GLM-4.5 norm_topk_prob). The expert
    bias: megatron's own buffer only when it may move (``expert_bias_update=native``: updated in
    finalize_model_grads from the routes used); frozen, ``build_model`` adds it as a plain buffer
    the router reads and megatron never updates."""
    native_bias = model.moe_router_expert_bias and model.expert_bias_update == "native"
    kw: dict = {
        "moe_router_score_function": model.moe_router_score_function,
        "moe_router_pre_softmax": model.moe_router_score_function == "softmax" and not model.norm_topk_prob,
        "moe_router_enable_expert_bias": native_bias,
    }
    if model.moe_router_num_groups > 1:
        kw["moe_router_num_groups"] = model.moe_router_num_groups
        kw["moe_router_group_topk"] = model.moe_router_group_topk
    if model.moe_router_scaling_factor != 1.0:
        kw["moe_router_topk_scaling_factor"] = model.moe_router_scaling_factor
    if model.moe_shared_expert_ffn_hidden_size > 0:
        kw["moe_shared_expert_intermediate_size"] = model.moe_shared_expert_ffn_hidden_size
        kw["moe_shared_expert_gate"] = model.moe_shared_expert_gate
    return kw


def add_frozen_expert_bias(gpt, model: ModelConfig) -> None:
    """``expert_bias_update=frozen``: every router gets ``expert_bias`` as a plain fp32 buffer.

    megatron's TopKRouter passes ``self.expert_bias`` to its top-k whatever built it; with
    ``moe_router_enable_expert_bias`` off, neither the router counts tokens nor
    ``finalize_model_grads`` updates the bias, so it stays bit-identical (``requires_grad=False``
    would not stop that update: it is a buffer copy, not an optimizer step)."""
    if not model.moe_router_expert_bias or model.expert_bias_update != "frozen":
        return
    for layer in gpt.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        if getattr(router, "expert_bias", None) is not None:
            raise RuntimeError("frozen expert bias: megatron already built a (moving) expert_bias")
        del router.expert_bias  # megatron's plain ``None`` attribute: a buffer takes its place
        router.register_buffer("expert_bias", torch.zeros(model.num_experts, device=router.weight.device))


def _attention(model: ModelConfig, par: ParallelConfig) -> dict:
    """The attention fields of the TransformerConfig: GQA (optional q/k/v biases, RoPE on a share of
    each head via GPTModel's rotary_percent, build_model) or multi-latent attention (MLATransformerConfig).

    MLA: megatron's qk_head_dim is HF's qk_nope_head_dim and qk_pos_emb_head_dim its qk_rope_head_dim;
    q_lora_rank 0 (HF null) is megatron's None (a direct linear_q_proj). Its ``q_layernorm`` /
    ``kv_layernorm`` are the latent norms (q_a_layernorm / kv_a_layernorm), built only with
    qk_layernorm=True. megatron's MLA RoPE de-interleaves the rope dims before rotate_half
    (rope_utils._apply_rotary_pos_emb_bshd, multi_latent_attention=True), which is exactly
    transformers' DeepSeek-V3 rope_interleave=True: no weight permutation at the canonical boundary.
    The softmax scale is mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(nope + rope), so
    plain RoPE passes factor 1 (mscale 1); YaRN's cos/sin factor is applied by YarnRotaryEmbedding."""
    if not model.mla:
        return {
            "num_query_groups": model.num_query_groups,
            "kv_channels": model.head_dim,
            "qk_layernorm": model.qk_layernorm,
            "add_qkv_bias": model.attention_bias,  # GLM-4.5 / Qwen2-MoE: linear_qkv.bias
        }
    if model.transformer_impl == "te" and par.tensor_parallel > 1:
        # TE's MLA spec keeps linear_q/kv_down_proj duplicated over TP, the local spec splits them:
        # weights/megatron_shards.py maps the local layout only.
        raise ConfigError(
            "config key 'model.kv_lora_rank': MLA with model.transformer_impl=te and "
            f"parallel.tensor_parallel={par.tensor_parallel} is not mapped yet (TE duplicates the down "
            "projections over TP); use tensor_parallel=1 or the local spec"
        )
    yarn = model.rope_scaling_type == "yarn"
    return {
        "num_query_groups": model.num_attention_heads,  # MLA: every head has its own k and v
        "kv_channels": model.v_head_dim,  # the core attention's output width per head (mla_core_attention)
        "qk_layernorm": True,
        "q_lora_rank": model.q_lora_rank or None,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_head_dim": model.qk_nope_head_dim,
        "qk_pos_emb_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "rope_type": "yarn" if yarn else "rope",
        "rotary_base": model.rope_theta,
        "rotary_percent": 1.0,
        "rotary_scaling_factor": model.rope_scaling_factor if yarn else 1.0,
        "original_max_position_embeddings": model.rope_original_max_position if yarn else model.max_seq_len,
        "beta_fast": model.rope_beta_fast,
        "beta_slow": model.rope_beta_slow,
        "mscale": model.rope_mscale,
        "mscale_all_dim": model.rope_mscale_all_dim if yarn else 0.0,
    }


def _precision(model: ModelConfig, bf16: bool) -> dict:
    """dtype, kernels and FP8 fields; model.precision / transformer_impl decide (learner/te_spec.py)."""
    from moe_rl.learner.te_spec import precision_kwargs

    kw = {
        "moe_grouped_gemm": False,  # grouped GEMM needs CUDA kernels; the TE spec brings its own
        "params_dtype": torch.bfloat16 if bf16 else torch.float32,
        "bf16": bf16,
    }
    kw.update(precision_kwargs(model))  # moe_router_fusion is always False: it would bypass replay
    return kw


def _pipeline(model: ModelConfig, par: ParallelConfig, bf16: bool) -> dict:
    """PP > 1: the dtype of the hidden states sent between stages, per-micro-batch shapes
    (micro-batches are trimmed to their own longest sequence: the stages exchange shapes first)
    and uneven first/last stages."""
    if par.pipeline_parallel == 1:
        return {}
    uneven = {}  # megatron takes None for "an even split"
    if par.layers_in_first_stage:
        uneven["num_layers_in_first_pipeline_stage"] = par.layers_in_first_stage
    if par.layers_in_last_stage:
        uneven["num_layers_in_last_pipeline_stage"] = par.layers_in_last_stage
    return {
        "pipeline_dtype": torch.bfloat16 if bf16 or model.precision != "fp32" else torch.float32,
        "variable_seq_lengths": True,
        **uneven,
    }


def _recompute(model: ModelConfig) -> dict:
    """Full activation recomputation, one layer per checkpoint (routes are served again on it)."""
    if not model.recompute:
        return {}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def build_model(
    model: ModelConfig, par: ParallelConfig, *, bf16: bool = False, sequence_parallel: bool = False
):
    """A megatron GPTModel with MoE layers: the local layer spec (CPU), or TE's (model.transformer_impl=te).

    With PP > 1 this rank's pipeline stage only: the embedding on the first, the final norm and
    output layer on the last (megatron numbers the stage's layers from its offset)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from moe_rl.learner.te_spec import layer_spec

    check_tied_embeddings(model, par)  # also for a Learner built without a RunConfig
    cfg = transformer_config(model, par, bf16=bf16, sequence_parallel=sequence_parallel)
    spec = layer_spec(cfg, use_te=model.transformer_impl == "te")
    if cfg.sequence_parallel:
        _swap_module(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    if model.mla and model.transformer_impl != "te":
        _swap_module(spec, DotProductAttention, mla_core_attention())
        _mla_module_without_te()
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_seq_len,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        # GLM-4.5's partial RoPE: megatron rotates the first int(kv_channels * rotary_percent) dims in
        # rotate_half layout with inv_freq over that dim, as transformers' Glm4Moe does (MLA: ignored)
        rotary_percent=model.partial_rotary_factor,
        # tied (GLM-4.5 tiny, many small models): the output layer reads the embedding matrix,
        # so autograd sums both uses' gradients into the one parameter (PP > 1 refused: layout.py)
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
    )
    add_frozen_expert_bias(gpt, model)
    return gpt, cfg


# DotProductAttention.__init__ of megatron-core 0.16.1 (checked before it is wrapped)
_DPA_PARAMS = (
    "self",
    "config",
    "layer_number",
    "attn_mask_type",
    "attention_type",
    "attention_dropout",
    "softmax_scale",
    "cp_comm_type",
    "pg_collection",
)


def mla_core_attention() -> type:
    """megatron's local DotProductAttention, taking the ``k_channels`` / ``v_channels`` that MLA passes.

    MLASelfAttention builds its core attention with k_channels (nope + rope) and v_channels (v head
    dim), which TE's attention accepts but the local DotProductAttention of megatron-core 0.16.1
    does not (TypeError). Its math is already head-dim generic (q.k over the last dim, the explicit
    softmax_scale MLA passes, value's own last dim); only its output reshape uses kv_channels, which
    the learner sets to v_head_dim for MLA (``_attention``). So this subclass checks both channel
    counts and drops them; the signature is checked first, so another megatron fails loudly."""
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = tuple(inspect.signature(DotProductAttention.__init__).parameters)
    if params != _DPA_PARAMS:
        raise RuntimeError(
            f"megatron-core's DotProductAttention.__init__{params} is not the 0.16.1 signature the MLA "
            f"wrapper (moe_rl/learner/build.py mla_core_attention) was written for: {_DPA_PARAMS}"
        )

    class MLADotProductAttention(DotProductAttention):
        # megatron's Attention base builds a core attention without channels first, then MLA its own
        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs) -> None:
            q_head = config.qk_head_dim + config.qk_pos_emb_head_dim
            if (k_channels, v_channels) != (None, None) and (
                k_channels != q_head
                or v_channels != config.kv_channels
                or kwargs.get("softmax_scale") is None
            ):
                raise RuntimeError(
                    f"MLA core attention: k_channels {k_channels} (expected {q_head}), v_channels "
                    f"{v_channels} (expected kv_channels {config.kv_channels}) and an explicit softmax_scale"
                )
            super().__init__(config, *args, **kwargs)

    return MLADotProductAttention


def _mla_module_without_te() -> None:
    """Without Transformer Engine, tell megatron's multi_latent_attention module so (HAVE_TE False).

    megatron-core 0.16.1's extensions/transformer_engine.py imports without TE by binding ``te`` to
    a MagicMock, so multi_latent_attention's ``try: import TELinear`` succeeds, sets HAVE_TE True and
    binds TELinear to a mock; MultiLatentAttention.__init__ then runs ``isinstance(linear_proj,
    TELinear)`` and raises TypeError. The flag only guards that TE-only FP8 branch. Checked: the
    module's TELinear is a mock (not a class) and TE really does not import; anything else is left
    alone, and the change is logged."""
    import logging

    from megatron.core.transformer import multi_latent_attention as mla

    from moe_rl.learner.te_spec import te_import_error

    if not getattr(mla, "HAVE_TE", False) or isinstance(getattr(mla, "TELinear", None), type):
        return
    if te_import_error() is None:
        raise RuntimeError("megatron's MLA module holds a mock TELinear although Transformer Engine imports")
    mla.HAVE_TE = False
    logging.getLogger(__name__).info("megatron multi_latent_attention: HAVE_TE set False (TE not installed)")


class SequenceParallelTorchNorm:
    """megatron's WrappedTorchNorm (torch RMSNorm) under sequence parallelism.

    WrappedTorchNorm asserts sequence_parallel off only because a plain torch norm does not mark
    its weight ``sequence_parallel``: the mark is what makes finalize_model_grads sum the weight's
    gradient over the TP ranks (each saw only its block of positions). TE's and apex's norms set
    it; this sets it on the torch norm, so the local (CPU) spec can train with TP."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False  # only WrappedTorchNorm's assertion reads this copy
        norm = WrappedTorchNorm(plain, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def _swap_module(spec, old: type, new: type) -> None:
    """Replace ``old`` by ``new`` wherever a (nested) megatron spec names it, in place."""
    if isinstance(spec, (list, tuple)):
        for item in spec:
            _swap_module(item, old, new)
        return
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if value is old:
            setattr(spec, f.name, new)
        else:
            _swap_module(value, old, new)


def wrap_ddp(gpt, cfg, par: ParallelConfig):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=par.distributed_optimizer,
        bucket_size=None,
        check_for_nan_in_grad=True,  # raise before the optimizer step, never train on NaN/Inf
    )
    return DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=gpt)


def build_optimizer(ddp_model, opt: OptimConfig, par: ParallelConfig, *, bf16: bool = False):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = bf16 or bool(getattr(getattr(ddp_model, "config", None), "bf16", False))  # model.precision
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        use_distributed_optimizer=par.distributed_optimizer,
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        **cpu_adam_fields(opt, OptimizerConfig),
    )
    return get_megatron_optimizer(ocfg, [ddp_model])


# megatron-core's CPU-offloaded optimizer, as slime and verl run it for the largest models
_CPU_ADAM = {
    "optimizer_cpu_offload": True,
    "optimizer_offload_fraction": 1.0,  # every parameter's Adam step on the host
    "overlap_cpu_optimizer_d2h_h2d": True,
    "use_precision_aware_optimizer": True,
}


def cpu_adam_fields(opt: OptimConfig, optimizer_config: type) -> dict:
    """``optim.cpu_adam``: megatron-core's HybridDeviceOptimizer (optimizer/cpu_offloading) holds
    the fp32 main params and Adam's state on the host and steps them there (torch's AdamW).

    CUDA and Transformer Engine only (untested on GPU): its constructor builds CUDA streams
    (``torch.cuda.current_stream`` in ``_init_sub_optimizers``) and offloads only ``is_cuda``
    parameters, so on CPU-only torch it fails with "Torch not compiled with CUDA enabled"; and
    OptimizerConfig's check of ``use_precision_aware_optimizer`` (which peers set with it) compares
    TE's version, a TypeError without TE. Preflight refuses the key in both cases
    (moe_rl/preflight.py check_devices; docs/gpu_stack.md 7.2). The fields are checked to exist in
    this megatron-core."""
    if not opt.cpu_adam:
        return {}
    known = {f.name for f in dataclasses.fields(optimizer_config)}
    missing = sorted(set(_CPU_ADAM) - known)
    if missing:
        raise RuntimeError(f"optim.cpu_adam: this megatron-core's OptimizerConfig lacks {missing}")
    return dict(_CPU_ADAM)
