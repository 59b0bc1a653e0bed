"""dist tier: DeepSeek-V3 / GLM-4.5-shaped routers (sigmoid + expert bias + 4 groups + routed
scaling + a shared expert, K=6) and Qwen2-MoE's (softmax without renormalisation, gated shared
expert) in the megatron learner on 2 gloo ranks: logits equal the built-in engine's, EP=2 equals
EP=1 (log-probs and gradients), the frozen expert bias stays bit-identical over 2 updates, the
native one moves by megatron's rule from the routes the learner used (replayed ones under R3),
and replayed ids outside a token's groups are accepted and counted. One spawn runs every check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from tests.dist_harness import run_ranks
from tests.models import TINY_QWEN2_L3, TINY_SIGMOID_L3

LOGP_TOL = 1e-5
S, B = 12, 4


def _data(rank: int, vocab: int):
    g = torch.Generator().manual_seed(400 + rank)
    lens_B = torch.tensor([12, 7, 10, 5]) if rank == 0 else torch.tensor([9, 12, 6, 11])
    pos_S = torch.arange(S)
    tokens_BS = torch.where(pos_S[None] < lens_B[:, None], torch.randint(3, vocab, (B, S), generator=g), 0)
    mask_BS = (pos_S[None] >= 2) & (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, mask_BS


def _nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def _engine_logits(model, weights, tokens_BS, lens_B):
    from moe_rl.rollout.builtin_model import BuiltinMoEModel

    eng = BuiltinMoEModel(model, torch.float32)
    eng.load_canonical(weights)
    pos = torch.arange(S).expand(B, S)
    valid = pos < lens_B[:, None]
    return eng.forward(tokens_BS, pos, valid).logits, valid


def _biases(learner, model) -> torch.Tensor:
    exp = learner.export_canonical()
    return torch.stack([exp[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in model.moe_layers])


def _worker(rank: int):
    from megatron.core import parallel_state as ps

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.routing.plan import PassMode, PassPlan
    from moe_rl.routing.record import RouteBatch
    from moe_rl.types import TrainBatch
    from moe_rl.weights.canonical import random_canonical_weights

    out: dict = {}
    par2 = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=False)
    ctx2 = dist.init_distributed(par2, seed=7)
    models = {"sigmoid": TINY_SIGMOID_L3, "qwen2": TINY_QWEN2_L3}
    weights = {k: random_canonical_weights(m, seed=11) for k, m in models.items()}
    ep2: dict = {}
    for name, model in models.items():
        learner = Learner(model, par2, OptimConfig(lr=1e-2), ctx2, weights[name])
        tokens_BS, lens_B, mask_BS = _data(rank, model.vocab_size)
        with torch.no_grad():
            logits = learner.gpt(tokens_BS, torch.arange(S).expand(B, S), None)
        eng_logits, valid = _engine_logits(model, weights[name], tokens_BS, lens_B)
        batch = TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)
        logp = learner.forward_logprobs(batch, 1.0, 2).stats.logp_BS
        learner.forward_backward(batch, _nll, 1.0, 2)
        ep2[name] = (logp, learner.canonical_grads())
        out[f"{name}_engine_diff"] = float((logits - eng_logits)[valid].abs().max())
        out[f"{name}_local_experts"] = len(learner.gpt.decoder.layers[1].mlp.experts.local_experts)

    # frozen expert bias: two real updates move the router, never the bias (bitwise)
    model = TINY_SIGMOID_L3
    tokens_BS, lens_B, mask_BS = _data(rank, model.vocab_size)
    batch = TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)
    frozen = Learner(model, par2, OptimConfig(lr=1e-2), ctx2, weights["sigmoid"])
    before = _biases(frozen, model)
    for _ in range(2):
        frozen.update(batch, _nll, 1.0, 2, lr=1e-2)
    # the router monitor sees the gradient of the unbiased gating scores: with sigmoid gates
    # renormalised over the K, exactly (E - K) / E of the entries get none
    out["monitor_zero_frac"] = frozen.router_monitor_metrics()["router_grad/zero_frac"]
    after = frozen.export_canonical()
    out["frozen_bias_equal"] = torch.equal(before, _biases(frozen, model))
    out["frozen_bias_is_init"] = torch.equal(
        before[0], weights["sigmoid"][f"model.layers.{model.moe_layers[0]}.mlp.gate.e_score_correction_bias"]
    )
    out["frozen_router_moved"] = float(
        (after["model.layers.1.mlp.gate.weight"] - weights["sigmoid"]["model.layers.1.mlp.gate.weight"])
        .abs()
        .max()
    )

    # native: replayed routes all pick experts 0..5, so those are over-loaded and 6..11 under:
    # megatron's rule moves the bias by -rate / +rate, from the replayed routes (native routing
    # would not put every token on 0..5); groups 2 and 3 (experts 6..11) are never replayed, so
    # the tokens whose own groups include them count as violations
    native_cfg = dataclasses.replace(model, expert_bias_update="native")
    native = Learner(native_cfg, par2, OptimConfig(lr=1e-2), ctx2, weights["sigmoid"])
    header = native.route_header
    rows_B = lens_B - 1
    n = int(rows_B.sum())
    ids_NLK = torch.arange(6).expand(n, len(header.layer_ids), 6).to(header.dtype)
    routes = RouteBatch(ids_NLK, rows_B, torch.zeros(B, dtype=torch.int64), torch.full((B,), 2), header)
    nb0 = _biases(native, native_cfg)
    up = native.update(batch.replace(routes=routes), _nll, 1.0, 2, lr=1e-2, plan=PassPlan(PassMode.REPLAY))
    delta = _biases(native, native_cfg) - nb0
    want = torch.cat([torch.full((6,), -1e-3), torch.full((6,), 1e-3)]).expand_as(delta)
    out["native_delta_err"] = float((delta - want).abs().max())
    m = up.routing.metrics
    v = m["routing/update_group_violation_frac"]  # update passes file under routing/update_
    out["violation"], out["violation_count"] = float(v.sum / v.count), float(v.count)

    ps.destroy_model_parallel()
    par1 = ParallelConfig(nproc=2, expert_parallel=1, distributed_optimizer=False)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    ctx1 = dist.ParallelDims.from_parallel_state()
    for name, model in models.items():
        learner = Learner(model, par1, OptimConfig(lr=1e-2), ctx1, weights[name])
        tokens_BS, lens_B, mask_BS = _data(rank, model.vocab_size)
        batch = TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)
        logp = learner.forward_logprobs(batch, 1.0, 2).stats.logp_BS
        learner.forward_backward(batch, _nll, 1.0, 2)
        grads = learner.canonical_grads()
        logp2, grads2 = ep2[name]
        out[f"{name}_ep_logp_diff"] = float((logp - logp2).abs().max())
        out[f"{name}_ep_grad_rel"] = max(
            float((grads2[k] - grads[k]).abs().max() / grads[k].abs().max().clamp(min=1e-12)) for k in grads
        )
        shared = grads["model.layers.1.mlp.shared_experts.up_proj.weight"]
        out[f"{name}_shared_grad"] = float(shared.abs().sum())
        out[f"{name}_same_keys"] = sorted(grads) == sorted(grads2)
    dist.shutdown()
    return out


@pytest.mark.dist
def test_router_variants_engine_ep_bias_replay():
    for rank, r in enumerate(run_ranks(_worker, 2)):
        for name in ("sigmoid", "qwen2"):
            assert r[f"{name}_engine_diff"] < LOGP_TOL, (rank, r)
            assert r[f"{name}_local_experts"] * 2 == {"sigmoid": 12, "qwen2": 6}[name], r
            assert r[f"{name}_ep_logp_diff"] < LOGP_TOL, (rank, r)
            assert r[f"{name}_ep_grad_rel"] < 1e-5, (rank, r)
            assert r[f"{name}_shared_grad"] > 0 and r[f"{name}_same_keys"], (rank, r)
        assert r["frozen_bias_equal"] and r["frozen_bias_is_init"], (rank, r)
        assert r["frozen_router_moved"] > 1e-4, (rank, r)
        assert abs(r["monitor_zero_frac"] - 0.5) < 1e-12, (rank, r)  # (12 - 6) / 12
        assert r["native_delta_err"] < 1e-7, (rank, r)
        assert 0 < r["violation"] < 1 and r["violation_count"] > 0, (rank, r)
