"""Rollout correction as a step runs it, from a ``CorrectionPlan`` resolved once from
``correction.*`` (``moe_rl/step/plan.py``): what is computed once per batch (decoupled mode: IS
weights, rejection and a TRM mask against pi_old), the DVP metrics, and the two policy losses a
plan picks between (``decoupled_loss``, ``bypass_loss``). The math is ``moe_rl/corrections`` and
``moe_rl/losses``; nothing here reads the config.

Shape suffixes: B sequences, S positions, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_rl.maths import losses
from moe_rl.corrections.dvp import RestrictedLogprobs, dvp_metrics, restricted_logprobs
from moe_rl.corrections.importance import is_batch_mean_parts, is_weights, rejection_mask
from moe_rl.corrections.trm import sample_kl_tokens, trm_mask
from moe_rl.maths.ratios import exact_log_ratio, log_ratio
from moe_rl.types import RolloutBatch, TokenStats, TrainBatch


@dataclass(frozen=True)
class TrmPlan:
    """Trust Region Masking: the criteria (None = off) and which per-token KL they read."""

    exact: bool  # the exact KL(pi_rollout || pi_train) from full distributions, else k2 / k3 samples
    max_delta: float | None
    avg_delta: float | None
    length_neutral: str
    ln_threshold: float
    ln_eps: float
    ln_delta: float

    def mask(
        self,
        train_logp_BS: torch.Tensor,
        rollout_logp_BS: torch.Tensor,
        mask_BS: torch.Tensor,
        exact_kl_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """TRM sequence keep mask (docs/math.md 3.3): the exact per-token KL(pi_rollout || pi_train) from
        full distributions, or the sample-based k2 (max criterion) and k3 (average criterion)."""
        log_ratio_BS = log_ratio(train_logp_BS.detach(), rollout_logp_BS.detach())
        ln = {
            "length_neutral": self.length_neutral,
            "log_ratio_BS": log_ratio_BS,
            "ln_threshold": self.ln_threshold,
            "ln_eps": self.ln_eps,
            "ln_delta": self.ln_delta,
        }
        if self.exact:
            if exact_kl_BS is None:
                raise ValueError("correction.trm.kl=exact needs the rollout engine's full distributions")
            return trm_mask(
                exact_kl_BS.detach(), mask_BS, max_delta=self.max_delta, avg_delta=self.avg_delta, **ln
            )
        return trm_mask(
            sample_kl_tokens(log_ratio_BS, "k2"),
            mask_BS,
            max_delta=self.max_delta,
            avg_delta=self.avg_delta,
            avg_kl_tok_BS=sample_kl_tokens(log_ratio_BS, "k3"),
            **ln,
        )


@dataclass(frozen=True)
class CorrectionPlan:
    """What a step corrects and what it needs from the engine, decided once.

    decoupled: decoupled mode's per-batch tensors (rollout -> old drift) are computed; False in
        bypass mode, whose loss corrects against pi_rollout itself.
    is_level: the rollout IS level of decoupled mode, None = off.
    trm_old: the TRM mask against pi_old, once per batch (None: off, or evaluated against pi_theta
        inside the loss).
    """

    support: str  # what the engine's log-probs must be normalised over (the learner's support)
    safe_sets: bool = False  # DVP: the engine's safe sets feed the learner and the DVP metrics
    full_dists: bool = False  # exact-KL TRM: the engine's full distributions feed the learner
    decoupled: bool = True
    is_level: str | None = None
    is_clip: float = 2.0
    is_batch_normalize: bool = False
    rs: tuple[str, ...] = ()
    rs_bounds: tuple = ()
    trm_old: TrmPlan | None = None


class TokenInputs(NamedTuple):
    """Per-token tensors the learner needs from the engine (None where not configured)."""

    safe_BSV: torch.Tensor | None  # DVP safe sets: the learner's log-probs use the same support
    rollout_dist_BSV: torch.Tensor | None  # full rollout distributions (exact-KL TRM)


class CorrectionTensors(NamedTuple):
    """Decoupled mode's per-batch tensors (rollout -> old drift)."""

    is_weights_BS: torch.Tensor | None
    keep_BS: torch.Tensor | None


def token_inputs(plan: CorrectionPlan, batch: RolloutBatch) -> TokenInputs:
    """The DVP safe sets and full rollout distributions the planned corrections need.

    Refuses a batch whose log-probs are normalised over another support than the learner's."""
    if batch.logprob_support != plan.support:
        raise ValueError(
            f"the rollout engine reported log-probs over support {batch.logprob_support!r} "
            f"but the learner computes them over {plan.support!r}"
        )
    safe_BSV = dist_BSV = None
    if plan.safe_sets:
        if batch.safe_BSV is None:
            raise ValueError("correction.dvp_threshold is set but the engine returned no safe sets")
        safe_BSV = batch.safe_BSV
    if plan.full_dists:
        if batch.dist_logp_BSV is None:
            raise ValueError("correction.trm.kl=exact needs the engine's full distributions (return_dist)")
        dist_BSV = batch.dist_logp_BSV
    return TokenInputs(safe_BSV, dist_BSV)


