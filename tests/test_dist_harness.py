"""The dist harness runs its ranks on the CPU over gloo, also where a GPU is visible."""

from __future__ import annotations

import os

import pytest

from tests.dist_harness import run_ranks

pytestmark = pytest.mark.dist


def _probe(rank: int) -> dict:
    import torch
    import torch.distributed as tdist

    from moe_rl import dist
    from moe_rl.config import ParallelConfig

    ctx = dist.init_distributed(ParallelConfig(nproc=2, expert_parallel=1), seed=7)
    out = {
        "cuda": torch.cuda.is_available(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "backend": tdist.get_backend(),
        "device": str(ctx.device),
        "rank": ctx.rank,
    }
    dist.shutdown()
    return out


def test_ranks_run_on_cpu_over_gloo_even_with_a_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as on a 1-GPU machine
    results = run_ranks(_probe, 2)
    assert results == [
        {"cuda": False, "visible": "", "backend": "gloo", "device": "cpu", "rank": r} for r in range(2)
    ]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the caller's environment is restored
