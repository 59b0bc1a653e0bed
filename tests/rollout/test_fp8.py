"""Blockwise FP8 rollouts (moe_rl/rollout/fp8.py, ``rollout.quantization=fp8``): the quantizer's
exact and bounded properties, the one name rule over every family, the router kept out of it, and
the built-in engine's wiring (every quantized matmul reads a quantized input, every load requantizes)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from moe_rl.config import ModelConfig
from moe_rl.rollout import builtin_model
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.builtin_model import BuiltinMoEModel, moe_forward
from moe_rl.rollout.fp8 import (
    BLOCK,
    E4M3,
    dequantize_weight,
    fake_quant_act,
    fake_quant_weight,
    quantize_weight,
    quantized_names,
)
from moe_rl.weights.canonical import canonical_param_shapes, random_canonical_weights
from tests.models import HF_FAMILY_TINY, hf_tiny

pytestmark = pytest.mark.unit

# Qwen3-MoE (q/k norms), Mixtral (every layer MoE, no q/k norms) and the three HF tinies
FAMILIES: dict[str, ModelConfig] = {
    "qwen3_moe": hf_tiny(),
    "mixtral": hf_tiny(first_k_dense=0, qk_layernorm=False, hf_family="mixtral"),
    **{name: build() for name, build in HF_FAMILY_TINY.items()},
}


def _representable(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random finite e4m3 values (every bit pattern but NaN), as fp32."""
    bits = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    v = bits.view(E4M3).float()
    return torch.where(v.isnan(), torch.zeros_like(v), v)


def test_representable_blocks_round_trip_bit_exactly_edges_included() -> None:
    """Values f * s (f e4m3, the block's largest |f| = 448, s a power of two per block) come back
    bit for bit: scale = s exactly, e4m3 = f exactly. 300 x 170: partial blocks on both dims."""
    N, K = 300, 170
    f = _representable((N, K), seed=0)
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    exps = torch.randint(-8, 8, (nb, kb), generator=torch.Generator().manual_seed(1)).float()
    s = torch.exp2(exps)
    for i in range(nb):  # the test's own per-block reference (the code reshapes instead)
        for j in range(kb):
            f[i * BLOCK, j * BLOCK] = 448.0 if (i + j) % 2 else -448.0
    w = f * s.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    q, scale = quantize_weight(w)
    assert q.dtype == E4M3 and q.shape == (N, K) and scale.shape == (3, 2)
    assert torch.equal(scale, s) and torch.equal(q.float(), f)
    assert torch.equal(dequantize_weight(q, scale), w)
    # activations: a row's 128-groups (the last partial, 42 wide) each with its own power-of-two scale
    g = torch.exp2(torch.tensor([3.0, -5.0]))
    a = f[:4].clone()
    a[:, 0], a[:, 128] = 448.0, -448.0
    x = a * g.repeat_interleave(BLOCK)[:K]
    assert torch.equal(fake_quant_act(x), x)


def test_an_edge_block_is_scaled_by_its_own_elements() -> None:
    """200 x 70 (blocks of 128 rows + 72 rows, one 70-wide column block): each block's scale is its
    own amax / 448, and the values equal a per-block reference loop bit for bit."""
    w = torch.randn(200, 70, generator=torch.Generator().manual_seed(2))
    w[150, 3] = 40.0  # the edge block's amax, 10x the first block's
    q, scale = quantize_weight(w)
    assert scale.shape == (2, 1)
    assert scale[1, 0].item() == pytest.approx(40.0 / 448, rel=1e-7)
    assert scale[0, 0] == w[:128].abs().max() / 448
    ref = torch.empty_like(w)
    for rows in (slice(0, 128), slice(128, 200)):
        blk = w[rows]
        sc = blk.abs().max() / 448
        ref[rows] = (blk / sc).to(E4M3).float() * sc
    assert torch.equal(dequantize_weight(q, scale), ref)
    # stacked experts [E, N, K]: each expert its own blocks
    stacked = torch.stack([w, 1000 * w])
    assert torch.equal(fake_quant_weight(stacked)[1], fake_quant_weight(1000 * w))


