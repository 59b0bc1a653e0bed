"""Rollout correction: importance weights, rejection masks, and off-policy diagnostics.

docs/math.md 2.2 (IS weights), 2.3 (rejection / masking), 2.6 (metrics); semantics of verl
``rollout_corr_helper.py`` except as listed under "Where this differs from verl" (below). Pure
tensor functions: no torch.distributed, no ``.item()``; metrics follow ``moe_rl.metrics`` (local
Mean/Std/Max/Min).

Shape suffixes: B sequences, S padded sequence length.

Direction convention (the one convention of ``moe_rl.corrections``): every ratio bound is a bound
on

    rho = pi_train / pi_rollout,      log rho = train_logp - rollout_logp  (``log_ratio``),

where pi_train is pi_old in decoupled mode and pi_theta in bypass mode. A k1 option with bounds
(lo, hi) keeps a token / sequence iff lo <= rho_stat <= hi, i.e. log lo <= stat(log rho) <= log hi,
where stat is the token value, the sum (rho_stat = rho(y)) or the mean (rho_stat = rho_geo). A bare
float U means (1/U, U). NOTE verl: its k1 statistic is -log rho and it keeps log L <= k1 <= log U,
which constrains pi_rollout / pi_train to [L, U], i.e. rho to [1/U, 1/L]. The two agree for
reciprocal pairs such as 0.5_2.0 (1/0.5 = 2) and are mirrored for asymmetric ones (verl's
"0.6_1.6" keeps rho in [0.625, 1.667]; ours keeps rho in [0.6, 1.6]). 0.999_1.001 is not a
reciprocal pair (1/1.001 = 0.999000999...): verl keeps rho in [0.999000999..., 1.001001...], ours
in [0.999, 1.001], a difference below 1e-6 at either end. k2 / k3 options take one upper bound.

Clamping (``SAFETY_BOUND`` = 20) happens where the math allows, after any aggregation, so the
statistics are exact for any finite input whose result is within the bound: a token weight clamps
its own log rho; a sequence weight clamps sum_t log rho_t and a geometric weight mean_t log rho_t
(not each term: +30 and -29.5 sum to 0.5); k1 rejection aggregates the exact log rho; chi^2_seq
clamps the sum. The per-token k2 = lr^2 / 2 and k3 = e^lr - 1 - lr (``moe_rl.maths.ratios.
kl_from_log_ratio``; estimators of KL(pi_rollout || pi_train) for tokens sampled from pi_rollout)
use lr = clamp(log rho, +-20) so e^lr stays finite; ``corr/k1_kl`` averages the exact log rho.

Where this differs from verl (docs/math.md 2.3 and 2.6):
  1. Direction of asymmetric k1 bounds: ours bound rho, verl's bound 1/rho (above).
  2. k1 rejection statistics: verl computes every per-token statistic from clamp(log rho_t, +-20)
     and aggregates those; token_k1, seq_sum_k1 and seq_mean_k1 here aggregate the exact log rho_t
     and clamp nothing (no exp is taken). Tokens +30, -29.5: verl's seq_sum_k1 is -(20 - 20) = 0,
     ours -(30 - 29.5) = -0.5. A decision differs from verl's only in a sequence with some
     |log rho_t| > 20; the options' metrics (``corr/rs_<k1 option>_*``) are exact as well.
     k2 / k3 options match verl (per-token clamp, then aggregation).
Sequence IS weights, chi^2_seq and ``corr/k1_kl`` (verl ``kl``, an unclamped mean) follow verl.

Sequences with no response token count in no sequence-level statistic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from moe_rl.corrections.correction_specs import ImportanceSpec, RejectionRule
from moe_rl.corrections.masked import inf_like, masked_max, masked_mean, masked_min, seq_valid, stats
from moe_rl.maths.ratios import SAFETY_BOUND, exact_log_ratio, kl_from_log_ratio, log_ratio
from moe_rl.metrics import MetricValue
from moe_rl.registry import Registry

__all__ = [
    "IS_LEVELS",
    "RS_AGGREGATIONS",
    "SAFETY_BOUND",
    "is_batch_mean_parts",
    "is_weights",
    "log_ratio",
    "offpolicy_metrics",
    "rejection_mask",
]


# --------------------------------------------------------------------------- IS weights

LogWeightFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
IS_LEVELS: Registry[LogWeightFn] = Registry("IS weight level")


def _masked_sum(log_ratio_BS: torch.Tensor, maskf_BS: torch.Tensor) -> torch.Tensor:
    """sum_t log rho_t over response tokens, [B, 1] (padding may hold anything, even inf)."""
    return torch.where(maskf_BS > 0, log_ratio_BS, torch.zeros_like(log_ratio_BS)).sum(-1, keepdim=True)


@IS_LEVELS.register("token")
def _token_log_weight(log_ratio_BS: torch.Tensor, maskf_BS: torch.Tensor) -> torch.Tensor:
    """log w_t = clamp(log rho_t, +-20)."""
    return log_ratio_BS.clamp(-SAFETY_BOUND, SAFETY_BOUND)


@IS_LEVELS.register("sequence")
def _sequence_log_weight(log_ratio_BS: torch.Tensor, maskf_BS: torch.Tensor) -> torch.Tensor:
    """log w = clamp(sum_t log rho_t, +-20) of the exact token terms, broadcast to the tokens."""
    total_B1 = _masked_sum(log_ratio_BS, maskf_BS).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return total_B1.expand_as(log_ratio_BS)


@IS_LEVELS.register("geometric")
def _geometric_log_weight(log_ratio_BS: torch.Tensor, maskf_BS: torch.Tensor) -> torch.Tensor:
    """log w = clamp(mean_t log rho_t, +-20) (log of rho_geo = rho(y)^(1/T)), broadcast."""
    mean_B1 = _masked_sum(log_ratio_BS, maskf_BS) / maskf_BS.sum(-1, keepdim=True).clamp(min=1)
    return mean_B1.clamp(-SAFETY_BOUND, SAFETY_BOUND).expand_as(log_ratio_BS)


def is_batch_mean_parts(
    weights_BS: torch.Tensor, mask_BS: torch.Tensor, spec: ImportanceSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (sum, count) whose global ratio is the batch-normalisation mean of ``is_weights``.

    ``spec.level`` token: over response tokens; sequence / geometric: over sequences (one weight
    each). A caller with several ranks all-reduces both and passes sum / count as ``norm_mean``.
    """
    IS_LEVELS.check(spec.level)
    mask_BS = mask_BS.bool()
    w_BS = weights_BS.detach()
    if spec.level == "token":
        keepf = mask_BS.to(w_BS.dtype)
        return (w_BS * keepf).sum(), keepf.sum()
    valid_B = seq_valid(mask_BS)
    seq_w_B = (w_BS * mask_BS.to(w_BS.dtype)).sum(-1) / mask_BS.sum(-1).clamp(min=1).to(w_BS.dtype)
    return (seq_w_B * valid_B.to(w_BS.dtype)).sum(), valid_B.to(w_BS.dtype).sum()


