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

Estimators that need more inputs (the Optimal Token Baseline, docs/math.md 6, needs per-token
old log-probs and sum_v pi^2) take them as extra keyword-only arguments passed by name. Every
registered estimator carries two attributes saying which: ``fn.REQUIRES`` (names that must be
passed, not None) and ``fn.OPTIONAL`` (names that may be passed). The caller computes only what
``REQUIRES`` lists and builds the keywords with ``extra_inputs(fn, available)``:

    fn = get_advantage(name)
    adv_BS, metrics = fn(rewards_B, group_B, mask_BS, std_norm=..., **extra_inputs(fn, available))

(``estimate_advantages(spec, ...)`` does exactly this from an ``AdvantageSpec``,
``moe_rl.maths.policy_specs``.)

Known extra inputs (all [B, S], aligned with ``response_mask_BS``; column t describes token t):
- ``logp_BS``: old log-probs log pi_old(y_t | y_<t) of the taken tokens (the learner's log-prob
  pass, ``moe_rl.learner.logprobs.token_logprobs_energy``).
- ``sum_pi_sq_BS``: sum_v pi_old(v | y_<t)^2, from the same pass.
- ``is_weights_BS``: rollout importance weights (truncated rho-bar), optional.

Names are checked when the config loads, against ``moe_rl.names.ADVANTAGE_NAMES`` (a test keeps
those names equal to ``ADVANTAGES``), and by ``get_advantage``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from moe_rl.maths.policy_specs import AdvantageSpec
from moe_rl.metrics import Mean, MetricValue, Std
from moe_rl.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, dict[str, MetricValue]]]

ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.lookup


