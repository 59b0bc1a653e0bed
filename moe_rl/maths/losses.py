"""Policy losses: the PPO clipped surrogate (asymmetric and dual clip), decoupled PPO, KL
estimators, and token-sum aggregation.

Pure tensor functions (docs/math.md 2.1; verl ``compute_policy_loss_vanilla``): no
torch.distributed, no ``.item()``. The losses take their spec
(``moe_rl.maths.policy_specs.PolicyLossSpec``) and tensors; the cross-rank normaliser is an argument.
The losses that apply a rollout correction inside the loss (the bypass loss, and ``PolicyLoss``,
the micro-batch loss a step runs) live in ``moe_rl/corrections/corrected_loss.py``, above both.

Modes (docs/math.md 2.1):
- decoupled (3 policies): ``decoupled_ppo_loss``. Drift rollout -> old is corrected by IS weights
  and rejection masks computed once per batch from pi_old / pi_rollout (``moe_rl.corrections``),
  handed in as tensors; drift old -> theta by the PPO clip on r = pi_theta / pi_old. IS weights
  multiply OUTSIDE the clip.
- bypass (2 policies, pi_old := pi_rollout): ``moe_rl.corrections.corrected_loss.bypass_loss``.

Shape suffixes: B sequences, S padded sequence length.

Aggregation: a loss is ``sum over loss tokens of the per-token loss / normalizer``, where the caller
passes ``normalizer`` = the number of loss tokens of the whole minibatch, over all micro-batches and
all data-parallel ranks (TitanRL ``global_valid_tokens``). Summing these losses over micro-batches
(gradient accumulation) and over ranks (the DP gradient all-reduce must then SUM, not average) gives
the global token-mean, however the minibatch was split.

Metrics follow ``moe_rl.metrics``: local ``Mean(sum, count)`` over loss tokens, ``Max``/``Min``.

Layering (issue 41): maths/ imports neither ``moe_rl.corrections`` nor the config; the log-ratio
and KL-estimator helpers (``log_ratio``, ``kl_from_log_ratio``, ``SAFETY_BOUND``) live in
``moe_rl.maths.ratios``, which the corrections use too.
"""

from __future__ import annotations

import torch

from moe_rl.maths.policy_specs import PolicyLossSpec
from moe_rl.maths.ratios import kl_from_log_ratio, log_ratio
from moe_rl.metrics import Max, Mean, MetricValue, Min


