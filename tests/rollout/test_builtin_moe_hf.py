"""unit tier: the built-in engine's MoE block equals transformers' DeepseekV3MoE, Glm4MoeMoE and
Qwen2MoeSparseMoeBlock on the same random weights (fp32, 1e-5; identical Top-K ids per token).

Odd shapes on purpose: K=6 of 12 experts in 4 groups (3 chosen), K=3 of 6, a routed scaling
factor, an expert bias large enough to change the selection."""

from __future__ import annotations

import pytest
import torch

from moe_rl.rollout.builtin_model import SharedExpert, moe_forward
from moe_rl.routing.gating import RouterSpec

H, F, FS = 32, 16, 24


def _weights(E: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "router_EH": torch.randn(E, H, generator=g) * H**-0.5 * 3,
        "bias_E": 0.1 * torch.randn(E, generator=g),
        "gate_EFH": torch.randn(E, F, H, generator=g) * H**-0.5,
        "up_EFH": torch.randn(E, F, H, generator=g) * H**-0.5,
        "down_EHF": torch.randn(E, H, F, generator=g) * F**-0.5,
        "s_gate": torch.randn(FS, H, generator=g) * H**-0.5,
        "s_up": torch.randn(FS, H, generator=g) * H**-0.5,
        "s_down": torch.randn(H, FS, generator=g) * FS**-0.5,
        "s_gate_1H": torch.randn(1, H, generator=g) * H**-0.5,
    }


def _load_experts(experts, w) -> None:
    experts.gate_up_proj.data.copy_(torch.cat([w["gate_EFH"], w["up_EFH"]], dim=1))
    experts.down_proj.data.copy_(w["down_EHF"])


def _load_mlp(mlp, w) -> None:
    mlp.gate_proj.weight.data.copy_(w["s_gate"])
    mlp.up_proj.weight.data.copy_(w["s_up"])
    mlp.down_proj.weight.data.copy_(w["s_down"])


def _ours(x_TH, w, spec: RouterSpec, bias: bool, gate: bool):
    shared = SharedExpert(w["s_gate"], w["s_up"], w["s_down"], w["s_gate_1H"] if gate else None)
    return moe_forward(
        x_TH,
        w["router_EH"],
        w["gate_EFH"],
        w["up_EFH"],
        w["down_EHF"],
        spec.top_k,
        spec=spec,
        bias_E=w["bias_E"] if bias else None,
        shared=shared,
    )


@pytest.mark.unit
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_groups_bias_shared_equal_transformers(family: str):
    import transformers

    E, K = 12, 6
    common = dict(
        hidden_size=H,
        moe_intermediate_size=F,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=4,
        topk_group=3,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        n_shared_experts=1,
        hidden_act="silu",
    )
    if family == "deepseek_v3":
        hf = transformers.models.deepseek_v3.modeling_deepseek_v3
        block = hf.DeepseekV3MoE(transformers.DeepseekV3Config(**common))
    else:
        hf = transformers.models.glm4_moe.modeling_glm4_moe
        block = hf.Glm4MoeMoE(transformers.Glm4MoeConfig(**common))
    fs = F  # the shared expert: n_shared_experts * moe_intermediate_size
    w = _weights(E, seed=3)
    w["s_gate"], w["s_up"], w["s_down"] = w["s_gate"][:fs], w["s_up"][:fs], w["s_down"][:, :fs]
    w["bias_E"][:3] += 0.2  # group 0 favoured: groups of unequal use
    block.gate.weight.data.copy_(w["router_EH"])
    block.gate.e_score_correction_bias.copy_(w["bias_E"])
    _load_experts(block.experts, w)
    _load_mlp(block.shared_experts, w)
    x_TH = torch.randn(40, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block(x_TH[None])[0]
        _, _, hf_ids_TK = block.gate(x_TH)
    spec = RouterSpec(K, "sigmoid", True, 4, 3, 2.5)
    y_TH, ids_TK = _ours(x_TH, w, spec, bias=True, gate=False)
    assert torch.equal(ids_TK.sort(-1).values, hf_ids_TK.sort(-1).values)
    torch.testing.assert_close(y_TH, want, rtol=0, atol=1e-5)
    # the bias changed the selection of some tokens (it is really exercised) ...
    _, unbiased_TK = _ours(x_TH, w, spec, bias=False, gate=False)
    assert not torch.equal(unbiased_TK.sort(-1).values, ids_TK.sort(-1).values)
    # ... and groups of unequal use: group 0 is chosen by far more tokens than another
    groups_used = torch.bincount((ids_TK // 3).flatten(), minlength=4)
    assert int(groups_used[0]) == int(groups_used.max()) > 1.5 * int(groups_used.min()), groups_used


@pytest.mark.unit
def test_qwen2_softmax_no_renorm_gated_shared_equal_transformers():
    import transformers

    E, K = 6, 3
    cfg = transformers.Qwen2MoeConfig(
        hidden_size=H,
        moe_intermediate_size=F,
        shared_expert_intermediate_size=FS,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=False,
        hidden_act="silu",
    )
    block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(cfg)
    w = _weights(E, seed=5)
    block.gate.weight.data.copy_(w["router_EH"])
    _load_experts(block.experts, w)
    _load_mlp(block.shared_expert, w)
    block.shared_expert_gate.weight.data.copy_(w["s_gate_1H"])
    x_TH = torch.randn(40, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = block(x_TH[None])[0]
        _, hf_w_TK, hf_ids_TK = block.gate(x_TH)
    y_TH, ids_TK = _ours(x_TH, w, RouterSpec(K, norm_topk_prob=False), bias=False, gate=True)
    assert torch.equal(ids_TK, hf_ids_TK)
    torch.testing.assert_close(y_TH, want, rtol=0, atol=1e-5)
    assert float(hf_w_TK.sum(-1).min()) < 0.9  # really not renormalised
