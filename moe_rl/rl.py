"""The named steps the training loop calls: engine construction, seeds, batch preparation
(old log-probs, advantages), the policy update, and rollout metrics.

Shape suffixes: B sequences, S positions.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from moe_rl import rollout_correction
from moe_rl.advantages import extra_inputs, get_advantage
from moe_rl.config import RunConfig
from moe_rl.corrections import derive_metrics
from moe_rl.corrections.importance import offpolicy_metrics
from moe_rl.learner import checkpoint
from moe_rl.lr import LengthLRScheduler, scheduled_lr
from moe_rl.metrics import Max, Mean, Sum, merge_metrics
from moe_rl.monitor.router_grad import rollout_flip_aliases
from moe_rl.routing.record import RouteBatch, RouteHeader, validate
from moe_rl.tasks import CharTokenizer
from moe_rl.types import RolloutBatch, SamplingParams
from moe_rl.variance import finalize_variance_proxies, variance_proxies

log = logging.getLogger(__name__)


def step_seed(seed: int, step: int, dp_rank: int, stream: int) -> int:
    """A seed per (run seed, step, data-parallel rank, use): a resumed run redraws the same
    prompts and samples without storing any RNG state."""
    return ((seed * 1_000_003 + step) * 1_009 + dp_rank) * 8 + stream


def build_engine(cfg: RunConfig, tok: CharTokenizer):
    """The rollout engine rollout.engine names: builtin (CPU or small GPU models) or vllm (CUDA)."""
    if cfg.rollout.engine == "vllm":
        from moe_rl.rollout.vllm_engine import VllmEngine

        return VllmEngine(cfg, cfg.model, pad_id=tok.pad_id)
    from moe_rl.rollout.builtin import BuiltinEngine

    return BuiltinEngine(cfg.model, dtype=cfg.rollout.dtype, pad_id=tok.pad_id,
                         router_logit_noise=cfg.rollout.router_noise)


# replay mode of the old-log-prob pass, per routing.replay
OLD_PASS_MODE = {"off": "observe", "r2": "record", "r3": "replay"}


def rollout_routes(batch: RolloutBatch, header: RouteHeader) -> RouteBatch:
    """The engine's per-sample route tensors as one jagged batch, checked at ingest."""
    routes = RouteBatch(torch.cat(batch.routes), torch.tensor([r.shape[0] for r in batch.routes]),
                        torch.zeros_like(batch.prompt_lens_B), batch.prompt_lens_B.clone(), header)
    validate(routes, batch.prompt_lens_B + batch.response_lens_B, header)
    return routes


def sampling(cfg: RunConfig, tok: CharTokenizer | None) -> SamplingParams:
    r, c = cfg.rollout, cfg.correction
    exact_trm = c.trm_on and c.trm_kl == "exact"
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                          top_k=r.top_k, stop_token_ids=(tok.eos_id,) if tok else (),
                          dvp_threshold=c.dvp_threshold, dvp_rule=c.dvp_rule,
                          return_dist=exact_trm or c.dvp_threshold > 0)


