"""Dynamic sampling on rollout ranks (issue 46, ``Schedule.rounds_on_request``): the learner's
``RemoteEngine`` asks for each generation round by its data index and tells the rollout rank when
the step's rounds end; one_step_off asks there for the next step's first round (the next data
index) instead of asking for it at that step, also when a resume restored it from the checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_rl.config import Schedule, ScheduleKind
from moe_rl.pipeline.placement import Placement, Split
from moe_rl.pipeline.remote_engine import ROUND_TAG, RemoteEngine, RolloutMessage, RoundRequest
from moe_rl.pipeline.rollout_ranks import _Server
from moe_rl.types import RolloutBatch

pytestmark = pytest.mark.unit


class Bridge:
    """Learner rank 0 <-> rollout rank 1 in one process: what the learner sent (its tag, object)
    and a rollout rank that answers each ``RoundRequest`` with a batch of its index."""

    def __init__(self) -> None:
        self.members, self.sent, self.queue = (0, 1), [], []

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t, torch.tensor([-1])]

    def send_object(self, obj, dst: int, tag: int) -> list:
        self.sent.append((tag, obj))
        if obj.index is not None:
            self.queue.append(message(obj.index))
        return [SimpleNamespace(wait=lambda: None)]

    def recv_object(self, src: int, tag: int):
        return self.queue.pop(0)


def message(index: int, version: int = 0) -> RolloutMessage:
    batch = RolloutBatch(
        tokens_BS=torch.ones(1, 3, dtype=torch.long),
        prompt_lens_B=torch.tensor([1]),
        response_lens_B=torch.tensor([2]),
        response_mask_BS=torch.tensor([[False, True, True]]),
        logprobs_BS=torch.zeros(1, 3),
        routes=[torch.zeros(2, 1, 1, dtype=torch.uint8)],
        group_B=torch.tensor([0]),
        finished_B=torch.tensor([True]),
    )
    return RolloutMessage(index, 0, 100 + index, [[index]], 1, version, batch, {})


def learner(kind: ScheduleKind) -> tuple[RemoteEngine, Bridge]:
    bridge = Bridge()
    dims = SimpleNamespace(placement=Placement(Split(2, 1), 0, bridge), dp_rank=0)
    return RemoteEngine(dims, Schedule(kind, dynamic_rounds=True)), bridge


def step(engine: RemoteEngine, cursor: int, rounds: int) -> list[int]:
    """A step's rounds from data index ``cursor`` on, as the trainer runs them: the indices trained."""
    got = []
    for k in range(rounds):
        index = engine.request_for(7, cursor + k)
        batch = engine.generate([[index]], 1, None, seed=100 + index)
        assert batch.version_BS[0, 1:].tolist() == [1, 1]  # stamped: W_0's tokens (the message's version)
        got.append(index)
    engine.end_rounds(cursor + rounds)
    engine.synced()
    return got


def asked(bridge: Bridge) -> list[tuple[int | None, bool]]:
    out = [(r.index, r.then_sync) for tag, r in bridge.sent if tag == ROUND_TAG]
    bridge.sent.clear()
    return out


def test_split_sync_asks_for_every_round_then_the_sync():
    engine, bridge = learner(ScheduleKind.SPLIT_SYNC)
    assert step(engine, 0, 2) == [0, 1] and asked(bridge) == [(0, False), (1, False), (None, True)]
    assert step(engine, 2, 1) == [2] and asked(bridge) == [(2, False), (None, True)]


