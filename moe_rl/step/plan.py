"""A step's plan, built once from the config at start-up: which routes each pass uses, what the
rollout correction computes and which loss it runs, the advantage estimator and the sampling
params. The stages (``prepare``, ``update``, ``finalize``) take the plan and never the config:
this is the one module of the step that reads ``correction.*``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from moe_rl.maths.advantages import AdvantageFn, get_advantage
from moe_rl.config import AlgoConfig, CorrectionConfig, OptimConfig, RunConfig
from moe_rl.learner.learner import LossFn
from moe_rl.rollout.factory import sampling_params
from moe_rl.routing.plan import ReplayPlan
from moe_rl.step.correction import CorrectionPlan, TrmPlan, bypass_loss, decoupled_loss
from moe_rl.types import SamplingParams


@dataclass(frozen=True)
class StepPlan:
    replay: ReplayPlan
    correction: CorrectionPlan
    advantage: AdvantageFn  # from the advantages registry
    std_norm: bool  # algo.grpo_std_norm
    loss: LossFn  # the policy loss of every micro-batch, its keywords bound here
    sampling: SamplingParams  # the engine's; the learner's passes use its temperature
    micro_batch_size: int
    num_minibatches: int
    reference: bool  # the KL term is on: a reference pass after the old one
    steps: int  # the LR schedule's length
    optim: OptimConfig  # the LR schedule

    @classmethod
    def from_config(cls, cfg: RunConfig, stop_token_ids: tuple[int, ...] = ()) -> StepPlan:
        a, sampling = cfg.algo, sampling_params(cfg, stop_token_ids)
        replay = ReplayPlan.from_config(
            cfg.routing.replay, cfg.routing.replay_reference, cfg.log.router_monitor
        )
        return cls(
            replay,
            correction_plan(cfg.correction, sampling.logprob_support),
            get_advantage(a.advantage),
            a.grpo_std_norm,
            policy_loss(cfg.correction, a),
            sampling,
            a.micro_batch_size,
            a.num_minibatches,
            a.kl_coef > 0,
            cfg.steps,
            cfg.optim,
        )


def trm_plan(cc: CorrectionConfig) -> TrmPlan | None:
    t = cc.trm
    if not t.on:
        return None
    return TrmPlan(
        t.kl == "exact", t.max or None, t.avg or None, t.length_neutral, t.ln_threshold, t.ln_eps, t.ln_delta
    )


def correction_plan(cc: CorrectionConfig, support: str) -> CorrectionPlan:
    """``correction.*`` resolved: the per-batch tensors and the engine inputs they need."""
    trm = trm_plan(cc)
    return CorrectionPlan(
        support,
        safe_sets=cc.dvp_threshold > 0,
        full_dists=trm is not None and trm.exact,
        decoupled=cc.mode == "decoupled",
        is_level=None if cc.is_level == "none" else cc.is_level,
        is_clip=cc.is_clip,
        is_batch_normalize=cc.is_batch_normalize,
        rs=cc.rs_options,
        rs_bounds=cc.rs_bounds,
        trm_old=trm if cc.trm.reference == "old" else None,
    )


def policy_loss(cc: CorrectionConfig, a: AlgoConfig) -> LossFn:
    """The micro-batch loss: bypass or decoupled PPO, chosen here once with all its keywords."""
    trm_theta = trm_plan(cc) if cc.trm.reference == "theta" else None
    common = {
        "trm_theta": trm_theta,
        "clip_low": a.clip_low,
        "clip_high": a.clip_high,
        "clip_ratio_c": cc.dual_clip_c or None,
        "kl_coef": a.kl_coef,
        "kl_kind": a.kl_estimator,
    }
    if cc.mode == "bypass":
        return functools.partial(
            bypass_loss,
            mode=cc.bypass_loss,
            is_clip_max=cc.is_clip,
            is_level=None if cc.is_level == "none" else cc.is_level,
            rs_options=cc.rs_options,
            rs_bounds=cc.rs_bounds,
            **common,
        )
    return functools.partial(decoupled_loss, **common)
