"""What the TP, PP and combined-layout learner tests share: tolerances, the batch, forced random
routes, the loss, the routing passes, the optimizer step with its checkpoint round trip, the
single-rank reference and the comparison against it.

Tolerances (fp32): log-probs / entropy / sum pi^2 max |diff| < LOGP_TOL; gradients max relative
diff < GRAD_RTOL per tensor; weights after one Adam step (lr LR) max |diff| < STEP_TOL."""

from __future__ import annotations

import torch

from moe_rl.config import OptimConfig
from moe_rl.metrics import Mean
from moe_rl.routing.replay_plan import PassMode, PassPlan

LOGP_TOL = 1e-5
GRAD_RTOL = 1e-5
STEP_TOL = 1e-6
LR = 1e-3
ODD_LENS = (13, 9, 12, 5, 11, 7)  # micro-batches of 4: longest 13 and 11, padded under TP
EVEN_LENS = (14, 9, 12, 5, 12, 7)


def batch_data(vocab_size: int, lens: tuple[int, ...] = ODD_LENS):
    """The same batch on every rank: 6 sequences of random ids >= 3 (seeded) in 14 positions,
    pad 0 after ``lens``; loss positions >= 3. Returns tokens_BS, lens_B, mask_BS."""
    g = torch.Generator().manual_seed(100)
    lens_B = torch.tensor(lens)
    pos_S = torch.arange(14)
    tokens_BS = torch.where(
        pos_S[None] < lens_B[:, None], torch.randint(3, vocab_size, (6, 14), generator=g), 0
    )
    mask_BS = (pos_S[None] >= 3) & (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, mask_BS


def random_routes(lens_B: torch.Tensor, header):
    """Distinct random experts for every recorded row (prompts of 2 tokens), seeded."""
    from moe_rl.routing.record import RouteBatch

    g = torch.Generator().manual_seed(300)
    rows_B = lens_B - 1
    ids_NLK = torch.rand(int(rows_B.sum()), len(header.layer_ids), header.num_experts, generator=g).argsort(
        -1
    )[..., : header.top_k]
    B = lens_B.shape[0]
    return RouteBatch(
        ids_NLK.to(torch.uint8), rows_B, torch.zeros(B, dtype=torch.int64), torch.full((B,), 2), header
    )


def nll_entropy_loss(mb, st, normalizer):
    """NLL with an entropy bonus, so the entropy's (vocab-parallel) gradient is checked too."""
    m, logp_BS, entropy_BS = mb.loss_mask_BS, st.logp_BS, st.entropy_BS
    loss = (-(logp_BS * m).sum() - 0.1 * (entropy_BS * m).sum()) / normalizer
    return loss, {"train/nll": Mean(-(logp_BS * m).sum().detach(), m.sum())}


REPLAY, RECORD = PassPlan(PassMode.REPLAY), PassPlan(PassMode.RECORD)


def reference_dims():
    """The dimensions of a single-rank-model reference after megatron's parallel state was rebuilt."""
    from moe_rl.dist import ParallelDims

    return ParallelDims.from_parallel_state()


def means(metrics: dict, prefix: str) -> dict[str, float]:
    return {k: float(v.sum / v.count) for k, v in metrics.items() if k.startswith(prefix)}


def routing_passes(learner, plain) -> tuple[dict, object, object]:
    """A recording pass, the replay of its routes (R2) and of forced random routes (micro-batches
    of 4, T 0.8): their stats and agreement metrics, the recorded and the forced routes."""
    out = learner.forward_logprobs(plain, 0.8, micro_batch_size=4, plan=RECORD)
    native, recorded = out.stats, out.routing.recorded
    out = learner.forward_logprobs(plain.replace(routes=recorded), 0.8, 4, REPLAY)
    r2, r2_metrics = out.stats, means(out.routing.metrics, "routing/")
    forced_routes = random_routes(plain.seq_lens_B, learner.route_header)
    out = learner.forward_logprobs(plain.replace(routes=forced_routes), 0.8, 4, REPLAY)
    forced, forced_metrics = out.stats, means(out.routing.metrics, "routing/")
    got = {
        "logp": native.logp_BS,
        "entropy": native.entropy_BS,
        "spi": native.sum_pi_sq_BS,
        "recorded": recorded.ids_NLK,
        "recorded_rows": recorded.rows_B,
        "r2_logp": r2.logp_BS,
        "r2_metrics": r2_metrics,
        "forced_logp": forced.logp_BS,
        "forced_metrics": forced_metrics,
    }
    return got, recorded, forced_routes


def update_pass(learner, batch) -> dict:
    """The replayed update pass (loss and gradients, micro-batches of 4, T 0.8): its agreement
    and loss metrics, the gradients in canonical names, the router monitor's metrics."""
    loss_metrics, routing = learner.forward_backward(batch, nll_entropy_loss, 0.8, 4, REPLAY)
    return {
        "update_metrics": means(routing.metrics, "routing/"),
        "grads": learner.canonical_grads(),
        "monitor": learner.router_monitor_metrics(),
        "loss_metrics": [means(m, "train/") for m in loss_metrics],
    }


def step_and_resume(model, par_opt, ctx, weights, batch, ckpt_dir: str | None) -> dict:
    """One optimizer step on a fresh learner: the gradient norm and the weights after it; with
    ``ckpt_dir``, save, load into another fresh learner, one more step on both: their differences."""
    from moe_rl.learner import checkpoint
    from moe_rl.learner.learner import Learner

    # adam_eps well above the gradients' rounding: Adam's first step is ~lr * sign(g) and would
    # turn a 1e-9 difference of a near-zero gradient into a difference of lr
    optim = OptimConfig(lr=LR, adam_eps=1e-4)
    stepper = Learner(model, par_opt, optim, ctx, weights, monitor=False)
    grad_norm = stepper.update(batch, nll_entropy_loss, 0.8, 4, lr=LR).grad_norm
    after = {k: v.clone() for k, v in stepper.export_canonical().items()}  # (views of the live weights)
    ckpt = {}
    if ckpt_dir is not None:
        path = checkpoint.save(stepper, ckpt_dir, 1, {"seed": 0})
        loaded = Learner(model, par_opt, optim, ctx, weights, monitor=False)
        checkpoint.load(loaded, path)
        back = loaded.export_canonical()
        ckpt["load_diff"] = max(float((back[k] - after[k]).abs().max()) for k in after)
        for lrn in (stepper, loaded):
            lrn.update(batch, nll_entropy_loss, 0.8, 4, lr=LR)
        a, b = stepper.export_canonical(), loaded.export_canonical()
        ckpt["resume_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    return {"after": after, "grad_norm": grad_norm, "ckpt": ckpt}


def exported_exactly(exported: dict, weights: dict) -> bool:
    return sorted(exported) == sorted(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)


def single_rank_reference(ep: int = 1):
    """Rebuild megatron's parallel state as TP = PP = 1 (EP ``ep``) for the reference model: its dims."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    RouterReplay.clear_global_router_replay_instances()
    return reference_dims()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def compare_common(got: dict, ref: dict, dp_ratio: int, real_BS: torch.Tensor | None = None) -> dict:
    """The differences every layout test checks. ``dp_ratio``: how many times more data-parallel
    ranks the reference has; ``real_BS``: compare log-probs on these positions only (None: all)."""

    def masked(d_BS):
        return d_BS if real_BS is None else d_BS * real_BS

    def max_diff(key):
        return float(masked(got[key] - ref[key]).abs().max())

    def metrics_diff(key):
        return max(abs(got[key][k] - v) for k, v in ref[key].items())

    mon_keys = [k for k in ref["monitor"] if ref["monitor"][k] == ref["monitor"][k]]  # not NaN

    def mon_ref(k):  # each reference DP rank divides by its share of (dp_ratio times) more tokens
        return ref["monitor"][k] * (dp_ratio if "logit_grad_norm" in k or "grad_mass" in k else 1)

    def mon_rel(k):
        return abs(got["monitor"][k] - mon_ref(k)) / max(abs(mon_ref(k)), 1e-12)

    out = {
        "logp_diff": max_diff("logp"),
        "ent_diff": max_diff("entropy"),
        "spi_diff": max_diff("spi"),
        "r2_logp_diff": max_diff("r2_logp"),
        "forced_logp_diff": max_diff("forced_logp"),
        "forced_vs_native": float(masked(ref["forced_logp"] - ref["logp"]).abs().max()),
        "recorded_equal": torch.equal(got["recorded"], ref["recorded"])
        and torch.equal(got["recorded_rows"], ref["recorded_rows"]),
        "r2_flip": got["r2_metrics"]["routing/flip_router_frac"],
        "forced_metrics_diff": metrics_diff("forced_metrics"),
        "same_metric_keys": sorted(got["forced_metrics"]) == sorted(ref["forced_metrics"]),
        "num_metric_keys": len(got["forced_metrics"]),
        "forced_flip": got["forced_metrics"]["routing/flip_router_frac"],
        "update_metrics_diff": metrics_diff("update_metrics"),
        "same_update_keys": sorted(got["update_metrics"]) == sorted(ref["update_metrics"]),
        "same_grad_keys": sorted(got["grads"]) == sorted(ref["grads"]),
        "num_grad_keys": len(ref["grads"]),
        "grad_rel": max(rel_diff(got["grads"][k], ref["grads"][k]) for k in ref["grads"]),
        "monitor_worst": max(mon_keys, key=mon_rel),
        "monitor_rel": max(mon_rel(k) for k in mon_keys),
        "monitor_keys": sorted(got["monitor"]) == sorted(ref["monitor"]) and len(mon_keys) > 10,
        "step_diff": max(float((got["after"][k] - ref["after"][k]).abs().max()) for k in ref["after"]),
        "same_after_keys": sorted(got["after"]) == sorted(ref["after"]),
    }
    if "loss_metrics" in ref:
        out["loss_metrics_diff"] = max(
            abs(a[k] - b[k]) for a, b in zip(got["loss_metrics"], ref["loss_metrics"]) for k in b
        )
        out["num_loss_metrics"] = len(got["loss_metrics"])
    if "grad_norm" in ref:
        out["grad_norm_rel"] = abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    return out


def check_stepped_layout(r: dict, rank: int) -> None:
    """What the PP and combined-layout tests assert on every rank's ``compare_common`` result
    (with loss metrics, grad norm and the checkpoint round trip of ``step_and_resume``)."""
    assert r["logp_diff"] < LOGP_TOL and r["ent_diff"] < LOGP_TOL and r["spi_diff"] < LOGP_TOL, (rank, r)
    assert r["recorded_equal"], (rank, r)
    assert r["r2_flip"] == 0.0 and r["r2_logp_diff"] < LOGP_TOL, (rank, r)
    assert r["forced_vs_native"] > 1e-3, (rank, r)  # forcing random experts really changes the output
    assert r["forced_logp_diff"] < LOGP_TOL and r["forced_flip"] > 0.1, (rank, r)
    assert r["same_metric_keys"] and r["num_metric_keys"] > 8 and r["forced_metrics_diff"] < 1e-6, (rank, r)
    assert r["same_update_keys"] and r["update_metrics_diff"] < 1e-6, (rank, r)
    assert r["num_loss_metrics"] == 2 and r["loss_metrics_diff"] < 1e-5, (rank, r)
    assert r["same_grad_keys"] and r["num_grad_keys"] > 40, (rank, r)
    assert r["grad_rel"] < GRAD_RTOL, (rank, r)
    assert r["monitor_keys"] and r["monitor_rel"] < 1e-5, (rank, r)
    assert r["grad_norm_rel"] < 1e-5, (rank, r)
    assert r["same_after_keys"] and r["step_diff"] < STEP_TOL, (rank, r)
    assert r["load_diff"] == 0.0 and r["resume_diff"] == 0.0, (rank, r)
