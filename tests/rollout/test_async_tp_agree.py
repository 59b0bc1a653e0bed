"""rollout.mode=async with an engine of 2 TP ranks (vLLM TP > 1) on 3 gloo ranks (``init_placement``:
a learner stand-in, then the two rollout ranks of one engine): each rollout rank receives the
learner's syncs in its own thread (``BackgroundWeights``), and the two shards must take every update
at the same engine step. Rank 2's receive is held back 0.2 s after each sync arrives, so for about
40 polls rank 1 has an update staged that rank 2 has not; both still hand out the same versions at
the same polls (``BackgroundWeights.group``: min == max over the group), and every version is
handed out, in order, once. Each poll here stands for one engine step (the ranks poll in lockstep,
as vLLM's TP ranks run one schedule)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from tests.dist_harness import run_ranks

LAST = 3  # syncs 1..3 after the first weights (update 0)
HOLD_S = 0.2  # rank 2 stages each sync this late


def _rollout(place, rank: int) -> list[tuple[int, int]]:
    import torch.distributed as dist

    from moe_rl.pipeline.weight_sync import BackgroundWeights

    src = BackgroundWeights(place.sync, 0, LAST, group=dist.group.WORLD)  # the rollout ranks' world
    if rank == 2:
        receive = src.pending.receive

        def late(group, expect=None, sliced=False):  # the sync is here; rank 2 stages it HOLD_S later
            got = receive(group, expect, sliced)
            staged = src.pending.take()
            time.sleep(HOLD_S)
            with src.pending._lock:
                src.pending._staged = staged
            return got

        src.pending.receive = late
    handed: list[tuple[int, int]] = []
    polls = 0
    while not src.final:
        update = src.poll()  # a collective over the two rollout ranks
        if update is not None:
            handed.append((polls, update[0]))
            carried = int(update[1]["w"].item())  # the update number the learner sent
            if carried != update[0] - 1:
                raise AssertionError(f"poll {polls}: version {update[0]} carried update {carried}")
        polls += 1
        time.sleep(0.005)
    return handed


def _worker(rank: int):
    from moe_rl.pipeline.placement import init_placement
    from moe_rl.pipeline.weight_broadcast import broadcast_weights

    place = init_placement(3, 2, "gloo", datetime.timedelta(seconds=120))
    if rank > 0:
        return _rollout(place, rank)
    for u in range(1, LAST + 1):
        time.sleep(0.5)  # the rollout ranks poll in between: each sync lands at its own poll
        broadcast_weights([{"w": torch.tensor([float(u)])}], place.sync, u)
    return []


@pytest.mark.dist
def test_the_ranks_of_a_tp_engine_take_each_update_at_the_same_poll():
    _, first, second = run_ranks(_worker, 3)
    assert first == second, (first, second)
    assert [v for _, v in first] == [2, 3, 4]  # update u is weight version u + 1, each once
    assert all(a < b for (a, _), (b, _) in zip(first, first[1:]))
