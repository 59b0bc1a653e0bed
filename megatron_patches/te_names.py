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

from megatron_patches import _compat

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
    """Nothing to check when the names exist; else the version and the router function."""
    if not needed()[0]:
        return
    _compat.require_version(SUPPORTED)
    moe_utils = _moe_utils()
    _compat.check_attr(moe_utils, "HAVE_TE")
    _compat.check_attr(moe_utils, "RouterGatingLinearFunction")


def is_applied() -> bool:
    return _compat.is_marked(_moe_utils(), NAME)


def apply() -> None:
    """Bind each missing name to None. Idempotent; a no-op when nothing is missing."""
    if is_applied() or not needed()[0]:
        return
    check_preconditions()
    moe_utils = _moe_utils()
    missing = _missing(moe_utils)
    for name in missing:
        setattr(moe_utils, name, None)
    _compat.mark(moe_utils, NAME)
    logger.info("applied megatron patch %s: bound %s to None", NAME, ", ".join(missing))
