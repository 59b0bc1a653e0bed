"""Plant real-LLM-like activation outliers in canonical weights without changing the function.

Real LLMs have activation channels far larger than the rest, which a 128-wide warm start of 80 SFT
steps does not: outlier features after the norm (LLM.int8(), SmoothQuant: a few channels 20-100x
the rest) and massive activations (Sun et al. 2024: up to about 1e4x the median, made in an MLP's
down_proj input). They matter most to per-tensor FP8, whose one activation scale is set by the
largest value (docs/collapse_lab.md 4). Two rescalings reproduce them in any canonical checkpoint:

- ``norm``: channel d of a layer's RMSNorm weight times ``alpha``, and input column d of every
  linear layer that reads that normed input (attention q/k/v or MLA's q_a / q / kv_a; the router,
  the Qwen2-MoE shared-expert gate, the gate/up of the dense MLP, every expert and shared experts)
  times 1/alpha.
- ``down``: intermediate channel j of every SwiGLU MLP (dense, each routed expert, shared experts):
  the up_proj row j times ``alpha`` and the down_proj column j times 1/alpha.

``alpha`` is a power of two, so each product in the model is the same product scaled by an exact
power of two: every engine dtype (fp32, bf16) computes bit-identical logits unless a value leaves
the format's normal range, which :func:`plant_outliers` refuses. Quantizers (FP8) do see the
outliers: that is the point. Channels: ``n`` indices drawn by ``seed``, the same in every layer
(real outlier features sit in the same dimensions across layers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from moe_rl.config import ModelConfig

WHERE = ("norm", "down")
# who reads each normed input (canonical names after "model.layers.{i}.")
_NORM_READERS = {
    "input_layernorm": re.compile(r"self_attn\.(q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa)\.weight"),
    "post_attention_layernorm": re.compile(
        r"mlp\.(gate|shared_expert_gate|((experts\.\d+|shared_experts)\.)?(gate_proj|up_proj))\.weight"
    ),
}
_UP = re.compile(r"mlp\.((experts\.\d+|shared_experts)\.)?up_proj\.weight")
_FP32_TINY = torch.finfo(torch.float32).tiny  # bf16 has fp32's exponent range


def check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float)) and alpha > 0 and math.frexp(alpha)[0] == 0.5):
        raise ValueError(f"alpha must be a power of two (exact in bf16 and fp32), got {alpha}")


def outlier_channels(width: int, n: int, seed: int) -> torch.Tensor:
    """``n`` distinct channel indices in [0, width), drawn by ``seed``, ascending."""
    if not 1 <= n <= width:
        raise ValueError(f"channels must be in [1, {width}], got {n}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(width, generator=gen)[:n].sort().values


def plant_outliers(
    weights: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    alpha: float,
    where: str,
    n: int,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The planted copy of canonical ``weights`` (any float dtype, kept) and what was done:
    ``{"where", "alpha", "channels", "scaled_up", "scaled_down"}`` (tensor counts). Raises
    ValueError for a bad alpha/where/n, a layer without a reader, or a value pushed out of the
    normal float range (the function would no longer be exactly the same)."""
    check_alpha(alpha)
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")
    out = {k: v.clone() for k, v in weights.items()}
    up, down = {}, {}  # tensor name -> the dim whose planted channels are scaled by alpha | 1/alpha
    if where == "norm":
        ch_C = outlier_channels(cfg.hidden_size, n, seed)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            for norm, readers in _NORM_READERS.items():
                read = [k for k in out if k.startswith(p) and readers.fullmatch(k[len(p) :])]
                if not read:
                    raise ValueError(f"layer {i}: no linear layer reads {norm} (not a canonical checkpoint?)")
                up[p + norm + ".weight"] = 0
                down.update(dict.fromkeys(read, 1))
    else:
        widths = {k: w.shape[0] for k, w in out.items() if _UP.fullmatch(k.split(".", 3)[-1])}
        if not widths:
            raise ValueError("no SwiGLU up_proj in these weights (not a canonical checkpoint?)")
        ch_C = outlier_channels(min(widths.values()), n, seed)
        for k in widths:
            up[k] = 0
            down[k.replace("up_proj", "down_proj")] = 1
    for names, factor in ((up, float(alpha)), (down, 1.0 / alpha)):
        for k, dim in names.items():
            w = out[k]
            scaled = w.index_select(dim, ch_C) * factor
            nz = scaled[scaled != 0].abs()
            if nz.numel() and (not torch.isfinite(nz).all() or nz.min() < _FP32_TINY or nz.max() > 2.0**126):
                raise ValueError(f"{k}: alpha {alpha} pushes a value out of the normal float range")
            out[k] = w.index_copy(dim, ch_C, scaled)
    info = {
        "where": where,
        "alpha": alpha,
        "channels": ch_C.tolist(),
        "seed": seed,
        "scaled_up": len(up),
        "scaled_down": len(down),
    }
    return out, info
