"""The rejection-option grammar (pure: no torch), shared by the config's validation of
``correction.rejection`` and ``moe_rl.corrections.importance.rejection_mask``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from moe_rl.names import KL_ESTIMATOR_NAMES, RS_AGGREGATION_NAMES

Bound = float | tuple[float, float]  # see parse_rs_spec


def parse_rs_spec(
    options: Sequence[str], bounds: Sequence[Bound] | Bound
) -> list[tuple[str, str, float, float]]:
    """Validate rejection options and bounds.

    Args:
        options: e.g. ["token_k1", "seq_max_k2", "seq_mean_k3"]; "<agg>_<k>" with agg in
            ``RS_AGGREGATION_NAMES`` and k in k1/k2/k3 (no seq_max_k1: k1 is sign-indefinite).
        bounds: a list with one entry per option, or with one entry (or a bare float) broadcast
            to all. k1 entry: (lo, hi) bounds on rho (0 < lo <= hi) or a float U >= 1 meaning
            (1/U, U); k2/k3 entry: a float upper bound > 0. E.g. options ["token_k1", "seq_max_k2"]
            with bounds [(0.6, 1.6), 2.5]; a single k1 option with bounds [(0.5, 2.0)].
    Returns:
        [(agg, kind, lo, hi)]: keep iff lo <= s <= hi, where s is the aggregated log rho for k1
        (lo = log lo_rho, hi = log hi_rho) and the aggregated k2/k3 otherwise (lo = -inf).
    """
    if isinstance(options, str):
        raise TypeError("options must be a list of option names, not a string")
    bounds = list(bounds) if isinstance(bounds, (list, tuple)) else [bounds]
    if len(bounds) == 1:
        bounds = bounds * len(options)
    if len(bounds) != len(options):
        raise ValueError(f"{len(options)} rejection options but {len(bounds)} bounds")
    return [_parse_one(opt, b) for opt, b in zip(options, bounds)]


def _parse_one(option: str, bound: Bound) -> tuple[str, str, float, float]:
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
        return agg, kind, -math.inf, float(bound)
    if isinstance(bound, (tuple, list)):
        lo, hi = (float(b) for b in bound)
    else:
        if not bound >= 1:
            raise ValueError(f"{option}: a single k1 bound U means (1/U, U) and needs U >= 1, got {bound}")
        lo, hi = 1.0 / bound, float(bound)
    if not 0 < lo <= hi:
        raise ValueError(f"{option}: k1 bounds on rho need 0 < lo <= hi, got ({lo}, {hi})")
    return agg, kind, math.log(lo), math.log(hi)
