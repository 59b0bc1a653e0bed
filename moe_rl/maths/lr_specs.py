"""The response-length LR decay's knobs (``optim.length_lr``): a frozen, torch-free dataclass the
config composes and ``moe_rl.maths.lr.LengthLRScheduler`` reads, so maths/ never imports the
config (issue 41). Validates itself in ``__post_init__``, naming the config key."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.checks import check, check_finite, one_of


@dataclass(frozen=True)
class LengthLRConfig:
    """Knobs of ``LengthLRScheduler`` (docs/math.md 5.2 [I]; all defaults unverified).

    Each step the scheduler observes the global mean response length x_k and:
    1. smooths it: ``smoothing="ema"``: L_k = (1 - ema_alpha) L_{k-1} + ema_alpha x_k, L_0 = x_0;
       ``smoothing="window"``: L_k = mean of the last ``window`` observations.
    2. compares it with a reference: ``reference="running_min"``: min_{j<=k} L_j (docs/math.md 5.2);
       ``reference="lookback"``: L_{k-lookback} (a relative slope over ``lookback`` steps; no
       trigger until that many smoothed values exist). ratio_k = L_k / reference.
    3. counts consecutive steps with ratio_k > ``surge_ratio`` (the first ``min_observations``
       observations and steps inside a cooldown do not count, and reset the count).
    4. triggers when the count reaches ``patience``: multiplier <- max(multiplier * decay_factor,
       min_multiplier), then no trigger for ``cooldown_steps`` steps. With ``rebase_after_trigger``
       the reference restarts from the current smoothed length, so the next trigger needs a new
       surge; without it a length that stays high decays again after every cooldown.
    A trigger when the multiplier is already at ``min_multiplier`` changes nothing and is not an
    event. The LR is then ``scheduled_lr(...)``: the base schedule (``lr_at``) times the
    multiplier, never below ``min(base, min_lr)``.
    """

    enabled: bool = False
    smoothing: str = "ema"  # ema | window
    ema_alpha: float = 0.1  # weight of the newest observation (ema)
    window: int = 10  # observations averaged (window)
    reference: str = "running_min"  # running_min | lookback
    lookback: int = 20  # steps back for reference="lookback"
    surge_ratio: float = 1.2  # trigger threshold on smoothed / reference (> 1)
    patience: int = 3  # consecutive steps above the threshold
    min_observations: int = 10  # no trigger before this many observations (smoother warm-up)
    decay_factor: float = 0.5  # multiplier <- multiplier * decay_factor on a trigger
    cooldown_steps: int = 50  # steps after a trigger during which nothing triggers
    min_multiplier: float = 0.1  # the multiplier's floor
    min_lr: float = 0.0  # floor on the decayed LR (never raises it above the base schedule)
    rebase_after_trigger: bool = True

    def __post_init__(self) -> None:
        check_finite(self, "optim.length_lr")
        one_of(self.smoothing, "optim.length_lr.smoothing", ("ema", "window"))
        one_of(self.reference, "optim.length_lr.reference", ("running_min", "lookback"))
        check(0 < self.ema_alpha <= 1, "optim.length_lr.ema_alpha", "must be in (0, 1]")
        for name in ("window", "lookback", "patience"):
            check(getattr(self, name) >= 1, f"optim.length_lr.{name}", "must be >= 1")
        for name in ("min_observations", "cooldown_steps"):
            check(getattr(self, name) >= 0, f"optim.length_lr.{name}", "must be >= 0")
        check(self.surge_ratio > 1, "optim.length_lr.surge_ratio", "must be > 1")
        check(0 < self.decay_factor < 1, "optim.length_lr.decay_factor", "must be in (0, 1)")
        check(0 <= self.min_multiplier <= 1, "optim.length_lr.min_multiplier", "must be in [0, 1]")
        check(self.min_lr >= 0, "optim.length_lr.min_lr", "must be >= 0")