def maybe_resume(cfg: RunConfig, learner, run_dir: Path, lr_sched: LengthLRScheduler) -> int:
    """The first step to run: 0, or the step after the last checkpoint when resuming."""
    if not cfg.resume:
        return 0
    path = checkpoint.latest(run_dir / "checkpoints")
    if path is None:
        raise FileNotFoundError(f"resume=true but {run_dir}/checkpoints has no checkpoint")
    state = checkpoint.load(learner, path)
    lr_sched.load_state_dict(state["length_lr"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def progress(cfg: RunConfig, start: int, ctx) -> tqdm:
    return tqdm(total=cfg.steps, initial=start, desc="rl", unit="step", dynamic_ncols=True,
                disable=not (ctx.is_main and cfg.log.progress_bar))


def response_ids(batch: RolloutBatch, pad_id: int) -> torch.Tensor:
    """The generated tokens of each sequence, left-aligned and right-padded: int64 [B, R]."""
    r_max = int(batch.response_lens_B.max())
    idx_BR = batch.prompt_lens_B[:, None] + torch.arange(r_max)[None, :]
    valid_BR = torch.arange(r_max)[None, :] < batch.response_lens_B[:, None]
    idx_BR = idx_BR.clamp(max=batch.tokens_BS.shape[1] - 1)
    return torch.where(valid_BR, batch.tokens_BS.gather(1, idx_BR), torch.full_like(idx_BR, pad_id))


def prepare(cfg: RunConfig, learner, batch: RolloutBatch, rewards_B: torch.Tensor):
    """Old (and reference) log-probs and advantages: the tensors the update consumes."""
    a, temp = cfg.algo, cfg.rollout.temperature
    seq_lens_B = batch.prompt_lens_B + batch.response_lens_B
    mask_BS = batch.response_mask_BS
    rollout = rollout_routes(batch, learner.route_header)
    replay = cfg.routing.replay
    inputs_BS = rollout_correction.token_inputs(cfg.correction, batch, sampling(cfg, None).logprob_support)
    monitor = cfg.log.router_monitor
    old = learner.forward_logprobs(batch.tokens_BS, seq_lens_B, temp, a.micro_batch_size, routes=rollout,
                                   replay_mode=OLD_PASS_MODE[replay], token_inputs=inputs_BS, keep_native=monitor)
    old_logp_BS, entropy_BS, sum_pi_sq_BS = old.logp, old.entropy, old.sum_pi_sq
    route_metrics = learner.replay.metrics()
    old_routes = learner.replay.recorded() if monitor or replay == "r2" else None
    # the routes the update (and reference) passes replay: R2 the old policy's, R3 the rollout's
    routes = {"off": None, "r2": old_routes, "r3": rollout}[replay]
    corr_tensors, corr_metrics = rollout_correction.prepare(cfg.correction, old_logp_BS, batch.logprobs_BS,
                                                            mask_BS, learner.dp_group, old.extra.get("exact_kl"))
    estimator = get_advantage(a.advantage)
    # OTB weights its energies by the squared rollout IS weights when rollout IS is on (math.md 6.2)
    inputs = {"logp_BS": old_logp_BS, "sum_pi_sq_BS": sum_pi_sq_BS, "is_weights_BS": corr_tensors.get("is_weights")}
    adv_BS, metrics = estimator(rewards_B, batch.group_B, mask_BS, std_norm=a.grpo_std_norm,
                                **extra_inputs(estimator, inputs))
    metrics.update(route_metrics)
    if monitor:
        metrics.update(rollout_flip_aliases(route_metrics))
    metrics.update(variance_proxies(adv_BS, mask_BS, sum_pi_sq_BS, old_logp_BS, corr_tensors.get("is_weights")))
    tb = {"tokens": batch.tokens_BS, "loss_mask": mask_BS, "old_logp": old_logp_BS, "advantages": adv_BS,
          "rollout_logp": batch.logprobs_BS, **corr_tensors, **inputs_BS}
    metrics.update({**corr_metrics, **rollout_correction.dvp_batch_metrics(cfg.correction, batch, old)})
    if routes is not None:
        tb["routes"] = routes
    if monitor:  # the update passes compare their routing with the old pass's (update-induced flips)
        tb["old_routes"] = old_routes
    if a.kl_coef > 0:
        ref_mode = "replay" if routes is not None and cfg.routing.replay_reference else None
        ref_inputs = {k: v for k, v in inputs_BS.items() if k == "safe"}  # the same support as the policy
        tb["ref_logp"] = learner.forward_logprobs(batch.tokens_BS, seq_lens_B, temp, a.micro_batch_size,
                                                  reference=True, routes=routes if ref_mode else None,
                                                  replay_mode=ref_mode, token_inputs=ref_inputs).logp
    m = mask_BS.float()
    diff_BS = (old_logp_BS - batch.logprobs_BS).abs() * m
    # training-inference mismatch on the sampled tokens (pi_train = the learner's pi_old here)
    metrics.update(offpolicy_metrics(old_logp_BS, batch.logprobs_BS, mask_BS))
    metrics.update({
        "train/entropy": Mean((entropy_BS * m).sum(), m.sum()),
        "corr/logprob_abs_diff": Mean(diff_BS.sum(), m.sum()),
        "corr/logprob_abs_diff_max": Max(diff_BS.max()),
    })
    return {**tb, "seq_lens": seq_lens_B}, metrics


def learning_rate(cfg: RunConfig, scheduler: LengthLRScheduler, step: int, batch: RolloutBatch,
                  dp_group) -> tuple[float, dict, list[dict]]:
    """This step's LR: the base schedule times the response-length decay multiplier, which sees
    the global mean response length of this step's rollouts (one tiny all-reduce)."""
    stats = torch.stack([batch.response_lens_B.double().sum(), torch.tensor(float(batch.num_seqs))])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats, group=dp_group)
    multiplier, events = scheduler.update(step, float(stats[0] / stats[1]))
    lr = scheduled_lr(step, cfg.steps, cfg.optim, multiplier, cfg.optim.length_lr.min_lr)
    return lr, scheduler.metrics() if cfg.optim.length_lr.enabled else {}, events


def finalize(reduced: dict[str, float]) -> dict[str, float]:
    """Metrics that are functions of globally reduced ones (after reduce_metrics)."""
    return derive_metrics(finalize_variance_proxies(reduced, reduced["train/grad_norm"]))


def update(cfg: RunConfig, learner, tb: dict[str, torch.Tensor], lr: float) -> dict:
    """algo.num_minibatches optimizer steps over the batch (split by whole prompt groups)."""
    a = cfg.algo
    loss_fn = rollout_correction.loss_fn(cfg.correction, a)
    seq_lens_B = tb.pop("seq_lens")
    replay_mode = "replay" if "routes" in tb else "observe" if "old_routes" in tb else None
    merged: dict = {}
    grad_norms = []
    for idx_B in torch.arange(seq_lens_B.shape[0]).chunk(a.num_minibatches):
        mb = {k: v.select(idx_B) if isinstance(v, RouteBatch) else v[idx_B] for k, v in tb.items()}
        opt_metrics, per_micro = learner.update(mb, seq_lens_B[idx_B], loss_fn, cfg.rollout.temperature,
                                                a.micro_batch_size, lr, replay_mode)
        grad_norms.append(opt_metrics["train/grad_norm"])
        for m in [*per_micro, learner.replay.metrics() if replay_mode else {}]:
            merged = merge_metrics(merged, m)
    # grad norms are global already (identical on every rank): plain numbers
    merged["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    merged["train/grad_norm_max"] = max(grad_norms)
    merged["train/lr"] = lr
    merged.update(learner.router_monitor_metrics())  # one all-reduce for the whole step
    return merged


def rollout_metrics(batch: RolloutBatch) -> dict:
    lens_B = batch.response_lens_B.float()
    n = torch.tensor(float(batch.num_seqs))
    return {
        "rollout/response_len_mean": Mean(lens_B.sum(), n),
        "rollout/response_len_max": Max(lens_B.max()),
        "rollout/finished_frac": Mean(batch.finished_B.float().sum(), n),
        "rollout/num_seqs": Sum(n),
        "rollout/num_response_tokens": Sum(lens_B.sum()),
    }
