"""Rollout correction: ``CorrectionConfig`` with its nested ``TrmConfig`` and typed rejection rules
(``RejectionSpec``, grammar in ``moe_rl.corrections.specs``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_rl.checks import check, check_finite, one_of
from moe_rl.errors import ConfigError
from moe_rl.names import (
    IS_LEVEL_NAMES,
    LENGTH_NEUTRAL_NAMES,
    SAFE_SET_RULE_NAMES,
    TRM_KL_SOURCE_NAMES,
    TRM_REFERENCE_NAMES,
)
from moe_rl.corrections.specs import parse_rs_spec


@dataclass(frozen=True)
class RejectionSpec:
    """One rejection rule of ``correction.rejection`` (AND-combined; grammar: ``moe_rl.corrections.specs``).

    ``option`` is ``<agg>_<k1|k2|k3>`` (token_k1, seq_mean_k3, ...). k1 bounds rho: kept iff
    lower <= rho <= upper, and ``lower: 0`` means 1/upper (then upper >= 1); k2/k3 bound the
    aggregated estimate from above (upper > 0, no lower). YAML: ``{option: seq_sum_k1, lower: 0.5,
    upper: 2.0}``."""

    option: str = ""
    upper: float = 0.0
    lower: float = 0.0

    @property
    def bound(self) -> float | tuple[float, float]:
        """The bound as ``parse_rs_spec`` takes it: (lower, upper), or upper alone."""
        return (self.lower, self.upper) if self.lower else self.upper


@dataclass(frozen=True)
class TrmConfig:
    """Trust Region Masking (docs/math.md 3): whole sequences whose per-token divergence from the
    rollout policy exceeds a criterion are masked. Off unless a delta > 0 or ``length_neutral``."""

    max: float = 0.0  # max criterion delta on per-token k2 (0 = off); paper: 0.05 alone
    avg: float = 0.0  # average criterion delta on per-token k3 (0 = off); paper: 0.001 alone
    reference: str = "old"  # evaluate TRM against pi_old (cheaper) | theta (the paper's guarantee)
    # exact: per-token KL(pi_rollout || pi) from the engine's full distributions (the built-in
    # engine returns them; vLLM gives top-k only); sample: k2 (max) and k3 (avg) estimators
    kl: str = "sample"
    # length-neutral TRM (paper appendix): ln = LN-TRM, ser = SER (mean |rho - 1| <= threshold)
    length_neutral: str = "none"
    ln_threshold: float = 0.05  # delta_W (ln) or delta_SER (ser; the paper suggests 0.03-0.10)
    ln_eps: float = 0.05  # LN-TRM token weights min(1, (T-t) eps, sqrt((T-t) delta / 2))
    ln_delta: float = 0.001

    def __post_init__(self) -> None:
        check_finite(self, "correction.trm")
        check(self.max >= 0 and self.avg >= 0, "correction.trm.max", "TRM deltas must be >= 0")
        one_of(self.reference, "correction.trm.reference", TRM_REFERENCE_NAMES)
        one_of(self.kl, "correction.trm.kl", TRM_KL_SOURCE_NAMES)
        one_of(self.length_neutral, "correction.trm.length_neutral", LENGTH_NEUTRAL_NAMES)
        check(
            self.ln_threshold > 0 and self.ln_eps > 0 and self.ln_delta > 0,
            "correction.trm.ln_threshold",
            "length-neutral TRM parameters must be > 0",
        )

    @property
    def on(self) -> bool:
        return self.max > 0 or self.avg > 0 or self.length_neutral != "none"


@dataclass(frozen=True)
class CorrectionConfig:
    """Rollout correction (docs/math.md 2-3). Ratio bounds are on rho = pi_train / pi_rollout."""

    mode: str = "decoupled"  # decoupled: rollout->old by IS/RS, old->theta by the clip | bypass
    bypass_loss: str = "ppo_clip"  # bypass only: ppo_clip (ratio theta/rollout) | reinforce
    is_level: str = "none"  # none | token | sequence | geometric
    is_clip: float = 2.0  # one-sided truncation of the IS weights
    is_batch_normalize: bool = False  # divide the weights by their global batch mean
    rejection: list[RejectionSpec] = field(default_factory=list)  # rejection rules, AND-combined
    dual_clip_c: float = 0.0  # dual clip for A < 0 (verl clip_ratio_c); 0 = off
    trm: TrmConfig = field(default_factory=TrmConfig)
    # Dynamic Vocabulary Pruning: the engine samples only from a safe set per position and both
    # sides compute log-probs over it (docs/math.md 4; the paper's rule is a GAP, so it is a knob). 0 = off
    dvp_threshold: float = 0.0
    dvp_rule: str = (
        "relative"  # relative: p >= threshold * max p | top_p: smallest set with mass >= threshold
    )

    def __post_init__(self) -> None:
        check_finite(self, "correction")
        one_of(self.mode, "correction.mode", ("decoupled", "bypass"))
        one_of(self.bypass_loss, "correction.bypass_loss", ("ppo_clip", "reinforce"))
        one_of(self.is_level, "correction.is_level", ("none", *IS_LEVEL_NAMES))
        check(self.is_clip >= 1, "correction.is_clip", "must be >= 1")
        check(
            self.dual_clip_c == 0 or self.dual_clip_c > 1, "correction.dual_clip_c", "must be 0 (off) or > 1"
        )
        check(0 <= self.dvp_threshold < 1, "correction.dvp_threshold", "must be in [0, 1)")
        one_of(self.dvp_rule, "correction.dvp_rule", SAFE_SET_RULE_NAMES)
        check(
            not (self.mode == "bypass" and self.bypass_loss == "ppo_clip" and self.is_level != "none"),
            "correction.is_level",
            "bypass ppo_clip applies no IS weight (the ratio already is one)",
        )
        for i, spec in enumerate(self.rejection):
            check_finite(spec, f"correction.rejection[{i}]")
            try:
                parse_rs_spec([spec.option], [spec.bound])
            except ValueError as e:
                raise ConfigError(f"config key 'correction.rejection[{i}]': {e}") from None

    @property
    def rs_options(self) -> tuple[str, ...]:
        return tuple(s.option for s in self.rejection)

    @property
    def rs_bounds(self) -> tuple:
        """One bound per option, as ``parse_rs_spec`` / ``rejection_mask`` take them."""
        return tuple(s.bound for s in self.rejection)
