"""Blockwise FP8 for the rollout engine's linear layers (``rollout.quantization=fp8``).

DeepSeek-V3's recipe (vLLM's ``fp8_per_block``): weights in float8 e4m3 per 128x128 block with one
fp32 scale per block, activations in e4m3 per token and 128-channel group with a scale computed on
the fly (dynamic), scale = amax / 448 (448 is e4m3's largest finite value). The built-in engine
emulates it on any device with real float8 arithmetic: each value is divided by its block's scale,
cast to ``torch.float8_e4m3fn`` (round to nearest even), cast back and multiplied by the scale;
the matmul then runs on those dequantized values in the engine dtype (``rollout.dtype``).

Which tensors are quantized is ONE rule over canonical names (:func:`quantized`): the 2-D weights
of the linear projections of attention and of every SwiGLU MLP (dense, routed experts, shared
experts). The router weight, the expert bias, the shared-expert gate, embeddings, the LM head,
norms and biases stay in high precision; :func:`check_quantized_names` refuses, by name, a set
that contains a router, gate or expert bias (docs/vllm.md 9).

``rollout.fp8_granularity=tensor`` is vLLM's plain ``quantization="fp8"`` instead (online, from a bf16
checkpoint): one fp32 scale per weight *as vLLM holds it*, i.e. per merged layer (q/k/v share one
scale, as do gate/up; vLLM's ``scaled_fp8_quant`` over the merged ``qkv_proj`` / ``gate_up_proj``, and
per expert for the stacked experts' ``w13`` / ``w2``), and one dynamic scale per activation tensor
(amax over every token of the matmul's input: a token's rounding depends on its batch, as in vLLM).
``rollout.kv_cache_dtype=fp8_e4m3`` stores attention keys and values in e4m3 (:func:`fake_quant_kv`)
with vLLM's default scale 1.0 (no calibrated ``k_scale``/``v_scale`` in a bf16 checkpoint).

A dimension that 128 does not divide ends in a partial block (or group): it is padded with zeros
to the block size for the amax and cropped after, so an edge block's scale is its own real
elements' amax / 448, as DeepSeek's ``per_block_cast_to_fp8`` pads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # weight blocks BLOCK x BLOCK, activation groups 1 x BLOCK
# a block whose amax is below this is scaled as if it were this (an all-zero block stays zero)
MIN_AMAX = 1e-12
QUANTIZATIONS = ("none", "fp8")  # rollout.quantization
# rollout.quantize: which linear layers FP8 takes; experts = the routed experts' projections only
# (attention, dense MLPs and shared experts keep rollout.dtype), as an MoE-only FP8 checkpoint has
SCOPES = ("all_linear", "experts")
GRANULARITIES = ("block", "tensor")  # rollout.fp8_granularity
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # rollout.kv_cache_dtype (vLLM's names; auto: the engine dtype)
KV_SCALE = 1.0  # vLLM's k_scale / v_scale when the checkpoint has none (calculate_kv_scales off)
# vLLM merges these canonical projections into one weight, and per-tensor FP8 gives it ONE scale
MERGED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
MERGED["up_proj"] = "gate_up_proj"

# The linear projections whose ``.weight`` the rule quantizes (canonical module names: attention,
# MLA, and the SwiGLU of dense MLPs, routed experts and shared experts).
LINEAR_MODULES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
)
# What must never be quantized, whatever set is asked for: routing reads these, and a rounded
# router flips expert choices (NeMo-RL #3614).
HIGH_PRECISION_SUFFIXES = (
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    "mlp.shared_expert_gate.weight",
)


def quantized(name: str, scope: str = "all_linear") -> bool:
    """The rule: canonical tensor ``name`` is held in FP8 iff it is the weight of a linear
    projection inside a decoder layer (``LINEAR_MODULES``) and, with ``scope`` experts, of a
    routed expert (``model.layers.<i>.mlp.experts.<e>.``)."""
    if scope not in SCOPES:
        raise ValueError(f"FP8 scope {scope!r} is not one of {SCOPES}")
    parts = name.split(".")
    return (
        len(parts) >= 4
        and parts[:2] == ["model", "layers"]
        and parts[-1] == "weight"
        and parts[-2] in LINEAR_MODULES
        and (scope == "all_linear" or parts[3:5] == ["mlp", "experts"])
    )


def quantized_names(names: Iterable[str], scope: str = "all_linear") -> frozenset[str]:
    """The names of ``names`` the rule quantizes."""
    return frozenset(n for n in names if quantized(n, scope))


def is_expert(name: str) -> bool:
    """A routed expert's tensor (its matmuls read the experts' activation quantizer)."""
    return ".mlp.experts." in name


def check_quantized_names(names: Iterable[str]) -> None:
    """ValueError naming the first router, gate or expert-bias tensor in ``names``."""
    for name in sorted(names):
        if name.endswith(HIGH_PRECISION_SUFFIXES):
            raise ValueError(
                f"FP8 would quantize {name!r}: the router weight, the expert bias and the "
                f"shared-expert gate stay in high precision (they decide and weight the routes)"
            )


def _pad_to_block(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` zero-padded at the end of each dim in ``dims`` (negative indices) to a multiple of BLOCK."""
    pad = [0] * (2 * x.dim())
    for d in dims:  # F.pad lists the last dim first: (last_lo, last_hi, second_last_lo, ...)
        pad[2 * (-d - 1) + 1] = -x.shape[d] % BLOCK
    return F.pad(x, pad) if any(pad) else x


