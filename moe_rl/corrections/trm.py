"""Trust Region Masking (TRM; arXiv 2512.23075, docs/math.md 3): per-token KL, the sequence
mask (max / average criteria, combined or alone, and the length-neutral LN-TRM and SER variants),
and the error-bound calculator of docs/math.md 3.2.

Pure tensor functions; metrics follow ``moe_rl.metrics``. Shape suffixes: B sequences, S padded
sequence length, V vocabulary.

Per-token divergence D_KL(c_t) = KL(pi_roll(.|c_t) || pi_train(.|c_t)) (rollout policy first,
docs/math.md 3.1), at the response positions only:
- exact, over the full vocabulary, when the engine returns the rollout distribution of every
  generated position (the built-in engine can): ``exact_kl_tokens``;
- sample-based otherwise (vLLM returns top-k only): k2 = (log rho)^2 / 2 for the max criterion
  and k3 = rho - 1 - log rho for the average (docs/math.md 3.3; ``sample_kl_tokens``). The paper's
  guarantee holds only with exact KL.

Which pi_train (a config choice, ``TRM_REFERENCES``): "theta" evaluates the statistic against
pi_theta of the current forward pass inside every loss call (the paper's Algorithm 1 and its
guarantee: accepted sequences have max_t D_KL(pi_roll || pi_theta) <= delta); "old" evaluates it
once per batch against pi_old (cheaper, no guarantee once theta moves). The functions here do not
care: pass the log-probs / logits of the policy chosen.

Loss normaliser: masked sequences contribute zero and the loss is still divided by the TOTAL
batch (docs/math.md 3.3, "not the accepted count"): pass ``normalizer`` counted before masking to
``moe_rl.maths.losses.decoupled_ppo_loss`` / ``corrected_loss.bypass_loss`` with ``keep=keep_B``.
"""

from __future__ import annotations

import math

import torch

from moe_rl.corrections.correction_specs import TrmSpec
from moe_rl.corrections.masked import masked_max, masked_mean, seq_valid
from moe_rl.maths.ratios import SAFETY_BOUND, kl_from_log_ratio, log_ratio
from moe_rl.metrics import MetricValue
from moe_rl.names import LENGTH_NEUTRAL_NAMES, TRM_KL_SOURCE_NAMES, TRM_REFERENCE_NAMES

__all__ = [
    "ACCEPT_ALARM_BELOW",
    "LENGTH_NEUTRAL",
    "TRM_KL_SOURCES",
    "TRM_REFERENCES",
    "exact_kl_tokens",
    "sample_kl_tokens",
    "trm_bounds",
    "trm_keep",
    "trm_mask",
]

TRM_REFERENCES = TRM_REFERENCE_NAMES  # the names the config accepts (moe_rl.names)
LENGTH_NEUTRAL = LENGTH_NEUTRAL_NAMES
TRM_KL_SOURCES = TRM_KL_SOURCE_NAMES  # exact: full rollout distributions (built-in engine); sample: k2/k3
ACCEPT_ALARM_BELOW = 0.7  # docs/math.md 3.3: monitor the acceptance rate; above 70% is recommended


# --------------------------------------------------------------------------- per-token KL