def test_error_bounds_against_fp32_on_random_data() -> None:
    """N(0, 1) weights 512 x 384 and activations 64 x 384 (fp32): every element within e4m3's half
    step (2^-4 relative for normals, 2^-10 x scale for subnormals); relative Frobenius errors: weights
    2.65%, activations 2.56%, the W8A8 matmul 3.72% (seed 3; e4m3's 3 mantissa bits)."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(512, 384, generator=gen), torch.randn(64, 384, generator=gen)
    q, scale = quantize_weight(w)
    wd = dequantize_weight(q, scale)
    s_full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    assert bool(((wd - w).abs() <= torch.maximum(w.abs() * 2**-4, s_full * 2**-10)).all())
    xd = fake_quant_act(x)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    assert 0.025 < rel(wd, w) < 0.028
    assert 0.024 < rel(xd, x) < 0.027
    assert 0.035 < rel(xd @ wd.T, x @ w.T) < 0.039
    assert fake_quant_weight(torch.zeros(3, 5)).abs().sum() == 0  # an all-zero block stays zero


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_name_rule_quantizes_exactly_the_linear_projections(family: str) -> None:
    """Per family: the count the config implies, and every 2-D tensor left out is an embedding, the
    LM head, a router or a shared-expert gate (1-D tensors: norms, biases, the expert bias)."""
    cfg = FAMILIES[family]
    shapes = canonical_param_shapes(cfg)
    q = quantized_names(shapes)
    attention = (5 if cfg.q_lora_rank else 4) if cfg.mla else 4  # MLA: q_a, q_b, kv_a, kv_b, o
    shared = 3 if cfg.moe_shared_expert_ffn_hidden_size else 0
    moe_layers = cfg.num_layers - cfg.first_k_dense
    want = cfg.num_layers * attention + cfg.first_k_dense * 3 + moe_layers * (3 * cfg.num_experts + shared)
    assert len(q) == want
    left_2d = {
        re.sub(r"^model\.(layers\.\d+\.)?", "", n) for n, s in shapes.items() if len(s) == 2 and n not in q
    }
    allowed = {"mlp.gate.weight", "mlp.shared_expert_gate.weight", "embed_tokens.weight", "lm_head.weight"}
    assert left_2d <= allowed and "mlp.gate.weight" in left_2d
    assert all(len(shapes[n]) == 2 for n in q)
    assert not any("gate.weight" in n and "gate_proj" not in n for n in q)
    assert not any(n.endswith(("bias", "norm.weight", "embed_tokens.weight")) for n in q)


@pytest.mark.parametrize(
    "forced",
    [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.shared_expert_gate.weight",
    ],
)
def test_a_quantized_router_gate_or_expert_bias_is_refused_by_name(forced: str) -> None:
    cfg = FAMILIES["qwen2_moe"] if "shared_expert_gate" in forced else FAMILIES["glm4_moe"]
    names = quantized_names(canonical_param_shapes(cfg)) | {forced}
    with pytest.raises(ValueError) as e:
        BuiltinMoEModel(cfg, fp8=names)
    assert str(e.value) == (
        f"FP8 would quantize '{forced}': the router weight, the expert bias and the shared-expert gate "
        f"stay in high precision (they decide and weight the routes)"
    )


def _engines(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], scope: str = "all_linear"
) -> tuple[BuiltinEngine, BuiltinEngine]:
    plain = BuiltinEngine(cfg, pad_id=0)
    fp8 = BuiltinEngine(cfg, pad_id=0, quantization="fp8", quantize=scope)
    plain.load_weights(weights)
    fp8.load_weights(weights)
    return plain, fp8


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_router_logits_under_fp8_equal_the_bf16_engines(family: str, monkeypatch) -> None:
    """The same hidden states through one MoE layer of the bf16 and the FP8 engine: the router
    logits (spied at ``route``) and so the chosen experts are equal bit for bit; the layer's
    output is not (the experts run in FP8)."""
    cfg = FAMILIES[family]
    plain, fp8 = _engines(cfg, random_canonical_weights(cfg, 4))
    seen: list[torch.Tensor] = []
    real_route = builtin_model.route

    def spy(logits_TE, *args):
        seen.append(logits_TE.clone())
        return real_route(logits_TE, *args)

    monkeypatch.setattr(builtin_model, "route", spy)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    outs = []
    for engine in (plain, fp8):
        m, p = engine.model, "model.layers.1.mlp."
        outs.append(
            moe_forward(
                x,
                m.w[p + "gate.weight"],
                m.w[p + "experts.gate_proj"],
                m.w[p + "experts.up_proj"],
                m.w[p + "experts.down_proj"],
                cfg.moe_router_topk,
                spec=m.router_spec,
                bias_E=m.w.get(p + "gate.e_score_correction_bias"),
                shared=m._shared_expert("model.layers.1."),
                aq=m.aq,
            )
        )
    assert len(seen) == 2 and seen[0].dtype == torch.float32 and torch.equal(seen[0], seen[1])
    assert torch.equal(outs[0][1], outs[1][1])  # the same experts
    assert not torch.equal(outs[0][0], outs[1][0])  # different expert outputs


def test_every_load_requantizes_what_the_learner_sent(cfg: ModelConfig) -> None:
    """Two loads of different weights: after each, every quantized tensor is the blockwise FP8 of
    the bf16 values sent, the router and norms are the values sent, and the load reports the
    relative FP8 error of the weights (2.6% on N(0, 0.02) weights)."""
    plain, fp8 = _engines(cfg, random_canonical_weights(cfg, 6))
    for seed in (7, 8):
        w = random_canonical_weights(cfg, seed)
        metrics = fp8.load_weights(w)
        assert plain.load_weights(w) is None
        assert 0.024 < metrics["rollout/fp8_weight_rel_err"] < 0.029
        slots = fp8.model._slots
        for name in (
            "model.layers.1.mlp.experts.3.down_proj.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ):
            assert torch.equal(slots[name], fake_quant_weight(w[name].bfloat16()))
        for name in ("model.layers.1.mlp.gate.weight", "model.norm.weight", "lm_head.weight"):
            assert torch.equal(slots[name], plain.model._slots[name])
            assert torch.equal(slots[name], w[name].to(slots[name].dtype))


class _LinearSpy:
    """``torch.nn.functional`` whose ``linear`` records, per call, (is the input one of ``made``,
    the weight's data_ptr), at call time: ``made`` holds the ids of tensors kept alive (a view of
    one, e.g. an expert's slice of the quantized routed pairs, counts as it)."""

    def __init__(self, made: set[int]) -> None:
        self.made, self.calls = made, []

    def __getattr__(self, name: str):
        return getattr(F, name)

    def linear(self, x, w, b=None):
        self.calls.append((id(x) in self.made or id(x._base) in self.made, w.data_ptr()))
        return F.linear(x, w, b)


@pytest.mark.parametrize("scope", ["all_linear", "experts"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_fp8_matmul_reads_a_quantized_input_and_no_other_does(
    family: str, scope: str, monkeypatch
) -> None:
    """A forward of the FP8 engine: each matmul with a quantized weight takes an input that came
    out of the activation quantizer, and each other matmul (router, shared-expert gate, LM head;
    with ``rollout.quantize=experts`` also attention, dense and shared-expert MLPs) an input that
    did not."""
    cfg = FAMILIES[family]
    _, fp8 = _engines(cfg, random_canonical_weights(cfg, 9), scope)
    m, made, outputs = fp8.model, set(), []
    spy = _LinearSpy(made)

    def aq(x: torch.Tensor) -> torch.Tensor:
        y = fake_quant_act(x)
        outputs.append(y)  # kept alive: no other tensor takes its id
        made.add(id(y))
        return y

    monkeypatch.setattr(builtin_model, "F", spy)
    m.aq = aq if m.aq is fake_quant_act else m.aq
    m.aq_experts = aq if m.aq_experts is fake_quant_act else m.aq_experts
    quantized_ptrs = {m._slots[n].data_ptr() for n in m.fp8_names}
    T = 6
    m.forward(torch.arange(1, T + 1)[None], torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool))
    fp8_inputs = [quantized for quantized, ptr in spy.calls if ptr in quantized_ptrs]
    other_inputs = [quantized for quantized, ptr in spy.calls if ptr not in quantized_ptrs]
    assert fp8_inputs and all(fp8_inputs)
    assert not any(other_inputs)
    routers = cfg.num_layers - cfg.first_k_dense
    if scope == "all_linear":
        assert len(other_inputs) == routers * (2 if cfg.moe_shared_expert_gate else 1) + 1  # + the LM head
    else:  # the routed experts' three projections per layer are the only FP8 weights
        assert m.fp8_names == {n for n in canonical_param_shapes(cfg) if ".mlp.experts." in n and "proj" in n}
        assert len(m.fp8_names) == routers * cfg.num_experts * 3 and m.aq is builtin_model.identity


def test_fp8_changes_the_engine_logits_by_a_few_percent(cfg: ModelConfig) -> None:
    plain, fp8 = _engines(cfg, random_canonical_weights(cfg, 10))
    toks = torch.randint(1, cfg.vocab_size, (4, 10), generator=torch.Generator().manual_seed(11))
    pos, valid = torch.arange(10).expand(4, 10), torch.ones(4, 10, dtype=torch.bool)
    a, b = (e.model.forward(toks, pos, valid).logits for e in (plain, fp8))
    assert 0.02 < float((a - b).norm() / a.norm()) < 0.2


def test_quantization_is_checked_by_the_engine(cfg: ModelConfig) -> None:
    with pytest.raises(ValueError, match="quantization 'int4' is not one of"):
        BuiltinEngine(dataclasses.replace(cfg), pad_id=0, quantization="int4")
    with pytest.raises(ValueError, match=r"quantize 'router' is not one of \('all_linear', 'experts'\)"):
        BuiltinEngine(cfg, pad_id=0, quantization="fp8", quantize="router")


def test_experts_only_fp8_changes_the_logits_less_than_all_linear(cfg: ModelConfig) -> None:
    """Same weights and tokens: the experts-only engine's logits sit strictly between the
    unquantized engine's and the all-linear one's distance (fewer tensors rounded)."""
    w = random_canonical_weights(cfg, 10)
    plain, every = _engines(cfg, w)
    _, experts = _engines(cfg, w, "experts")
    toks = torch.randint(1, cfg.vocab_size, (4, 10), generator=torch.Generator().manual_seed(11))
    pos, valid = torch.arange(10).expand(4, 10), torch.ones(4, 10, dtype=torch.bool)
    a, b, c = (e.model.forward(toks, pos, valid).logits for e in (plain, every, experts))
    assert 0 < float((a - c).norm()) < float((a - b).norm())
