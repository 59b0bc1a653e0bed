"""Let a per-layer controller serve megatron-core's routing replay.

Target: megatron.core.transformer.moe.router_replay.RouterReplay.get_replay_topk (called by
    moe_utils.topk_routing_with_score_function for every MoE router when
    ``TransformerConfig.moe_enable_routing_replay`` is set).
Why: upstream replays whole index tensors under one class-level action. moe-rl needs, per
    layer and micro-batch: native routing for rows that have no recorded route (the last
    token), the native Top-K from the same forward to measure routing agreement, a check that
    each route is consumed exactly once (stale data raises), and per-model control (a reference
    model's routers must not share the policy's state). Upstream has no such seam.
How: a RouterReplay instance that carries a controller in ``moe_rl_controller`` delegates to
    ``controller(scores, topk, compute_native)``, where ``compute_native(scores)`` is upstream's
    own top-k; every other instance runs upstream unchanged. Gate values stay
    ``scores.gather(1, indices)`` as upstream computes them, so the router keeps its gradient.
Remove when: upstream offers partial replay with native fallback and consumption accounting.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "router_replay_hook"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = False
KIND = "routing-replay seam on CPU and GPU"
EXPECTED_PARAMS = ("self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk")
ATTR = "moe_rl_controller"


def _cls() -> type:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def check_preconditions() -> None:
    compat.require_version(SUPPORTED)
    cls = _cls()
    compat.check_signature(compat.check_attr(cls, "get_replay_topk"), EXPECTED_PARAMS)
    from megatron.core.transformer.moe import moe_utils

    fn = compat.check_attr(moe_utils, "topk_routing_with_score_function")
    import inspect

    if "router_replay" not in inspect.signature(fn).parameters:
        raise compat.PatchError("topk_routing_with_score_function no longer takes router_replay")


def _wrap(upstream: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(upstream)
    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        controller = getattr(self, ATTR, None)
        if controller is None:
            return upstream(self, scores, topk, num_groups, group_topk, default_compute_topk)

        def compute_native(s):
            return default_compute_topk(s, topk, num_groups=num_groups, group_topk=group_topk)

        return controller(scores, topk, compute_native)

    return compat.mark(get_replay_topk, NAME)


def is_applied() -> bool:
    return compat.is_marked(_cls().get_replay_topk, NAME)


def apply() -> None:
    """Wrap RouterReplay.get_replay_topk. Idempotent; harmless for instances without a controller."""
    if is_applied():
        return
    check_preconditions()
    cls = _cls()
    cls.get_replay_topk = _wrap(cls.get_replay_topk)
    logger.info("applied megatron patch %s", NAME)
