"""Learning-rate schedules: ``lr_at``, a pure function of the step (warmup, constant or cosine),
and the response-length-triggered decay of docs/math.md 5 (``LengthLRConfig``, ``LengthLRScheduler``,
composed by ``scheduled_lr``).

Composition: ``lr = scheduled_lr(step, total_steps, opt, multiplier, cfg.min_lr)``, where
``multiplier`` comes from ``LengthLRScheduler.update(step, mean_response_len)``.
"""

from __future__ import annotations

import math
from typing import Protocol

from moe_rl.maths.lr_specs import LengthLRConfig

__all__ = ["BaseSchedule", "LengthLRConfig", "LengthLRScheduler", "lr_at", "scheduled_lr"]


class BaseSchedule(Protocol):
    """The base schedule's values (``moe_rl.config.OptimConfig`` has them): plain values in, so
    maths/ never imports the config (issue 41)."""

    lr: float
    min_lr: float
    warmup_steps: int
    lr_schedule: str  # constant | cosine


def lr_at(step: int, total_steps: int, opt: BaseSchedule) -> float:
    """Linear warmup to opt.lr, then constant or cosine decay to opt.min_lr at total_steps."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.lr_schedule == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    frac = min(1.0, (step - opt.warmup_steps) / span)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * frac))


# ----------------------------------------------------------------------------- response-length LR decay
# docs/math.md 5 ("Beyond Precision"): decay the LR when the response length surges. 5.1 is verified;
# the exact trigger rule, decay factor, smoothing and every default are NOT public (5.2 [GAP]).
# What follows is the 5.2 implementation proposal [I], with every part configurable. No default
# below is from the paper; all are unverified starting points.


def scheduled_lr(
    step: int, total_steps: int, opt: BaseSchedule, multiplier: float = 1.0, min_lr: float = 0.0
) -> float:
    """The LR of ``step``: lr_at(step) * multiplier, floored at min(lr_at(step), min_lr).

    The floor only limits the length-triggered decay: it never lifts the base schedule (warmup,
    cosine) above itself. multiplier = 1 gives exactly ``lr_at``.
    """
    base = lr_at(step, total_steps, opt)
    return max(base * multiplier, min(base, min_lr))


class LengthLRScheduler:
    """Stateful response-length LR decay (see ``LengthLRConfig`` for the rule).

    Call ``update(step, mean_response_len)`` once per RL step, after the rollout and before the
    update, with strictly increasing steps; use the returned multiplier for that step's LR.
    ``state_dict`` / ``load_state_dict`` hold every piece of state (plain Python, JSON-able), so
    a resumed run makes exactly the decisions the uninterrupted run would. Disabled
    (``cfg.enabled`` False) it always returns (1.0, []) and keeps no state.
    """

    def __init__(self, cfg: LengthLRConfig) -> None:
        self.cfg = cfg
        self.multiplier = 1.0
        self.num_obs = 0  # observations so far
        self.last_step: int | None = None
        self.smoothed: float | None = None
        self.recent: list[float] = []  # last `window` observations (window smoothing)
        self.history: list[float] = []  # smoothed values since the last rebase, newest last (<= lookback + 1)
        self.running_min: float | None = None
        self.above = 0  # consecutive counted steps above the threshold
        self.cooldown_until = -1  # no trigger at steps <= this
        self.num_triggers = 0
        self.ratio = math.nan

    def _smooth(self, x: float) -> float:
        if self.cfg.smoothing == "window":
            self.recent = (self.recent + [x])[-self.cfg.window :]
            return sum(self.recent) / len(self.recent)
        if self.smoothed is None:
            return x
        return (1.0 - self.cfg.ema_alpha) * self.smoothed + self.cfg.ema_alpha * x

    def _reference(self) -> float | None:
        if self.cfg.reference == "running_min":
            return self.running_min
        return self.history[0] if len(self.history) > self.cfg.lookback else None

    def _rebase(self) -> None:
        self.history = [self.smoothed]
        self.running_min = self.smoothed

    def update(self, step: int, mean_response_len: float) -> tuple[float, list[dict]]:
        """Observe step's mean response length. Returns (multiplier for this step, events).

        An event is {"step", "cause", "multiplier_before", "multiplier_after", "smoothed_len",
        "reference_len", "ratio"}; there is at most one per step.
        """
        if not self.cfg.enabled:
            return 1.0, []
        x = float(mean_response_len)
        if not math.isfinite(x) or x < 0:
            raise ValueError(
                f"step {step}: mean response length {mean_response_len!r} is not a finite number >= 0"
            )
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"steps must increase: got {step} after {self.last_step}")
        self.last_step = step
        self.num_obs += 1
        self.smoothed = self._smooth(x)
        self.history = (self.history + [self.smoothed])[-(self.cfg.lookback + 1) :]
        self.running_min = self.smoothed if self.running_min is None else min(self.running_min, self.smoothed)
        ref = self._reference()
        self.ratio = self.smoothed / ref if ref and ref > 0 else math.nan
        counted = self.num_obs > self.cfg.min_observations and step > self.cooldown_until
        self.above = self.above + 1 if counted and self.ratio > self.cfg.surge_ratio else 0
        if self.above < self.cfg.patience or self.multiplier <= self.cfg.min_multiplier:
            return self.multiplier, []
        event = self._trigger(step, ref)  # updates self.multiplier: the decay applies to this step
        return self.multiplier, [event]

    def _trigger(self, step: int, ref: float) -> dict:
        c = self.cfg
        before = self.multiplier
        self.multiplier = max(before * c.decay_factor, c.min_multiplier)
        self.num_triggers += 1
        self.above = 0
        self.cooldown_until = step + c.cooldown_steps
        event = {
            "step": step,
            "cause": (
                f"smoothed response length surged from {ref:.1f} ({c.reference}) to {self.smoothed:.1f} "
                f"(ratio {self.ratio:.3f} > surge_ratio {c.surge_ratio}) for {c.patience} consecutive "
                f"step(s); lr multiplier {before:g} -> {self.multiplier:g}"
            ),
            "multiplier_before": before,
            "multiplier_after": self.multiplier,
            "smoothed_len": self.smoothed,
            "reference_len": ref,
            "ratio": self.ratio,
        }
        if c.rebase_after_trigger:
            self._rebase()
        return event

    def metrics(self) -> dict[str, float]:
        """Plain (already global) values for the step's metrics: multiplier, smoothed length, ratio."""
        return {
            "train/length_lr/multiplier": self.multiplier,
            "train/length_lr/smoothed_len": math.nan if self.smoothed is None else self.smoothed,
            "train/length_lr/ratio": self.ratio,
            "train/length_lr/num_triggers": self.num_triggers,
        }

    _STATE = (
        "multiplier",
        "num_obs",
        "last_step",
        "smoothed",
        "recent",
        "history",
        "running_min",
        "above",
        "cooldown_until",
        "num_triggers",
    )  # ratio is recomputed by every update

    def state_dict(self) -> dict:
        return {
            k: (list(v) if isinstance(v, list) else v)
            for k, v in ((k, getattr(self, k)) for k in self._STATE)
        }

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in self._STATE if k not in state]
        if missing:
            raise ValueError(f"LengthLRScheduler state is missing {missing}")
        for k in self._STATE:
            setattr(self, k, list(state[k]) if isinstance(state[k], list) else state[k])
