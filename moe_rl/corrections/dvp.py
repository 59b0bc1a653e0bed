"""Dynamic Vocabulary Pruning (DVP; arXiv 2512.23087, docs/math.md 4): a safe vocabulary per
position, log-probs renormalised over it, and its metrics.

FIDELITY: the paper body was not reachable (docs/math.md 4.1 is a GAP). The safe-set rule, the
threshold and the handling of sampled tokens outside the set below are the project's proposal
[I], not the paper's. Default rule "relative" (min-p style): V_safe(c) = {v : p(v|c) >= rho_min *
max_u p(u|c)}; rule and threshold are configurable (``SAFE_SET_RULES``).

Contract (docs/math.md 4.3): the safe set is computed ONCE per position from one distribution
(e.g. the rollout engine's, or pi_old's) and then BOTH policies are restricted to it,
pi~(v|c) = pi(v|c) 1[v in V_safe] / sum_{u in V_safe} pi(u|c), so IS ratios compare log-probs over
the same support. A sampled token outside the set has no restricted log-prob: it is flagged
(``inside_BS`` false, log-prob -inf) and the caller drops it from the loss (mask &= inside_BS).

Pure tensor functions; metrics follow ``moe_rl.metrics``. Shape suffixes: B sequences, S padded
sequence length, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.corrections.masked import masked_max, masked_mean, masked_min
from moe_rl.maths.ratios import kl_from_log_ratio, log_ratio
from moe_rl.metrics import MetricValue
from moe_rl.registry import Registry

__all__ = [
    "DEFAULT_RHO_MIN",
    "SAFE_SET_RULES",
    "RestrictedLogprobs",
    "dvp_metrics",
    "restricted_logprobs",
    "safe_set",
    "safe_set_for",
]

DEFAULT_RHO_MIN = 1e-3  # [I] docs/math.md 4.1 is a GAP: no threshold from the paper

SafeSetRule = Callable[[torch.Tensor, float], torch.Tensor]
SAFE_SET_RULES: Registry[SafeSetRule] = Registry("DVP safe-set rule")


@SAFE_SET_RULES.register("relative")
def _relative_rule(logits_BSV: torch.Tensor, rho_min: float) -> torch.Tensor:
    """p(v) >= rho_min * p_max  <=>  z_v >= z_max + log rho_min (logit space: no softmax copy)."""
    if not 0 < rho_min <= 1:
        raise ValueError(f"relative rule: rho_min must be in (0, 1], got {rho_min}")
    z_max_BS1 = logits_BSV.amax(-1, keepdim=True)
    return logits_BSV >= z_max_BS1 + math.log(rho_min)


@SAFE_SET_RULES.register("top_p")
def _top_p_rule(logits_BSV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: the smallest set of most likely tokens whose mass reaches top_p (ties by sort order).

    Memory: sorts a [B, S, V] copy (values + int64 indices); prefer "relative" on large V.
    """
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p rule: top_p must be in (0, 1], got {top_p}")
    probs_sorted, order = torch.softmax(logits_BSV.float(), dim=-1).sort(dim=-1, descending=True)
    mass_before = probs_sorted.cumsum(-1) - probs_sorted  # mass of the strictly more likely tokens
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@torch.no_grad()
def safe_set(
    logits_BSV: torch.Tensor, *, rule: str = "relative", threshold: float = DEFAULT_RHO_MIN
) -> torch.Tensor:
    """The safe vocabulary at every position (no gradient).

    Args:
        logits_BSV: float [B, S, V] logits or log-probs of the distribution defining the set
            (temperature-scaled as sampled).
        rule: a ``SAFE_SET_RULES`` name: "relative" (threshold = rho_min) or "top_p" (threshold = p).
    Returns:
        safe_BSV: bool [B, S, V]; always contains the most likely token.
    """
    return SAFE_SET_RULES.lookup(rule)(logits_BSV.detach(), threshold)


def safe_set_for(spec: DvpSpec, logits_BSV: torch.Tensor) -> torch.Tensor:
    """The safe vocabulary ``spec`` (``correction.dvp``) defines at every position: its rule at its
    threshold (``safe_set``); what the engines call. ValueError when the spec is off (no set)."""
    if not spec.on:
        raise ValueError("DVP is off (threshold 0): there is no safe set")
    return safe_set(logits_BSV, rule=spec.rule, threshold=spec.threshold)


class RestrictedLogprobs(NamedTuple):
    """Per sampled token, float [B, S] unless noted.

    logp_BS: log pi~(y_t) over the safe set (-inf where the token is outside it).
    full_logp_BS: log pi(y_t) over the full vocabulary.
    log_safe_mass_BS: log sum_{v in V_safe} pi(v) (<= 0); pruned tail mass = 1 - exp(this).
    inside_BS: bool, y_t is in the safe set.
    """

    logp_BS: torch.Tensor
    full_logp_BS: torch.Tensor
    log_safe_mass_BS: torch.Tensor
    inside_BS: torch.Tensor