@torch.no_grad()
def exact_kl_tokens(
    rollout_logits_BSV: torch.Tensor,
    train_logits_BSV: torch.Tensor,
    mask_BS: torch.Tensor | None = None,
    *,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Exact per-position KL(pi_roll || pi_train) = sum_v p_roll(v) (log p_roll(v) - log p_train(v)).

    Both inputs are unnormalised logits or log-probs over the same full vocabulary, already
    temperature-scaled the way the tokens were sampled (log_softmax is applied here; it leaves
    log-probs unchanged). Computed without gradient in float32, ``chunk_tokens`` positions at a time,
    so the extra memory is O(chunk_tokens * V), not more [B, S, V] copies.

    Args:
        rollout_logits_BSV: float [B, S, V] the rollout engine's distribution at each position.
        train_logits_BSV: float [B, S, V] pi_train's logits at the same positions.
        mask_BS: bool [B, S] positions to compute (others are 0); None = all.
    Returns:
        kl_BS: float32 [B, S], >= 0 (up to rounding), 0 outside the mask.
    """

    def rows_kl(roll_NV: torch.Tensor, train_NV: torch.Tensor) -> torch.Tensor:
        log_p, log_q = torch.log_softmax(roll_NV, dim=-1), torch.log_softmax(train_NV, dim=-1)
        return (log_p.exp() * (log_p - log_q)).sum(-1)

    return chunked_kl(rollout_logits_BSV, train_logits_BSV, mask_BS, chunk_tokens, rows_kl)


def chunked_kl(
    rollout_logits_BSV: torch.Tensor,
    train_logits_BSV: torch.Tensor,
    mask_BS: torch.Tensor | None,
    chunk_tokens: int,
    rows_kl,
) -> torch.Tensor:
    """``rows_kl(rollout_NV, train_NV) -> kl_N`` (float32 inputs) over the masked positions,
    ``chunk_tokens`` at a time; float32 [B, S], 0 outside the mask. Shared by ``exact_kl_tokens``
    and its vocabulary-parallel form (learner/logprobs.py)."""
    if rollout_logits_BSV.shape != train_logits_BSV.shape:
        raise ValueError(
            f"shape mismatch: {tuple(rollout_logits_BSV.shape)} vs {tuple(train_logits_BSV.shape)}"
        )
    *lead, num_v = train_logits_BSV.shape
    roll_NV = rollout_logits_BSV.reshape(-1, num_v)
    train_NV = train_logits_BSV.reshape(-1, num_v)
    kl_N = torch.zeros(roll_NV.shape[0], dtype=torch.float32, device=roll_NV.device)
    rows_N = (
        torch.arange(roll_NV.shape[0], device=roll_NV.device)
        if mask_BS is None
        else mask_BS.reshape(-1).nonzero().squeeze(-1)
    )
    for start in range(0, rows_N.numel(), chunk_tokens):  # chunks of positions, not tokens one by one
        idx = rows_N[start : start + chunk_tokens]
        kl_N[idx] = rows_kl(roll_NV[idx].float(), train_NV[idx].float())
    return kl_N.reshape(lead)


def sample_kl_tokens(log_ratio_BS: torch.Tensor, kind: str) -> torch.Tensor:
    """Sample-based per-token statistic from log rho = log pi_train - log pi_rollout (detached,
    clamped +-20): "k2" for the max criterion, "k3" for the average (docs/math.md 3.3)."""
    if kind not in ("k2", "k3"):
        raise ValueError(f"TRM sample statistic must be k2 (max) or k3 (avg), got {kind!r}")
    return kl_from_log_ratio(log_ratio_BS.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND), kind)


# --------------------------------------------------------------------------- the mask


def trm_mask(
    spec: TrmSpec,
    train_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    exact_kl_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """The TRM sequence keep mask of ``spec`` (docs/math.md 3.3): what each criterion bounds is
    decided here. ``spec.kl`` "exact": every criterion reads the exact per-token KL(pi_rollout ||
    pi_train) (``exact_kl_BS``, from the engine's full distributions; ``exact_kl_tokens``);
    "sample": the max criterion reads k2 and the average criterion k3 of log rho
    (``sample_kl_tokens``). The length-neutral criteria read log rho itself.

    Args:
        spec: the TRM spec (``spec.on``: at least one criterion).
        train_logp_BS, rollout_logp_BS: float [B, S] log-probs of the sampled tokens under the
            policy TRM is evaluated against (pi_old or pi_theta, ``spec.reference``) and the rollout's.
        mask_BS: bool or 0/1 [B, S] response tokens.
        exact_kl_BS: float [B, S] the exact per-token KL; needed when ``spec.kl`` is "exact".
    Returns:
        (keep_B, metrics) as ``trm_keep``.
    """
    log_ratio_BS = log_ratio(train_logp_BS.detach(), rollout_logp_BS.detach())
    if spec.kl == "exact":
        if exact_kl_BS is None:
            raise ValueError("correction.trm.kl=exact needs the rollout engine's full distributions")
        max_kl_BS, avg_kl_BS = exact_kl_BS.detach(), None
    else:
        max_kl_BS, avg_kl_BS = sample_kl_tokens(log_ratio_BS, "k2"), sample_kl_tokens(log_ratio_BS, "k3")
    return trm_keep(
        max_kl_BS,
        mask_BS,
        max_delta=spec.max or None,
        avg_delta=spec.avg or None,
        avg_kl_tok_BS=avg_kl_BS,
        length_neutral=spec.length_neutral,
        log_ratio_BS=log_ratio_BS,
        ln_threshold=spec.ln_threshold,
        ln_eps=spec.ln_eps,
        ln_delta=spec.ln_delta,
    )


def _ln_weights(mask_BS: torch.Tensor, eps: float, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LN-TRM weights w_t = min(1, (T-t) eps, sqrt((T-t) delta / 2)) and Z(T) = sum_t w_t.

    t = 1..T counts response tokens (the cumulative mask), T = the sequence's response length.
    """
    maskf_BS = mask_BS.to(torch.float64)
    t_BS = maskf_BS.cumsum(-1)
    remaining_BS = (maskf_BS.sum(-1, keepdim=True) - t_BS).clamp(min=0)
    w_BS = (
        torch.minimum(
            torch.minimum(torch.ones_like(remaining_BS), remaining_BS * eps),
            torch.sqrt(remaining_BS * delta / 2),
        )
        * maskf_BS
    )
    return w_BS, w_BS.sum(-1)


def _length_neutral_score(
    log_ratio_BS: torch.Tensor, mask_BS: torch.Tensor, kind: str, ln_eps: float | None, ln_delta: float | None
) -> torch.Tensor:
    """Per-sequence score: SER (1/T) sum_t |rho_t - 1|, or LN-TRM W(y) / Z(T) (0 when Z = 0)."""
    maskf_BS = mask_BS.to(torch.float64)
    dev_BS = torch.expm1(log_ratio_BS.detach().to(torch.float64).clamp(-SAFETY_BOUND, SAFETY_BOUND)).abs()
    if kind == "ser":
        return (dev_BS * maskf_BS).sum(-1) / maskf_BS.sum(-1).clamp(min=1)
    if ln_eps is None or ln_delta is None:
        raise ValueError("length_neutral='ln' needs ln_eps and ln_delta (the eps, delta of its weights)")
    w_BS, z_B = _ln_weights(mask_BS, ln_eps, ln_delta)
    score_B = (dev_BS * w_BS).sum(-1)
    return torch.where(z_B > 0, score_B / z_B.clamp(min=torch.finfo(z_B.dtype).tiny), torch.zeros_like(z_B))


def trm_keep(
    kl_tok_BS: torch.Tensor | None,
    mask_BS: torch.Tensor,
    *,
    max_delta: float | None = None,
    avg_delta: float | None = None,
    avg_kl_tok_BS: torch.Tensor | None = None,
    length_neutral: str = "none",
    log_ratio_BS: torch.Tensor | None = None,
    ln_threshold: float | None = None,
    ln_eps: float | None = None,
    ln_delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """TRM sequence mask over given per-token statistics, docs/math.md 3.3 (paper Algorithm 1 and
    Appendix "Length-Neutral TRM"); ``trm_mask`` runs it from a spec.

    Every criterion given is applied and they are AND-combined:
    - max:  M = 1[max_t D_KL(c_t) <= max_delta]                     (``max_delta``)
    - avg:  M = 1[(1/T) sum_t D_KL(c_t) <= avg_delta]               (``avg_delta``)
    - "ln": LN-TRM, W(y) / Z(T) <= ln_threshold with W = sum_t |rho_t - 1| w_t,
            w_t = min(1, (T-t) ln_eps, sqrt((T-t) ln_delta / 2)), Z(T) = sum_t w_t
    - "ser": SER, (1/T) sum_t |rho_t - 1| <= ln_threshold (paper recommends 0.03..0.10)
    T and t count response tokens only.

    Args:
        kl_tok_BS: float [B, S] per-token statistic for the max (and, unless avg_kl_tok_BS is
            given, the avg) criterion: exact D_KL (``exact_kl_tokens``) or k2 (``sample_kl_tokens``).
            May be None when only a length-neutral criterion is used.
        mask_BS: bool or 0/1 [B, S] response tokens.
        max_delta, avg_delta: thresholds; None = criterion off (defaults docs/math.md 9: 0.05 alone,
            0.001 alone, 0.1 + 0.002 combined).
        avg_kl_tok_BS: float [B, S] statistic for the avg criterion (k3 in the sample-based form).
        length_neutral: "none" | "ln" | "ser".
        log_ratio_BS: float [B, S] log rho = log pi_train - log pi_rollout (for "ln" / "ser").
        ln_threshold: delta_W ("ln") or delta_SER ("ser"); ln_eps, ln_delta: LN-TRM weight params.
    Returns:
        keep_B: bool [B], the sequence is accepted (a sequence without response tokens is kept; it
        carries no loss). metrics (sequences with a response token): ``corr/trm_accept_rate``,
        ``corr/trm_{max,avg,ln,ser}_reject_frac`` per active criterion, ``corr/trm_max_kl`` (max over
        sequences of max_t) and ``corr/trm_seq_max_kl_mean``, ``corr/trm_avg_kl`` (+ ``_max``),
        ``corr/trm_{ln,ser}_score`` (+ ``_max``), ``corr/trm_token_accept_frac`` (response tokens in
        accepted sequences), ``corr/trm_len_accepted`` / ``corr/trm_len_all`` (mean response length:
        watch the length bias, accept ~ (1-p)^T). ``corr/trm_alarm`` (acceptance < 70%) is a
        function of the GLOBAL rate: ``moe_rl.corrections.derive_metrics`` adds it after reduction.
    """
    if length_neutral not in LENGTH_NEUTRAL:
        raise ValueError(f"unknown length_neutral {length_neutral!r}; known: {list(LENGTH_NEUTRAL)}")
    if max_delta is None and avg_delta is None and length_neutral == "none":
        raise ValueError("trm_keep needs at least one criterion (max_delta, avg_delta, length_neutral)")
    if (max_delta is not None or (avg_delta is not None and avg_kl_tok_BS is None)) and kl_tok_BS is None:
        raise ValueError("max/avg criteria need kl_tok_BS")
    mask_BS = mask_BS.bool()
    valid_B = seq_valid(mask_BS)
    keep_B = torch.ones_like(valid_B)
    metrics: dict[str, MetricValue] = {}
    f64 = torch.float64
    if max_delta is not None:
        seq_max_B = torch.where(mask_BS, kl_tok_BS.detach().to(f64), -math.inf).amax(-1)
        keep_B = _criterion(metrics, "max", seq_max_B <= max_delta, keep_B, valid_B)
        metrics["corr/trm_max_kl"] = masked_max(seq_max_B, valid_B)
        metrics["corr/trm_seq_max_kl_mean"] = masked_mean(seq_max_B, valid_B)
    if avg_delta is not None:
        stat_BS = (kl_tok_BS if avg_kl_tok_BS is None else avg_kl_tok_BS).detach().to(f64)
        seq_avg_B = (stat_BS * mask_BS).sum(-1) / mask_BS.sum(-1).clamp(min=1)
        keep_B = _criterion(metrics, "avg", seq_avg_B <= avg_delta, keep_B, valid_B)
        metrics["corr/trm_avg_kl"] = masked_mean(seq_avg_B, valid_B)
        metrics["corr/trm_avg_kl_max"] = masked_max(seq_avg_B, valid_B)
    if length_neutral != "none":
        if log_ratio_BS is None or ln_threshold is None:
            raise ValueError(f"length_neutral={length_neutral!r} needs log_ratio_BS and ln_threshold")
        score_B = _length_neutral_score(log_ratio_BS, mask_BS, length_neutral, ln_eps, ln_delta)
        keep_B = _criterion(metrics, length_neutral, score_B <= ln_threshold, keep_B, valid_B)
        metrics[f"corr/trm_{length_neutral}_score"] = masked_mean(score_B, valid_B)
        metrics[f"corr/trm_{length_neutral}_score_max"] = masked_max(score_B, valid_B)
    metrics.update(_acceptance_metrics(keep_B, mask_BS, valid_B))
    return keep_B, metrics


def _criterion(
    metrics: dict[str, MetricValue],
    name: str,
    ok_B: torch.Tensor,
    keep_B: torch.Tensor,
    valid_B: torch.Tensor,
) -> torch.Tensor:
    metrics[f"corr/trm_{name}_reject_frac"] = masked_mean((~ok_B).to(torch.float64), valid_B)
    return keep_B & ok_B


def _acceptance_metrics(
    keep_B: torch.Tensor, mask_BS: torch.Tensor, valid_B: torch.Tensor
) -> dict[str, MetricValue]:
    f64 = torch.float64
    len_B = mask_BS.sum(-1).to(f64)
    accepted_B = keep_B & valid_B
    return {
        "corr/trm_accept_rate": masked_mean(keep_B.to(f64), valid_B),
        "corr/trm_token_accept_frac": masked_mean(keep_B[:, None].expand_as(mask_BS).to(f64), mask_BS),
        "corr/trm_len_accepted": masked_mean(len_B, accepted_B),
        "corr/trm_len_all": masked_mean(len_B, valid_B),
    }


# --------------------------------------------------------------------------- bounds (docs/math.md 3.2)


def trm_bounds(
    T: int,
    delta: float,
    *,
    eps: float | None = None,
    kl_seq: float | None = None,
    tv_seq: float | None = None,
    dbar_t: torch.Tensor | list[float] | None = None,
) -> dict[str, float]:
    """Every bound of docs/math.md 3.2 on |Error| = |J(pi_theta) - J(pi_roll) - L(pi_theta)|.

    A CPU calculator of python floats (for reports and config sanity checks), not training math.

    Args:
        T: response length (>= 1).
        delta: D_KL^{tok,max} (max token KL(pi_roll || pi_theta)).
        eps: D_TV^{tok,max}; None = "KL-only": min(1, sqrt(delta / 2)) by Pinsker.
        kl_seq: D_KL^seq; None = T * delta (its worst case, paper Corollary).
        tv_seq: D_TV^seq; None = min(1, sqrt(kl_seq / 2)) by Pinsker.
        dbar_t: [T] per-position expected TV Dbar_t (t = 1..T); None = the uniform worst case
            min(1, eps, sqrt(delta / 2)).
    Returns (floats):
        classical      2 T (T-1) eps^2                  (O(T^2); equals T(T-1) delta when KL-only)
        classical_kl   T (T-1) delta
        linear         4 T min(1, eps)                  (paper v2 "Linear"; Adaptive with the cap 1)
        coupling       4 min(1, eps) sum_t min(1, (t-1) eps)
        pm_kl          4 min(1, sqrt(delta/2)) sum_t min(1, sqrt((t-1) delta / 2))
        pm_tv          4 min(1, eps) sum_t min(1, sqrt((t-1) delta / 2))
        pm_kl_closed   (4/3) T^{3/2} delta              (closed form of pm_kl when delta <= 2/T; the
        pm_tv_closed   (8/3) T^{3/2} eps sqrt(delta/2)   integral upper bound, always >= the sums)
        mix_kl         4 T min(1, sqrt(delta/2)) min(1, sqrt(kl_seq / 2))
        mix_tv         4 T min(1, eps) min(1, tv_seq)
        adaptive_kl    4 sum_t Dbar_t min(1, sqrt((T-t) delta / 2))
        adaptive_tv    4 sum_t Dbar_t min(1, (T-t) eps)
        adaptive       4 sum_t Dbar_t min(1, (T-t) eps, sqrt((T-t) delta / 2))   (B_Adap^*)
        unified        B* = min(pm_kl, pm_tv, mix_kl, mix_tv, coupling, adaptive)
        eps, kl_seq, tv_seq  the values used
    """
    if T < 1 or delta < 0:
        raise ValueError(f"need T >= 1 and delta >= 0, got T={T}, delta={delta}")
    eps = min(1.0, math.sqrt(delta / 2)) if eps is None else float(eps)
    kl_seq = T * delta if kl_seq is None else float(kl_seq)
    tv_seq = min(1.0, math.sqrt(kl_seq / 2)) if tv_seq is None else float(tv_seq)
    if min(eps, kl_seq, tv_seq) < 0:
        raise ValueError("eps, kl_seq and tv_seq must be >= 0")
    f64 = torch.float64
    k_T = torch.arange(T, dtype=f64)  # k = t - 1 (context shift) for t = 1..T
    one = torch.ones((), dtype=f64)
    shift_pinsker = float(torch.minimum(one, torch.sqrt(k_T * delta / 2)).sum())
    shift_coupling = float(torch.minimum(one, k_T * eps).sum())
    adv_kl, adv_tv = min(1.0, math.sqrt(delta / 2)), min(1.0, eps)
    out = {
        "classical": 2 * T * (T - 1) * eps**2,
        "classical_kl": T * (T - 1) * delta,
        "linear": 4 * T * adv_tv,
        "coupling": 4 * adv_tv * shift_coupling,
        "pm_kl": 4 * adv_kl * shift_pinsker,
        "pm_tv": 4 * adv_tv * shift_pinsker,
        "pm_kl_closed": 4 / 3 * T**1.5 * delta,
        "pm_tv_closed": 8 / 3 * T**1.5 * eps * math.sqrt(delta / 2),
        "mix_kl": 4 * T * adv_kl * min(1.0, math.sqrt(kl_seq / 2)),
        "mix_tv": 4 * T * adv_tv * min(1.0, tv_seq),
    }
    out.update(_adaptive_bounds(T, delta, eps, dbar_t))
    out["unified"] = min(out[k] for k in ("pm_kl", "pm_tv", "mix_kl", "mix_tv", "coupling", "adaptive"))
    out.update(eps=eps, kl_seq=kl_seq, tv_seq=tv_seq)
    return out


def _adaptive_bounds(
    T: int, delta: float, eps: float, dbar_t: torch.Tensor | list[float] | None
) -> dict[str, float]:
    f64 = torch.float64
    if dbar_t is None:
        dbar_T = torch.full((T,), min(1.0, eps, math.sqrt(delta / 2)), dtype=f64)
    else:
        dbar_T = torch.as_tensor(dbar_t, dtype=f64)
        if dbar_T.shape != (T,):
            raise ValueError(f"dbar_t must have shape ({T},), got {tuple(dbar_T.shape)}")
    remaining_T = T - torch.arange(1, T + 1, dtype=f64)  # T - t for t = 1..T
    one = torch.ones((), dtype=f64)
    future_kl = torch.minimum(one, torch.sqrt(remaining_T * delta / 2))
    future_tv = torch.minimum(one, remaining_T * eps)
    return {
        "adaptive_kl": 4 * float((dbar_T * future_kl).sum()),
        "adaptive_tv": 4 * float((dbar_T * future_tv).sum()),
        "adaptive": 4 * float((dbar_T * torch.minimum(future_kl, future_tv)).sum()),
    }
