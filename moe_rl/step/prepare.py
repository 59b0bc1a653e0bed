"""Batch preparation: from a rollout and its rewards to the ``TrainBatch`` the update consumes,
in three stages the loop times apart:

- ``old_logprobs``: one pass of the learner over the rollout (old log-probs, routed per
  ``ReplayPlan.old_pass``);
- ``prepare_batch``: the rollout-correction tensors, advantages, and the step's rollout,
  mismatch and routing metrics;
- ``reference_logprobs``: the reference pass when the KL term is on.

Nothing here mutates what it is given, or reads the config (the ``StepPlan`` holds it resolved).

Shape suffixes: B sequences, S positions.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_rl.corrections.importance import offpolicy_metrics
from moe_rl.dist import comm_device
from moe_rl.learner.learner import Learner, LogprobOutput
from moe_rl.maths.advantages import estimate_advantages
from moe_rl.maths.variance import variance_proxies
from moe_rl.maths.versions import (
    check_versions,
    k3_by_lag,
    lag_BS,
    lag_k3_by_turn,
    lag_metrics,
    route_lag_BS,
    route_turn_BS,
)
from moe_rl.metrics import Max, Mean, Sum
from moe_rl.monitor.router_grad import rollout_flip_aliases
from moe_rl.routing.provenance import Provenance, apply_stale_policy
from moe_rl.routing.record import RouteBatch, RouteHeader, missing_id, validate
from moe_rl.step import drift
from moe_rl.step.plan import StepPlan
from moe_rl.types import RolloutBatch, TrainBatch


def rollout_routes(batch: RolloutBatch, header: RouteHeader) -> RouteBatch:
    """The engine's per-sample route tensors (and their provenance) as one jagged batch, checked at
    ingest. Route records live on the host (a few bytes per token; the replay layout is index
    arithmetic done there and moved to the router's device once per micro-batch): one copy per step
    from an engine on a GPU."""
    prompt_lens_B = batch.prompt_lens_B.cpu()
    prov = None if batch.route_prov is None else Provenance.cat(batch.route_prov).cpu()
    routes = RouteBatch(
        torch.cat(batch.routes).cpu(),
        torch.tensor([r.shape[0] for r in batch.routes], dtype=torch.int64, device="cpu"),
        torch.zeros_like(prompt_lens_B),
        prompt_lens_B.clone(),
        header,
        prov,
    )
    validate(routes, prompt_lens_B + batch.response_lens_B.cpu(), header)
    return routes


def stale_routes(
    batch: RolloutBatch, routes: RouteBatch, policy: str
) -> tuple[RolloutBatch, RouteBatch, dict]:
    """``routing.stale_rows`` (``apply_stale_policy``) on the checked routes: the batch (a dropped
    sample's response mask cleared: it leaves the loss), the routes to replay, and the counts."""
    version_BS = None if batch.version_BS is None else batch.version_BS.cpu()
    ids_NLK, keep_B, metrics = apply_stale_policy(
        routes.ids_NLK,
        routes.prov,
        routes.sample_N,
        routes.position_N,
        version_BS,
        policy,
        missing_id(routes.header.dtype),
    )
    if not bool(keep_B.all()):
        mask_BS = batch.response_mask_BS & keep_B.to(batch.response_mask_BS.device)[:, None]
        # the cleared tokens are no longer generated ones: version 0, as every other masked position
        # (check_versions' rule; an async run's first dropped sample failed it)
        v_BS = batch.version_BS
        batch = dataclasses.replace(
            batch,
            response_mask_BS=mask_BS,
            version_BS=None if v_BS is None else torch.where(mask_BS, v_BS, torch.zeros_like(v_BS)),
        )
    return batch, dataclasses.replace(routes, ids_NLK=ids_NLK), metrics


class OldPass(NamedTuple):
    """The old-log-prob pass and what it ran on (the rollout on the learner's device)."""

    batch: RolloutBatch
    tb: TrainBatch  # tokens, lengths, DVP / exact-KL inputs and the rollout's routes
    out: LogprobOutput
    lag_BS: torch.Tensor  # int64 [B, S], each generated token's version lag (0 elsewhere)
    num_lags: int  # 1 + the largest lag over the data-parallel ranks: the per-lag metrics' keys
    route_metrics: dict = {}  # routing.stale_rows' counts (``stale_routes``)


def version_lags(batch: RolloutBatch, learner_version: int, dp_group) -> tuple[torch.Tensor, int]:
    """Each generated token's lag behind ``learner_version`` (0 without ``version_BS``: the engine
    holds the learner's weights), and 1 + the largest lag over the data-parallel ranks (one tiny
    MAX all-reduce), so every rank files the same per-lag keys."""
    mask_BS = batch.response_mask_BS
    if batch.version_BS is None:
        lags_BS = torch.zeros_like(mask_BS, dtype=torch.int64)
    else:
        check_versions(batch.version_BS, mask_BS, learner_version)
        lags_BS = lag_BS(batch.version_BS, mask_BS, learner_version)
    top = lags_BS.max().reshape(1) if lags_BS.numel() else torch.zeros(1, dtype=torch.int64)
    if dist.is_initialized():
        top = top.to(comm_device(dp_group))
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=dp_group)
    return lags_BS, int(top) + 1


def old_logprobs(plan: StepPlan, learner: Learner, batch: RolloutBatch, learner_version: int = 1) -> OldPass:
    """The learner's pass over the rollout, on the learner's device (an engine may hand its batch
    over on another: vLLM's is on the host). ``learner_version``: the version of the learner's
    weights (step t: ``weight_version(t)`` = t + 1), against which ``batch.version_BS`` gives
    each token's lag."""
    batch = batch.to(learner.device)
    seq_lens_B = batch.prompt_lens_B + batch.response_lens_B
    turns = plan.agent_turns if batch.turn_BS is not None else 0
    # before a dropped sample's mask is cleared: the turns of its rows come from it
    turn_BS = route_turn_BS(batch.turn_BS, batch.response_mask_BS, seq_lens_B) if turns else None
    routes = rollout_routes(batch, learner.route_header)
    batch, routes, route_metrics = stale_routes(batch, routes, plan.stale_rows)
    inputs = drift.token_inputs(plan.correction, plan.support, batch)
    lags_BS, num_lags = version_lags(batch, learner_version, learner.dims.dp_group)
    tb = TrainBatch(
        batch.tokens_BS,
        seq_lens_B,
        safe_BSV=inputs.safe_BSV,
        rollout_dist_BSV=inputs.rollout_dist_BSV,
        routes=routes,
        route_lag_BS=route_lag_BS(lags_BS, batch.prompt_lens_B, seq_lens_B),
        route_turn_BS=turn_BS,
    )
    # router flips by lag, and by turn in agent runs
    old_plan = dataclasses.replace(plan.replay.old_pass, num_lags=num_lags, num_turns=turns)
    out = learner.forward_logprobs(tb, plan.sampling.temperature, plan.micro_batch_size, old_plan)
    return OldPass(batch, tb, out, lags_BS, num_lags, route_metrics)


def prepare_batch(
    plan: StepPlan, learner: Learner, old: OldPass, rewards_B: torch.Tensor
) -> tuple[TrainBatch, dict]:
    """Correction tensors and advantages: the batch the update consumes, and the step's metrics."""
    batch, st, routing = old.batch, old.out.stats, old.out.routing
    rewards_B, mask_BS = rewards_B.to(learner.device), batch.response_mask_BS
    corr, corr_metrics = drift.drift_tensors(
        plan.correction, st.logp_BS, batch.logprobs_BS, mask_BS, learner.dims.dp_group, st.exact_kl_BS
    )
    # OTB weights its energies by the squared rollout IS weights when rollout IS is on (docs/math.md 6.2)
    adv_inputs = {"logp_BS": st.logp_BS, "sum_pi_sq_BS": st.sum_pi_sq_BS, "is_weights_BS": corr.is_weights_BS}
    adv_BS, metrics = estimate_advantages(plan.advantage, rewards_B, batch.group_B, mask_BS, adv_inputs)
    metrics.update(routing.metrics)
    metrics.update(old.route_metrics)
    if plan.replay.monitor:
        metrics.update(rollout_flip_aliases(routing.metrics))
    metrics.update(variance_proxies(adv_BS, mask_BS, st.sum_pi_sq_BS, st.logp_BS, corr.is_weights_BS))
    metrics.update({**corr_metrics, **drift.dvp_batch_metrics(plan.correction, batch, st)})
    tb = old.tb.replace(
        loss_mask_BS=mask_BS,
        old_logp_BS=st.logp_BS,
        advantages_BS=adv_BS,
        rollout_logp_BS=batch.logprobs_BS,
        is_weights_BS=corr.is_weights_BS,
        keep_BS=corr.keep_BS,
        routes=plan.replay.update_routes(old.tb.routes, routing.recorded),
        # the update passes compare their routing with the old pass's (update-induced flips)
        old_routes=routing.recorded if plan.replay.monitor else None,
        route_lag_BS=None,  # the old pass's flips by lag are measured; the update's are not split
        route_turn_BS=None,
    )
    metrics.update(mismatch_metrics(st.logp_BS, batch.logprobs_BS, st.entropy_BS, mask_BS))
    # by version lag (docs/math.md 2.7): the staleness histogram and the rollout -> old k3 per lag
    metrics.update(lag_metrics(old.lag_BS, mask_BS, old.num_lags))
    metrics.update(k3_by_lag(st.logp_BS, batch.logprobs_BS, old.lag_BS, mask_BS, old.num_lags))
    if plan.agent_turns and batch.turn_BS is not None:  # the same, by assistant turn
        turn_BS = batch.turn_BS.to(mask_BS.device)
        metrics.update(
            lag_k3_by_turn(st.logp_BS, batch.logprobs_BS, old.lag_BS, turn_BS, mask_BS, plan.agent_turns)
        )
    return tb, metrics


def reference_logprobs(plan: StepPlan, learner: Learner, tb: TrainBatch) -> TrainBatch:
    """The reference policy's log-probs (the KL term), on the policy's support and, under
    ``routing.replay_reference``, the update's routes; the batch as given when the term is off."""
    if not plan.reference:
        return tb
    ref_plan = plan.replay.reference_pass
    ref_batch = TrainBatch(
        tb.tokens_BS, tb.seq_lens_B, safe_BSV=tb.safe_BSV, routes=tb.routes if ref_plan else None
    )
    ref = learner.forward_logprobs(
        ref_batch, plan.sampling.temperature, plan.micro_batch_size, ref_plan, reference=True
    )
    return tb.replace(ref_logp_BS=ref.stats.logp_BS)


def mismatch_metrics(
    old_logp_BS: torch.Tensor, rollout_logp_BS: torch.Tensor, entropy_BS: torch.Tensor, mask_BS: torch.Tensor
) -> dict:
    """Training-inference mismatch on the sampled tokens (pi_train = the learner's pi_old here)."""
    m = mask_BS.float()
    diff_BS = (old_logp_BS - rollout_logp_BS).abs() * m
    return {
        **offpolicy_metrics(old_logp_BS, rollout_logp_BS, mask_BS),
        "train/entropy": Mean((entropy_BS * m).sum(), m.sum()),
        "train/loss_tokens": Sum(m.sum()),  # the tokens the loss trains (multi-turn: assistant only)
        "corr/logprob_abs_diff": Mean(diff_BS.sum(), m.sum()),
        "corr/logprob_abs_diff_max": Max(diff_BS.max()),
    }


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
        **batch.engine_metrics,
    }