def restricted_logprobs(
    logits_BSV: torch.Tensor, safe_BSV: torch.Tensor, tokens_BS: torch.Tensor
) -> RestrictedLogprobs:
    """Log-probs of the sampled tokens renormalised over the safe set (differentiable in logits).

    log pi~(y) = z_y - logsumexp_{v in V_safe} z_v, i.e. log_softmax(logits.masked_fill(~safe, -inf))
    at y, without materialising the log_softmax: one masked [B, S, V] copy (plus a float32 copy
    if the logits are half precision). Outside tokens get -inf with zero gradient.

    Args:
        logits_BSV: float [B, S, V] logits at the positions that predict tokens_BS.
        safe_BSV: bool [B, S, V] from ``safe_set`` (computed once, shared by both policies).
        tokens_BS: int64 [B, S] sampled tokens.
    """
    logits = logits_BSV if logits_BSV.dtype in (torch.float32, torch.float64) else logits_BSV.float()
    idx_BS1 = tokens_BS.long().unsqueeze(-1)
    z_y_BS = logits.gather(-1, idx_BS1).squeeze(-1)
    lse_full_BS = torch.logsumexp(logits, dim=-1)
    lse_safe_BS = torch.logsumexp(logits.masked_fill(~safe_BSV, -math.inf), dim=-1)
    inside_BS = safe_BSV.gather(-1, idx_BS1).squeeze(-1)
    logp_BS = torch.where(inside_BS, z_y_BS - lse_safe_BS, torch.full_like(z_y_BS, -math.inf))
    return RestrictedLogprobs(logp_BS, z_y_BS - lse_full_BS, lse_safe_BS - lse_full_BS, inside_BS)


def dvp_metrics(
    train: RestrictedLogprobs, rollout: RestrictedLogprobs, safe_BSV: torch.Tensor, mask_BS: torch.Tensor
) -> dict[str, MetricValue]:
    """DVP metrics over response tokens (docs/math.md 4.4 list).

    Args:
        train, rollout: ``restricted_logprobs`` of pi_train and pi_rollout over the same safe set.
            When the engine reports only the sampled token's full and safe-set-normalised
            log-probs, build ``rollout`` from those (full_logp, logp, log_safe_mass, inside).
        safe_BSV: bool [B, S, V] the safe set; mask_BS: bool or 0/1 [B, S] response tokens.
    Returns:
        ``corr/dvp_pruned_mass`` (+ ``_max``): 1 - rollout mass of the safe set, per token;
        ``corr/dvp_pruned_mass_train``: the same under pi_train; ``corr/dvp_outside_frac``: sampled
        tokens outside the safe set; ``corr/dvp_safe_size`` (+ ``_max``, ``_min``): |V_safe|;
        ``corr/dvp_k3_before``: mean k3 of full-vocabulary log rho; ``corr/dvp_k3_after``: mean k3 of
        restricted log rho over the tokens inside the set.
    """
    f64 = torch.float64
    mask_BS = mask_BS.bool()
    inside_BS = train.inside_BS & rollout.inside_BS
    pruned_BS = -torch.expm1(rollout.log_safe_mass_BS.detach().to(f64))
    size_BS = safe_BSV.sum(-1).to(f64)
    lr_full_BS = log_ratio(train.full_logp_BS.detach().to(f64), rollout.full_logp_BS.detach().to(f64))
    restricted_train = torch.where(inside_BS, train.logp_BS.detach().to(f64), 0.0)
    restricted_roll = torch.where(inside_BS, rollout.logp_BS.detach().to(f64), 0.0)
    lr_restricted_BS = log_ratio(restricted_train, restricted_roll)
    return {
        "corr/dvp_pruned_mass": masked_mean(pruned_BS, mask_BS),
        "corr/dvp_pruned_mass_max": masked_max(pruned_BS, mask_BS),
        "corr/dvp_pruned_mass_train": masked_mean(
            -torch.expm1(train.log_safe_mass_BS.detach().to(f64)), mask_BS
        ),
        "corr/dvp_outside_frac": masked_mean((~inside_BS).to(f64), mask_BS),
        "corr/dvp_safe_size": masked_mean(size_BS, mask_BS),
        "corr/dvp_safe_size_max": masked_max(size_BS, mask_BS),
        "corr/dvp_safe_size_min": masked_min(size_BS, mask_BS),
        "corr/dvp_k3_before": masked_mean(kl_from_log_ratio(lr_full_BS, "k3"), mask_BS),
        "corr/dvp_k3_after": masked_mean(kl_from_log_ratio(lr_restricted_BS, "k3"), mask_BS & inside_BS),
    }
