"""unit tier: the Mixtral family (transformers' MixtralForCausalLM) through HF checkpoint import/export.

Mixtral checkpoints name the router ``block_sparse_moe.gate`` and the experts ``w1``/``w3``/``w2``
(= gate_proj/up_proj/down_proj); moe_rl/weights/hf.py renames them at the file boundary only.
Tolerance: fp32 logits max |diff| < 1e-4 (measured 1e-6 scale); routes, round trips and reloads
are exact."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, ModelConfig
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.weights import hf as hfc
from moe_rl.weights.canonical import random_canonical_weights
from tests.hf.conftest import CFG, MIXTRAL_CFG, assert_config_refused, assert_missing_tensor_named
from tests.hf_reference import hf_forward

transformers = pytest.importorskip("transformers")
LOGITS_ATOL = 1e-4
B, S = 3, 12


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    tokens_BS = torch.randint(1, MIXTRAL_CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(5))
    return tokens_BS, torch.ones_like(tokens_BS, dtype=torch.bool)


@pytest.mark.unit
def test_families_match_the_config_choices() -> None:
    for family in hfc.FAMILIES:
        ModelConfig(hf_family=family)
    with pytest.raises(ConfigError, match="model.hf_family"):
        ModelConfig(hf_family="llama")


@pytest.mark.unit
def test_mixtral_config_and_weights_import_exactly(mixtral_dir: Path, mixtral_weights: dict) -> None:
    hf = json.loads((mixtral_dir / hfc.CONFIG).read_text())
    assert hf["model_type"] == "mixtral" and hf.get("head_dim") is None  # head_dim = hidden / heads
    stored = json.loads((mixtral_dir / hfc.INDEX).read_text())["weight_map"]
    assert "model.layers.2.block_sparse_moe.experts.5.w3.weight" in stored
    assert "model.layers.2.block_sparse_moe.gate.weight" in stored
    assert not any(".mlp." in k for k in stored)
    fields = hfc.load_hf_config(mixtral_dir)
    assert "ffn_hidden_size" not in fields  # no dense layer describes it
    assert ModelConfig(**{**dataclasses.asdict(MIXTRAL_CFG), **fields}) == MIXTRAL_CFG
    got = hfc.read_hf_weights(mixtral_dir, MIXTRAL_CFG)
    assert sorted(got) == sorted(mixtral_weights)
    assert all(torch.equal(got[k], mixtral_weights[k]) for k in mixtral_weights)


@pytest.mark.unit
def test_mixtral_routing_is_softmax_over_topk_logits(mixtral_model: object) -> None:
    """transformers: softmax over all experts, Top-K, renormalise; learner and engine: softmax over
    the top-k logits. Same experts, same gates (measured max |diff| 1.2e-7)."""
    router = mixtral_model.model.layers[1].mlp.gate
    x_TH = 3.0 * torch.randn(4096, MIXTRAL_CFG.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_TE, hf_gates_TK, hf_ids_TK = router(x_TH)
    top_logits_TK, ids_TK = torch.topk(logits_TE.float(), MIXTRAL_CFG.moe_router_topk, dim=-1)
    gates_TK = torch.softmax(top_logits_TK, dim=-1)
    assert torch.equal(ids_TK, hf_ids_TK)
    diff = (gates_TK - hf_gates_TK).abs().max().item()
    print(f"max |gate diff| {diff:.1e}")
    assert diff < 1e-6


@pytest.mark.unit
def test_builtin_engine_on_imported_mixtral_matches_hf(mixtral_dir: Path, mixtral_model: object) -> None:
    engine = BuiltinEngine(MIXTRAL_CFG, dtype="fp32", pad_id=0)
    engine.load_weights(hfc.load_hf_checkpoint(mixtral_dir, MIXTRAL_CFG))
    tokens_BS, valid_BS = _tokens()
    hf_logits, hf_ids = hf_forward(mixtral_model, MIXTRAL_CFG, tokens_BS, valid_BS)
    ours = engine.model.forward(tokens_BS, torch.arange(S).expand(B, S), valid_BS)
    diff = (ours.logits - hf_logits).abs().max().item()
    print(f"max |logits diff| {diff:.2e} (|logits| up to {hf_logits.abs().max():.1f})")
    assert diff < LOGITS_ATOL, f"max |logits diff| {diff:.2e}"
    assert torch.equal(ours.expert_ids_BTLK, hf_ids)


@pytest.mark.unit
def test_mixtral_export_round_trip_reloads_in_transformers_bitwise(
    tmp_path: Path, mixtral_dir: Path, mixtral_model: object
) -> None:
    canon = hfc.read_hf_weights(mixtral_dir, MIXTRAL_CFG)
    out = hfc.write_hf_checkpoint(tmp_path / "out", canon, MIXTRAL_CFG, max_shard_bytes=100_000)
    hf = json.loads((out / hfc.CONFIG).read_text())
    assert hf["model_type"] == "mixtral" and hf["architectures"] == ["MixtralForCausalLM"]
    written = json.loads((out / hfc.INDEX).read_text())["weight_map"]
    assert sorted(written) == sorted(json.loads((mixtral_dir / hfc.INDEX).read_text())["weight_map"])
    again = hfc.read_hf_weights(out, MIXTRAL_CFG)  # import -> export -> import
    assert all(torch.equal(again[k], canon[k]) for k in canon)
    assert hfc.load_hf_config(out) == hfc.load_hf_config(mixtral_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    reloaded.config._experts_implementation = "eager"
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    ref_sd, new_sd = mixtral_model.state_dict(), reloaded.state_dict()
    assert sorted(ref_sd) == sorted(new_sd) and all(torch.equal(ref_sd[k], new_sd[k]) for k in ref_sd)
    tokens_BS, valid_BS = _tokens()
    a, ids_a = hf_forward(mixtral_model, MIXTRAL_CFG, tokens_BS, valid_BS)
    b, ids_b = hf_forward(reloaded, MIXTRAL_CFG, tokens_BS, valid_BS)
    assert torch.equal(a, b) and torch.equal(ids_a, ids_b)


@pytest.mark.unit
def test_missing_mixtral_expert_names_tensor_and_file(tmp_path: Path, mixtral_dir: Path) -> None:
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    assert_missing_tensor_named(mixtral_dir, tmp_path / "a", name, MIXTRAL_CFG)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("sliding_window", 4096, "sliding-window"),
        ("router_jitter_noise", 0.01, "jitter"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "plain RoPE"),
    ],
)
def test_unsupported_mixtral_config_names_key(
    tmp_path: Path, mixtral_dir: Path, key: str, value: object, match: str
) -> None:
    assert_config_refused(mixtral_dir, tmp_path, key, value, match)


@pytest.mark.unit
def test_hub_style_mixtral_config(tmp_path: Path, mixtral_dir: Path) -> None:
    """Mixtral-8x7B's config.json: top-level rope_theta, or none (transformers' default 1e6), and
    a router_aux_loss_coef, which is a training knob of transformers' own loss: not imported."""
    hf = json.loads((mixtral_dir / hfc.CONFIG).read_text())
    del hf["rope_parameters"]
    hf.update(router_aux_loss_coef=0.02, head_dim=None)
    (tmp_path / hfc.CONFIG).write_text(json.dumps(hf))
    fields = hfc.load_hf_config(tmp_path)
    assert fields["rope_theta"] == 1e6 and fields["head_dim"] == 16 and "router_aux_loss_coeff" not in fields
    hf["rope_theta"] = 500000.0
    (tmp_path / hfc.CONFIG).write_text(json.dumps(hf))
    assert hfc.load_hf_config(tmp_path)["rope_theta"] == 5e5


