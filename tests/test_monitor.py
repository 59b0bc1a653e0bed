"""unit tier: the router-gradient monitor's bookkeeping on hand-built logits and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.monitor.router_grad import (
    MARGIN_EDGES,
    RouterGradMonitor,
    histogram_quantiles,
    rollout_flip_aliases,
    structural_zero_frac,
)


@pytest.mark.unit
def test_blackout_load_and_margins_from_known_tensors():
    mon = RouterGradMonitor([3], num_experts=4, top_k=2, near_eps=0.5)
    logits_NE = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 1.0, 2.8, 3.0], [1.0, 1.0, 0.9, 0.0]])
    native_NK = torch.topk(logits_NE, 2, dim=-1).indices
    mon.observe_forward(0, logits_NE, native_NK)
    # gradient only on the selected logits of tokens 0 and 1; token 2 is padding (no gradient)
    grad_NE = torch.zeros(3, 4)
    grad_NE[0, :2] = torch.tensor([0.5, -0.5])
    grad_NE[1, 2:] = torch.tensor([0.2, -0.2])
    mon.observe_grad(0, grad_NE)
    m = mon.finalize(mon.stats_LXW, mon.max_L, torch.ones(1, 4, 8))
    assert m["router_grad/zero_frac/layer3"] == 0.5 == m["router_grad/zero_frac"]  # (E - K) / E
    assert m["router_grad/never_selected/layer3"] == 0.0  # experts 0,1 / 2,3 / 0,1: all used
    assert m["router_grad/load_max_frac/layer3"] == pytest.approx(2 / 6)
    # margins: 3 - 0, 2.8 - 1, 1 - 0.9; near the boundary (< 0.5): only the last
    assert m["router_grad/margin_mean/layer3"] == pytest.approx((3.0 + 1.8 + 0.1) / 3)
    assert m["router_grad/near_boundary_frac/layer3"] == pytest.approx(1 / 3)
    p = torch.tensor([2, 2, 1, 1]) / 6
    assert m["router_grad/load_entropy/layer3"] == pytest.approx(float(-(p * p.log()).sum()) / math.log(4))
    assert m["router_grad/norm/layer3"] == pytest.approx(math.sqrt(32))
    assert m["router_grad/no_grad_expert_frac/layer3"] == 0.0
    assert m["router_grad/zero_frac_expected"] == 0.5
    # per-token logit-gradient norms over the two tokens with gradient: sqrt(0.5), sqrt(0.08)
    assert m["router_grad/logit_grad_norm_mean/layer3"] == pytest.approx((0.5**0.5 + 0.08**0.5) / 2)
    assert m["router_grad/logit_grad_norm_max/layer3"] == pytest.approx(0.5**0.5)
    # bf16 resolution |h_(K)| 2^-8: 3/256, 2.8/256, 1/256; no margin is that small
    assert m["router_grad/near_boundary_bf16_frac/layer3"] == 0.0
    # margins 3, 1.8, 0.1: the median lies in 1.8's log bin, within one bin's ratio (10^(8/64))
    assert 1.8 / 1.34 < m["router_grad/margin_p50/layer3"] < 1.8 * 1.34
    assert 0.1 / 1.34 < m["router_grad/margin_p1/layer3"] < 0.1 * 1.34


@pytest.mark.unit
def test_structural_zero_fraction_follows_the_gating_variant():
    assert structural_zero_frac(8, 2) == 0.75  # renormalised top-k: (E - K) / E
    assert structural_zero_frac(128, 8) == 120 / 128
    assert structural_zero_frac(8, 2, pre_softmax=True) == 0.0  # denominator reaches every logit
    assert structural_zero_frac(8, 2, aux_loss=True) == 0.0


@pytest.mark.unit
def test_margin_quantiles_from_the_histogram_match_exact_quantiles():
    gen = torch.Generator().manual_seed(0)
    margins_N = torch.exp(torch.randn(20_000, generator=gen, dtype=torch.float64) * 2 - 3)  # spans decades
    bins_N = torch.bucketize(margins_N, MARGIN_EDGES, right=True)
    hist = torch.bincount(bins_N, minlength=MARGIN_EDGES.numel() + 1).double()
    got = histogram_quantiles(hist, MARGIN_EDGES, (0.01, 0.05, 0.5, 0.9))
    exact = torch.quantile(margins_N, torch.tensor([0.01, 0.05, 0.5, 0.9], dtype=torch.float64))
    ratio = torch.tensor(got) / exact
    assert float((ratio.log().abs()).max()) < 0.05, (got, exact)  # well inside one bin (ratio 1.33)
    assert math.isnan(histogram_quantiles(torch.zeros(66), MARGIN_EDGES, (0.5,))[0])  # empty


@pytest.mark.unit
def test_stats_accumulate_over_micro_batches_like_one_batch():
    gen = torch.Generator().manual_seed(1)
    logits_NE = torch.randn(40, 8, generator=gen)
    grad_NE = torch.randn(40, 8, generator=gen) * (torch.rand(40, 8, generator=gen) > 0.6)
    native_NK = torch.topk(logits_NE, 2, dim=-1).indices
    one, two = RouterGradMonitor([0], 8, 2), RouterGradMonitor([0], 8, 2)
    one.observe_forward(0, logits_NE, native_NK)
    one.observe_grad(0, grad_NE)
    for sl in (slice(0, 13), slice(13, 40)):
        two.observe_forward(0, logits_NE[sl], native_NK[sl])
        two.observe_grad(0, grad_NE[sl])
    g = torch.randn(1, 8, 4, generator=gen)
    assert one.finalize(one.stats_LXW, one.max_L, g) == pytest.approx(
        two.finalize(two.stats_LXW, two.max_L, g), nan_ok=True
    )


@pytest.mark.unit
def test_rollout_flip_rates_are_filed_under_the_monitor_prefix():
    got = rollout_flip_aliases(
        {
            "routing/flip_router_frac": 1,
            "routing/flip_router_frac/layer2": 2,
            "routing/flip_token_frac": 3,
            "routing/update_flip_router_frac": 4,
            "routing/overlap_at_k": 5,
        }
    )
    assert got == {
        "router_grad/rollout_flip_frac": 1,
        "router_grad/rollout_flip_frac/layer2": 2,
        "router_grad/rollout_flip_token_frac": 3,
    }