def kl_estimate(logp_BS: torch.Tensor, ref_logp_BS: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref), for tokens sampled from pi (Schulman 2020).

    With log r = log(ref / pi) = ref_logp - logp, clamped to +-20:
        k1 = -log r                 unbiased, high variance, either sign per token
        k2 = (log r)^2 / 2          biased (KL to second order), >= 0
        k3 = r - 1 - log r          unbiased, >= 0, low variance
    (This is the estimator family of docs/math.md 1.2 with (pi_roll, pi_theta) replaced by (pi, ref).)

    Args:
        logp_BS: log pi of the sampled tokens (the policy being trained; gradients flow).
        ref_logp_BS: log ref of the same tokens (detached inside).
        kind: "k1" | "k2" | "k3".
    Returns:
        kl_BS, same shape; unmasked (the caller masks and aggregates).
    """
    return kl_from_log_ratio(log_ratio(ref_logp_BS.detach(), logp_BS), kind)


def check_normalizer(normalizer: float | torch.Tensor) -> None:
    if not isinstance(normalizer, torch.Tensor) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")


def ppo_metrics(
    pg_sum: torch.Tensor, log_ratio_BS: torch.Tensor, clipped_BS: torch.Tensor, loss_mask_BS: torch.Tensor
) -> dict[str, MetricValue]:
    """Local sums/counts over loss tokens (all inputs detached; clipped_BS bool)."""
    keep_BS = loss_mask_BS.bool()
    mask_BS = keep_BS.to(log_ratio_BS.dtype)
    num_tokens = mask_BS.sum()
    ratio_BS = torch.exp(log_ratio_BS)
    inf = torch.tensor(float("inf"), dtype=ratio_BS.dtype, device=ratio_BS.device)
    return {
        "train/pg_loss": Mean(pg_sum, num_tokens),
        "train/pg_clipfrac": Mean((clipped_BS.to(mask_BS.dtype) * mask_BS).sum(), num_tokens),
        "train/ppo_kl": Mean((-log_ratio_BS * mask_BS).sum(), num_tokens),
        "train/ratio_mean": Mean((ratio_BS * mask_BS).sum(), num_tokens),
        "train/ratio_max": Max(torch.where(keep_BS, ratio_BS, -inf).amax()),
        "train/ratio_min": Min(torch.where(keep_BS, ratio_BS, inf).amin()),
    }


def clipped_surrogate(
    log_ratio_BS: torch.Tensor,
    adv_BS: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss with asymmetric clip and optional dual clip (verl semantics, docs/math.md 2.1).

    With ratio = exp(lr):
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        dual clip (clip_ratio_c = c > 1), only where A < 0:  pg = min(pg, -A * c)
    The dual clip bounds the loss of a negative-advantage token by |A| * c when ratio >> 1
    (e.g. an MoE routing flip); that branch is a constant, so it carries no gradient.

    Args:
        log_ratio_BS: float [B, S] log ratio (log pi_theta - log pi_old), gradients flow.
        adv_BS: float [B, S] advantages (detached by the caller).
    Returns:
        pg_BS: per-token loss; clipped_BS: bool, the clipped branch is strictly larger (no
        gradient there); dual_BS: bool, the dual-clip bound is active.
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    ratio_BS = torch.exp(log_ratio_BS)
    pg_unclipped_BS = -adv_BS * ratio_BS
    pg_clipped_BS = -adv_BS * ratio_BS.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_BS = torch.maximum(pg_unclipped_BS, pg_clipped_BS)
    clipped_BS = (pg_clipped_BS > pg_unclipped_BS).detach()
    if clip_ratio_c is None:
        return pg_BS, clipped_BS, torch.zeros_like(clipped_BS)
    pg_dual_BS = -adv_BS * clip_ratio_c
    dual_BS = ((adv_BS < 0) & (pg_dual_BS < pg_BS)).detach()
    return torch.where(dual_BS, pg_dual_BS, pg_BS), clipped_BS, dual_BS


def add_kl_term(
    loss_sum: torch.Tensor,
    metrics: dict[str, MetricValue],
    logp_BS: torch.Tensor,
    ref_logp_BS: torch.Tensor | None,
    mask_BS: torch.Tensor,
    kl_coef: float,
    kl_kind: str,
) -> torch.Tensor:
    """Adds kl_coef * sum_t m_t kl_t to loss_sum and ``train/kl_ref`` to metrics (when ref given)."""
    if kl_coef > 0 and ref_logp_BS is None:
        raise ValueError("kl_coef > 0 needs ref_logp_BS")
    if ref_logp_BS is None:
        return loss_sum
    kl_sum = (kl_estimate(logp_BS, ref_logp_BS, kl_kind) * mask_BS).sum()
    metrics["train/kl_ref"] = Mean(kl_sum.detach(), metrics["train/pg_loss"].count)
    return loss_sum + kl_coef * kl_sum if kl_coef > 0 else loss_sum


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
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """PPO clipped surrogate with asymmetric clip, token-sum / normalizer, plus an optional KL term.

    Per token, with ratio = exp(clamp(logp - old_logp, +-20)):
        pg = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        (dual clip when clip_ratio_c is set: pg = min(pg, -A * clip_ratio_c) where A < 0)
        loss = sum_t m_t * (w_t * pg_t + kl_coef * kl_t) / normalizer
    where w_t are optional IS weights (detached; 1 when None), multiplying OUTSIDE the clip, and
    kl_t = kl_estimate(logp, ref).

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
            stop-gradient is applied here (docs/math.md 2.1).
        clip_ratio_c: dual-clip constant c > 1 (verl ``clip_ratio_c``, default there 3.0); None = off.
    Returns:
        loss: 0-dim tensor; metrics: ``train/pg_loss`` (the IS-weighted PG term, per token),
        ``train/pg_clipfrac`` (share of loss tokens where the clipped branch is strictly larger,
        so it carries no gradient),
        ``train/ppo_kl`` (mean of old_logp - logp, k1 of KL(old || new)), ``train/ratio_mean``,
        ``train/ratio_max``, ``train/ratio_min``, ``train/kl_ref`` when ref_logp_BS is given, and
        ``train/pg_clipfrac_lower`` (share of loss tokens where the dual clip binds) when
        clip_ratio_c is set.
    """
    check_normalizer(normalizer)
    mask_BS = loss_mask_BS.to(logp_BS.dtype)
    adv_BS = advantages_BS.detach().to(logp_BS.dtype)
    log_ratio_BS = log_ratio(logp_BS, old_logp_BS.detach())
    pg_BS, clipped_BS, dual_BS = clipped_surrogate(
        log_ratio_BS, adv_BS, clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c
    )
    weighted_pg_BS = pg_BS if is_weights_BS is None else pg_BS * is_weights_BS.detach()
    loss_sum = (weighted_pg_BS * mask_BS).sum()

    metrics = ppo_metrics(loss_sum.detach(), log_ratio_BS.detach(), clipped_BS, loss_mask_BS)
    if clip_ratio_c is not None:
        metrics["train/pg_clipfrac_lower"] = Mean(
            (dual_BS.to(mask_BS.dtype) * mask_BS).sum(), metrics["train/pg_loss"].count
        )
    loss_sum = add_kl_term(loss_sum, metrics, logp_BS, ref_logp_BS, mask_BS, kl_coef, kl_kind)
    return loss_sum / normalizer, metrics


def apply_keep(loss_mask_BS: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """loss_mask AND keep, where keep is a token mask [B, S] or a sequence mask [B] (broadcast)."""
    mask_BS = loss_mask_BS.bool()
    if keep is None:
        return mask_BS
    keep = keep.bool()
    if keep.dim() == 1:
        keep = keep[:, None]
    return mask_BS & keep


def decoupled_ppo_loss(
    spec: PolicyLossSpec,
    logp_BS: torch.Tensor,
    old_logp_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    *,
    normalizer: float | torch.Tensor,
    is_weights_BS: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    ref_logp_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """Decoupled PPO (Hilton et al. 2021; docs/math.md 2.1): L = -E_mu[w_t * min(r_t A_t, clip(r_t) A_t)].

    Two drifts, two mechanisms:
    - rollout -> old: ``is_weights_BS`` (w_t, from pi_old / pi_rollout, computed once per batch by
      ``moe_rl.corrections.importance.is_weights``) multiply each token's clipped loss OUTSIDE the
      clip, detached; ``keep`` (from ``rejection_mask`` or ``trm_mask``) is ANDed into the loss mask.
    - old -> theta: the PPO clip on r_t = pi_theta / pi_old (``spec``: asymmetric; dual clip if
      ``spec.dual_clip_c``), plus ``spec``'s KL term.

    Normaliser: an explicit argument, NOT recomputed after rejection. Pass the global number of loss
    tokens BEFORE rejection (TRM, docs/math.md 3.3: normalise by the total batch, not the accepted
    count): rejected tokens / sequences contribute zero and the others are not re-weighted.

    Args:
        spec: the policy loss's clip and KL term.
        logp_BS, old_logp_BS, advantages_BS, loss_mask_BS, normalizer, ref_logp_BS: as ``ppo_clip_loss``.
        is_weights_BS: float [B, S] IS weights (stop-gradient applied here); None = 1.
        keep: bool [B, S] token keep mask or bool [B] sequence keep mask; None = keep all.
    Returns:
        (loss, metrics) as ``ppo_clip_loss``; metric means are over the kept loss tokens.
    """
    return ppo_clip_loss(
        logp_BS,
        old_logp_BS,
        advantages_BS,
        apply_keep(loss_mask_BS, keep),
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        normalizer=normalizer,
        ref_logp_BS=ref_logp_BS,
        kl_coef=spec.kl_coef,
        kl_kind=spec.kl_estimator,
        is_weights_BS=is_weights_BS,
        clip_ratio_c=spec.clip_ratio_c,
    )
