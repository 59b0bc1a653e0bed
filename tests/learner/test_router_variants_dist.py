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


def _engine_router_stats(model, weights, tokens_BS, lens_B) -> dict[str, list[float]]:
    """Per MoE layer, over this rank's real tokens, from the built-in engine's own MoE forward:
    the sums of the shared expert's norm share ||s|| / (||s|| + ||r||) and of the Top-K margin of
    the scores megatron's top-k ranks (sigmoid + bias within the selected groups; softmax
    probabilities when not renormalised, as megatron's pre-softmax), and the token count."""
    from moe_rl.rollout import builtin_model
    from moe_rl.routing.gating import route

    real_T = (torch.arange(S)[None] < lens_B[:, None]).reshape(-1)
    out: dict[str, list[float]] = {"share": [], "margin": [], "tokens": []}
    upstream = builtin_model.moe_forward

    def observed(x_TH, router_EH, *args, spec, bias_E, shared, **kw):
        y_TH, ids_TK = upstream(x_TH, router_EH, *args, spec=spec, bias_E=bias_E, shared=shared, **kw)
        s_TH = shared(x_TH)
        s_T, r_T = s_TH.norm(dim=-1)[real_T], (y_TH - s_TH).norm(dim=-1)[real_T]
        logits_TE = torch.nn.functional.linear(x_TH.float(), router_EH.float())
        _, _, select_TE = route(logits_TE, spec, bias_E)  # -inf outside the selected groups
        if spec.score_function == "softmax" and not spec.norm_topk_prob:
            select_TE = torch.softmax(logits_TE, -1)
        top_TK = select_TE.topk(spec.top_k + 1, dim=-1).values[real_T]
        out["share"].append(float((s_T / (s_T + r_T)).sum()))
        out["margin"].append(float((top_TK[:, -2] - top_TK[:, -1]).sum()))
        out["tokens"].append(float(real_T.sum()))
        return y_TH, ids_TK

    builtin_model.moe_forward = observed
    try:
        _engine_logits(model, weights, tokens_BS, lens_B)
    finally:
        builtin_model.moe_forward = upstream
    return out


def _biases(learner, model) -> torch.Tensor:
    exp = learner.export_canonical()
    return torch.stack([exp[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in model.moe_layers])


def _worker(rank: int):
    from megatron.core import parallel_state as ps

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.routing.record import RouteBatch
    from moe_rl.routing.replay_plan import PassMode, PassPlan
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
        # the monitor over both ranks' real tokens vs the engine's MoE forward on each rank's own
        out[f"{name}_monitor"] = learner.router_monitor_metrics()
        out[f"{name}_engine_stats"] = _engine_router_stats(model, weights[name], tokens_BS, lens_B)
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
    results = run_ranks(_worker, 2)
    for rank, r in enumerate(results):
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
    # the monitor (summed over both ranks) sees what the engine computes: the shared expert's
    # output share and the Top-K margin of the scores that select, per MoE layer; dense layer 0 has none
    for name, model in (("sigmoid", TINY_SIGMOID_L3), ("qwen2", TINY_QWEN2_L3)):
        m = results[0][f"{name}_monitor"]
        assert m == pytest.approx(results[1][f"{name}_monitor"], rel=0, abs=0, nan_ok=True), (
            name
        )  # all-reduced
        assert not [k for k in m if k.endswith("/layer0")], (name, sorted(m))
        for pos, lid in enumerate(model.moe_layers):
            n = sum(r[f"{name}_engine_stats"]["tokens"][pos] for r in results)
            share = sum(r[f"{name}_engine_stats"]["share"][pos] for r in results) / n
            margin = sum(r[f"{name}_engine_stats"]["margin"][pos] for r in results) / n
            assert 0 < share < 1, (name, lid, share)
            assert abs(m[f"router_grad/shared_expert_share/layer{lid}"] - share) < 1e-5, (name, lid, m, share)
            assert abs(m[f"router_grad/margin_mean/layer{lid}"] - margin) < 1e-5, (name, lid, m, margin)
