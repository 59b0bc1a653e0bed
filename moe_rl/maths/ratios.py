"""Log-ratios and the KL estimators built on them: the one home of the helpers shared by the losses
(``moe_rl.maths.losses``) and the rollout corrections (``moe_rl.corrections``), below both.

Pure tensor functions (docs/math.md 1; verl ``SAFETY_BOUND``): no torch.distributed, no
``.item()``, no config objects.

Shape suffixes: B sequences, S padded sequence length.
"""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0  # |log ratio| clamp before exp or any KL estimator (verl SAFETY_BOUND)
KL_KINDS = ("k1", "k2", "k3")


def log_ratio(num_logp_BS: torch.Tensor, den_logp_BS: torch.Tensor) -> torch.Tensor:
    """log(p_num / p_den) = num - den per token, clamped to [-20, 20] so exp() stays finite."""
    return (num_logp_BS - den_logp_BS).clamp(-SAFETY_BOUND, SAFETY_BOUND)


def exact_log_ratio(num_logp_BS: torch.Tensor, den_logp_BS: torch.Tensor) -> torch.Tensor:
    """log(p_num / p_den) = num - den per token, NOT clamped: for statistics that sum or average
    over a sequence (sequence / geometric IS weights, seq k1 rejection, chi^2_seq), which clamp the
    aggregate instead. Clamping +30 and -29.5 first would give a sum of -9.5 instead of 0.5."""
    return num_logp_BS - den_logp_BS


def kl_from_log_ratio(log_ratio_BS: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-sample estimators of KL(p || q) from log r = log(q / p), for samples drawn from p.

        k1 = -log r                 unbiased, high variance, either sign per sample
        k2 = (log r)^2 / 2          biased (KL to second order), >= 0, k2(r) = k2(1/r)
        k3 = r - 1 - log r          unbiased, >= 0, asymmetric
    Rollout correction (docs/math.md 1): log r = log rho = log pi_train - log pi_rollout,
    samples from pi_rollout, so these estimate KL(pi_rollout || pi_train). For k2 / k3 the
    caller clamps log r (``log_ratio`` does) so exp stays finite; k1 takes no exp, so the
    corrections pass it the exact log r (``exact_log_ratio``) where they average or sum it.
    """
    if kind == "k1":
        return -log_ratio_BS
    if kind == "k2":
        return 0.5 * log_ratio_BS * log_ratio_BS
    if kind == "k3":
        return torch.expm1(log_ratio_BS) - log_ratio_BS
    raise ValueError(f"unknown KL estimator {kind!r}; known: {list(KL_KINDS)}")
