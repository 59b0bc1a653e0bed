"""The policy update of a step: this step's learning rate and ``algo.num_minibatches`` optimizer
steps over the prepared batch, with the loss the plan built once."""

from __future__ import annotations

import torch

from moe_rl.dist import all_reduce_sum, comm_device
from moe_rl.learner.learner import Learner
from moe_rl.maths.lr import LengthLRScheduler, scheduled_lr
from moe_rl.metrics import merge_metrics
from moe_rl.step.plan import StepPlan
from moe_rl.types import RolloutBatch, TrainBatch


def learning_rate(
    plan: StepPlan, scheduler: LengthLRScheduler, step: int, batch: RolloutBatch, dp_group
) -> tuple[float, dict, list[dict]]:
    """This step's LR: the base schedule times the response-length decay multiplier, which sees
    the global mean response length of this step's rollouts (one tiny all-reduce)."""
    lens_B = batch.response_lens_B.to(comm_device(dp_group))  # NCCL reduces CUDA tensors only
    stats = all_reduce_sum(
        torch.stack([lens_B.double().sum(), lens_B.new_tensor(float(batch.num_seqs), dtype=torch.float64)]),
        dp_group,
    )
    multiplier, events = scheduler.update(step, float(stats[0] / stats[1]))
    o = plan.optim
    lr = scheduled_lr(step, plan.steps, o, multiplier, o.length_lr.min_lr)
    return lr, scheduler.metrics() if o.length_lr.enabled else {}, events


def update_policy(plan: StepPlan, learner: Learner, tb: TrainBatch, lr: float) -> dict:
    """``algo.num_minibatches`` optimizer steps over the batch (split by whole prompt groups)."""
    merged: dict = {}
    grad_norms, skipped = [], 0
    for idx_B in torch.arange(tb.num_seqs, device=tb.tokens_BS.device).chunk(plan.num_minibatches):
        out = learner.update(
            tb.select(idx_B),
            plan.loss,
            plan.sampling.temperature,
            plan.micro_batch_size,
            lr,
            plan.replay.update_pass,
        )
        grad_norms.append(out.grad_norm)
        skipped += out.skipped
        for m in [*out.loss_metrics, out.routing.metrics]:
            merged = merge_metrics(merged, m)
    # grad norms are global already (identical on every rank): plain numbers
    merged["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    merged["train/grad_norm_max"] = max(grad_norms)
    merged["train/skipped_minibatches"] = skipped  # zero gradient on every rank: no optimizer step
    merged["train/lr"] = lr
    merged.update(learner.router_monitor_metrics())  # one all-reduce for the whole step
    return merged
