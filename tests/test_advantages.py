"""moe_rl.maths.advantages: closed forms, reference-loop equivalence, registry."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.learner.logprobs import token_logprobs_energy
from moe_rl.maths import advantages
from moe_rl.maths.advantages import (
    ADVANTAGES,
    extra_inputs,
    get_advantage,
    grpo,
    otb,
    otb_multiturn,
    register_advantage,
    rloo,
)
from moe_rl.metrics import reduce_metrics
from moe_rl.names import ADVANTAGE_NAMES


def _mask(lens: list[int], S: int = 6) -> torch.Tensor:
    """Response mask with the response starting at position 1 (after a 1-token prompt)."""
    m = torch.zeros(len(lens), S, dtype=torch.bool)
    for b, n in enumerate(lens):
        m[b, 1 : 1 + n] = True
    return m


@pytest.mark.unit
def test_grpo_closed_form_std_norm():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = _mask([2, 3, 1, 4, 2, 5])
    adv, _ = grpo(rewards, group, mask, std_norm=True, eps=0.0)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 1: mean 2, unbiased std sqrt(2)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2.0)
    expect_B = torch.tensor([0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 1 / s1, -1 / s1])
    torch.testing.assert_close(adv, expect_B[:, None] * mask, rtol=1e-6, atol=1e-7)
    assert adv.dtype == torch.float32 and adv.shape == mask.shape
    assert (adv[~mask] == 0).all()


@pytest.mark.unit
def test_grpo_eps_and_no_std_norm():
    rewards = torch.tensor([2.0, 0.0, 5.0, 4.0, 0.0])
    group = torch.tensor([7, 7, 3, 3, 3])  # non-contiguous ids, unsorted
    mask = torch.ones(5, 2, dtype=torch.bool)
    adv, _ = grpo(rewards, group, mask, std_norm=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1.0, 2.0, 1.0, -3.0]))
    adv, _ = grpo(rewards, group, mask, std_norm=True, eps=0.5)
    std3 = math.sqrt((4 + 1 + 9) / 2)
    torch.testing.assert_close(
        adv[:, 1],
        torch.tensor(
            [
                1 / (math.sqrt(2) + 0.5),
                -1 / (math.sqrt(2) + 0.5),
                2 / (std3 + 0.5),
                1 / (std3 + 0.5),
                -3 / (std3 + 0.5),
            ]
        ),
    )


@pytest.mark.unit
@pytest.mark.parametrize("fn", [grpo, rloo])
def test_zero_std_group_gives_exact_zero(fn):
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.7])  # 0.1 * 3 / 3 != 0.1 in floating point
    group = torch.tensor([0, 0, 0, 1, 1, 2])  # group 2 has a single sample
    adv, metrics = fn(rewards, group, torch.ones(6, 3, dtype=torch.bool))
    assert (adv[:3] == 0).all() and (adv[5] == 0).all()
    assert (adv[3] > 0).all() and (adv[4] < 0).all()
    assert reduce_metrics(metrics)["adv/zero_std_group_frac"] == pytest.approx(2 / 3)


@pytest.mark.unit
def test_rloo_closed_form():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    group = torch.tensor([0, 0, 0, 1, 1])
    adv, _ = rloo(rewards, group, torch.ones(5, 1, dtype=torch.bool))
    # r_i - mean of the others
    expect = torch.tensor([1 - 0.0, 0 - 0.5, 0 - 0.5, 2 - 4.0, 4 - 2.0])
    torch.testing.assert_close(adv[:, 0], expect)


def _reference(rewards, group, mask, kind, std_norm, eps=1e-6):
    """Plain-Python loop over groups (verl-style) for the equivalence test."""
    adv_B = torch.zeros(len(rewards), dtype=torch.float64)
    for g in group.unique().tolist():
        idx = (group == g).nonzero().flatten().tolist()
        r = rewards[idx].double()
        if len(idx) == 1 or bool((r == r[0]).all()):
            continue
        for j, i in enumerate(idx):
            if kind == "grpo":
                a = r[j] - r.mean()
                adv_B[i] = a / (r.std() + eps) if std_norm else a
            else:
                adv_B[i] = r[j] - (r.sum() - r[j]) / (len(idx) - 1)
    return (adv_B[:, None] * mask).float()


@pytest.mark.unit
@pytest.mark.parametrize("kind,std_norm", [("grpo", True), ("grpo", False), ("rloo", False)])
def test_vectorized_matches_reference_loop(kind, std_norm):
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        B, S = 48, 9
        group = torch.randint(0, 13, (B,), generator=gen) * 3  # sizes vary, some groups of one
        rewards = torch.randint(0, 3, (B,), generator=gen).float() * 0.5  # ties -> zero-std groups
        rewards[:8] = torch.rand(8, generator=gen)
        mask = torch.rand(B, S, generator=gen) > 0.3
        adv, metrics = get_advantage(kind)(rewards, group, mask, std_norm=std_norm)
        ref = _reference(rewards, group, mask, kind, std_norm)
        torch.testing.assert_close(adv, ref, rtol=1e-5, atol=1e-6)
        got = reduce_metrics(metrics)
        flat = ref[mask].double()
        assert got["adv/mean"] == pytest.approx(flat.mean().item(), abs=1e-6)
        assert got["adv/std"] == pytest.approx(flat.std(unbiased=False).item(), rel=1e-5)


@pytest.mark.unit
def test_metrics_pool_exactly_over_a_split_batch():
    gen = torch.Generator().manual_seed(1)
    rewards, group = torch.rand(12, generator=gen), torch.arange(12) // 4
    mask = torch.rand(12, 5, generator=gen) > 0.2
    _, whole = grpo(rewards, group, mask)
    _, a = grpo(rewards[:8], group[:8], mask[:8])  # groups kept whole on each "rank"
    _, b = grpo(rewards[8:], group[8:], mask[8:])
    from moe_rl.metrics import merge_metrics

    split = reduce_metrics(merge_metrics(a, b))
    for key, value in reduce_metrics(whole).items():
        assert split[key] == pytest.approx(value, abs=1e-12)


@pytest.mark.unit
def test_registry():
    assert {"grpo", "rloo"} <= set(ADVANTAGES)
    assert set(ADVANTAGES) == set(ADVANTAGE_NAMES)  # the names moe_rl.config checks when a config loads
    assert get_advantage("grpo") is grpo
    with pytest.raises(ValueError, match="known: .*grpo.*rloo"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda *a, **k: None)
    assert advantages.ADVANTAGES["grpo"] is grpo  # the failed registration changed nothing


# ----------------------------------------------------------------------------- OTB (docs/math.md 6.2)

HALF = math.log(0.5)  # pi(y) = 0.5 everywhere below, so w_t = 1 - 1 + sum_pi_sq = sum_pi_sq


def _otb_inputs(spans: list[list[int]], w: list[list[float]], S: int):
    """mask true at the listed columns; logp = log 0.5 and sum_pi_sq = w there (so w_t = w),
    junk elsewhere."""
    B = len(spans)
    mask = torch.zeros(B, S, dtype=torch.bool)
    sum_pi_sq = torch.full((B, S), 0.9, dtype=torch.float64)  # off-mask junk must not matter
    logp = torch.full((B, S), -0.1, dtype=torch.float64)
    for b, (cols, ws) in enumerate(zip(spans, w)):
        mask[b, cols] = True
        sum_pi_sq[b, cols] = torch.tensor(ws, dtype=torch.float64)
        logp[b, cols] = HALF
    return mask, sum_pi_sq, logp


@pytest.mark.unit
def test_otb_closed_form_single_turn():
    # A (r=1): response at cols 1-2, w = [.5, .25] -> W = [.5, .75]
    # B (r=2): response at cols 2-4 (longer prompt), w = [.25, .25, .5] -> W = [.25, .5, 1]
    # C (r=.7): alone in its group -> baseline 0, advantage = r
    mask, spi, logp = _otb_inputs(
        [[1, 2], [2, 3, 4], [3, 4]], [[0.5, 0.25], [0.25, 0.25, 0.5], [0.3, 0.3]], S=6
    )
    rewards, group = torch.tensor([1.0, 2.0, 0.7]), torch.tensor([4, 4, 9])
    adv, _ = otb(rewards, group, mask, sum_pi_sq_BS=spi, logp_BS=logp, eps=0.0)
    # positions counted from each response's start: B*_0 = (1*.5 + 2*.25)/.75 = 4/3,
    # B*_1 = (1*.75 + 2*.5)/1.25 = 1.4, B*_2 = 2*1/1 = 2 (B alone)
    expect = torch.zeros(3, 6, dtype=torch.float64)
    expect[0, 1:3] = torch.tensor([1 - 4 / 3, 1 - 1.4])
    expect[1, 2:5] = torch.tensor([2 - 4 / 3, 2 - 1.4, 0.0])
    expect[2, 3:5] = 0.7
    torch.testing.assert_close(adv, expect.float(), rtol=0, atol=1e-7)
    assert adv.dtype == torch.float32
    # handle_zero_tail: B is strictly the longest (3 > 2): its baseline from position 2 on is 0
    adv_zt, _ = otb(rewards, group, mask, sum_pi_sq_BS=spi, logp_BS=logp, eps=0.0, handle_zero_tail=True)
    expect[1, 4] = 2.0
    torch.testing.assert_close(adv_zt, expect.float(), rtol=0, atol=1e-7)
    # default eps = 1e-8 only perturbs at the 1e-8 level
    adv_eps, _ = otb(rewards, group, mask, sum_pi_sq_BS=spi, logp_BS=logp)
    torch.testing.assert_close(adv_eps, adv, rtol=0, atol=1e-7)


@pytest.mark.unit
def test_otb_is_weights_scale_energy_by_their_square():
    mask, spi, logp = _otb_inputs([[1, 2], [2, 3, 4]], [[0.5, 0.25], [0.25, 0.25, 0.5]], S=6)
    rewards, group = torch.tensor([1.0, 2.0]), torch.tensor([0, 0])
    isw = torch.ones(2, 6, dtype=torch.float64)
    isw[0, 1] = 2.0  # A's first w: .5 * 4 = 2 -> W_A = [2, 2.25]
    isw[1, 0] = 5.0  # off the mask: ignored
    adv, _ = otb(rewards, group, mask, sum_pi_sq_BS=spi, logp_BS=logp, is_weights_BS=isw, eps=0.0)
    b0, b1 = (2 + 2 * 0.25) / 2.25, (2.25 + 2 * 0.5) / 2.75  # 10/9, 13/11
    torch.testing.assert_close(adv[0, 1:3], torch.tensor([1 - b0, 1 - b1]), rtol=0, atol=1e-7)
    torch.testing.assert_close(adv[1, 2:5], torch.tensor([2 - b0, 2 - b1, 0.0]), rtol=0, atol=1e-7)


@pytest.mark.unit
def test_otb_multiturn_compacts_tool_tokens():
    # A (r=1): model tokens at cols 1, 3, 4; col 2 is a tool token (masked). B (r=0): cols 1, 2.
    mask, spi, logp = _otb_inputs([[1, 3, 4], [1, 2]], [[0.5, 0.25, 0.25], [0.25, 0.5]], S=6)
    spi[0, 2] = 0.75  # the tool token's energy must not enter W
    rewards, group = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    kw = {"sum_pi_sq_BS": spi, "logp_BS": logp, "eps": 0.0}
    # compacted: A W = [.5, .75, 1] at positions 0, 1, 2; B W = [.25, .75] at 0, 1.
    # B*_0 = .5/.75 = 2/3, B*_1 = .75/1.5 = .5; A is strictly longest (3 > 2): B*_2 = 0 (zero tail)
    adv, _ = otb_multiturn(rewards, group, mask, **kw)
    torch.testing.assert_close(adv[0, [1, 3, 4]], torch.tensor([1 / 3, 0.5, 1.0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(adv[1, [1, 2]], torch.tensor([-2 / 3, -0.5]), rtol=0, atol=1e-7)
    assert adv[0, 2] == 0 and (adv[:, 5] == 0).all()
    adv, _ = otb_multiturn(rewards, group, mask, handle_zero_tail=False, **kw)
    assert adv[0, 4] == pytest.approx(0.0, abs=1e-7)  # B*_2 = 1*1/1 (A alone)
    # single-turn OTB on the same data: positions are columns from the response start, so the
    # tool token advances A's position (A at 0, 2, 3; B at 0, 1); nothing shares positions past 0
    adv, _ = otb(rewards, group, mask, **kw)
    torch.testing.assert_close(adv[0, [1, 3, 4]], torch.tensor([1 / 3, 0.0, 0.0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(adv[1, [1, 2]], torch.tensor([-2 / 3, 0.0]), rtol=0, atol=1e-7)
    # zero tail compares response-token counts (A 3, B 2) with positions, as the reference does
    adv, _ = otb(rewards, group, mask, handle_zero_tail=True, **kw)
    torch.testing.assert_close(adv[0, [1, 3, 4]], torch.tensor([1 / 3, 1.0, 1.0]), rtol=0, atol=1e-7)


@pytest.mark.unit
@pytest.mark.parametrize("fn", [otb, otb_multiturn])
def test_otb_missing_inputs_raise_naming_them(fn):
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="sum_pi_sq_BS"):
        fn(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, logp_BS=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="logp_BS"):
        fn(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, sum_pi_sq_BS=torch.zeros(2, 3))


def _otb_reference(rewards, group, mask, logp, spi, isw, handle_zero_tail, compact, eps=1e-8):
    """The authors' per-group loops (docs/math.md 6.2), transcribed for the equivalence test."""
    B, S = mask.shape
    m = mask.double()
    w = 1 - 2 * logp.double().exp() + spi.double()
    if isw is not None:
        w = w * isw.double() ** 2
    W = (w * m).cumsum(-1)
    starts = [int(mask[b].nonzero()[0]) if mask[b].any() else 0 for b in range(B)]
    rows_W, rows_R, lens = torch.zeros(B, S, dtype=torch.float64), torch.zeros(B, S, dtype=torch.float64), []
    for b in range(B):  # align on the response: compacted (multi-turn) or from the first response column
        cols = mask[b].nonzero().flatten() if compact else torch.arange(starts[b], S)
        rows_W[b, : len(cols)] = W[b, cols] * m[b, cols]
        rows_R[b, : len(cols)] = float(rewards[b]) * m[b, cols]
        lens.append(int(m[b].sum()))
    base = torch.zeros(B, S, dtype=torch.float64)
    for g in group.unique().tolist():
        idx = [b for b in range(B) if group[b] == g and (lens[b] > 0 or not compact)]
        if len(idx) <= 1:
            continue
        b_star = (rows_R[idx] * rows_W[idx]).sum(0) / (rows_W[idx].sum(0) + eps)
        base[idx] = b_star
        gl = sorted(lens[i] for i in idx)
        at_max = [i for i in idx if lens[i] == gl[-1]]
        if handle_zero_tail and len(at_max) == 1 and gl[-1] > gl[-2]:
            base[at_max[0], gl[-2] :] = 0.0
    adv = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        cols = mask[b].nonzero().flatten()
        pos = torch.arange(len(cols)) if compact else cols - starts[b]
        adv[b, cols] = float(rewards[b]) - base[b, pos]
    return adv.float()


