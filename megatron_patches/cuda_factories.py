"""Send megatron's hard-coded ``device="cuda"`` tensor factories to the CPU, module by module.

Target: the ``torch`` global of the megatron-core modules in ``MODULES`` (their
    ``torch.tensor/zeros/...(..., device="cuda")`` calls): optimizer.optimizer (found_inf,
    _scale_one, _dummy_overflow_buf, FP32Optimizer._scale), optimizer.clip_grads
    (total_norm_cuda, dummy_overflow_buf, grad_norm), optimizer.grad_scaler (_scale, min_scale,
    growth/backoff factors), distributed.param_and_grad_buffer (tmp_warmup_tensor),
    transformer.moe.moe_utils (track_moe_metrics), utils (l2 norms, packed-seq params) and
    dist_checkpointing.strategies.state_dict_saver (verify_reuse all_reduce).
Why: each raises ``AssertionError: Torch not compiled with CUDA enabled`` on a CPU build: any
    megatron optimizer, clip-grad, MoE metrics and dist-checkpoint save.
Remove when: megatron-core allocates these on the model's device (unchanged in 0.19.2).
    CPU-only: applying it on a CUDA build raises PatchError.

Scoped: each listed module gets its own proxy ``torch`` (see torch_proxy), so no other code in
the process sees a changed factory, and the upstream function bodies run unchanged.
"""

from __future__ import annotations

import importlib
import logging
import types

from megatron_patches import compat, torch_proxy

logger = logging.getLogger(__name__)

NAME = "cuda_factories"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = True
MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens accumulator
)


def _modules() -> list[types.ModuleType]:
    try:
        return [importlib.import_module(name) for name in MODULES]
    except ImportError as err:
        raise compat.PatchError(f"{NAME}: a target module is gone: {err}") from err


def check_preconditions() -> None:
    """Version, and that every listed module still reads factories through global ``torch``."""
    compat.require_version(SUPPORTED)
    for module in _modules():
        torch_proxy.check_module_uses_torch(module)


def is_applied() -> bool:
    return all(torch_proxy.find(module, NAME) is not None for module in _modules())


def apply() -> None:
    """Give each listed module the CPU-device torch proxy. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    compat.require_no_cuda(NAME)
    for module in _modules():
        torch_proxy.install(module, NAME)
    logger.info("applied megatron patch %s to %d modules", NAME, len(MODULES))
