"""moe_rl.maths.losses: hand-computed PPO values, clip direction (asymmetric, dual), gradient flow,
normaliser, KL forms, decoupled PPO (IS outside the clip, keep masks) and the bypass losses."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.corrections.corrected_loss import bypass_loss
from moe_rl.corrections.correction_specs import CorrectionSpec, ImportanceSpec, RejectionSpec, parse_rs_spec
from moe_rl.corrections.importance import is_weights, rejection_mask
from moe_rl.maths.losses import (
    clipped_surrogate,
    decoupled_ppo_loss,
    kl_estimate,
    ppo_clip_loss,
)
from moe_rl.maths.policy_specs import PolicyLossSpec
from moe_rl.maths.ratios import SAFETY_BOUND, kl_from_log_ratio, log_ratio
from moe_rl.metrics import merge_metrics, reduce_metrics

# (ratio, advantage, expected per-token loss, clipped branch active)
CASES = [
    (1.5, 1.0, -1.28, True),  # A > 0, ratio above 1 + clip_high: clipped, no gradient
    (0.5, 1.0, -0.5, False),  # A > 0, ratio below 1 - clip_low: unclipped (pessimistic min)
    (0.5, -1.0, 0.8, True),  # A < 0, ratio below 1 - clip_low: clipped
    (1.5, -1.0, 1.5, False),  # A < 0, ratio above 1 + clip_high: unclipped
    (1.1, 2.0, -2.2, False),  # inside the range
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
    loss, metrics = ppo_clip_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, normalizer=torch.tensor(10.0)
    )
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
    loss_tok, _ = ppo_clip_loss(
        logp[:, :1], old[:, :1], adv[:, :1], mask[:, :1], clip_low=0.2, clip_high=0.28, normalizer=1
    )
    assert loss_tok.item() == pytest.approx(-1.25)
    loss_tok, _ = ppo_clip_loss(
        logp[:, 1:], old[:, 1:], adv[:, 1:], mask[:, 1:], clip_low=0.2, clip_high=0.28, normalizer=1
    )
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
    loss, _ = ppo_clip_loss(
        logp, old, adv, torch.ones_like(adv), clip_low=0.2, clip_high=0.28, normalizer=6, is_weights_BS=w
    )
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

    def loss_with(kl_kind: str):
        return ppo_clip_loss(
            logp,
            logp.detach(),
            adv,
            mask,
            clip_low=0.2,
            clip_high=0.2,
            normalizer=2,
            ref_logp_BS=ref,
            kl_coef=0.5,
            kl_kind=kl_kind,
        )

    loss, m = loss_with("k1")
    # k1 = logp - ref = [log 2, -log 2]: sums to 0
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss, m = loss_with("k2")
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
    loss, _ = ppo_clip_loss(
        logp,
        torch.tensor([[-100.0]]),
        torch.tensor([[-1.0]]),
        torch.ones(1, 1),
        clip_low=0.2,
        clip_high=0.28,
        normalizer=1,
    )
    assert torch.isfinite(loss)


# ----------------------------------------------------------------------------- dual clip


@pytest.mark.unit
def test_dual_clip_hand_computed():
    # (ratio, A, expected loss with clip 0.2/0.28 and c = 3, dual active, has gradient)
    cases = [
        (5.0, -1.0, 3.0, True, False),  # A < 0, -A*ratio = 5 > c = 3: bounded at 3, no gradient
        (2.0, -1.0, 2.0, False, True),  # below c: unchanged
        (5.0, 1.0, -1.28, False, False),  # A > 0: dual clip does not apply (normal clip)
        (0.5, -2.0, 1.6, False, False),
    ]  # A < 0, clipped from below as usual
    logp = torch.tensor([[math.log(c[0]) for c in cases]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, m = ppo_clip_loss(
        logp, old, adv, mask, clip_low=0.2, clip_high=0.28, normalizer=4, clip_ratio_c=3.0
    )
    assert loss.item() == pytest.approx(sum(c[2] for c in cases) / 4)
    assert reduce_metrics(m)["train/pg_clipfrac_lower"] == pytest.approx(1 / 4)
    loss.backward()
    for i, case in enumerate(cases):
        assert (logp.grad[0, i].item() != 0.0) == case[4], i
    _, _, dual = clipped_surrogate(logp.detach(), adv, clip_low=0.2, clip_high=0.2)
    assert not dual.any()  # off without clip_ratio_c
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, normalizer=4, clip_ratio_c=1.0)
    _, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, normalizer=4)
    assert "train/pg_clipfrac_lower" not in m


# ----------------------------------------------------------------------------- decoupled PPO


@pytest.mark.unit
def test_decoupled_is_weights_multiply_outside_the_clip():
    logp, old, adv = _inputs()
    w = torch.tensor([[2.0, 0.5, 3.0, 1.0, 1.5, 0.25]], dtype=torch.float64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, _ = decoupled_ppo_loss(
        PolicyLossSpec(clip_low=0.2, clip_high=0.28), logp, old, adv, mask, normalizer=6, is_weights_BS=w
    )
    assert loss.item() == pytest.approx(sum(wi * c[2] for wi, c in zip(w[0].tolist(), CASES)) / 6)
    loss.backward()
    for i, (ratio, a, _, clipped) in enumerate(CASES):
        # outside the clip: a clipped token stays gradient-free even with w != 1 (inside would change that)
        expect = 0.0 if clipped else -w[0, i].item() * a * ratio / 6
        assert logp.grad[0, i].item() == pytest.approx(expect)


@pytest.mark.unit
def test_decoupled_keep_mask_token_and_sequence_with_explicit_normalizer():
    gen = torch.Generator().manual_seed(0)
    logp = (torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.1 - 1).requires_grad_(True)
    old = logp.detach() + 0.05 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    kw = {"clip_low": 0.2, "clip_high": 0.28, "normalizer": 12}
    spec = PolicyLossSpec(clip_low=0.2, clip_high=0.28)
    keep_B = torch.tensor([True, False, True])
    loss_seq, _ = decoupled_ppo_loss(spec, logp, old, adv, mask, keep=keep_B, normalizer=12)
    loss_tok, _ = decoupled_ppo_loss(
        spec, logp, old, adv, mask, keep=keep_B[:, None].expand(3, 4), normalizer=12
    )
    loss_ref, _ = ppo_clip_loss(logp, old, adv, mask & keep_B[:, None], **kw)
    assert loss_seq.item() == pytest.approx(loss_ref.item()) and loss_tok.item() == pytest.approx(
        loss_ref.item()
    )
    (g,) = torch.autograd.grad(loss_seq, logp)
    assert (g[1] == 0).all() and (g[0] != 0).all()
    # not renormalised: the kept rows' gradient equals the one of the full batch with the same normaliser
    (g_full,) = torch.autograd.grad(ppo_clip_loss(logp, old, adv, mask, **kw)[0], logp)
    torch.testing.assert_close(g[0], g_full[0])


# ----------------------------------------------------------------------------- bypass

BYPASS_CLIP = CorrectionSpec(mode="bypass", bypass_loss="ppo_clip")


@pytest.mark.unit
def test_bypass_ppo_clip_is_ppo_on_rollout_ratio_without_is():
    logp, roll, adv = _inputs()
    mask = torch.ones_like(adv, dtype=torch.bool)
    kw = {"clip_low": 0.2, "clip_high": 0.28, "normalizer": 6}
    spec = PolicyLossSpec(clip_low=0.2, clip_high=0.28)
    loss, m = bypass_loss(spec, BYPASS_CLIP, logp, roll, adv, mask, normalizer=6)
    ref, _ = ppo_clip_loss(logp, roll, adv, mask, **kw)
    assert loss.item() == pytest.approx(ref.item())
    assert not any(k.startswith("corr/is") for k in m)
    # the spec refuses an IS weight in bypass ppo_clip (it would double-count) and unknown modes
    with pytest.raises(ValueError, match="applies no IS weight"):
        CorrectionSpec(mode="bypass", bypass_loss="ppo_clip", is_level="token")
    with pytest.raises(ValueError, match="correction.bypass_loss"):
        CorrectionSpec(mode="bypass", bypass_loss="grpo")
    # and batch normalisation, which only decoupled mode applies (bypass would ignore it silently)
    with pytest.raises(ValueError) as e:
        CorrectionSpec(mode="bypass", bypass_loss="reinforce", is_level="sequence", is_batch_normalize=True)
    assert str(e.value) == (
        "config key 'correction.is_batch_normalize': batch normalisation is decoupled mode's (bypass "
        "applies its IS weights per micro-batch, in the loss); use correction.mode=decoupled or leave "
        "it false"
    )
    assert CorrectionSpec(
        mode="decoupled", is_level="sequence", is_batch_normalize=True
    ).importance.batch_normalize
    # RS recomputed from the current pi_theta: token_k1 in [0.8, 1.3] drops ratios 1.5, 0.5, 0.5, 1.5
    rs = CorrectionSpec(mode="bypass", rejection=[RejectionSpec("token_k1", upper=1.3, lower=0.8)])
    loss, m = bypass_loss(spec, rs, logp, roll, adv, mask, normalizer=6)
    assert loss.item() == pytest.approx((-2.2 - 1.25) / 6)
    assert reduce_metrics(m)["corr/rs_masked_fraction"] == pytest.approx(4 / 6)


@pytest.mark.unit
def test_bypass_reinforce_gradient_is_w_times_a_times_grad_logp():
    gen = torch.Generator().manual_seed(1)
    B, S = 4, 5
    logp = (torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.2 - 1.5).requires_grad_(True)
    roll = logp.detach() + 0.3 * torch.randn(B, S, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, S)
    mask = torch.rand(B, S, generator=gen) > 0.2
    n = mask.sum()
    for level in (None, "token", "sequence"):
        c = CorrectionSpec(mode="bypass", bypass_loss="reinforce", is_level=level or "none", is_clip=1.5)
        loss, m = bypass_loss(PolicyLossSpec(), c, logp, roll, adv, mask, normalizer=n)
        w = (
            torch.ones(B, S, dtype=torch.float64)
            if level is None
            else is_weights(log_ratio(logp.detach(), roll), mask, ImportanceSpec(level, 1.5))[0]
        )
        assert loss.item() == pytest.approx((-w * adv * logp.detach() * mask).sum().item() / n.item())
        (g,) = torch.autograd.grad(loss, logp)
        # stopgrad(w): exactly -w A / N per token, no log pi * grad w term
        torch.testing.assert_close(g, -(w * adv * mask) / n)
        assert ("corr/is_mean" in m) == (level is not None)


@pytest.mark.unit
def test_bypass_reinforce_rejection_and_keep():
    logp, roll, adv = _inputs()
    logp = logp.detach().requires_grad_(True)
    mask = torch.ones_like(adv, dtype=torch.bool)
    keep_rs, _ = rejection_mask(log_ratio(logp.detach(), roll), mask, parse_rs_spec(["token_k2"], [0.05]))
    rs = CorrectionSpec(
        mode="bypass", bypass_loss="reinforce", rejection=[RejectionSpec("token_k2", upper=0.05)]
    )
    loss, _ = bypass_loss(
        PolicyLossSpec(), rs, logp, roll, adv, mask, keep=torch.tensor([True]), normalizer=6
    )
    assert loss.item() == pytest.approx((-adv * logp.detach() * keep_rs).sum().item() / 6)
    reinforce = CorrectionSpec(mode="bypass", bypass_loss="reinforce")
    loss, _ = bypass_loss(
        PolicyLossSpec(), reinforce, logp, roll, adv, mask, keep=torch.tensor([False]), normalizer=6
    )
    assert loss.item() == 0.0


@pytest.mark.unit
def test_kl_from_log_ratio_matches_kl_estimate():
    lr = torch.tensor([-1.0, 0.0, 0.7], dtype=torch.float64)
    for kind in ("k1", "k2", "k3"):
        torch.testing.assert_close(
            kl_from_log_ratio(lr, kind), kl_estimate(torch.zeros(3, dtype=torch.float64), lr, kind)
        )
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_from_log_ratio(lr, "k5")
