"""Policy versions and lag (docs/math.md 2.7): which weights produced each generated token, how
many updates behind the learner that is, and the step's metrics split by lag. Pure tensor
functions (``check_versions`` aside, which syncs once to raise); metrics follow ``moe_rl.metrics``
(local Mean/Sum/Max). The staleness filter built on them belongs to the async request buffer
(``moe_rl/pipeline/request_buffer.py``).

Shape suffixes: B sequences, S positions, K lags (0 .. num_lags - 1), N rows.

Versions count learner updates from 1 (0 marks prompt/pad positions, the engines' convention,
docs/design.md 15.1): W_u, the weights after u updates (W_0 the start), is version u + 1
(``weight_version``), and a token's version is that of the forward pass that produced its log-prob
(``RolloutBatch.version_BS``). At step t the learner holds W_t, version t + 1, so a token's lag is
the number of updates between its weights and the learner's: t + 1 - version >= 0. Route row t of
a sequence is the input side of the pass that produced token t + 1's log-prob: it carries token
t + 1's version, and the prompt rows are the prefill's, the pass of the first response token
(``route_lag_BS``).
"""

from __future__ import annotations

import torch

from moe_rl.maths.ratios import SAFETY_BOUND, exact_log_ratio, kl_from_log_ratio
from moe_rl.metrics import Max, Mean, MetricValue, Sum


def weight_version(updates: int) -> int:
    """The version of W_u, the weights after ``updates`` learner updates: u + 1 (0 marks no token)."""
    return updates + 1


def lag_BS(version_BS: torch.Tensor, response_mask_BS: torch.Tensor, learner_version: int) -> torch.Tensor:
    """int64 [B, S]: learner_version - version on generated tokens, 0 elsewhere."""
    return torch.where(response_mask_BS.bool(), learner_version - version_BS.long(), 0)


def check_versions(version_BS: torch.Tensor, response_mask_BS: torch.Tensor, learner_version: int) -> None:
    """Raise ValueError unless the versions can be true: 0 on prompt/pad positions, within
    [1, learner_version] on generated tokens (no weights from the future) and non-decreasing along
    a response (a sync only moves an engine forward). One host sync."""
    v_BS, m_BS = version_BS.long(), response_mask_BS.bool()
    floor = torch.iinfo(torch.int64).min
    running_BS = torch.where(m_BS, v_BS, floor).cummax(1).values  # the newest version so far
    off, future, unset, older = (
        x.sum()
        for x in (
            ~m_BS & (v_BS != 0),
            m_BS & (v_BS > learner_version),
            m_BS & (v_BS < 1),
            m_BS & (v_BS < running_BS),
        )
    )
    off, future, unset, older = torch.stack([off, future, unset, older]).tolist()
    problems = [
        f"{n} {what}"
        for n, what in (
            (off, "prompt/pad positions with a version other than 0"),
            (future, f"generated tokens newer than the learner's version {learner_version}"),
            (unset, "generated tokens with a version below 1 (0 marks prompt/pad positions)"),
            (older, "generated tokens older than a token before them in their response"),
        )
        if n
    ]
    if problems:
        raise ValueError("RolloutBatch.version_BS: " + "; ".join(problems))


def sum_by_lag(x_N: torch.Tensor, lag_N: torch.Tensor, num_lags: int) -> torch.Tensor:
    """float64 [K]: the sum of ``x_N`` over the rows of each lag (every lag < ``num_lags``)."""
    out_K = torch.zeros(num_lags, dtype=torch.float64, device=x_N.device)
    return out_K.index_add_(0, lag_N.to(x_N.device).long(), x_N.to(torch.float64))


def lag_metrics(lag_BS: torch.Tensor, mask_BS: torch.Tensor, num_lags: int) -> dict[str, MetricValue]:
    """The staleness histogram of the generated tokens: ``rollout/lag_frac/<k>`` (fraction of
    tokens with lag k, k < ``num_lags``, which exceeds every lag), ``rollout/lag_mean``,
    ``rollout/lag_max``; and ``rollout/mixed_version_seqs`` (Sum) / ``rollout/mixed_version_frac``
    (Mean over sequences): the responses whose tokens come from two or more weight versions, i.e.
    an in-flight update landed inside them (async only; 0 when every update waits for a whole
    generate call, as in one_step_off)."""
    m_BS = mask_BS.bool()
    lag0_BS = torch.where(m_BS, lag_BS, 0)
    n = m_BS.double().sum()
    # an empty [B, 0] batch has no tokens: amin/amax need a column
    pad_BS = torch.nn.functional.pad(m_BS, (0, 1))  # one masked-off column
    lag1_BS = torch.nn.functional.pad(lag_BS.long(), (0, 1))
    lo_B = torch.where(pad_BS, lag1_BS, torch.iinfo(torch.int64).max).amin(1)
    hi_B = torch.where(pad_BS, lag1_BS, -1).amax(1)
    mixed = (hi_B > lo_B).double().sum()  # rows without tokens: lo max, hi -1
    count_K = sum_by_lag(m_BS.reshape(-1), lag0_BS.reshape(-1), num_lags)
    out: dict[str, MetricValue] = {f"rollout/lag_frac/{k}": Mean(count_K[k], n) for k in range(num_lags)}
    out["rollout/lag_mean"] = Mean(lag0_BS.double().sum(), n)
    out["rollout/mixed_version_seqs"] = Sum(mixed)
    rows = torch.tensor(float(m_BS.shape[0]), dtype=torch.float64, device=m_BS.device)
    out["rollout/mixed_version_frac"] = Mean(mixed, rows)
    out["rollout/lag_max"] = Max(
        lag0_BS.max().double() if lag0_BS.numel() else torch.zeros((), dtype=torch.float64)
    )
    return out


