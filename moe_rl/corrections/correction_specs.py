"""The specs of the rollout corrections, one frozen dataclass per feature, torch-free (the config
composes them without the maths): importance weights (``ImportanceSpec``), rejection
(``RejectionSpec``, its grammar ``parse_rs_spec`` and the typed ``RejectionRule`` it parses into),
Trust Region Masking (``TrmSpec``), Dynamic Vocabulary Pruning (``DvpSpec``), and the correction as
a whole (``CorrectionSpec``: ``correction.*`` of a config, and what a step carries unchanged).

Each spec validates itself in ``__post_init__``, naming the config key (``moe_rl.checks``). The
maths next to this module takes them directly: ``importance.is_weights`` the ``ImportanceSpec``,
``importance.rejection_mask`` the parsed rules, ``trm.trm_mask`` the ``TrmSpec`` (which statistic
each criterion reads is decided there), ``dvp.safe_set`` the ``DvpSpec``, ``moe_rl.maths.losses``
the whole ``CorrectionSpec`` in bypass mode.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from moe_rl.checks import check, check_finite, one_of
from moe_rl.errors import ConfigError
from moe_rl.maths.policy_specs import PolicyLossSpec
from moe_rl.names import (
    BYPASS_LOSS_NAMES,
    IS_LEVEL_NAMES,
    KL_ESTIMATOR_NAMES,
    LENGTH_NEUTRAL_NAMES,
    RS_AGGREGATION_NAMES,
    SAFE_SET_RULE_NAMES,
    TRM_KL_SOURCE_NAMES,
    TRM_REFERENCE_NAMES,
)

# --------------------------------------------------------------------------- rejection

Bound = float | tuple[float, float]  # see parse_rs_spec


class RejectionRule(NamedTuple):
    """One parsed rejection option: keep iff lo <= s <= hi, where s is the aggregated log rho for
    k1 (lo, hi = log of the bounds on rho) and the aggregated k2 / k3 otherwise (lo = -inf)."""

    agg: str  # moe_rl.names.RS_AGGREGATION_NAMES
    kind: str  # k1 | k2 | k3
    lo: float
    hi: float

    @property
    def option(self) -> str:
        """The option's name, ``<agg>_<kind>`` (its metrics are ``corr/rs_<option>_*``)."""
        return f"{self.agg}_{self.kind}"


def parse_rs_spec(options: Sequence[str], bounds: Sequence[Bound] | Bound) -> list[RejectionRule]:
    """Validate rejection options and bounds into typed rules.

    Args:
        options: e.g. ["token_k1", "seq_max_k2", "seq_mean_k3"]; "<agg>_<k>" with agg in
            ``RS_AGGREGATION_NAMES`` and k in k1/k2/k3 (no seq_max_k1: k1 is sign-indefinite).
        bounds: a list with one entry per option, or with one entry (or a bare float) broadcast
            to all. k1 entry: (lo, hi) bounds on rho (0 < lo <= hi) or a float U >= 1 meaning
            (1/U, U); k2/k3 entry: a float upper bound > 0. E.g. options ["token_k1", "seq_max_k2"]
            with bounds [(0.6, 1.6), 2.5]; a single k1 option with bounds [(0.5, 2.0)].
    Returns:
        [RejectionRule(agg, kind, lo, hi)]: keep iff lo <= s <= hi, where s is the aggregated log
        rho for k1 (lo = log lo_rho, hi = log hi_rho) and the aggregated k2/k3 otherwise (lo = -inf).
    """
    if isinstance(options, str):
        raise TypeError("options must be a list of option names, not a string")
    bounds = list(bounds) if isinstance(bounds, (list, tuple)) else [bounds]
    if len(bounds) == 1:
        bounds = bounds * len(options)
    if len(bounds) != len(options):
        raise ValueError(f"{len(options)} rejection options but {len(bounds)} bounds")
    return [_parse_one(opt, b) for opt, b in zip(options, bounds)]


