"""unit tier: the StepPlan (moe_rl/step/plan.py) resolves correction.*, the loss, the advantage
estimator and the sampling params once; a step then runs from the plan alone and never consults
the config (the per-micro-batch branch on the correction mode is a function picked at build)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_rl.config import AlgoConfig, RunConfig, load_config
from moe_rl.corrections.corrected_loss import PolicyLoss
from moe_rl.corrections.correction_specs import ImportanceSpec, TrmSpec
from moe_rl.learner.learner import UpdateOutput
from moe_rl.maths import advantages
from moe_rl.maths.policy_specs import AdvantageSpec, PolicyLossSpec
from moe_rl.routing.agreement import RoutingOutcome
from moe_rl.routing.replay_plan import ReplayMode, ReplayPlan
from moe_rl.step.plan import StepPlan, sampling_params
from moe_rl.step.prepare import old_logprobs, prepare_batch, reference_logprobs
from moe_rl.step.update import update_policy
from moe_rl.types import TokenStats
from tests.step.stand_ins import OLD_LOGP, StandInLearner, small_rollout


@pytest.mark.unit
def test_trm_and_token_is_resolve_into_the_plan_and_the_decoupled_loss():
    cfg = load_config(
        None,
        [
            "correction.trm.max=0.05",
            "correction.is_level=token",
            "correction.is_clip=3",
            "correction.dual_clip_c=3",
            "algo.kl_coef=0.1",
            "routing.replay=r3",
            "log.router_monitor=false",
        ],
    )
    plan = StepPlan.from_config(cfg, (7,))
    # the step carries the correction spec as loaded: its typed parts are what the maths reads
    assert plan.correction is cfg.correction and plan.support == "full"
    assert plan.correction.importance == ImportanceSpec("token", 3.0, False)
    assert plan.correction.trm_old == TrmSpec(max=0.05) and plan.correction.trm_theta is None
    assert plan.correction.decoupled and not plan.correction.needs_full_dists and not plan.correction.dvp.on
    assert plan.correction.rules == ()
    assert plan.loss == PolicyLoss(
        PolicyLossSpec(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k3"),
        cfg.correction,
    )
    assert plan.loss.spec.clip_ratio_c == 3.0
    assert plan.replay == ReplayPlan(ReplayMode.R3, True, False)
    assert plan.advantage == AdvantageSpec("grpo", True) and plan.reference is True
    assert advantages.get_advantage(plan.advantage.name) is advantages.grpo
    assert plan.sampling == sampling_params(cfg, (7,)) and plan.sampling.stop_token_ids == (7,)
    assert (plan.micro_batch_size, plan.num_minibatches, plan.steps) == (
        cfg.algo.micro_batch_size,
        cfg.algo.num_minibatches,
        cfg.steps,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.loss = None


@pytest.mark.unit
def test_bypass_theta_trm_exact_kl_and_dvp_pick_the_bypass_loss():
    cfg = load_config(
        "configs/corrections/bypass_reinforce.yaml",
        [
            "correction.trm.max=0.05",
            "correction.trm.reference=theta",
            "correction.trm.kl=exact",
            "correction.dvp_threshold=0.1",
            "correction.rejection=[{option: seq_sum_k1, lower: 0.5, upper: 2.0}]",
            "algo.advantage=rloo",
        ],
    )
    plan = StepPlan.from_config(cfg)
    c = plan.correction
    # bypass mode corrects in the loss: no per-batch tensors, TRM against pi_theta lives in the loss
    assert c is cfg.correction and plan.support == "dvp:relative:0.1"
    assert not c.decoupled and c.dvp.on and c.needs_full_dists and plan.sampling.return_dist
    assert c.importance == ImportanceSpec("sequence", 2.0, False)
    assert c.rules == (("seq_sum", "k1", math.log(0.5), math.log(2.0)),)
    assert c.trm_old is None and c.trm_theta == TrmSpec(max=0.05, reference="theta", kl="exact")
    assert plan.loss == PolicyLoss(
        PolicyLossSpec(clip_low=0.2, clip_high=0.28, dual_clip_c=0.0, kl_coef=0.0, kl_estimator="k3"), c
    )
    assert c.bypass_loss == "reinforce" and plan.loss.spec.clip_ratio_c is None
    assert plan.advantage == AdvantageSpec("rloo", True) and plan.reference is False


class _LossLearner(StandInLearner):
    """The stand-in learner, whose update runs the plan's loss at theta = old (ratio 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[float] = []

    def update(self, batch, loss_fn, temperature, micro_batch_size, lr, plan=None):
        self.passes.append(("update", batch, plan))
        value, metrics = loss_fn(
            batch,
            TokenStats(batch.old_logp_BS.clone(), batch.old_logp_BS, batch.old_logp_BS),
            batch.loss_mask_BS.sum(),
        )
        self.values.append(float(value))
        return UpdateOutput(1.5, [metrics], RoutingOutcome())


