"""moe_rl.corrections.importance: IS weights, rejection masks (direction!), off-policy metrics."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from moe_rl.corrections import corrected_loss, importance
from moe_rl.corrections.correction_specs import CorrectionSpec, ImportanceSpec, parse_rs_spec
from moe_rl.corrections.derived import derive_metrics
from moe_rl.corrections.importance import (
    is_batch_mean_parts,
    is_weights,
    log_ratio,
    offpolicy_metrics,
    rejection_mask,
)
from moe_rl.maths import ratios
from moe_rl.maths.policy_specs import PolicyLossSpec
from moe_rl.metrics import merge_metrics, reduce_metrics

F64 = torch.float64


def _lr(rows):
    """[B, S] log ratios from rows of ratios (None = padding) and the mask."""
    width = max(len(r) for r in rows)
    lr = torch.zeros(len(rows), width, dtype=F64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        for s, rho in enumerate(row):
            if rho is not None:
                lr[b, s], mask[b, s] = math.log(rho), True
    return lr, mask


def _random_batch(seed, B=6, S=9, scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    train = torch.randn(B, S, generator=gen, dtype=F64) * 0.3 - 2
    roll = train + torch.randn(B, S, generator=gen, dtype=F64) * scale
    mask = torch.rand(B, S, generator=gen) > 0.3
    mask[0] = False  # one sequence without response tokens
    return train, roll, mask


def _unchecked(spec, **fields):
    """A copy of a frozen spec with fields set past its validation (to reach the maths' own check)."""
    out = copy.copy(spec)
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out


@pytest.mark.unit
def test_log_ratio_is_reused_not_duplicated():
    assert importance.log_ratio is corrected_loss.log_ratio is ratios.log_ratio
    assert importance.SAFETY_BOUND == ratios.SAFETY_BOUND == 20.0


@pytest.mark.unit
def test_token_is_weights_truncated_and_zero_on_padding():
    lr, mask = _lr([[0.5, 1.5, 4.0], [3.0, None, None]])
    w, m = is_weights(lr, mask, ImportanceSpec("token", clip=2.0))
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0], [2.0, 0.0, 0.0]], dtype=F64))
    got = reduce_metrics(m)
    assert got["corr/is_mean"] == pytest.approx((0.5 + 1.5 + 2 + 2) / 4)
    assert got["corr/is_max"] == 2.0 and got["corr/is_min"] == 0.5
    assert got["corr/is_ratio_fraction_high"] == pytest.approx(2 / 4)  # 4.0 and 3.0 > C
    assert got["corr/is_ratio_fraction_low"] == pytest.approx(0.0)  # 0.5 is not < 1/C
    assert got["corr/is_seq_mean"] == pytest.approx(((0.5 + 1.5 + 2) / 3 + 2) / 2)
    ess = derive_metrics(got)["corr/is_ess"]
    w_valid = torch.tensor([0.5, 1.5, 2.0, 2.0], dtype=F64)
    assert ess == pytest.approx((1 / ((w_valid / w_valid.mean()) ** 2).mean()).item())


@pytest.mark.unit
def test_sequence_and_geometric_weights():
    lr, mask = _lr([[1.2, 1.5, None], [0.5, 0.5, 0.5]])
    w, m = is_weights(lr, mask, ImportanceSpec("sequence", clip=2.0))
    # rho(y) = 1.8 (kept) and 0.125 (below 1/C: counted low, not clamped)
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8, 0.0], [0.125] * 3], dtype=F64))
    got = reduce_metrics(m)
    assert got["corr/is_ratio_fraction_low"] == pytest.approx(0.5)  # per sequence
    assert got["corr/is_seq_mean"] == pytest.approx((1.8 + 0.125) / 2)
    w, _ = is_weights(lr, mask, ImportanceSpec("sequence", clip=1.5))
    assert w[0, 0].item() == pytest.approx(1.5)
    w, _ = is_weights(lr, mask, ImportanceSpec("geometric", clip=None))
    torch.testing.assert_close(w, torch.tensor([[1.8**0.5] * 2 + [0.0], [0.5] * 3], dtype=F64))
    # the sum is clamped to +-20 before exp
    w, _ = is_weights(
        torch.full((1, 3), 15.0, dtype=F64),
        torch.ones(1, 3, dtype=torch.bool),
        ImportanceSpec("sequence", clip=None),
    )
    assert w[0, 0].item() == pytest.approx(math.exp(20.0))
    with pytest.raises(ValueError, match="IS weight level"):
        is_weights(lr, mask, _unchecked(ImportanceSpec("token", 2.0), level="tokens"))
    with pytest.raises(ValueError, match="correction.is_level"):  # the spec refuses it first
        ImportanceSpec("tokens", 2.0)