def k3_by_lag(
    train_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    lag_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    num_lags: int,
) -> dict[str, MetricValue]:
    """``mismatch/k3_lag<k>``: ``corr/k3_kl`` (mean_t rho - 1 - log rho, log rho = log pi_train -
    log pi_rollout clamped at +-20) over the generated tokens of lag k; NaN after reduction where
    no token has lag k."""
    m_BS = mask_BS.bool()
    f64 = torch.float64
    log_ratio_BS = torch.where(m_BS, exact_log_ratio(train_logp_BS.to(f64), rollout_logp_BS.to(f64)), 0.0)
    k3_BS = torch.where(m_BS, kl_from_log_ratio(log_ratio_BS.clamp(-SAFETY_BOUND, SAFETY_BOUND), "k3"), 0.0)
    lag0_N = torch.where(m_BS, lag_BS, 0).reshape(-1)
    sum_K = sum_by_lag(k3_BS.reshape(-1), lag0_N, num_lags)
    count_K = sum_by_lag(m_BS.reshape(-1), lag0_N, num_lags)
    return {f"mismatch/k3_lag{k}": Mean(sum_K[k], count_K[k]) for k in range(num_lags)}


def lag_k3_by_turn(
    train_logp_BS: torch.Tensor,
    rollout_logp_BS: torch.Tensor,
    lag_BS: torch.Tensor,
    turn_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    num_turns: int,
) -> dict[str, MetricValue]:
    """Multi-turn: ``agent/lag_mean/turn<k>`` and ``agent/k3/turn<k>`` (``corr/k3_kl`` as in
    ``k3_by_lag``) over the sampled tokens of assistant turn k = 1..``num_turns``: an update that
    lands between two turns shows as a later turn's larger lag; NaN after reduction where no
    token is of turn k."""
    m_BS = mask_BS.bool() & (turn_BS >= 1) & (turn_BS <= num_turns)
    f64 = torch.float64
    log_ratio_BS = torch.where(m_BS, exact_log_ratio(train_logp_BS.to(f64), rollout_logp_BS.to(f64)), 0.0)
    k3_BS = torch.where(m_BS, kl_from_log_ratio(log_ratio_BS.clamp(-SAFETY_BOUND, SAFETY_BOUND), "k3"), 0.0)
    turn0_N = torch.where(m_BS, turn_BS.long(), 0).reshape(-1)  # turn 0: the prompt, never sampled
    count_K = sum_by_lag(m_BS.reshape(-1), turn0_N, num_turns + 1)
    lag_K = sum_by_lag(torch.where(m_BS, lag_BS, 0).reshape(-1), turn0_N, num_turns + 1)
    k3_K = sum_by_lag(k3_BS.reshape(-1), turn0_N, num_turns + 1)
    out: dict[str, MetricValue] = {}
    for k in range(1, num_turns + 1):
        out[f"agent/lag_mean/turn{k}"] = Mean(lag_K[k], count_K[k])
        out[f"agent/k3/turn{k}"] = Mean(k3_K[k], count_K[k])
    return out


def route_lag_BS(lag_BS: torch.Tensor, prompt_lens_B: torch.Tensor, seq_lens_B: torch.Tensor) -> torch.Tensor:
    """int64 [B, S], column t: the lag of route row t = the lag of token max(t + 1, P_b) (the
    pass whose input row t was; the prompt rows are the prefill's, which produced token P_b), for
    t < T_b - 1 (a record's rows); 0 elsewhere."""
    S = lag_BS.shape[1]
    pos_S = torch.arange(S, device=lag_BS.device)
    src_BS = torch.maximum(pos_S[None, :] + 1, prompt_lens_B.to(lag_BS.device)[:, None]).clamp(max=S - 1)
    rows_BS = pos_S[None, :] < (seq_lens_B.to(lag_BS.device) - 1)[:, None]
    return torch.where(rows_BS, lag_BS.long().gather(1, src_BS), 0)


def route_turn_BS(turn_BS: torch.Tensor, mask_BS: torch.Tensor, seq_lens_B: torch.Tensor) -> torch.Tensor:
    """int64 [B, S], column t: the agent turn whose engine call computed route row t (the flips by
    turn), for t < T_b - 1; 0 elsewhere. Token t was fed by the call of its own turn when it and
    token t + 1 are sampled tokens of one turn (a decode step), else by the next call: the prompt
    by turn 1's prefill, a turn's last sampled token and its tool reply by the next turn's. The same
    as the rows' provenance turn (docs/design.md 5.1), from the batch alone (vLLM's records carry
    none). ``mask_BS``: the sampled tokens (the response mask before any sample was dropped)."""
    m_BS, t_BS = mask_BS.bool(), turn_BS.long()
    same_BS = torch.zeros_like(m_BS)
    same_BS[:, :-1] = m_BS[:, :-1] & m_BS[:, 1:] & (t_BS[:, :-1] == t_BS[:, 1:])
    S = turn_BS.shape[1]
    rows_BS = torch.arange(S, device=turn_BS.device)[None, :] < (seq_lens_B.to(turn_BS.device) - 1)[:, None]
    return torch.where(rows_BS, t_BS + 1 - same_BS.long(), 0)
