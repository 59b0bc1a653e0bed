"""Correction metrics that are non-linear functions of globally reduced ones.

The pure functions return only exactly reducible values (``moe_rl.metrics``: Mean / Std / Max / Min).
A quantity such as an effective sample size, a ratio of means, or an alarm on a global rate cannot be
computed per rank and then reduced, so the caller derives it once, from the output of
``reduce_metrics``:

    reduced = derive_metrics(reduce_metrics(metrics))
"""

from __future__ import annotations

import math

from moe_rl.corrections.trm import ACCEPT_ALARM_BELOW


def derive_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """Adds the derived correction metrics whose inputs are present; returns a new dict.

    - ``corr/is_ess`` = 1 / mean(wbar^2) with wbar = w / mean(w) (docs/math.md 2.6; a fraction in (0, 1]),
      = mean^2 / (mean^2 + std^2) from ``corr/is_mean`` and ``corr/is_std`` (population std over
      response tokens). Troubleshooting hint (docs/math.md 2.6): investigate below 0.3.
    - ``corr/is_seq_ess``: the same over sequences, from ``corr/is_seq_mean`` / ``corr/is_seq_std``.
    - ``corr/trm_alarm`` = 1.0 when ``corr/trm_accept_rate`` < 0.7 (docs/math.md 3.3), else 0.0.
    """
    out = dict(reduced)
    for prefix in ("corr/is", "corr/is_seq"):
        mean, std = reduced.get(f"{prefix}_mean"), reduced.get(f"{prefix}_std")
        if mean is not None and std is not None:
            second = mean * mean + std * std
            out[f"{prefix}_ess"] = mean * mean / second if second > 0 else math.nan
    rate = reduced.get("corr/trm_accept_rate")
    if rate is not None:
        out["corr/trm_alarm"] = float(rate < ACCEPT_ALARM_BELOW) if not math.isnan(rate) else math.nan
    return out
