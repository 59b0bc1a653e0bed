"""Build megatron's default causal masks on the CPU.

Target: megatron.core.transformer.utils.get_default_causal_mask and
    get_sliding_window_causal_mask (also bound by name in megatron.core.fusions.fused_softmax,
    which calls them from FusedScaleMaskSoftmax when no attention_mask is passed).
Why: both hard-code ``device="cuda"``, so the local-spec DotProductAttention forward raises
    ``AssertionError: Torch not compiled with CUDA enabled``.
Remove when: megatron-core builds the mask on the scores' device (still "cuda" in 0.19.2).
    CPU-only: applying it on a CUDA build raises PatchError.

The upstream functions run unchanged: only the ``torch`` global of transformer/utils.py is
swapped for a proxy whose factories send ``device="cuda"`` to the CPU (see torch_proxy).
Alternative without a patch: always pass an explicit attention_mask.
"""

from __future__ import annotations

import logging
import types

from megatron_patches import compat, torch_proxy

logger = logging.getLogger(__name__)

NAME = "causal_mask"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = True
EXPECTED_PARAMS = {
    "get_default_causal_mask": ("sq",),
    "get_sliding_window_causal_mask": ("sq", "skv", "window_size"),
}


def _modules() -> tuple[types.ModuleType, types.ModuleType]:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    return utils, fused_softmax


def check_preconditions() -> None:
    """Version, both signatures, and that fused_softmax calls the functions from utils.py."""
    compat.require_version(SUPPORTED)
    utils, fused_softmax = _modules()
    torch_proxy.check_module_uses_torch(utils)
    for name, params in EXPECTED_PARAMS.items():
        fn = compat.check_attr(utils, name)
        compat.check_signature(fn, params)
        # the proxy acts through the functions' globals; a copy elsewhere would escape it
        bound = compat.check_attr(fused_softmax, name)
        if getattr(bound, "__globals__", None) is not utils.__dict__:
            raise compat.PatchError(
                f"megatron.core.fusions.fused_softmax.{name} is not defined in "
                f"megatron.core.transformer.utils any more; the causal_mask shim would miss it"
            )


def is_applied() -> bool:
    return torch_proxy.find(_modules()[0], NAME) is not None


def apply() -> None:
    """Swap transformer/utils.py's ``torch`` for the CPU-device proxy. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    compat.require_no_cuda(NAME)
    torch_proxy.install(_modules()[0], NAME)
    logger.info("applied megatron patch %s", NAME)
