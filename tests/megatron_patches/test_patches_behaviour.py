"""The patches make megatron-core train and checkpoint on CPU, and each one is needed.

The scenarios run in fresh subprocesses (_mcore_cpu_scenario.py) so that this pytest process
is never patched; both start at once and each groups many checks to pay the ~10 s megatron
import only once. Model: local-spec MoE GPTModel, 2 layers, hidden 32, 4 heads, 4 experts
top-2 (alltoall dispatcher), vocab 64, gloo world size 1, DDP + distributed optimizer.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

import megatron_patches

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
SCENARIO = HERE / "_mcore_cpu_scenario.py"
TIMEOUT_S = 300


def _start(mode: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # the two scenarios run side by side
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU shims refuse a visible GPU; run them on CPU anywhere
    return subprocess.Popen(
        [sys.executable, str(SCENARIO), mode, str(out)],
        cwd=out.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, out: Path) -> dict[str, Any]:
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        pytest.fail(f"scenario timed out after {TIMEOUT_S} s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"scenario failed (rc={proc.returncode}):\n{log[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    procs = {}
    for mode in ("patched", "ablation"):
        out = tmp_path_factory.mktemp(mode) / "result.json"
        procs[mode] = (_start(mode, out), out)
    yield {mode: _finish(proc, out) for mode, (proc, out) in procs.items()}


@pytest.fixture(scope="module")
def patched(scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return scenarios["patched"]


@pytest.fixture(scope="module")
def ablation(scenarios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return scenarios["ablation"]


# ------------------------------------------------------------------ what this install needs
# The scenarios run with CUDA hidden; what upstream does then depends on the megatron-core
# version (te_names: fixed in 0.17) and on the torch build (a CPU build and a CUDA build without
# a usable GPU fail with different errors at the same megatron frame).

MCORE = Version(megatron_patches.MCORE_VERSION)
CPU_TORCH = torch.version.cuda is None


@functools.cache
def te_names_needed() -> bool:
    """megatron-core >= 0.17 binds moe_utils' TE names to None itself; with TE they exist."""
    return megatron_patches.get_patch("te_names").needed()[0]  # imports megatron: not at collection


def expected_applied() -> list[str]:
    return [n for n in megatron_patches.ALL_PATCHES if n != "te_names" or te_names_needed()]


def test_te_names_is_needed_on_0_16_without_te_only() -> None:
    import importlib.util

    if MCORE >= Version("0.17"):
        assert not te_names_needed()
    elif importlib.util.find_spec("transformer_engine") is None:
        assert te_names_needed()


# ------------------------------------------------------------------ apply_all


def test_apply_all_applies_every_patch_in_order(patched: dict[str, Any]) -> None:
    assert patched["applied_as_if_cuda"] == list(megatron_patches.ALWAYS_PATCHES)
    assert patched["applied"] == expected_applied()


def test_apply_all_is_idempotent(patched: dict[str, Any]) -> None:
    assert patched["applied_again"] == patched["applied"]
    assert patched["idempotent_targets"], "a second apply_all re-wrapped a target"
    assert patched["check_all_after_apply"] == list(megatron_patches.ALL_PATCHES)


def test_shims_stay_scoped(patched: dict[str, Any]) -> None:
    assert patched["type_outside_optimizer"] == "torch.FloatTensor"
    assert patched["a2a_numpy"], "CPU split sizes were not turned into a host array"


# ------------------------------------------------------------------ training


def test_moe_gpt_trains_with_distributed_optimizer(patched: dict[str, Any]) -> None:
    losses = patched["losses"]
    assert len(losses) == 3 and all(0.0 < loss < 10.0 for loss in losses)
    assert losses[-1] < losses[0]
    assert patched["num_params_changed"] == patched["num_params"] > 0
    assert patched["optimizers"] == ["DistributedOptimizer"]


# ------------------------------------------------------------------ checkpoint + step alias


def test_distopt_checkpoint_restores_state_exactly(patched: dict[str, Any]) -> None:
    assert patched["param_max_diff_after_load"] == 0.0
    assert patched["exp_avg_max_diff_after_load"] == 0.0
    loss_uninterrupted, loss_resumed = patched["next_loss_uninterrupted_vs_resumed"]
    assert loss_resumed == loss_uninterrupted
    assert patched["param_max_diff_after_next_step"] == 0.0


def test_adam_step_is_per_param_after_load(patched: dict[str, Any]) -> None:
    at_save, after_load = patched["steps_at_save"], patched["steps_after_load"]
    assert at_save["values"] == [3.0]
    assert after_load["values"] == at_save["values"]
    assert after_load["num_distinct_tensors"] == after_load["num"] == at_save["num"] > 1