@pytest.mark.unit
@pytest.mark.parametrize("compact", [False, True])
def test_otb_vectorized_matches_reference_loop(compact):
    gen = torch.Generator().manual_seed(3)
    B, S, V = 30, 12, 7
    for trial in range(3):
        group = torch.randint(0, 9, (B,), generator=gen) * 2  # sizes vary, some groups of one
        rewards = torch.randint(0, 2, (B,), generator=gen).double()
        rewards[:5] = torch.rand(5, generator=gen, dtype=torch.float64)
        start = torch.randint(1, 4, (B,), generator=gen)
        length = torch.randint(1, S - 3, (B,), generator=gen)
        cols = torch.arange(S)[None, :]
        mask = (cols >= start[:, None]) & (cols < (start + length)[:, None])
        if compact:
            mask &= torch.rand(B, S, generator=gen) > 0.25  # tool tokens inside the response
        mask[0] = False  # an empty response
        logits = torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2
        tokens = torch.randint(0, V, (B, S), generator=gen)
        logp, _, spi = token_logprobs_energy(logits, tokens)
        isw = torch.rand(B, S, generator=gen, dtype=torch.float64) * 2 if trial == 2 else None
        for zt in (False, True):
            fn = otb_multiturn if compact else otb
            adv, metrics = fn(
                rewards, group, mask, sum_pi_sq_BS=spi, logp_BS=logp, is_weights_BS=isw, handle_zero_tail=zt
            )
            ref = _otb_reference(rewards, group, mask, logp, spi, isw, zt, compact)
            torch.testing.assert_close(adv, ref, rtol=1e-6, atol=1e-6)
            got = reduce_metrics(metrics)
            assert got["adv/mean"] == pytest.approx(ref[mask].double().mean().item(), abs=1e-6)


