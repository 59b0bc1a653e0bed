"""The rollout -> learner drift as a step handles it, from the ``CorrectionSpec`` the plan
carries unchanged (``moe_rl/step/plan.py``): the engine inputs the corrections need, what is
computed once per batch (decoupled mode: IS weights, rejection and a TRM mask against pi_old) and
the DVP metrics. The maths is ``moe_rl/corrections`` (the policy loss: ``moe_rl.corrections.
corrected_loss.PolicyLoss``); nothing here reads the config.

Shape suffixes: B sequences, S positions, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_rl.corrections.correction_specs import CorrectionSpec
from moe_rl.corrections.dvp import RestrictedLogprobs, dvp_metrics, restricted_logprobs
from moe_rl.corrections.importance import is_batch_mean_parts, is_weights, rejection_mask
from moe_rl.corrections.trm import trm_mask
from moe_rl.maths.ratios import exact_log_ratio
from moe_rl.types import RolloutBatch, TokenStats


class TokenInputs(NamedTuple):
    """Per-token tensors the learner needs from the engine (None where not configured)."""

    safe_BSV: torch.Tensor | None  # DVP safe sets: the learner's log-probs use the same support
    rollout_dist_BSV: torch.Tensor | None  # full rollout distributions (exact-KL TRM)


class CorrectionTensors(NamedTuple):
    """Decoupled mode's per-batch tensors (rollout -> old drift)."""

    is_weights_BS: torch.Tensor | None
    keep_BS: torch.Tensor | None


def token_inputs(correction: CorrectionSpec, support: str, batch: RolloutBatch) -> TokenInputs:
    """The DVP safe sets and full rollout distributions the corrections need.

    Refuses a batch whose log-probs are normalised over another ``support`` than the learner's."""
    if batch.logprob_support != support:
        raise ValueError(
            f"the rollout engine reported log-probs over support {batch.logprob_support!r} "
            f"but the learner computes them over {support!r}"
        )
    safe_BSV = dist_BSV = None
    if correction.dvp.on:
        if batch.safe_BSV is None:
            raise ValueError("correction.dvp_threshold is set but the engine returned no safe sets")
        safe_BSV = batch.safe_BSV
    if correction.needs_full_dists:
        if batch.dist_logp_BSV is None:
            raise ValueError("correction.trm.kl=exact needs the engine's full distributions (return_dist)")
        dist_BSV = batch.dist_logp_BSV
    return TokenInputs(safe_BSV, dist_BSV)


def dvp_batch_metrics(correction: CorrectionSpec, batch: RolloutBatch, old: TokenStats) -> dict:
    """Pruned tail mass, sampled-outside fraction, safe-set size, k3 before and after pruning."""
    if not correction.dvp.on:
        return {}
    outside_BS1 = ~batch.response_mask_BS[..., None]  # prompt/pad positions: no distribution, no NaN
    safe_BSV = batch.safe_BSV | outside_BS1
    train = RestrictedLogprobs(
        old.logp_BS, old.full_logp_BS, old.log_safe_mass_BS, batch.response_mask_BS.clone()
    )
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


def drift_tensors(
    correction: CorrectionSpec,
    old_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    dp_group,
    exact_kl_BS: torch.Tensor | None = None,
) -> tuple[CorrectionTensors, dict]:
    """Decoupled mode's per-batch tensors (rollout -> old drift): IS weights and the keep mask."""
    metrics: dict = {}
    is_weights_BS = None
    if not correction.decoupled:
        return CorrectionTensors(None, None), metrics
    # is_weights / rejection_mask clamp after summing
    log_ratio_BS = exact_log_ratio(old_logp_BS, rollout_logp_BS)
    imp = correction.importance
    if imp.on:
        norm_mean = None
        if imp.batch_normalize:  # the global mean, so every rank divides by the same number
            w_BS, _ = is_weights(log_ratio_BS, mask_BS, replace(imp, batch_normalize=False))
            parts = torch.stack(is_batch_mean_parts(w_BS, mask_BS, imp)).double()
            if dist.is_initialized():
                dist.all_reduce(parts, group=dp_group)
            norm_mean = float(parts[0] / parts[1].clamp(min=1))
        is_weights_BS, m = is_weights(log_ratio_BS, mask_BS, imp, norm_mean=norm_mean)
        metrics.update(m)
    keep_BS = mask_BS.bool()
    if correction.rules:
        rs_keep_BS, m = rejection_mask(log_ratio_BS, mask_BS, correction.rules)
        keep_BS = keep_BS & rs_keep_BS
        metrics.update(m)
    if correction.trm_old is not None:
        keep_B, m = trm_mask(correction.trm_old, old_logp_BS, rollout_logp_BS, mask_BS, exact_kl_BS)
        keep_BS = keep_BS & keep_B[:, None]
        metrics.update(m)
    return CorrectionTensors(is_weights_BS, keep_BS), metrics
