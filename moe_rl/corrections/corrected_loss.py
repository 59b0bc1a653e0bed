"""The losses that apply a rollout correction inside the loss (docs/math.md 2.1): the bypass
loss, which recomputes rejection masks and IS weights from pi_theta in every call, and
``PolicyLoss``, the micro-batch loss a step runs (decoupled PPO or bypass, with TRM against
pi_theta). Glue between the pure surrogates of ``moe_rl.maths.losses`` and the corrections of this
package: it sits above both, so maths/ never imports corrections/ (issue 41).

Shape suffixes: B sequences, S padded sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moe_rl.corrections.correction_specs import CorrectionSpec
from moe_rl.corrections.importance import is_weights, rejection_mask
from moe_rl.corrections.trm import trm_mask
from moe_rl.maths.losses import (
    add_kl_term,
    apply_keep,
    check_normalizer,
    decoupled_ppo_loss,
    ppo_clip_loss,
    ppo_metrics,
)
from moe_rl.maths.policy_specs import PolicyLossSpec
from moe_rl.maths.ratios import exact_log_ratio, log_ratio
from moe_rl.metrics import MetricValue
from moe_rl.names import BYPASS_LOSS_NAMES
from moe_rl.types import TokenStats, TrainBatch

BYPASS_MODES = BYPASS_LOSS_NAMES


def bypass_loss(
    spec: PolicyLossSpec,
    correction: CorrectionSpec,
    logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    advantages_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    *,
    normalizer: float | torch.Tensor,
    keep: torch.Tensor | None = None,
    ref_logp_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """Bypass mode (docs/math.md 2.1; verl ``compute_policy_loss_bypass_mode``): pi_old := pi_rollout.

    The rejection mask (``correction.rules``, see ``corrections.importance.rejection_mask``) is
    recomputed here from the CURRENT pi_theta (rho = pi_theta / pi_rollout, detached) and ANDed
    with ``keep`` (e.g. a TRM mask the caller evaluated against pi_theta) into the loss mask.

    - ``correction.bypass_loss`` "ppo_clip": per-token ``clipped_surrogate`` (``spec``) on
      r = pi_theta / pi_rollout; no IS weight (the spec refuses one: the ratio already is the IS
      ratio, a weight would double-count).
    - "reinforce": loss_t = -stopgrad(w_t) * A_t * log pi_theta(y_t), with w from
      ``is_weights(log rho, correction.importance)`` on the fly (w = 1 when IS is off). Its gradient
      is -w_t A_t grad log pi_theta: no log pi * grad w term.

    Normaliser: as ``decoupled_ppo_loss`` (explicit; count loss tokens before rejection).
    Returns:
        (loss, metrics): the ``ppo_clip_loss`` train/ metrics (ratio = pi_theta / pi_rollout) plus the
        corr/ metrics of the IS weights and rejection computed here.
    """
    check_normalizer(normalizer)
    log_ratio_det_BS = log_ratio(logp_BS.detach(), rollout_logp_BS.detach())
    exact_BS = exact_log_ratio(logp_BS.detach(), rollout_logp_BS.detach())  # clamped after any sum
    base_mask_BS = loss_mask_BS.bool()  # IS weights and RS statistics see every response token
    mask_BS = apply_keep(base_mask_BS, keep)
    corr_metrics: dict[str, MetricValue] = {}
    if correction.rules:
        rs_keep_BS, corr_metrics = rejection_mask(exact_BS, base_mask_BS, correction.rules)
        mask_BS = mask_BS & rs_keep_BS
    if correction.bypass_loss == "ppo_clip":
        loss, metrics = ppo_clip_loss(
            logp_BS,
            rollout_logp_BS,
            advantages_BS,
            mask_BS,
            clip_low=spec.clip_low,
            clip_high=spec.clip_high,
            normalizer=normalizer,
            ref_logp_BS=ref_logp_BS,
            kl_coef=spec.kl_coef,
            kl_kind=spec.kl_estimator,
            clip_ratio_c=spec.clip_ratio_c,
        )
        return loss, {**corr_metrics, **metrics}
    w_BS = torch.ones_like(log_ratio_det_BS)
    imp = correction.importance
    if imp.on:
        # per micro-batch and against pi_theta: no batch normalisation here (it is decoupled mode's)
        w_BS, is_metrics = is_weights(exact_BS, base_mask_BS, replace(imp, batch_normalize=False))
        corr_metrics.update(is_metrics)
    maskf_BS = mask_BS.to(logp_BS.dtype)
    adv_BS = advantages_BS.detach().to(logp_BS.dtype)
    loss_sum = (-w_BS.detach() * adv_BS * logp_BS * maskf_BS).sum()
    metrics = ppo_metrics(loss_sum.detach(), log_ratio_det_BS, torch.zeros_like(mask_BS), mask_BS)
    loss_sum = add_kl_term(loss_sum, metrics, logp_BS, ref_logp_BS, maskf_BS, spec.kl_coef, spec.kl_estimator)
    return loss_sum / normalizer, {**corr_metrics, **metrics}


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss of every micro-batch, ``loss(mb, st, normalizer) -> (value, metrics)`` (the
    learner's ``LossFn``): decoupled PPO or the bypass loss, as ``correction.mode`` says, with the
    TRM mask evaluated against pi_theta here when ``correction.trm.reference`` is "theta" (the
    paper's guarantee). The normaliser (global loss tokens before any rejection, as TRM requires)
    comes from the learner."""

    spec: PolicyLossSpec
    correction: CorrectionSpec

    def __call__(
        self, mb: TrainBatch, st: TokenStats, normalizer: float | torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, MetricValue]]:
        keep_B, metrics = None, {}
        trm = self.correction.trm_theta
        if trm is not None:
            keep_B, metrics = trm_mask(trm, st.logp_BS, mb.rollout_logp_BS, mb.loss_mask_BS, st.exact_kl_BS)
        if self.correction.decoupled:
            keep_BS = mb.keep_BS if keep_B is None else mb.keep_BS & keep_B[:, None]
            value, m = decoupled_ppo_loss(
                self.spec,
                st.logp_BS,
                mb.old_logp_BS,
                mb.advantages_BS,
                mb.loss_mask_BS,
                normalizer=normalizer,
                is_weights_BS=mb.is_weights_BS,
                keep=keep_BS,
                ref_logp_BS=mb.ref_logp_BS,
            )
        else:
            value, m = bypass_loss(
                self.spec,
                self.correction,
                st.logp_BS,
                mb.rollout_logp_BS,
                mb.advantages_BS,
                mb.loss_mask_BS,
                normalizer=normalizer,
                keep=keep_B,
                ref_logp_BS=mb.ref_logp_BS,
            )
        return value, {**metrics, **m}
