"""moe_rl.maths.lr: lr_at, and the response-length LR decay on deterministic synthetic length series."""

from __future__ import annotations

import json
import math

import pytest

from moe_rl.config import OptimConfig
from moe_rl.maths.lr import LengthLRConfig, LengthLRScheduler, lr_at, scheduled_lr

SURGE = [100.0] * 20 + [200.0] * 60  # a step surge at step 20

# the decay rule both SURGE tests run: EMA 0.5, 3 steps above the ratio after 5 observations, halve,
# then 5 steps of cooldown
DECAY = dict(enabled=True, ema_alpha=0.5, patience=3, min_observations=5, decay_factor=0.5, cooldown_steps=5)


def _run(cfg: LengthLRConfig, lengths: list[float], sched: LengthLRScheduler | None = None, start: int = 0):
    sched = sched or LengthLRScheduler(cfg)
    mults, events = [], []
    for step, x in enumerate(lengths, start):
        m, ev = sched.update(step, x)
        mults.append(m)
        events += ev
    return mults, events, sched


@pytest.mark.unit
def test_lr_at_warmup_constant_cosine():
    opt = OptimConfig(lr=1e-3, min_lr=1e-4, lr_schedule="cosine", warmup_steps=4)
    assert lr_at(0, 20, opt) == pytest.approx(2.5e-4)
    assert lr_at(3, 20, opt) == pytest.approx(1e-3)
    assert lr_at(4, 20, opt) == pytest.approx(1e-3)
    assert lr_at(12, 20, opt) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr_at(20, 20, opt) == pytest.approx(1e-4)
    assert lr_at(7, 20, OptimConfig(lr=1e-3)) == 1e-3


@pytest.mark.unit
def test_scheduled_lr_composition_and_floor():
    opt = OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=10)
    for step in (0, 5, 10, 50, 99):
        assert scheduled_lr(step, 100, opt) == lr_at(step, 100, opt)  # multiplier 1: unchanged
    assert scheduled_lr(20, 100, OptimConfig(lr=1e-3), 0.25) == pytest.approx(2.5e-4)
    assert scheduled_lr(20, 100, OptimConfig(lr=1e-3), 0.01, min_lr=1e-4) == pytest.approx(1e-4)
    # in warmup the base is below min_lr: the floor never lifts the base schedule
    assert scheduled_lr(0, 100, opt, 0.01, min_lr=5e-4) == pytest.approx(lr_at(0, 100, opt))


@pytest.mark.unit
def test_flat_and_disabled_never_trigger():
    cfg = LengthLRConfig(enabled=True, ema_alpha=0.5, min_observations=0, patience=1)
    mults, events, _ = _run(cfg, [100.0] * 100)
    assert events == [] and set(mults) == {1.0}
    noisy = [100.0 + (10.0 if k % 2 else -10.0) for k in range(100)]  # EMA ratio stays < 1.2
    assert _run(cfg, noisy)[1] == []
    mults, events, _ = _run(LengthLRConfig(), SURGE)  # enabled=False by default
    assert events == [] and set(mults) == {1.0}


@pytest.mark.unit
def test_surge_triggers_after_patience():
    cfg = LengthLRConfig(**DECAY, surge_ratio=1.2)
    mults, events, sched = _run(cfg, SURGE)
    # EMA after the surge: 150 (ratio 1.5), 175, 187.5 -> the 3rd step above 1.2 is step 22
    assert [e["step"] for e in events] == [22]  # rebase_after_trigger: 200 / 187.5 < 1.2 afterwards
    e = events[0]
    assert e["multiplier_before"] == 1.0 and e["multiplier_after"] == 0.5
    assert e["smoothed_len"] == 187.5 and e["reference_len"] == 100.0 and e["ratio"] == 1.875
    assert "100.0" in e["cause"] and "187.5" in e["cause"] and "1.875 > surge_ratio 1.2" in e["cause"]
    assert mults[:22] == [1.0] * 22 and mults[22:] == [0.5] * (len(SURGE) - 22)  # applies from step 22
    assert sched.metrics() == {
        "train/length_lr/multiplier": 0.5,
        "train/length_lr/smoothed_len": 200.0,
        "train/length_lr/ratio": pytest.approx(200 / 187.5),
        "train/length_lr/num_triggers": 1,
    }
    # patience 4 delays the trigger by one step
    assert [e["step"] for e in _run(LengthLRConfig(**{**cfg.__dict__, "patience": 4}), SURGE)[1]] == [23]


