"""moe_rl.advantages: closed forms, reference-loop equivalence, registry."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl import advantages
from moe_rl.advantages import ADVANTAGES, get_advantage, grpo, register_advantage, rloo
from moe_rl.metrics import reduce_metrics


def _mask(lens: list[int], S: int = 6) -> torch.Tensor:
    """Response mask with the response starting at position 1 (after a 1-token prompt)."""
    m = torch.zeros(len(lens), S, dtype=torch.bool)
    for b, n in enumerate(lens):
        m[b, 1:1 + n] = True
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
    torch.testing.assert_close(adv[:, 1], torch.tensor([1 / (math.sqrt(2) + 0.5), -1 / (math.sqrt(2) + 0.5),
                                                        2 / (std3 + 0.5), 1 / (std3 + 0.5), -3 / (std3 + 0.5)]))


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
    assert get_advantage("grpo") is grpo
    with pytest.raises(ValueError, match="known: .*grpo.*rloo"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda *a, **k: None)
    assert advantages.ADVANTAGES["grpo"] is grpo  # the failed registration changed nothing
