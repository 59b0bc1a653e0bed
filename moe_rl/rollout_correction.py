"""Glue between ``correction.*`` config and the pure math of ``moe_rl/corrections`` and
``moe_rl/losses``: what is computed once per batch (decoupled mode: IS weights, rejection and a
TRM mask against pi_old), and the loss each micro-batch runs.

Shape suffixes: B sequences, S positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_rl.config import AlgoConfig, CorrectionConfig
from moe_rl.corrections.importance import is_batch_mean_parts, is_weights, rejection_mask
from moe_rl.corrections.dvp import RestrictedLogprobs, dvp_metrics, restricted_logprobs
from moe_rl.corrections.trm import sample_kl_tokens, trm_mask
from moe_rl.losses import bypass_loss, decoupled_ppo_loss
from moe_rl.ratios import exact_log_ratio, log_ratio
from moe_rl.types import RolloutBatch, TokenStats, TrainBatch


def _trm(cc: CorrectionConfig, train_logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor,
         mask_BS: torch.Tensor, exact_kl_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """TRM sequence keep mask (math.md 3.3): the exact per-token KL(pi_rollout || pi_train) from
    full distributions, or the sample-based k2 (max criterion) and k3 (average criterion)."""
    lr_BS = log_ratio(train_logp_BS.detach(), rollout_logp_BS.detach())
    ln = {"length_neutral": cc.trm_length_neutral, "log_ratio_BS": lr_BS, "ln_threshold": cc.trm_ln_threshold,
          "ln_eps": cc.trm_ln_eps, "ln_delta": cc.trm_ln_delta}
    if cc.trm_kl == "exact":
        if exact_kl_BS is None:
            raise ValueError("correction.trm_kl=exact needs the rollout engine's full distributions")
        kl = exact_kl_BS.detach()
        return trm_mask(kl, mask_BS, max_delta=cc.trm_max or None, avg_delta=cc.trm_avg or None, **ln)
    return trm_mask(sample_kl_tokens(lr_BS, "k2"), mask_BS, max_delta=cc.trm_max or None,
                    avg_delta=cc.trm_avg or None, avg_kl_tok_BS=sample_kl_tokens(lr_BS, "k3"), **ln)


class TokenInputs(NamedTuple):
    """Per-token tensors the learner needs from the engine (None where not configured)."""

    safe_BSV: torch.Tensor | None  # DVP safe sets: the learner's log-probs use the same support
    rollout_dist_BSV: torch.Tensor | None  # full rollout distributions (exact-KL TRM)


class CorrectionTensors(NamedTuple):
    """Decoupled mode's per-batch tensors (rollout -> old drift)."""

    is_weights_BS: torch.Tensor | None
    keep_BS: torch.Tensor | None


def token_inputs(cc: CorrectionConfig, batch: RolloutBatch, expected_support: str) -> TokenInputs:
    """The DVP safe sets and full rollout distributions the configured corrections need.

    Refuses a batch whose log-probs are normalised over another support than the learner's."""
    if batch.logprob_support != expected_support:
        raise ValueError(f"the rollout engine reported log-probs over support {batch.logprob_support!r} "
                         f"but the learner computes them over {expected_support!r}")
    safe_BSV = dist_BSV = None
    if cc.dvp_threshold > 0:
        if batch.safe_BSV is None:
            raise ValueError("correction.dvp_threshold is set but the engine returned no safe sets")
        safe_BSV = batch.safe_BSV
    if cc.trm_on and cc.trm_kl == "exact":
        if batch.dist_logp_BSV is None:
            raise ValueError("correction.trm_kl=exact needs the engine's full distributions (return_dist)")
        dist_BSV = batch.dist_logp_BSV
    return TokenInputs(safe_BSV, dist_BSV)


def dvp_batch_metrics(cc: CorrectionConfig, batch: RolloutBatch, old: TokenStats) -> dict:
    """Pruned tail mass, sampled-outside fraction, safe-set size, k3 before and after pruning."""
    if cc.dvp_threshold <= 0:
        return {}
    outside_BS1 = ~batch.response_mask_BS[..., None]  # prompt/pad positions: no distribution, no NaN
    safe_BSV = batch.safe_BSV | outside_BS1
    train = RestrictedLogprobs(old.logp_BS, old.full_logp_BS, old.log_safe_mass_BS,
                               batch.response_mask_BS.clone())
    if batch.dist_logp_BSV is not None:
        rollout = restricted_logprobs(batch.dist_logp_BSV, safe_BSV, batch.tokens_BS)
        return dvp_metrics(train, rollout, safe_BSV, batch.response_mask_BS)
    # vLLM reports the sampled token's safe-set log-prob only (no full distribution): the
    # rollout side's full log-prob and safe mass are unknown, so the metrics built on them are left out
    inside_BS = safe_BSV.gather(-1, batch.tokens_BS.long()[..., None]).squeeze(-1)
    unknown_BS = torch.full_like(batch.logprobs_BS, math.nan)
    rollout = RestrictedLogprobs(batch.logprobs_BS, unknown_BS, unknown_BS, inside_BS)
    metrics = dvp_metrics(train, rollout, safe_BSV, batch.response_mask_BS)
    return {k: v for k, v in metrics.items() if k not in ROLLOUT_DIST_METRICS}


