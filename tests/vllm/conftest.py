"""vllm tier: the real vLLM engine (vllm-cpu 0.30 on CPU). Without vllm these tests skip, unless
MOE_RL_REQUIRE_VLLM=1 (CI's vllm tier, which installed it): then a missing vllm fails them."""

from __future__ import annotations

import os

import pytest


def require_vllm():
    """The vllm module, or a skip; with MOE_RL_REQUIRE_VLLM=1 a missing vllm is a failure."""
    if os.environ.get("MOE_RL_REQUIRE_VLLM") == "1":
        import vllm  # ImportError here fails the test: the tier was asked to run

        return vllm
    return pytest.importorskip("vllm")


@pytest.fixture(scope="session")
def vllm_module():
    return require_vllm()


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """One vLLM engine for test_vllm_cpu.py and test_vllm_cpu_turns.py (it costs ~30 s to start on
    2 cores): ``tests/vllm/cpu_run.module_run``; test_vllm_kv8.py reads its bf16-cache scores.
    The later module changes its weights (the checked sync's breaks, the agent warm start), so it
    runs after the first (file order)."""
    from tests.vllm.cpu_run import module_run

    return module_run(tmp_path_factory)
