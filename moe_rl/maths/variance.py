"""Gradient-variance proxies for any advantage estimator (docs/math.md 6.4 [C verl
``compute_variance_proxy_metrics``]).

Shape suffixes: B sequences, S padded sequence length.

Per sequence tau (m the response mask, Abar the masked mean advantage):
    w_t       = 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2        (the logit-gradient energy, docs/math.md 6.2)
    W(tau)    = sum_t w_t m_t                              (IS-weighted by rho_t^2 when IS is on)
    Abar(tau) = sum_t A_t m_t / max(sum_t m_t, 1)          (0 for an empty response, as verl)

    proxy2 total power  P = mean_tau[Abar^2 * max(W, 0)]                 (on-policy)
                        P = mean_tau[rhobar_seq^2 * Abar^2 * max(W_orig, 0)]   (rollout IS on)
        rhobar_seq = masked mean of the IS weights over the sequence; W_orig = sum_t w_t m_t
        without the IS factor, recovered as verl does by dividing by max(rho_t^2, 1e-10) (so tokens
        whose IS weight is 0 drop out).
    proxy1 signal strength S = ||g||^2, the squared global gradient norm of the step.
    proxy3 pure noise   = max(0, (P - S) / (N - 1)),  N = number of sequences in the batch.
    expected_a_squared = mean_tau Abar^2; expected_w = mean_tau W (IS-weighted when IS is on).

Means run over all B rows (every sequence of the step, empty responses included, as verl).
P and S are in different units (a logit-space proxy of the per-sequence score norm vs the
parameter gradient of the normalised loss), so the noise proxy is a trend indicator, not a
variance; this is verl's definition, kept as is.

Reduction: ``variance_proxies`` returns local ``Mean``/``Sum`` metrics (exact over ranks and
micro-batches); S needs the gradient norm, known only after the backward, and the noise proxy
is a difference of global means, so the caller reduces with ``reduce_metrics`` and then calls
``finalize_variance_proxies(reduced, grad_norm)``, which adds ``adv/proxy_signal`` and
``adv/proxy_noise``.
"""

from __future__ import annotations

import math

import torch

from moe_rl.metrics import Mean, MetricValue, Sum


def variance_proxies(
    advantages_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    sum_pi_sq_BS: torch.Tensor,
    logp_BS: torch.Tensor,
    is_weights_BS: torch.Tensor | None = None,
) -> dict[str, MetricValue]:
    """Local parts of the docs/math.md 6.4 proxies for one rank's batch (see the module docstring).

    Args:
        advantages_BS: the advantages the loss uses, [B, S].
        mask_BS: response mask, bool or 0/1 [B, S].
        sum_pi_sq_BS, logp_BS: from ``token_logprobs_energy`` on the old policy, [B, S].
        is_weights_BS: rollout IS weights (truncated rho-bar) [B, S], or None (on-policy).
    Returns:
        metrics: ``adv/proxy_total_power`` (Mean), ``adv/proxy_expected_a_sq`` (Mean),
        ``adv/proxy_expected_w`` (Mean) and ``adv/proxy_num_seqs`` (Sum).
    """
    m_BS = mask_BS.to(torch.float64)
    len_B = m_BS.sum(1)
    denom_B = len_B.clamp(min=1.0)
    a_B = (advantages_BS.detach().double() * m_BS).sum(1) / denom_B
    w_BS = (1.0 - 2.0 * logp_BS.detach().double().exp() + sum_pi_sq_BS.detach().double()) * m_BS
    if is_weights_BS is None:
        w_B = w_BS.sum(1)
        power_B = a_B**2 * w_B.clamp(min=0.0)
    else:
        rho_BS = is_weights_BS.detach().double()
        rho_sq_BS = rho_BS**2
        w_B = (w_BS * rho_sq_BS).sum(1)
        w_orig_B = (w_BS * rho_sq_BS / rho_sq_BS.clamp(min=1e-10)).sum(1).clamp(min=0.0)  # verl's divide-back
        rho_seq_B = (rho_BS * m_BS).sum(1) / denom_B
        power_B = rho_seq_B**2 * a_B**2 * w_orig_B
    num_seqs = torch.full((), a_B.shape[0], dtype=torch.float64, device=a_B.device)
    return {
        "adv/proxy_total_power": Mean(power_B.sum(), num_seqs),
        "adv/proxy_expected_a_sq": Mean((a_B**2).sum(), num_seqs),
        "adv/proxy_expected_w": Mean(w_B.sum(), num_seqs),
        "adv/proxy_num_seqs": Sum(num_seqs),
    }


def finalize_variance_proxies(reduced: dict[str, float], grad_norm: float) -> dict[str, float]:
    """Add the signal and noise proxies to reduced metrics (from ``reduce_metrics``).

    Args:
        reduced: the reduced step metrics; must hold ``adv/proxy_total_power`` and
            ``adv/proxy_num_seqs``.
        grad_norm: the global (pre-clip) gradient norm of the step; with several optimizer steps
            per RL step pass their mean, as verl does.
    Returns:
        a new dict: ``reduced`` plus ``adv/proxy_signal`` = grad_norm^2 and ``adv/proxy_noise`` =
        max(0, (P - S) / (N - 1)) (NaN when N <= 1).
    """
    signal = float(grad_norm) ** 2
    power, n = reduced["adv/proxy_total_power"], reduced["adv/proxy_num_seqs"]
    noise = max(0.0, (power - signal) / (n - 1)) if n > 1 else math.nan
    return {**reduced, "adv/proxy_signal": signal, "adv/proxy_noise": noise}