def is_weights(
    log_ratio_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    spec: ImportanceSpec,
    *,
    norm_mean: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """Truncated importance weights w = min(rho_level, C) (docs/math.md 2.2), detached.

    Levels (``spec.level``, ``IS_LEVELS``): "token" rho_t = exp(clamp(log rho_t, +-20)); "sequence"
    rho(y) = exp(clamp(sum_t log rho_t, +-20)); "geometric" rho_geo = exp(clamp(mean_t log rho_t,
    +-20)); the sum and mean are of the exact token terms (module docstring); sequence levels
    broadcast to every token.
    Truncation at C = ``spec.clip`` is one-sided (no lower clamp; None = no truncation, plain IS);
    1/C is used only in the metrics. Weights are 0 on padding. With ``spec.batch_normalize`` the
    truncated weights are divided by their batch mean (tokens for "token", sequences otherwise):
    the local mean, or ``norm_mean`` when the caller passes the global one (see
    ``is_batch_mean_parts``).

    Args:
        log_ratio_BS: float [B, S] log rho = log pi_train - log pi_rollout, unclamped
            (``exact_log_ratio``; a per-token clamped input gives clamped-term sums); detached here.
        mask_BS: bool or 0/1 [B, S] response tokens.
        spec: the level, the truncation C and the batch normalisation (``correction.importance``).
    Returns:
        weights_BS: float [B, S], no gradient. metrics (IS weights, after truncation and
        normalisation): ``corr/is_{mean,std,max,min}`` over tokens, ``corr/is_seq_{mean,std,max,min}``
        over sequences (per-sequence mean weight), ``corr/is_ratio_fraction_{high,low}`` (untruncated
        rho_level above C / below 1/C; tokens for "token", sequences otherwise) when C is set, and
        ``corr/is_batch_norm_factor`` (the mean divided by; local unless norm_mean is given) when
        batch_normalize. ESS follows from is_mean and is_std after reduction
        (``moe_rl.corrections.derive_metrics``).
    """
    level, clip_max = spec.level, spec.clip
    log_ratio_BS = log_ratio_BS.detach()
    mask_BS = mask_BS.bool()
    maskf_BS = mask_BS.to(log_ratio_BS.dtype)
    log_w_BS = torch.where(
        mask_BS, IS_LEVELS.lookup(level)(log_ratio_BS, maskf_BS), torch.zeros_like(log_ratio_BS)
    )
    w_BS = torch.exp(log_w_BS)
    if clip_max is not None:
        w_BS = w_BS.clamp(max=clip_max)
    w_BS = w_BS * maskf_BS
    metrics: dict[str, MetricValue] = {}
    if spec.batch_normalize:
        if norm_mean is None:
            total, count = is_batch_mean_parts(w_BS, mask_BS, spec)
            norm_mean = total / count.clamp(min=1)
        norm_mean = torch.as_tensor(norm_mean, dtype=w_BS.dtype, device=w_BS.device)
        w_BS = w_BS / norm_mean.clamp(min=torch.finfo(w_BS.dtype).tiny)
        metrics["corr/is_batch_norm_factor"] = norm_mean.detach()
    metrics.update(_is_metrics(w_BS, log_w_BS, mask_BS, level, clip_max))
    return w_BS, metrics


def _is_metrics(
    w_BS: torch.Tensor, log_w_BS: torch.Tensor, mask_BS: torch.Tensor, level: str, clip_max: float | None
) -> dict[str, MetricValue]:
    w64_BS = w_BS.detach().to(torch.float64)
    metrics = stats("corr/is", w64_BS, mask_BS, std=True)
    valid_B = seq_valid(mask_BS)
    seq_w_B = (w64_BS * mask_BS).sum(-1) / mask_BS.sum(-1).clamp(min=1)
    metrics.update(stats("corr/is_seq", seq_w_B, valid_B, std=True))
    if clip_max is not None:
        log_c = math.log(clip_max)
        unit_log_w, unit_keep = (log_w_BS, mask_BS) if level == "token" else (log_w_BS[:, 0], valid_B)
        unit_log_w = unit_log_w.to(torch.float64)
        metrics["corr/is_ratio_fraction_high"] = masked_mean(
            (unit_log_w > log_c).to(torch.float64), unit_keep
        )
        metrics["corr/is_ratio_fraction_low"] = masked_mean(
            (unit_log_w < -log_c).to(torch.float64), unit_keep
        )
    return metrics


# --------------------------------------------------------------------------- rejection

AggregateFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
RS_AGGREGATIONS: Registry[AggregateFn] = Registry("rejection aggregation")  # keys: names.RS_AGGREGATION_NAMES


@RS_AGGREGATIONS.register("token")
def _agg_token(stat_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return stat_BS


@RS_AGGREGATIONS.register("seq_sum")
def _agg_seq_sum(stat_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return (stat_BS * mask_BS.to(stat_BS.dtype)).sum(-1)


@RS_AGGREGATIONS.register("seq_mean")
def _agg_seq_mean(stat_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return _agg_seq_sum(stat_BS, mask_BS) / mask_BS.sum(-1).clamp(min=1).to(stat_BS.dtype)


@RS_AGGREGATIONS.register("seq_max")
def _agg_seq_max(stat_BS: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BS, stat_BS, -inf_like(stat_BS)).amax(-1)


def rejection_mask(
    log_ratio_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    rules: Sequence[RejectionRule],
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """Rejection sampling masks (docs/math.md 2.3), several options AND-combined.

    Each option "<agg>_<k>" aggregates a per-token statistic (k1/k2/k3 of log rho) per token
    ("token") or per sequence ("seq_sum", "seq_mean", "seq_max"; the decision then covers the whole
    sequence). k1 options keep log lo <= agg(log rho) <= log hi with (lo, hi) bounds on
    rho = pi_train / pi_rollout (module docstring: NOT verl's mirrored reading); k2/k3 options keep
    agg(k) <= upper.

    Args:
        log_ratio_BS: float [B, S] log rho = log pi_train - log pi_rollout, unclamped
            (``exact_log_ratio``); detached here. k1 aggregates it exactly; k2 / k3 are computed
            per token from its +-20 clamp.
        mask_BS: bool or 0/1 [B, S] response tokens.
        rules: the parsed rules (``CorrectionSpec.rules``; grammar:
            ``corrections.correction_specs.parse_rs_spec``).
    Returns:
        keep_BS: bool [B, S] = mask AND every option's keep. metrics per option opt:
        ``corr/rs_{opt}_{mean,max,min}`` of the aggregated k statistic (over tokens for token
        options, sequences otherwise), ``corr/rs_{opt}_masked_fraction`` (response tokens rejected),
        ``corr/rs_{opt}_seq_masked_fraction`` (sequences with a rejected token); overall
        ``corr/rs_masked_fraction`` and ``corr/rs_seq_masked_fraction``.
    """
    mask_BS = mask_BS.bool()
    exact_BS = torch.where(mask_BS, log_ratio_BS.detach().to(torch.float64), 0.0)
    clamped_BS = exact_BS.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    valid_B = seq_valid(mask_BS)
    keep_BS = mask_BS.clone()
    metrics: dict[str, MetricValue] = {}
    for rule in rules:
        option, (agg, kind, lo, hi) = rule.option, rule
        k_BS = kl_from_log_ratio(exact_BS if kind == "k1" else clamped_BS, kind)
        stat = RS_AGGREGATIONS[agg](k_BS, mask_BS)  # [B, S] for "token", else [B]
        test = -stat if kind == "k1" else stat  # k1 bounds act on agg(log rho) = -agg(k1)
        opt_keep = (test >= lo) & (test <= hi)
        opt_keep_BS = opt_keep if agg == "token" else opt_keep[:, None].expand_as(mask_BS)
        rejected_BS = mask_BS & ~opt_keep_BS
        unit_keep = mask_BS if agg == "token" else valid_B
        metrics.update(stats(f"corr/rs_{option}", stat, unit_keep))
        metrics.update(_rejected_fractions(f"corr/rs_{option}", rejected_BS, mask_BS, valid_B))
        keep_BS &= opt_keep_BS
    metrics.update(_rejected_fractions("corr/rs", mask_BS & ~keep_BS, mask_BS, valid_B))
    return keep_BS, metrics


def _rejected_fractions(
    prefix: str, rejected_BS: torch.Tensor, mask_BS: torch.Tensor, valid_B: torch.Tensor
) -> dict[str, MetricValue]:
    f64 = torch.float64
    return {
        f"{prefix}_masked_fraction": masked_mean(rejected_BS.to(f64), mask_BS),
        f"{prefix}_seq_masked_fraction": masked_mean(rejected_BS.any(-1).to(f64), valid_B),
    }


# --------------------------------------------------------------------------- diagnostics


def offpolicy_metrics(
    train_logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor, mask_BS: torch.Tensor
) -> dict[str, MetricValue]:
    """Off-policy diagnostics of pi_train vs pi_rollout (docs/math.md 2.6, verl
    ``compute_offpolicy_metrics``).

    pi_train is pi_old in decoupled mode and pi_theta in bypass mode / inside the update.

    Args:
        train_logp_BS, rollout_logp_BS: float [B, S] log-probs of the sampled tokens.
        mask_BS: bool or 0/1 [B, S] response tokens.
    Returns:
        metrics, token means over response tokens and sequence means over sequences with a token
        (all exactly reducible across ranks):
        ``corr/k1_kl`` mean(log pi_rollout - log pi_train) of the exact, unclamped token terms
        (verl ``kl``; may be negative),
        ``corr/k3_kl`` mean(rho - 1 - log rho), ``corr/chi2_token`` mean(rho^2) - 1,
        ``corr/chi2_seq`` mean_seq exp(2 clamp(sum_t log rho_t, +-20)) - 1 (the exact sum),
        ``corr/{training,rollout}_log_ppl`` mean_seq(-mean_t log pi),
        ``corr/{training,rollout}_ppl`` mean_seq exp(-mean_t log pi),
        ``corr/log_ppl_diff`` mean_seq(mean_t log pi_rollout - mean_t log pi_train) and its
        ``_max`` / ``_min``, ``corr/log_ppl_abs_diff`` (TRM's Delta_PPL, docs/math.md 3.5),
        ``corr/ppl_ratio`` mean_seq exp(log_ppl_diff) (= training_ppl / rollout_ppl per sequence).
    """
    f64 = torch.float64
    mask_BS = mask_BS.bool()
    maskf_BS = mask_BS.to(f64)
    train_BS, roll_BS = train_logp_BS.detach().to(f64), rollout_logp_BS.detach().to(f64)
    exact_BS = torch.where(mask_BS, exact_log_ratio(train_BS, roll_BS), 0.0)
    log_ratio_BS = exact_BS.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    valid_B = seq_valid(mask_BS)
    len_B = maskf_BS.sum(-1).clamp(min=1)
    train_mean_B = (train_BS * maskf_BS).sum(-1) / len_B
    roll_mean_B = (roll_BS * maskf_BS).sum(-1) / len_B
    diff_B = roll_mean_B - train_mean_B
    seq_log_ratio_B = exact_BS.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # the exact sum, then the clamp
    return {
        # exact: a mean of log-ratios needs no exp, so no clamp (like the sequence sums above)
        "corr/k1_kl": masked_mean(kl_from_log_ratio(exact_BS, "k1"), mask_BS),
        "corr/k3_kl": masked_mean(kl_from_log_ratio(log_ratio_BS, "k3"), mask_BS),
        "corr/chi2_token": masked_mean(torch.expm1(2 * log_ratio_BS), mask_BS),
        "corr/chi2_seq": masked_mean(torch.expm1(2 * seq_log_ratio_B), valid_B),
        "corr/training_log_ppl": masked_mean(-train_mean_B, valid_B),
        "corr/rollout_log_ppl": masked_mean(-roll_mean_B, valid_B),
        "corr/training_ppl": masked_mean(torch.exp(-train_mean_B), valid_B),
        "corr/rollout_ppl": masked_mean(torch.exp(-roll_mean_B), valid_B),
        "corr/log_ppl_diff": masked_mean(diff_B, valid_B),
        "corr/log_ppl_diff_max": masked_max(diff_B, valid_B),
        "corr/log_ppl_diff_min": masked_min(diff_B, valid_B),
        "corr/log_ppl_abs_diff": masked_mean(diff_B.abs(), valid_B),
        "corr/ppl_ratio": masked_mean(torch.exp(diff_B), valid_B),
    }
