"""moe_rl.corrections.dvp: safe set, renormalised log-probs, metrics."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.corrections.dvp import SAFE_SET_RULES, dvp_metrics, restricted_logprobs, safe_set, safe_set_for
from moe_rl.metrics import reduce_metrics

F64 = torch.float64


def _logits(seed, B=3, S=4, V=13, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, V, generator=gen, dtype=F64) * scale, gen


@pytest.mark.unit
def test_relative_rule_definition_and_top_token():
    logits, _ = _logits(0)
    p = logits.softmax(-1)
    for rho_min in (1e-3, 0.05, 0.5, 1.0):
        safe = safe_set(logits, rule="relative", threshold=rho_min)
        expect = p >= rho_min * p.amax(-1, keepdim=True) * (1 - 1e-12)
        assert torch.equal(safe, expect)
        assert safe.gather(-1, logits.argmax(-1, keepdim=True)).all()
    assert safe_set(logits, threshold=1.0).sum(-1).eq(1).all()  # only the top token (no ties here)
    hand = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]], dtype=F64))
    assert safe_set(hand, threshold=0.25).tolist() == [[[True, True, True, False]]]  # 0.05 < 0.125
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="rho_min"):
            safe_set(logits, threshold=bad)
    with pytest.raises(ValueError, match="DVP safe-set rule"):
        safe_set(logits, rule="min_p", threshold=0.1)
    assert set(SAFE_SET_RULES) == {"relative", "top_p"}


@pytest.mark.unit
def test_top_p_rule():
    hand = torch.log(torch.tensor([[[0.15, 0.5, 0.05, 0.3]]], dtype=F64))
    assert safe_set(hand, rule="top_p", threshold=0.7).tolist() == [[[False, True, False, True]]]
    assert safe_set(hand, rule="top_p", threshold=0.8).tolist() == [[[False, True, False, True]]]
    assert safe_set(hand, rule="top_p", threshold=0.81).tolist() == [[[True, True, False, True]]]
    assert safe_set(hand, rule="top_p", threshold=1.0).all()


@pytest.mark.unit
def test_restricted_logprobs_renormalise_over_safe_set():
    logits, gen = _logits(1)
    B, S, V = logits.shape
    safe = safe_set(logits, threshold=0.05)
    # every token of the vocabulary as "sampled": restricted probabilities sum to 1 over the set
    total = torch.zeros(B, S, dtype=F64)
    for v in range(V):  # test-side enumeration of the vocabulary (the function itself is vectorised)
        r = restricted_logprobs(logits, safe, torch.full((B, S), v))
        assert torch.equal(r.inside_BS, safe[..., v])
        assert (r.logp_BS[r.inside_BS] <= 0).all() and torch.isneginf(r.logp_BS[~r.inside_BS]).all()
        assert (r.logp_BS[r.inside_BS] >= r.full_logp_BS[r.inside_BS]).all()  # renormalising raises it
        total += torch.where(r.inside_BS, r.logp_BS.exp(), 0.0)
    torch.testing.assert_close(total, torch.ones(B, S, dtype=F64))
    tokens = torch.multinomial(logits.softmax(-1).reshape(-1, V), 1, generator=gen).reshape(B, S)
    r = restricted_logprobs(logits, safe, tokens)
    ref = torch.log_softmax(logits.masked_fill(~safe, -math.inf), -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(r.logp_BS, ref)
    torch.testing.assert_close(r.log_safe_mass_BS, torch.log((logits.softmax(-1) * safe).sum(-1)))


@pytest.mark.unit
def test_restricted_equals_full_when_safe_set_is_everything():
    logits, gen = _logits(2)
    tokens = torch.randint(0, logits.shape[-1], logits.shape[:2], generator=gen)
    r = restricted_logprobs(logits, torch.ones_like(logits, dtype=torch.bool), tokens)
    full = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(r.logp_BS, full)
    torch.testing.assert_close(r.full_logp_BS, full)
    assert r.inside_BS.all() and torch.allclose(r.log_safe_mass_BS, torch.zeros_like(full))
    # half-precision logits are upcast
    r16 = restricted_logprobs(logits.bfloat16(), torch.ones_like(logits, dtype=torch.bool), tokens)
    assert r16.logp_BS.dtype == torch.float32


@pytest.mark.unit
def test_gradient_flows_to_logits_and_is_finite_outside():
    logits, gen = _logits(3)
    logits.requires_grad_(True)
    safe = safe_set(logits, threshold=0.05)
    tokens = torch.randint(0, logits.shape[-1], logits.shape[:2], generator=gen)
    r = restricted_logprobs(logits, safe, tokens)
    assert (~r.inside_BS).any() and r.inside_BS.any()
    r.logp_BS[r.inside_BS].sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~safe] == 0).all()  # tokens outside the set get no gradient
    # d/dz log softmax_safe(z)_y = 1[v=y] - p~_v over the safe set
    b, s = r.inside_BS.nonzero()[0].tolist()
    p_tilde = torch.softmax(logits.detach()[b, s].masked_fill(~safe[b, s], -math.inf), -1)
    expect = -p_tilde
    expect[tokens[b, s]] += 1
    torch.testing.assert_close(logits.grad[b, s], expect)


@pytest.mark.unit
def test_dvp_metrics_hand_computed():
    # one position, V = 4; rollout p = [0.5, 0.3, 0.15, 0.05], train q = [0.4, 0.4, 0.1, 0.1]
    roll = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]], dtype=F64))
    train = torch.log(torch.tensor([[[0.4, 0.4, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]]], dtype=F64))
    safe = safe_set(roll, threshold=0.25)  # {0, 1, 2}
    tokens = torch.tensor([[1, 3]])  # position 2 sampled a pruned token
    mask = torch.ones(1, 2, dtype=torch.bool)
    rt, rr = restricted_logprobs(train, safe, tokens), restricted_logprobs(roll, safe, tokens)
    got = reduce_metrics(dvp_metrics(rt, rr, safe, mask))
    assert got["corr/dvp_pruned_mass"] == pytest.approx(0.05)
    assert got["corr/dvp_pruned_mass_train"] == pytest.approx(0.1)
    assert got["corr/dvp_outside_frac"] == pytest.approx(0.5)
    assert got["corr/dvp_safe_size"] == pytest.approx(3.0)

    def k3(r):
        return r - 1 - math.log(r)

    assert got["corr/dvp_k3_before"] == pytest.approx((k3(0.4 / 0.3) + k3(0.1 / 0.05)) / 2)
    assert got["corr/dvp_k3_after"] == pytest.approx(k3((0.4 / 0.9) / (0.3 / 0.95)))
    assert all(math.isfinite(v) for v in got.values())


@pytest.mark.unit
def test_safe_set_for_reads_the_rule_and_threshold_from_the_spec():
    hand = torch.log(torch.tensor([[[0.15, 0.5, 0.05, 0.3]]], dtype=F64))
    assert safe_set_for(DvpSpec(0.25), hand).tolist() == [[[True, True, False, True]]]  # 0.15 >= 0.125
    assert safe_set_for(DvpSpec(0.7, "top_p"), hand).tolist() == [[[False, True, False, True]]]
    with pytest.raises(ValueError, match="DVP is off"):
        safe_set_for(DvpSpec(), hand)