@pytest.mark.unit
def test_cooldown_and_floor_without_rebase():
    cfg = LengthLRConfig(**DECAY, min_multiplier=0.2, rebase_after_trigger=False)
    mults, events, _ = _run(cfg, SURGE)
    # trigger at 22; steps 23..27 are cooldown; 28, 29, 30 count -> 30; then 38; then the floor
    assert [e["step"] for e in events] == [22, 30, 38]
    assert [e["multiplier_after"] for e in events] == [0.5, 0.25, 0.2]
    assert min(mults) == 0.2 and mults[-1] == 0.2


@pytest.mark.unit
def test_lookback_reference_ignores_slow_drift_running_min_does_not():
    drift = [100.0 + k for k in range(80)]  # +1 per step: 1.1x over 10 steps, 1.5x overall
    base = {
        "enabled": True,
        "ema_alpha": 1.0,
        "patience": 2,
        "min_observations": 0,
        "surge_ratio": 1.2,
        "cooldown_steps": 0,
    }
    assert _run(LengthLRConfig(**base, reference="lookback", lookback=10), drift)[1] == []
    events = _run(LengthLRConfig(**base, reference="running_min"), drift)[1]
    # 121/100 > 1.2 at step 21, 2nd step above at 22; rebased to 122: 147/122 > 1.2 at 47 -> 48;
    # rebased to 148: 178/148 > 1.2 at 78 -> 79
    assert [e["step"] for e in events] == [22, 48, 79]
    # a jump is caught by lookback too, once lookback + 1 smoothed values exist
    jump = [100.0] * 15 + [150.0] * 10
    events = _run(LengthLRConfig(**base, reference="lookback", lookback=10), jump)[1]
    assert [e["step"] for e in events] == [16] and events[0]["reference_len"] == 100.0


@pytest.mark.unit
def test_window_smoothing():
    cfg = LengthLRConfig(enabled=True, smoothing="window", window=4, patience=1, min_observations=0)
    sched = LengthLRScheduler(cfg)
    for step, x in enumerate([100.0, 100.0, 100.0, 100.0, 200.0]):
        _, events = sched.update(step, x)
    assert sched.smoothed == 125.0 and events and events[0]["ratio"] == 1.25


@pytest.mark.unit
@pytest.mark.parametrize("cut", [21, 25, 33])  # mid-patience, mid-cooldown, after two triggers
@pytest.mark.parametrize("rebase", [True, False])
def test_state_dict_round_trip_reproduces_the_future(cut, rebase):
    cfg = LengthLRConfig(
        enabled=True,
        ema_alpha=0.3,
        patience=2,
        min_observations=3,
        cooldown_steps=4,
        min_multiplier=0.05,
        rebase_after_trigger=rebase,
        reference="lookback",
        lookback=3,
    )
    lengths = [
        100.0 + 3 * (k % 5) + (40.0 if k >= 18 else 0.0) + (60.0 if k >= 30 else 0.0) for k in range(60)
    ]
    full_mults, full_events, _ = _run(cfg, lengths)
    _, _, first = _run(cfg, lengths[:cut])
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint as plain JSON
    resumed = LengthLRScheduler(cfg)
    resumed.load_state_dict(state)
    mults, events, _ = _run(cfg, lengths[cut:], resumed, start=cut)
    assert mults == full_mults[cut:]
    assert events == [e for e in full_events if e["step"] >= cut]
    assert full_events  # the series does trigger


@pytest.mark.unit
def test_validation_and_misuse():
    with pytest.raises(ValueError, match="surge_ratio"):
        LengthLRConfig(surge_ratio=1.0)
    with pytest.raises(ValueError, match="smoothing"):
        LengthLRConfig(smoothing="median")
    with pytest.raises(ValueError, match="decay_factor"):
        LengthLRConfig(decay_factor=1.0)
    sched = LengthLRScheduler(LengthLRConfig(enabled=True))
    sched.update(3, 10.0)
    with pytest.raises(ValueError, match="increase"):
        sched.update(3, 10.0)
    with pytest.raises(ValueError, match="finite"):
        sched.update(4, math.nan)
    with pytest.raises(ValueError, match="missing"):
        LengthLRScheduler(LengthLRConfig(enabled=True)).load_state_dict({"multiplier": 1.0})
