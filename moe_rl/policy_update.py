"""The policy update of a step: this step's learning rate, ``algo.num_minibatches`` optimizer
steps over the prepared batch, and the metrics that are functions of reduced ones."""

from __future__ import annotations

import torch

from moe_rl import rollout_correction
from moe_rl.config import RunConfig
from moe_rl.corrections import derive_metrics
from moe_rl.dist import all_reduce_sum, comm_device
from moe_rl.learner.learner import Learner
from moe_rl.lr import LengthLRScheduler, scheduled_lr
from moe_rl.metrics import merge_metrics
from moe_rl.routing.plan import ReplayPlan
from moe_rl.types import RolloutBatch, TrainBatch
from moe_rl.variance import finalize_variance_proxies


def learning_rate(cfg: RunConfig, scheduler: LengthLRScheduler, step: int, batch: RolloutBatch,
                  dp_group) -> tuple[float, dict, list[dict]]:
    """This step's LR: the base schedule times the response-length decay multiplier, which sees
    the global mean response length of this step's rollouts (one tiny all-reduce)."""
    lens_B = batch.response_lens_B.to(comm_device(dp_group))  # NCCL reduces CUDA tensors only
    stats = all_reduce_sum(torch.stack([lens_B.double().sum(), lens_B.new_tensor(float(batch.num_seqs),
                                                                                 dtype=torch.float64)]), dp_group)
    multiplier, events = scheduler.update(step, float(stats[0] / stats[1]))
    lr = scheduled_lr(step, cfg.steps, cfg.optim, multiplier, cfg.optim.length_lr.min_lr)
    return lr, scheduler.metrics() if cfg.optim.length_lr.enabled else {}, events


def update(cfg: RunConfig, plan: ReplayPlan, learner: Learner, tb: TrainBatch, lr: float) -> dict:
    """``algo.num_minibatches`` optimizer steps over the batch (split by whole prompt groups)."""
    a = cfg.algo
    loss_fn = rollout_correction.loss_fn(cfg.correction, a)
    merged: dict = {}
    grad_norms, skipped = [], 0
    for idx_B in torch.arange(tb.num_seqs, device=tb.tokens_BS.device).chunk(a.num_minibatches):
        out = learner.update(tb.select(idx_B), loss_fn, cfg.rollout.temperature, a.micro_batch_size, lr,
                             plan.update_pass)
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


def finalize(reduced: dict[str, float]) -> dict[str, float]:
    """Metrics that are functions of globally reduced ones (after reduce_metrics)."""
    return derive_metrics(finalize_variance_proxies(reduced, reduced["train/grad_norm"]))
