"""moe_rl.losses: hand-computed PPO values, clip direction, gradient flow, normaliser, KL forms."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.losses import SAFETY_BOUND, kl_estimate, log_ratio, ppo_clip_loss
from moe_rl.metrics import merge_metrics, reduce_metrics

# (ratio, advantage, expected per-token loss, clipped branch active)
CASES = [
    (1.5, 1.0, -1.28, True),    # A > 0, ratio above 1 + clip_high: clipped, no gradient
    (0.5, 1.0, -0.5, False),    # A > 0, ratio below 1 - clip_low: unclipped (pessimistic min)
    (0.5, -1.0, 0.8, True),     # A < 0, ratio below 1 - clip_low: clipped
    (1.5, -1.0, 1.5, False),    # A < 0, ratio above 1 + clip_high: unclipped
    (1.1, 2.0, -2.2, False),    # inside the range
    (1.25, 1.0, -1.25, False),  # inside the asymmetric range (would be clipped at 1.2)
]


def _inputs(cases=CASES):
    """Leaf tensors [1, N]: logp and old_logp require grad, advantages do not."""
    ratio = torch.tensor([[c[0] for c in cases]], dtype=torch.float64)
    old = torch.linspace(-3.0, -0.5, len(cases), dtype=torch.float64)[None]
    logp = (old + ratio.log()).requires_grad_(True)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    return logp, old.requires_grad_(True), adv


@pytest.mark.unit
def test_ppo_hand_computed_values_and_metrics():
    logp, old, adv = _inputs()
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, normalizer=6)
    expect = [c[2] for c in CASES]
    assert loss.item() == pytest.approx(sum(expect) / 6)
    got = reduce_metrics(metrics)
    assert got["train/pg_loss"] == pytest.approx(sum(expect) / 6)
    assert got["train/pg_clipfrac"] == pytest.approx(2 / 6)
    ratios = [c[0] for c in CASES]
    assert got["train/ratio_mean"] == pytest.approx(sum(ratios) / 6)
    assert got["train/ratio_max"] == pytest.approx(1.5) and got["train/ratio_min"] == pytest.approx(0.5)
    assert got["train/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratios) / 6)
    assert "train/kl_ref" not in got


@pytest.mark.unit
def test_mask_and_normalizer():
    logp, old, adv = _inputs()
    mask = torch.tensor([[True, False, True, False, False, True]])
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                  normalizer=torch.tensor(10.0))
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.25) / 10)
    got = reduce_metrics(metrics)
    assert got["train/pg_clipfrac"] == pytest.approx(2 / 3)
    assert got["train/pg_loss"] == pytest.approx((-1.28 + 0.8 - 1.25) / 3)
    with pytest.raises(ValueError, match="normalizer"):
        ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, normalizer=0)


@pytest.mark.unit
def test_asymmetric_clip_direction():
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    # ratio 1.25 with A > 0: inside [0.8, 1.28], clipped with a symmetric 0.2
    # ratio 0.75 with A < 0: below 1 - clip_low = 0.8, clipped
    logp = torch.tensor([[math.log(1.25), math.log(0.75)]], dtype=torch.float64)
    _, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, normalizer=2)
    loss_tok, _ = ppo_clip_loss(logp[:, :1], old[:, :1], adv[:, :1], mask[:, :1],
                                clip_low=0.2, clip_high=0.28, normalizer=1)
    assert loss_tok.item() == pytest.approx(-1.25)
    loss_tok, _ = ppo_clip_loss(logp[:, 1:], old[:, 1:], adv[:, 1:], mask[:, 1:],
                                clip_low=0.2, clip_high=0.28, normalizer=1)
    assert loss_tok.item() == pytest.approx(0.8)
    assert reduce_metrics(m)["train/pg_clipfrac"] == pytest.approx(0.5)
    _, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.3, clip_high=0.2, normalizer=2)
    assert reduce_metrics(m)["train/pg_clipfrac"] == pytest.approx(0.5)  # now only token 0


@pytest.mark.unit
def test_gradient_flow():
    logp, old, adv = _inputs()
    mask = torch.ones_like(adv)
    loss, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, normalizer=6)
    loss.backward()
    grad = logp.grad[0]
    for i, (ratio, a, _, clipped) in enumerate(CASES):
        if clipped:
            assert grad[i].item() == 0.0
        else:  # d/dlogp of -A * ratio / N
            assert grad[i].item() == pytest.approx(-a * ratio / 6)
    assert old.grad is None  # old_logp is detached inside


@pytest.mark.unit
def test_is_weights_are_stop_gradient():
    logp, old, adv = _inputs()
    w = torch.full_like(adv, 2.0, requires_grad=True)
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones_like(adv), clip_low=0.2, clip_high=0.28,
                            normalizer=6, is_weights_BS=w)
    loss.backward()
    assert loss.item() == pytest.approx(2 * sum(c[2] for c in CASES) / 6)
    assert w.grad is None


@pytest.mark.unit
def test_microbatch_split_with_global_normalizer_equals_whole_batch():
    gen = torch.Generator().manual_seed(0)
    B, S = 8, 12
    logp = (torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.2 - 2).requires_grad_(True)
    old = logp.detach() + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.1
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, S)
    mask = torch.rand(B, S, generator=gen) > 0.4
    kw = dict(clip_low=0.2, clip_high=0.28, normalizer=mask.sum(), kl_coef=0.1)

    whole, m_whole = ppo_clip_loss(logp, old, adv, mask, ref_logp_BS=ref, **kw)
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts, merged = [], {}
    for sl in (slice(0, 3), slice(3, B)):
        loss, m = ppo_clip_loss(logp[sl], old[sl], adv[sl], mask[sl], ref_logp_BS=ref[sl], **kw)
        parts.append(loss)
        merged = merge_metrics(merged, m)
    total = parts[0] + parts[1]
    (g_split,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(g_split, g_whole)
    a, b = reduce_metrics(m_whole), reduce_metrics(merged)
    assert a.keys() == b.keys() and "train/kl_ref" in a
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-12)


@pytest.mark.unit
def test_kl_term_added_with_coef():
    logp = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64))
    adv = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, m = ppo_clip_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2,
                            normalizer=2, ref_logp_BS=ref, kl_coef=0.5, kl_kind="k1")
    # k1 = logp - ref = [log 2, -log 2]: sums to 0
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss, m = ppo_clip_loss(logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.2,
                            normalizer=2, ref_logp_BS=ref, kl_coef=0.5, kl_kind="k2")
    assert loss.item() == pytest.approx(0.5 * math.log(2) ** 2 / 2)
    assert reduce_metrics(m)["train/kl_ref"] == pytest.approx(math.log(2) ** 2 / 2)
    with pytest.raises(ValueError, match="ref_logp_BS"):
        ppo_clip_loss(logp, logp, adv, mask, clip_low=0.2, clip_high=0.2, normalizer=2, kl_coef=0.1)


@pytest.mark.unit
def test_kl_estimators_closed_form():
    logp = torch.log(torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64))
    ref = torch.log(torch.tensor([0.25, 0.3, 0.9], dtype=torch.float64))
    r = torch.tensor([0.5, 3.0, 1.0], dtype=torch.float64)  # ref / pi
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), -r.log())
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * r.log() ** 2)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), r - 1 - r.log())
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.unit
def test_k3_nonnegative_and_unbiased():
    gen = torch.Generator().manual_seed(0)
    lr = torch.randn(10000, generator=gen, dtype=torch.float64) * 5  # includes beyond +-20
    k3 = kl_estimate(torch.zeros_like(lr), lr, "k3")
    assert (k3 >= 0).all() and torch.isfinite(k3).all()
    # unbiasedness: pi and ref categorical over 5 symbols; E_pi[k1] = E_pi[k3] = KL(pi || ref)
    pi = torch.softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    ref = torch.softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    kl = (pi * (pi / ref).log()).sum()
    for kind in ("k1", "k3"):
        assert (pi * kl_estimate(pi.log(), ref.log(), kind)).sum().item() == pytest.approx(kl.item())


@pytest.mark.unit
def test_log_ratio_clamp():
    a = torch.tensor([0.0, 0.0, -1.0])
    b = torch.tensor([-100.0, 100.0, -3.0])
    torch.testing.assert_close(log_ratio(a, b), torch.tensor([SAFETY_BOUND, -SAFETY_BOUND, 2.0]))
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, torch.tensor([[-100.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1),
                            clip_low=0.2, clip_high=0.28, normalizer=1)
    assert torch.isfinite(loss)
