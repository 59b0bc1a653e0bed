"""dist tier: the megatron learner with pipeline parallelism (PP=2: stage 0 holds the embedding and
layers 0-1, stage 1 layers 2-3, the output layer and the loss; megatron's 1F1B schedule with p2p
over gloo) against PP=1 (DP=2, both ranks on the same data) on the same canonical weights. One
spawn of 2 ranks runs every check.

Checked, PP=2 vs PP=1, on both stages (every stage must return the same values): log-probs,
entropy and sum pi^2 (broadcast from the last stage); gradients in canonical names (gathered
from the owning stages); routes recorded per stage and joined; replay of the recorded routes (no
flips, same log-probs) and of forced random routes (same log-probs, same agreement metrics, the
same keys on both stages); per-micro-batch loss metrics; the router-gradient monitor's metrics;
one optimizer step (distributed optimizer): reported gradient norm and weights after it; a dist
checkpoint save + load round trip (weights equal, and the next step equal to the saver's).
Micro-batches have different lengths (the stages exchange shapes).

Tolerances (fp32): log-probs / entropy / sum pi^2 max |diff| < 1e-5; gradients max relative
diff < 1e-5 per tensor; weights after one Adam step max |diff| < 1e-6 (lr 1e-3)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.learner.parallel_cases import (
    GRAD_RTOL,
    LOGP_TOL,
    LR,
    RECORD,
    REPLAY,
    STEP_TOL,
    means,
    nll_entropy_loss,
    random_routes,
    reference_dims,
)

MODEL = ModelConfig(vocab_size=50, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                    head_dim=16, ffn_hidden_size=96, moe_ffn_hidden_size=48, num_experts=4,
                    moe_router_topk=2, first_k_dense=1, max_seq_len=32)


def _data():
    """The same batch on every rank; micro-batches of 4 are 13 and 11 long."""
    g = torch.Generator().manual_seed(100)
    lens_B = torch.tensor([13, 9, 12, 5, 11, 7])
    pos_S = torch.arange(14)
    tokens_BS = torch.where(pos_S[None] < lens_B[:, None], torch.randint(3, MODEL.vocab_size, (6, 14), generator=g), 0)
    mask_BS = (pos_S[None] >= 3) & (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, mask_BS




def _full_vocab_inputs(batch):
    """DVP safe sets and rollout distributions (generated positions >= 3), as the engine reports them."""
    g = torch.Generator().manual_seed(400)
    B, S, V = *batch.tokens_BS.shape, MODEL.vocab_size
    safe_BSV = torch.rand(B, S, V, generator=g) < 0.7
    dist_BSV = torch.log_softmax(torch.randn(B, S, V, generator=g), -1) * (torch.arange(S) >= 3)[None, :, None]
    return batch.replace(safe_BSV=safe_BSV, rollout_dist_BSV=dist_BSV)






def _run(learner, par_opt: ParallelConfig, ctx, weights, ckpt_dir: str | None) -> dict:
    from moe_rl.learner import checkpoint
    from moe_rl.learner.learner import Learner

    tokens_BS, lens_B, mask_BS = _data()
    plain = TrainBatch(tokens_BS, lens_B)
    out = learner.forward_logprobs(plain, 0.8, micro_batch_size=4, plan=RECORD)
    native, recorded = out.stats, out.routing.recorded
    out = learner.forward_logprobs(plain.replace(routes=recorded), 0.8, 4, REPLAY)
    r2, r2_metrics = out.stats, means(out.routing.metrics, "routing/")
    forced_routes = random_routes(lens_B, learner.route_header)
    out = learner.forward_logprobs(plain.replace(routes=forced_routes), 0.8, 4, REPLAY)
    forced, forced_metrics = out.stats, means(out.routing.metrics, "routing/")
    full_vocab = learner.forward_logprobs(_full_vocab_inputs(plain), 0.8, 4).stats
    loss_metrics, routing = learner.forward_backward(plain.replace(loss_mask_BS=mask_BS, routes=forced_routes),
                                                     nll_entropy_loss, 0.8, 4, REPLAY)
    update_metrics = means(routing.metrics, "routing/")
    grads = learner.canonical_grads()
    monitor = learner.router_monitor_metrics()

    # adam_eps well above the gradients' rounding (see test_learner_tp.py)
    optim = OptimConfig(lr=LR, adam_eps=1e-4)
    stepper = Learner(MODEL, par_opt, optim, ctx, weights, monitor=False)
    batch = plain.replace(loss_mask_BS=mask_BS)
    grad_norm = stepper.update(batch, nll_entropy_loss, 0.8, 4, lr=LR).grad_norm
    after = {k: v.clone() for k, v in stepper.export_canonical().items()}  # (views of the live weights)
    ckpt = {}
    if ckpt_dir is not None:  # save, load into a fresh learner, then one more step on both
        path = checkpoint.save(stepper, ckpt_dir, 1, {"seed": 0})
        loaded = Learner(MODEL, par_opt, optim, ctx, weights, monitor=False)
        checkpoint.load(loaded, path)
        back = loaded.export_canonical()
        ckpt["load_diff"] = max(float((back[k] - after[k]).abs().max()) for k in after)
        for lrn in (stepper, loaded):
            lrn.update(batch, nll_entropy_loss, 0.8, 4, lr=LR)
        a, b = stepper.export_canonical(), loaded.export_canonical()
        ckpt["resume_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    extra = {k: v for k, v in full_vocab.fields().items() if k in ("exact_kl_BS", "full_logp_BS", "log_safe_mass_BS")}
    return {"logp": native.logp_BS, "entropy": native.entropy_BS, "spi": native.sum_pi_sq_BS,
            "recorded": recorded.ids_NLK, "recorded_rows": recorded.rows_B, "r2_logp": r2.logp_BS,
            "r2_metrics": r2_metrics, "forced_logp": forced.logp_BS, "dvp_logp": full_vocab.logp_BS, "extra": extra,
            "forced_metrics": forced_metrics, "update_metrics": update_metrics,
            "loss_metrics": [means(m, "train/") for m in loss_metrics], "grads": grads, "monitor": monitor,
            "after": after, "grad_norm": grad_norm, "ckpt": ckpt}


def _compare(pp: dict, ref: dict) -> dict:
    def max_diff(key):
        return float((pp[key] - ref[key]).abs().max())

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    mon_keys = [k for k in ref["monitor"] if ref["monitor"][k] == ref["monitor"][k]]  # not NaN

    def mon_ref(k):  # the reference's DP ranks each divide by twice the tokens (the batch runs twice)
        return ref["monitor"][k] * (2 if "logit_grad_norm" in k or "grad_mass" in k else 1)

    def metrics_diff(key):
        return max(abs(pp[key][k] - v) for k, v in ref[key].items())
    return {
        "logp_diff": max_diff("logp"), "ent_diff": max_diff("entropy"), "spi_diff": max_diff("spi"),
        "r2_logp_diff": max_diff("r2_logp"), "dvp_logp_diff": max_diff("dvp_logp"),
        "extra_diff": max(float((pp["extra"][k] - v).abs().max()) for k, v in ref["extra"].items()),
        "extra_keys": sorted(pp["extra"]) == sorted(ref["extra"]) == ["exact_kl_BS", "full_logp_BS", "log_safe_mass_BS"], "forced_logp_diff": max_diff("forced_logp"),
        "forced_vs_native": float((ref["forced_logp"] - ref["logp"]).abs().max()),
        "recorded_equal": torch.equal(pp["recorded"], ref["recorded"]) and torch.equal(pp["recorded_rows"],
                                                                                        ref["recorded_rows"]),
        "r2_flip": pp["r2_metrics"]["routing/flip_router_frac"],
        "forced_metrics_diff": metrics_diff("forced_metrics"),
        "same_metric_keys": sorted(pp["forced_metrics"]) == sorted(ref["forced_metrics"]),
        "num_metric_keys": len(pp["forced_metrics"]),
        "forced_flip": pp["forced_metrics"]["routing/flip_router_frac"],
        "update_metrics_diff": metrics_diff("update_metrics"),
        "same_update_keys": sorted(pp["update_metrics"]) == sorted(ref["update_metrics"]),
        "loss_metrics_diff": max(abs(a[k] - b[k]) for a, b in zip(pp["loss_metrics"], ref["loss_metrics"]) for k in b),
        "num_loss_metrics": len(pp["loss_metrics"]),
        "same_grad_keys": sorted(pp["grads"]) == sorted(ref["grads"]), "num_grad_keys": len(ref["grads"]),
        "grad_rel": max(rel(pp["grads"][k], ref["grads"][k]) for k in ref["grads"]),
        "monitor_rel": max(abs(pp["monitor"][k] - mon_ref(k)) / max(abs(mon_ref(k)), 1e-12) for k in mon_keys),
        "monitor_keys": sorted(pp["monitor"]) == sorted(ref["monitor"]) and len(mon_keys) > 10,
        "grad_norm_rel": abs(pp["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
        "step_diff": max(float((pp["after"][k] - ref["after"][k]).abs().max()) for k in ref["after"]),
        "same_after_keys": sorted(pp["after"]) == sorted(ref["after"]),
    }


def _recompute_grads(par: ParallelConfig, ctx, weights) -> dict:
    """The replayed update pass with full activation recomputation (routes served again from the
    FIFO while 1F1B interleaves micro-batches): gradients as without it."""
    import dataclasses

    from moe_rl.learner.learner import Learner

    learner = Learner(dataclasses.replace(MODEL, recompute=True), par, OptimConfig(lr=LR), ctx, weights, monitor=False)
    tokens_BS, lens_B, mask_BS = _data()
    routes = random_routes(lens_B, learner.route_header)
    learner.forward_backward(TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS, routes=routes), nll_entropy_loss,
                             0.8, 2, REPLAY)
    return learner.canonical_grads()


def _worker(rank: int, ckpt_dir: str, world: int, ep: int):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    weights = random_canonical_weights(MODEL, seed=0)
    par = ParallelConfig(nproc=world, pipeline_parallel=2, expert_parallel=ep, distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    assert (ctx.dp_size, ctx.ep_size, ps.get_pipeline_model_parallel_world_size()) == (world // 2, ep, 2)
    pp = Learner(MODEL, par, OptimConfig(lr=LR), ctx, weights)
    stage = {"stage": ps.get_pipeline_model_parallel_rank(), "layers": len(pp.gpt.decoder.layers),
             "embedding": hasattr(pp.gpt, "embedding"), "output": hasattr(pp.gpt, "output_layer"),
             "moe_hooks": pp.replay.layer_ids}
    pp_out = _run(pp, ParallelConfig(nproc=world, pipeline_parallel=2, expert_parallel=ep), ctx, weights, ckpt_dir)
    exported = pp.export_canonical()
    recompute = _recompute_grads(par, ctx, weights)
    recompute_rel = max(float((recompute[k] - pp_out["grads"][k]).abs().max() / pp_out["grads"][k].abs().max())
                        for k in pp_out["grads"])
    export_exact = sorted(exported) == sorted(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)
    tokens_BS, lens_B, _ = _data()
    try:  # pipeline stages given different batches fail closed
        pp.forward_logprobs(TrainBatch(tokens_BS + rank, lens_B), 1.0, 4)
        mismatch_error = None
    except RuntimeError as e:
        mismatch_error = str(e)

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    RouterReplay.clear_global_router_replay_instances()
    ctx1 = reference_dims()
    ref = Learner(MODEL, ParallelConfig(nproc=world, expert_parallel=ep, distributed_optimizer=False),
                  OptimConfig(lr=LR), ctx1, weights)
    ref_out = _run(ref, ParallelConfig(nproc=world, expert_parallel=ep), ctx1, weights, None)
    result = {**_compare(pp_out, ref_out), **stage, **pp_out["ckpt"], "export_exact": export_exact, "recompute_rel": recompute_rel,
              "mismatch_error": mismatch_error}
    dist.shutdown()
    return result


@pytest.mark.dist
@pytest.mark.parametrize("world, ep", [(2, 1), (4, 2)])  # (4, 2): DP=2 per stage, experts split over EP=2
def test_pp2_matches_pp1(tmp_path, world, ep):
    results = run_ranks(_worker, world, str(tmp_path / "ckpt"), world, ep)
    print({k: v for k, v in results[0].items() if k.endswith(("diff", "rel"))})
    stages = [results[0], results[-1]]  # megatron puts PP outermost: the first ranks are stage 0
    assert [r["moe_hooks"] for r in stages] == [[1], [2, 3]], results
    assert [(r["embedding"], r["output"], r["layers"]) for r in stages] == [(True, False, 2), (False, True, 2)]
    for rank, r in enumerate(results):
        assert r["export_exact"], (rank, r)
        assert r["mismatch_error"] and "different token batches" in r["mismatch_error"], (rank, r)
        assert r["logp_diff"] < LOGP_TOL and r["ent_diff"] < LOGP_TOL and r["spi_diff"] < LOGP_TOL, (rank, r)
        assert r["recorded_equal"], (rank, r)
        assert r["r2_flip"] == 0.0 and r["r2_logp_diff"] < LOGP_TOL, (rank, r)
        assert r["forced_vs_native"] > 1e-3, (rank, r)  # forcing random experts really changes the output
        assert r["forced_logp_diff"] < LOGP_TOL and r["forced_flip"] > 0.1, (rank, r)
        assert r["extra_keys"] and r["dvp_logp_diff"] < LOGP_TOL and r["extra_diff"] < LOGP_TOL, (rank, r)
        assert r["recompute_rel"] < GRAD_RTOL, (rank, r)
        assert r["same_metric_keys"] and r["num_metric_keys"] > 8 and r["forced_metrics_diff"] < 1e-6, (rank, r)
        assert r["same_update_keys"] and r["update_metrics_diff"] < 1e-6, (rank, r)
        assert r["num_loss_metrics"] == 2 and r["loss_metrics_diff"] < 1e-5, (rank, r)
        assert r["same_grad_keys"] and r["num_grad_keys"] > 40, (rank, r)
        assert r["grad_rel"] < GRAD_RTOL, (rank, r)
        assert r["monitor_keys"] and r["monitor_rel"] < 1e-5, (rank, r)
        assert r["grad_norm_rel"] < 1e-5, (rank, r)
        assert r["same_after_keys"] and r["step_diff"] < STEP_TOL, (rank, r)
        assert r["load_diff"] == 0.0 and r["resume_diff"] == 0.0, (rank, r)