@pytest.mark.unit
def test_is_weights_never_carry_gradient():
    lr = torch.randn(3, 4, dtype=F64, requires_grad=True)
    for level in ("token", "sequence", "geometric"):
        w, _ = is_weights(
            lr, torch.ones(3, 4, dtype=torch.bool), ImportanceSpec(level, 2.0, batch_normalize=True)
        )
        assert not w.requires_grad and w.grad_fn is None


@pytest.mark.unit
def test_batch_normalisation():
    lr, mask = _lr([[0.5, 1.5, 4.0], [3.0, None, None]])
    w, m = is_weights(lr, mask, ImportanceSpec("token", 2.0, batch_normalize=True))
    assert (w[mask].mean()).item() == pytest.approx(1.0)
    assert reduce_metrics(m)["corr/is_batch_norm_factor"] == pytest.approx(6.0 / 4)
    lr, mask = _lr([[1.2, 1.5, None], [0.5, 0.5, 0.5]])
    w, _ = is_weights(lr, mask, ImportanceSpec("sequence", 2.0, batch_normalize=True))
    mean_seq = (1.8 + 0.125) / 2  # per sequence, not per token
    torch.testing.assert_close(w[:, 0], torch.tensor([1.8, 0.125], dtype=F64) / mean_seq)
    w_raw, _ = is_weights(lr, mask, ImportanceSpec("sequence", 2.0))
    total, count = is_batch_mean_parts(w_raw, mask, ImportanceSpec("sequence"))
    assert (total / count).item() == pytest.approx(mean_seq)
    w_global, _ = is_weights(lr, mask, ImportanceSpec("sequence", 2.0, batch_normalize=True), norm_mean=4.0)
    torch.testing.assert_close(w_global, w_raw / 4.0)


# ----------------------------------------------------------------------------- rejection


@pytest.mark.unit
def test_k1_direction_with_asymmetric_bound():
    """Bounds are on rho = pi_train / pi_rollout, NOT verl's mirrored pi_rollout / pi_train."""
    bound = [(0.6, 1.6)]
    lr, mask = _lr([[1.62], [0.61], [1.65], [0.59]])
    keep, _ = rejection_mask(lr, mask, parse_rs_spec(["token_k1"], bound))
    # ours: rho in [0.6, 1.6]; verl's reading would keep rho in [0.625, 1.667]: [True, False, True, False]
    assert keep[:, 0].tolist() == [False, True, False, False]
    # build the ratio from log-probs explicitly: train more likely than rollout -> rho > 1
    train = torch.log(torch.tensor([[0.81]], dtype=F64))
    roll = torch.log(torch.tensor([[0.50]], dtype=F64))  # rho = 1.62
    keep, _ = rejection_mask(
        log_ratio(train, roll), torch.ones(1, 1, dtype=torch.bool), parse_rs_spec(["token_k1"], bound)
    )
    assert not keep.item()
    keep, _ = rejection_mask(
        log_ratio(roll, train), torch.ones(1, 1, dtype=torch.bool), parse_rs_spec(["token_k1"], bound)
    )
    assert keep.item()  # rho = 1/1.62 = 0.617 is inside [0.6, 1.6]
    # sequence-level k1: seq_sum bounds rho(y), seq_mean bounds rho_geo
    lr, mask = _lr([[1.5, 1.1], [0.7, 0.8]])  # rho(y) = 1.65, 0.56
    keep, _ = rejection_mask(lr, mask, parse_rs_spec(["seq_sum_k1"], [(0.5, 1.6)]))
    assert keep.tolist() == [[False, False], [True, True]]
    keep, _ = rejection_mask(
        lr, mask, parse_rs_spec(["seq_mean_k1"], [(0.76, 1.3)])
    )  # rho_geo = 1.285, 0.748
    assert keep.tolist() == [[True, True], [False, False]]


