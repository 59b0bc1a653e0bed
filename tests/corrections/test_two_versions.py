"""unit tier: the corrections know each token's version. A batch whose responses were sampled half
under policy A and half under policy B (an in-flight weight update mid-response): token IS,
sequence IS, rejection, TRM and the decoupled PPO loss must read each token's own behaviour
log-prob, exp(old - behaviour) with A's on the first half and B's on the second. The expected
values are computed here per token from the three policies' logits, independently of the
vectorized code."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.corrections.correction_specs import CorrectionSpec, RejectionSpec, TrmSpec
from moe_rl.maths.losses import decoupled_ppo_loss
from moe_rl.maths.policy_specs import PolicyLossSpec
from moe_rl.maths.versions import k3_by_lag, lag_BS
from moe_rl.step.drift import drift_tensors

B, S, V, P = 3, 8, 5, 2
RESP = [6, 4, 5]  # response lengths; the switch A -> B after half of each response
LEARNER = 4  # the learner's version; A is version 2, B version 3


def _policies():
    g = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(0, V, (B, S), generator=g)
    logits = {name: torch.randn(B, S, V, generator=g, dtype=torch.float64) for name in ("A", "B", "old")}
    logp = {
        k: torch.log_softmax(v, -1).gather(-1, tokens_BS[..., None]).squeeze(-1) for k, v in logits.items()
    }
    mask_BS = torch.zeros(B, S, dtype=torch.bool)
    version_BS = torch.zeros(B, S, dtype=torch.int32)
    behaviour_BS = torch.zeros(B, S, dtype=torch.float64)
    for b, r in enumerate(RESP):  # the engine's record, token by token
        for t in range(P, P + r):
            mask_BS[b, t] = True
            first = t < P + r // 2
            version_BS[b, t] = 2 if first else 3
            behaviour_BS[b, t] = logp["A" if first else "B"][b, t]
    return logp, mask_BS, version_BS, behaviour_BS


def _expected_log_rho(logp, mask_BS):
    """log rho per generated token from the logits, by position: (old - A) then (old - B)."""
    out = {}
    for b, r in enumerate(RESP):
        for t in range(P, P + r):
            src = "A" if t < P + r // 2 else "B"
            out[b, t] = float(logp["old"][b, t] - logp[src][b, t])
    return out


@pytest.mark.unit
def test_token_and_sequence_is_use_each_tokens_own_behaviour_logprob():
    logp, mask_BS, _, behaviour_BS = _policies()
    lr = _expected_log_rho(logp, mask_BS)
    token, _ = drift_tensors(
        CorrectionSpec(is_level="token", is_clip=1e6), logp["old"], behaviour_BS, mask_BS, None
    )
    seq, _ = drift_tensors(
        CorrectionSpec(is_level="sequence", is_clip=1e6), logp["old"], behaviour_BS, mask_BS, None
    )
    for (b, t), x in lr.items():
        assert float(token.is_weights_BS[b, t]) == pytest.approx(math.exp(x), rel=1e-12)
        seq_sum = sum(v for (bb, _), v in lr.items() if bb == b)
        assert float(seq.is_weights_BS[b, t]) == pytest.approx(math.exp(seq_sum), rel=1e-12)
    assert token.is_weights_BS[~mask_BS].eq(0).all() and seq.is_weights_BS[~mask_BS].eq(0).all()
    # one version for the whole response (A's log-probs throughout) would give other weights
    wrong, _ = drift_tensors(
        CorrectionSpec(is_level="token", is_clip=1e6), logp["old"], logp["A"], mask_BS, None
    )
    assert not torch.allclose(wrong.is_weights_BS[mask_BS], token.is_weights_BS[mask_BS])


@pytest.mark.unit
def test_rejection_and_trm_decide_on_each_tokens_own_behaviour_logprob():
    logp, mask_BS, _, behaviour_BS = _policies()
    lr = _expected_log_rho(logp, mask_BS)
    lo, hi = 0.5, 2.0
    spec = CorrectionSpec(rejection=[RejectionSpec("token_k1", upper=hi, lower=lo)])
    out, _ = drift_tensors(spec, logp["old"], behaviour_BS, mask_BS, None)
    for (b, t), x in lr.items():
        assert bool(out.keep_BS[b, t]) == (math.log(lo) <= x <= math.log(hi)), (b, t, x)
    assert not out.keep_BS[~mask_BS].any() and 0 < int(out.keep_BS.sum()) < int(
        mask_BS.sum()
    )  # both outcomes
    # TRM max criterion on k2 = (log rho)^2 / 2: a sequence is kept iff its max is within delta
    max_k2 = [max(lr[b, t] ** 2 / 2 for t in range(P, P + r)) for b, r in enumerate(RESP)]
    delta = sorted(max_k2)[1]  # between the sequences: one rejected at least, one kept
    out, _ = drift_tensors(CorrectionSpec(trm=TrmSpec(max=delta)), logp["old"], behaviour_BS, mask_BS, None)
    assert out.keep_BS.any(1).tolist() == [k <= delta for k in max_k2]
    assert sum(k <= delta for k in max_k2) == 2


@pytest.mark.unit
def test_decoupled_ppo_weights_each_token_by_its_own_versions_ratio():
    logp, mask_BS, _, behaviour_BS = _policies()
    lr = _expected_log_rho(logp, mask_BS)
    corr, _ = drift_tensors(
        CorrectionSpec(is_level="token", is_clip=1e6), logp["old"], behaviour_BS, mask_BS, None
    )
    theta_BS = logp["old"].clone().requires_grad_(True)  # theta = old: ratio 1, no clip
    adv_BS = torch.ones(B, S, dtype=torch.float64)
    n = float(mask_BS.sum())
    loss, _ = decoupled_ppo_loss(
        PolicyLossSpec(),
        theta_BS,
        logp["old"],
        adv_BS,
        mask_BS,
        normalizer=n,
        is_weights_BS=corr.is_weights_BS,
    )
    # L = -sum_t w_t r_t A_t / n with r = 1, A = 1; dL/dlogp_t = -w_t / n
    assert float(loss) == pytest.approx(-sum(math.exp(x) for x in lr.values()) / n, rel=1e-12)
    loss.backward()
    for (b, t), x in lr.items():
        assert float(theta_BS.grad[b, t]) == pytest.approx(-math.exp(x) / n, rel=1e-12)


@pytest.mark.unit
def test_k3_by_lag_separates_the_two_versions():
    logp, mask_BS, version_BS, behaviour_BS = _policies()
    lr = _expected_log_rho(logp, mask_BS)
    lags = lag_BS(version_BS, mask_BS, LEARNER)  # A: lag 2, B: lag 1
    m = k3_by_lag(logp["old"], behaviour_BS, lags, mask_BS, 3)
    for lag, first in ((2, True), (1, False)):
        xs = [x for (b, t), x in lr.items() if (t < P + RESP[b] // 2) == first]
        k3 = sum(math.exp(x) - 1 - x for x in xs) / len(xs)
        assert float(m[f"mismatch/k3_lag{lag}"].sum) / float(
            m[f"mismatch/k3_lag{lag}"].count
        ) == pytest.approx(k3)
    assert float(m["mismatch/k3_lag0"].count) == 0.0
