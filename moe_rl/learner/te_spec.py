"""Transformer Engine for the learner: the TE layer spec, FP8 settings, TE <-> local parameter names.

The ONLY module that imports ``transformer_engine`` (tests/test_style.py). Everything except
``require_te`` / ``layer_spec`` is pure and runs on CPU, so it is unit-tested without TE:

- ``precision_kwargs``: model.transformer_impl / precision / fp8_recipe / fp8_format -> the
  megatron-core ``TransformerConfig`` fields (``transformer_impl``, ``bf16``, ``fp8``, ``fp8_recipe``,
  ``moe_grouped_gemm``). megatron-core then opens TE's FP8 autocast around each layer itself
  (``fp8_utils.get_fp8_context``), so no FP8 context is opened here. ``moe_router_fusion`` is always
  False: TE's fused top-k returns before ``RouterReplay`` and would silently bypass routing replay.
- ``check_te_environment``: TE or FP8 without CUDA / TE / a new enough TE -> ConfigError saying why.
- ``te_name_map``: TE-spec parameter names -> local-spec names, so ``weights/megatron_shards.py``
  (written for the local spec) serves the TE model too. TE fuses the pre-attention RMSNorm into
  ``linear_qkv`` (``linear_qkv.layer_norm_weight``), the pre-MLP RMSNorm of dense layers into
  ``linear_fc1`` (``linear_fc1.layer_norm_weight``; MoE layers keep a separate
  ``pre_mlp_layernorm``), and ``TEGroupedMLP`` stores expert j as ``experts.linear_fc1.weight{j}``.
  Shapes and layouts are identical on both sides (megatron ``models/gpt/gpt_layer_specs.py``,
  ``extensions/transformer_engine_spec_provider.py``, ``transformer/moe/experts.py``, 0.16.1).
"""

from __future__ import annotations

import inspect
import re
from importlib import metadata

import torch
from packaging.version import Version

from moe_rl.config import ConfigError, ModelConfig

# Oldest TE each FP8 recipe needs in megatron-core's get_fp8_recipe (fp8_utils.py, 0.16.1 = 0.19.2;
# docs/gpu_stack.md 3). MoE FP8 needs TE >= 1.7 and FP8 grouped GEMM >= 1.11 (TransformerConfig checks).
FP8_MIN_TE = {"delayed": "1.11.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0"}
BLOCKWISE_MIN_CUDA = "12.9"  # Float8BlockScaling kernels (docs/gpu_stack.md 3)
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards
FP8_TOKEN_MULTIPLE = 16  # TE FP8 GEMMs need the token count (S * B) to be a multiple of 16


# --------------------------------------------------------------------------------------------
# Precision -> megatron TransformerConfig fields (pure)
# --------------------------------------------------------------------------------------------


def precision_kwargs(model: ModelConfig) -> dict:
    """The TransformerConfig fields that model.transformer_impl / precision choose.

    fp32 on the local spec adds nothing (the CPU default). bf16 and fp8 keep bf16 params (the
    optimizer keeps fp32 main params); fp8 runs TE's linears in FP8 under megatron's own context."""
    out: dict = {"moe_router_fusion": False}  # never: the fused TE top-k bypasses routing replay
    if model.transformer_impl == "te":
        # TEGroupedMLP: one grouped GEMM per expert projection (and FP8 padding per expert inside)
        out.update(transformer_impl="transformer_engine", moe_grouped_gemm=True)
    if model.precision in ("bf16", "fp8"):
        out.update(bf16=True, params_dtype=torch.bfloat16)
    if model.precision == "fp8":
        out.update(fp8=model.fp8_format, fp8_recipe=model.fp8_recipe)
    return out


def uses_te(model: ModelConfig) -> bool:
    return model.transformer_impl == "te"


# --------------------------------------------------------------------------------------------
# Environment checks (run when a run starts: moe_rl.preflight.check_launch)
# --------------------------------------------------------------------------------------------


def te_version() -> Version | None:
    """The installed TE version from package metadata (no import: importing a broken TE raises)."""
    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return Version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


