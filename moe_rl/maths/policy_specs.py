"""The specs of the advantage estimator and the policy loss: frozen, torch-free dataclasses (the
config composes them without the maths), each validating itself in ``__post_init__`` and naming
the config key. ``moe_rl.maths.advantages.estimate_advantages`` and
``moe_rl.corrections.corrected_loss.PolicyLoss`` take them directly."""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.checks import check, check_finite, one_of
from moe_rl.names import ADVANTAGE_NAMES, KL_ESTIMATOR_NAMES


@dataclass(frozen=True)
class AdvantageSpec:
    """The advantage estimator (``algo.advantage``, ``algo.grpo_std_norm``)."""

    name: str = "grpo"  # moe_rl.maths.advantages.ADVANTAGES
    std_norm: bool = True  # grpo only: divide by the group std (rloo never does)

    def __post_init__(self) -> None:
        one_of(self.name, "algo.advantage", ADVANTAGE_NAMES)


@dataclass(frozen=True)
class PolicyLossSpec:
    """The PPO clipped surrogate and its KL term (docs/math.md 2.1): ``algo.clip_low``,
    ``algo.clip_high``, ``algo.kl_coef``, ``algo.kl_estimator`` and ``correction.dual_clip_c``."""

    clip_low: float = 0.2  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28
    dual_clip_c: float = 0.0  # dual clip for A < 0 (verl clip_ratio_c); 0 = off
    kl_coef: float = 0.0  # KL to the reference (initial) policy; 0 = no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3

    def __post_init__(self) -> None:
        check_finite(self, "algo")
        check(self.clip_low >= 0 and self.clip_high >= 0, "algo.clip_low", "clips must be >= 0")
        check(
            self.dual_clip_c == 0 or self.dual_clip_c > 1, "correction.dual_clip_c", "must be 0 (off) or > 1"
        )
        one_of(self.kl_estimator, "algo.kl_estimator", KL_ESTIMATOR_NAMES)
        check(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0")

    @property
    def clip_ratio_c(self) -> float | None:
        """The dual-clip constant as ``clipped_surrogate`` takes it (None = off)."""
        return self.dual_clip_c or None