def _parse_one(option: str, bound: Bound) -> RejectionRule:
    agg, _, kind = option.rpartition("_")
    if kind not in KL_ESTIMATOR_NAMES or agg not in RS_AGGREGATION_NAMES:
        raise ValueError(
            f"unknown rejection option {option!r}; use <agg>_<k1|k2|k3>, agg in "
            f"{sorted(RS_AGGREGATION_NAMES)}"
        )
    if agg == "seq_max" and kind == "k1":
        raise ValueError("seq_max_k1 is not supported (k1 is sign-indefinite); use seq_max_k2")
    if kind != "k1":
        if isinstance(bound, (tuple, list)) or not bound > 0:
            raise ValueError(f"{option}: bound must be one float > 0, got {bound!r}")
        return RejectionRule(agg, kind, -math.inf, float(bound))
    if isinstance(bound, (tuple, list)):
        lo, hi = (float(b) for b in bound)
    else:
        if not bound >= 1:
            raise ValueError(f"{option}: a single k1 bound U means (1/U, U) and needs U >= 1, got {bound}")
        lo, hi = 1.0 / bound, float(bound)
    if not 0 < lo <= hi:
        raise ValueError(f"{option}: k1 bounds on rho need 0 < lo <= hi, got ({lo}, {hi})")
    return RejectionRule(agg, kind, math.log(lo), math.log(hi))


@dataclass(frozen=True)
class RejectionSpec:
    """One rejection rule of ``correction.rejection`` (AND-combined; grammar: ``parse_rs_spec``).

    ``option`` is ``<agg>_<k1|k2|k3>`` (token_k1, seq_mean_k3, ...). k1 bounds rho: kept iff
    lower <= rho <= upper, and ``lower: 0`` means 1/upper (then upper >= 1); k2/k3 bound the
    aggregated estimate from above (upper > 0, no lower). YAML: ``{option: seq_sum_k1, lower: 0.5,
    upper: 2.0}``. ``CorrectionSpec`` validates it (the error names its index) and parses it once,
    into ``rule``."""

    option: str = ""
    upper: float = 0.0
    lower: float = 0.0

    @property
    def bound(self) -> float | tuple[float, float]:
        """The bound as ``parse_rs_spec`` takes it: (lower, upper), or upper alone."""
        return (self.lower, self.upper) if self.lower else self.upper

    @functools.cached_property
    def rule(self) -> RejectionRule:
        """The parsed rule (ValueError when the option or bound is invalid); parsed on first use."""
        return parse_rs_spec([self.option], [self.bound])[0]


# --------------------------------------------------------------------------- IS, TRM, DVP


@dataclass(frozen=True)
class ImportanceSpec:
    """Truncated importance weights w = min(rho_level, clip) (docs/math.md 2.2); ``level`` "none" = off.
    YAML: the flat ``correction.is_level``, ``is_clip``, ``is_batch_normalize``. The maths,
    ``moe_rl.corrections.importance.is_weights``, takes this spec."""

    level: str = "none"  # none | token | sequence | geometric
    # one-sided truncation of the weights; None = none (plain IS: the maths and its tests only, the
    # config's is_clip is a float)
    clip: float | None = 2.0
    batch_normalize: bool = False  # divide the weights by their global batch mean

    def __post_init__(self) -> None:
        one_of(self.level, "correction.is_level", ("none", *IS_LEVEL_NAMES))
        check(
            self.clip is None or (math.isfinite(self.clip) and self.clip >= 1),
            "correction.is_clip",
            "must be >= 1",
        )

    @property
    def on(self) -> bool:
        return self.level != "none"


@dataclass(frozen=True)
class TrmSpec:
    """Trust Region Masking (docs/math.md 3): whole sequences whose per-token divergence from the
    rollout policy exceeds a criterion are masked. Off unless a delta > 0 or ``length_neutral``.
    Which per-token statistic each criterion reads is ``moe_rl.corrections.trm.trm_mask``'s."""

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
class DvpSpec:
    """Dynamic Vocabulary Pruning (docs/math.md 4): the engine samples only from a safe set per
    position and both sides compute log-probs over it; ``threshold`` 0 = off. YAML: the flat
    ``correction.dvp_threshold``, ``dvp_rule``."""

    threshold: float = 0.0
    rule: str = "relative"  # relative: p >= threshold * max p | top_p: smallest set with mass >= threshold

    def __post_init__(self) -> None:
        check(0 <= self.threshold < 1, "correction.dvp_threshold", "must be in [0, 1)")
        one_of(self.rule, "correction.dvp_rule", SAFE_SET_RULE_NAMES)

    @property
    def on(self) -> bool:
        return self.threshold > 0


