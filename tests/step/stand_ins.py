"""The step's stand-ins (tests/step): a small rollout batch with valid route records, and a
learner with known log-probs that records every pass it is asked for."""

from __future__ import annotations

import dataclasses

import torch

from moe_rl.learner.learner import LogprobOutput, UpdateOutput
from moe_rl.routing.agreement import RoutingOutcome
from moe_rl.routing.record import RouteBatch, RouteHeader
from moe_rl.routing.replay_plan import PassPlan
from moe_rl.types import RolloutBatch, TokenStats, TrainBatch
from tests.models import MICRO_MOE as MODEL

HEADER = RouteHeader.for_model(MODEL)
OLD_LOGP = -0.5  # the stand-in learner's log-prob of every token
ROLLOUT_LOGP = -0.75


def small_rollout() -> RolloutBatch:
    """2 prompts x 2 samples; prompt 2 tokens, responses of 3, 1, 2, 2 tokens; S = 5."""
    prompt_B, resp_B = torch.full((4,), 2), torch.tensor([3, 1, 2, 2])
    pos_S = torch.arange(5)
    mask_BS = (pos_S >= 2) & (pos_S < (prompt_B + resp_B)[:, None])
    tokens_BS = torch.where(pos_S < (prompt_B + resp_B)[:, None], pos_S + 3, 0)
    routes = []
    for b in range(4):  # valid records: distinct ids, T - 1 rows
        rows = int(prompt_B[b] + resp_B[b]) - 1
        ids_TLK = torch.stack([torch.tensor([(r + b) % 4, (r + b + 1) % 4]) for r in range(rows)])
        routes.append(
            ids_TLK[:, None, :].expand(rows, len(HEADER.layer_ids), 2).to(HEADER.dtype).contiguous()
        )
    return RolloutBatch(
        tokens_BS,
        prompt_B,
        resp_B,
        mask_BS,
        torch.where(mask_BS, ROLLOUT_LOGP, 0.0),
        routes,
        torch.tensor([0, 0, 1, 1]),
        torch.tensor([True, False, True, True]),
    )


class StandInLearner:
    """Records every pass; log-probs OLD_LOGP everywhere; an R2-style record of its own."""

    route_header = HEADER
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.dims = dataclasses.make_dataclass("Dims", [("dp_group", object, None)])()
        self.passes: list[tuple[str, TrainBatch, PassPlan | None]] = []
        self.losses: list = []
        self.recorded = RouteBatch(
            torch.zeros(0, len(HEADER.layer_ids), 2, dtype=HEADER.dtype),
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int64),
            torch.full((4,), 2),
            HEADER,
        )

    def forward_logprobs(self, batch, temperature, micro_batch_size, plan=None, reference=False):
        self.passes.append(("ref" if reference else "old", batch, plan))
        full = torch.full(batch.tokens_BS.shape, OLD_LOGP)
        stats = TokenStats(full, torch.full_like(full, 0.25), torch.full_like(full, 0.5))
        recorded = self.recorded if plan is not None and plan.records else None
        return LogprobOutput(stats, RoutingOutcome({}, recorded))

    def update(self, batch, loss_fn, temperature, micro_batch_size, lr, plan=None):
        self.passes.append(("update", batch, plan))
        self.losses.append(loss_fn)
        odd = len(self.passes) % 2
        return UpdateOutput(0.0 if odd else 4.0, [], RoutingOutcome(), skipped=bool(odd))

    def router_monitor_metrics(self):
        return {}
