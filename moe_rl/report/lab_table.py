"""The collapse lab's tables (scripts/collapse_lab.py, docs/collapse_lab.md): per arm, mean ±
sample std over seeds of each run's outcome (``outcome.Outcome``), and of any further per-run
numbers reduced from the logged series (``SeriesColumn``: the multi-turn task's stale rows and
tool calls, dynamic sampling's rounds and generated tokens).

Shape suffixes: T logged steps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moe_rl.report import outcome


def mean_spread(xs: Sequence[float]) -> str:
    """'m ± s' over the finite values (sample std), the value alone for one, '-' for none."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3g}"
    return f"{statistics.mean(xs):.3g} ± {statistics.stdev(xs):.2g}"


def collapsed_count(outs: Sequence[outcome.Outcome]) -> str:
    """ "k of n" seeds collapsed, or "n/a" when a run is too short to tell."""
    return f"{sum(o.collapsed for o in outs)} of {len(outs)}" if all(o.judged for o in outs) else "n/a"


def arm_table(results: dict[str, list[outcome.Outcome]]) -> str:
    """Markdown: one row per arm, mean ± sample std over seeds (collapses counted)."""
    head = (
        "| arm | seeds | start reward | final reward | collapsed | collapse step | peak k3 KL "
        "| grad-norm spikes | router flips | TRM acceptance | skipped updates | k3 native | k3 replayed "
        "| flip share |"
    )
    rows = [head, "|---|" + "---:|" * 13]
    for arm, outs in results.items():
        steps = [float(o.collapse_step) for o in outs if o.collapse_step is not None]
        cells = [
            f"| {arm}",
            str(len(outs)),
            mean_spread([o.start_reward for o in outs]),
            mean_spread([o.final_reward for o in outs]),
            collapsed_count(outs),
            mean_spread(steps) if steps else "-",
            *(
                mean_spread([getattr(o, f) for o in outs])
                for f in ("peak_k3", "grad_spikes", "mean_flip", "trm_accept", "skipped_updates")
            ),
            mean_spread([o.k3_native for o in outs]),
            mean_spread([o.k3_replayed for o in outs]),
            mean_spread([o.flip_share for o in outs]),
        ]
        rows.append(" | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _finite(x_T: np.ndarray) -> np.ndarray:
    x = np.asarray(x_T, dtype=np.float64)
    return x[np.isfinite(x)]


def total(x_T: np.ndarray) -> float:
    """Sum over the logged steps (NaN when the key was never logged)."""
    x = _finite(x_T)
    return float(x.sum()) if x.size else math.nan


def steps_nonzero(x_T: np.ndarray) -> float:
    """Steps whose value is > 0 (NaN when never logged)."""
    x = _finite(x_T)
    return float((x > 0).sum()) if x.size else math.nan


def mean_all(x_T: np.ndarray) -> float:
    x = _finite(x_T)
    return float(x.mean()) if x.size else math.nan


def mean_last(x_T: np.ndarray) -> float:
    """Mean over the last ``outcome.FINAL_WINDOW`` logged steps (the final reward's window)."""
    return mean_all(np.asarray(x_T, dtype=np.float64)[-outcome.FINAL_WINDOW :])


def first(x_T: np.ndarray) -> float:
    x = np.asarray(x_T, dtype=np.float64)
    return float(x[0]) if x.size and math.isfinite(x[0]) else math.nan


@dataclass(frozen=True)
class SeriesColumn:
    """One column: ``reduce`` over a run's ``key`` series gives the run's number."""

    label: str
    key: str
    reduce: Callable[[np.ndarray], float]
    meaning: str  # printed under the table


# issue 44 point 7: what the multi-turn task's arms differ in (docs/collapse_lab.md 2)
AGENT_COLUMNS = (
    SeriesColumn(
        "stale rows",
        "routing/version_mismatch_rows",
        total,
        "route rows whose weight version differs from their token's log-prob version, summed over the run",
    ),
    SeriesColumn(
        "steps with stale rows", "routing/version_mismatch_rows", steps_nonzero, "steps with at least one"
    ),
    SeriesColumn(
        "samples dropped",
        "routing/stale_samples_dropped",
        total,
        "samples routing.stale_rows=drop_sample took out of the loss, summed",
    ),
    SeriesColumn(
        "mixed-version samples",
        "rollout/mixed_version_seqs",
        total,
        "trajectories whose tokens carry two weight versions (an update landed inside), summed",
    ),
    SeriesColumn(
        "tool success, start", "agent/tool_success_rate", first, "agent/tool_success_rate at step 0"
    ),
    SeriesColumn(
        "tool success, final",
        "agent/tool_success_rate",
        mean_last,
        f"its mean over the last {outcome.FINAL_WINDOW} steps",
    ),
    SeriesColumn(
        "turns, final",
        "agent/turns_mean",
        mean_last,
        f"agent/turns_mean over the last {outcome.FINAL_WINDOW}",
    ),
)

# issue 46 point 4: what dynamic sampling costs and buys (docs/sampling.md 5)
SAMPLING_COLUMNS = (
    SeriesColumn("rounds / step", "sampling/rounds", mean_all, "sampling/rounds, mean over steps"),
    SeriesColumn(
        "useful fraction", "sampling/useful_frac", mean_all, "sampling/useful_frac, mean over steps"
    ),
    SeriesColumn(
        "cap reached", "sampling/cap_reached", total, "steps that hit algo.dynamic_sampling.max_rounds"
    ),
    SeriesColumn(
        "generated tokens",
        "sampling/response_tokens_generated",
        total,
        "response tokens generated over every round of the run",
    ),
)


def series_table(runs: dict[str, list], columns: Sequence[SeriesColumn]) -> str:
    """Markdown: one row per arm, each column's per-run number as mean ± sample std over the arm's
    runs (``runs``: arm -> ``data.Run``-likes with ``series(key)``), then what each column means."""
    rows = [
        "| arm | seeds | " + " | ".join(c.label for c in columns) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for arm, rs in runs.items():
        cells = [mean_spread([c.reduce(r.series(c.key)) for r in rs]) for c in columns]
        rows.append(f"| {arm} | {len(rs)} | " + " | ".join(cells) + " |")
    notes = "; ".join(f"{c.label}: {c.meaning}" for c in columns)
    return "\n".join(rows) + f"\n\n{notes}.\n"