def test_adam_step_advances_by_one_after_load(patched: dict[str, Any]) -> None:
    # with the shared tensor it would advance by the number of params (35 here)
    after = patched["steps_after_next_step"]
    assert after["values"] == [patched["steps_at_save"]["values"][0] + 1]
    assert after["num_distinct_tensors"] == after["num"]


def test_save_results_stay_in_the_rank_process(patched: dict[str, Any]) -> None:
    # upstream's spawn Manager would be a live child process after the save
    q = patched["save_results_queue"]
    assert (q["type"], q["children_left"]) == ("InProcessResults", [])
    assert q["pickle"]["type"] == q["put_from_child"]["type"] == "PatchError"
    assert "asynchronous" in q["pickle"]["message"] and "asynchronous" in q["put_from_child"]["message"]
    assert q["empty_after_child"]  # nothing from another process reached the queue


# ------------------------------------------------------------------ upstream bugs still there
# Tripwires for "Remove when": each calls the upstream callable under our wrapper. When one
# fails after a megatron-core upgrade, upstream fixed that bug: delete the patch (or part).


def test_upstream_still_shares_adam_step(patched: dict[str, Any]) -> None:
    assert patched["upstream_still_broken"]["distopt_step_alias"], "fixed upstream?"


def test_upstream_still_asserts_on_empty_adam_state(patched: dict[str, Any]) -> None:
    err = patched["upstream_still_broken"]["distopt_ckpt_i"]
    assert err["type"] == "AssertionError"
    assert err["where"] == "optimizer/distrib_optimizer.py:state_dict"


def test_upstream_still_copies_missing_step(patched: dict[str, Any]) -> None:
    err = patched["upstream_still_broken"]["distopt_ckpt_ii"]
    assert (err["type"], err["message"]) == ("KeyError", "'step'")


def test_upstream_still_keeps_cpu_splits_as_tensors(patched: dict[str, Any]) -> None:
    assert patched["upstream_still_broken"]["a2a_splits"], "fixed upstream?"


# ------------------------------------------------------------------ ablations

if CPU_TORCH:  # torch's CPU build (CI: 2.13.0+cpu)
    NOT_CUDA: tuple[tuple[str, ...], str] = (("AssertionError",), "Torch not compiled with CUDA enabled")
    NO_STREAM: tuple[tuple[str, ...], str] = (("RuntimeError",), "torch.cuda.Stream requires CUDA support")
else:  # a CUDA build with no usable GPU: no driver (CPU machine) or CUDA_VISIBLE_DEVICES=""
    NOT_CUDA = (("RuntimeError",), "Found no NVIDIA driver|No CUDA GPUs are available")
    NO_STREAM = (
        ("RuntimeError", "AcceleratorError"),
        "CUDA driver version is insufficient|no CUDA-capable device|No CUDA GPUs are available"
        "|Found no NVIDIA driver",
    )
ABLATIONS = {
    # patch left out: (exception types, message regex, innermost megatron frame); the same
    # frames in megatron-core 0.16.1 and 0.19.2
    "rng_tracker": (*NOT_CUDA, "tensor_parallel/random.py:add"),
    "current_device": (*NOT_CUDA, "tensor_parallel/layers.py:__init__"),
    "cuda_stream": (*NO_STREAM, "transformer/moe/token_dispatcher.py:__init__"),
    "causal_mask": (*NOT_CUDA, "transformer/utils.py:get_default_causal_mask"),
    "te_names": (
        ("NameError",),
        "name 'te_general_gemm' is not defined",
        "transformer/moe/moe_utils.py:forward",
    ),
    "cuda_factories": (*NOT_CUDA, "optimizer/optimizer.py:__init__"),
    "tensor_type_strings": (
        ("TypeError",),
        "Wrapped parameters must be one of torch.cuda.FloatTensor",
        "optimizer/distrib_optimizer.py:_build_model_and_main_param_groups",
    ),
}


@pytest.mark.parametrize("name", ABLATIONS)
def test_without_patch_upstream_fails(ablation: dict[str, Any], name: str) -> None:
    err_types, message, where = ABLATIONS[name]
    if name == "te_names" and not te_names_needed():
        # fixed upstream in 0.17 (names bound to None): nothing fails, the patch is skipped
        err_types, message, where = ("none",), "no error", ""
    err = ablation[name]
    assert err["type"] in err_types, err
    assert re.search(message, err["message"]), err
    assert err["where"] == where, err


def test_patches_applied_one_by_one_reach_a_training_step(ablation: dict[str, Any]) -> None:
    assert 0.0 < ablation["loss_after_all_applied"] < 10.0
    assert ablation["apply_all_after"] == expected_applied()
