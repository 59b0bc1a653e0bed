"""The rollout -> learner mismatch split into what flipped routes cause and what remains with the
engine's routes replayed (docs/math.md 7.4), for any mismatch source (the engine's dtype, FP8,
staleness, router noise).

The old-log-prob pass gives one side: the learner's native routes (``routing.replay`` off or r2)
or the engine's replayed (r3). Every ``log.mismatch_split_every`` steps one extra learner forward
(no gradient) gives the other: with the engine's routes replayed, or natively under r3. The flip
part is k3(native) - k3(replayed): the mismatch R3 removes; the replayed k3 is what it cannot (the
experts' and attention's own numerics, stale weights).

Shape suffixes: B sequences, S positions.
"""

from __future__ import annotations

import contextlib

import torch

from moe_rl.corrections.masked import masked_mean
from moe_rl.learner.learner import Learner
from moe_rl.maths.ratios import kl_from_log_ratio, log_ratio
from moe_rl.metrics import Mean
from moe_rl.routing.replay_plan import PassMode, PassPlan
from moe_rl.step.plan import StepPlan
from moe_rl.step.prepare import OldPass


def split_due(plan: StepPlan, step: int) -> bool:
    every = plan.mismatch_split_every
    return every > 0 and step % every == 0


def mismatch_split(
    rollout_logp_BS: torch.Tensor, native_logp_BS: torch.Tensor, replayed_logp_BS: torch.Tensor, mask_BS
) -> dict:
    """k3 KL(pi_rollout || pi_learner) over the response tokens with the learner's native routes and
    with the engine's routes replayed, their difference (the flip part) and its share of the native.
    Each is a token mean with the same count, so the parts add up after any reduction over ranks."""
    mask_BS = mask_BS.bool()
    f64 = torch.float64
    k3 = {
        side: kl_from_log_ratio(log_ratio(logp_BS.detach().to(f64), rollout_logp_BS.detach().to(f64)), "k3")
        for side, logp_BS in (("native", native_logp_BS), ("replayed", replayed_logp_BS))
    }
    native, replayed = masked_mean(k3["native"], mask_BS), masked_mean(k3["replayed"], mask_BS)
    flip = native.sum - replayed.sum
    return {
        "mismatch/k3_native": native,
        "mismatch/k3_replayed": replayed,
        "mismatch/k3_flip_part": Mean(flip, native.count),
        "mismatch/k3_flip_share": Mean(flip, native.sum),
    }


def split_step(plan: StepPlan, learner: Learner, old: OldPass, step: int, phase=None) -> dict:
    """The split's metrics on the steps it is due (none on the others): the old pass's log-probs are
    one side, one extra no-grad forward over the same batch the other, timed as ``phase``
    ("mismatch_split": ``time/mismatch_split_s``, on the steps it runs) when given."""
    if not split_due(plan, step):
        return {}
    replayed_old = plan.replay.old_pass.mode is PassMode.REPLAY
    other = PassPlan(PassMode.OBSERVE if replayed_old else PassMode.REPLAY, prefix="mismatch/extra_")
    with phase("mismatch_split") if phase else contextlib.nullcontext():
        extra = learner.forward_logprobs(old.tb, plan.sampling.temperature, plan.micro_batch_size, other)
    old_logp_BS, extra_logp_BS = old.out.stats.logp_BS, extra.stats.logp_BS
    native, replayed = (extra_logp_BS, old_logp_BS) if replayed_old else (old_logp_BS, extra_logp_BS)
    return mismatch_split(old.batch.logprobs_BS, native, replayed, old.batch.response_mask_BS)
