"""unit tier: the routers of issue 25 on hand-computed inputs, in moe_rl's closed form
(routing/gating.py: the built-in engine) and in megatron-core's own top-k (the learner), natively
and under replay; and the combinations megatron-core 0.16.1 cannot build, refused by field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import ConfigError, ModelConfig
from moe_rl.routing.gating import RouterSpec, group_violations, route
from tests.models import TINY_MOE_L3, TINY_SIGMOID_L3


def _logit(p: list[float]) -> torch.Tensor:
    """Logits whose sigmoid is exactly-ish ``p`` (fp32), one token."""
    t = torch.tensor([p], dtype=torch.float64)
    return torch.log(t / (1 - t)).float()


def _megatron(logits_TE, spec: RouterSpec, bias_E=None, replay_ids_TK=None):
    """megatron-core's topk_routing_with_score_function, as the learner configures it; with
    ``replay_ids_TK`` its RouterReplay forces those ids. Returns (gates of the chosen ids, ids)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    replay = None
    if replay_ids_TK is not None:
        replay = RouterReplay()
        replay.set_target_indices(replay_ids_TK)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        probs_TE, map_TE = topk_routing_with_score_function(
            logits_TE,
            spec.top_k,
            use_pre_softmax=spec.score_function == "softmax" and not spec.norm_topk_prob,
            num_groups=spec.num_groups or None,
            group_topk=spec.group_topk or None,
            scaling_factor=spec.scaling_factor if spec.scaling_factor != 1.0 else None,
            score_function=spec.score_function,
            expert_bias=bias_E,
            router_replay=replay,
        )
    finally:
        RouterReplay.clear_global_router_replay_instances()
    ids_TK = map_TE.nonzero()[:, 1].view(logits_TE.shape[0], spec.top_k)  # ascending ids
    return probs_TE.gather(1, ids_TK), ids_TK


SIG3 = RouterSpec(top_k=3, score_function="sigmoid", scaling_factor=2.5)
P6 = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
BIAS6 = torch.tensor([0.0, 0.0, -0.5, 0.35, 0.0, 0.0])


@pytest.mark.unit
def test_sigmoid_bias_selects_never_weights_k3():
    # selection 0.9 0.8 0.2 0.95 0.5 0.4 -> experts 3, 0, 1; gates from the UNBIASED 0.6 0.9 0.8
    gates_TK, ids_TK, select_TE = route(_logit(P6), SIG3, BIAS6)
    assert ids_TK.tolist() == [[3, 0, 1]]
    want = torch.tensor([[0.6, 0.9, 0.8]]) / 2.3 * 2.5
    torch.testing.assert_close(gates_TK, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(select_TE[0, 3], torch.tensor(0.95), rtol=0, atol=1e-6)
    # no bias: experts 0, 1, 2
    g0, ids0, _ = route(_logit(P6), SIG3)
    assert ids0.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(g0, torch.tensor([[0.9, 0.8, 0.7]]) / 2.4 * 2.5, rtol=0, atol=1e-6)
    # megatron's own routing: the same ids and gates
    mg, mids = _megatron(_logit(P6), SIG3, BIAS6)
    assert mids.tolist() == [[0, 1, 3]]
    torch.testing.assert_close(mg, torch.tensor([[0.9, 0.8, 0.6]]) / 2.3 * 2.5, rtol=0, atol=1e-6)


# four groups of two: g0 holds the best expert (0.9) but sums 1.0; g1 sums 1.15, g2 1.02, g3 0.5
P8 = [0.9, 0.1, 0.6, 0.55, 0.5, 0.52, 0.3, 0.2]
GRP = RouterSpec(top_k=4, score_function="sigmoid", num_groups=4, group_topk=2)


@pytest.mark.unit
def test_groups_by_top2_sum_not_max():
    gates_TK, ids_TK, select_TE = route(_logit(P8), GRP)
    assert sorted(ids_TK[0].tolist()) == [2, 3, 4, 5]  # g1 and g2, not g0 of the single best expert
    torch.testing.assert_close(gates_TK, torch.tensor([[0.6, 0.55, 0.52, 0.5]]) / 2.17, rtol=0, atol=1e-6)
    assert torch.isinf(select_TE[0, [0, 1, 6, 7]]).all()
    mg, mids = _megatron(_logit(P8), GRP)
    assert mids.tolist() == [[2, 3, 4, 5]]
    torch.testing.assert_close(mg, torch.tensor([[0.6, 0.55, 0.5, 0.52]]) / 2.17, rtol=0, atol=1e-6)
    # a bias moves g0 in: selection g0 = 1.2 + 0.4 > g2 -> experts of g0 and g1
    bias = torch.tensor([0.3, 0.3, 0, 0, 0, 0, 0, 0])
    _, ids_b, _ = route(_logit(P8), GRP, bias)
    assert sorted(ids_b[0].tolist()) == [0, 1, 2, 3]
    assert _megatron(_logit(P8), GRP, bias)[1].tolist() == [[0, 1, 2, 3]]


@pytest.mark.unit
def test_replayed_ids_gated_by_unbiased_scores_renormalised_and_scaled():
    """R3: ids from the engine; gates = the learner's unbiased scores at those ids, renormalised
    over K, times the routed scaling factor; an id outside the token's groups is accepted."""
    spec = dataclasses.replace(GRP, scaling_factor=2.5)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.4, 0.0])
    replay_TK = torch.tensor([[0, 3, 6, 2]])  # 0 (g0) and 6 (g3) lie outside the chosen g1, g2
    mg, mids = _megatron(_logit(P8), spec, bias, replay_TK)
    assert mids.tolist() == [[0, 2, 3, 6]]
    # unbiased 0.9 0.6 0.55 0.3 (sum 2.35), never 0.3 + 0.4 for expert 6
    want = torch.tensor([[0.9, 0.6, 0.55, 0.3]]) / 2.35 * 2.5
    torch.testing.assert_close(mg, want, rtol=0, atol=1e-6)
    from moe_rl.routing.gating import gates, selection_scores

    scores_TE, select_TE = selection_scores(_logit(P8), spec, bias)
    ours = gates(scores_TE, replay_TK, spec)
    torch.testing.assert_close(ours, torch.tensor([[0.9, 0.55, 0.3, 0.6]]) / 2.35 * 2.5, rtol=0, atol=1e-6)
    both = torch.cat([replay_TK, torch.tensor([[2, 3, 4, 5]])])
    assert group_violations(select_TE.expand(2, -1), both, spec).tolist() == [True, False]
    assert not group_violations(select_TE, replay_TK, SIG3).any()  # no groups: never a violation


