"""unit tier: the mismatch split (moe_rl/step/mismatch_split.py, docs/math.md 7.4): its arithmetic
on hand-made log-probs, and which side the extra forward supplies in each replay mode."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.learner.learner import LogprobOutput
from moe_rl.metrics import reduce_metrics
from moe_rl.routing.agreement import RoutingOutcome
from moe_rl.routing.replay_plan import PassMode
from moe_rl.step.mismatch_split import mismatch_split, split_due, split_step
from moe_rl.step.plan import StepPlan
from moe_rl.step.prepare import old_logprobs
from moe_rl.types import TokenStats
from tests.step.stand_ins import OLD_LOGP, ROLLOUT_LOGP, StandInLearner, small_rollout

pytestmark = pytest.mark.unit

LN2 = math.log(2.0)


def test_split_arithmetic_on_hand_made_log_probs():
    """Rollout log-probs 0; native log r = ln 2 on both response tokens (k3 = 1 - ln 2 each);
    replayed: ln 2 on the first, 0 on the second (k3 = 0). The masked token's garbage is ignored."""
    rollout = torch.zeros(1, 3, dtype=torch.float64)
    native = torch.tensor([[LN2, LN2, 99.0]], dtype=torch.float64)
    replayed = torch.tensor([[LN2, 0.0, -99.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    m = reduce_metrics(mismatch_split(rollout, native, replayed, mask))
    k3 = 1 - LN2
    assert m["mismatch/k3_native"] == pytest.approx(k3, abs=1e-15)
    assert m["mismatch/k3_replayed"] == pytest.approx(k3 / 2, abs=1e-15)
    assert m["mismatch/k3_flip_part"] == pytest.approx(k3 / 2, abs=1e-15)
    assert m["mismatch/k3_flip_share"] == pytest.approx(0.5, abs=1e-15)
    assert sorted(m) == [f"mismatch/k3_{k}" for k in ("flip_part", "flip_share", "native", "replayed")]


def test_split_parts_add_up_after_a_reduction_over_ranks():
    """Two ranks' token sums: the flip part is the native minus the replayed mean of all tokens."""
    t = lambda *x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    a = mismatch_split(t(0.0, 0.0), t(LN2, 0.0), t(0.0, 0.0), t(1.0, 1.0))
    b = mismatch_split(t(0.0), t(LN2), t(LN2), t(1.0))
    merged = {
        k: dataclasses.replace(v, sum=v.sum + b[k].sum, count=v.count + b[k].count) for k, v in a.items()
    }
    m = reduce_metrics(merged)
    k3 = 1 - LN2
    assert m["mismatch/k3_native"] == pytest.approx(2 * k3 / 3, abs=1e-15)
    assert m["mismatch/k3_replayed"] == pytest.approx(k3 / 3, abs=1e-15)
    assert m["mismatch/k3_flip_part"] == pytest.approx(k3 / 3, abs=1e-15)
    assert m["mismatch/k3_flip_share"] == pytest.approx(0.5, abs=1e-15)


class _TwoSided(StandInLearner):
    """Native passes give OLD_LOGP, passes that replay the engine's routes OLD_LOGP + 0.25."""

    def forward_logprobs(self, batch, temperature, micro_batch_size, plan=None, reference=False):
        self.passes.append(("old", batch, plan))
        logp = OLD_LOGP + (0.25 if plan is not None and plan.mode is PassMode.REPLAY else 0.0)
        full = torch.full(batch.tokens_BS.shape, logp)
        return LogprobOutput(TokenStats(full, full * 0, full * 0), RoutingOutcome({}, None))


@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
def test_the_extra_forward_is_the_side_the_old_pass_is_not(replay: str):
    """Off / r2: the old pass is native, the extra one replays the engine's routes; r3 the other way
    round. Either way native k3 is from OLD_LOGP, replayed k3 from OLD_LOGP + 0.25."""
    cfg = load_config(None, [f"routing.replay={replay}", "log.mismatch_split_every=3"])
    plan, learner = StepPlan.from_config(cfg), _TwoSided()
    old = old_logprobs(plan, learner, small_rollout())
    assert [split_due(plan, s) for s in range(7)] == [True, False, False, True, False, False, True]
    assert split_step(plan, learner, old, step=1) == {} and len(learner.passes) == 1  # not due: no pass
    m = reduce_metrics(split_step(plan, learner, old, step=3))
    (_, tb, extra_plan) = learner.passes[-1]
    assert extra_plan.mode is (PassMode.OBSERVE if replay == "r3" else PassMode.REPLAY)
    assert tb is old.tb and tb.routes is not None  # the engine's routes, on the old pass's batch
    k3 = lambda lr: math.expm1(lr) - lr  # noqa: E731
    native, replayed = k3(OLD_LOGP - ROLLOUT_LOGP), k3(OLD_LOGP + 0.25 - ROLLOUT_LOGP)
    assert m["mismatch/k3_native"] == pytest.approx(native, rel=1e-12)
    assert m["mismatch/k3_replayed"] == pytest.approx(replayed, rel=1e-12)
    assert m["mismatch/k3_flip_part"] == pytest.approx(native - replayed, rel=1e-12)


def test_the_split_is_off_with_every_zero():
    plan = StepPlan.from_config(load_config(None, ["log.mismatch_split_every=0"]))
    assert not any(split_due(plan, s) for s in range(20))