def _qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` through e4m3 with ``scale`` (broadcast): x / s -> e4m3 (nearest even) -> * s."""
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.float() * scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] as (e4m3 values [..., N, K], fp32 scales [..., ceil(N/128), ceil(K/128)]),
    one scale per 128x128 block (leading dims: stacked experts, each its own blocks)."""
    *lead, N, K = w.shape
    wp = _pad_to_block(w.float(), (-2, -1))
    nb, kb = wp.shape[-2] // BLOCK, wp.shape[-1] // BLOCK
    blocks = wp.reshape(*lead, nb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :N, :K]
    return q, scale.reshape(*lead, nb, kb)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``quantize_weight``'s (q, scale)."""
    *lead, N, K = q.shape
    qp = _pad_to_block(q.float(), (-2, -1))
    nb, kb = scale.shape[-2:]
    blocks = qp.reshape(*lead, nb, BLOCK, kb, BLOCK) * scale.reshape(*lead, nb, 1, kb, 1)
    return blocks.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :N, :K]


def fake_quant_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` through blockwise e4m3 and back, in ``w``'s dtype (what the engine computes with)."""
    return dequantize_weight(*quantize_weight(w)).to(w.dtype)


def quantize_in_place(weights: list[torch.Tensor]) -> tuple[float, float]:
    """Replace each tensor by its blockwise FP8 values (``fake_quant_weight``); returns the sum of
    their squared errors and the sum of their squares (the sync's relative error, squared, is the
    ratio). One tensor at a time: blocks are reshaped, never looped over."""
    sq_err = sq = 0.0
    for w in weights:
        q = fake_quant_weight(w)
        sq_err += float((q.float() - w.float()).pow(2).sum())
        sq += float(w.float().pow(2).sum())
        w.copy_(q)
    return sq_err, sq


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    """Activations ``x`` [..., K] through e4m3 per token and 128-channel group (dynamic scales:
    each group's own amax / 448), back in ``x``'s dtype."""
    K = x.shape[-1]
    xp = _pad_to_block(x.float(), (-1,))
    groups = xp.reshape(*xp.shape[:-1], xp.shape[-1] // BLOCK, BLOCK)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    return _qdq(groups, scale).reshape(xp.shape)[..., :K].to(x.dtype)


def fake_quant_act_tensor(x: torch.Tensor) -> torch.Tensor:
    """Activations ``x`` through e4m3 with ONE dynamic scale for the whole tensor (amax / 448 over
    every token and channel), back in ``x``'s dtype: vLLM's per-tensor dynamic activation scheme."""
    scale = x.float().abs().amax().clamp(min=MIN_AMAX) / E4M3_MAX
    return _qdq(x.float(), scale).to(x.dtype)


def merged_name(name: str) -> str:
    """The weight vLLM holds canonical ``name`` in (q/k/v -> qkv_proj, gate/up -> gate_up_proj);
    per-tensor FP8 gives every name of one merged weight the same scale."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in MERGED:
        parts[-2] = MERGED[parts[-2]]
    return ".".join(parts)


def quantize_tensor_in_place(named: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Per-tensor FP8 of ``named`` in place: one scale per merged weight (:func:`merged_name`),
    amax over all its parts / 448; returns (sum of squared errors, sum of squares) as
    :func:`quantize_in_place`. A loop over tensors (as ``quantize_in_place``), none over values."""
    amax: dict[str, torch.Tensor] = {}
    for name, w in named.items():
        a = w.float().abs().amax()
        key = merged_name(name)
        amax[key] = torch.maximum(amax[key], a) if key in amax else a
    sq_err = sq = 0.0
    for name, w in named.items():
        q = _qdq(w.float(), amax[merged_name(name)].clamp(min=MIN_AMAX) / E4M3_MAX)
        sq_err += float((q - w.float()).pow(2).sum())
        sq += float(w.float().pow(2).sum())
        w.copy_(q.to(w.dtype))
    return sq_err, sq


def fake_quant_kv(x: torch.Tensor) -> torch.Tensor:
    """Keys or values as an FP8 KV cache stores and reads them: x / KV_SCALE -> e4m3 -> * KV_SCALE,
    in ``x``'s dtype (values past +-448 saturate, as vLLM's scaled convert does)."""
    return _qdq(x.float(), torch.tensor(KV_SCALE)).to(x.dtype)


def identity(x: torch.Tensor) -> torch.Tensor:
    """The activation path of an unquantized engine."""
    return x
