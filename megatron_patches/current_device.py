"""Make ``torch.cuda.current_device()`` name the CPU on CPU-only torch builds.

Target: torch.cuda.current_device, as called by megatron-core for ``device=`` arguments in
    tensor_parallel.layers (VocabParallelEmbedding with use_cpu_initialization=False),
    utils.GlobalMemoryBuffer (DotProductAttention), Router.gating, the experts, the DDP
    buffers, and TopKRouter's ``expert_bias`` / ``local_tokens_per_expert`` buffers (sigmoid
    routers with ``moe_router_enable_expert_bias``, tests/learner/test_router_variants_dist.py).
Why: every one of those raises ``AssertionError: Torch not compiled with CUDA enabled``.
    Returning ``torch.device("cpu")`` keeps all those allocations valid on the CPU.
Remove when: megatron-core takes its device from the model/config instead of
    ``torch.cuda.current_device()`` (still hard-coded in 0.19.2). CPU-only: applying it on a
    CUDA build raises PatchError.

Installed on ``torch.cuda`` itself: the call sites are spread over dozens of megatron modules,
and on a CPU-only build the original can only raise.
"""

from __future__ import annotations

import logging

import torch

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "current_device"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = True


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def check_preconditions() -> None:
    """Version and the zero-argument signature megatron calls."""
    compat.require_version(SUPPORTED)
    compat.check_signature(torch.cuda.current_device, ())


def is_applied() -> bool:
    return compat.is_marked(torch.cuda.current_device, NAME)


def apply() -> None:
    """Replace torch.cuda.current_device with a function returning the CPU device. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    compat.require_no_cuda(NAME)
    original = torch.cuda.current_device
    _cpu_current_device.__wrapped__ = original  # type: ignore[attr-defined]  # for inspection
    torch.cuda.current_device = compat.mark(_cpu_current_device, NAME)
    logger.info("applied megatron patch %s", NAME)