@pytest.mark.unit
def test_softmax_without_renormalisation_qwen2():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    p = torch.softmax(logits.double(), -1).float()
    spec = RouterSpec(top_k=3, norm_topk_prob=False)
    gates_TK, ids_TK, _ = route(logits, spec)
    assert ids_TK.tolist() == [[0, 1, 4]]
    torch.testing.assert_close(gates_TK, p[:, [0, 1, 4]], rtol=0, atol=1e-6)
    assert float(gates_TK.sum()) < 0.9  # not renormalised
    mg, mids = _megatron(logits, spec)
    assert mids.tolist() == [[0, 1, 4]]
    torch.testing.assert_close(mg, p[:, [0, 1, 4]], rtol=0, atol=1e-6)
    # renormalised (Qwen3): the same ids, gates summing to 1, equal to megatron's top-k softmax
    g1, _, _ = route(logits, RouterSpec(top_k=3))
    torch.testing.assert_close(g1, p[:, [0, 1, 4]] / p[:, [0, 1, 4]].sum(), rtol=0, atol=1e-6)
    torch.testing.assert_close(_megatron(logits, RouterSpec(top_k=3))[0], g1, rtol=0, atol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        ({"norm_topk_prob": False}, "model.norm_topk_prob", "megatron-core 0.16.1 renormalises sigmoid"),
        ({"moe_router_score_function": "softmax"}, "model.moe_router_expert_bias", "sigmoid scores only"),
        ({"moe_router_group_topk": 2}, "model.moe_router_group_topk", r"here 3\), HF DeepSeek-V3"),
        ({"moe_router_expert_bias": False, "expert_bias_update": "native"}, "model.expert_bias_update", ""),
    ],
)
def test_unbuildable_router_refused_naming_field(overrides, key, words):
    with pytest.raises(ConfigError, match=rf"'{key}'.*{words}"):
        dataclasses.replace(TINY_SIGMOID_L3, **overrides)


@pytest.mark.unit
def test_groups_with_softmax_refused_and_dense_layers_carry_no_routes():
    with pytest.raises(ConfigError, match="'model.moe_router_num_groups'.*sigmoid scores only"):
        ModelConfig(num_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2)
    from moe_rl.routing.record import RouteHeader

    assert RouteHeader.for_model(TINY_SIGMOID_L3).layer_ids == (1, 2)  # layer 0 is dense
    assert RouteHeader.for_model(TINY_MOE_L3).top_k == 2
