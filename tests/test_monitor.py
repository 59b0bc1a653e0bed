"""unit tier: the router-gradient monitor's bookkeeping on hand-built logits and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.monitor.router_grad import RouterGradMonitor


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
    m = mon.finalize(mon.stats_LXE, torch.ones(1, 4, 8))
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