def dvp_batch_metrics(plan: CorrectionPlan, batch: RolloutBatch, old: TokenStats) -> dict:
    """Pruned tail mass, sampled-outside fraction, safe-set size, k3 before and after pruning."""
    if not plan.safe_sets:
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
    plan: CorrectionPlan,
    old_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    dp_group,
    exact_kl_BS: torch.Tensor | None = None,
) -> tuple[CorrectionTensors, dict]:
    """Decoupled mode's per-batch tensors (rollout -> old drift): IS weights and the keep mask."""
    metrics: dict = {}
    is_weights_BS = None
    if not plan.decoupled:
        return CorrectionTensors(None, None), metrics
    log_ratio_BS = exact_log_ratio(old_logp_BS, rollout_logp_BS)  # is_weights / rejection_mask clamp after summing
    if plan.is_level is not None:
        norm_mean = None
        if plan.is_batch_normalize:  # the global mean, so every rank divides by the same number
            w_BS, _ = is_weights(log_ratio_BS, mask_BS, plan.is_level, plan.is_clip)
            parts = torch.stack(is_batch_mean_parts(w_BS, mask_BS, plan.is_level)).double()
            if dist.is_initialized():
                dist.all_reduce(parts, group=dp_group)
            norm_mean = float(parts[0] / parts[1].clamp(min=1))
        is_weights_BS, m = is_weights(
            log_ratio_BS,
            mask_BS,
            plan.is_level,
            plan.is_clip,
            batch_normalize=plan.is_batch_normalize,
            norm_mean=norm_mean,
        )
        metrics.update(m)
    keep_BS = mask_BS.bool()
    if plan.rs:
        rs_keep_BS, m = rejection_mask(log_ratio_BS, mask_BS, list(plan.rs), list(plan.rs_bounds))
        keep_BS = keep_BS & rs_keep_BS
        metrics.update(m)
    if plan.trm_old is not None:
        keep_B, m = plan.trm_old.mask(old_logp_BS, rollout_logp_BS, mask_BS, exact_kl_BS)
        keep_BS = keep_BS & keep_B[:, None]
        metrics.update(m)
    return CorrectionTensors(is_weights_BS, keep_BS), metrics


# The policy losses over one micro-batch, ``loss(mb, st, normalizer) -> (value, metrics)`` once the
# plan has bound their keywords (functools.partial); the normaliser (global loss tokens before any
# rejection, as TRM requires) comes from the learner. ``trm_theta``: the TRM mask evaluated
# against pi_theta here (the paper's guarantee), None when off or evaluated against pi_old.


def _theta_keep(
    trm_theta: TrmPlan | None, mb: TrainBatch, st: TokenStats
) -> tuple[torch.Tensor | None, dict]:
    if trm_theta is None:
        return None, {}
    return trm_theta.mask(st.logp_BS, mb.rollout_logp_BS, mb.loss_mask_BS, st.exact_kl_BS)


def decoupled_loss(
    mb: TrainBatch,
    st: TokenStats,
    normalizer,
    *,
    trm_theta: TrmPlan | None,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
    kl_coef: float,
    kl_kind: str,
):
    """Decoupled PPO: the per-batch IS weights and keep mask, the clip against pi_old."""
    keep, metrics = _theta_keep(trm_theta, mb, st)
    keep_BS = mb.keep_BS if keep is None else mb.keep_BS & keep[:, None]
    value, m = losses.decoupled_ppo_loss(
        st.logp_BS,
        mb.old_logp_BS,
        mb.advantages_BS,
        mb.loss_mask_BS,
        clip_low=clip_low,
        clip_high=clip_high,
        normalizer=normalizer,
        is_weights_BS=mb.is_weights_BS,
        keep=keep_BS,
        clip_ratio_c=clip_ratio_c,
        ref_logp_BS=mb.ref_logp_BS,
        kl_coef=kl_coef,
        kl_kind=kl_kind,
    )
    return value, {**metrics, **m}


def bypass_loss(
    mb: TrainBatch,
    st: TokenStats,
    normalizer,
    *,
    trm_theta: TrmPlan | None,
    mode: str,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
    is_level: str | None,
    is_clip_max: float,
    rs_options: tuple[str, ...],
    rs_bounds: tuple,
    kl_coef: float,
    kl_kind: str,
):
    """Bypass mode: the ratio, IS weights and rejection against pi_rollout, in the loss."""
    keep, metrics = _theta_keep(trm_theta, mb, st)
    value, m = losses.bypass_loss(
        st.logp_BS,
        mb.rollout_logp_BS,
        mb.advantages_BS,
        mb.loss_mask_BS,
        mode=mode,
        normalizer=normalizer,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        is_level=is_level,
        is_clip_max=is_clip_max,
        rs_options=list(rs_options),
        rs_bounds=list(rs_bounds),
        keep=keep,
        ref_logp_BS=mb.ref_logp_BS,
        kl_coef=kl_coef,
        kl_kind=kl_kind,
    )
    return value, {**metrics, **m}
