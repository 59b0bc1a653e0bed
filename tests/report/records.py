"""Metrics records written like the trainer writes them (the monitor's per-layer keys), for the
report tests (test_report.py, test_advice.py)."""

from __future__ import annotations

import numpy as np

LAYERS = (0, 1, 2)


def record(step: int, replay: str) -> dict:
    rng = np.random.default_rng(step)
    rec = {
        "step": step,
        "reward/mean": 0.5 + step / 100,
        "corr/k3_kl": 1e-3 * rng.random(),
        "routing/flip_token_frac": 0.1,
        "router_grad/zero_frac": 0.75,
        "router_grad/zero_frac_expected": 0.75,
        "router_grad/norm": 1.0,
        "time/step_s": 0.5,
        "router_grad/update_flip_token_frac": 0.02,
    }
    for lid in LAYERS:
        rec.update(
            {
                f"router_grad/zero_frac/layer{lid}": 0.75,
                # layer 1: 40% of experts without router gradient every step; others none
                f"router_grad/no_grad_expert_frac/layer{lid}": 0.4 if lid == 1 else 0.0,
                # the same mismatch; r3 only changes its meaning
                f"router_grad/rollout_flip_frac/layer{lid}": 0.12,
                f"router_grad/update_flip_frac/layer{lid}": 0.002 * (lid + 1),
                f"router_grad/load_entropy/layer{lid}": 0.95 - 0.1 * lid,
                f"router_grad/load_max_frac/layer{lid}": 0.2,
                f"router_grad/margin_p50/layer{lid}": 0.3 + rng.random(),
                f"router_grad/near_boundary_frac/layer{lid}": 0.05,
                f"router_grad/near_boundary_bf16_frac/layer{lid}": 0.001,
            }
        )
    return rec