@pytest.mark.unit
def test_each_option_hand_computed():
    # seq 0: rho = [2.0, 1.0]; seq 1: rho = [1.0, 1.1, 0.9]
    lr, mask = _lr([[2.0, 1.0, None], [1.0, 1.1, 0.9]])
    k2_tok = 0.5 * math.log(2.0) ** 2  # 0.240
    k3_tok = 2.0 - 1 - math.log(2.0)  # 0.307
    keep, m = rejection_mask(lr, mask, parse_rs_spec(["token_k2"], [0.2]))
    assert keep.tolist() == [[False, True, False], [True, True, True]]
    got = reduce_metrics(m)
    assert got["corr/rs_token_k2_max"] == pytest.approx(k2_tok)
    assert got["corr/rs_token_k2_masked_fraction"] == pytest.approx(1 / 5)
    assert got["corr/rs_token_k2_seq_masked_fraction"] == pytest.approx(1 / 2)
    keep, _ = rejection_mask(lr, mask, parse_rs_spec(["seq_max_k3"], 0.3))
    assert keep.tolist() == [[False, False, False], [True, True, True]]
    keep, m = rejection_mask(lr, mask, parse_rs_spec(["seq_mean_k3"], [k3_tok / 2 + 1e-9]))
    assert keep[0].tolist() == [True, True, False]  # mean k3 of seq 0 == k3_tok / 2, kept (<=)
    assert reduce_metrics(m)["corr/rs_seq_mean_k3_mean"] == pytest.approx(
        (k3_tok / 2 + (1.1 - 1 - math.log(1.1) + 0.9 - 1 - math.log(0.9)) / 3) / 2
    )
    keep, _ = rejection_mask(lr, mask, parse_rs_spec(["seq_sum_k2"], [0.2]))
    assert keep.tolist() == [[False, False, False], [True, True, True]]
    keep, _ = rejection_mask(lr, mask, parse_rs_spec(["token_k1"], 1.5))  # float U -> (1/U, U)
    assert keep.tolist() == [[False, True, False], [True, True, True]]


