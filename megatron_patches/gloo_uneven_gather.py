"""Give gloo the uneven all-gather of megatron's sequence-parallel mappings.

Target: megatron.core.tensor_parallel.mappings._gather_along_first_dim (called through the
    module's globals by gather_from_sequence_parallel_region).
Why: with ``output_split_sizes`` (ranks hold different numbers of rows) upstream calls
    ``torch.distributed.all_gather`` with a list of unequal tensors, which gloo refuses
    ("ProcessGroupGloo::allgather: invalid tensor size at index 0"). The alltoall token
    dispatcher takes this path with expert parallelism AND expert-tensor parallelism > 1 (the
    tokens each expert-TP rank received differ), so TP x EP layouts with expert-TP 2 could not
    run on CPU. (The uneven reduce-scatter of the way back works on gloo as it is.)
How: only for a gloo group with split sizes: every rank's rows are padded to the largest split,
    equal tensors all-gathered and the padding cut off. The same values as upstream; more bytes
    moved, which only matters off GPUs. Everything else goes to upstream.
Remove when: gloo supports an all_gather of unequal tensors (not in torch 2.13).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "gloo_uneven_gather"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = True
TARGET = "_gather_along_first_dim"
EXPECTED_PARAMS = ("input_", "group", "output_split_sizes", "use_global_buffer")


def _module() -> types.ModuleType:
    from megatron.core.tensor_parallel import mappings

    return mappings


def _gloo(group) -> bool:
    import torch.distributed as dist

    return group.size() > 1 and dist.get_backend(group) == "gloo"


def _wrap_gather(upstream: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(upstream)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or not _gloo(group):
            return upstream(input_, group, output_split_sizes, use_global_buffer)
        import torch
        import torch.distributed as dist

        rows = max(output_split_sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])

    return compat.mark(gather, NAME)


def check_preconditions() -> None:
    compat.require_version(SUPPORTED)
    compat.check_signature(compat.check_attr(_module(), TARGET), EXPECTED_PARAMS)


def is_applied() -> bool:
    return compat.is_marked(getattr(_module(), TARGET), NAME)


def apply() -> None:
    """Wrap the function in the mappings module. Idempotent; CPU (gloo) only."""
    if is_applied():
        return
    compat.require_no_cuda(NAME)
    check_preconditions()
    mappings = _module()
    mappings._gather_along_first_dim = _wrap_gather(mappings._gather_along_first_dim)
    logger.info("applied megatron patch %s", NAME)
