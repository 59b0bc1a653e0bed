"""Policy losses: the PPO clipped surrogate, KL estimators, and token-sum aggregation.

Pure tensor functions (math.md sections 2.1, 2.4; verl ``compute_policy_loss_vanilla``): no
torch.distributed, no ``.item()``, no config objects. The cross-rank normaliser is an argument.

Shape suffixes: B sequences, S padded sequence length.

Aggregation: a loss is ``sum over loss tokens of the per-token loss / normalizer``, where the caller
passes ``normalizer`` = the number of loss tokens of the whole minibatch, over all micro-batches and
all data-parallel ranks (TitanRL ``global_valid_tokens``). Summing these losses over micro-batches
(gradient accumulation) and over ranks (the DP gradient all-reduce must then SUM, not average) gives
the global token-mean, however the minibatch was split.

Metrics follow ``moe_rl.metrics``: local ``Mean(sum, count)`` over loss tokens, ``Max``/``Min``.
"""

from __future__ import annotations

import torch

from moe_rl.metrics import Max, Mean, MetricValue, Min

SAFETY_BOUND = 20.0  # |log ratio| clamp before exp or any KL estimator (verl SAFETY_BOUND)
KL_KINDS = ("k1", "k2", "k3")


def log_ratio(num_logp_BS: torch.Tensor, den_logp_BS: torch.Tensor) -> torch.Tensor:
    """log(p_num / p_den) = num - den per token, clamped to [-20, 20] so exp() stays finite."""
    return (num_logp_BS - den_logp_BS).clamp(-SAFETY_BOUND, SAFETY_BOUND)


def kl_estimate(logp_BS: torch.Tensor, ref_logp_BS: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref), for tokens sampled from pi (Schulman 2020).

    With log r = log(ref / pi) = ref_logp - logp, clamped to +-20:
        k1 = -log r                 unbiased, high variance, either sign per token
        k2 = (log r)^2 / 2          biased (KL to second order), >= 0
        k3 = r - 1 - log r          unbiased, >= 0, low variance
    (This is math.md's estimator family with (pi_roll, pi_theta) replaced by (pi, ref).)

    Args:
        logp_BS: log pi of the sampled tokens (the policy being trained; gradients flow).
        ref_logp_BS: log ref of the same tokens (detached inside).
        kind: "k1" | "k2" | "k3".
    Returns:
        kl_BS, same shape; unmasked (the caller masks and aggregates).
    """
    lr_BS = log_ratio(ref_logp_BS.detach(), logp_BS)
    if kind == "k1":
        return -lr_BS
    if kind == "k2":
        return 0.5 * lr_BS * lr_BS
    if kind == "k3":
        return torch.expm1(lr_BS) - lr_BS
    raise ValueError(f"unknown KL estimator {kind!r}; known: {list(KL_KINDS)}")


def _check_normalizer(normalizer: float | torch.Tensor) -> None:
    if not isinstance(normalizer, torch.Tensor) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")


def _ppo_metrics(pg_sum: torch.Tensor, lr_BS: torch.Tensor, clipped_BS: torch.Tensor,
                 loss_mask_BS: torch.Tensor) -> dict[str, MetricValue]:
    """Local sums/counts over loss tokens (all inputs detached; clipped_BS bool)."""
    keep_BS = loss_mask_BS.bool()
    mask_BS = keep_BS.to(lr_BS.dtype)
    num_tokens = mask_BS.sum()
    ratio_BS = torch.exp(lr_BS)
    inf = torch.tensor(float("inf"), dtype=ratio_BS.dtype, device=ratio_BS.device)
    return {
        "train/pg_loss": Mean(pg_sum, num_tokens),
        "train/pg_clipfrac": Mean((clipped_BS.to(mask_BS.dtype) * mask_BS).sum(), num_tokens),
        "train/ppo_kl": Mean((-lr_BS * mask_BS).sum(), num_tokens),
        "train/ratio_mean": Mean((ratio_BS * mask_BS).sum(), num_tokens),
        "train/ratio_max": Max(torch.where(keep_BS, ratio_BS, -inf).amax()),
        "train/ratio_min": Min(torch.where(keep_BS, ratio_BS, inf).amin()),
    }


def ppo_clip_loss(
    logp_BS: torch.Tensor,
    old_logp_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    normalizer: float | torch.Tensor,
    ref_logp_BS: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    is_weights_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """PPO clipped surrogate with asymmetric clip, token-sum / normalizer, plus an optional KL term.

    Per token, with ratio = exp(clamp(logp - old_logp, +-20)):
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        loss = sum_t m_t * (w_t * pg_t + kl_coef * kl_t) / normalizer
    where w_t are optional IS weights (detached; 1 when None) and kl_t = kl_estimate(logp, ref).

    Args:
        logp_BS: float [B, S] log pi_theta of the taken tokens (gradients flow here only).
        old_logp_BS: float [B, S] log pi_old (or pi_rollout in bypass mode); detached inside.
        advantages_BS: float [B, S]; detached inside.
        loss_mask_BS: bool or 0/1 [B, S], the tokens that count.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        normalizer: float > 0 or 0-dim tensor: the global number of loss tokens of the minibatch
            (all micro-batches and ranks), so summed micro-batch/rank losses are the token-mean.
        ref_logp_BS: float [B, S] log pi_ref; needed when kl_coef > 0. When given with
            kl_coef == 0 only the metric is computed.
        kl_coef, kl_kind: weight and estimator ("k1" | "k2" | "k3") of the KL(pi || ref) term.
        is_weights_BS: float [B, S] rollout-correction IS weights multiplying the PG term; the
            stop-gradient is applied here (math.md 2.1).
    Returns:
        loss: 0-dim tensor; metrics: ``train/pg_loss`` (the IS-weighted PG term, per token),
        ``train/pg_clipfrac`` (share of loss tokens where the clipped branch is strictly larger,
        so it carries no gradient),
        ``train/ppo_kl`` (mean of old_logp - logp, k1 of KL(old || new)), ``train/ratio_mean``,
        ``train/ratio_max``, ``train/ratio_min``, and ``train/kl_ref`` when ref_logp_BS is given.
    """
    _check_normalizer(normalizer)
    if kl_coef > 0 and ref_logp_BS is None:
        raise ValueError("kl_coef > 0 needs ref_logp_BS")
    mask_BS = loss_mask_BS.to(logp_BS.dtype)
    adv_BS = advantages_BS.detach().to(logp_BS.dtype)
    lr_BS = log_ratio(logp_BS, old_logp_BS.detach())
    ratio_BS = torch.exp(lr_BS)
    pg_unclipped_BS = -adv_BS * ratio_BS
    pg_clipped_BS = -adv_BS * ratio_BS.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_BS = torch.maximum(pg_unclipped_BS, pg_clipped_BS)
    weighted_pg_BS = pg_BS if is_weights_BS is None else pg_BS * is_weights_BS.detach()
    loss_sum = (weighted_pg_BS * mask_BS).sum()

    metrics = _ppo_metrics(loss_sum.detach(), lr_BS.detach(), (pg_clipped_BS > pg_unclipped_BS).detach(),
                           loss_mask_BS)
    if ref_logp_BS is not None:
        kl_BS = kl_estimate(logp_BS, ref_logp_BS, kl_kind)
        kl_sum = (kl_BS * mask_BS).sum()
        metrics["train/kl_ref"] = Mean(kl_sum.detach(), metrics["train/pg_loss"].count)
        if kl_coef > 0:
            loss_sum = loss_sum + kl_coef * kl_sum
    return loss_sum / normalizer, metrics