def _inputs(
    requires: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator recording the extra keyword inputs an estimator needs (``REQUIRES``) or accepts."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        fn.REQUIRES = tuple(requires)  # type: ignore[attr-defined]
        fn.OPTIONAL = tuple(optional)  # type: ignore[attr-defined]
        return fn

    return deco


def extra_inputs(fn: AdvantageFn, available: Mapping[str, Any]) -> dict[str, Any]:
    """The extra keywords to pass ``fn``: every name in ``fn.REQUIRES`` (a missing or None one
    raises ValueError naming it) and every name in ``fn.OPTIONAL`` that ``available`` holds and is
    not None. Other entries of ``available`` are left out."""
    missing = [k for k in fn.REQUIRES if available.get(k) is None]
    if missing:
        raise ValueError(
            f"advantage estimator {fn.__name__} needs {missing}; the caller did not provide them"
        )
    out = {k: available[k] for k in fn.REQUIRES}
    out.update({k: available[k] for k in fn.OPTIONAL if available.get(k) is not None})
    return out


def estimate_advantages(
    spec: AdvantageSpec,
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    response_mask_BS: torch.Tensor,
    available: Mapping[str, Any],
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """The advantages of ``spec``'s estimator, handed the extra inputs it asks for from
    ``available`` (``extra_inputs``)."""
    fn = get_advantage(spec.name)
    return fn(rewards_B, group_B, response_mask_BS, std_norm=spec.std_norm, **extra_inputs(fn, available))


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
        "r_B": r_B,
        "count_B": count_G[index_B],
        "sum_B": sum_G[index_B],
        "mean_B": mean_B,
        "sq_dev_B": sq_dev_G[index_B],
        "const_B": const_G[index_B],
        "num_groups": torch.full((), ids_G.shape[0], dtype=torch.float64, device=r_B.device),
        "num_const_groups": const_G.sum().to(torch.float64),
    }


def _broadcast_and_metrics(
    adv_B: torch.Tensor, response_mask_BS: torch.Tensor, stats: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
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
@_inputs()
def grpo(
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    std_norm: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
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
@_inputs()
def rloo(
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    std_norm: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """RLOO: A_i = r_i - mean_{j != i, j in g} r_j = n/(n-1) * (r_i - mean_g).

    ``std_norm`` and ``eps`` are accepted so all estimators share one signature; RLOO ignores them
    (its baseline is unnormalised by definition). A group of one, or of equal rewards, gets 0.
    """
    del std_norm, eps
    s = _group_stats(rewards_B, group_B)
    loo_mean_B = (s["sum_B"] - s["r_B"]) / (s["count_B"] - 1).clamp(min=1)
    adv_B = torch.where(s["const_B"], torch.zeros_like(loo_mean_B), s["r_B"] - loo_mean_B)
    return _broadcast_and_metrics(adv_B, response_mask_BS, s)


# ----------------------------------------------------------------------------- Optimal Token Baseline
# docs/math.md 6.2 [C verl compute_optimal_token_baseline_advantage / compute_multi_turn_...]; 6.3 [I].


def _response_positions(mask_BS: torch.Tensor, compact: bool) -> torch.Tensor:
    """Position of each token inside its response, the index OTB aligns sequences on: int64 [B, S].

    compact=False: t - (first response column), so masked-out tokens inside the response (tool
    output) still advance the position (verl's response-tensor index). compact=True: the rank of
    the token among the response tokens (cumsum of the mask - 1), tool tokens removed (verl TIR).
    Values off the response are meaningless (callers mask them); all are clamped into [0, S).
    """
    S = mask_BS.shape[1]
    if compact:
        pos_BS = mask_BS.long().cumsum(1) - 1
    else:
        first_B = mask_BS.long().argmax(1)  # the first True (0 for an empty row, which is all masked)
        pos_BS = torch.arange(S, device=mask_BS.device)[None, :] - first_B[:, None]
    return pos_BS.clamp(0, S - 1)


def _zero_tail_BS(
    len_B: torch.Tensor, index_B: torch.Tensor, num_groups: int, active_B: torch.Tensor, pos_BS: torch.Tensor
) -> torch.Tensor:
    """handle_zero_tail: true where a sequence that is *strictly* the longest of its group (one
    sequence at the max length) is at a position >= the second-longest length of the group."""
    zeros_G = torch.zeros(num_groups, dtype=len_B.dtype, device=len_B.device)
    max_B = zeros_G.scatter_reduce(0, index_B, len_B, reduce="amax", include_self=False)[index_B]
    at_max_B = len_B == max_B
    num_at_max_B = zeros_G.index_add(0, index_B, at_max_B.to(len_B.dtype))[index_B]
    below_B = torch.where(at_max_B, torch.full_like(len_B, -1), len_B)
    second_B = torch.full_like(zeros_G, -1).scatter_reduce(0, index_B, below_B, reduce="amax")[index_B]
    unique_longest_B = at_max_B & (num_at_max_B == 1) & active_B & (second_B >= 0)
    return unique_longest_B[:, None] & (pos_BS >= second_B[:, None])


def _otb(
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    response_mask_BS: torch.Tensor,
    sum_pi_sq_BS: torch.Tensor | None,
    logp_BS: torch.Tensor | None,
    is_weights_BS: torch.Tensor | None,
    eps: float,
    handle_zero_tail: bool,
    compact: bool,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    missing = [n for n, v in (("sum_pi_sq_BS", sum_pi_sq_BS), ("logp_BS", logp_BS)) if v is None]
    if missing:
        raise ValueError(f"OTB advantage needs {missing} (the learner's old-log-prob pass computes them)")
    mask_BS = response_mask_BS.to(torch.bool)
    m_BS = mask_BS.to(torch.float64)
    S = mask_BS.shape[1]
    # per-token energy w_j = ||e_y - pi_j||^2 >= 0 exactly; the clamp only removes rounding noise
    w_BS = (1.0 - 2.0 * logp_BS.detach().double().exp() + sum_pi_sq_BS.detach().double()).clamp(min=0.0)
    if is_weights_BS is not None:
        w_BS = w_BS * is_weights_BS.detach().double() ** 2
    W_BS = (w_BS * m_BS).cumsum(1)  # realized energy W_t, masked cumsum along the sequence
    r_B = rewards_B.detach().to(torch.float64)
    ids_G, index_B = torch.unique(group_B, return_inverse=True)
    G = ids_G.shape[0]
    len_B = mask_BS.sum(1)
    member_B = len_B > 0 if compact else torch.ones_like(len_B, dtype=torch.bool)
    count_B = torch.zeros(G, dtype=torch.float64, device=r_B.device).index_add(0, index_B, member_B.double())[
        index_B
    ]
    pos_BS = _response_positions(mask_BS, compact)
    # baseline B*_t = sum_i G_t W_t m_t / (sum_i W_t m_t + eps) per (group, position): scatter-add
    # into a [G * S] table. The scalar reward sits on the last response token, so G_t = r_i.
    flat_BS = index_B[:, None] * S + pos_BS
    wm_BS = W_BS * m_BS
    num = torch.zeros(G * S, dtype=torch.float64, device=r_B.device).index_add(
        0, flat_BS.flatten(), (r_B[:, None] * wm_BS).flatten()
    )
    den = torch.zeros_like(num).index_add(0, flat_BS.flatten(), wm_BS.flatten())
    active_B = (count_B > 1) & member_B  # a group of one gets baseline 0 (advantage = return)
    den = den + eps
    b_star = torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), torch.zeros_like(num))
    base_BS = b_star[flat_BS] * active_B[:, None]  # den == 0 (eps = 0, no energy) -> 0, the eps > 0 limit
    if handle_zero_tail:
        base_BS = base_BS.masked_fill(_zero_tail_BS(len_B, index_B, G, active_B, pos_BS), 0.0)
    adv_BS = (r_B[:, None] - base_BS) * m_BS
    return adv_BS.to(torch.float32), _token_metrics(adv_BS, m_BS, r_B, index_B, G)


def _token_metrics(
    adv_BS: torch.Tensor, m_BS: torch.Tensor, r_B: torch.Tensor, index_B: torch.Tensor, num_groups: int
) -> dict[str, MetricValue]:
    """The keys every estimator logs (see ``_broadcast_and_metrics``), from token advantages."""
    zeros_G = torch.zeros(num_groups, dtype=torch.float64, device=r_B.device)
    max_G = zeros_G.scatter_reduce(0, index_B, r_B, reduce="amax", include_self=False)
    min_G = zeros_G.scatter_reduce(0, index_B, r_B, reduce="amin", include_self=False)
    num_tokens = m_BS.sum()
    return {
        "adv/mean": Mean(adv_BS.sum(), num_tokens),
        "adv/std": Std(adv_BS.sum(), (adv_BS * adv_BS).sum(), num_tokens),
        "adv/zero_std_group_frac": Mean(
            (max_G == min_G).sum().to(torch.float64),
            torch.full((), num_groups, dtype=torch.float64, device=r_B.device),
        ),
    }


@register_advantage("otb")
@_inputs(requires=("sum_pi_sq_BS", "logp_BS"), optional=("is_weights_BS",))
def otb(
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    std_norm: bool = False,
    eps: float = 1e-8,
    sum_pi_sq_BS: torch.Tensor | None = None,
    logp_BS: torch.Tensor | None = None,
    is_weights_BS: torch.Tensor | None = None,
    handle_zero_tail: bool = False,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """Optimal Token Baseline (docs/math.md 6.2, verl ``optimal_token_baseline``): per-token baselines.

    For group g and response position t (counted from the first response token; masked-out
    tokens inside the response still advance t):
        w_j  = 1 - 2 pi_j(y_j) + sum_v pi_j(v)^2      (pi_j(y_j) = exp(logp_BS), clamped >= 0)
        w_j *= is_weights_BS[j]^2                      (only if given: rollout IS on)
        W_t  = sum_{j <= t} w_j m_j                    (realized energy; masked cumsum)
        B*_t = sum_i G_t^i W_t^i m_t^i / (sum_i W_t^i m_t^i + eps)
        A_t  = (G_t - B*_t) m_t,  with G_t = r_i (reward on the last response token)
    A group of one sequence (N = 1) gets baseline 0, so A_t = r_i, as the reference does; run
    with N > 1 (docs/math.md 9). A group of equal rewards gets A ~ r * eps / (sum W + eps), not an
    exact 0 (reference behaviour). ``handle_zero_tail`` (default False here): if one sequence is
    strictly the longest in its group, its baseline at positions >= the second-longest response
    length (the count of response tokens) is 0.

    Args (beyond the shared ones; see the module docstring): sum_pi_sq_BS, logp_BS (required,
    ValueError naming them if missing), is_weights_BS (optional), eps, handle_zero_tail.
    ``std_norm`` is accepted for the shared signature and ignored.
    Returns: (advantages_BS float32, metrics) as every estimator.
    """
    del std_norm
    return _otb(
        rewards_B,
        group_B,
        response_mask_BS,
        sum_pi_sq_BS,
        logp_BS,
        is_weights_BS,
        eps,
        handle_zero_tail,
        compact=False,
    )


@register_advantage("otb_multiturn")
@_inputs(requires=("sum_pi_sq_BS", "logp_BS"), optional=("is_weights_BS",))
def otb_multiturn(
    rewards_B: torch.Tensor,
    group_B: torch.Tensor,
    response_mask_BS: torch.Tensor,
    *,
    std_norm: bool = False,
    eps: float = 1e-8,
    sum_pi_sq_BS: torch.Tensor | None = None,
    logp_BS: torch.Tensor | None = None,
    is_weights_BS: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """OTB for multi-turn / tool-integrated sequences (verl ``tir_optimal_token_baseline``).

    As ``otb``, but positions are compacted first: tool / environment tokens (false in
    ``response_mask_BS``) are removed, so position t is the t-th model-generated token of each
    sequence, and ``handle_zero_tail`` defaults to True. A sequence with no response token is
    left out of its group's count (so its one partner, if any, forms a group of one).
    """
    del std_norm
    return _otb(
        rewards_B,
        group_B,
        response_mask_BS,
        sum_pi_sq_BS,
        logp_BS,
        is_weights_BS,
        eps,
        handle_zero_tail,
        compact=True,
    )
