"""unit tier, issue 44 point 5: the route verifier on the real built-in engine (prefix cache on).
A clean multi-turn rollout verifies with no mismatch; each way of breaking the stitching is caught,
in the turn it broke: a row dropped at a turn boundary (off by one), an earlier turn's rows replaced
by those of a re-rendered turn, and a prefix-cache block of other weights whose rows claim the
current version. A stale block whose provenance is honest is not compared but counted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.config.route_verify import verify_every
from moe_rl.health import HealthMonitor
from moe_rl.maths.versions import route_turn_BS
from moe_rl.metrics import reduce_metrics
from moe_rl.rollout.prefix_cache import PrefixCachedEngine
from moe_rl.routing.provenance import NONE, PREFIX_HIT
from moe_rl.routing.record import missing_id
from moe_rl.routing.verify import VerifyPlan, verify_batch
from moe_rl.step.plan import sampling_params
from moe_rl.tasks.task import build_task
from moe_rl.weights.warmstart import load_init_weights

pytestmark = pytest.mark.unit
BLOCK = 4
TURNS = 3


@pytest.fixture(scope="module")
def run():
    cfg = load_config(None, ["agent.env=calculator", "rollout.max_new_tokens=12", f"agent.max_turns={TURNS}"])
    cfg, task = build_task(cfg, start_pool=False)
    weights = load_init_weights(cfg.init_weights, cfg.model, task.tokenizer)
    engine = PrefixCachedEngine(
        cfg.model, max_blocks=1000, block_tokens=BLOCK, dtype="fp32", pad_id=task.tokenizer.pad_id
    )
    engine.load_weights(weights)
    prompts = task.source.sample_step(0, 2, 0, 1, 7)
    sampling = sampling_params(cfg, task.tokenizer.eos_ids)
    batch = task.agent.rollout(engine, prompts, 3, sampling, 11)
    plan = VerifyPlan(1, batch.num_seqs, 0.0, tuple(cfg.model.moe_layers), TURNS)  # every sample, no margin
    return cfg, task, engine, weights, prompts, sampling, batch, plan


def _values(metrics: dict) -> dict[str, float]:
    return reduce_metrics(metrics)  # as the step reduces them (one process: no group)


def _with_routes(batch, new_routes):
    return dataclasses.replace(batch, routes=new_routes)


def test_a_clean_stitched_trace_equals_the_full_prefill(run):
    cfg, _, engine, _, _, _, batch, plan = run
    assert int(batch.turn_BS.max()) >= 2 and engine.prefix.hit_blocks > 0  # turns 2+ read the cache
    v = _values(verify_batch(engine, batch, plan, seed=0))
    rows = sum(r.shape[0] for r in batch.routes)
    none = sum(int((p.source_N == NONE).sum()) for p in batch.route_prov)
    assert v["routing/verify_mismatch_frac"] == 0.0
    assert v["routing/verify_rows_compared"] == rows - none and v["routing/verify_rows_no_route"] == none
    assert v["routing/verify_rows_other_version"] == 0.0 and v["routing/verify_samples"] == batch.num_seqs
    assert all(v[f"routing/verify_mismatch_frac/turn{k}"] == 0.0 for k in (1, 2))
    # the run's default: on, every 10 steps, for an agent run on the built-in engine
    assert verify_every(cfg) == 10


def test_route_turns_from_the_batch_are_the_provenance_turns(run):
    # the flips by turn bucket rows by route_turn_BS (vLLM's records carry no provenance)
    batch = run[6]
    T_B = batch.prompt_lens_B + batch.response_lens_B
    turn_BS = route_turn_BS(batch.turn_BS, batch.response_mask_BS, T_B)
    for b, p in enumerate(batch.route_prov):
        has_N = p.source_N != NONE
        assert torch.equal(turn_BS[b, : p.num_rows][has_N], p.turn_N.long()[has_N])
    assert int(turn_BS.max()) >= 2


def test_full_return_compares_prefix_hit_rows_too(run):
    # append-only keeps no hit row (it had them all); full return re-takes every row, hits included
    _, task, engine, _, prompts, sampling, _, plan = run
    task.agent.route_return = "full"
    try:
        batch = task.agent.rollout(engine, prompts, 3, sampling, 11)
    finally:
        task.agent.route_return = "append"
    hits = sum(int((p.source_N == PREFIX_HIT).sum()) for p in batch.route_prov)
    v = _values(verify_batch(engine, batch, plan, seed=0))
    assert hits > 0 and v["routing/verify_mismatch_frac"] == 0.0
    assert v["routing/verify_rows_compared"] == sum(int((p.source_N != NONE).sum()) for p in batch.route_prov)


def test_a_row_dropped_at_a_turn_boundary_is_caught_from_that_turn_on(run):
    _, _, engine, _, _, _, batch, plan = run
    broken = []
    for r, p in zip(batch.routes, batch.route_prov):  # the first row turn 2 sent is lost: the rest shift
        t2 = (p.turn_N == 2).nonzero()
        if not len(t2):
            broken.append(r)
            continue
        a = int(t2[0])
        broken.append(torch.cat([r[:a], r[a + 1 :], r.new_full((1, *r.shape[1:]), missing_id(r.dtype))]))
    v = _values(verify_batch(engine, _with_routes(batch, broken), plan, seed=0))
    assert v["routing/verify_mismatch_frac/turn1"] == 0.0
    assert v["routing/verify_mismatch_frac/turn2"] > 0.3
    assert v["routing/verify_mismatch_frac"] > 0.1
    (event,) = HealthMonitor(cfg_health(), 50, verify_alarm_frac=0.01).observe(7, v)
    assert event["alarm"] == "route_verify" and "worst turn " in event["cause"]
    assert "worst turn 1 " not in event["cause"]


def test_an_earlier_turn_replaced_by_a_rerendered_one_is_caught_in_that_turn(run):
    _, _, engine, _, _, _, batch, plan = run
    broken = []
    for i, (r, p) in enumerate(zip(batch.routes, batch.route_prov)):
        # the routes of a re-rendered turn 1 (its sampled tokens reversed), pasted over turn 1's rows
        T = int(batch.prompt_lens_B[i] + batch.response_lens_B[i])
        seq = batch.tokens_BS[i, :T].clone()
        m = batch.response_mask_BS[i, :T] & (batch.turn_BS[i, :T] == 1)
        seq[m] = seq[m].flip(0)
        other, _ = engine.prefill_routes([seq.tolist()])
        rows = (p.turn_N == 1) & (torch.arange(r.shape[0]) >= int(batch.prompt_lens_B[i]))
        r = r.clone()
        r[rows] = other[0, : r.shape[0]][rows].to(r.dtype)
        broken.append(r)
    v = _values(verify_batch(engine, _with_routes(batch, broken), plan, seed=0))
    assert v["routing/verify_mismatch_frac/turn1"] > 0.05
    assert v["routing/verify_mismatch_frac/turn2"] == 0.0 == v["routing/verify_mismatch_frac/turn3"] or (
        v["routing/verify_mismatch_frac/turn3"] != v["routing/verify_mismatch_frac/turn3"]  # NaN: no turn 3
    )
    (event,) = HealthMonitor(cfg_health(), 50, verify_alarm_frac=0.01).observe(3, v)
    assert "worst turn 1 (" in event["cause"]


def cfg_health():
    return load_config(None, []).log.health


class StaleCacheEngine(PrefixCachedEngine):
    """Broken on purpose: a weight load keeps the cached blocks; ``restamp``: and stamps their rows
    with the new version (a restored cache that claims the current weights)."""

    restamp = True

    def load_weights(self, weights, version=None):
        blocks = dict(self.prefix.blocks)
        out = super().load_weights(weights, version)
        self.prefix.blocks.update(blocks)
        if self.restamp:
            for b in blocks.values():
                b.version_T.fill_(self.version)
        return out


@pytest.mark.parametrize("restamp", [True, False])
def test_a_cached_block_of_other_weights(run, restamp):
    cfg, task, _, weights, prompts, sampling, _, plan = run
    engine = StaleCacheEngine(
        cfg.model, max_blocks=1000, block_tokens=BLOCK, dtype="fp32", pad_id=task.tokenizer.pad_id
    )
    engine.restamp = restamp
    engine.load_weights(weights)
    engine.generate([p.prompt_ids for p in prompts], 1, sampling, seed=11)  # fills the cache at version 1
    perm = torch.randperm(cfg.model.num_experts, generator=torch.Generator().manual_seed(0))
    w2 = {k: (v[perm] if k.endswith("mlp.gate.weight") else v) for k, v in weights.items()}
    engine.load_weights(w2)  # version 2: routers' rows permuted, so every route differs
    batch = task.agent.rollout(engine, prompts, 3, sampling, 11)  # turn 1's prompts hit the old blocks
    v = _values(verify_batch(engine, batch, plan, seed=0))
    hit_rows = sum(int((p.source_N == PREFIX_HIT).sum()) for p in batch.route_prov)
    assert hit_rows > 0
    if restamp:  # the rows lie about their version: compared, and they differ
        assert v["routing/verify_mismatch_frac/turn1"] > 0.3 and v["routing/verify_rows_other_version"] == 0
    else:  # honest provenance: those rows are of version 1, not compared, counted; the rows computed
        # after them attended to the old weights' KV of the same blocks, and differ: caught there
        assert v["routing/verify_rows_other_version"] == hit_rows
        present = sum(int((p.source_N != NONE).sum()) for p in batch.route_prov)
        assert v["routing/verify_rows_compared"] == present - hit_rows
        assert v["routing/verify_mismatch_frac/turn1"] > 0.01