def _no_config_reads(monkeypatch) -> None:
    """Any attribute read of a run or algo config raises from here on (the step reads the specs
    it carries, ``plan.correction`` among them, never the config tree around them)."""

    def refuse(obj, name):
        raise AssertionError(f"{type(obj).__name__}.{name} read during a step")

    for cls in (RunConfig, AlgoConfig):
        monkeypatch.setattr(cls, "__getattribute__", refuse)


@pytest.mark.unit
def test_a_step_runs_from_the_plan_alone(monkeypatch):
    cfg = load_config(
        None,
        [
            "correction.trm.max=0.05",
            "correction.trm.reference=theta",
            "correction.is_level=token",
            "algo.kl_coef=0.1",
            "algo.num_minibatches=1",
            "log.router_monitor=false",
        ],
    )
    plan = StepPlan.from_config(cfg)
    learner, rollout = _LossLearner(), small_rollout()
    # sequence 1 drifted further from the engine: log rho 0.5, k2 0.125 > 0.05 (the others 0.25, k2 0.03125)
    rollout.logprobs_BS[1] = torch.where(rollout.response_mask_BS[1], -1.0, 0.0)
    algo = cfg.algo
    _no_config_reads(monkeypatch)
    with pytest.raises(AssertionError, match="AlgoConfig.clip_low read during a step"):
        _ = algo.clip_low  # the trap is armed
    old = old_logprobs(plan, learner, rollout)
    tb, m_prep = prepare_batch(plan, learner, old, torch.tensor([1.0, 0.0, 0.5, 0.5]))
    tb = reference_logprobs(plan, learner, tb)
    m_update = update_policy(plan, learner, tb, lr=0.25)
    monkeypatch.undo()
    assert [kind for kind, _, _ in learner.passes] == ["old", "ref", "update"]
    # token IS weights exp(old - rollout): e^0.25, and e^0.5 on sequence 1 (under is_clip 2)
    assert tb.is_weights_BS[0, 2:5].tolist() == pytest.approx([math.exp(0.25)] * 3)
    assert tb.is_weights_BS[1, 2].item() == pytest.approx(math.exp(0.5))
    assert torch.equal(tb.keep_BS, rollout.response_mask_BS)  # TRM is evaluated against theta, in the loss
    assert tb.ref_logp_BS.eq(OLD_LOGP).all()
    # ratio 1, KL 0 (theta = ref): loss = -(sum of w A over KEPT tokens) / (all 8 loss tokens); TRM drops
    # sequence 1 (A = -1/sqrt 2), sequence 0 keeps 3 tokens of A = 1/sqrt 2, the others have A = 0
    assert learner.values == [pytest.approx(-3 * math.exp(0.25) / math.sqrt(2) / 8, rel=1e-5)]  # GRPO std eps
    assert (m_update["train/grad_norm"], m_update["train/lr"]) == (1.5, 0.25)
    assert not any(k.startswith("corr/trm") for k in m_prep)  # against theta: in the loss, not per batch
    accept = m_update["corr/trm_accept_rate"]
    assert (float(accept.sum), float(accept.count)) == (3.0, 4.0)  # every sequence but 1
