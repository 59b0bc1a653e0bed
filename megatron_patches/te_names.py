"""Bind moe_utils' Transformer Engine helper names to None when TE is not installed.

Target: module globals of megatron.core.transformer.moe.moe_utils (``te_general_gemm`` and the
    ``fused_*`` helpers), read by RouterGatingLinearFunction.forward/backward.
Why: in megatron-core 0.16.x these names are bound only inside ``try: import
    transformer_engine``; without TE the router forward raises
    ``NameError: name 'te_general_gemm' is not defined``.
Remove when: megatron-core >= 0.17 (binds them to None when HAVE_TE is False); the patch is
    then reported as not needed and skipped.

Not tied to the device: it only fills names that are missing, so it is harmless on a CUDA build
(with TE installed the names exist and the patch is not needed).
"""

from __future__ import annotations

import logging
import types

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "te_names"
SUPPORTED = ">=0.16.1,<0.17"  # the bug: fixed upstream in 0.17
CPU_ONLY = False
TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)
# set on moe_utils by apply(): the names this patch bound (a module-specific marker, since the
# module object is shared with other patches)
BOUND_ATTR = "_moe_rl_te_names_bound"


def _moe_utils() -> types.ModuleType:
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


def _missing(module: types.ModuleType) -> list[str]:
    return [name for name in TE_NAMES if name not in module.__dict__]


def needed() -> tuple[bool, str]:
    """Whether any TE name is unbound in moe_utils, with the reason."""
    missing = _missing(_moe_utils())
    if not missing:
        return False, "TE names already bound in moe_utils (TE installed, or megatron-core >= 0.17)"
    return True, f"moe_utils lacks {len(missing)} TE names (megatron-core 0.16.x without TE)"


def check_preconditions() -> None:
    """Nothing to check when the names exist; else the version and the router's global read."""
    if not needed()[0]:
        return
    compat.require_version(SUPPORTED)
    moe_utils = _moe_utils()
    compat.check_attr(moe_utils, "HAVE_TE")
    router_fn = compat.check_attr(moe_utils, "RouterGatingLinearFunction")
    forward = compat.check_attr(router_fn, "forward")
    if "te_general_gemm" not in forward.__code__.co_names:
        raise compat.PatchError(
            "RouterGatingLinearFunction.forward no longer reads the global te_general_gemm"
        )


def is_applied() -> bool:
    return BOUND_ATTR in _moe_utils().__dict__


def apply() -> None:
    """Bind each missing name to None. Idempotent; a no-op when nothing is missing."""
    if is_applied() or not needed()[0]:
        return
    check_preconditions()
    moe_utils = _moe_utils()
    missing = _missing(moe_utils)
    for name in missing:
        setattr(moe_utils, name, None)
    setattr(moe_utils, BOUND_ATTR, tuple(missing))
    logger.info("applied megatron patch %s: bound %s to None", NAME, ", ".join(missing))
