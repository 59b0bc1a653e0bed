"""The checked weight sync (``rollout.sync_check``, moe_rl/pipeline/sync_check.py) on the built-in
engine colocated: a clean sync passes in every precision (bf16, fp32, FP8), and each fault the
check exists for (a permuted expert order, a chunk the engine dropped, a tensor left stale, an FP8
tensor left unquantized) fails with one line naming the tensor."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.pipeline.sync_check import (
    SyncCheck,
    SyncCheckError,
    engine_logprobs,
    mismatch_error,
    probe_engine,
    probe_k3,
    probe_tokens,
    verify_held,
)
from moe_rl.pipeline.weight_sync import fp8_names
from moe_rl.rollout.base import ENGINE_DTYPES
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.fp8 import fake_quant_weight, quantized_names
from moe_rl.weights.canonical import canonical_param_shapes, random_canonical_weights
from moe_rl.weights.checksum import checksum, expected
from tests.models import hf_tiny

pytestmark = pytest.mark.unit

CFG = hf_tiny()  # 3 layers (layer 0 dense), 8 experts top-2
EXPERT0 = "model.layers.1.mlp.experts.0.gate_proj.weight"


def _chunks(weights: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The stream's shape: the embedding, one chunk per decoder layer, then the rest."""
    layer = {n: int(n.split(".")[2]) if n.startswith("model.layers.") else None for n in weights}
    groups = [None, *range(CFG.num_layers)]
    out = [{n: t for n, t in weights.items() if layer[n] == g} for g in groups]
    return [c for c in out if c]


def _setup(dtype: str = "bf16", quantization: str = "none"):
    engine = BuiltinEngine(CFG, dtype=dtype, pad_id=0, quantization=quantization)
    fp8 = quantized_names(canonical_param_shapes(CFG)) if quantization == "fp8" else frozenset()
    check = SyncCheck(ENGINE_DTYPES[dtype], fp8, True, CFG.vocab_size)
    engine.load_weights(random_canonical_weights(CFG, 1))  # the previous sync's weights
    return engine, check


@pytest.mark.parametrize("dtype,quantization", [("bf16", "none"), ("fp32", "none"), ("bf16", "fp8")])
def test_a_clean_sync_passes_bit_for_bit(dtype: str, quantization: str) -> None:
    engine, check = _setup(dtype, quantization)
    w = random_canonical_weights(CFG, 2)
    engine.load_weights(check.wrap(_chunks(w)))
    check.verify(engine, 2)  # raises on any mismatch
    assert sorted(check.sent) == sorted(canonical_param_shapes(CFG))
    if quantization == "fp8":  # the engine holds the dequantized blocks the learner recomputed
        assert torch.equal(engine.held_weights()[EXPERT0], fake_quant_weight(w[EXPERT0].bfloat16()))
        assert int(check.sent[EXPERT0]) != int(checksum(w[EXPERT0].bfloat16()))


def test_a_dict_sync_stays_a_dict_and_is_checked() -> None:
    """A whole dict (rollout.staleness's kept sets) is handed on as the same dict, summed first."""
    engine, check = _setup("bf16", "fp8")
    w = random_canonical_weights(CFG, 2)
    assert check.wrap(w) is w and sorted(check.sent) == sorted(w)
    engine.load_weights(w)
    check.verify(engine, 2)


def _fails(engine, check, name: str) -> None:
    with pytest.raises(SyncCheckError) as e:
        check.verify(engine, 2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"weight sync check failed at sync 2: engine tensor {name!r}: ")


def test_a_permuted_expert_order_fails_naming_the_first_expert() -> None:
    engine, check = _setup()
    engine.load_weights(check.wrap(_chunks(random_canonical_weights(CFG, 2))))
    stacked = engine.model.w["model.layers.1.mlp.experts.gate_proj"]
    stacked.copy_(stacked.roll(1, dims=0))  # expert e holds expert e - 1's weights
    _fails(engine, check, EXPERT0)


def test_a_dropped_chunk_fails_naming_its_first_tensor() -> None:
    engine, check = _setup()
    chunks = _chunks(random_canonical_weights(CFG, 2))
    held = engine.held_weights()
    before = {n: held[n].clone() for n in chunks[2]}  # layer 1's chunk
    engine.load_weights(check.wrap(chunks))
    for n, t in before.items():  # an engine whose load skipped that chunk keeps the old values
        held[n].copy_(t)
    _fails(engine, check, sorted(before)[0])


def test_one_stale_tensor_fails_naming_it() -> None:
    engine, check = _setup()
    name = "model.layers.2.self_attn.o_proj.weight"
    old = engine.held_weights()[name].clone()
    engine.load_weights(check.wrap(_chunks(random_canonical_weights(CFG, 2))))
    engine.held_weights()[name].copy_(old)
    _fails(engine, check, name)


