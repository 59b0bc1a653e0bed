"""rollout.mode=async on 2 gloo ranks (a learner stand-in and a rollout rank, ``init_placement``):
``BackgroundWeights`` receives the learner's syncs in a thread while the engine decodes, and a sync
that arrives mid-generation is applied between two decode steps, so the tokens after it carry the
new version. The rollout rank signals the learner at its 4th poll (over the bridge) and waits there
until the sync is staged, so the update lands before forward 3 whatever the timing; the batch must
equal, bit for bit, one generated with the same update scheduled at poll 3 (``ScheduledUpdates``).
The learner sends the next sync only after that call ends (a second signal): sent earlier, it could
land in the same call under load, at a poll that depends on timing."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.models import TINY_MOE_L3 as MODEL
from tests.rollout.rank_results import packed, unpacked

PROMPTS = [[3, 1, 4, 1, 5], [9, 2]]
AT = 3  # the poll (= forward) the update lands before
SEEDS = {0: 11, 1: 22, 2: 33}  # update u: random weights of this seed


def _weights(u: int) -> dict[str, torch.Tensor]:
    from moe_rl.weights.canonical import random_canonical_weights

    return random_canonical_weights(MODEL, seed=SEEDS[u])


class _Gate:
    """Delegates every poll; at poll AT first tells the learner to sync and waits until it is staged."""

    def __init__(self, src, bridge) -> None:
        self.src, self.bridge, self.polls = src, bridge, 0

    def poll(self):
        if self.polls == AT:
            self.bridge.send(torch.ones(1), 0)
            while self.src.staged is None:
                self.src.tick()
                time.sleep(0.002)
        self.polls += 1
        return self.src.poll()


def _rollout(place) -> dict:
    from moe_rl.maths.versions import weight_version
    from moe_rl.pipeline.weight_broadcast import receive_weights
    from moe_rl.pipeline.weight_sync import BackgroundWeights
    from moe_rl.rollout.base import ScheduledUpdates
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.types import SamplingParams

    sampling = SamplingParams(max_new_tokens=8)
    engine = BuiltinEngine(MODEL, dtype="fp32", pad_id=0)
    u, chunks = receive_weights(place.sync)
    engine.load_weights(chunks, version=weight_version(u))
    src = BackgroundWeights(place.sync, u, last=2)
    batch = engine.generate(PROMPTS, 2, sampling, seed=5, updates=_Gate(src, place.bridge))
    place.bridge.send(torch.ones(1), 0)  # generated: only now may the next sync come (else it races)
    out = {
        "first": u,
        "applied_mid": src.applied,
        "version_BS": batch.version_BS,
        "mask_BS": batch.response_mask_BS,
    }
    ref = BuiltinEngine(MODEL, dtype="fp32", pad_id=0)
    ref.load_weights(_weights(0), version=1)
    expect = ref.generate(PROMPTS, 2, sampling, seed=5, updates=ScheduledUpdates({AT: (2, _weights(1))}))
    out["same"] = all(
        torch.equal(getattr(batch, f), getattr(expect, f))
        for f in ("tokens_BS", "logprobs_BS", "version_BS", "response_mask_BS")
    )
    while src.staged is None and not src.final:  # the final sync, then nothing more is received
        src.tick()
        time.sleep(0.002)
    last = engine.generate(PROMPTS, 2, sampling, seed=6, updates=src)
    out["final"], out["receiving"] = src.final, src.thread.is_alive()
    out["last_versions"] = sorted(set(last.version_BS[last.response_mask_BS].tolist()))
    return out


def _worker(rank: int):
    from moe_rl.pipeline.placement import init_placement
    from moe_rl.pipeline.weight_broadcast import broadcast_weights

    place = init_placement(2, 1, "gloo", datetime.timedelta(seconds=120))
    if rank == 1:
        return packed(_rollout(place))
    broadcast_weights([_weights(0)], place.sync, 0)
    place.bridge.recv(torch.empty(1), 1)  # the rollout rank is at poll AT, mid-generation
    broadcast_weights([_weights(1)], place.sync, 1)
    place.bridge.recv(torch.empty(1), 1)  # that generate call is over
    broadcast_weights([_weights(2)], place.sync, 2)
    return packed({})


@pytest.mark.dist
def test_a_sync_received_in_the_background_lands_between_decode_steps():
    _, r = [unpacked(x) for x in run_ranks(_worker, 2)]
    assert r["first"] == 0 and r["applied_mid"] == 1
    assert r["same"]  # tokens, log-probs, versions: as with the update scheduled at poll AT
    gen_G = r["version_BS"][r["mask_BS"]].reshape(4, -1)  # no stop tokens: 8 generated each
    assert gen_G.shape == (4, 8)
    assert (gen_G[:, :AT] == 1).all() and (gen_G[:, AT:] == 2).all()  # W_0 is version 1, W_1 version 2
    assert r["final"] and not r["receiving"] and r["last_versions"] == [3]
