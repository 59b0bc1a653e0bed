"""unit tier: HF checkpoint import/export (moe_rl/weights/hf.py) against transformers, and the
built-in engine's parity on an imported checkpoint. Tolerance: fp32 logits max |diff| < 1e-4
(measured 1e-6 scale); routes, round trips and reloads are exact."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl.config import ModelConfig
from moe_rl.errors import CheckpointError, ConfigError
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.weights import hf as hfc
from moe_rl.weights.warmstart import load_init_weights
from tests.hf.conftest import assert_config_refused, assert_missing_tensor_named
from tests.hf_reference import hf_forward

transformers = pytest.importorskip("transformers")
LOGITS_ATOL = 1e-4


def _tokens(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens_BS = torch.randint(1, cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(5))
    return tokens_BS, torch.ones_like(tokens_BS, dtype=torch.bool)


@pytest.mark.unit
def test_config_and_weights_import_exactly(hf_dir: Path, cfg: ModelConfig, weights: dict) -> None:
    fields = hfc.load_hf_config(hf_dir)
    assert ModelConfig(**{**dataclasses.asdict(cfg), **fields}) == cfg
    got = hfc.read_hf_weights(hf_dir, cfg)
    assert sorted(got) == sorted(weights)
    assert all(torch.equal(got[k], weights[k]) for k in weights)


@pytest.mark.unit
def test_builtin_engine_on_imported_checkpoint_matches_hf(
    hf_dir: Path, hf_model: object, cfg: ModelConfig
) -> None:
    engine = BuiltinEngine(cfg, dtype="fp32", pad_id=0)
    engine.load_weights(hfc.load_hf_checkpoint(hf_dir, cfg))
    tokens_BS, valid_BS = _tokens(cfg)
    hf_logits, hf_ids = hf_forward(hf_model, cfg, tokens_BS, valid_BS)
    ours = engine.model.forward(tokens_BS, torch.arange(12).expand(3, 12), valid_BS)
    diff = (ours.logits - hf_logits).abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logits diff| {diff:.2e}"
    assert torch.equal(ours.expert_ids_BTLK, hf_ids)


@pytest.mark.unit
def test_export_reloads_in_transformers_bitwise(
    tmp_path: Path, hf_dir: Path, hf_model: object, cfg: ModelConfig
) -> None:
    canon = hfc.read_hf_weights(hf_dir, cfg)
    out = hfc.write_hf_checkpoint(tmp_path / "out", canon, cfg, max_shard_bytes=100_000)
    assert (out / hfc.INDEX).is_file() and len(list(out.glob("model-*.safetensors"))) >= 2
    assert not (tmp_path / "out.tmp").exists()
    again = hfc.read_hf_weights(out, cfg)  # round trip import -> export -> import
    assert all(torch.equal(again[k], canon[k]) for k in canon)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    reloaded.config._experts_implementation = "eager"
    ref_sd, new_sd = hf_model.state_dict(), reloaded.state_dict()
    assert sorted(ref_sd) == sorted(new_sd) and all(torch.equal(ref_sd[k], new_sd[k]) for k in ref_sd)
    tokens_BS, valid_BS = _tokens(cfg)
    a, ids_a = hf_forward(hf_model, cfg, tokens_BS, valid_BS)
    b, ids_b = hf_forward(reloaded, cfg, tokens_BS, valid_BS)
    assert torch.equal(a, b) and torch.equal(ids_a, ids_b)
    assert hfc.load_hf_config(out) == hfc.load_hf_config(hf_dir)


@pytest.mark.unit
def test_export_is_atomic_and_never_overwrites(
    tmp_path: Path, cfg: ModelConfig, weights: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def crash_on_second(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(hfc, "save_file", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        hfc.write_hf_checkpoint(tmp_path / "out", weights, cfg, max_shard_bytes=100_000)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    hfc.write_hf_checkpoint(tmp_path / "out", weights, cfg)  # one shard: model.safetensors
    assert (tmp_path / "out" / hfc.SINGLE).is_file() and not (tmp_path / "out" / hfc.INDEX).exists()
    assert all(torch.equal(v, weights[k]) for k, v in hfc.read_hf_weights(tmp_path / "out", cfg).items())
    with pytest.raises(CheckpointError, match="never overwrites"):
        hfc.write_hf_checkpoint(tmp_path / "out", weights, cfg)


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / json.loads((ckpt / hfc.INDEX).read_text())["weight_map"][name]


@pytest.mark.unit
def test_partial_or_wrong_checkpoints_name_tensor_and_file(
    tmp_path: Path, hf_dir: Path, cfg: ModelConfig
) -> None:
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    # 1. the shard lacks a tensor the index lists; 2. the index does not list it either
    assert_missing_tensor_named(hf_dir, tmp_path / "a", name, cfg)
    # 3. wrong shape
    ckpt = shutil.copytree(hf_dir, tmp_path / "b")
    shard = _shard_of(ckpt, name)
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(shard))
    with pytest.raises(hfc.CheckpointError, match=rf"{shard.name}: tensor '{name}' has shape \(32, 63\)"):
        hfc.read_hf_weights(ckpt, cfg)
    # 4. an unexpected tensor (a shared expert, say)
    ckpt = shutil.copytree(hf_dir, tmp_path / "c")
    shard = _shard_of(ckpt, name)
    tensors = load_file(str(shard))
    tensors["model.layers.1.mlp.shared_expert.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(shard))
    index = json.loads((ckpt / hfc.INDEX).read_text())
    index["weight_map"]["model.layers.1.mlp.shared_expert.up_proj.weight"] = shard.name
    (ckpt / hfc.INDEX).write_text(json.dumps(index))
    with pytest.raises(
        hfc.CheckpointError, match=rf"{shard.name}: unexpected tensor 'model.layers.1.mlp.shared"
    ):
        hfc.read_hf_weights(ckpt, cfg)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("norm_topk_prob", False, "renormalises"),
        ("use_sliding_window", True, "sliding-window"),
        ("decoder_sparse_step", 2, "first k"),
        ("mlp_only_layers", [1], "first k"),
        ("model_type", "llama", "supported"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "plain RoPE"),
        ("shared_expert_intermediate_size", 64, "shared experts"),
    ],
)
def test_unsupported_config_names_key_and_file(
    tmp_path: Path, hf_dir: Path, key: str, value: object, match: str
) -> None:
    assert_config_refused(hf_dir, tmp_path, key, value, match)
    hf = json.loads((hf_dir / hfc.CONFIG).read_text())
    del hf["num_hidden_layers"]
    (tmp_path / hfc.CONFIG).write_text(json.dumps(hf))
    with pytest.raises(hfc.CheckpointError, match="required key 'num_hidden_layers' is missing"):
        hfc.load_hf_config(tmp_path)


@pytest.mark.unit
def test_hub_style_config_keys(tmp_path: Path, hf_dir: Path) -> None:
    """Older hub configs spell num_experts and a top-level rope_theta (Qwen3-30B-A3B style)."""
    hf = json.loads((hf_dir / hfc.CONFIG).read_text())
    hf["num_experts"] = hf.pop("num_local_experts")
    del hf["rope_parameters"]
    hf.update(rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False, sliding_window=4096)
    (tmp_path / hfc.CONFIG).write_text(json.dumps(hf))
    fields = hfc.load_hf_config(tmp_path)
    assert fields["num_experts"] == 8 and fields["rope_theta"] == 1e6


@pytest.mark.unit
def test_init_weights_hf_prefix(hf_dir: Path, cfg: ModelConfig, weights: dict) -> None:
    tok = CharTokenizer()
    got = load_init_weights(f"hf:{hf_dir}", cfg, tok)
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    other = dataclasses.replace(cfg, num_experts=4)
    with pytest.raises(
        hfc.CheckpointError, match="model.num_experts=8, but the config has model.num_experts=4"
    ):
        load_init_weights(f"hf:{hf_dir}", other, tok)
    with pytest.raises(ConfigError, match="init_weights"):
        load_init_weights("hf:/nonexistent", cfg, tok)