@pytest.mark.unit
def test_options_are_and_combined():
    lr, mask = _lr([[2.0, 1.0], [1.0, 1.3], [1.05, 1.05]])
    keep_a, _ = rejection_mask(lr, mask, parse_rs_spec(["token_k1"], [(0.5, 1.5)]))
    keep_b, _ = rejection_mask(lr, mask, parse_rs_spec(["seq_sum_k1"], [(0.8, 1.2)]))
    keep, m = rejection_mask(lr, mask, parse_rs_spec(["token_k1", "seq_sum_k1"], [(0.5, 1.5), (0.8, 1.2)]))
    assert torch.equal(keep, keep_a & keep_b)
    assert keep.tolist() == [[False, False], [False, False], [True, True]]
    got = reduce_metrics(m)
    assert got["corr/rs_masked_fraction"] == pytest.approx(4 / 6)
    assert got["corr/rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert got["corr/rs_token_k1_masked_fraction"] == pytest.approx(1 / 6)
    assert got["corr/rs_seq_sum_k1_masked_fraction"] == pytest.approx(4 / 6)


@pytest.mark.unit
def test_rs_spec_validation():
    assert parse_rs_spec(["seq_max_k2", "seq_mean_k3"], [0.05, 0.001])[1] == (
        "seq_mean",
        "k3",
        -math.inf,
        0.001,
    )
    agg, kind, lo, hi = parse_rs_spec(["token_k1"], [(0.6, 1.6)])[0]
    assert (
        (agg, kind) == ("token", "k1")
        and lo == pytest.approx(math.log(0.6))
        and hi == pytest.approx(math.log(1.6))
    )
    assert len(parse_rs_spec(["token_k2", "seq_max_k3"], 2.0)) == 2  # broadcast
    for options, bounds, match in [
        (["seq_max_k1"], [2.0], "seq_max_k1"),
        (["token_k4"], [1.0], "unknown rejection option"),
        (["seq_median_k2"], [1.0], "unknown rejection option"),
        (["token_k2"], [(0.5, 2.0)], "one float"),
        (["token_k1"], [0.5], "U >= 1"),
        (["token_k1"], [(2.0, 0.5)], "lo <= hi"),
        (["token_k1", "token_k2"], [1.0, 2.0, 3.0], "bounds"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_rs_spec(options, bounds)
    with pytest.raises(TypeError):
        parse_rs_spec("token_k1", [2.0])


def _loop_rejection(lr, mask, option, bound):
    """Per-sequence Python reference."""
    agg, kind, lo, hi = parse_rs_spec([option], [bound])[0]
    keep = torch.zeros_like(mask)
    for b in range(lr.shape[0]):
        idx = [s for s in range(lr.shape[1]) if mask[b, s]]
        vals = [ratios.kl_from_log_ratio(lr[b, s], kind).item() for s in idx]
        tests = [-v if kind == "k1" else v for v in vals]
        for j, s in enumerate(idx):
            if agg == "token":
                keep[b, s] = lo <= tests[j] <= hi
            else:
                stat = {"seq_sum": sum(vals), "seq_mean": sum(vals) / len(vals), "seq_max": max(vals)}[agg]
                keep[b, s] = lo <= (-stat if kind == "k1" else stat) <= hi
    return keep


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_matches_loop_reference(seed):
    train, roll, mask = _random_batch(seed)
    lr = log_ratio(train, roll)
    for option, bound in [
        ("token_k1", (0.7, 1.2)),
        ("seq_sum_k1", (0.3, 2.5)),
        ("seq_mean_k1", (0.9, 1.05)),
        ("token_k2", 0.05),
        ("seq_sum_k2", 0.4),
        ("seq_mean_k2", 0.08),
        ("seq_max_k2", 0.2),
        ("token_k3", 0.05),
        ("seq_sum_k3", 0.5),
        ("seq_mean_k3", 0.1),
        ("seq_max_k3", 0.3),
    ]:
        keep, _ = rejection_mask(lr, mask, parse_rs_spec([option], [bound]))
        assert torch.equal(keep, _loop_rejection(lr, mask, option, bound)), option


# ----------------------------------------------------------------------------- diagnostics


@pytest.mark.unit
def test_offpolicy_metrics_hand_computed():
    train = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.4, 0.8, 0.3]], dtype=F64))
    roll = torch.log(torch.tensor([[0.25, 0.2, 0.9], [0.5, 0.8, 0.3]], dtype=F64))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    got = reduce_metrics(offpolicy_metrics(train, roll, mask))
    rho = [2.0, 1.0, 0.8]
    assert got["corr/k1_kl"] == pytest.approx(-sum(math.log(r) for r in rho) / 3)
    assert got["corr/k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 3)
    assert got["corr/chi2_token"] == pytest.approx(sum(r * r for r in rho) / 3 - 1)
    assert got["corr/chi2_seq"] == pytest.approx((2.0**2 + 0.8**2) / 2 - 1)
    d0 = (math.log(0.25) + math.log(0.2)) / 2 - (math.log(0.5) + math.log(0.2)) / 2
    d1 = math.log(0.5) - math.log(0.4)
    assert got["corr/log_ppl_diff"] == pytest.approx((d0 + d1) / 2)
    assert got["corr/log_ppl_abs_diff"] == pytest.approx((abs(d0) + abs(d1)) / 2)
    assert got["corr/log_ppl_diff_max"] == pytest.approx(d1) and got[
        "corr/log_ppl_diff_min"
    ] == pytest.approx(d0)
    ppl_train = [math.exp(-(math.log(0.5) + math.log(0.2)) / 2), 1 / 0.4]
    ppl_roll = [math.exp(-(math.log(0.25) + math.log(0.2)) / 2), 1 / 0.5]
    assert got["corr/training_ppl"] == pytest.approx(sum(ppl_train) / 2)
    assert got["corr/rollout_ppl"] == pytest.approx(sum(ppl_roll) / 2)
    assert got["corr/training_log_ppl"] == pytest.approx(sum(math.log(p) for p in ppl_train) / 2)
    assert got["corr/ppl_ratio"] == pytest.approx(sum(a / b for a, b in zip(ppl_train, ppl_roll)) / 2)
    assert all(k.startswith("corr/") for k in got)


@pytest.mark.unit
def test_metrics_split_across_microbatches_equal_whole_batch():
    """Sequence-level and token-level metrics reduce exactly however the batch is split."""
    train, roll, mask = _random_batch(3, B=8)
    lr = log_ratio(train, roll)

    def all_metrics(sl):
        out = dict(offpolicy_metrics(train[sl], roll[sl], mask[sl]))
        out.update(is_weights(lr[sl], mask[sl], ImportanceSpec("sequence", 2.0))[1])
        out.update(
            rejection_mask(lr[sl], mask[sl], parse_rs_spec(["token_k1", "seq_max_k2"], [(0.5, 2.0), 0.3]))[1]
        )
        return out

    whole = reduce_metrics(all_metrics(slice(None)))
    merged = merge_metrics(all_metrics(slice(0, 3)), all_metrics(slice(3, 8)))
    split = reduce_metrics(merged)
    assert whole.keys() == split.keys()
    for key in whole:
        assert split[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-15), key


@pytest.mark.unit
def test_is_weights_match_loop_reference():
    train, roll, mask = _random_batch(5)
    lr = log_ratio(train, roll)
    for level in ("token", "sequence", "geometric"):
        w, _ = is_weights(lr, mask, ImportanceSpec(level, 1.7))
        for b in range(lr.shape[0]):
            idx = [s for s in range(lr.shape[1]) if mask[b, s]]
            for s in range(lr.shape[1]):
                if s not in idx:
                    assert w[b, s].item() == 0.0
                    continue
                log_w = {
                    "token": lr[b, s].item(),
                    "sequence": sum(lr[b, j].item() for j in idx),
                    "geometric": sum(lr[b, j].item() for j in idx) / len(idx),
                }[level]
                assert w[b, s].item() == pytest.approx(min(math.exp(log_w), 1.7))


# ------------------------------------------------ exact sequence ratios (issue 14 point 7)


def _extreme():
    # sequence 0: token log-ratios +30 and -29.5 (sum 0.5, mean 0.25); sequence 1: +15, +15
    # (sum 30 -> clamped to 20, mean 15); sequence 2: -25 alone; padding holds inf (never read)
    train = torch.tensor([[30.0, -29.5, 0.0], [15.0, 15.0, 0.0], [-25.0, 0.0, 0.0]], dtype=F64)
    roll = torch.zeros(3, 3, dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, False], [True, False, False]])
    train[~mask] = math.inf
    return train, roll, mask


