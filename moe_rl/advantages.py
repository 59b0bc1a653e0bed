"""Advantage estimators: pure tensor functions behind one registry (verl ``register_adv_est`` pattern).

Shape suffixes: B sequences, S padded sequence length, G prompt groups.

Every estimator has the signature

    fn(rewards_B, group_B, response_mask_BS, *, std_norm: bool = ..., eps: float = ...)
        -> (advantages_BS, metrics)

- rewards_B: float [B], one scalar reward per sequence.
- group_B: int64 [B], the prompt each sequence answers. Ids need not be contiguous or sorted;
  a group must be complete in the batch passed in (the caller keeps groups on one rank).
- response_mask_BS: bool or 0/1 [B, S], true on response tokens.
- advantages_BS: float32 [B, S], the sequence advantage on its response tokens, 0 elsewhere.
- metrics: the ``moe_rl.metrics`` convention (``Mean``/``Std`` of local sums over response tokens),
  so the caller can reduce them across ranks whichever way the batch was split.

Estimators that need more inputs (e.g. the Optimal Token Baseline, math.md section 6, which needs
per-token old log-probs and sum_v pi^2) take them as extra keyword-only arguments passed by name.
Names are checked against ``ADVANTAGES`` when the config loads (``get_advantage``).
"""

from __future__ import annotations

from typing import Callable

import torch

from moe_rl.metrics import Mean, MetricValue, Std
from moe_rl.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, dict[str, MetricValue]]]

ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.lookup


def _group_stats(rewards_B: torch.Tensor, group_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sequence views of group statistics, vectorised over groups with index_add/scatter_reduce.

    Returns float64 tensors (exact sums): r_B the rewards; count_B, sum_B, mean_B, sq_dev_B (sum of
    squared deviations from the mean) of the sequence's group; const_B (bool) all rewards of the
    group are equal; num_groups and num_const_groups (0-dim).
    """
    r_B = rewards_B.detach().to(torch.float64)
    ids_G, index_B = torch.unique(group_B, return_inverse=True)
    zeros_G = torch.zeros(ids_G.shape[0], dtype=torch.float64, device=r_B.device)
    count_G = zeros_G.index_add(0, index_B, torch.ones_like(r_B))
    sum_G = zeros_G.index_add(0, index_B, r_B)
    mean_B = (sum_G / count_G)[index_B]
    sq_dev_G = zeros_G.index_add(0, index_B, (r_B - mean_B) ** 2)
    max_G = zeros_G.scatter_reduce(0, index_B, r_B, reduce="amax", include_self=False)
    min_G = zeros_G.scatter_reduce(0, index_B, r_B, reduce="amin", include_self=False)
    const_G = max_G == min_G
    return {
        "r_B": r_B, "count_B": count_G[index_B], "sum_B": sum_G[index_B], "mean_B": mean_B,
        "sq_dev_B": sq_dev_G[index_B], "const_B": const_G[index_B],
        "num_groups": torch.full((), ids_G.shape[0], dtype=torch.float64, device=r_B.device),
        "num_const_groups": const_G.sum().to(torch.float64),
    }


def _broadcast_and_metrics(adv_B: torch.Tensor, response_mask_BS: torch.Tensor,
                           stats: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    mask_BS = response_mask_BS.to(torch.float64)
    adv_BS = adv_B[:, None] * mask_BS
    num_tokens = mask_BS.sum()
    metrics: dict[str, MetricValue] = {
        "adv/mean": Mean(adv_BS.sum(), num_tokens),
        "adv/std": Std(adv_BS.sum(), (adv_BS * adv_BS).sum(), num_tokens),
        "adv/zero_std_group_frac": Mean(stats["num_const_groups"], stats["num_groups"]),
    }
    return adv_BS.to(torch.float32), metrics


@register_advantage("grpo")
def grpo(rewards_B: torch.Tensor, group_B: torch.Tensor, response_mask_BS: torch.Tensor, *,
         std_norm: bool = True, eps: float = 1e-6) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """GRPO group-normalised advantage: A_i = (r_i - mean_g) [/ (std_g + eps) if std_norm].

    std_g is the *unbiased* (Bessel, n - 1) group std, as torch.std in verl and TRL. A group whose
    rewards are all equal (including a group of one) gets exactly 0, whatever the rounding of its
    mean. See the module docstring for shapes and metrics.
    """
    s = _group_stats(rewards_B, group_B)
    dev_B = s["r_B"] - s["mean_B"]
    if std_norm:
        std_B = (s["sq_dev_B"] / (s["count_B"] - 1).clamp(min=1)).sqrt()
        dev_B = dev_B / (std_B + eps)
    adv_B = torch.where(s["const_B"], torch.zeros_like(dev_B), dev_B)
    return _broadcast_and_metrics(adv_B, response_mask_BS, s)


@register_advantage("rloo")
def rloo(rewards_B: torch.Tensor, group_B: torch.Tensor, response_mask_BS: torch.Tensor, *,
         std_norm: bool = False, eps: float = 1e-6) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """RLOO: A_i = r_i - mean_{j != i, j in g} r_j = n/(n-1) * (r_i - mean_g).

    ``std_norm`` and ``eps`` are accepted so all estimators share one signature; RLOO ignores them
    (its baseline is unnormalised by definition). A group of one, or of equal rewards, gets 0.
    """
    del std_norm, eps
    s = _group_stats(rewards_B, group_B)
    loo_mean_B = (s["sum_B"] - s["r_B"]) / (s["count_B"] - 1).clamp(min=1)
    adv_B = torch.where(s["const_B"], torch.zeros_like(loo_mean_B), s["r_B"] - loo_mean_B)
    return _broadcast_and_metrics(adv_B, response_mask_BS, s)