# --------------------------------------------------------------------------- the correction


@dataclass(frozen=True)
class CorrectionSpec:
    """Rollout correction, ``correction.*`` (docs/math.md 2-3). Ratio bounds are on
    rho = pi_train / pi_rollout. The YAML keys are flat (``is_level``, ``dvp_threshold``, ...);
    ``importance`` and ``dvp`` are their specs, built (and validated) once."""

    mode: str = "decoupled"  # decoupled: rollout->old by IS/RS, old->theta by the clip | bypass
    bypass_loss: str = "ppo_clip"  # bypass only: ppo_clip (ratio theta/rollout) | reinforce
    is_level: str = "none"  # none | token | sequence | geometric
    is_clip: float = 2.0  # one-sided truncation of the IS weights
    is_batch_normalize: bool = False  # divide the weights by their global batch mean
    rejection: list[RejectionSpec] = field(default_factory=list)  # rejection rules, AND-combined
    dual_clip_c: float = 0.0  # dual clip for A < 0 (verl clip_ratio_c); 0 = off
    trm: TrmSpec = field(default_factory=TrmSpec)
    # Dynamic Vocabulary Pruning: the engine samples only from a safe set per position and both
    # sides compute log-probs over it (docs/math.md 4; the paper's rule is a GAP, so it is a knob). 0 = off
    dvp_threshold: float = 0.0
    dvp_rule: str = (
        "relative"  # relative: p >= threshold * max p | top_p: smallest set with mass >= threshold
    )

    def __post_init__(self) -> None:
        check_finite(self, "correction")
        one_of(self.mode, "correction.mode", ("decoupled", "bypass"))
        one_of(self.bypass_loss, "correction.bypass_loss", BYPASS_LOSS_NAMES)
        _ = self.importance  # validates is_level, is_clip
        PolicyLossSpec(dual_clip_c=self.dual_clip_c)  # the dual clip's rule is the loss spec's
        _ = self.dvp  # validates dvp_threshold, dvp_rule
        check(
            not (self.mode == "bypass" and self.bypass_loss == "ppo_clip" and self.is_level != "none"),
            "correction.is_level",
            "bypass ppo_clip applies no IS weight (the ratio already is one)",
        )
        check(
            not (self.mode == "bypass" and self.is_batch_normalize),
            "correction.is_batch_normalize",
            "batch normalisation is decoupled mode's (bypass applies its IS weights per micro-batch, "
            "in the loss); use correction.mode=decoupled or leave it false",
        )
        for i, spec in enumerate(self.rejection):
            check_finite(spec, f"correction.rejection[{i}]")
            try:
                _ = spec.rule  # parsed here, once
            except ValueError as e:
                raise ConfigError(f"config key 'correction.rejection[{i}]': {e}") from None

    @functools.cached_property
    def importance(self) -> ImportanceSpec:
        return ImportanceSpec(self.is_level, self.is_clip, self.is_batch_normalize)

    @functools.cached_property
    def dvp(self) -> DvpSpec:
        return DvpSpec(self.dvp_threshold, self.dvp_rule)

    @property
    def rules(self) -> tuple[RejectionRule, ...]:
        """The rejection rules, parsed once (``RejectionSpec.rule``)."""
        return tuple(s.rule for s in self.rejection)

    @property
    def decoupled(self) -> bool:
        """Decoupled mode: the rollout -> old drift is corrected once per batch (IS, rejection,
        TRM against pi_old); bypass mode corrects against pi_rollout inside the loss."""
        return self.mode == "decoupled"

    @property
    def trm_old(self) -> TrmSpec | None:
        """TRM evaluated once per batch against pi_old (None: off, or against pi_theta)."""
        return self.trm if self.trm.on and self.trm.reference == "old" else None

    @property
    def trm_theta(self) -> TrmSpec | None:
        """TRM evaluated inside every loss call against pi_theta (None: off, or against pi_old)."""
        return self.trm if self.trm.on and self.trm.reference == "theta" else None

    @property
    def needs_full_dists(self) -> bool:
        """The learner needs the rollout engine's full distributions (exact-KL TRM): the one place
        this is decided; the engine's sampling params, the vLLM rules and the step read it."""
        return self.trm.on and self.trm.kl == "exact"
