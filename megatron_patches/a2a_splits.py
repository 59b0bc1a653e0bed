"""Let the alltoall token dispatcher's split sizes become host arrays when already on the CPU.

Target: megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu (also bound by name in
    megatron.core.transformer.moe.token_dispatcher, which uses it for input_splits,
    output_splits and tokens_per_expert).
Why: with ``as_numpy=True`` it converts only ``tensor.is_cuda`` tensors, so on CPU the splits stay
    torch tensors and ``all_to_all_single`` raises ``TypeError: all_to_all_single():
    incompatible function arguments ... output_split_sizes: Sequence[SupportsInt]``
    (tensor_parallel/mappings.py). Hit by the alltoall dispatcher with EP > 1.
Remove when: upstream also converts CPU tensors when ``as_numpy=True`` (unchanged in 0.19.2).

Not tied to the device: the wrapper only acts on CPU tensors and calls upstream otherwise, so it
is harmless on a CUDA build; apply_all still applies it only on CPU, where it is needed.
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

NAME = "a2a_splits"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = False
EXPECTED_PARAMS = ("tensor", "as_numpy", "record_stream")
TARGET = "maybe_move_tensor_to_cpu"


def _modules() -> tuple[types.ModuleType, types.ModuleType]:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    return moe_utils, token_dispatcher


def _wrap(upstream: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(upstream)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # the one case upstream leaves alone: a CPU tensor asked for as a host array
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return compat.mark(maybe_move_tensor_to_cpu, NAME)


def check_preconditions() -> None:
    """Version, the helper's signature, and that the dispatcher uses moe_utils' function."""
    compat.require_version(SUPPORTED)
    moe_utils, token_dispatcher = _modules()
    fn = compat.check_attr(moe_utils, TARGET)
    compat.check_signature(fn, EXPECTED_PARAMS)
    if compat.check_attr(token_dispatcher, TARGET) is not fn:
        raise compat.PatchError(
            f"token_dispatcher.{TARGET} is no longer moe_utils.{TARGET}; the shim would miss it"
        )


def is_applied() -> bool:
    return compat.is_marked(_modules()[0].maybe_move_tensor_to_cpu, NAME)


def apply() -> None:
    """Wrap the helper in moe_utils and rebind the dispatcher's name to the wrapper. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    moe_utils, token_dispatcher = _modules()
    wrapped = _wrap(moe_utils.maybe_move_tensor_to_cpu)
    moe_utils.maybe_move_tensor_to_cpu = wrapped
    token_dispatcher.maybe_move_tensor_to_cpu = wrapped
    logger.info("applied megatron patch %s", NAME)
