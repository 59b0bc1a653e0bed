"""unit tier, issue 44 point 4: route provenance across turns on the real built-in engine. A weight
update scheduled between turn 1 and turn 2 (``ScheduledUpdates`` at the first poll of turn 2) leaves
turn 1's rows at version 1 (append-only) and stamps the new rows with version 2 and turn 2; the only
row at another version than its token's log-prob is each continuing trajectory's last turn-1 token
(sampled at 1, its row computed by turn 2's prefill at 2), and ``routing.stale_rows`` acts on exactly
those rows."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.maths.versions import check_versions
from moe_rl.pipeline.remote_engine import RolloutMessage
from moe_rl.rollout.base import ScheduledUpdates
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.routing.provenance import COMPUTED, NONE
from moe_rl.routing.record import RouteHeader, missing_id
from moe_rl.step.plan import sampling_params
from moe_rl.step.prepare import rollout_routes, stale_routes
from moe_rl.tasks.task import build_task
from moe_rl.types import with_version
from moe_rl.weights.warmstart import load_init_weights

pytestmark = pytest.mark.unit


class UpdateBeforeTurn:
    """The engine, with an update to ``version`` delivered at the first poll of generate call ``turn``."""

    def __init__(self, engine: BuiltinEngine, turn: int, version: int, weights) -> None:
        self.engine, self.turn, self.update, self.calls = engine, turn, (version, weights), 0

    @property
    def version(self) -> int:
        return self.engine.version

    def prefill_routes(self, seqs):  # the route verifier's prefill (it runs at step 0 by default)
        return self.engine.prefill_routes(seqs)

    def generate(self, prompts, n, sampling, seed):
        self.calls += 1
        updates = ScheduledUpdates({0: self.update}) if self.calls == self.turn else None
        return self.engine.generate(prompts, n, sampling, seed, updates=updates)


@pytest.fixture(scope="module")
def updated_run():
    # the agent warm start's calls take up to 12 tokens: 8 would cut every call and no turn 2 runs
    cfg = load_config(None, ["agent.env=calculator", "rollout.max_new_tokens=12", "agent.max_turns=3"])
    cfg, task = build_task(cfg, start_pool=False)
    engine = BuiltinEngine(cfg.model, pad_id=task.tokenizer.pad_id)
    w1 = load_init_weights(cfg.init_weights, cfg.model, task.tokenizer)
    engine.load_weights(w1)
    g = torch.Generator().manual_seed(3)
    w2 = {
        k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype) * v.float().std().to(v.dtype)
        for k, v in w1.items()
    }
    prompts = task.source.sample_step(0, 2, 0, 1, 7)
    sampling = sampling_params(cfg, task.tokenizer.eos_ids)
    batch = task.agent.rollout(UpdateBeforeTurn(engine, 2, 2, w2), prompts, 3, sampling, 11)
    return cfg, batch


def test_rows_keep_the_version_and_turn_that_computed_them(updated_run):
    cfg, b = updated_run
    T_B = (b.prompt_lens_B + b.response_lens_B).tolist()
    # the verifier ran after the rollout, at version 2: turn 1's rows (version 1) are not compared
    m = b.engine_metrics
    assert float(m["routing/verify_rows_other_version"].value) > 0
    assert float(m["routing/verify_mismatch_frac"].sum) == 0.0
    turn_BS = b.turn_BS.long()
    reached_2 = 0
    for i, prov in enumerate(b.route_prov):
        assert prov.num_rows == b.routes[i].shape[0] == T_B[i] - 1
        assert bool((prov.source_N == COMPUTED).all())  # every row computed by the call that sent it
        # turn 1 sent the rows of positions [0, end1 - 1): the prompt and turn 1's tokens but the last
        # (turn_BS gives the tool reply after turn 1 turn 1 too: end1 counts the sampled ones only)
        end1 = int(b.prompt_lens_B[i] + (b.response_mask_BS[i] & (turn_BS[i] == 1)).sum())
        assert prov.version_N[: end1 - 1].unique().tolist() == [1]
        assert prov.turn_N[: end1 - 1].unique().tolist() == [1]
        if end1 < T_B[i]:  # went on after a tool reply: every later row is version 2, turn >= 2
            reached_2 += 1
            assert prov.version_N[end1 - 1 :].unique().tolist() == [2]
            assert int(prov.turn_N[end1 - 1]) == 2
            assert bool((prov.turn_N[end1 - 1 :] >= 2).all())
            assert bool((b.version_BS[i][b.response_mask_BS[i] & (turn_BS[i] >= 2)] == 2).all())
    assert reached_2 >= 1  # else this test shows nothing about a second turn


@pytest.mark.parametrize("policy", ["replay", "native", "drop_sample"])
def test_stale_rows_policy_on_an_update_between_turns(updated_run, policy):
    cfg, b = updated_run
    header = RouteHeader.for_model(cfg.model)
    T_B = b.prompt_lens_B + b.response_lens_B
    turn_BS = b.turn_BS.long()
    # the expected stale rows: the last turn-1 token of each trajectory that had a turn 2
    end1_B = b.prompt_lens_B + (b.response_mask_BS & (turn_BS == 1)).sum(1)  # turn 1's last token + 1
    went_on_B = end1_B < T_B
    routes = rollout_routes(b, header)
    out, replay, m = stale_routes(b, routes, policy)
    n_stale = int(went_on_B.sum())
    assert n_stale >= 1
    assert m["routing/version_mismatch_rows"].value == float(n_stale)
    missing = missing_id(header.dtype)
    miss_N = (replay.ids_NLK == missing).all(-1).all(-1)
    if policy == "native":
        first_B = routes.first_B
        want = torch.zeros_like(miss_N)
        want[(first_B + end1_B - 1)[went_on_B]] = True
        assert torch.equal(miss_N, want)
    else:
        assert not bool(miss_N.any()) and torch.equal(replay.ids_NLK, routes.ids_NLK)
    if policy == "drop_sample":
        assert m["routing/stale_samples_dropped"].value == float(n_stale)
        assert torch.equal(out.response_mask_BS.any(1), ~went_on_B & b.response_mask_BS.any(1))
        # a dropped sample's tokens are no longer generated ones: version 0, so the batch still
        # passes the version check the old-log-prob pass runs next
        assert torch.equal(out.version_BS, torch.where(out.response_mask_BS, b.version_BS, 0))
        check_versions(out.version_BS, out.response_mask_BS, learner_version=2)
    else:
        assert torch.equal(out.response_mask_BS, b.response_mask_BS)
    assert not bool((routes.prov.source_N == NONE).any())


def test_a_restamped_batch_restamps_its_route_rows(updated_run):
    """A schedule that replaces the engine's own versions (``with_version``: simulated staleness, a
    rollout rank's batch) stamps the route rows too, so none reads as stale; MISSING rows stay 0."""
    cfg, b = updated_run
    r = with_version(dataclasses.replace(b, version_BS=None), 7)
    assert all(p.version_N.unique().tolist() == [7] for p in r.route_prov)
    _, _, m = stale_routes(r, rollout_routes(r, RouteHeader.for_model(cfg.model)), "native")
    assert m["routing/version_mismatch_rows"].value == 0.0


