"""e2e tier: scripts/bench_sampling.py --quick --arms plain,partial runs plain GRPO and the
partial-rollout arm (dynamic sampling + over-sampling with on_abort=partial) as real `moe-rl train`
runs on the long-tailed task, and every figure it prints is recomputed here from the runs'
metrics.jsonl (exact counts; the per-token rates, the ratios and the step-time median to their
printed rounding), its goal lines from those figures. Two arms, not four: each launch costs about
15 s of startup, and partial runs the code of every figure and both goals (dynamic and drop are
the same figures over other runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.bench_figures import check_printed_figures, check_ratios_and_goals

ROOT = Path(__file__).resolve().parents[2]
SAMPLES, MINIBATCHES = 4, 2  # --quick's


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
    figs = check_printed_figures(text, tmp_path, ("plain", "partial"), SAMPLES, MINIBATCHES)
    plain, partial = figs["plain"], figs["partial"]
    assert plain["mb_total"] == partial["mb_total"] == 2 * MINIBATCHES and plain["steps"] == 2
    # plain trains every group it generated: at the warm start some carry no signal; partial, none
    # (or the cap says so), and its round aborted the long tail and resumed it at step 1
    assert plain["rounds"] == 1 and plain["aborted"] == plain["resumed"] == 0
    assert partial["zero_uncapped"] == 0 and partial["mb_signal"] == partial["mb_total"]
    assert partial["aborted"] > 0 and partial["resumed"] > 0 and partial["dropped"] == 0
    check_ratios_and_goals(text, plain, partial)
