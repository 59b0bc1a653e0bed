"""The engine a rank's step talks to, by the schedule: its own (colocated: built-in or vLLM,
``moe_rl/rollout/factory.py``) or, on a learner rank of a split world, the ``RemoteEngine`` that
stands in for the rollout ranks' engines. Started by the offload timeline."""

from __future__ import annotations

import torch

from moe_rl.config import RunConfig, Schedule
from moe_rl.pipeline.remote_engine import RemoteEngine
from moe_rl.rollout.factory import build_engine, engine_tp


def build_rank_engine(cfg: RunConfig, schedule: Schedule, pad_id: int, device: torch.device | str, dims):
    """The learner rank's engine (not yet started)."""
    if schedule.split:
        return RemoteEngine(dims, schedule, engine_tp(cfg))
    return build_engine(cfg, pad_id, device, dims)
