"""unit tier: the typed batch, the replay plan, the step's stages (moe_rl/step/prepare.py,
update.py) and the update loop's split, on closed-form inputs. The learner here is a stand-in with
known log-probs (the real megatron learner is tested in tests/learner and end to end); what is
checked is the glue: which routes each pass gets, what the TrainBatch carries, and the numbers
computed from known inputs. The stages get a StepPlan only, never the config."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.routing.replay_plan import PassMode, ReplayMode, ReplayPlan
from moe_rl.step.plan import StepPlan
from moe_rl.step.prepare import old_logprobs, prepare_batch, reference_logprobs
from moe_rl.step.update import update_policy
from moe_rl.types import TrainBatch
from tests.step.stand_ins import OLD_LOGP, StandInLearner, small_rollout


@pytest.mark.unit
def test_replay_plan_table():
    off, r2, r3 = (ReplayPlan(m, True, False) for m in (ReplayMode.OFF, ReplayMode.R2, ReplayMode.R3))
    assert [p.old_pass.mode for p in (off, r2, r3)] == [PassMode.OBSERVE, PassMode.RECORD, PassMode.REPLAY]
    assert off.update_pass is None and r2.update_pass.mode is r3.update_pass.mode is PassMode.REPLAY
    assert ReplayPlan(ReplayMode.OFF, True, True).update_pass.mode is PassMode.OBSERVE  # the monitor compares
    assert (off.needs_old_routes, r2.needs_old_routes, r3.needs_old_routes) == (False, True, False)
    assert ReplayPlan(ReplayMode.R3, True, True).needs_old_routes  # the monitor keeps the old routes
    assert off.update_routes("rollout", "recorded") is None
    assert (r2.update_routes("rollout", "recorded"), r3.update_routes("rollout", "recorded")) == (
        "recorded",
        "rollout",
    )
    assert (
        ReplayPlan(ReplayMode.R3, False, False).reference_pass is None
        and r3.reference_pass.mode is PassMode.REPLAY
    )
    with pytest.raises(ValueError):
        ReplayPlan.from_config("r4", True, False)


@pytest.mark.unit
def test_train_batch_select_micro_batches_and_to_make_new_batches():
    rollout = small_rollout()
    tb = TrainBatch(
        rollout.tokens_BS,
        rollout.prompt_lens_B + rollout.response_lens_B,
        loss_mask_BS=rollout.response_mask_BS,
        advantages_BS=torch.arange(20.0).view(4, 5),
    )
    sel = tb.select(torch.tensor([2, 0]))
    assert torch.equal(sel.seq_lens_B, torch.tensor([4, 5])) and torch.equal(
        sel.advantages_BS[1], torch.arange(5.0)
    )
    assert sel.old_logp_BS is None and tb.num_seqs == 4 and sel.num_seqs == 2
    mbs = tb.micro_batches(3, token_multiple=1, seq_multiple=2)
    # lengths 5, 3, 4 -> S = 5 rounded up to 6; then 4 -> 4
    assert [tuple(m.tokens_BS.shape) for m in mbs] == [(3, 6), (1, 4)]
    assert torch.equal(mbs[0].tokens_BS[:, :5], tb.tokens_BS[:3]) and mbs[0].tokens_BS[:, 5].eq(0).all()
    assert torch.equal(mbs[1].seq_lens_B, torch.tensor([4]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        tb.tokens_BS = tb.tokens_BS  # nothing mutates a batch it was handed
    meta = tb.to("meta")
    assert meta.tokens_BS.device.type == "meta" and tb.tokens_BS.device.type == "cpu"


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
def test_prepare_routes_each_pass_as_the_plan_says(mode):
    plan = StepPlan.from_config(
        load_config(
            None,
            [
                f"routing.replay={mode}",
                "algo.kl_coef=0.1",
                "correction.is_level=token",
                "log.router_monitor=true",
            ],
        )
    )
    learner, rollout = StandInLearner(), small_rollout()
    rewards_B = torch.tensor([1.0, 0.0, 0.5, 0.5])
    old = old_logprobs(plan, learner, rollout)
    tb, metrics = prepare_batch(plan, learner, old, rewards_B)
    assert len(learner.passes) == 1 and tb.ref_logp_BS is None  # the reference pass is a stage of its own
    tb, replay = reference_logprobs(plan, learner, tb), plan.replay
    (kind0, old_batch, old_plan), (kind1, ref_batch, ref_plan) = learner.passes
    assert (kind0, kind1) == ("old", "ref")
    # the monitor keeps the old routes; the flips are split by version lag (all 0 here: one lag)
    assert old_plan == dataclasses.replace(replay.old_pass, num_lags=1) and old_plan.keep_native
    assert old_batch.route_lag_BS.eq(0).all() and tb.route_lag_BS is None
    assert torch.equal(old_batch.routes.rows_B, torch.tensor([4, 2, 3, 3]))  # the rollout's, T - 1 rows each
    expected = {"off": None, "r2": learner.recorded, "r3": old_batch.routes}[mode]
    assert tb.routes is expected and tb.old_routes is learner.recorded
    assert (ref_batch.routes is expected) and (ref_plan == replay.reference_pass)
    # closed form: GRPO (Bessel std) of [1, 0] -> +-0.7071, of [0.5, 0.5] -> 0
    adv_B = tb.advantages_BS.sum(1) / rollout.response_mask_BS.sum(1)
    assert adv_B.tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0], abs=1e-5)
    assert tb.advantages_BS[~rollout.response_mask_BS].eq(0).all()
    # token IS weights exp(old - rollout) = e^0.25 (under is_clip 2) on response tokens
    assert tb.is_weights_BS[rollout.response_mask_BS].tolist() == pytest.approx([math.exp(0.25)] * 8)
    assert torch.equal(tb.keep_BS, rollout.response_mask_BS) and tb.ref_logp_BS.eq(OLD_LOGP).all()
    assert tb.old_logp_BS.eq(OLD_LOGP).all() and torch.equal(tb.rollout_logp_BS, rollout.logprobs_BS)
    m = metrics["corr/logprob_abs_diff"]
    assert (float(m.sum), float(m.count)) == (pytest.approx(0.25 * 8), 8.0)
    assert float(metrics["train/entropy"].sum / metrics["train/entropy"].count) == pytest.approx(0.25)


@pytest.mark.unit
def test_update_splits_by_minibatch_and_averages_grad_norms():
    plan = StepPlan.from_config(
        load_config(None, ["algo.num_minibatches=2", "routing.replay=r3", "log.router_monitor=false"])
    )
    learner, rollout = StandInLearner(), small_rollout()
    tb = TrainBatch(
        rollout.tokens_BS,
        rollout.prompt_lens_B + rollout.response_lens_B,
        loss_mask_BS=rollout.response_mask_BS,
    )
    m = update_policy(plan, learner, tb, lr=0.5)
    sizes = [b.seq_lens_B.tolist() for _, b, _ in learner.passes]
    assert sizes == [[5, 3], [4, 4]] and all(p == plan.replay.update_pass for _, _, p in learner.passes)
    assert all(loss is plan.loss for loss in learner.losses)  # the loss built once, at plan build
    assert (m["train/grad_norm"], m["train/grad_norm_max"], m["train/lr"]) == (2.0, 4.0, 0.5)
    assert m["train/skipped_minibatches"] == 1  # the first minibatch had no gradient on any rank


@pytest.mark.unit
def test_response_ids_left_aligns_the_responses():
    rollout = small_rollout()
    assert rollout.response_ids(pad_id=0).tolist() == [[5, 6, 7], [5, 0, 0], [5, 6, 0], [5, 6, 0]]


@pytest.mark.unit
def test_prepare_splits_the_mismatch_by_each_tokens_version_lag():
    plan = StepPlan.from_config(load_config(None, ["routing.replay=r3", "log.router_monitor=false"]))
    learner, rollout = StandInLearner(), small_rollout()
    # responses (prompt 2): 3, 1, 2, 2 tokens; the learner is at version 6
    version_BS = torch.tensor(
        [[0, 0, 4, 5, 5], [0, 0, 6, 0, 0], [0, 0, 4, 4, 0], [0, 0, 6, 6, 0]], dtype=torch.int32
    )
    rollout = dataclasses.replace(rollout, version_BS=version_BS)
    old = old_logprobs(plan, learner, rollout, learner_version=6)
    _, metrics = prepare_batch(plan, learner, old, torch.tensor([1.0, 0.0, 0.5, 0.5]))
    ((_, old_batch, old_plan),) = learner.passes
    assert old_plan.num_lags == 3  # lags 0 .. 2
    # route row t has token max(t + 1, 2)'s lag; rows 0 .. T - 2
    assert old_batch.route_lag_BS.tolist() == [
        [2, 2, 1, 1, 0],
        [0, 0, 0, 0, 0],
        [2, 2, 2, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    m = {k: float(v.sum) / float(v.count) for k, v in metrics.items() if "lag" in k and hasattr(v, "count")}
    # 8 tokens: lag 0 on 1 + 2, lag 1 on 2, lag 2 on 1 + 2
    assert m == pytest.approx(
        {
            "rollout/lag_frac/0": 3 / 8,
            "rollout/lag_frac/1": 2 / 8,
            "rollout/lag_frac/2": 3 / 8,
            "rollout/lag_mean": 8 / 8,
            # the stand-in's old log-prob is -0.5 and the rollout's -0.75 on every token
            "mismatch/k3_lag0": math.exp(0.25) - 1.25,
            "mismatch/k3_lag1": math.exp(0.25) - 1.25,
            "mismatch/k3_lag2": math.exp(0.25) - 1.25,
        }
    )
    assert float(metrics["rollout/lag_max"].value) == 2.0
    with pytest.raises(ValueError, match="newer than the learner's version 5"):  # weights from the future
        old_logprobs(plan, learner, rollout, learner_version=5)
