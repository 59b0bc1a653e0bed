"""Give every param its own Adam ``step`` tensor after DistributedOptimizer.load_state_dict.

Target: megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict (the
    torch-Adam branch, ``HAVE_APEX_OR_TE`` False: ``step = torch.tensor(...)`` then
    ``s["step"] = step`` for every param state).
Why: a silent bug: all params share ONE ``step`` tensor, and torch Adam increments it in place
    once per param, so after a reload the step advances by the number of params per iteration
    (observed 6 -> 60 in 6 iterations), Adam's bias correction is wrong and resumed losses
    diverge from the uninterrupted run. Hits every run without Apex/TE fused Adam, CPU or GPU.
Remove when: upstream clones ``step`` per param (it does for HybridDeviceOptimizer, not for the
    torch-Adam branch; still shared in 0.19.2).

Applies on CPU and GPU. The wrapper runs upstream unchanged, then replaces every second and
later holder of the same ``step`` tensor with a clone; with fused Adam (``step`` kept in the
param groups) or already-distinct tensors it changes nothing.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "distopt_step_alias"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = False
EXPECTED_PARAMS = ("self", "state_dict")


def _module() -> types.ModuleType:
    from megatron.core.optimizer import distrib_optimizer

    return distrib_optimizer


def unalias_steps(optimizer: torch.optim.Optimizer) -> int:
    """Clone every ``step`` tensor already held by an earlier param state.

    Returns:
        the number of param states that got a fresh ``step`` tensor.
    """
    seen: set[int] = set()
    num_cloned = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if not torch.is_tensor(step):
            continue
        if id(step) in seen:
            state["step"] = step.clone()
            num_cloned += 1
        else:
            seen.add(id(step))
    return num_cloned


def _wrap(upstream: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(upstream)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        result = upstream(self, state_dict)
        num_cloned = unalias_steps(self.optimizer)
        if num_cloned:
            logger.debug("%s: un-aliased Adam step for %d param states", NAME, num_cloned)
        return result

    return compat.mark(load_state_dict, NAME)


def check_preconditions() -> None:
    """Version and DistributedOptimizer.load_state_dict's signature."""
    compat.require_version(SUPPORTED)
    cls = compat.check_attr(_module(), "DistributedOptimizer")
    compat.check_signature(compat.check_attr(cls, "load_state_dict"), EXPECTED_PARAMS)


def is_applied() -> bool:
    return compat.is_marked(_module().DistributedOptimizer.load_state_dict, NAME)


def apply() -> None:
    """Wrap DistributedOptimizer.load_state_dict with the un-aliasing step. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    cls = _module().DistributedOptimizer
    cls.load_state_dict = _wrap(cls.load_state_dict)
    logger.info("applied megatron patch %s", NAME)