# DVP metrics that need the rollout's full distribution (not available from vLLM)
ROLLOUT_DIST_METRICS = ("corr/dvp_pruned_mass", "corr/dvp_pruned_mass_max", "corr/dvp_k3_before")


def prepare(cc: CorrectionConfig, old_logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor,
            mask_BS: torch.Tensor, dp_group, exact_kl_BS: torch.Tensor | None = None
            ) -> tuple[CorrectionTensors, dict]:
    """Decoupled mode's per-batch tensors (rollout -> old drift): IS weights and the keep mask."""
    metrics: dict = {}
    is_weights_BS = None
    if cc.mode != "decoupled":
        return CorrectionTensors(None, None), metrics
    lr_BS = exact_log_ratio(old_logp_BS, rollout_logp_BS)  # is_weights / rejection_mask clamp after summing
    if cc.is_level != "none":
        norm_mean = None
        if cc.is_batch_normalize:  # the global mean, so every rank divides by the same number
            w_BS, _ = is_weights(lr_BS, mask_BS, cc.is_level, cc.is_clip)
            parts = torch.stack(is_batch_mean_parts(w_BS, mask_BS, cc.is_level)).double()
            if dist.is_initialized():
                dist.all_reduce(parts, group=dp_group)
            norm_mean = float(parts[0] / parts[1].clamp(min=1))
        is_weights_BS, m = is_weights(lr_BS, mask_BS, cc.is_level, cc.is_clip,
                                          batch_normalize=cc.is_batch_normalize, norm_mean=norm_mean)
        metrics.update(m)
    keep_BS = mask_BS.bool()
    if cc.rs:
        rs_keep_BS, m = rejection_mask(lr_BS, mask_BS, list(cc.rs), cc.bounds)
        keep_BS = keep_BS & rs_keep_BS
        metrics.update(m)
    if cc.trm_on and cc.trm_reference == "old":
        keep_B, m = _trm(cc, old_logp_BS, rollout_logp_BS, mask_BS, exact_kl_BS)
        keep_BS = keep_BS & keep_B[:, None]
        metrics.update(m)
    return CorrectionTensors(is_weights_BS, keep_BS), metrics


def loss_fn(cc: CorrectionConfig, a: AlgoConfig) -> Callable:
    """The policy loss over one micro-batch; the normaliser (global loss tokens before any
    rejection, as TRM requires) comes from the learner."""
    clip_c = cc.dual_clip_c or None

    def loss(mb: TrainBatch, st: TokenStats, normalizer):
        keep = None
        metrics: dict = {}
        logp_BS = st.logp_BS
        if cc.trm_on and cc.trm_reference == "theta":  # the paper's guarantee: against pi_theta
            keep, metrics = _trm(cc, logp_BS, mb.rollout_logp_BS, mb.loss_mask_BS, st.exact_kl_BS)
        if cc.mode == "bypass":
            value, m = bypass_loss(logp_BS, mb.rollout_logp_BS, mb.advantages_BS, mb.loss_mask_BS,
                                   mode=cc.bypass_loss, normalizer=normalizer, clip_low=a.clip_low,
                                   clip_high=a.clip_high, clip_ratio_c=clip_c,
                                   is_level=None if cc.is_level == "none" else cc.is_level, is_clip_max=cc.is_clip,
                                   rs_options=list(cc.rs), rs_bounds=cc.bounds, keep=keep,
                                   ref_logp_BS=mb.ref_logp_BS, kl_coef=a.kl_coef, kl_kind=a.kl_estimator)
            return value, {**metrics, **m}
        keep_BS = mb.keep_BS if keep is None else mb.keep_BS & keep[:, None]
        value, m = decoupled_ppo_loss(logp_BS, mb.old_logp_BS, mb.advantages_BS, mb.loss_mask_BS,
                                      clip_low=a.clip_low, clip_high=a.clip_high, normalizer=normalizer,
                                      is_weights_BS=mb.is_weights_BS, keep=keep_BS, clip_ratio_c=clip_c,
                                      ref_logp_BS=mb.ref_logp_BS, kl_coef=a.kl_coef, kl_kind=a.kl_estimator)
        return value, {**metrics, **m}

    return loss