@pytest.mark.unit
def test_family_mismatch_is_refused(tmp_path: Path, mixtral_dir: Path, hf_dir: Path) -> None:
    with pytest.raises(
        hfc.CheckpointError, match="model.hf_family=mixtral, but the config has model.hf_family=qwen3_moe"
    ):
        hfc.load_hf_checkpoint(mixtral_dir, dataclasses.replace(MIXTRAL_CFG, hf_family="qwen3_moe"))
    with pytest.raises(
        hfc.CheckpointError, match="model.hf_family=qwen3_moe, but the config has model.hf_family=mixtral"
    ):
        hfc.load_hf_checkpoint(hf_dir, dataclasses.replace(CFG, hf_family="mixtral"))
    weights = random_canonical_weights(MIXTRAL_CFG, seed=0)
    with pytest.raises(ValueError, match="model.qk_layernorm=False, but model.hf_family='qwen3_moe' always"):
        hfc.write_hf_checkpoint(
            tmp_path / "a", weights, dataclasses.replace(MIXTRAL_CFG, hf_family="qwen3_moe")
        )
    with pytest.raises(ValueError, match="model.first_k_dense=1, but model.hf_family='mixtral' always has 0"):
        hfc.write_hf_checkpoint(tmp_path / "b", weights, dataclasses.replace(MIXTRAL_CFG, first_k_dense=1))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
