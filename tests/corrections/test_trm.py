"""moe_rl.corrections.trm: exact vs sample KL, the TRM mask (docs/math.md 3.3), the normaliser, the bounds
of docs/math.md 3.2 and the T = 4096 table."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.corrections.correction_specs import TrmSpec, parse_rs_spec
from moe_rl.corrections.derived import derive_metrics
from moe_rl.corrections.importance import log_ratio, rejection_mask
from moe_rl.corrections.trm import exact_kl_tokens, sample_kl_tokens, trm_bounds, trm_keep, trm_mask
from moe_rl.maths.losses import decoupled_ppo_loss
from moe_rl.maths.policy_specs import PolicyLossSpec
from moe_rl.metrics import reduce_metrics

F64 = torch.float64


# ----------------------------------------------------------------------------- per-token KL


@pytest.mark.unit
def test_exact_kl_closed_form_chunks_and_mask():
    gen = torch.Generator().manual_seed(0)
    roll = torch.randn(3, 5, 11, generator=gen, dtype=F64)
    train = roll + 0.3 * torch.randn(3, 5, 11, generator=gen, dtype=F64)
    p, log_p, log_q = roll.softmax(-1), roll.log_softmax(-1), train.log_softmax(-1)
    expect = (p * (log_p - log_q)).sum(-1).float()
    torch.testing.assert_close(exact_kl_tokens(roll, train), expect)
    torch.testing.assert_close(exact_kl_tokens(roll, train, chunk_tokens=4), expect)
    torch.testing.assert_close(exact_kl_tokens(log_p, train), expect)  # log-probs work as logits
    mask = torch.rand(3, 5, generator=gen) > 0.5
    torch.testing.assert_close(
        exact_kl_tokens(roll, train, mask, chunk_tokens=2), torch.where(mask, expect, 0.0)
    )
    assert (exact_kl_tokens(roll, roll).abs() < 1e-6).all()
    with pytest.raises(ValueError, match="shape"):
        exact_kl_tokens(roll, train[..., :5])


@pytest.mark.unit
def test_k3_sample_mean_matches_exact_kl_in_expectation():
    """E_{y ~ pi_roll}[k3(rho_y)] = KL(pi_roll || pi_train) (docs/math.md 3.3): toy distribution, seeded."""
    gen = torch.Generator().manual_seed(1)
    roll_logits = torch.randn(8, generator=gen, dtype=F64)
    train_logits = roll_logits + 0.4 * torch.randn(8, generator=gen, dtype=F64)
    exact = exact_kl_tokens(roll_logits[None, None], train_logits[None, None]).double().item()
    log_p, log_q = roll_logits.log_softmax(-1), train_logits.log_softmax(-1)
    n = 200_000
    y = torch.multinomial(log_p.exp(), n, replacement=True, generator=gen)
    k3 = sample_kl_tokens(log_ratio(log_q[y], log_p[y]), "k3")
    k2 = sample_kl_tokens(log_ratio(log_q[y], log_p[y]), "k2")
    se = k3.std().item() / math.sqrt(n)
    assert abs(k3.mean().item() - exact) < 4 * se
    assert exact > 0.01 and abs(k2.mean().item() - exact) < 0.2 * exact  # k2 biased, only ~KL
    with pytest.raises(ValueError, match="k2"):
        sample_kl_tokens(k3, "k1")


# ----------------------------------------------------------------------------- the mask


def _batch():
    """Per-token KL, 3 sequences: [0.01, 0.2], [0.01, 0.01, 0.01], [0.04, 0.0001]; seq 3 empty."""
    kl = torch.tensor([[0.01, 0.2, 0.0], [0.01, 0.01, 0.01], [0.04, 0.0001, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    return kl, mask


@pytest.mark.unit
def test_max_avg_and_combined_criteria():
    kl, mask = _batch()
    keep, m = trm_keep(kl, mask, max_delta=0.05)
    assert keep.tolist() == [False, True, True, True]  # the empty sequence is kept (no loss)
    got = derive_metrics(reduce_metrics(m))
    assert got["corr/trm_accept_rate"] == pytest.approx(2 / 3)
    assert got["corr/trm_alarm"] == 1.0  # 66.7% < 70%
    assert got["corr/trm_max_kl"] == pytest.approx(0.2)
    assert got["corr/trm_max_reject_frac"] == pytest.approx(1 / 3)
    assert got["corr/trm_token_accept_frac"] == pytest.approx(5 / 7)
    assert got["corr/trm_len_accepted"] == pytest.approx(2.5) and got["corr/trm_len_all"] == pytest.approx(
        7 / 3
    )
    keep, m = trm_keep(kl, mask, avg_delta=0.015)  # averages 0.105, 0.01, 0.02005
    assert keep.tolist() == [False, True, False, True]
    assert reduce_metrics(m)["corr/trm_avg_kl"] == pytest.approx((0.105 + 0.01 + 0.02005) / 3)
    keep, m = trm_keep(kl, mask, max_delta=0.05, avg_delta=0.015)
    assert keep.tolist() == [False, True, False, True]
    keep, m = trm_keep(kl, mask, max_delta=0.3, avg_delta=0.1)  # max alone accepts all; avg rejects seq 0
    assert keep.tolist() == [False, True, True, True]
    got = derive_metrics(reduce_metrics(m))
    assert got["corr/trm_max_reject_frac"] == 0.0 and got["corr/trm_avg_reject_frac"] == pytest.approx(1 / 3)
    keep, m = trm_keep(kl, mask, max_delta=0.3)
    assert derive_metrics(reduce_metrics(m))["corr/trm_alarm"] == 0.0
    with pytest.raises(ValueError, match="at least one criterion"):
        trm_keep(kl, mask)
    with pytest.raises(ValueError, match="length_neutral"):
        trm_keep(kl, mask, length_neutral="avg")


@pytest.mark.unit
def test_trm_mask_from_a_spec_reads_k2_for_max_k3_for_avg_or_the_exact_kl():
    """The spec says the criteria; ``trm_mask`` decides their statistics (docs/math.md 3.3): sample
    TRM = rollout_rs "seq_max_k2,seq_mean_k3" (verl mapping, a different code path), exact TRM
    reads only the exact per-token KL it is handed."""
    # log rho -0.4: k2 0.08 > 0.075 (max rejects), k3 0.0703; log rho 0.3: k2 0.045, k3 0.0499 > 0.047
    # (avg rejects); with the statistics swapped both sequences would be kept
    rollout = torch.full((3, 2), -1.0, dtype=F64)
    train = rollout + torch.tensor([[-0.4, -0.4], [0.3, 0.3], [0.0, 0.0]], dtype=F64)
    keep_B, m = trm_mask(TrmSpec(max=0.075, avg=0.047), train, rollout, torch.ones(3, 2, dtype=torch.bool))
    assert keep_B.tolist() == [False, False, True]
    assert reduce_metrics(m)["corr/trm_max_kl"] == pytest.approx(0.08)
    gen = torch.Generator().manual_seed(2)
    rollout = -torch.rand(16, 12, generator=gen, dtype=F64)
    train = rollout + torch.randn(16, 12, generator=gen, dtype=F64) * 0.2
    mask = torch.rand(16, 12, generator=gen) > 0.2
    keep_B, _ = trm_mask(TrmSpec(max=0.05, avg=0.02), train, rollout, mask)
    rules = parse_rs_spec(["seq_max_k2", "seq_mean_k3"], [0.05, 0.02])
    keep_BS, _ = rejection_mask(log_ratio(train, rollout), mask, rules)
    assert 0 < keep_B.sum() < 16
    assert torch.equal(keep_BS, mask & keep_B[:, None])
    # exact: a KL of 0.1 on sequence 3 only rejects it alone, whatever the log-ratios say
    exact_BS = torch.zeros(16, 12, dtype=F64)
    exact_BS[3] = 0.1
    keep_B, _ = trm_mask(TrmSpec(max=0.05, avg=0.02, kl="exact"), train, rollout, mask, exact_BS)
    assert keep_B.tolist() == [i != 3 for i in range(16)]
    with pytest.raises(ValueError, match="full distributions"):
        trm_mask(TrmSpec(max=0.05, kl="exact"), train, rollout, mask)


@pytest.mark.unit
def test_sample_based_form_equals_rs_options():
    """Sample TRM = rollout_rs "seq_max_k2,seq_mean_k3" (docs/math.md 3.3 verl mapping)."""
    gen = torch.Generator().manual_seed(2)
    lr = torch.randn(16, 12, generator=gen, dtype=F64) * 0.2
    mask = torch.rand(16, 12, generator=gen) > 0.2
    keep_B, _ = trm_keep(
        sample_kl_tokens(lr, "k2"),
        mask,
        max_delta=0.05,
        avg_delta=0.02,
        avg_kl_tok_BS=sample_kl_tokens(lr, "k3"),
    )
    keep_BS, _ = rejection_mask(lr, mask, parse_rs_spec(["seq_max_k2", "seq_mean_k3"], [0.05, 0.02]))
    assert 0 < keep_B.sum() < 16
    assert torch.equal(keep_BS, mask & keep_B[:, None])


@pytest.mark.unit
def test_length_neutral_variants_hand_computed():
    rho = torch.tensor([[1.1, 0.8, 1.0, 1.2]], dtype=F64)
    lr, mask = rho.log(), torch.ones(1, 4, dtype=torch.bool)
    dev = [0.1, 0.2, 0.0, 0.2]
    keep, m = trm_keep(None, mask, length_neutral="ser", log_ratio_BS=lr, ln_threshold=0.126)
    assert keep.tolist() == [True]
    assert reduce_metrics(m)["corr/trm_ser_score"] == pytest.approx(sum(dev) / 4)  # 0.125
    keep, _ = trm_keep(None, mask, length_neutral="ser", log_ratio_BS=lr, ln_threshold=0.124)
    assert keep.tolist() == [False]
    eps, delta = 0.5, 0.08
    w = [min(1, (4 - t) * eps, math.sqrt((4 - t) * delta / 2)) for t in range(1, 5)]  # [0.346, 0.283, 0.2, 0]
    score = sum(d * wt for d, wt in zip(dev, w)) / sum(w)
    keep, m = trm_keep(
        None,
        mask,
        length_neutral="ln",
        log_ratio_BS=lr,
        ln_threshold=score + 1e-9,
        ln_eps=eps,
        ln_delta=delta,
    )
    assert keep.tolist() == [True]
    assert reduce_metrics(m)["corr/trm_ln_score"] == pytest.approx(score)
    keep, _ = trm_keep(
        None,
        mask,
        length_neutral="ln",
        log_ratio_BS=lr,
        ln_threshold=score - 1e-6,
        ln_eps=eps,
        ln_delta=delta,
    )
    assert keep.tolist() == [False]
    with pytest.raises(ValueError, match="ln_eps"):
        trm_keep(None, mask, length_neutral="ln", log_ratio_BS=lr, ln_threshold=0.1)
    # LN uses response-token positions: interleaved padding / tool tokens do not change the score
    lr_gap = torch.tensor([[lr[0, 0], 5.0, lr[0, 1], lr[0, 2], 5.0, lr[0, 3]]], dtype=F64)
    mask_gap = torch.tensor([[True, False, True, True, False, True]])
    _, m_gap = trm_keep(
        None, mask_gap, length_neutral="ln", log_ratio_BS=lr_gap, ln_threshold=1.0, ln_eps=eps, ln_delta=delta
    )
    assert reduce_metrics(m_gap)["corr/trm_ln_score"] == pytest.approx(score)


@pytest.mark.unit
def test_vectorised_mask_matches_loop_reference():
    gen = torch.Generator().manual_seed(3)
    B, S = 12, 10
    kl = torch.rand(B, S, generator=gen, dtype=F64) * 0.06
    kl_avg = torch.rand(B, S, generator=gen, dtype=F64) * 0.03
    lr = torch.randn(B, S, generator=gen, dtype=F64) * 0.1
    mask = torch.rand(B, S, generator=gen) > 0.25
    eps, delta = 0.05, 0.01
    for ln in ("none", "ln", "ser"):
        keep, _ = trm_keep(
            kl,
            mask,
            max_delta=0.05,
            avg_delta=0.014,
            avg_kl_tok_BS=kl_avg,
            length_neutral=ln,
            log_ratio_BS=lr,
            ln_threshold=0.08,
            ln_eps=eps,
            ln_delta=delta,
        )
        for b in range(B):
            idx = [s for s in range(S) if mask[b, s]]
            if not idx:
                assert keep[b]
                continue
            T = len(idx)
            ok = (
                max(kl[b, s].item() for s in idx) <= 0.05
                and sum(kl_avg[b, s].item() for s in idx) / T <= 0.014
            )
            devs = [abs(math.exp(lr[b, s].item()) - 1) for s in idx]
            if ln == "ser":
                ok = ok and sum(devs) / T <= 0.08
            elif ln == "ln":
                w = [min(1, (T - t) * eps, math.sqrt((T - t) * delta / 2)) for t in range(1, T + 1)]
                ok = ok and (sum(d * x for d, x in zip(devs, w)) / sum(w) if sum(w) > 0 else 0.0) <= 0.08
            assert bool(keep[b]) == ok, (ln, b)


@pytest.mark.unit
def test_normaliser_is_total_batch_not_accepted_count():
    """Masked sequences contribute zero; the others keep weight 1 / N_total (docs/math.md 3.3)."""
    kl, mask = _batch()
    keep_B, _ = trm_keep(kl, mask, max_delta=0.05)  # rejects sequence 0
    gen = torch.Generator().manual_seed(4)
    logp = (torch.randn(4, 3, generator=gen, dtype=F64) * 0.1 - 1).requires_grad_(True)
    old = logp.detach().clone()  # ratio 1: loss_t = -A_t
    adv = torch.tensor([[1.0], [2.0], [-1.0], [5.0]], dtype=F64).expand(4, 3)
    total_tokens = mask.sum()  # counted BEFORE masking: 7
    loss, _ = decoupled_ppo_loss(
        PolicyLossSpec(clip_low=0.2, clip_high=0.2),
        logp,
        old,
        adv,
        mask,
        normalizer=total_tokens,
        keep=keep_B,
    )
    assert loss.item() == pytest.approx((-2.0 * 3 + 1.0 * 2) / 7)  # not / 5 (accepted tokens)
    loss.backward()
    assert (logp.grad[0] == 0).all()  # the rejected sequence has no gradient
    torch.testing.assert_close(logp.grad[1], torch.full((3,), -2.0 / 7, dtype=F64))


# ----------------------------------------------------------------------------- bounds


@pytest.mark.unit
def test_bound_table_t4096_reproduced():
    """docs/math.md 3.2 reference table, T = 4096, delta = 1e-4, eps = 5e-3, KL_seq = 0.01, TV_seq = 0.05."""
    kl_only = trm_bounds(4096, 1e-4, kl_seq=0.01)
    kl_tv = trm_bounds(4096, 1e-4, eps=5e-3, kl_seq=0.01, tv_seq=0.05)
    assert kl_only["eps"] == pytest.approx(7.07e-3, abs=5e-6) and kl_only["tv_seq"] == pytest.approx(
        0.0707, abs=5e-5
    )
    table = {  # row: (key, KL-only, KL+TV, decimals)
        "Classical": ("classical", 1677, 839, 0),
        "Coupling": ("coupling", 113.8, 79.9, 1),
        "PM-KL": ("pm_kl_closed", 35.0, 35.0, 1),
        "PM-TV": ("pm_tv_closed", 35.0, 24.7, 1),
        "Mix-KL": ("mix_kl", 8.2, 8.2, 1),
        "Mix-TV": ("mix_tv", 8.2, 4.1, 1),
        "Unified": ("unified", 8.2, 4.1, 1),
    }
    for row, (key, a, b, nd) in table.items():
        assert round(kl_only[key], nd) == a, (row, kl_only[key])
        assert round(kl_tv[key], nd) == b, (row, kl_tv[key])
    # the exact capped sums sit just below the paper's closed forms (integral bound)
    assert kl_only["pm_kl"] == pytest.approx(34.946, abs=1e-3) and kl_only["pm_kl"] <= kl_only["pm_kl_closed"]
    assert round(kl_tv["pm_tv"], 1) == 24.7 and kl_tv["pm_tv"] <= kl_tv["pm_tv_closed"]
    # Adaptive (hybrid) with uniform worst-case Dbar_t: <= 35.0 / <= 24.7
    assert kl_only["adaptive"] <= 35.0 and round(kl_only["adaptive"], 1) == 34.9
    assert kl_tv["adaptive"] <= kl_tv["pm_tv"] and round(kl_tv["adaptive"], 1) == 24.7
    assert kl_only["classical_kl"] == pytest.approx(1677.312)
    assert (
        math.floor(kl_tv["classical_kl"] / kl_tv["unified"]) == 409
    )  # "409x better" (1677.3 / 4.096 = 409.5)
    assert round(kl_only["linear"], 1) == 115.9  # paper v2 "Linear" row


@pytest.mark.unit
def test_bounds_large_divergence_v2_column():
    """Paper v2 table, delta = KL_seq = 1: classical 1.68e7, linear 11,585, PM 3.49e5 uncapped /
    11,582 capped, mixed 8,192."""
    b = trm_bounds(4096, 1.0, kl_seq=1.0)
    assert b["classical"] == pytest.approx(1.68e7, rel=3e-3)
    assert round(b["linear"]) == 11585
    assert b["pm_kl_closed"] == pytest.approx(3.49e5, rel=2e-3)
    assert round(b["pm_kl"]) == 11582
    assert b["mix_kl"] == pytest.approx(8192)
    assert b["unified"] == pytest.approx(8192)  # Adaptive reports "<= 8,192": Mixed is the min


@pytest.mark.unit
def test_bound_identities():
    # Adaptive recovers PM-KL with Dbar = sqrt(delta/2) and Coupling with Dbar = eps (paper Remark)
    T, delta, eps = 300, 2e-3, 4e-3
    b = trm_bounds(T, delta, eps=eps, kl_seq=0.2, tv_seq=0.1, dbar_t=[math.sqrt(delta / 2)] * T)
    assert b["adaptive_kl"] == pytest.approx(b["pm_kl"])
    b = trm_bounds(T, delta, eps=eps, kl_seq=0.2, tv_seq=0.1, dbar_t=[eps] * T)
    assert b["adaptive_tv"] == pytest.approx(b["coupling"])
    assert b["adaptive"] <= min(b["adaptive_kl"], b["adaptive_tv"]) + 1e-12
    # small-divergence closed forms and T eps <= 1 coupling = classical
    b = trm_bounds(100, 1e-4, eps=1e-3, kl_seq=1e-3, tv_seq=1e-2)
    assert b["coupling"] == pytest.approx(b["classical"])
    assert b["mix_kl"] == pytest.approx(2 * 100 * math.sqrt(1e-4 * 1e-3))
    assert b["mix_tv"] == pytest.approx(4 * 100 * 1e-3 * 1e-2)
    assert b["pm_kl"] <= b["pm_kl_closed"]
    # unified is the min of the six bounds; non-uniform Dbar_t makes adaptive strictly tighter
    dbar = torch.full((T,), 1e-4, dtype=F64)
    dbar[::50] = eps
    b = trm_bounds(T, delta, eps=eps, kl_seq=0.5, tv_seq=0.5, dbar_t=dbar)
    assert (
        b["unified"] == b["adaptive"] < min(b[k] for k in ("pm_kl", "pm_tv", "mix_kl", "mix_tv", "coupling"))
    )
    with pytest.raises(ValueError, match="dbar_t"):
        trm_bounds(T, delta, dbar_t=[0.1] * (T - 1))
    with pytest.raises(ValueError):
        trm_bounds(0, delta)
