"""Parity of the built-in engine (fp32) with HF transformers' Qwen3MoeForCausalLM, the independent
reference implementation of the same architecture (docs/design.md 9).

HF v5 holds experts fused in memory (``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj
[E, H, F]``) and writes the per-expert hub layout on ``save_pretrained``; the test converts our
canonical dict to the in-memory layout and checks that the saved file is exactly our canonical dict.
Routes are captured with forward hooks on the router modules (``output[2]``, docs/gpu_stack.md 6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import ModelConfig
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.types import SamplingParams
from tests.hf_reference import canonical_to_hf_memory, hf_config, hf_forward

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Measured on this machine (transformers 5.24.0, torch 2.13.0+cpu): logits max |diff| 1.1e-6
# (|logits| up to 3.5), sampled-token log-probs max |diff| 1.7e-6, routes 100% equal. The bound
# leaves headroom for other BLAS builds.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> object:
    model = transformers.Qwen3MoeForCausalLM(hf_config(cfg)).eval()
    model.load_state_dict(canonical_to_hf_memory(weights, cfg), strict=True)
    return model


@pytest.mark.unit
def test_hf_save_pretrained_writes_our_canonical_dict(
    hf_model: object, weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    hf_model.save_pretrained(tmp_path)
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(weights)
    for name, t in weights.items():
        assert torch.equal(saved[name], t), name


@pytest.mark.unit
def test_logits_and_routes_match_hf(hf_model: object, fp32_engine: BuiltinEngine, cfg: ModelConfig) -> None:
    gen = torch.Generator().manual_seed(5)
    lens = [14, 9, 3]
    S = max(lens)
    tokens_BS = torch.randint(1, cfg.vocab_size, (len(lens), S), generator=gen)
    valid_BS = torch.arange(S)[None] < torch.tensor(lens)[:, None]
    tokens_BS[~valid_BS] = 0
    hf_logits, hf_ids = hf_forward(hf_model, cfg, tokens_BS, valid_BS)
    ours = fp32_engine.model.forward(tokens_BS, torch.arange(S).expand(len(lens), S), valid_BS)
    diff = (ours.logits - hf_logits)[valid_BS].abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logits diff| {diff:.2e}"
    assert torch.equal(ours.expert_ids_BTLK[valid_BS], hf_ids[valid_BS])


@pytest.mark.unit
def test_generated_logprobs_and_routes_match_hf(
    hf_model: object, fp32_engine: BuiltinEngine, cfg: ModelConfig
) -> None:
    """End to end: KV-cached sampling, layout conversion and route records against HF scoring."""
    temperature = 0.8
    batch = fp32_engine.generate(
        [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]],
        3,
        SamplingParams(max_new_tokens=7, temperature=temperature, stop_token_ids=(7,)),
        seed=11,
    )
    S = batch.tokens_BS.shape[1]
    total_B = batch.prompt_lens_B + batch.response_lens_B
    valid_BS = torch.arange(S)[None] < total_B[:, None]
    hf_logits, hf_ids = hf_forward(hf_model, cfg, batch.tokens_BS, valid_BS)

    # logprobs_BS[b, t] = log p(tokens[b, t] | tokens[b, :t]) -> HF logits at t - 1.
    hf_lp_BS = torch.zeros_like(batch.logprobs_BS)
    hf_lp_BS[:, 1:] = (
        torch.log_softmax(hf_logits[:, :-1] / temperature, -1)
        .gather(-1, batch.tokens_BS[:, 1:, None])
        .squeeze(-1)
    )
    mask = batch.response_mask_BS
    diff = (batch.logprobs_BS - hf_lp_BS)[mask].abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logprob diff| {diff:.2e}"
    for b, route in enumerate(batch.routes):
        T = int(total_B[b])
        assert torch.equal(route.long(), hf_ids[b, : T - 1]), f"sample {b}"
