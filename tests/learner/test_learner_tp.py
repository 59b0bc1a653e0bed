"""dist tier: the megatron learner with tensor parallelism (TP=2, sequence parallel, experts split
over expert-TP as megatron defaults) over gloo against TP=1 (DP=2, both ranks on the same data) on
the same canonical weights. One spawn of 2 ranks runs every check (the import costs ~10 s).

Checked, TP=2 vs TP=1: vocab-parallel log-probs, entropy and sum pi^2 (OTB's energy input); with
the engine's full-vocabulary DVP safe sets and rollout distributions in the batch, each rank on
its vocabulary slice: the DVP log-prob, full log-prob, log safe mass and exact KL, and the
gradients of a loss on the DVP log-prob; gradients in canonical names after the DP/TP reduction;
routes recorded under sequence parallelism (gathered back
over TP); replay of the recorded routes (no flips, same log-probs) and of forced random routes
(same log-probs, same agreement metrics: the per-rank sequence blocks sum to the whole); the
router-gradient monitor's metrics; one optimizer step (distributed optimizer) and the exported
weights after it. Micro-batch lengths are odd on purpose: they are padded to a multiple of TP.

The vocab-parallel functions alone (float64, 2 slices of 5) against their full-vocabulary forms:
values and each slice's gradient, with safe sets empty on one slice or on both, and sampled tokens
outside the safe set.

Tolerances (fp32): log-probs / entropy / sum pi^2 / DVP / exact KL max |diff| < 1e-5; gradients max relative
diff < 1e-5 per tensor; weights after one Adam step max |diff| < 1e-6 (lr 1e-3)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.learner.parallel_cases import (
    EVEN_LENS,
    GRAD_RTOL,
    LOGP_TOL,
    LR,
    ODD_LENS,
    REPLAY,
    STEP_TOL,
    batch_data,
    compare_common,
    exported_exactly,
    nll_entropy_loss,
    random_routes,
    rel_diff,
    routing_passes,
    single_rank_reference,
    step_and_resume,
    update_pass,
)
from tests.models import TINY_MOE_L3 as MODEL


def _data(odd: bool = True):
    """The same batch on every rank (TP ranks share their data; the TP=1 reference runs it twice).

    ``odd``: micro-batches of 4 have odd longest lengths (13, 11), padded under TP. The update
    batch has even ones: the router monitor counts padding rows too, which TP would add."""
    return batch_data(MODEL.vocab_size, ODD_LENS if odd else EVEN_LENS)


def _full_vocab_inputs(batch):
    """DVP safe sets and rollout distributions at the generated positions (>= 3; zeros elsewhere,
    as the engine reports them). Some positions have no safe token on one vocabulary half (one TP
    rank's slice); ~30% of the sampled tokens are outside the safe set."""
    g = torch.Generator().manual_seed(400)
    B, S, V = *batch.tokens_BS.shape, MODEL.vocab_size
    pos_S = torch.arange(S)
    gen_BS1 = ((pos_S[None] >= 3) & (pos_S[None] < batch.seq_lens_B[:, None]))[..., None]
    safe_BSV = (torch.rand(B, S, V, generator=g) < 0.7) & gen_BS1
    safe_BSV[0::2, 4:6, : V // 2] = False
    safe_BSV[1::2, 6:8, V // 2 :] = False
    dist_BSV = torch.log_softmax(torch.randn(B, S, V, generator=g), -1) * gen_BS1
    return batch.replace(safe_BSV=safe_BSV, rollout_dist_BSV=dist_BSV)


def _run(learner, par_opt: ParallelConfig, ctx, weights) -> dict:
    tokens_BS, lens_B, mask_BS = _data()
    plain = TrainBatch(tokens_BS, lens_B)
    got, recorded, _ = routing_passes(learner, plain)
    tokens_BS, lens_B, mask_BS = _data(odd=False)
    forced_routes = random_routes(lens_B, learner.route_header)
    update = TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)
    got.update(update_pass(learner, update.replace(routes=forced_routes)))
    # DVP and exact KL on vocabulary shards; then a loss on the DVP log-prob (st.logp_BS)
    full_vocab = learner.forward_logprobs(
        _full_vocab_inputs(plain).replace(routes=recorded), 0.8, 4, REPLAY
    ).stats
    learner.forward_backward(
        _full_vocab_inputs(update).replace(routes=forced_routes), nll_entropy_loss, 0.8, 4, REPLAY
    )
    dvp_grads = learner.canonical_grads()
    after = step_and_resume(MODEL, par_opt, ctx, weights, update, None)["after"]
    return {**got, "full_vocab": full_vocab.fields(), "dvp_grads": dvp_grads, "after": after}


def _compare(tp: dict, ref: dict) -> dict:
    def inf_aware_diff(a, b):  # -inf (an empty safe set, a token outside it) must match exactly
        fin = torch.isfinite(b)
        return float((a[fin] - b[fin]).abs().max()) if torch.equal(a[~fin], b[~fin]) else math.inf

    # the reference's DP ranks each run the batch twice (DP = world, TP = 1)
    return {
        **compare_common(tp, ref, 2),
        "full_vocab_keys": sorted(tp["full_vocab"]) == sorted(ref["full_vocab"]) == sorted(FULL_VOCAB_STATS),
        "full_vocab_diff": {k: inf_aware_diff(tp["full_vocab"][k], v) for k, v in ref["full_vocab"].items()},
        "dvp_counts": _dvp_counts(ref["full_vocab"]),
        "dvp_vs_plain_grad": max(rel_diff(ref["dvp_grads"][k], ref["grads"][k]) for k in ref["grads"]),
        "dvp_grad_rel": max(rel_diff(tp["dvp_grads"][k], ref["dvp_grads"][k]) for k in ref["dvp_grads"]),
    }


FULL_VOCAB_STATS = (
    "logp_BS",
    "entropy_BS",
    "sum_pi_sq_BS",
    "full_logp_BS",
    "log_safe_mass_BS",
    "exact_kl_BS",
)


def _dvp_counts(st: dict) -> dict:
    """Generated tokens of the DVP batch whose log-prob the safe set changes, that are outside
    it, with a positive KL; positions without a safe set (prompts: log safe mass -inf)."""
    _, _, gen_BS = _data()
    restricted_BS = (st["logp_BS"] - st["full_logp_BS"]).abs() > 1e-3
    return {
        "restricted": int((restricted_BS & (st["logp_BS"] != 0) & gen_BS).sum()),
        "outside": int(((st["logp_BS"] == 0) & gen_BS).sum()),
        "empty": int(torch.isinf(st["log_safe_mass_BS"]).sum()),
        "kl_positive": int(((st["exact_kl_BS"] > 1e-3) & gen_BS).sum()),
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
    local_BSV = full_BSV[..., rank * 5 : (rank + 1) * 5].clone().requires_grad_()
    full_BSV.requires_grad_()
    outs = token_logprobs_energy_vocab_parallel(local_BSV, tokens_BS, 0.8, rank * 5, group)
    refs = token_logprobs_energy(full_BSV, tokens_BS, 0.8)
    for out in (outs, refs):
        (out[0].sum() + 0.3 * out[1].sum() + 0.7 * out[2].sum()).backward()
    return {
        "value_diff": max(float((a - b).abs().max()) for a, b in zip(outs, refs)),
        "grad_diff": float((local_BSV.grad - full_BSV.grad[..., rank * 5 : (rank + 1) * 5]).abs().max()),
    }


def _vocab_parallel_corrections(rank: int, group) -> dict:
    """restricted_logprobs_vocab_parallel and exact_kl_tokens_vocab_parallel against the
    full-vocabulary functions, float64, 2 slices of 5: values (-inf where the full ones have it),
    and each slice's gradient of a loss on every finite DVP output."""
    from moe_rl.corrections.dvp import restricted_logprobs
    from moe_rl.corrections.trm import exact_kl_tokens
    from moe_rl.learner.logprobs import (
        exact_kl_tokens_vocab_parallel,
        restricted_logprobs_vocab_parallel,
    )

    g = torch.Generator().manual_seed(1)
    B, S, V, half = 3, 6, 10, 5
    cols = slice(rank * half, (rank + 1) * half)
    full_BSV = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2
    tokens_BS = torch.randint(0, V, (B, S), generator=g)
    safe_BSV = torch.rand(B, S, V, generator=g) < 0.5
    safe_BSV[0, 0, :half], safe_BSV[0, 0, half:] = False, True  # rank 0's slice has no safe token
    safe_BSV[0, 1, half:], safe_BSV[0, 1, 2] = False, True  # rank 1's slice has none
    safe_BSV[1, 2] = False  # none at all
    local_BSV = full_BSV[..., cols].clone().requires_grad_()
    full_BSV.requires_grad_()
    outs = restricted_logprobs_vocab_parallel(local_BSV, safe_BSV[..., cols], tokens_BS, rank * half, group)
    refs = restricted_logprobs(full_BSV, safe_BSV, tokens_BS)
    for r in (outs, refs):
        lsm_BS = r.log_safe_mass_BS
        (
            torch.where(r.inside_BS, r.logp_BS, 0).sum()
            + 0.5 * r.full_logp_BS.sum()
            + 0.3 * torch.where(torch.isfinite(lsm_BS), lsm_BS, 0).sum()
        ).backward()
    diffs, same_inf = [], True
    for a, b in zip(outs[:3], refs[:3]):
        fin = torch.isfinite(b.detach())
        same_inf &= torch.equal(a.detach()[~fin], b.detach()[~fin])
        diffs.append(float((a - b).detach()[fin].abs().max()))
    roll_BSV = torch.log_softmax(torch.randn(B, S, V, generator=g, dtype=torch.float64), -1)
    mask_BS = torch.rand(B, S, generator=g) < 0.7
    kl_BS = exact_kl_tokens_vocab_parallel(
        roll_BSV[..., cols], full_BSV[..., cols].detach(), group, mask_BS, chunk_tokens=4
    )  # several chunks
    kl_ref_BS = exact_kl_tokens(roll_BSV, full_BSV.detach(), mask_BS)
    return {
        "value_diff": max(diffs),
        "same_inf": same_inf,
        "inside_equal": torch.equal(outs.inside_BS, refs.inside_BS),
        "inside": int(refs.inside_BS.sum()),
        "outside": int((~refs.inside_BS).sum()),
        "empty": int(torch.isinf(refs.log_safe_mass_BS).sum()),
        "grad_diff": float((local_BSV.grad - full_BSV.grad[..., cols]).abs().max()),
        "kl_diff": float((kl_BS - kl_ref_BS).abs().max()),
        "kl_min": float(kl_ref_BS[mask_BS].min()),
        "kl_masked_out_zero": bool((kl_BS[~mask_BS] == 0).all()) and int((~mask_BS).sum()) > 0,
    }


def _worker(rank: int):
    from megatron.core import parallel_state as ps

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    weights = random_canonical_weights(MODEL, seed=0)
    par = ParallelConfig(nproc=2, tensor_parallel=2, expert_parallel=1, distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    assert (ctx.tp_size, ctx.dp_size) == (2, 1)
    autograd = _vocab_parallel_autograd(rank, ps.get_tensor_model_parallel_group())
    corrections = _vocab_parallel_corrections(rank, ps.get_tensor_model_parallel_group())
    tp = Learner(MODEL, par, OptimConfig(lr=LR), ctx, weights)
    mlp = tp.gpt.decoder.layers[1].mlp
    shapes = {
        "output": tuple(tp.gpt.output_layer.weight.shape),
        "expert_fc1": tuple(mlp.experts.local_experts[0].linear_fc1.weight.shape),
        "sequence_parallel": tp.tcfg.sequence_parallel,
    }
    tp_out = _run(tp, ParallelConfig(nproc=2, tensor_parallel=2, expert_parallel=1), ctx, weights)
    exported = tp.export_canonical()
    tokens_BS, lens_B, _ = _data()
    try:  # TP ranks given different batches fail closed instead of mixing them
        tp.forward_logprobs(TrainBatch(tokens_BS + rank, lens_B), 1.0, 4)
        mismatch_error = None
    except RuntimeError as e:
        mismatch_error = str(e)
    export_exact = exported_exactly(exported, weights)

    ctx1 = single_rank_reference()
    ref = Learner(
        MODEL,
        ParallelConfig(nproc=2, expert_parallel=1, distributed_optimizer=False),
        OptimConfig(lr=LR),
        ctx1,
        weights,
    )
    ref_out = _run(ref, ParallelConfig(nproc=2, expert_parallel=1), ctx1, weights)
    result = {
        **_compare(tp_out, ref_out),
        **shapes,
        "export_exact": export_exact,
        "autograd": autograd,
        "corrections": corrections,
        "mismatch_error": mismatch_error,
    }
    dist.shutdown()
    return result


@pytest.mark.dist
def test_tp2_matches_tp1():
    results = run_ranks(_worker, 2)
    print(
        {k: v for k, v in results[0].items() if k.endswith(("diff", "rel", "counts", "corrections", "grad"))}
    )
    for rank, r in enumerate(results):
        assert r["sequence_parallel"] and r["output"] == (MODEL.vocab_size // 2, MODEL.hidden_size), r
        assert r["expert_fc1"] == (MODEL.moe_ffn_hidden_size, MODEL.hidden_size), r  # 2F / ETP rows
        assert r["export_exact"], (rank, r)
        assert r["mismatch_error"] and "different token batches" in r["mismatch_error"], (rank, r)
        assert r["autograd"]["value_diff"] < 1e-12 and r["autograd"]["grad_diff"] < 1e-12, (rank, r)
        c = r["corrections"]
        assert c["value_diff"] < 1e-12 and c["grad_diff"] < 1e-12 and c["same_inf"] and c["inside_equal"], (
            rank,
            c,
        )
        assert c["inside"] >= 5 and c["outside"] >= 5 and c["empty"] == 1, (rank, c)
        assert c["kl_diff"] < 1e-5 and c["kl_min"] > 0.1 and c["kl_masked_out_zero"], (rank, c)  # (fp32 KL)
        assert r["logp_diff"] < LOGP_TOL and r["ent_diff"] < LOGP_TOL and r["spi_diff"] < LOGP_TOL, (rank, r)
        assert r["recorded_equal"], (rank, r)
        assert r["r2_flip"] == 0.0 and r["r2_logp_diff"] < LOGP_TOL, (rank, r)
        assert r["forced_vs_native"] > 1e-3, (rank, r)  # forcing random experts really changes the output
        assert r["forced_logp_diff"] < LOGP_TOL and r["forced_flip"] > 0.1, (rank, r)
        assert r["same_metric_keys"] and r["forced_metrics_diff"] < 1e-6, (rank, r)
        assert r["update_metrics_diff"] < 1e-6, (rank, r)
        assert r["same_grad_keys"] and r["num_grad_keys"] > 30, (rank, r)
        assert r["grad_rel"] < GRAD_RTOL, (rank, r)
        assert r["full_vocab_keys"] and max(r["full_vocab_diff"].values()) < LOGP_TOL, (rank, r)
        n = r["dvp_counts"]
        assert n["restricted"] > 20 and n["outside"] > 10 and n["empty"] > 10 and n["kl_positive"] > 20, (
            rank,
            n,
        )
        assert r["dvp_vs_plain_grad"] > 1e-3 and r["dvp_grad_rel"] < GRAD_RTOL, (rank, r)
        assert r["monitor_keys"] and r["monitor_rel"] < 1e-5, (rank, r)
        assert r["step_diff"] < STEP_TOL, (rank, r)