def te_import_error() -> str | None:
    """None when ``transformer_engine.pytorch`` imports, else why not. The empty meta wheel raises
    RuntimeError, not ImportError (docs/gpu_stack.md 3), so both are caught."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, RuntimeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def te_problems(
    model: ModelConfig,
    *,
    cuda: bool,
    capability: tuple[int, int] | None,
    cuda_version: str | None,
    te_ver: Version | None,
    te_error: str | None,
) -> list[str]:
    """Why this machine cannot run ``model``'s transformer_impl / precision (pure; [] = it can)."""
    key = "model.precision" if model.precision == "fp8" else "model.transformer_impl"
    if not uses_te(model):
        return []
    what = (
        "FP8 needs Hopper-class (sm_89+) GPUs and Transformer Engine"
        if model.precision == "fp8"
        else "the Transformer Engine layer spec needs CUDA and Transformer Engine"
    )
    if not cuda:
        return [
            (
                f"config key '{key}': {what}; this machine has no CUDA device "
                f"(use model.transformer_impl=local model.precision=fp32 on CPU)"
            )
        ]
    if te_error is not None:
        return [
            (
                f"config key '{key}': {what}; transformer_engine.pytorch does not import ({te_error}). "
                f"Install moe-rl[te] against the CUDA torch, with --no-build-isolation"
            )
        ]
    problems = []
    if model.precision == "fp8":
        if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
            problems.append(
                f"config key 'model.precision': fp8 needs compute capability >= 8.9, this GPU is "
                f"sm_{capability[0]}{capability[1]}"
            )
        need = Version(FP8_MIN_TE[model.fp8_recipe])
        if te_ver is not None and te_ver < need:
            problems.append(
                f"config key 'model.fp8_recipe': {model.fp8_recipe} needs Transformer Engine >= "
                f"{need}, installed {te_ver}"
            )
        if (
            model.fp8_recipe == "blockwise"
            and cuda_version
            and Version(cuda_version) < Version(BLOCKWISE_MIN_CUDA)
        ):
            problems.append(
                f"config key 'model.fp8_recipe': blockwise needs CUDA >= {BLOCKWISE_MIN_CUDA}, "
                f"torch is built for {cuda_version}"
            )
    return problems


def check_te_environment(model: ModelConfig) -> None:
    """Raise ConfigError when this machine cannot run ``model``'s transformer_impl / precision."""
    if not uses_te(model):
        return
    cuda = torch.cuda.is_available()
    problems = te_problems(
        model,
        cuda=cuda,
        capability=torch.cuda.get_device_capability() if cuda else None,
        cuda_version=torch.version.cuda,
        te_ver=te_version(),
        te_error=te_import_error() if cuda else None,
    )
    if problems:
        raise ConfigError("; ".join(problems))


# --------------------------------------------------------------------------------------------
# The layer spec
# --------------------------------------------------------------------------------------------


def require_te() -> None:
    """Import TE before megatron's TE extension does, so a missing TE is one clear error."""
    err = te_import_error()
    if err is not None:
        raise ConfigError(f"config key 'model.transformer_impl': te needs Transformer Engine: {err}")


def layer_spec(tcfg, use_te: bool):
    """megatron's decoder block spec, TE or local. ``get_gpt_decoder_block_spec(config,
    use_transformer_engine, normalization=...)`` has this shape in megatron-core 0.16.1..0.19.x;
    a different signature fails loudly instead of building the wrong model."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    params = list(inspect.signature(get_gpt_decoder_block_spec).parameters)
    if params[:2] != ["config", "use_transformer_engine"] or "normalization" not in params:
        raise RuntimeError(
            f"megatron-core's get_gpt_decoder_block_spec{tuple(params)} is not the "
            f"(config, use_transformer_engine, normalization, ...) signature moe_rl supports"
        )
    if use_te:
        require_te()
    return get_gpt_decoder_block_spec(tcfg, use_transformer_engine=use_te, normalization="RMSNorm")


# --------------------------------------------------------------------------------------------
# TE <-> local parameter names (pure)
# --------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^(decoder\.layers\.\d+\.)(.+)$")
_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc1|linear_fc2)\.weight(\d+)$")
_TE_ONLY = {  # TE suffix -> local suffix (within one layer)
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",  # dense layers only
    # MLA: TE fuses the latent norms into the up projections (gpt_layer_specs.py, 0.16.1; untested on GPU)
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


def te_to_local_name(name: str) -> str:
    """One TE-spec parameter name as the local spec names the same tensor (unchanged if shared).

    Raises KeyError for TE parameters with no local counterpart (biases of fused norms, the legacy
    ``GroupedMLP`` weight1/weight2 whose layout differs)."""
    m = _LAYER.match(name)
    if m is None:
        return name
    pre, rest = m.groups()
    if rest in _TE_ONLY:
        return pre + _TE_ONLY[rest]
    g = _GROUPED.match(rest)
    if g is not None:
        return f"{pre}mlp.experts.local_experts.{int(g.group(2))}.{g.group(1)}.weight"
    if rest.endswith("layer_norm_bias") or rest in ("mlp.experts.weight1", "mlp.experts.weight2"):
        raise KeyError(
            f"TE parameter {name!r} has no local-spec counterpart (RMSNorm has no bias; the "
            f"legacy GroupedMLP is not supported: use TE >= 1.7 for TEGroupedMLP)"
        )
    return name


def te_name_map(te_names: list[str]) -> dict[str, str]:
    """TE name -> local name for every parameter of a TE model; one-to-one or KeyError.

    Usage with the local-spec mapping (``weights/megatron_shards.py``):
        m = te_name_map(list(params));  canonical_to_megatron(full, [m[n] for n in params], ...)
        megatron_to_canonical({m[n]: p for n, p in params.items()}, ...)"""
    out = {n: te_to_local_name(n) for n in te_names}
    seen: dict[str, str] = {}
    for te, local in out.items():
        if local in seen:
            raise KeyError(f"TE parameters {seen[local]!r} and {te!r} both map to {local!r}")
        seen[local] = te
    return out


def rename_to_local(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A TE model's named tensors under local-spec names (same tensors, no copy)."""
    m = te_name_map(list(named))
    return {m[n]: t for n, t in named.items()}
