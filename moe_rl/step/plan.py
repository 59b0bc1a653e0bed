"""A step's plan, built once from the config at start-up: which routes each pass uses, the
feature specs the step carries unchanged (the rollout correction, the advantage estimator, the
policy loss), and the sampling params. The stages (``prepare``, ``update``, ``finalize``) take the
plan and never the config: this is the one module of the step that reads the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config import OptimConfig, RunConfig
from moe_rl.corrections.corrected_loss import PolicyLoss
from moe_rl.corrections.correction_specs import CorrectionSpec
from moe_rl.learner.learner import LossFn
from moe_rl.maths.policy_specs import AdvantageSpec
from moe_rl.routing.replay_plan import ReplayPlan
from moe_rl.types import SamplingParams


def sampling_params(cfg: RunConfig, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    """What the engine samples with (``rollout.*``, DVP). The full distributions are returned when
    the correction needs them (``CorrectionSpec.needs_full_dists``), and with DVP, whose pruned-mass
    metrics use them where the engine has them (``moe_rl.step.drift.dvp_batch_metrics``)."""
    r, c = cfg.rollout, cfg.correction
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=tuple(stop_token_ids),
        dvp=c.dvp,
        return_dist=c.needs_full_dists or c.dvp.on,
        long_tail_frac=r.long_tail_frac,
    )


@dataclass(frozen=True)
class StepPlan:
    replay: ReplayPlan
    correction: CorrectionSpec  # correction.*, as loaded
    support: str  # what the engine's log-probs must be normalised over (the learner's support)
    advantage: AdvantageSpec  # algo.advantage, algo.grpo_std_norm
    loss: LossFn  # the policy loss of every micro-batch (``PolicyLoss``: its specs)
    sampling: SamplingParams  # the engine's; the learner's passes use its temperature
    micro_batch_size: int
    num_minibatches: int
    reference: bool  # the KL term is on: a reference pass after the old one
    steps: int  # the LR schedule's length
    optim: OptimConfig  # the LR schedule
    agent_turns: int = 0  # agent.env: agent.max_turns (the lag and k3 by turn, docs/agentic.md 6)

    @classmethod
    def from_config(cls, cfg: RunConfig, stop_token_ids: tuple[int, ...] = ()) -> StepPlan:
        a, sampling = cfg.algo, sampling_params(cfg, stop_token_ids)
        replay = ReplayPlan.from_config(
            cfg.routing.replay, cfg.routing.replay_reference, cfg.log.router_monitor
        )
        loss = cfg.policy_loss
        return cls(
            replay,
            cfg.correction,
            sampling.logprob_support,
            a.estimator,
            PolicyLoss(loss, cfg.correction),
            sampling,
            a.micro_batch_size,
            a.num_minibatches,
            loss.kl_coef > 0,
            cfg.steps,
            cfg.optim,
            cfg.agent.max_turns if cfg.agent.env else 0,
        )
