"""``optim.cpu_adam`` (issue 32 point 3): megatron-core's CPU-offloaded optimizer
(HybridDeviceOptimizer) is wired for CUDA runs with Transformer Engine (untested on GPU) and
refused on a CPU-only machine with one line, before any rank starts; the reasons are checked
against megatron-core itself (its optimizer builds CUDA streams; its config check compares TE's
version), so a megatron-core that steps on the host without them fails this test and gets wired."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig
from moe_rl.learner.build import cpu_adam_fields
from tests.cli_helpers import TINY, fails_with

pytestmark = pytest.mark.unit
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")


@NO_CUDA
def test_cpu_adam_is_refused_without_cuda_before_any_rank(tmp_path):
    fails_with(
        tmp_path,
        "config key 'optim.cpu_adam': megatron-core's CPU-offloaded Adam (HybridDeviceOptimizer) needs "
        "CUDA (it builds CUDA streams); without GPUs the optimizer step already runs on the host: use "
        "optim.cpu_adam=false",
        "train",
        f"run_dir={tmp_path / 'run'}",
        "optim.cpu_adam=true",
        *TINY,
    )


def test_cpu_adam_needs_the_distributed_optimizer(tmp_path):
    fails_with(
        tmp_path,
        "override 'optim.cpu_adam=true': config key 'optim.cpu_adam': needs "
        "parallel.distributed_optimizer=true (megatron-core steps on the host only as the distributed "
        "optimizer's precision-aware inner optimizer)",
        "train",
        f"run_dir={tmp_path / 'run'}",
        "parallel.distributed_optimizer=false",
        "optim.cpu_adam=true",
    )


@NO_CUDA
def test_megatron_cpu_offloaded_optimizer_needs_cuda_and_te():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from moe_rl.learner.te_spec import te_import_error

    fields = cpu_adam_fields(OptimConfig(cpu_adam=True), OptimizerConfig)
    assert fields["optimizer_cpu_offload"] and fields["optimizer_offload_fraction"] == 1.0
    assert cpu_adam_fields(OptimConfig(), OptimizerConfig) == {}
    if te_import_error() is not None:  # its precision-aware check compares TE's version (None here)
        with pytest.raises(TypeError, match="'>=' not supported between instances of 'NoneType'"):
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, **fields)
    param = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        HybridDeviceOptimizer(
            [{"params": [param]}],
            offload_fraction=1.0,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.Adam,
            param_update_in_fp32=True,
            lr=1e-3,
        )