@pytest.mark.unit
def test_every_estimator_declares_inputs_and_takes_the_shared_call():
    gen = torch.Generator().manual_seed(4)
    rewards, group = torch.rand(8, generator=gen), torch.arange(8) // 4
    mask = torch.ones(8, 5, dtype=torch.bool)
    mask[:, 0] = False
    available = {
        "logp_BS": torch.full((8, 5), HALF),
        "sum_pi_sq_BS": torch.full((8, 5), 0.5),
        "is_weights_BS": None,
        "unrelated": 1,
    }
    for name, fn in ADVANTAGES.items():
        assert isinstance(fn.REQUIRES, tuple) and isinstance(fn.OPTIONAL, tuple), name
        extra = extra_inputs(fn, available)
        assert set(extra) == set(fn.REQUIRES)  # None optionals and unknown names are left out
        adv, metrics = fn(rewards, group, mask, std_norm=True, **extra)
        assert adv.shape == mask.shape and (adv[:, 0] == 0).all()
        assert {"adv/mean", "adv/std", "adv/zero_std_group_frac"} <= set(metrics)
    assert grpo.REQUIRES == () and rloo.REQUIRES == ()
    assert otb.REQUIRES == ("sum_pi_sq_BS", "logp_BS") and otb.OPTIONAL == ("is_weights_BS",)
    with pytest.raises(ValueError, match="sum_pi_sq_BS"):
        extra_inputs(otb, {"logp_BS": available["logp_BS"]})


@pytest.mark.unit
def test_otb_with_equal_energies_is_the_group_mean_baseline():
    # all W_t equal across the group at every shared position -> B*_t = mean_g r (GRPO without std)
    rewards, group = torch.tensor([1.0, 0.0, 0.0, 3.0]), torch.tensor([0, 0, 0, 0])
    mask = torch.ones(4, 3, dtype=torch.bool)
    spi = torch.full((4, 3), 0.5, dtype=torch.float64)
    adv, _ = otb(rewards, group, mask, sum_pi_sq_BS=spi, logp_BS=torch.full((4, 3), HALF), eps=0.0)
    grpo_adv, _ = grpo(rewards, group, mask, std_norm=False)
    torch.testing.assert_close(adv, grpo_adv, rtol=0, atol=1e-7)
