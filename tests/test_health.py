"""unit tier: moe_rl/health.py alarms on a uniform or collapsed policy and on zero gradients."""

from __future__ import annotations

import json
import math

import pytest

from moe_rl.config import HealthConfig, load_config
from moe_rl.health import HealthMonitor
from moe_rl.report.run_files import health_warnings

UNIFORM_50 = math.log(50)


@pytest.mark.unit
def test_uniform_entropy_and_zero_gradient_alarm_once_after_patience_and_rearm():
    mon = HealthMonitor(HealthConfig(patience=2), vocab_size=50)
    sick = {"train/entropy": UNIFORM_50, "train/grad_norm_max": 0.0}
    assert mon.observe(0, sick) == []
    events = mon.observe(1, sick)
    assert [e["alarm"] for e in events] == ["entropy_uniform", "grad_norm_zero"]
    assert events[0] == {
        "step": 1,
        "event": "health",
        "alarm": "entropy_uniform",
        "severity": "warning",
        "cause": "policy entropy 3.912 nats >= 0.95 ln(V=50) = 3.716: the policy is uniform for 2 "
        "consecutive steps (steps 0-1; log.health)",
    }
    assert events[1]["cause"] == (
        "gradient norm exactly 0 in every minibatch (optimizer steps skipped): "
        "nothing is learned for 2 consecutive steps (steps 0-1; log.health)"
    )
    assert mon.observe(2, sick) == []  # once per episode
    assert mon.observe(3, {"train/entropy": 1.0, "train/grad_norm_max": 0.5}) == []  # clears: re-armed
    assert mon.observe(4, sick) == []
    assert [e["step"] for e in mon.observe(5, sick)] == [5, 5]


@pytest.mark.unit
def test_collapsed_entropy_alarm_and_healthy_steps_are_silent():
    mon = HealthMonitor(HealthConfig(patience=1, entropy_zero=1e-3), vocab_size=50)
    assert mon.observe(0, {"train/entropy": 0.5, "train/grad_norm_max": 0.25}) == []
    (event,) = mon.observe(1, {"train/entropy": 2e-4, "train/grad_norm_max": 0.25})
    assert event["alarm"] == "entropy_zero"
    assert event["cause"] == (
        "policy entropy 0.0002 nats <= 0.001: the policy collapsed onto one token for 1 "
        "consecutive step (steps 1-1; log.health)"
    )
    assert mon.observe(2, {}) == []  # metrics not logged: no alarm
    assert HealthMonitor(HealthConfig(enabled=False), 50).observe(0, {"train/grad_norm_max": 0.0}) == []
    assert (
        HealthMonitor(HealthConfig(patience=1), 50, active=False).observe(0, {"train/grad_norm_max": 0.0})
        == []
    )


@pytest.mark.unit
def test_health_config_is_validated_and_alarms_reach_the_report(tmp_path):
    cfg = load_config(None, ["log.health.patience=5", "log.health.entropy_uniform_frac=0.9"])
    assert cfg.log.health == HealthConfig(patience=5, entropy_uniform_frac=0.9)
    with pytest.raises(ValueError, match=r"config key 'log.health.patience': must be >= 1"):
        load_config(None, ["log.health.patience=0"])
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"step": 3, "cause": "length surged", "multiplier_after": 0.5})
        + "\n"
        + json.dumps({"step": 7, "event": "health", "alarm": "grad_norm_zero", "cause": "why"})
        + "\n{cut"
    )
    assert health_warnings(tmp_path / "events.jsonl") == [
        f"{tmp_path.name}: health alarm grad_norm_zero at step 7: why"
    ]


@pytest.mark.unit
def test_route_verify_alarm_names_the_worst_layer_and_turn_on_each_verified_step():
    mon = HealthMonitor(HealthConfig(patience=3), 50, verify_alarm_frac=0.01)
    nan = float("nan")
    bad = {
        "routing/verify_mismatch_frac": 0.25,
        "routing/verify_mismatch_frac/layer0": 0.0,
        "routing/verify_mismatch_frac/layer3": 0.5,
        "routing/verify_mismatch_frac/turn1": 0.0,
        "routing/verify_mismatch_frac/turn2": 0.4,
        "routing/verify_mismatch_frac/turn3": nan,  # no row of turn 3 compared
    }
    (event,) = mon.observe(10, bad)  # no patience: the verifier runs every N steps only
    assert event == {
        "step": 10,
        "event": "health",
        "alarm": "route_verify",
        "severity": "warning",
        "cause": "stitched routes differ from one full prefill on 0.25 of the compared (row, layer) "
        "pairs > 0.01 (routing.verify.alarm_frac); worst layer 3 (0.5), worst turn 2 (0.4)",
    }
    assert [e["step"] for e in mon.observe(20, bad)] == [20]
    assert mon.observe(11, {"train/entropy": 1.0}) == []  # no verify this step
    assert mon.observe(30, {**bad, "routing/verify_mismatch_frac": 0.01}) == []  # at the threshold
    assert mon.observe(40, {"routing/verify_mismatch_frac": nan}) == []  # nothing compared
    assert HealthMonitor(HealthConfig(), 50).observe(10, bad) == []  # no threshold given: no alarm