def test_one_step_off_asks_for_the_next_steps_first_round_with_the_sync():
    engine, bridge = learner(ScheduleKind.ONE_STEP_OFF)
    # a new run: step 0's first round is asked for; the next step's (data index 3) comes ahead
    assert step(engine, 0, 3) == [0, 1, 2] and asked(bridge) == [
        (0, False),
        (1, False),
        (2, False),
        (3, True),
    ]
    assert step(engine, 3, 2) == [3, 4] and asked(bridge) == [(4, False), (5, True)]
    assert step(engine, 5, 1) == [5] and asked(bridge) == [(6, True)]
    # a resume: the checkpoint's batch in flight is the first round (the rollout rank asked for none)
    engine, bridge = learner(ScheduleKind.ONE_STEP_OFF)
    engine.resume(4, message(9))
    assert step(engine, 9, 2) == [9, 10] and asked(bridge) == [(10, False), (11, True)]
    # a round that is not the one the step trains (here the batch generated ahead is index 11,
    # the step's cursor says 12) is refused, naming both
    engine.request_for(7, 12)
    with pytest.raises(
        RuntimeError, match="got step 11, dp rank 0, seed 111, n 1; expected step 12, seed 112"
    ):
        engine.generate([[12]], 1, None, seed=112)


def test_a_round_request_is_one_hashable_value():
    # the rollout rank checks that every learner rank it serves asked for the same round
    assert len({RoundRequest(3), RoundRequest(3), RoundRequest(3, then_sync=True)}) == 2


def test_over_sampling_asks_each_round_with_the_groups_still_wanted():
    # algo.over_sampling (split sync / one_step_off): the rollout rank's round aborts once the dp
    # rank has `want` groups; one_step_off's next-step round wants a whole step's
    for kind, ahead_want in ((ScheduleKind.SPLIT_SYNC, 0), (ScheduleKind.ONE_STEP_OFF, 4)):
        engine, bridge = learner(kind)
        for index, want in ((0, 4), (1, 3)):
            assert engine.request_for(7, index, want=want, pending={"prompts": [index]}) == index
            engine.generate([[index]], 1, None, seed=100 + index)
        engine.end_rounds(2, want=4, pending={"prompts": [2]})
        sent = [r for tag, r in bridge.sent if tag == ROUND_TAG]
        assert [(r.index, r.then_sync, r.want) for r in sent] == [
            (0, False, 4),
            (1, False, 3),
            (2 if ahead_want else None, True, ahead_want),
        ]
        # on_abort=partial: each round resumes the pending groups it was sent; the sync's request
        # only when it asks for a round (one_step_off's next-step round)
        assert [r.pending for r in sent] == [
            {"prompts": [0]},
            {"prompts": [1]},
            {"prompts": [2]} if ahead_want else None,
        ]


def test_a_rollout_rank_serving_two_dp_ranks_takes_each_ones_want():
    """``_Server.round_request`` over the requests of 2 dp ranks x 2 learner ranks: one round, each
    dp rank's own ``want``; learner ranks that disagree on the round are refused, naming them."""

    def server(reqs: dict[int, RoundRequest]) -> SimpleNamespace:
        bridge = SimpleNamespace(recv_object=lambda src, tag: reqs[src], send_object=None)
        return SimpleNamespace(
            sends=True, bridge=bridge, served=[0, 1], dests={0: [0, 1], 1: [2, 3]}, peers=[]
        )

    # on_abort=partial: each dp rank's pending groups travel in its request, outside its identity
    same = {r: RoundRequest(5, want=4 if r < 2 else 2, pending={"prompts": [r // 2]}) for r in range(4)}
    req, reqs = _Server.round_request(server(same))
    assert (req.index, req.then_sync) == (5, False)
    assert {d: (q.want, q.pending) for d, q in reqs.items()} == {
        0: (4, {"prompts": [0]}),
        1: (2, {"prompts": [1]}),
    }
    split = {**same, 3: RoundRequest(6, want=2)}
    with pytest.raises(RuntimeError, match="the learner ranks served by one rollout rank ask for different"):
        _Server.round_request(server(split))
    within = {**same, 3: RoundRequest(5, want=1)}  # one dp rank's learner ranks want different counts
    with pytest.raises(RuntimeError, match="ask for different rounds"):
        _Server.round_request(server(within))
