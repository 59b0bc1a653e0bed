"""vLLM's other real FP8 settings in the built-in engine (moe_rl/rollout/fp8.py):
``rollout.fp8_granularity=tensor`` (vLLM's plain ``quantization="fp8"``: one scale per merged
weight, one dynamic scale per activation tensor) and ``rollout.kv_cache_dtype=fp8_e4m3`` (keys and
values stored in e4m3 with vLLM's default scale 1.0). Hand-computed values, then the engine's wiring."""

from __future__ import annotations

import pytest
import torch

from moe_rl.rollout import builtin_model
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.builtin_model import moe_forward
from moe_rl.rollout.fp8 import (
    E4M3,
    fake_quant_act,
    fake_quant_act_tensor,
    fake_quant_kv,
    merged_name,
    quantize_tensor_in_place,
)
from moe_rl.weights.canonical import random_canonical_weights
from tests.models import hf_tiny

pytestmark = pytest.mark.unit

L0 = "model.layers.0."


def test_per_tensor_weights_share_one_scale_per_merged_weight_by_hand() -> None:
    """q, k, v share the scale of their largest value (vLLM's merged qkv_proj), o_proj has its own.
    v's 896 sets scale 896 / 448 = 2: q's 3.3 -> 1.65 -> e4m3 1.625 (step 0.125 in [1, 2)) -> 3.25;
    o_proj's amax 7 gives scale 1/64: 3.3 * 64 = 211.2 -> 208 (step 16 in [128, 256)) -> 3.25 too,
    and 7 * 64 = 448 exactly -> 7."""
    named = {
        L0 + "self_attn.q_proj.weight": torch.tensor([[3.3, -1.0]]),
        L0 + "self_attn.k_proj.weight": torch.tensor([[0.3, 2.0]]),
        L0 + "self_attn.v_proj.weight": torch.tensor([[896.0, 0.0]]),
        L0 + "self_attn.o_proj.weight": torch.tensor([[3.3, 7.0]]),
    }
    sq_err, sq = quantize_tensor_in_place(named)
    # k's 0.3 / 2 = 0.15 -> e4m3 in [0.125, 0.25) steps 1/64: 0.15625 -> 0.3125
    assert named[L0 + "self_attn.q_proj.weight"].tolist() == [[3.25, -1.0]]
    assert named[L0 + "self_attn.k_proj.weight"].tolist() == [[0.3125, 2.0]]
    assert named[L0 + "self_attn.v_proj.weight"].tolist() == [[896.0, 0.0]]
    assert named[L0 + "self_attn.o_proj.weight"].tolist() == [[3.25, 7.0]]
    want_err = 2 * 0.05**2 + 0.0125**2  # q's and o's 3.3, k's 0.3
    want_sq = 3.3**2 + 1 + 0.09 + 4 + 896**2 + 3.3**2 + 49
    assert sq_err == pytest.approx(want_err, rel=1e-5) and sq == pytest.approx(want_sq, rel=1e-6)


def test_merged_names_follow_vllms_fused_layers() -> None:
    e = L0 + "mlp.experts.5."
    assert (
        merged_name(e + "gate_proj.weight") == merged_name(e + "up_proj.weight") == e + "gate_up_proj.weight"
    )
    assert merged_name(e + "down_proj.weight") == e + "down_proj.weight"  # per expert: w2 alone
    assert merged_name(L0 + "mlp.experts.6.up_proj.weight") != merged_name(e + "up_proj.weight")


def test_per_tensor_activations_take_one_scale_for_the_whole_batch_by_hand() -> None:
    """Token 1's 1792 sets the scale 4 for both tokens: token 0's 13.2 -> 3.3 -> 3.25 -> 13.0. The
    blockwise path scales token 0 by its own amax 13.2 / 448 and keeps 13.2 up to e4m3's 3 bits."""
    x = torch.tensor([[13.2, 1.0], [1792.0, 0.5]])
    assert fake_quant_act_tensor(x).tolist() == [[13.0, 1.0], [1792.0, 0.5]]
    assert fake_quant_act(x)[0, 0].item() == pytest.approx(13.2, rel=1e-6)  # 448 exactly
    assert fake_quant_act(x)[0, 1].item() == pytest.approx(1.0, rel=1 / 16)


