"""Make a DistributedOptimizer checkpoint loadable with torch's Adam (no Apex / TE fused Adam).

Target: megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict and
    DistributedOptimizer._set_main_param_and_optimizer_states (torch-Adam branch, i.e.
    ``distrib_optimizer.HAVE_APEX_OR_TE`` is False).
Why: (i) ``sharded_state_dict(..., is_loading=True)`` on a fresh optimizer raises a bare
    ``AssertionError`` (distrib_optimizer.py:642): ``state_dict()`` asserts exactly one Adam
    ``step`` over a still-empty torch-Adam state. (ii) ``load_state_dict`` ->
    ``load_parameter_state_from_fully_reshardable`` / ``_fs_model_space`` ->
    ``_set_main_param_and_optimizer_states`` raises ``KeyError: 'step'``: it copies every
    torch-Adam state key, but the loaders leave ``step`` out (it is restored separately). (iii)
    ``load_parameter_state_from_dp_reshardable`` passes a ``step``, but not the checkpoint's: its
    sharded state keeps ``step`` as a non-persistent object, i.e. the load-time template's tensor
    (1 after the dummy step of (i)), and copying it over the step that ``load_state_dict`` just
    restored from the param groups silently resets Adam's bias correction on every resume.
Remove when: megatron-core initialises the torch-Adam state before ``state_dict()`` and skips
    ``step`` when copying (both unchanged in 0.19.2; (iii) read in 0.16.1).

Both wrappers act only when ``HAVE_APEX_OR_TE`` is False (as upstream's own torch-Adam branches
do) and otherwise call upstream untouched, so the patch is harmless on a CUDA build with fused
Adam; apply_all applies it on CPU. The shared-``step`` bug of the same code path is a separate
patch, ``distopt_step_alias``, because it also hits GPU runs.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "distopt_ckpt"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = False
EXPECTED_PARAMS = {
    "sharded_state_dict": (
        "self",
        "model_sharded_state_dict",
        "is_loading",
        "sharding_type",
        "metadata",
    ),
    "_set_main_param_and_optimizer_states": ("self", "model_param", "tensors"),
    "_get_main_param_and_optimizer_states": ("self", "model_param"),
    "_init_optimizer_states_with_dummy_values": ("self",),
}


def _module() -> types.ModuleType:
    from megatron.core.optimizer import distrib_optimizer

    return distrib_optimizer


def _torch_adam(dopt: types.ModuleType) -> bool:
    return not dopt.HAVE_APEX_OR_TE


def _wrap_sharded_state_dict(dopt: types.ModuleType, upstream: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(upstream)

    @functools.wraps(upstream)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        is_loading = signature.bind(self, *args, **kwargs).arguments.get("is_loading", False)
        if is_loading and _torch_adam(dopt) and len(self.optimizer.state) == 0:
            # (i) materialise the torch-Adam state (a zero-grad step, megatron's own helper, also
            # used by its fsdp_dtensor load path); the checkpoint load overwrites it in place
            self._init_optimizer_states_with_dummy_values()
        return upstream(self, *args, **kwargs)

    return compat.mark(sharded_state_dict, NAME)


def _wrap_set_states(dopt: types.ModuleType, upstream: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(upstream)
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> Any:
        if _torch_adam(dopt) and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            # (ii) the loaders leave out torch Adam's "step", (iii) or pass the template's: the
            # step was restored from the param groups already, so supply the destination's own
            # tensor; upstream's copy_ of it is a self-copy (a no-op) and the rest runs as is
            dst = self._get_main_param_and_optimizer_states(model_param)
            if "step" in dst:
                tensors = {**tensors, "step": dst["step"]}
        return upstream(self, model_param, tensors)

    return compat.mark(_set_main_param_and_optimizer_states, NAME)


def check_preconditions() -> None:
    """Version, the four DistributedOptimizer methods, and the HAVE_APEX_OR_TE switch."""
    compat.require_version(SUPPORTED)
    dopt = _module()
    compat.check_attr(dopt, "HAVE_APEX_OR_TE")
    cls = compat.check_attr(dopt, "DistributedOptimizer")
    for name, params in EXPECTED_PARAMS.items():
        compat.check_signature(compat.check_attr(cls, name), params)


def is_applied() -> bool:
    return compat.is_marked(_module().DistributedOptimizer.sharded_state_dict, NAME)


def apply() -> None:
    """Wrap sharded_state_dict (i) and _set_main_param_and_optimizer_states (ii). Idempotent."""
    if is_applied():
        return
    check_preconditions()
    dopt = _module()
    cls = dopt.DistributedOptimizer
    cls.sharded_state_dict = _wrap_sharded_state_dict(dopt, cls.sharded_state_dict)
    cls._set_main_param_and_optimizer_states = _wrap_set_states(
        dopt, cls._set_main_param_and_optimizer_states
    )
    logger.info("applied megatron patch %s", NAME)
