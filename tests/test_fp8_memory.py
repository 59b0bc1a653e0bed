"""``moe-rl estimate`` with ``rollout.quantization=fp8`` (moe_rl/memory/sizes.py ``engine_fp8_bytes``):
the engine's weights are 1 byte per quantized element plus an fp32 scale per 128x128 block, the
rest at rollout.dtype, checked against the canonical tensors and the quantizer's own rule, and
against a hand count."""

from __future__ import annotations

import dataclasses
import math

import pytest

from moe_rl.memory.sizes import engine_fp8_bytes, param_counts
from moe_rl.rollout.fp8 import quantized
from moe_rl.weights.canonical import canonical_param_shapes
from tests.models import HF_FAMILY_TINY, hf_tiny

pytestmark = pytest.mark.unit

FAMILIES = {"qwen3_moe": hf_tiny(), **{n: b() for n, b in HF_FAMILY_TINY.items()}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp8_engine_bytes_equal_the_canonical_tensors_under_the_rule(family: str) -> None:
    m = FAMILIES[family]
    want = 0
    for name, shape in canonical_param_shapes(m).items():
        n = math.prod(shape)
        if quantized(name):
            want += n + 4 * math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128)
        else:
            want += 2 * n
    assert engine_fp8_bytes(m, 2) == want


def test_fp8_engine_bytes_by_hand() -> None:
    """hf_tiny: vocab 40, hidden 64, 3 layers (layer 0 dense), 4 heads x 16, 2 kv groups, 8 experts.
    Every quantized weight is smaller than one block: one scale each."""
    m = hf_tiny()
    H, D, F, Fe = m.hidden_size, m.head_dim, m.ffn_hidden_size, m.moe_ffn_hidden_size
    assert (H, D, m.num_attention_heads, m.num_query_groups, m.num_layers, m.num_experts) == (
        64,
        16,
        4,
        2,
        3,
        8,
    )
    attn = 3 * (64 * 64 + 2 * 32 * 64 + 64 * 64)  # q, k, v, o per layer
    dense = 3 * F * H
    experts = 2 * 8 * 3 * Fe * H
    q_elems = attn + dense + experts
    scales = 3 * 4 + 3 + 2 * 8 * 3  # one per tensor: 4 attention, 3 dense MLP, 3 per expert
    assert engine_fp8_bytes(m, 2) == q_elems + 4 * scales + 2 * (param_counts(m)["total"] - q_elems)


def test_a_big_tensor_counts_one_scale_per_block() -> None:
    """Experts of 1536 x 4096 (12 x 32 blocks each): 1 byte + 4 / 16384 bytes an element."""
    m = dataclasses.replace(hf_tiny(), hidden_size=4096, moe_ffn_hidden_size=1536)
    per_expert = 3 * (1536 * 4096 + 4 * 12 * 32)
    bf16 = engine_fp8_bytes(dataclasses.replace(m, moe_ffn_hidden_size=1536), 2)
    fewer = engine_fp8_bytes(dataclasses.replace(m, num_experts=m.num_experts - 1), 2)
    assert bf16 - fewer == 2 * per_expert + 2 * 2 * 4096  # 2 MoE layers, + one router row each at bf16
