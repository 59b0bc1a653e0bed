"""moe_rl.maths.variance: the docs/math.md 6.4 proxies on hand-computed batches, and exact cross-rank
pooling."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.maths.variance import finalize_variance_proxies, variance_proxies
from moe_rl.metrics import merge_metrics, reduce_metrics

HALF = math.log(0.5)


def _batch():
    """Two sequences; pi(y) = 0.5 on response tokens, so w_t = sum_pi_sq_t there."""
    mask = torch.tensor([[True, True, False], [False, True, True]])
    adv = torch.tensor([[1.0, 3.0, 99.0], [0.0, -2.0, -2.0]])  # Abar = 2, -2 (99 is off the mask)
    spi = torch.tensor([[0.5, 0.25, 0.9], [0.9, 0.75, 0.25]], dtype=torch.float64)  # W = .75, 1.0
    logp = torch.full((2, 3), HALF, dtype=torch.float64)
    return adv, mask, spi, logp


@pytest.mark.unit
def test_on_policy_closed_form():
    adv, mask, spi, logp = _batch()
    got = reduce_metrics(variance_proxies(adv, mask, spi, logp))
    assert got["adv/proxy_total_power"] == pytest.approx((4 * 0.75 + 4 * 1.0) / 2, abs=1e-12)  # 3.5
    assert got["adv/proxy_expected_a_sq"] == pytest.approx(4.0, abs=1e-12)
    assert got["adv/proxy_expected_w"] == pytest.approx(0.875, abs=1e-12)
    assert got["adv/proxy_num_seqs"] == 2
    fin = finalize_variance_proxies(got, grad_norm=1.5)
    assert fin["adv/proxy_signal"] == pytest.approx(2.25)
    assert fin["adv/proxy_noise"] == pytest.approx((3.5 - 2.25) / (2 - 1))
    assert finalize_variance_proxies(got, grad_norm=2.0)["adv/proxy_noise"] == 0.0  # floored at 0
    assert got.items() <= fin.items()  # finalize only adds keys


@pytest.mark.unit
def test_rollout_is_closed_form():
    adv, mask, spi, logp = _batch()
    isw = torch.tensor([[2.0, 0.5, 7.0], [7.0, 1.0, 1.0]], dtype=torch.float64)  # rhobar_seq = 1.25, 1
    got = reduce_metrics(variance_proxies(adv, mask, spi, logp, isw))
    # P = mean[rhobar^2 Abar^2 W_orig]; W_orig is the unweighted energy
    assert got["adv/proxy_total_power"] == pytest.approx((1.25**2 * 4 * 0.75 + 4 * 1.0) / 2, abs=1e-12)
    # expected_w is the IS-weighted W: A 4 * .5 + .25 * .25, B 1.0
    assert got["adv/proxy_expected_w"] == pytest.approx((2.0625 + 1.0) / 2, abs=1e-12)


@pytest.mark.unit
def test_negative_w_clamped_and_empty_rows_count():
    mask = torch.tensor([[True, True], [False, False]])
    adv = torch.tensor([[1.0, 1.0], [5.0, 5.0]])
    spi = torch.zeros(2, 2, dtype=torch.float64)  # w = 1 - 2 * .5 + 0 = 0; push it negative below
    logp = torch.full((2, 2), math.log(0.6), dtype=torch.float64)  # w = -0.2 per token
    got = reduce_metrics(variance_proxies(adv, mask, spi, logp))
    assert got["adv/proxy_total_power"] == 0.0  # W clamped at 0; the empty row has Abar = 0
    assert got["adv/proxy_expected_w"] == pytest.approx(-0.4 / 2)  # unclamped, over both rows
    assert math.isnan(finalize_variance_proxies({**got, "adv/proxy_num_seqs": 1.0}, 1.0)["adv/proxy_noise"])


@pytest.mark.unit
@pytest.mark.parametrize("with_is", [False, True])
def test_pooling_over_ranks_is_exact(with_is):
    gen = torch.Generator().manual_seed(0)
    B, S = 10, 7
    adv = torch.randn(B, S, generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.3
    spi = torch.rand(B, S, generator=gen, dtype=torch.float64) * 0.5 + 0.2
    logp = -torch.rand(B, S, generator=gen, dtype=torch.float64) * 3
    isw = torch.rand(B, S, generator=gen, dtype=torch.float64) * 2 if with_is else None
    whole = reduce_metrics(variance_proxies(adv, mask, spi, logp, isw))
    parts = [
        variance_proxies(adv[s], mask[s], spi[s], logp[s], None if isw is None else isw[s])
        for s in (slice(0, 3), slice(3, B))
    ]
    split = reduce_metrics(merge_metrics(*parts))
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, rel=1e-12)
    fin = finalize_variance_proxies(split, 0.1)
    assert fin["adv/proxy_noise"] == pytest.approx(
        max(0.0, (whole["adv/proxy_total_power"] - 0.01) / (B - 1))
    )
