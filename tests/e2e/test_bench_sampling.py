"""e2e tier: scripts/bench_sampling.py --quick --arms plain,partial runs plain GRPO and the
partial-rollout arm (dynamic sampling + over-sampling with on_abort=partial) as real `moe-rl train`
runs on the long-tailed task, and every figure it prints is recomputed here from the runs'
metrics.jsonl (exact counts; the per-token rates, the ratios and the step-time median to their
printed rounding), its goal lines from those figures. Two arms, not four: each launch costs about
15 s of startup, and partial runs the code of every figure and both goals (dynamic and drop are
the same figures over other runs)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUM = r"(nan|[0-9.]+)"
SAMPLES, MINIBATCHES = 4, 2  # --quick's


def _printed(text: str, name: str) -> dict[str, float]:
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


def _from_metrics(run_dir: Path) -> dict[str, float]:
    """The figures, recomputed from the run's own metrics.jsonl."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    col = {k: [r.get(k) for r in recs] for k in recs[0]}
    tokens = sum(col["sampling/response_tokens_generated"])
    trained_groups = [n / SAMPLES for n in col["rollout/num_seqs"]]
    zero = [t - k for t, k in zip(trained_groups, col["sampling/groups_kept"])]
    mb = MINIBATCHES * len(recs) - sum(col["train/skipped_minibatches"])

    def mean_logged(key):
        xs = [x for x in col.get(key, []) if x is not None]
        return statistics.fmean(xs) if xs else float("nan")

    return {
        "tokens": tokens,
        "mb_signal": mb,
        "mb_total": MINIBATCHES * len(recs),
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


def _ratio(text: str, label: str) -> float:
    return float(re.search(rf"{re.escape(label)} {NUM} \(median\)", text).group(1))


@pytest.mark.e2e
def test_bench_sampling_quick_prints_the_runs_own_figures_and_goals(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_sampling.py"),
            "--quick",
            "--arms",
            "plain,partial",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = proc.stdout
    figs = {}
    for name in ("plain", "partial"):
        printed, want = _printed(text, name), _from_metrics(tmp_path / f"{name}_r0")
        figs[name] = want
        for key, value in want.items():
            digits = 4 if key in ("mb_per_ktok", "groups_per_ktok", "step_s", "useful_frac") else 2
            assert printed[key] == pytest.approx(value, abs=0.6 * 10**-digits, nan_ok=True), (name, key)
    plain, partial = figs["plain"], figs["partial"]
    assert plain["mb_total"] == partial["mb_total"] == 2 * MINIBATCHES and plain["steps"] == 2
    # plain trains every group it generated: at the warm start some carry no signal; partial, none
    # (or the cap says so), and its round aborted the long tail and resumed it at step 1
    assert plain["rounds"] == 1 and plain["aborted"] == plain["resumed"] == 0
    assert partial["zero_uncapped"] == 0 and partial["mb_signal"] == partial["mb_total"]
    assert partial["aborted"] > 0 and partial["resumed"] > 0 and partial["dropped"] == 0
    for key, label in (
        ("mb_per_ktok", "minibatches with signal per generated token"),
        ("groups_per_ktok", "groups with signal per generated token"),
        ("step_s", "step time"),
    ):
        got = _ratio(text, f"partial {label} over plain")
        assert got == pytest.approx(partial[key] / plain[key], rel=2e-3, abs=2e-3), key
    assert (
        f"goal: partial trains no zero-signal group unless the cap says so: met (0 such groups at "
        f"steps without the cap; cap reached at {partial['cap_steps']:.0f} steps)"
    ) in text
    faster = _ratio(text, "partial step time over plain") < 1
    goal = re.search(
        r"^goal: partial's step time below plain's: (met|NOT MET) \(median paired ratio ", text, re.M
    )
    assert goal.group(1) == ("met" if faster else "NOT MET")
    assert text.rstrip().endswith(f"goals: {'all met' if faster else 'not all met'}")