def test_kv_values_round_to_e4m3_with_scale_one_by_hand() -> None:
    """0.3 -> 0.3125 (step 1/32 in [0.25, 0.5)); 500 saturates to 448; 0.0009 is under half e4m3's
    smallest subnormal 2^-9 and flushes to 0; 0.0015 rounds up to 2^-9; the dtype is kept."""
    x = torch.tensor([0.3, 500.0, -500.0, 0.0009, 0.0015, 1.0], dtype=torch.bfloat16)
    y = fake_quant_kv(x)
    assert y.dtype == torch.bfloat16
    assert y.float().tolist() == [0.3125, 448.0, -448.0, 0.0, 2**-9, 1.0]


def _weights(outlier: float = 1.0) -> dict[str, torch.Tensor]:
    w = random_canonical_weights(hf_tiny(), 3)
    w[L0 + "self_attn.v_proj.weight"][5] *= outlier  # a row of v that sets q's and k's scale too
    return w


def _engine(outlier: float = 1.0, **kw) -> BuiltinEngine:
    e = BuiltinEngine(hf_tiny(), pad_id=0, **kw)
    e.load_weights(_weights(outlier))
    return e


@pytest.mark.parametrize("outlier, lo, hi", [(1e3, 0.95, 1.05), (1e5, 4.0, 100.0)])
def test_the_engine_holds_per_tensor_fp8_weights_and_outliers_cost_only_past_e4m3s_range(
    outlier: float, lo: float, hi: float
) -> None:
    """Every held q/k/v of a layer is (w / s -> e4m3) * s in bf16 with ONE s, the three's amax /
    448. q's relative error against blockwise FP8's (q its own 128x128 block): e4m3 is a float, so
    a 1000x outlier in v leaves q's values in the normal range (its error within 5%); at 1e5 q
    falls under e4m3's smallest normal 2^-6 (448 / 2^-6 = 2.9e4) and its error grows > 4x."""
    tensor = _engine(outlier, quantization="fp8", fp8_granularity="tensor")
    block = _engine(outlier, quantization="fp8")
    sent = _weights(outlier)
    qkv = [sent[L0 + f"self_attn.{p}_proj.weight"].to(torch.bfloat16).float() for p in "qkv"]
    s = max(t.abs().max() for t in qkv) / 448
    for p, w in zip("qkv", qkv, strict=True):
        want = ((w / s).to(E4M3).float() * s).to(torch.bfloat16)
        assert torch.equal(tensor.held_weights()[L0 + f"self_attn.{p}_proj.weight"], want)
    q = qkv[0]
    err_t, err_b = (
        ((e.held_weights()[L0 + "self_attn.q_proj.weight"].float() - q).norm() / q.norm()).item()
        for e in (tensor, block)
    )
    assert lo < err_t / err_b < hi


def test_routed_experts_quantize_all_their_pairs_as_one_tensor(monkeypatch) -> None:
    """The experts' activation quantizer is called on every routed pair at once (input [T*K, H],
    intermediate [T*K, F]), so a per-tensor scale spans the whole batch as vLLM's fused MoE does."""
    cfg = hf_tiny()
    T, H, F_, E, K = 5, cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.num_experts, cfg.moe_router_topk
    g = torch.Generator().manual_seed(0)
    seen: list[tuple[int, ...]] = []

    def aq(x: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return fake_quant_act_tensor(x)

    args = [torch.randn(s, generator=g) for s in ((T, H), (E, H), (E, F_, H), (E, F_, H), (E, H, F_))]
    moe_forward(*args, K, aq=aq)
    assert seen == [(T * K, H), (T * K, F_)]


def test_fp8_kv_cache_holds_e4m3_values_and_moves_the_logits() -> None:
    """With kv_cache_dtype=fp8_e4m3 every cached key and value is an e4m3 value (scale 1); without,
    some are not; the logits differ from the bf16 cache's by a small relative amount."""
    cfg = hf_tiny()
    toks = torch.randint(1, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    pos, valid = torch.arange(7).expand(2, 7), torch.ones(2, 7, dtype=torch.bool)
    out = {}
    for kv in ("auto", "fp8_e4m3"):
        e = _engine(kv_cache_dtype=kv)
        cache = builtin_model.KVCache.allocate(cfg, 2, 8, torch.bfloat16, "cpu")
        out[kv] = e.model.forward(toks, pos, valid, cache).logits
        kv_vals = torch.cat([t[:, :, :7].reshape(-1).float() for t in cache.k + cache.v])
        exact = torch.equal(kv_vals.to(E4M3).float(), kv_vals)
        assert exact == (kv == "fp8_e4m3")
    rel = (out["fp8_e4m3"] - out["auto"]).norm() / out["auto"].norm()
    assert 1e-4 < rel < 0.2
