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


def _parent_and_env(rank: int) -> tuple[int, str | None, bool]:
    import sys

    return os.getppid(), os.environ.get("MOE_RL_HARNESS_PROBE"), "megatron.core" in sys.modules


def test_without_cuda_ranks_are_forked_from_the_rank_server_with_the_tests_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from moe_rl import rank_server

    if torch.cuda.is_available():
        pytest.skip("with CUDA the harness spawns its ranks (the rank server is for CPU machines)")
    rank_server.start()  # the server may already run: the variable is set after it started
    monkeypatch.setenv("MOE_RL_HARNESS_PROBE", "set-after-the-server-started")
    results = run_ranks(_parent_and_env, 2)
    assert results == [(rank_server.server_pid(), "set-after-the-server-started", True)] * 2