def test_an_fp8_tensor_left_unquantized_fails_naming_it() -> None:
    engine, check = _setup("bf16", "fp8")
    w = random_canonical_weights(CFG, 2)
    engine.load_weights(check.wrap(_chunks(w)))
    name = "model.layers.0.mlp.down_proj.weight"
    engine.held_weights()[name].copy_(w[name])  # the bf16 values, not their FP8 blocks
    _fails(engine, check, name)


def test_a_tensor_the_learner_never_sent_is_named() -> None:
    e = mismatch_error("lm_head.weight", {}, {"lm_head.weight": 5}, 3)
    assert str(e) == (
        "weight sync check failed at sync 3: engine tensor 'lm_head.weight': "
        "the learner sent no such tensor (a missed bucket)"
    )


def test_the_checksum_sees_positions_and_bits() -> None:
    """Exact integers: the same bits give the same sum on any view; a swap of two values, a
    transposition and one flipped low bit each change it; the router stays fp32 in ``expected``."""
    t = torch.randn(300, 70, generator=torch.Generator().manual_seed(3)).bfloat16()
    s = int(checksum(t))
    assert s == int(checksum(t.clone())) and 0 <= s < 2**63
    swapped = t.clone()
    swapped[0, 0], swapped[0, 1] = t[0, 1], t[0, 0]
    flipped = t.clone().view(torch.int16)
    flipped[299, 69] ^= 1
    flat = t.reshape(-1)
    blocks = torch.cat([flat[256:512], flat[:256], flat[512:]]).view(300, 70)  # two 256-value rows swapped
    sums = {s, *(int(checksum(x)) for x in (swapped, t.t(), flipped.view(torch.bfloat16), blocks))}
    assert len(sums) == 5
    router = "model.layers.1.mlp.gate.weight"
    assert expected(router, t.float(), torch.bfloat16, frozenset()).dtype == torch.float32


def test_probe_k3_is_the_mean_of_rho_minus_one_minus_log_rho() -> None:
    learner = torch.tensor([[0.0, -1.0, -2.0]])
    engine = torch.tensor([[0.0, -1.5, -2.0]])  # log rho = 0.5, 0 on the scored columns
    assert probe_k3(learner, engine) == pytest.approx((math.exp(0.5) - 1 - 0.5) / 2, rel=1e-12)
    tokens = probe_tokens(CFG.vocab_size)
    assert tokens.shape == (4, 16) and torch.equal(tokens, probe_tokens(CFG.vocab_size))


def test_a_rollout_ranks_probe_sees_a_wrong_tensor_which_the_checksum_names_first() -> None:
    """Split (a rollout rank, ``RolloutRankWeights.receive``): after its load the engine is checked
    against the root's sums (sorted names), then scores the probe against the learner's log-probs
    of the same weights (here an fp32 engine holding them: the probe's reference). A clean load
    scores k3 = 0 exactly; a permuted expert order fails the checksum naming the tensor, and the
    probe alone (were it unchecked) sees it as a k3 far above the fp32 rounding of a clean sync."""
    w = random_canonical_weights(CFG, 2)
    reference = BuiltinEngine(CFG, dtype="fp32", pad_id=0)
    reference.load_weights(w)
    learner_logp = engine_logprobs(reference, CFG.vocab_size)
    engine, check = _setup("fp32")
    engine.load_weights(check.wrap(_chunks(w)))
    sums = [v for _, v in sorted(check.sent_ints().items())]
    verify_held(engine, sums, 2)
    assert probe_engine(engine, learner_logp, CFG.vocab_size) == 0.0
    stacked = engine.model.w["model.layers.1.mlp.experts.gate_proj"]
    stacked.copy_(stacked.roll(1, dims=0))  # expert e holds expert e - 1's weights
    with pytest.raises(SyncCheckError, match=f"at sync 2: engine tensor {EXPERT0!r}: checksum "):
        verify_held(engine, sums, 2)
    assert probe_engine(engine, learner_logp, CFG.vocab_size) > 0.05  # measured 0.094


@pytest.mark.parametrize("quantize", ["all_linear", "experts"])
def test_the_checks_fp8_names_are_the_engines_for_either_scope(quantize: str) -> None:
    """The checked sync recomputes FP8 for exactly the names the engine quantizes: with
    rollout.quantize=experts the routed experts' projections only (it used to take every linear
    layer, so a clean experts-only sync failed on the first attention tensor), and a clean sync
    through that set passes."""
    cfg = load_config(None, ["rollout.quantization=fp8", f"rollout.quantize={quantize}"])
    cfg = dataclasses.replace(cfg, model=CFG)
    engine = BuiltinEngine(CFG, pad_id=0, quantization="fp8", quantize=quantize)
    names = fp8_names(cfg)
    assert names == engine.model.fp8_names
    assert all(".mlp.experts." in n for n in names) == (quantize == "experts")
    check = SyncCheck(ENGINE_DTYPES["bf16"], names, True, CFG.vocab_size)
    engine.load_weights(check.wrap(_chunks(random_canonical_weights(CFG, 2))))
    check.verify(engine, 1)  # raises on any mismatch
