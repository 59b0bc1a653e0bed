"""rollout.mode=async, the learner side (moe_rl/pipeline/request_buffer.py): which request a step
trains on (the first the staleness filter keeps whole), what is dropped and counted, where it
gives up; the buffer bound and the checkpoint schedule both roles share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_rl.metrics import reduce_metrics
from moe_rl.pipeline.request_buffer import StaleRequests, buffer_bound, checkpoint_due, drop_limit, take_fresh

pytestmark = pytest.mark.unit


def request(name: str, versions: list[list[int]], groups: list[int]) -> SimpleNamespace:
    """A request whose sequence b has one prompt position (version 0) then ``versions[b]``."""
    v_BS = torch.tensor([[0, *v] for v in versions], dtype=torch.int32)
    batch = SimpleNamespace(
        version_BS=v_BS,
        response_mask_BS=v_BS > 0,
        group_B=torch.tensor(groups),
        num_seqs=len(versions),
    )
    return SimpleNamespace(name=name, batch=batch)


# learner version 5, max_staleness 1: lag = 5 - version, a token of version 3 is 2 stale
A = request("A", [[5, 5], [5, 5], [4, 5], [3, 4]], [0, 0, 1, 1])  # group 1 has a stale token
B = request("B", [[3, 3], [3, 4], [3, 3], [3, 3]], [0, 0, 1, 1])  # all stale
C = request("C", [[4, 4], [4, 5], [5, 5], [5, 5]], [0, 0, 1, 1])  # lags 0 and 1
D = request("D", [[5, 5], [5, 5], [5, 5], [5, 5]], [0, 0, 1, 1])


def stream(*reqs):
    it, taken = iter(reqs), []

    def receive():
        r = next(it)
        taken.append(r.name)
        return r

    return receive, taken


def test_a_request_with_any_stale_group_is_dropped_whole_and_counted():
    receive, taken = stream(A, B, C, D)
    msg, metrics = take_fresh(receive, learner_version=5, max_staleness=1, limit=3)
    assert msg is C and taken == ["A", "B", "C"]  # D stays in the buffer for the next step
    assert reduce_metrics(metrics) == {
        "rollout/dropped_stale": 8.0,  # A's fresh group 0 goes with its stale group 1
        "rollout/dropped_stale_batches": 2.0,
        "rollout/dropped_stale_frac": 8 / 12,
    }


def test_max_staleness_zero_drops_every_token_behind_the_learner():
    receive, taken = stream(C, A, D)
    msg, metrics = take_fresh(receive, learner_version=5, max_staleness=0, limit=3)
    assert msg is D and taken == ["C", "A", "D"]
    assert reduce_metrics(metrics)["rollout/dropped_stale"] == 8.0
    receive, _ = stream(D)
    _, metrics = take_fresh(receive, learner_version=5, max_staleness=0, limit=0)
    assert reduce_metrics(metrics) == {
        "rollout/dropped_stale": 0.0,
        "rollout/dropped_stale_batches": 0.0,
        "rollout/dropped_stale_frac": 0.0,
    }


def test_more_stale_requests_than_the_limit_fail_with_one_line():
    receive, taken = stream(A, B, C)
    with pytest.raises(StaleRequests) as e:
        take_fresh(receive, learner_version=5, max_staleness=1, limit=1, dp_rank=1)
    assert str(e.value) == (
        "rollout.max_staleness=1: data-parallel rank 1 dropped 2 stale requests in a row at learner "
        "version 5 (at most 1 can predate its last sync)"
    )
    assert taken == ["A", "B"]


def test_buffer_bound_drop_limit_and_checkpoint_schedule():
    assert [buffer_bound(m) for m in (0, 1, 3)] == [1, 1, 3]
    assert drop_limit(1) == 3 and drop_limit(1, queued=3) == 6
    # checkpoint_every=2 over 5 steps: after steps 1 and 3, and after the last (4); 0: the last only
    assert [s for s in range(5) if checkpoint_due(s, 2, 5)] == [1, 3, 4]
    assert [s for s in range(5) if checkpoint_due(s, 0, 5)] == [4]