def test_provenance_survives_the_buffer_and_its_checkpoint_pickle(updated_run):
    """The async buffer keeps batches and picks samples with ``select``; a split world and the
    buffer's checkpoint pickle them: the route rows' provenance goes along, sample for sample."""
    _, b = updated_run
    again = pickle.loads(pickle.dumps(b.select(torch.tensor([4, 1]))))
    for mine, theirs in zip(again.route_prov, [b.route_prov[4], b.route_prov[1]]):
        assert all(torch.equal(x, y) for x, y in zip(mine.tensors().values(), theirs.tensors().values()))


def test_provenance_survives_the_async_buffer_checkpoint(updated_run, tmp_path):
    """A buffered batch is checkpointed as plain tensors (``RolloutMessage.state_dict``, read back
    with ``torch.load(weights_only=True)``): the provenance and the agent metrics come back equal
    (async runs the agent loop on its rollout ranks)."""
    _, b = updated_run
    # the loop's agent metrics (Sum, Mean, Max objects) ride along and come back equal
    assert {type(v).__name__ for v in b.engine_metrics.values()} >= {"Sum", "Mean", "Max"}
    msg = RolloutMessage(3, 0, 5, [[1, 2]], 3, 2, b, {"wait_s": 0.5})
    torch.save(msg.state_dict(), tmp_path / "buffer.pt")
    back = RolloutMessage.from_state_dict(torch.load(tmp_path / "buffer.pt", weights_only=True))
    assert back.batch.engine_metrics == b.engine_metrics
    for mine, theirs in zip(back.batch.route_prov, b.route_prov, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(mine.tensors().values(), theirs.tensors().values()))
