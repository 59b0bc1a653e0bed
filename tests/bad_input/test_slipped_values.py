"""bad_input tier, issue 42.4: values that used to slip through, each now one ``error:`` line (exit
code 2) naming the key or flag, the disk unchanged: ``rollout.max_staleness`` above its bound (past
int64 it overflowed at the first step) or set with a mode that has no staleness filter, a
``rollout.vllm.*`` key with the built-in engine (a forgotten ``rollout.engine=vllm`` passed for a
vLLM run), ``estimate --gpu-gib`` without room beside the CUDA context, and a GPU recipe started on
a machine without a GPU, which says what it needs before any of its paths is read. And
``estimate``'s verdict for the config's own layout, when vLLM's weights alone do not fit."""

from __future__ import annotations

import pytest
import torch

from tests.cli_helpers import ROOT, fails_with, run_cli

pytestmark = pytest.mark.bad_input
SPLIT = ["parallel.nproc=4", "parallel.rollout_ranks=2"]
RECIPE = str(ROOT / "configs" / "qwen3_30b_a3b_1x8h100.yaml")


def _train_fails(tmp_path, line: str, *args: str) -> None:
    fails_with(tmp_path, line, "train", f"run_dir={tmp_path / 'run'}", *args)


def test_max_staleness_is_bounded_and_async_only(tmp_path):
    huge = "99999999999999999999"  # > int64: the first step's filter overflowed
    _train_fails(
        tmp_path,
        f"override 'rollout.max_staleness={huge}': config key 'rollout.max_staleness': must be <= 64 "
        f"(got {huge}): a rollout rank buffers up to that many requests ahead of the learner",
        *SPLIT,
        "rollout.mode=async",
        f"rollout.max_staleness={huge}",
    )
    for mode in ("sync", "one_step_off"):
        _train_fails(
            tmp_path,
            f"override 'rollout.max_staleness=3': config key 'rollout.max_staleness': 3 acts only with "
            f"rollout.mode=async (the staleness filter) or algo.over_sampling.on_abort=partial (the partial "
            f"rollouts' bound), and rollout.mode={mode} has none: drop the key, "
            f"or use rollout.mode=async",
            *SPLIT,
            f"rollout.mode={mode}",
            "rollout.max_staleness=3",
        )


def test_vllm_keys_with_the_builtin_engine_are_refused_by_name(tmp_path):
    _train_fails(
        tmp_path,
        "override 'rollout.vllm.enforce_eager=true': config key 'rollout.vllm.enforce_eager': "
        "rollout.engine=builtin ignores the vLLM settings rollout.vllm.enforce_eager=true (vLLM does not "
        "run): use rollout.engine=vllm, or drop them",
        "rollout.vllm.enforce_eager=true",
    )
    # every one is named; the line is the first one's source
    _train_fails(
        tmp_path,
        "override 'rollout.vllm.gpu_memory_utilization=0.5': config key "
        "'rollout.vllm.gpu_memory_utilization': rollout.engine=builtin ignores the vLLM settings "
        "rollout.vllm.gpu_memory_utilization=0.5 rollout.vllm.max_model_len=32 (vLLM does not run): use "
        "rollout.engine=vllm, or drop them",
        "rollout.vllm.max_model_len=32",
        "rollout.vllm.gpu_memory_utilization=0.5",
    )
    # a saved config.yaml writes every key at its default: that passes
    code, _, err = run_cli(tmp_path, "config", "rollout.vllm.enforce_eager=false")
    assert (code, err) == (0, "")


def test_estimate_needs_room_beside_the_cuda_context(tmp_path):
    for gib in ("1", "4"):
        fails_with(
            tmp_path,
            f"--gpu-gib must be more than the 4 GiB each GPU keeps for the CUDA context (moe_rl/memory/), "
            f"got {gib}",
            "estimate",
            RECIPE,
            "--gpu-gib",
            gib,
        )


def test_estimate_verdict_when_vllm_weights_alone_do_not_fit(tmp_path):
    # the recipe's vLLM share of an 8 GiB GPU (0.85 x 8 = 6.8 GiB) is below its weights (7.1 GiB)
    code, out, err = run_cli(tmp_path, "estimate", RECIPE, "--gpu-gib", "8")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[-1] == (
        "verdict for TP 2 x EP 8 x ETP 1 x PP 1: does not fit: vLLM's weights alone need 7.1 GiB per GPU, "
        "more than its share rollout.vllm.gpu_memory_utilization=0.85 x 8 GiB = 6.8 GiB"
    )
    assert [x for x in lines if x.startswith("rollout peak:")] == [
        "rollout peak: 74.1 GiB without parallel.offload_during_rollout, 6.8 GiB with it (vLLM's share; "
        "its weights alone need 7.1)"
    ]
    code, out, _ = run_cli(tmp_path, "estimate", RECIPE)  # its own 80 GiB H100s
    assert code == 0 and out.splitlines()[-1] == "verdict for TP 2 x EP 8 x ETP 1 x PP 1: fits"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_recipe_on_a_cpu_machine_says_what_it_needs_first(tmp_path):
    # the recipe's init_weights (/path/to/Qwen3-30B-A3B) is not read: the GPUs come first
    fails_with(
        tmp_path,
        "config key 'parallel.backend': nccl needs CUDA: this config needs 8 GPU(s) (parallel.nproc=8, one "
        "rank a GPU) and this machine has none; run it on 8 GPU(s), or use parallel.backend=gloo (or auto) "
        "for a model the CPU can train",
        "train",
        RECIPE,
        f"run_dir={tmp_path / 'run'}",
    )
