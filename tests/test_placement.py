"""The split world's arithmetic (``Split``: roles, ranks, which rollout rank serves which learner dp
rank) and its groups over real spawned ranks (gloo): the bridge's object send/recv and all-gather,
and the versioned weight broadcast over the sync group (docs/design.md 15)."""

from __future__ import annotations

import datetime

import pytest
import torch

from moe_rl.pipeline.placement import LEARNER, ROLLOUT, Split, exchange_dp_ranks, init_placement
from moe_rl.pipeline.weight_broadcast import broadcast_weights, receive_weights
from tests.dist_harness import run_ranks


@pytest.mark.unit
def test_split_roles_ranks_and_servers():
    s = Split(nproc=6, rollout_ranks=2)
    assert (s.learners, s.rollouts, s.sync_members) == ((0, 1, 2, 3), (4, 5), (0, 4, 5))
    assert [s.role(r) for r in range(6)] == [LEARNER] * 4 + [ROLLOUT] * 2
    assert [s.role_rank(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    # dp rank d is served by engine d % engines (its first rank)
    assert [s.server(d) for d in range(4)] == [4, 5, 4, 5]
    assert (s.engines(2), [s.server(d, engine_tp=2) for d in range(4)]) == (1, [4, 4, 4, 4])
    assert Split(3, 0).rollouts == () and Split(3, 0).learners == (0, 1, 2)


CHUNKS = [
    {"embed": torch.arange(12, dtype=torch.float32).reshape(3, 4)},
    {
        "layer.w": torch.linspace(-1, 1, 10).to(torch.bfloat16),
        "layer.b": torch.tensor([7], dtype=torch.int64),
    },
]


def _worker(rank: int) -> dict:
    """3 ranks: learners 0 and 1 (dp ranks 0 and 1), rollout rank 2."""
    p = init_placement(3, 1, "gloo", datetime.timedelta(seconds=60))
    dp_of = exchange_dp_ranks(p.bridge, -1 if p.is_rollout else rank)
    out = {"role": p.role, "dp_of": dp_of, "sync": p.sync is not None}
    if p.is_rollout:  # a batch-like object to each learner, then two weight syncs received
        works = [
            w for dst in (0, 1) for w in p.bridge.send_object({"to": dst, "t": torch.ones(dst + 1)}, dst, 1)
        ]
        got = []
        for _ in range(2):
            version, chunks = receive_weights(p.sync)
            got.append((version, [{n: (t.dtype, t.tolist()) for n, t in c.items()} for c in chunks]))
        for w in works:
            w.wait()
        out["weights"] = got
    else:
        msg = p.bridge.recv_object(2, 1)
        out["msg"] = (msg["to"], msg["t"].tolist())
        if p.sync is not None:  # learner rank 0 is the broadcast's root
            broadcast_weights(iter(CHUNKS), p.sync, 5)
            broadcast_weights(iter(CHUNKS[1:]), p.sync, 6)
    p.bridge.barrier()
    return out


@pytest.mark.dist
def test_bridge_objects_and_the_versioned_weight_broadcast():
    r0, r1, r2 = run_ranks(_worker, 3)
    assert [r["role"] for r in (r0, r1, r2)] == [LEARNER, LEARNER, ROLLOUT]
    assert r0["dp_of"] == r1["dp_of"] == r2["dp_of"] == [0, 1, -1]
    assert (r0["sync"], r1["sync"], r2["sync"]) == (True, False, True)
    assert r0["msg"] == (0, [1.0]) and r1["msg"] == (1, [1.0, 1.0])
    want = [{n: (t.dtype, t.tolist()) for n, t in c.items()} for c in CHUNKS]
    assert r2["weights"] == [(5, want), (6, want[1:])]  # exact values, dtypes kept, chunk by chunk
