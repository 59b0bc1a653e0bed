"""Learning-rate schedules: pure functions of the step."""

from __future__ import annotations

import math

from moe_rl.config import OptimConfig


def lr_at(step: int, total_steps: int, opt: OptimConfig) -> float:
    """Linear warmup to opt.lr, then constant or cosine decay to opt.min_lr at total_steps."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.lr_schedule == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    frac = min(1.0, (step - opt.warmup_steps) / span)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * frac))
