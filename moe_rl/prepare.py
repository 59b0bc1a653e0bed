"""Batch preparation: from a rollout and its rewards to the ``TrainBatch`` the update consumes.

One pass of the learner over the rollout (old log-probs, routed per ``ReplayPlan.old_pass``), the
rollout-correction tensors, advantages, and the reference pass when the KL term is on; plus the
step's rollout, mismatch and routing metrics. Nothing here mutates what it is given.

Shape suffixes: B sequences, S positions, R response positions.
"""

from __future__ import annotations

import torch

from moe_rl import rollout_correction
from moe_rl.advantages import extra_inputs, get_advantage
from moe_rl.config import RunConfig
from moe_rl.corrections.importance import offpolicy_metrics
from moe_rl.learner.learner import Learner
from moe_rl.metrics import Max, Mean, Sum
from moe_rl.monitor.router_grad import rollout_flip_aliases
from moe_rl.rollout.factory import sampling_params
from moe_rl.routing.plan import ReplayPlan
from moe_rl.routing.record import RouteBatch, RouteHeader, validate
from moe_rl.types import RolloutBatch, TrainBatch
from moe_rl.variance import variance_proxies


def rollout_routes(batch: RolloutBatch, header: RouteHeader) -> RouteBatch:
    """The engine's per-sample route tensors as one jagged batch, checked at ingest. Route records
    live on the host (a few bytes per token; the replay layout is index arithmetic done there and
    moved to the router's device once per micro-batch): one copy per step from an engine on a GPU."""
    prompt_lens_B = batch.prompt_lens_B.cpu()
    routes = RouteBatch(torch.cat(batch.routes).cpu(),
                        torch.tensor([r.shape[0] for r in batch.routes], dtype=torch.int64, device="cpu"),
                        torch.zeros_like(prompt_lens_B), prompt_lens_B.clone(), header)
    validate(routes, prompt_lens_B + batch.response_lens_B.cpu(), header)
    return routes


def response_ids(batch: RolloutBatch, pad_id: int) -> torch.Tensor:
    """The generated tokens of each sequence, left-aligned and right-padded: int64 [B, R]."""
    lens_B = batch.response_lens_B
    r_max = int(lens_B.max())
    pos_R = torch.arange(r_max, device=lens_B.device)
    idx_BR = (batch.prompt_lens_B[:, None] + pos_R[None, :]).clamp(max=batch.tokens_BS.shape[1] - 1)
    valid_BR = pos_R[None, :] < lens_B[:, None]
    return torch.where(valid_BR, batch.tokens_BS.gather(1, idx_BR), torch.full_like(idx_BR, pad_id))


def prepare(cfg: RunConfig, plan: ReplayPlan, learner: Learner, batch: RolloutBatch,
            rewards_B: torch.Tensor) -> tuple[TrainBatch, dict]:
    """Old (and reference) log-probs, correction tensors and advantages: the batch the update
    consumes, on the learner's device (an engine may hand its batch over on another: vLLM's is
    on the host)."""
    a, temp = cfg.algo, cfg.rollout.temperature
    batch, rewards_B = batch.to(learner.device), rewards_B.to(learner.device)
    mask_BS = batch.response_mask_BS
    inputs = rollout_correction.token_inputs(cfg.correction, batch, sampling_params(cfg).logprob_support)
    rollout = rollout_routes(batch, learner.route_header)
    tb = TrainBatch(batch.tokens_BS, batch.prompt_lens_B + batch.response_lens_B, safe_BSV=inputs.safe_BSV,
                    rollout_dist_BSV=inputs.rollout_dist_BSV, routes=rollout)
    old = learner.forward_logprobs(tb, temp, a.micro_batch_size, plan.old_pass)
    st = old.stats
    corr, corr_metrics = rollout_correction.prepare(cfg.correction, st.logp_BS, batch.logprobs_BS, mask_BS,
                                                    learner.dims.dp_group, st.exact_kl_BS)
    estimator = get_advantage(a.advantage)
    # OTB weights its energies by the squared rollout IS weights when rollout IS is on (math.md 6.2)
    adv_inputs = {"logp_BS": st.logp_BS, "sum_pi_sq_BS": st.sum_pi_sq_BS, "is_weights_BS": corr.is_weights_BS}
    adv_BS, metrics = estimator(rewards_B, batch.group_B, mask_BS, std_norm=a.grpo_std_norm,
                                **extra_inputs(estimator, adv_inputs))
    metrics.update(old.routing.metrics)
    if plan.monitor:
        metrics.update(rollout_flip_aliases(old.routing.metrics))
    metrics.update(variance_proxies(adv_BS, mask_BS, st.sum_pi_sq_BS, st.logp_BS, corr.is_weights_BS))
    metrics.update({**corr_metrics, **rollout_correction.dvp_batch_metrics(cfg.correction, batch, st)})
    routes = plan.update_routes(rollout, old.routing.recorded)
    tb = tb.replace(loss_mask_BS=mask_BS, old_logp_BS=st.logp_BS, advantages_BS=adv_BS,
                    rollout_logp_BS=batch.logprobs_BS, is_weights_BS=corr.is_weights_BS, keep_BS=corr.keep_BS,
                    routes=routes,
                    # the update passes compare their routing with the old pass's (update-induced flips)
                    old_routes=old.routing.recorded if plan.monitor else None)
    if a.kl_coef > 0:
        ref_plan = plan.reference_pass
        ref_batch = TrainBatch(tb.tokens_BS, tb.seq_lens_B, safe_BSV=tb.safe_BSV,  # the policy's support
                               routes=routes if ref_plan else None)
        ref = learner.forward_logprobs(ref_batch, temp, a.micro_batch_size, ref_plan, reference=True)
        tb = tb.replace(ref_logp_BS=ref.stats.logp_BS)
    metrics.update(mismatch_metrics(st.logp_BS, batch.logprobs_BS, st.entropy_BS, mask_BS))
    return tb, metrics


def mismatch_metrics(old_logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor, entropy_BS: torch.Tensor,
                     mask_BS: torch.Tensor) -> dict:
    """Training-inference mismatch on the sampled tokens (pi_train = the learner's pi_old here)."""
    m = mask_BS.float()
    diff_BS = (old_logp_BS - rollout_logp_BS).abs() * m
    return {**offpolicy_metrics(old_logp_BS, rollout_logp_BS, mask_BS),
            "train/entropy": Mean((entropy_BS * m).sum(), m.sum()),
            "corr/logprob_abs_diff": Mean(diff_BS.sum(), m.sum()),
            "corr/logprob_abs_diff_max": Max(diff_BS.max())}


def rollout_metrics(batch: RolloutBatch) -> dict:
    lens_B = batch.response_lens_B.float()
    n = torch.tensor(float(batch.num_seqs), device=lens_B.device)
    return {
        "rollout/response_len_mean": Mean(lens_B.sum(), n),
        "rollout/response_len_max": Max(lens_B.max()),
        "rollout/finished_frac": Mean(batch.finished_B.float().sum(), n),
        "rollout/truncated_frac": Mean((~batch.finished_B).float().sum(), n),  # hit rollout.max_new_tokens
        "rollout/num_seqs": Sum(n),
        "rollout/num_response_tokens": Sum(lens_B.sum()),
    }
