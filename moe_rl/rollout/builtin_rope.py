"""The built-in engine's rotary position embeddings (``builtin_model.py``): RoPE tables in fp32,
YaRN frequency scaling and its attention-scale correction, and their application to the rotary
part of each head (partial rotary for GLM-4.5, decoupled rope dims for MLA).

Shape suffix legend: B sequences, T tokens, N heads, D head dim, R rotary dims.
"""

from __future__ import annotations

import math

import torch

from moe_rl.config import ModelConfig


def rope_cos_sin(
    positions_BT: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [B, T, D] for non-interleaved (rotate_half) RoPE over the full head dim."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions_BT.device) / head_dim)
    )
    return _cos_sin(positions_BT, inv_freq, 1.0)


def rotary_dim(cfg: ModelConfig) -> int:
    """Dims of each q/k head that RoPE rotates: MLA's rope part, else the partial share of head_dim
    (GLM-4.5: int(head_dim * partial_rotary_factor), as transformers and megatron's rotary_percent)."""
    return cfg.qk_rope_head_dim if cfg.mla else int(cfg.head_dim * cfg.partial_rotary_factor)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extrapolating)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """inv_freq [R/2] fp32 and the factor cos/sin are multiplied by (YaRN's attention factor, else 1).

    YaRN as DeepSeek-V3 uses it (transformers ``_compute_yarn_parameters``, megatron-core
    ``YarnRotaryEmbedding``): frequencies below the correction range are interpolated by
    ``rope_scaling_factor``, those above kept, a linear ramp between (bounds floored/ceiled)."""
    R, base = rotary_dim(cfg), cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, R, 2, dtype=torch.float32, device=device) / R)
    if cfg.rope_scaling_type == "none":
        return 1.0 / pos_freqs, 1.0
    factor, orig = cfg.rope_scaling_factor, cfg.rope_original_max_position

    def correction_dim(rotations: float) -> float:
        return (R * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), R - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(R // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, cfg.rope_mscale) / yarn_get_mscale(
            factor, cfg.rope_mscale_all_dim
        )
    else:
        attention_factor = yarn_get_mscale(factor)
    return inv_freq, attention_factor


def rope_tables(positions_BT: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [B, T, R] of the model's RoPE (R = rotary_dim; YaRN's factor folded in)."""
    inv_freq, factor = rope_frequencies(cfg, positions_BT.device)
    return _cos_sin(positions_BT, inv_freq, factor)


def _cos_sin(
    positions_BT: torch.Tensor, inv_freq: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs_BTd = positions_BT.float()[..., None] * inv_freq
    emb_BTR = torch.cat((freqs_BTd, freqs_BTd), dim=-1)
    return emb_BTR.cos() * factor, emb_BTR.sin() * factor


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(q-k head dim); MLA under YaRN also times mscale(factor, mscale_all_dim)^2 (DeepSeek-V3)."""
    if not cfg.mla:
        return cfg.head_dim**-0.5
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling_type == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_get_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def apply_rope(
    x_BNTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first R = cos.shape[-1] dims (x * cos + rotate_half(x) * sin), pass the rest; in
    fp32 (positions must not lose bits in bf16), cast back.

    ``interleaved``: the rotated dims hold (x0, x1), (x2, x3) pairs (DeepSeek-V3's rope_interleave,
    megatron's MLA): they are de-interleaved to (x0, x2, ..., x1, x3, ...) first, so the result is
    in rotate_half layout, as transformers and megatron both return it (q and k alike: q.k is
    unchanged by the permutation)."""
    xf = x_BNTD.float()
    R = cos_BTR.shape[-1]
    rot, passed = xf[..., :R], xf[..., R:]
    if interleaved:
        rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
    half = R // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos_BTR[:, None] + rotated * sin_BTR[:, None]
    return torch.cat((out, passed), dim=-1).to(x_BNTD.dtype)
