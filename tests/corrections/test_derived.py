"""moe_rl.corrections.derived and the package surface (registries checked at config load)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.corrections import corrected_loss, dvp, importance, trm
from moe_rl.corrections.correction_specs import ImportanceSpec
from moe_rl.corrections.derived import derive_metrics
from moe_rl.corrections.importance import is_weights
from moe_rl.metrics import merge_metrics, reduce_metrics
from moe_rl.names import RS_AGGREGATION_NAMES


@pytest.mark.unit
def test_ess_derived_exactly_from_reduced_mean_and_std():
    gen = torch.Generator().manual_seed(0)
    lr = torch.randn(8, 6, generator=gen, dtype=torch.float64) * 0.5
    mask = torch.rand(8, 6, generator=gen) > 0.3
    w, _ = is_weights(lr, mask, ImportanceSpec("token", 2.0))
    # two "ranks" / micro-batches: the derived ESS equals the whole-batch formula 1 / mean(wbar^2)
    parts = merge_metrics(
        is_weights(lr[:3], mask[:3], ImportanceSpec("token", 2.0))[1],
        is_weights(lr[3:], mask[3:], ImportanceSpec("token", 2.0))[1],
    )
    got = derive_metrics(reduce_metrics(parts))
    w_valid = w[mask]
    assert got["corr/is_ess"] == pytest.approx(
        (1 / ((w_valid / w_valid.mean()) ** 2).mean()).item(), rel=1e-12
    )
    assert 0 < got["corr/is_seq_ess"] <= 1


@pytest.mark.unit
def test_trm_alarm_threshold_and_passthrough():
    assert derive_metrics({"corr/trm_accept_rate": 0.69})["corr/trm_alarm"] == 1.0
    assert derive_metrics({"corr/trm_accept_rate": 0.7})["corr/trm_alarm"] == 0.0
    assert math.isnan(derive_metrics({"corr/trm_accept_rate": math.nan})["corr/trm_alarm"])
    src = {"train/pg_loss": 1.0}
    assert derive_metrics(src) == src and derive_metrics(src) is not src


@pytest.mark.unit
def test_package_surface():
    for module in (dvp, importance, trm):
        for name in module.__all__:
            assert hasattr(module, name), name
    assert set(importance.IS_LEVELS) == {"token", "sequence", "geometric"}
    assert set(importance.RS_AGGREGATIONS) == {"token", "seq_sum", "seq_mean", "seq_max"}
    assert set(importance.RS_AGGREGATIONS) == set(RS_AGGREGATION_NAMES)  # the names moe_rl.config checks
    assert trm.LENGTH_NEUTRAL == ("none", "ln", "ser")
    assert trm.TRM_REFERENCES == ("theta", "old")
    assert corrected_loss.BYPASS_MODES == ("ppo_clip", "reinforce")
