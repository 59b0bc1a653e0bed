"""dist tier: the megatron learner with tensor parallelism (TP=2, sequence parallel, experts split
over expert-TP as megatron defaults) over gloo against TP=1 (DP=2, both ranks on the same data) on
the same canonical weights. One spawn of 2 ranks runs every check (the import costs ~10 s).

Checked, TP=2 vs TP=1: vocab-parallel log-probs, entropy and sum pi^2; gradients in canonical
names after the DP/TP reduction; routes recorded under sequence parallelism (gathered back
over TP); replay of the recorded routes (no flips, same log-probs) and of forced random routes
(same log-probs, same agreement metrics: the per-rank sequence blocks sum to the whole); the
router-gradient monitor's metrics; one optimizer step (distributed optimizer) and the exported
weights after it. Micro-batch lengths are odd on purpose: they are padded to a multiple of TP.

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

MODEL = ModelConfig(vocab_size=50, hidden_size=64, num_layers=3, num_attention_heads=4, num_query_groups=2,
                    head_dim=16, ffn_hidden_size=96, moe_ffn_hidden_size=48, num_experts=4,
                    moe_router_topk=2, first_k_dense=1, max_seq_len=32)


def _data(odd: bool = True):
    """The same batch on every rank (TP ranks share their data; the TP=1 reference runs it twice).

    ``odd``: micro-batches of 4 have odd longest lengths (13, 11), padded under TP. The update
    batch has even ones: the router monitor counts padding rows too, which TP would add."""
    g = torch.Generator().manual_seed(100)
    lens_B = torch.tensor([13, 9, 12, 5, 11, 7] if odd else [14, 9, 12, 5, 12, 7])
    pos_S = torch.arange(14)
    tokens_BS = torch.where(pos_S[None] < lens_B[:, None], torch.randint(3, MODEL.vocab_size, (6, 14), generator=g), 0)
    mask_BS = (pos_S[None] >= 3) & (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, mask_BS








def _run(learner, par_opt: ParallelConfig, ctx, weights) -> dict:
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
    tokens_BS, lens_B, mask_BS = _data(odd=False)
    forced_routes = random_routes(lens_B, learner.route_header)
    update = TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)
    _, routing = learner.forward_backward(update.replace(routes=forced_routes), nll_entropy_loss, 0.8, 4, REPLAY)
    update_metrics = means(routing.metrics, "routing/")
    grads = learner.canonical_grads()
    monitor = learner.router_monitor_metrics()

    # adam_eps well above the gradients' rounding: Adam's first step is ~lr * sign(g) and would
    # turn a 1e-9 difference of a near-zero gradient into a difference of lr
    stepper = Learner(MODEL, par_opt, OptimConfig(lr=LR, adam_eps=1e-4), ctx, weights, monitor=False)
    stepper.update(update, nll_entropy_loss, 0.8, 4, lr=LR)
    after = stepper.export_canonical()
    return {"logp": native.logp_BS, "entropy": native.entropy_BS, "spi": native.sum_pi_sq_BS,
            "recorded": recorded.ids_NLK, "recorded_rows": recorded.rows_B, "r2_logp": r2.logp_BS,
            "r2_metrics": r2_metrics, "forced_logp": forced.logp_BS, "forced_metrics": forced_metrics,
            "update_metrics": update_metrics,
            "grads": grads, "monitor": monitor, "after": after}


def _compare(tp: dict, ref: dict) -> dict:
    def max_diff(key):
        return float((tp[key] - ref[key]).abs().max())

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    mon_keys = [k for k in ref["monitor"] if ref["monitor"][k] == ref["monitor"][k]]  # not NaN

    def mon_ref(k):  # the reference's DP ranks each divide by twice the tokens (the batch runs twice)
        return ref["monitor"][k] * (2 if "logit_grad_norm" in k or "grad_mass" in k else 1)
    return {
        "logp_diff": max_diff("logp"), "ent_diff": max_diff("entropy"), "spi_diff": max_diff("spi"),
        "r2_logp_diff": max_diff("r2_logp"), "forced_logp_diff": max_diff("forced_logp"),
        "forced_vs_native": float((ref["forced_logp"] - ref["logp"]).abs().max()),
        "recorded_equal": torch.equal(tp["recorded"], ref["recorded"]) and torch.equal(tp["recorded_rows"],
                                                                                        ref["recorded_rows"]),
        "r2_flip": tp["r2_metrics"]["routing/flip_router_frac"],
        "forced_metrics_diff": max(abs(tp["forced_metrics"][k] - v) for k, v in ref["forced_metrics"].items()),
        "same_metric_keys": sorted(tp["forced_metrics"]) == sorted(ref["forced_metrics"]),
        "forced_flip": tp["forced_metrics"]["routing/flip_router_frac"],
        "update_metrics_diff": max(abs(tp["update_metrics"][k] - v) for k, v in ref["update_metrics"].items()),
        "same_grad_keys": sorted(tp["grads"]) == sorted(ref["grads"]), "num_grad_keys": len(ref["grads"]),
        "grad_rel": max(rel(tp["grads"][k], ref["grads"][k]) for k in ref["grads"]),
        "monitor_rel": max(abs(tp["monitor"][k] - mon_ref(k)) / max(abs(mon_ref(k)), 1e-12) for k in mon_keys),
        "monitor_keys": sorted(tp["monitor"]) == sorted(ref["monitor"]) and len(mon_keys) > 10,
        "step_diff": max(float((tp["after"][k] - ref["after"][k]).abs().max()) for k in ref["after"]),
    }


def _vocab_parallel_autograd(rank: int, group) -> dict:
    """token_logprobs_energy_vocab_parallel against the full-vocabulary function, float64: values
    and the gradient every rank gets for its vocabulary slice (loss using all three outputs)."""
    from moe_rl.learner.logprobs import (
        token_logprobs_energy,
        token_logprobs_energy_vocab_parallel,
    )

    g = torch.Generator().manual_seed(0)
    full_BSV = torch.randn(3, 5, 10, generator=g, dtype=torch.float64) * 2
    tokens_BS = torch.randint(0, 10, (3, 5), generator=g)
    local_BSV = full_BSV[..., rank * 5:(rank + 1) * 5].clone().requires_grad_()
    full_BSV.requires_grad_()
    outs = token_logprobs_energy_vocab_parallel(local_BSV, tokens_BS, 0.8, rank * 5, group)
    refs = token_logprobs_energy(full_BSV, tokens_BS, 0.8)
    for out in (outs, refs):
        (out[0].sum() + 0.3 * out[1].sum() + 0.7 * out[2].sum()).backward()
    return {"value_diff": max(float((a - b).abs().max()) for a, b in zip(outs, refs)),
            "grad_diff": float((local_BSV.grad - full_BSV.grad[..., rank * 5:(rank + 1) * 5]).abs().max())}


def _worker(rank: int):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.rollout.builtin_model import random_canonical_weights

    weights = random_canonical_weights(MODEL, seed=0)
    par = ParallelConfig(nproc=2, tensor_parallel=2, expert_parallel=1, distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    assert (ctx.tp_size, ctx.dp_size) == (2, 1)
    autograd = _vocab_parallel_autograd(rank, ps.get_tensor_model_parallel_group())
    tp = Learner(MODEL, par, OptimConfig(lr=LR), ctx, weights)
    mlp = tp.gpt.decoder.layers[1].mlp
    shapes = {"output": tuple(tp.gpt.output_layer.weight.shape),
              "expert_fc1": tuple(mlp.experts.local_experts[0].linear_fc1.weight.shape),
              "sequence_parallel": tp.tcfg.sequence_parallel}
    tp_out = _run(tp, ParallelConfig(nproc=2, tensor_parallel=2, expert_parallel=1), ctx, weights)
    exported = tp.export_canonical()
    tokens_BS, lens_B, _ = _data()
    try:  # TP ranks given different batches fail closed instead of mixing them
        tp.forward_logprobs(TrainBatch(tokens_BS + rank, lens_B), 1.0, 4)
        mismatch_error = None
    except RuntimeError as e:
        mismatch_error = str(e)
    export_exact = sorted(exported) == sorted(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    RouterReplay.clear_global_router_replay_instances()
    ctx1 = reference_dims()
    ref = Learner(MODEL, ParallelConfig(nproc=2, expert_parallel=1, distributed_optimizer=False),
                  OptimConfig(lr=LR), ctx1, weights)
    ref_out = _run(ref, ParallelConfig(nproc=2, expert_parallel=1), ctx1, weights)
    result = {**_compare(tp_out, ref_out), **shapes, "export_exact": export_exact, "autograd": autograd,
              "mismatch_error": mismatch_error}
    dist.shutdown()
    return result


@pytest.mark.dist
def test_tp2_matches_tp1():
    results = run_ranks(_worker, 2)
    print({k: v for k, v in results[0].items() if k.endswith(("diff", "rel"))})
    for rank, r in enumerate(results):
        assert r["sequence_parallel"] and r["output"] == (MODEL.vocab_size // 2, MODEL.hidden_size), r
        assert r["expert_fc1"] == (MODEL.moe_ffn_hidden_size, MODEL.hidden_size), r  # 2F / ETP rows
        assert r["export_exact"], (rank, r)
        assert r["mismatch_error"] and "different token batches" in r["mismatch_error"], (rank, r)
        assert r["autograd"]["value_diff"] < 1e-12 and r["autograd"]["grad_diff"] < 1e-12, (rank, r)
        assert r["logp_diff"] < LOGP_TOL and r["ent_diff"] < LOGP_TOL and r["spi_diff"] < LOGP_TOL, (rank, r)
        assert r["recorded_equal"], (rank, r)
        assert r["r2_flip"] == 0.0 and r["r2_logp_diff"] < LOGP_TOL, (rank, r)
        assert r["forced_vs_native"] > 1e-3, (rank, r)  # forcing random experts really changes the output
        assert r["forced_logp_diff"] < LOGP_TOL and r["forced_flip"] > 0.1, (rank, r)
        assert r["same_metric_keys"] and r["forced_metrics_diff"] < 1e-6, (rank, r)
        assert r["update_metrics_diff"] < 1e-6, (rank, r)
        assert r["same_grad_keys"] and r["num_grad_keys"] > 30, (rank, r)
        assert r["grad_rel"] < GRAD_RTOL, (rank, r)
        assert r["monitor_keys"] and r["monitor_rel"] < 1e-5, (rank, r)
        assert r["step_diff"] < STEP_TOL, (rank, r)