@pytest.mark.unit
def test_sequence_and_geometric_weights_are_exact_on_extreme_token_ratios():
    train, roll, mask = _extreme()
    lr = ratios.exact_log_ratio(train, roll)
    seq, _ = is_weights(lr, mask, ImportanceSpec("sequence", None))
    geo, _ = is_weights(lr, mask, ImportanceSpec("geometric", None))
    tok, _ = is_weights(lr, mask, ImportanceSpec("token", None))
    assert seq[0, :2].tolist() == [math.exp(0.5)] * 2  # e^(30 - 29.5), not e^(20 - 29.5) = e^-9.5
    assert seq[1, :2].tolist() == [math.exp(20.0)] * 2  # the sum 30 is clamped, after summing
    assert seq[2, 0].item() == math.exp(-20.0)
    assert geo[0, :2].tolist() == [math.exp(0.25)] * 2
    assert geo[1, :2].tolist() == [math.exp(15.0)] * 2
    assert tok[0, :2].tolist() == [math.exp(20.0), math.exp(-20.0)]  # a token weight clamps its own
    for w in (seq, geo, tok):
        assert w[~mask].tolist() == [0.0] * int((~mask).sum())


@pytest.mark.unit
def test_chi2_seq_and_seq_k1_rejection_use_the_exact_sum():
    train, roll, mask = _extreme()
    m = offpolicy_metrics(train, roll, mask)
    got = float(m["corr/chi2_seq"].sum / m["corr/chi2_seq"].count)
    want = (math.expm1(2 * 0.5) + math.expm1(2 * 20.0) + math.expm1(2 * -20.0)) / 3
    assert got == pytest.approx(want, rel=1e-12)
    lr = ratios.exact_log_ratio(train, roll)
    # keep sequences with rho(y) in [e^-1, e^1]: only sequence 0 (sum 0.5)
    keep, _ = rejection_mask(lr, mask, parse_rs_spec(["seq_sum_k1"], [(math.exp(-1), math.exp(1))]))
    assert keep.any(-1).tolist() == [True, False, False]
    keep, _ = rejection_mask(lr, mask, parse_rs_spec(["seq_mean_k1"], [(math.exp(0.2), math.exp(0.3))]))
    assert keep.any(-1).tolist() == [True, False, False]  # mean 0.25


