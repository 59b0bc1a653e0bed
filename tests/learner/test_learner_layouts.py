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
    LR,
    batch_data,
    check_stepped_layout,
    compare_common,
    exported_exactly,
    routing_passes,
    single_rank_reference,
    step_and_resume,
    update_pass,
)
from tests.models import TINY_MOE_L4 as MODEL


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
        return ParallelConfig(
            nproc=self.world,
            tensor_parallel=self.tp,
            pipeline_parallel=self.pp,
            expert_parallel=self.ep,
            expert_tensor_parallel=self.etp,
            layers_in_first_stage=self.first,
            distributed_optimizer=distributed_optimizer,
        )

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


def _run(learner, lay: Layout, ctx, weights, ckpt_dir: str | None) -> dict:
    tokens_BS, lens_B, mask_BS = batch_data(learner.model_cfg.vocab_size)
    plain = TrainBatch(tokens_BS, lens_B)
    got, _, forced_routes = routing_passes(learner, plain)
    got.update(update_pass(learner, plain.replace(loss_mask_BS=mask_BS, routes=forced_routes)))
    stepped = step_and_resume(
        learner.model_cfg,
        lay.par(distributed_optimizer=True),
        ctx,
        weights,
        plain.replace(loss_mask_BS=mask_BS),
        ckpt_dir,
    )
    return {**got, **stepped}


def _compare(got: dict, ref: dict, lay: Layout) -> dict:
    tokens_BS, lens_B, _ = batch_data(MODEL.vocab_size)
    real_BS = torch.arange(tokens_BS.shape[1])[None] < lens_B[:, None]
    # real tokens only: padding rows get pad routes spread over EP, which differs; the reference
    # has world DP ranks, the layout world / (TP x PP)
    return compare_common(got, ref, lay.tp * lay.pp, real_BS)


def _worker(rank: int, ckpt_dir: str, lay: Layout):
    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    model = lay.model
    weights = random_canonical_weights(model, seed=0)
    par = lay.par(distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    learner = Learner(model, par, OptimConfig(lr=LR), ctx, weights)
    mlp = next(layer.mlp for layer in learner.gpt.decoder.layers if hasattr(layer.mlp, "experts"))
    shape = {
        "dims": (ctx.tp_size, ctx.pp_size, ctx.ep_size, ctx.etp_size, ctx.dp_size),
        "local_experts": len(mlp.experts.local_experts),
        "expert_fc1_rows": mlp.experts.local_experts[0].linear_fc1.weight.shape[0],
        "stage": ctx.pp_rank,
        "moe_hooks": learner.replay.layer_ids,
        "sequence_parallel": learner.tcfg.sequence_parallel,
    }
    got = _run(learner, lay, ctx, weights, ckpt_dir)
    export_exact = exported_exactly(learner.export_canonical(), weights)

    ctx1 = single_rank_reference()
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
        check_stepped_layout(r, rank)
    if lay.pp > 1:  # megatron puts PP outermost: the first world / PP ranks are stage 0
        stages = [results[0], results[-1]]
        assert [r["stage"] for r in stages] == [0, lay.pp - 1]
        first = lay.first or lay.num_layers // lay.pp
        assert stages[0]["moe_hooks"] == list(range(MODEL.first_k_dense, first))
        assert stages[1]["moe_hooks"] == list(
            range(lay.num_layers - (lay.num_layers - first) // (lay.pp - 1), lay.num_layers)
        )
