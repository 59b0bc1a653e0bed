"""A run's outcome in numbers: final reward, when (if) it collapsed, peak mismatch, gradient-norm
spikes, TRM acceptance, skipped optimizer steps. Pure numpy over the logged series; the
definitions are stated once here and printed with every table that uses them.

Shape suffixes: T logged steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# start reward: the first logged step's (the warm start, before any update). Every arm of a seed
# samples that step from the same weights and engine, so all are judged against one bar; a mean over
# later steps would hold each arm's own first updates, and any fast fall inside them.
START_WINDOW = 1
COLLAPSE_WINDOW = 10  # collapsed once the mean over this many consecutive steps ...
COLLAPSE_FRAC = 0.25  # ... is below this fraction of the start reward
FINAL_WINDOW = 10  # final reward: mean over the last this many logged steps
SPIKE_FACTOR = 5.0  # a spike: grad norm above this multiple of the median of all earlier steps
SPIKE_MIN_HISTORY = 5  # ... once at least this many earlier steps exist

START_DEFINITION = "reward/mean of the first logged step (the warm start, before any update)"
FINAL_DEFINITION = f"mean reward/mean over the last {FINAL_WINDOW} logged steps"
DEFINITIONS = (
    f"Start reward: {START_DEFINITION}. Final reward: {FINAL_DEFINITION}. "
    f"Collapse step: the first later step from which the mean reward/mean of {COLLAPSE_WINDOW} "
    f"consecutive steps is below {COLLAPSE_FRAC:.0%} of the start reward "
    f"(none: never; n/a: fewer than {START_WINDOW + COLLAPSE_WINDOW} steps logged). "
    f"Gradient-norm spikes: steps whose train/grad_norm exceeds {SPIKE_FACTOR:g}x the median of all "
    f"earlier steps (from step {SPIKE_MIN_HISTORY} on). Peak k3: max corr/k3_kl (rollout vs learner). "
    f"TRM acceptance: mean corr/trm_accept_rate (only runs with TRM on). Skipped updates: minibatches "
    f"whose gradient was exactly 0 on every rank, so the optimizer did not step (sum of "
    f"train/skipped_minibatches). k3 native / replayed: mean mismatch/k3_native and "
    f"mismatch/k3_replayed over the steps the mismatch split was logged (log.mismatch_split_every); "
    f"flip share: 1 - replayed / native, the part of the mismatch the flipped routes cause."
)


@dataclass(frozen=True)
class Outcome:
    final_reward: float
    start_reward: float  # mean over the first START_WINDOW steps (1: the warm start's own step)
    collapse_step: int | None  # None: never collapsed (or too short to tell: see ``judged``)
    judged: bool  # at least START_WINDOW + COLLAPSE_WINDOW steps logged
    peak_k3: float
    mean_k3: float
    grad_spikes: int
    mean_flip: float  # routing/flip_router_frac, mean over steps
    trm_accept: float  # NaN when TRM is off
    skipped_updates: float  # minibatches without an optimizer step; NaN when not logged
    k3_native: float = math.nan  # mismatch/k3_native, mean over the steps the split was logged
    k3_replayed: float = math.nan  # mismatch/k3_replayed, likewise

    @property
    def flip_share(self) -> float:
        """The part of the k3 mismatch the flipped routes cause (NaN without the split)."""
        return 1.0 - self.k3_replayed / self.k3_native if self.k3_native > 0 else math.nan

    @property
    def collapsed(self) -> bool:
        return self.collapse_step is not None

    def collapse_text(self) -> str:
        if not self.judged:
            return "n/a"
        return "none" if self.collapse_step is None else str(self.collapse_step)


def collapse_step(
    steps_T: np.ndarray,
    reward_T: np.ndarray,
    window: int = COLLAPSE_WINDOW,
    frac: float = COLLAPSE_FRAC,
    start: int = START_WINDOW,
) -> int | None:
    """The logged step after the first ``start`` (the reference) that opens the first ``window``
    consecutive steps whose mean reward is below ``frac`` x the reference's mean; None if never (or
    fewer than ``start + window`` steps). The reference is the warm start, so a collapse within a
    few steps is dated when it happens and not hidden in the bar it is measured against."""
    r_T = np.nan_to_num(np.asarray(reward_T, dtype=np.float64), nan=0.0)
    if len(r_T) < start + window:
        return None
    csum = np.concatenate([[0.0], np.cumsum(r_T)])
    sums = csum[start + window :] - csum[start:-window]  # the window opening at step index start + i
    below = np.nonzero(sums * start < frac * window * csum[start])[0]  # sums, not means: no rounding
    return int(steps_T[start + below[0]]) if below.size else None


def grad_spikes(
    grad_T: np.ndarray, factor: float = SPIKE_FACTOR, min_history: int = SPIKE_MIN_HISTORY
) -> int:
    """Steps whose gradient norm exceeds ``factor`` x the median of every earlier finite one."""
    g_T = np.asarray(grad_T, dtype=np.float64)
    count = 0
    for t in range(min_history, len(g_T)):  # T is a run's step count: a few hundred medians
        earlier = g_T[:t][np.isfinite(g_T[:t])]
        if earlier.size >= min_history and np.isfinite(g_T[t]) and g_T[t] > factor * np.median(earlier):
            count += 1
    return count


def start_and_final_reward(reward_T) -> tuple[float, float]:
    """(start, final) reward of a run, the one definition the report uses everywhere (summary,
    outcome table): START_DEFINITION and FINAL_DEFINITION. NaN where nothing finite was logged;
    the start is the first logged step's value, NaN if that step has none."""
    r_T = np.asarray(reward_T, dtype=np.float64)
    return _stat(r_T[:START_WINDOW], np.mean), _stat(r_T[-FINAL_WINDOW:], np.mean)


def _stat(x_T: np.ndarray, fn) -> float:
    x = np.asarray(x_T, dtype=np.float64)
    x = x[np.isfinite(x)]
    return float(fn(x)) if x.size else math.nan


def outcome(steps_T: np.ndarray, series) -> Outcome:
    """``series(key)`` gives a metric as float [T] (NaN where absent), e.g. ``Run.series``."""
    reward_T = series("reward/mean")
    start, final = start_and_final_reward(reward_T)
    return Outcome(
        final_reward=final,
        start_reward=start,
        collapse_step=collapse_step(steps_T, reward_T),
        judged=len(reward_T) >= START_WINDOW + COLLAPSE_WINDOW,
        peak_k3=_stat(series("corr/k3_kl"), np.max),
        mean_k3=_stat(series("corr/k3_kl"), np.mean),
        grad_spikes=grad_spikes(series("train/grad_norm")),
        mean_flip=_stat(series("routing/flip_router_frac"), np.mean),
        trm_accept=_stat(series("corr/trm_accept_rate"), np.mean),
        skipped_updates=_stat(series("train/skipped_minibatches"), np.sum),
        k3_native=_stat(series("mismatch/k3_native"), np.mean),
        k3_replayed=_stat(series("mismatch/k3_replayed"), np.mean),
    )