@pytest.mark.unit
def test_k1_kl_averages_the_exact_token_log_ratios():
    """corr/k1_kl = mean(log pi_rollout - log pi_train) over response tokens, no per-token clamp:
    the clamp at 20 would change every value below."""
    train, roll, mask = _extreme()
    m = reduce_metrics(offpolicy_metrics(train, roll, mask))
    # tokens +30, -29.5, +15, +15, -25: mean log rho 5.5 / 5 (clamped terms would give 10 / 5)
    assert m["corr/k1_kl"] == -1.1
    one = reduce_metrics(
        offpolicy_metrics(
            torch.tensor([[25.0]], dtype=F64), torch.zeros(1, 1, dtype=F64), torch.tensor([[True]])
        )
    )
    assert one["corr/k1_kl"] == -25.0
    # k3 still takes e^lr of the clamped token term (finite): e^20 - 1 - 20
    assert one["corr/k3_kl"] == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-12)


@pytest.mark.unit
def test_glue_and_bypass_paths_weight_sequences_exactly():
    from moe_rl.config import load_config
    from moe_rl.step import drift
    from moe_rl.step.plan import StepPlan

    train, roll, mask = _extreme()
    train, roll, mask = train[:1].float(), roll[:1].float(), mask[:1]
    plan = StepPlan.from_config(load_config(None, ["correction.is_level=sequence", "correction.is_clip=1e6"]))
    corr, _ = drift.drift_tensors(plan.correction, train, roll, mask, None)
    assert corr.is_weights_BS[0, :2].tolist() == pytest.approx([math.exp(0.5)] * 2, rel=1e-6)
    logp = train.clone().requires_grad_(True)
    bypass = CorrectionSpec(mode="bypass", bypass_loss="reinforce", is_level="sequence", is_clip=1e6)
    _, metrics = corrected_loss.bypass_loss(
        PolicyLossSpec(), bypass, logp, roll, torch.ones(1, 3), mask, normalizer=2.0
    )
    assert float(metrics["corr/is_max"].value) == pytest.approx(math.exp(0.5), rel=1e-6)


@pytest.mark.unit
def test_reciprocal_pair_docstring_is_exact():
    doc = importance.__doc__
    assert "0.999_1.001 is not a\nreciprocal pair (1/1.001 = 0.999000999...)" in doc
    assert 1 / 1.001 == pytest.approx(0.999000999000999, abs=1e-15)
