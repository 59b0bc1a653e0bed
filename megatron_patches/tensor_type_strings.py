"""Let megatron's optimizer classify CPU params by their ``torch.cuda.*`` type string.

Target: torch.Tensor.type, as called with no arguments from megatron.core.optimizer.*:
    DistributedOptimizer._build_model_and_main_param_groups and __init__,
    Float16OptimizerWithFloat16Params.__init__, clip_grads.clip_grad_by_total_norm_fp32.
Why: they compare ``param.type()`` with ``'torch.cuda.FloatTensor'`` (and the Half/BFloat16
    spellings); a CPU param reports ``'torch.FloatTensor'``, so building the distributed
    optimizer raises ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor,
    torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor. Received torch.FloatTensor`` and
    clipping raises AssertionError.
Remove when: megatron-core classifies params by dtype instead of type strings (0.19.2 still
    uses the strings). CPU-only: applying it on a CUDA build raises PatchError.

The wrapper changes only the no-argument call made *from a megatron.core.optimizer module*
(checked on the caller's frame); every other call, and every cast, goes to upstream unchanged.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "tensor_type_strings"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = True
CALLER_PACKAGE = "megatron.core.optimizer"
# (module, attribute path) of the upstream code that compares type strings
CALL_SITES = (
    (
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups",
    ),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
)


def _called_from_optimizer(depth: int) -> bool:
    caller = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return caller == CALLER_PACKAGE or caller.startswith(CALLER_PACKAGE + ".")


def _wrap(upstream: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(upstream)
    def type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 (method name)
        if not args and not kwargs and not self.is_cuda and _called_from_optimizer(1):
            return upstream(self).replace("torch.", "torch.cuda.", 1)
        return upstream(self, *args, **kwargs)

    return compat.mark(type, NAME)


def check_preconditions() -> None:
    """Version, Tensor.type, and the optimizer call sites that compare type strings."""
    import importlib

    compat.require_version(SUPPORTED)
    compat.check_attr(torch.Tensor, "type")
    for module_name, path in CALL_SITES:
        obj: Any = importlib.import_module(module_name)
        for part in path.split("."):
            obj = compat.check_attr(obj, part)


def is_applied() -> bool:
    return compat.is_marked(torch.Tensor.type, NAME)


def apply() -> None:
    """Wrap torch.Tensor.type with the optimizer-caller check. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    compat.require_no_cuda(NAME)
    torch.Tensor.type = _wrap(torch.Tensor.type)  # type: ignore[method-assign]
    logger.info("applied megatron patch %s", NAME)
