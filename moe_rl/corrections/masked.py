"""Masked reductions into ``moe_rl.metrics`` values (local sums / counts / extrema), shared by the
correction modules. Empty selections give Mean(0, 0), Max(-inf), Min(+inf): the identities of the
cross-rank reduction."""

from __future__ import annotations

import torch

from moe_rl.metrics import Max, Mean, MetricValue, Min, Std


def inf_like(like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float("inf"), dtype=like.dtype, device=like.device)


def masked_max(x: torch.Tensor, keep: torch.Tensor) -> Max:
    return Max(torch.where(keep, x, -inf_like(x)).amax())


def masked_min(x: torch.Tensor, keep: torch.Tensor) -> Min:
    return Min(torch.where(keep, x, inf_like(x)).amin())


def masked_mean(x: torch.Tensor, keep: torch.Tensor) -> Mean:
    """Mean of x over kept entries (dropped entries may be inf / nan: selected away, not multiplied)."""
    x = torch.where(keep, x, torch.zeros_like(x))
    return Mean(x.sum(), keep.to(x.dtype).sum())


def masked_std(x: torch.Tensor, keep: torch.Tensor) -> Std:
    x = torch.where(keep, x, torch.zeros_like(x))
    return Std(x.sum(), (x * x).sum(), keep.to(x.dtype).sum())


def stats(prefix: str, x: torch.Tensor, keep: torch.Tensor, std: bool = False) -> dict[str, MetricValue]:
    """``{prefix}_mean``, ``_max``, ``_min`` (and ``_std``) of x over the kept entries."""
    out: dict[str, MetricValue] = {
        f"{prefix}_mean": masked_mean(x, keep),
        f"{prefix}_max": masked_max(x, keep),
        f"{prefix}_min": masked_min(x, keep),
    }
    if std:
        out[f"{prefix}_std"] = masked_std(x, keep)
    return out


def seq_valid(mask_BS: torch.Tensor) -> torch.Tensor:
    """bool [B]: the sequence has at least one response token."""
    return mask_BS.any(dim=-1)
