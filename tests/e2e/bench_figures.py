"""scripts/bench_sampling.py's printed figures read back, and the same figures recomputed from a
run's own metrics.jsonl (independently of the script's code), for the e2e test of the built-in
engine (tests/e2e/test_bench_sampling.py) and the vllm tier's (tests/vllm/test_vllm_bench_sampling.py)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

NUM = r"(nan|[0-9.]+)"
# the rates, the step time and useful_frac are printed to 4 decimals, every other figure to 2 or less
FOUR_DIGITS = ("mb_per_ktok", "groups_per_ktok", "step_s", "useful_frac")
RATIO_LABELS = (
    ("mb_per_ktok", "minibatches with signal per generated token"),
    ("groups_per_ktok", "groups with signal per generated token"),
    ("step_s", "step time"),
)


def printed(text: str, name: str) -> dict[str, float]:
    """The figures of arm ``name``'s repetition-0 line."""
    line = re.search(rf"^rep 0 {name}: (.*)$", text, re.M).group(1)
    got = re.fullmatch(
        rf"generated tokens {NUM}, minibatches with signal {NUM} of {NUM} \({NUM} per 1k tokens\), "
        rf"groups with signal trained {NUM} \({NUM} per 1k tokens\), zero-signal groups trained {NUM} "
        rf"\({NUM} at steps without the cap; cap reached at {NUM} of {NUM} steps\), step time {NUM} s "
        rf"\(median of steps 1..n\) \| rounds/step {NUM} useful_frac {NUM} aborted {NUM} resumed {NUM} "
        rf"dropped {NUM} stale {NUM} dropped_len {NUM} kept_len {NUM}",
        line,
    )
    assert got, line
    keys = (
        "tokens mb_signal mb_total mb_per_ktok groups_signal groups_per_ktok zero_trained zero_uncapped "
        "cap_steps steps step_s rounds useful_frac aborted resumed dropped stale dropped_len kept_len"
    ).split()
    return dict(zip(keys, map(float, got.groups())))


def from_metrics(run_dir: Path, samples: int, minibatches: int) -> dict[str, float]:
    """The figures, recomputed from the run's own metrics.jsonl."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    col = {k: [r.get(k) for r in recs] for k in recs[0]}
    tokens = sum(col["sampling/response_tokens_generated"])
    trained_groups = [n / samples for n in col["rollout/num_seqs"]]
    zero = [t - k for t, k in zip(trained_groups, col["sampling/groups_kept"])]
    mb = minibatches * len(recs) - sum(col["train/skipped_minibatches"])

    def mean_logged(key):
        xs = [x for x in col.get(key, []) if x is not None]
        return statistics.fmean(xs) if xs else float("nan")

    return {
        "tokens": tokens,
        "mb_signal": mb,
        "mb_total": minibatches * len(recs),
        "mb_per_ktok": 1000 * mb / tokens,
        "groups_signal": sum(col["sampling/groups_kept"]),
        "groups_per_ktok": 1000 * sum(col["sampling/groups_kept"]) / tokens,
        "zero_trained": sum(zero),
        "zero_uncapped": sum(z for z, c in zip(zero, col["sampling/cap_reached"]) if not c),
        "cap_steps": sum(col["sampling/cap_reached"]),
        "steps": len(recs),
        "step_s": statistics.median(col["time/step_s"][1:]),
        "rounds": statistics.fmean(col["sampling/rounds"]),
        "useful_frac": mean_logged("sampling/useful_frac"),
        "aborted": sum(col.get("sampling/aborted", [0.0])),
        "resumed": sum(col.get("sampling/resumed", [0.0])),
        "dropped": sum(col.get("sampling/dropped_aborted", [0.0])),
        "stale": sum(col.get("sampling/partial_dropped_stale", [0.0])),
        "dropped_len": mean_logged("sampling/dropped_len_mean"),
        "kept_len": mean_logged("sampling/kept_len_mean"),
    }


def ratio(text: str, label: str) -> float:
    return float(re.search(rf"{re.escape(label)} {NUM} \(median\)", text).group(1))


def check_printed_figures(
    text: str, out: Path, names: tuple[str, ...], samples: int, minibatches: int
) -> dict:
    """Every figure printed for each arm equals its recomputation (to its printed rounding); the
    recomputed figures by arm."""
    figs = {}
    for name in names:
        got, want = printed(text, name), from_metrics(out / f"{name}_r0", samples, minibatches)
        figs[name] = want
        for key, value in want.items():
            digits = 4 if key in FOUR_DIGITS else 2
            assert got[key] == pytest.approx(value, abs=0.6 * 10**-digits, nan_ok=True), (name, key)
    return figs


def check_ratios_and_goals(text: str, plain: dict, partial: dict) -> None:
    """partial's printed ratios over plain are its figures' ratios; its goal lines follow them."""
    for key, label in RATIO_LABELS:
        got = ratio(text, f"partial {label} over plain")
        assert got == pytest.approx(partial[key] / plain[key], rel=2e-3, abs=2e-3), key
    assert (
        f"goal: partial trains no zero-signal group unless the cap says so: met (0 such groups at "
        f"steps without the cap; cap reached at {partial['cap_steps']:.0f} steps)"
    ) in text
    faster = ratio(text, "partial step time over plain") < 1
    goal = re.search(
        r"^goal: partial's step time below plain's: (met|NOT MET) \(median paired ratio ", text, re.M
    )
    assert goal.group(1) == ("met" if faster else "NOT MET")
    assert text.rstrip().endswith(f"goals: {'all met' if faster else 'not all met'}")
