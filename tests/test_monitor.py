"""unit tier: the router-gradient monitor's bookkeeping on hand-built logits and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.monitor.router_grad import (
    MARGIN_EDGES,
    RouterGradMonitor,
    expert_load_LE,
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
    # the per-expert load behind them (expert_load.jsonl): slots 0,1 / 2,3 / 0,1 of 6
    assert expert_load_LE(mon.stats_LXW, 4).tolist() == [[2 / 6, 2 / 6, 1 / 6, 1 / 6]]
    empty = RouterGradMonitor([1, 2], num_experts=4, top_k=2)
    assert expert_load_LE(empty.stats_LXW, 4).tolist() == [[0.0] * 4] * 2  # no token: zeros, no NaN


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


# DeepSeek-V3-shaped router: 12 experts in 4 groups of 3, 2 groups per token, top-4 (4 // 2 = 2,
# the best-2 group score), sigmoid + expert bias. Sigmoid scores and bias of one token:
P12 = [0.95, 0.05, 0.10, 0.60, 0.56, 0.40, 0.50, 0.47, 0.30, 0.20, 0.15, 0.10]
B12 = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 0.32, 0.0, 0.0, 0.0]
# biased selection .95 .05 .10 | .60 .56 .40 | .50 .48 .62 | .20 .15 .10: group scores 1.05, 1.16,
# 1.12, 0.35 -> groups 1 and 2 (not group 0 of the best expert); their sorted selection scores
# .62 .60 .56 .50 | .48 .40: margin .50 - .48 = 0.02. Not 0.06 (biased, groups ignored:
# .95 .62 .60 .56 | .50) and not 0.03 (the unbiased scores: .95 .60 .56 .50 | .47).
GROUPED_MARGIN = 0.02


@pytest.mark.unit
def test_sigmoid_group_limited_margin_is_of_the_biased_selection_in_megatrons_top_k():
    """What megatron-core's top-k hands the replay seam (sigmoid + bias, before group masking) is
    what the monitor measures: the margin within the token's selected groups, the load of the
    experts chosen there, and (E - K) / E zero-gradient entries through sigmoid gates."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_patches import router_replay_hook
    from moe_rl.routing.gating import RouterSpec

    router_replay_hook.apply()
    spec = RouterSpec(top_k=4, score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5)
    mon = RouterGradMonitor([1, 2], 12, 4, near_eps=0.025, spec=spec)
    p = torch.tensor([P12, P12[::-1]], dtype=torch.float64)  # token 1: experts reversed, bias not
    logits_NE = torch.log(p / (1 - p)).float().requires_grad_(True)
    bias_E = torch.tensor(B12)

    def controller(scores, topk, compute_native):  # what RouteReplay._route does, observe mode
        probs, native_NK = compute_native(scores)
        mon.observe_forward(0, scores, native_NK)
        return probs, native_NK

    replay = RouterReplay()
    replay.moe_rl_controller = controller
    try:
        probs_NE, map_NE = topk_routing_with_score_function(
            logits_NE,
            4,
            num_groups=4,
            group_topk=2,
            scaling_factor=2.5,
            score_function="sigmoid",
            expert_bias=bias_E.float(),
            router_replay=replay,
        )
    finally:
        RouterReplay.clear_global_router_replay_instances()
    assert map_NE[0].nonzero().flatten().tolist() == [3, 4, 6, 8]
    # token 1 (reversed scores, same bias): selection .10 .15 .20 | .30 .47 .50 | .40 .57 .92 |
    # .10 .05 .95 -> groups 2 (1.49) and 3 (1.05): .95 .92 .57 .40 | .10, margin 0.30
    assert map_NE[1].nonzero().flatten().tolist() == [6, 7, 8, 11]
    (probs_NE * torch.arange(12.0)).sum().backward()  # every selected gate gets a gradient
    mon.observe_grad(0, logits_NE.grad)
    m = mon.finalize(mon.stats_LXW, mon.max_L, torch.ones(2, 12, 8))
    assert m["router_grad/margin_mean/layer1"] == pytest.approx((GROUPED_MARGIN + 0.30) / 2, abs=1e-6)
    assert m["router_grad/near_boundary_frac/layer1"] == 0.5  # token 0's 0.02 < 0.025; 0.30 is not
    assert m["router_grad/zero_frac/layer1"] == 8 / 12 == m["router_grad/zero_frac_expected"]
    assert m["router_grad/never_selected/layer1"] == 12 - 6  # experts 3 4 6 7 8 11 (6 and 8 twice)
    assert m["router_grad/load_max_frac/layer1"] == 2 / 8
    # only MoE layers are monitored: dense layer 0 has no router and no key; no shared expert here
    assert not [k for k in m if k.endswith("/layer0")]
    assert not [k for k in m if "shared_expert_share" in k]


@pytest.mark.unit
def test_shared_expert_share_is_the_mean_norm_share_per_token():
    mon = RouterGradMonitor([1, 2], 4, 2, shared_expert=True)
    shared_NH = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
    routed_NH = torch.tensor([[0.0, 5.0], [0.0, 0.0], [0.0, 3.0]])
    mon.observe_shared(0, shared_NH, routed_NH)  # 5 / (5 + 5), 0 (nothing on either), 1 / (1 + 3)
    mon.observe_shared(1, shared_NH[:1], 3 * routed_NH[:1])  # 5 / (5 + 15)
    m = mon.finalize(mon.stats_LXW, mon.max_L, torch.ones(2, 4, 8))
    assert m["router_grad/shared_expert_share/layer1"] == pytest.approx(0.75 / 3, rel=1e-12)
    assert m["router_grad/shared_expert_share/layer2"] == pytest.approx(0.25, rel=1e-12)
    assert m["router_grad/shared_expert_share"] == pytest.approx(1.0 / 4, rel=1e-12)  # token-weighted
