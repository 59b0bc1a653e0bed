"""dist tier: the learner on combined layouts (TP x EP with expert-TP 1 and 2, TP x PP,
PP x EP x TP on 8 ranks, uneven pipeline stages) over gloo, each against a single-rank model
(TP=PP=EP=1; DP = world, every rank on the same data) on the same canonical weights. One spawn per
layout runs every check.

Checked on every rank of the layout: log-probs, entropy and sum pi^2; routes recorded (under
sequence parallelism and per stage, joined back) equal to the reference's; replay of the recorded
routes (no flips, same log-probs) and of forced random routes (same log-probs, same agreement
metrics: per-rank sequence blocks, stages and DP ranks reduced over the right groups); the
update pass's agreement metrics and per-micro-batch loss metrics; gradients in canonical names;
the router-gradient monitor's metrics; one optimizer step (distributed optimizer) and the weights
after it; a dist-checkpoint save + load round trip; the weights exported exactly as loaded.

Tolerances: tests/learner/parallel_cases.py.
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 0  # 0: = tp (megatron's default)
    first: int = 0  # layers_in_first_stage
    num_layers: int = 4

    def par(self, distributed_optimizer: bool) -> ParallelConfig:
        return ParallelConfig(nproc=self.world, tensor_parallel=self.tp, pipeline_parallel=self.pp,
                              expert_parallel=self.ep, expert_tensor_parallel=self.etp,
                              layers_in_first_stage=self.first, distributed_optimizer=distributed_optimizer)

    @property
    def model(self) -> ModelConfig:
        return dataclasses.replace(MODEL, num_layers=self.num_layers)


LAYOUTS = {
    "tp2_ep2_etp1": Layout(4, tp=2, ep=2, etp=1),
    "tp2_ep2_etp2": Layout(4, tp=2, ep=2, etp=2),
    "tp2_pp2": Layout(4, tp=2, pp=2),
    "pp2_uneven_2_3": Layout(2, pp=2, first=2, num_layers=5),
    "pp2_ep2_tp2": Layout(8, tp=2, pp=2, ep=2, etp=1),
}


def _data(model: ModelConfig):
    """The same batch on every rank; micro-batches of 4 have odd longest lengths (13, 11), padded
    to a multiple of TP. Loss positions >= 3."""
    g = torch.Generator().manual_seed(100)
    lens_B = torch.tensor([13, 9, 12, 5, 11, 7])
    pos_S = torch.arange(14)
    tokens_BS = torch.where(pos_S[None] < lens_B[:, None], torch.randint(3, model.vocab_size, (6, 14), generator=g), 0)
    mask_BS = (pos_S[None] >= 3) & (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, mask_BS


def _run(learner, lay: Layout, ctx, weights, ckpt_dir: str | None) -> dict:
    from moe_rl.learner import checkpoint
    from moe_rl.learner.learner import Learner

    model = learner.model_cfg
    tokens_BS, lens_B, mask_BS = _data(model)
    plain = TrainBatch(tokens_BS, lens_B)
    out = learner.forward_logprobs(plain, 0.8, micro_batch_size=4, plan=RECORD)
    native, recorded = out.stats, out.routing.recorded
    out = learner.forward_logprobs(plain.replace(routes=recorded), 0.8, 4, REPLAY)
    r2, r2_metrics = out.stats, means(out.routing.metrics, "routing/")
    forced_routes = random_routes(lens_B, learner.route_header)
    out = learner.forward_logprobs(plain.replace(routes=forced_routes), 0.8, 4, REPLAY)
    forced, forced_metrics = out.stats, means(out.routing.metrics, "routing/")
    loss_metrics, routing = learner.forward_backward(plain.replace(loss_mask_BS=mask_BS, routes=forced_routes),
                                                     nll_entropy_loss, 0.8, 4, REPLAY)
    update_metrics = means(routing.metrics, "routing/")
    grads = learner.canonical_grads()
    monitor = learner.router_monitor_metrics()

    # adam_eps well above the gradients' rounding (see test_learner_tp.py)
    optim = OptimConfig(lr=LR, adam_eps=1e-4)
    par_opt = lay.par(distributed_optimizer=True)
    stepper = Learner(model, par_opt, optim, ctx, weights, monitor=False)
    batch = plain.replace(loss_mask_BS=mask_BS)
    grad_norm = stepper.update(batch, nll_entropy_loss, 0.8, 4, lr=LR).grad_norm
    after = {k: v.clone() for k, v in stepper.export_canonical().items()}
    ckpt = {}
    if ckpt_dir is not None:  # save, load into a fresh learner, then one more step on both
        path = checkpoint.save(stepper, ckpt_dir, 1, {"seed": 0})
        loaded = Learner(model, par_opt, optim, ctx, weights, monitor=False)
        checkpoint.load(loaded, path)
        back = loaded.export_canonical()
        ckpt["load_diff"] = max(float((back[k] - after[k]).abs().max()) for k in after)
        for lrn in (stepper, loaded):
            lrn.update(batch, nll_entropy_loss, 0.8, 4, lr=LR)
        a, b = stepper.export_canonical(), loaded.export_canonical()
        ckpt["resume_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    return {"logp": native.logp_BS, "entropy": native.entropy_BS, "spi": native.sum_pi_sq_BS,
            "recorded": recorded.ids_NLK, "recorded_rows": recorded.rows_B, "r2_logp": r2.logp_BS,
            "r2_metrics": r2_metrics, "forced_logp": forced.logp_BS, "forced_metrics": forced_metrics,
            "update_metrics": update_metrics, "loss_metrics": [means(m, "train/") for m in loss_metrics],
            "grads": grads, "monitor": monitor, "after": after, "grad_norm": grad_norm, "ckpt": ckpt}


def _compare(got: dict, ref: dict, lay: Layout) -> dict:
    tokens_BS, lens_B, _ = _data(MODEL)
    real_BS = torch.arange(tokens_BS.shape[1])[None] < lens_B[:, None]

    def max_diff(key):  # real tokens only: padding rows get pad routes spread over EP, which differs
        return float(((got[key] - ref[key]) * real_BS).abs().max())

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))

    mon_keys = [k for k in ref["monitor"] if ref["monitor"][k] == ref["monitor"][k]]  # not NaN
    dp_ratio = lay.tp * lay.pp  # the reference has world DP ranks, the layout world / (TP x PP)

    def mon_ref(k):  # each reference DP rank divides by its share of (dp_ratio times) more tokens
        return ref["monitor"][k] * (dp_ratio if "logit_grad_norm" in k or "grad_mass" in k else 1)

    def metrics_diff(key):
        return max(abs(got[key][k] - v) for k, v in ref[key].items())
    return {
        "logp_diff": max_diff("logp"), "ent_diff": max_diff("entropy"), "spi_diff": max_diff("spi"),
        "r2_logp_diff": max_diff("r2_logp"), "forced_logp_diff": max_diff("forced_logp"),
        "forced_vs_native": float(((ref["forced_logp"] - ref["logp"]) * real_BS).abs().max()),
        "recorded_equal": torch.equal(got["recorded"], ref["recorded"]) and torch.equal(got["recorded_rows"],
                                                                                         ref["recorded_rows"]),
        "r2_flip": got["r2_metrics"]["routing/flip_router_frac"],
        "forced_metrics_diff": metrics_diff("forced_metrics"),
        "same_metric_keys": sorted(got["forced_metrics"]) == sorted(ref["forced_metrics"]),
        "num_metric_keys": len(got["forced_metrics"]),
        "forced_flip": got["forced_metrics"]["routing/flip_router_frac"],
        "update_metrics_diff": metrics_diff("update_metrics"),
        "same_update_keys": sorted(got["update_metrics"]) == sorted(ref["update_metrics"]),
        "loss_metrics_diff": max(abs(a[k] - b[k]) for a, b in zip(got["loss_metrics"], ref["loss_metrics"]) for k in b),
        "num_loss_metrics": len(got["loss_metrics"]),
        "same_grad_keys": sorted(got["grads"]) == sorted(ref["grads"]), "num_grad_keys": len(ref["grads"]),
        "grad_rel": max(rel(got["grads"][k], ref["grads"][k]) for k in ref["grads"]),
        "monitor_worst": max(mon_keys, key=lambda k: abs(got["monitor"][k] - mon_ref(k)) / max(abs(mon_ref(k)), 1e-12)),
        "monitor_rel": max(abs(got["monitor"][k] - mon_ref(k)) / max(abs(mon_ref(k)), 1e-12) for k in mon_keys),
        "monitor_keys": sorted(got["monitor"]) == sorted(ref["monitor"]) and len(mon_keys) > 10,
        "grad_norm_rel": abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
        "step_diff": max(float((got["after"][k] - ref["after"][k]).abs().max()) for k in ref["after"]),
        "same_after_keys": sorted(got["after"]) == sorted(ref["after"]),
    }


def _worker(rank: int, ckpt_dir: str, lay: Layout):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    model = lay.model
    weights = random_canonical_weights(model, seed=0)
    par = lay.par(distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    learner = Learner(model, par, OptimConfig(lr=LR), ctx, weights)
    mlp = next(layer.mlp for layer in learner.gpt.decoder.layers if hasattr(layer.mlp, "experts"))
    shape = {"dims": (ctx.tp_size, ctx.pp_size, ctx.ep_size, ctx.etp_size, ctx.dp_size),
             "local_experts": len(mlp.experts.local_experts),
             "expert_fc1_rows": mlp.experts.local_experts[0].linear_fc1.weight.shape[0],
             "stage": ctx.pp_rank, "moe_hooks": learner.replay.layer_ids,
             "sequence_parallel": learner.tcfg.sequence_parallel}
    got = _run(learner, lay, ctx, weights, ckpt_dir)
    exported = learner.export_canonical()
    export_exact = sorted(exported) == sorted(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    RouterReplay.clear_global_router_replay_instances()
    ctx1 = reference_dims()
    ref_lay = Layout(lay.world, num_layers=lay.num_layers)
    ref = Learner(model, ref_lay.par(False), OptimConfig(lr=LR), ctx1, weights)
    ref_out = _run(ref, ref_lay, ctx1, weights, None)
    result = {**_compare(got, ref_out, lay), **shape, **got["ckpt"], "export_exact": export_exact}
    dist.shutdown()
    return result


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_rank(tmp_path, name):
    lay = LAYOUTS[name]
    results = run_ranks(_worker, lay.world, str(tmp_path / "ckpt"), lay)
    print(name, {k: v for k, v in results[0].items() if k.endswith(("diff", "rel"))})
    etp = lay.etp or lay.tp
    dp = lay.world // (lay.tp * lay.pp)
    for rank, r in enumerate(results):
        assert r["dims"] == (lay.tp, lay.pp, lay.ep, etp, dp), (rank, r["dims"])
        assert r["local_experts"] == MODEL.num_experts // lay.ep, (rank, r)
        assert r["expert_fc1_rows"] == 2 * MODEL.moe_ffn_hidden_size // etp, (rank, r)  # cat(gate, up) / ETP
        assert r["sequence_parallel"] == (lay.tp > 1)
        assert r["export_exact"], (rank, r)
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
    if lay.pp > 1:  # megatron puts PP outermost: the first world / PP ranks are stage 0
        stages = [results[0], results[-1]]
        assert [r["stage"] for r in stages] == [0, lay.pp - 1]
        first = lay.first or lay.num_layers // lay.pp
        assert stages[0]["moe_hooks"] == list(range(MODEL.first_k_dense, first))
        assert stages[1]["moe_hooks"] == list(range(lay.num_layers - (lay.num_layers - first) // (lay.pp - 1),
                                                    lay.num_layers))
