"""Breaking what vLLM's worker receives in a weight sync (a helper module, no tests): the checked
sync's faults (``rollout.sync_check``, docs/vllm.md 11), in process (tests/vllm/test_vllm_cpu_turns.py
patches its engine with them) and on a rollout rank of a launched run (tests/bad_input/faults.py's
``stale_vllm`` place, tests/vllm/test_vllm_split.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import torch

Items = list[tuple[str, torch.Tensor]]  # one chunk of sync_chunks: (HF name, tensor) pairs


def corrupting(real: Callable[..., Iterator[Items]], corrupt: Callable[[Items], Items]):
    """``moe_rl.rollout.vllm.engine.sync_chunks`` with ``corrupt(items)`` over each chunk it yields,
    i.e. after the engine's own name and shape checks: what the worker loads is changed."""
    return lambda *a: (corrupt(items) for items in real(*a))


def stale_from_second_load(real: Callable[..., Iterator[Items]], name: str):
    """``sync_chunks`` under which tensor ``name`` keeps, from the engine's second load on, the
    values of its first: a load that left it stale, raising nothing (each load calls
    ``sync_chunks`` once). Where the rank holds a shard the tensor is its ``placed`` full-shape
    one, so the rank's slice is the stale one. The time it is first handed stale (time.time()) is
    written to the file ``MOE_RL_FAULT_STAMP`` names, when set (tests/bad_input/faults.py)."""
    loads: list[int] = []
    first: dict[str, torch.Tensor] = {}

    def keep(items: Items) -> Items:
        out = []
        for k, t in items:
            if k == name and len(loads) == 1:
                first[k] = t.detach().clone()
            stale = k == name and len(loads) > 1
            if stale and (stamp := os.environ.get("MOE_RL_FAULT_STAMP")) and not os.path.exists(stamp):
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
            out.append((k, first[k] if stale else t))
        return out

    def sync_chunks(*a):
        loads.append(1)
        return corrupting(real, keep)(*a)

    return sync_chunks
