"""The HF families of issue 25 in and out: DeepSeek-V3 (and Kimi-K2's config.json), GLM-4.5 and
Qwen2-MoE. Files and configs only: our canonical weights written as each family's checkpoint,
loaded by transformers' own classes with nothing missing or unexpected, saved back by
transformers (sharded) and read again bitwise; config.json mapped onto every typed field both ways."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, ModelConfig, load_config
from moe_rl.errors import CheckpointError
from moe_rl.weights import hf as hfc
from moe_rl.weights.canonical import random_canonical_weights
from tests.hub_configs import DEEPSEEK_V3_HUB, KIMI_K2_HUB
from tests.models import HF_FAMILY_TINY, deepseek_v3_tiny, hf_tiny

transformers = pytest.importorskip("transformers")

FAMILIES = sorted(HF_FAMILY_TINY)


def _export(tmp_path: Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> tuple[Path, dict]:
    weights = random_canonical_weights(cfg, seed=11)
    out = hfc.write_hf_checkpoint(tmp_path / "ours", weights, cfg, max_shard_bytes=60_000, dtype=dtype)
    return out, weights


@pytest.mark.unit
@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_and_comes_back_bitwise(tmp_path: Path, family: str) -> None:
    cfg = HF_FAMILY_TINY[family]()
    ours, weights = _export(tmp_path, cfg)
    assert len(list(ours.glob("model-*.safetensors"))) > 1  # sharded, with an index
    hf_cfg = json.loads((ours / hfc.CONFIG).read_text())
    assert hf_cfg["model_type"] == family and hf_cfg["architectures"] == [hfc.FAMILIES[family].architecture]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(ours), output_loading_info=True, dtype=torch.float32
    )
    assert type(model).__name__ == hfc.FAMILIES[family].architecture
    assert {k: v for k, v in info.items() if v} == {}  # nothing missing, unexpected or mismatched
    model.save_pretrained(str(tmp_path / "theirs"), max_shard_size="60KB")
    # transformers' own config.json maps onto exactly our fields; its tensors are ours, bitwise
    fields = hfc.load_hf_config(tmp_path / "theirs")
    assert {k: getattr(cfg, k) for k in fields} == fields
    assert set(hfc.FAMILIES[family].fixed) <= set(fields)  # what the family cannot vary is derived too
    got = hfc.read_hf_weights(tmp_path / "theirs", cfg)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in weights)


@pytest.mark.unit
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_stays_bf16_and_the_expert_bias_fp32(tmp_path: Path, family: str) -> None:
    cfg = HF_FAMILY_TINY[family]()
    ours, weights = _export(tmp_path, cfg, dtype=torch.bfloat16)
    assert hfc.checkpoint_dtype(ours) == torch.bfloat16
    assert json.loads((ours / hfc.CONFIG).read_text())["dtype"] == "bfloat16"
    stored = hfc.read_hf_weights(ours, cfg)
    for name, t in stored.items():
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert t.dtype == want, name
        assert torch.equal(t, weights[name].to(want)), name
    assert any(k.endswith("e_score_correction_bias") for k in stored) == cfg.moe_router_expert_bias
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ours), dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path / "theirs"))
    again = hfc.read_hf_weights(tmp_path / "theirs", cfg)
    assert all(torch.equal(again[k].to(stored[k].dtype), stored[k]) for k in stored)
    assert hfc.checkpoint_dtype(tmp_path / "theirs") == torch.bfloat16


@pytest.mark.unit
def test_family_tensor_names() -> None:
    qwen2 = hfc.hf_names(HF_FAMILY_TINY["qwen2_moe"]())
    assert (
        qwen2["model.layers.0.mlp.shared_experts.up_proj.weight"]
        == "model.layers.0.mlp.shared_expert.up_proj.weight"
    )
    assert (
        qwen2["model.layers.0.mlp.shared_expert_gate.weight"]
        == "model.layers.0.mlp.shared_expert_gate.weight"
    )
    assert qwen2["model.layers.2.self_attn.q_proj.bias"] == "model.layers.2.self_attn.q_proj.bias"
    ds = hfc.hf_names(deepseek_v3_tiny())
    assert all(k == v for k, v in ds.items())  # canonical names are DeepSeek-V3's for MLA and shared experts
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in ds
    assert "model.layers.0.mlp.gate.weight" not in ds  # layer 0 is dense
    assert "lm_head.weight" not in hfc.hf_names(HF_FAMILY_TINY["glm4_moe"]())  # tied
    assert "model.layers.1.self_attn.q_proj.weight" in hfc.hf_names(deepseek_v3_tiny(q_lora_rank=0))


def _write(tmp_path: Path, hf: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / hfc.CONFIG).write_text(json.dumps(hf))
    return tmp_path


@pytest.mark.unit
def test_transformers_default_configs_are_the_published_architectures(tmp_path: Path) -> None:
    """transformers' defaults: DeepSeek-V3-671B, GLM-4.5-Air (46 layers, 128 experts), Qwen1.5-MoE-A2.7B."""
    ds = hfc.model_fields_from_hf(transformers.DeepseekV3Config().to_dict(), tmp_path)
    assert ds["hf_family"] == "deepseek_v3" and ds["num_experts"] == 256 and ds["moe_router_topk"] == 8
    assert (ds["moe_router_num_groups"], ds["moe_router_group_topk"]) == (8, 4)
    assert ds["moe_router_scaling_factor"] == 2.5 and ds["first_k_dense"] == 3
    assert ds["moe_shared_expert_ffn_hidden_size"] == 2048 and ds["moe_router_expert_bias"]
    assert (ds["kv_lora_rank"], ds["q_lora_rank"], ds["qk_nope_head_dim"], ds["qk_rope_head_dim"]) == (
        512,
        1536,
        128,
        64,
    )
    assert ds["v_head_dim"] == 128 and ds["moe_router_score_function"] == "sigmoid" and ds["norm_topk_prob"]
    glm = hfc.model_fields_from_hf(transformers.Glm4MoeConfig().to_dict(), tmp_path)
    assert glm["partial_rotary_factor"] == 0.5 and glm["num_experts"] == 128 and glm["first_k_dense"] == 1
    assert glm["moe_shared_expert_ffn_hidden_size"] == 1408 and glm["moe_router_num_groups"] == 0
    assert glm["head_dim"] == 4096 // 96 and not glm["attention_bias"] and not glm["qk_layernorm"]
    qw = hfc.model_fields_from_hf(transformers.Qwen2MoeConfig().to_dict(), tmp_path)
    assert qw["moe_shared_expert_ffn_hidden_size"] == 5632 and qw["moe_shared_expert_gate"]
    assert qw["norm_topk_prob"] is False and qw["attention_bias"] and qw["num_experts"] == 60


@pytest.mark.unit
def test_hub_configs_deepseek_v3_and_kimi_k2(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config.json: key 'quantization_config'.*dequantize to bf16"):
        hfc.load_hf_config(_write(tmp_path / "fp8", DEEPSEEK_V3_HUB))
    bf16 = {k: v for k, v in DEEPSEEK_V3_HUB.items() if k != "quantization_config"}
    ds = hfc.load_hf_config(_write(tmp_path / "ds", bf16))
    assert ds["rope_scaling_type"] == "yarn" and ds["rope_scaling_factor"] == 40.0
    assert ds["rope_original_max_position"] == 4096 and ds["rope_mscale_all_dim"] == 1.0
    assert ds["rope_theta"] == 10000.0 and ds["first_k_dense"] == 3 and ds["num_layers"] == 61
    kimi = {k: v for k, v in KIMI_K2_HUB.items() if k != "quantization_config"}
    k2 = hfc.load_hf_config(_write(tmp_path / "k2", kimi))
    assert k2["hf_family"] == "deepseek_v3"  # Kimi-K2 is this architecture; exported as deepseek_v3
    assert k2["num_experts"] == 384 and k2["moe_router_num_groups"] == 0 and k2["moe_router_group_topk"] == 0
    assert k2["moe_router_scaling_factor"] == 2.827 and k2["rope_theta"] == 50000.0
    assert (k2["rope_scaling_factor"], k2["rope_beta_fast"], k2["rope_beta_slow"]) == (64.0, 1.0, 1.0)


@pytest.mark.bad_input
@pytest.mark.parametrize(
    ("family", "key", "value", "match"),
    [
        (
            "deepseek_v3",
            "model_type",
            "llama",
            r"supported: \('qwen3_moe', 'mixtral', 'deepseek_v3', "
            r"'glm4_moe', 'qwen2_moe', 'kimi_k2'\)",
        ),
        ("deepseek_v3", "scoring_func", "softmax", "only sigmoid"),
        ("deepseek_v3", "topk_method", "greedy", "noaux_tc"),
        ("deepseek_v3", "rope_interleave", False, "interleaved"),
        ("deepseek_v3", "moe_layer_freq", 2, "every layer"),
        ("deepseek_v3", "first_k_dense_replace", 4, "at least one MoE layer of num_hidden_layers=4"),
        ("deepseek_v3", "attention_bias", True, "MLA with biases"),
        ("deepseek_v3", "hidden_act", "gelu", "silu"),
        (
            "glm4_moe",
            "rope_parameters",
            {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
            "plain RoPE",
        ),
        ("qwen2_moe", "decoder_sparse_step", 2, "first k"),
        ("qwen2_moe", "shared_expert_intermediate_size", 0, "must be > 0"),
        ("qwen2_moe", "use_sliding_window", True, "sliding-window"),
    ],
)
def test_unsupported_family_configs_name_key_and_file(
    tmp_path: Path, family: str, key: str, value: object, match: str
) -> None:
    hf = hfc.hf_config_dict(HF_FAMILY_TINY[family]())
    hf[key] = value
    key_shown = "rope_parameters.rope_type" if key == "rope_parameters" else key
    with pytest.raises(CheckpointError, match=rf"config.json: key '{key_shown}'.*{match}"):
        hfc.load_hf_config(_write(tmp_path, hf))


@pytest.mark.unit
def test_yarn_attention_factor_and_truncate_refused(tmp_path: Path) -> None:
    hf = hfc.hf_config_dict(deepseek_v3_tiny())
    hf["rope_parameters"]["attention_factor"] = 1.2
    with pytest.raises(CheckpointError, match=r"key 'rope_parameters.attention_factor' = 1.2"):
        hfc.load_hf_config(_write(tmp_path, hf))
    del hf["rope_parameters"]["attention_factor"]
    hf["rope_parameters"]["truncate"] = False
    with pytest.raises(CheckpointError, match=r"key 'rope_parameters.truncate' = False"):
        hfc.load_hf_config(_write(tmp_path, hf))


@pytest.mark.unit
def test_export_refuses_what_the_family_cannot_hold(tmp_path: Path) -> None:
    weights = random_canonical_weights(deepseek_v3_tiny(), seed=0)
    cases = [
        (
            deepseek_v3_tiny(kv_lora_rank=0, qk_layernorm=False, rope_scaling_type="none"),
            "model.kv_lora_rank=0, but model.hf_family='deepseek_v3' has multi-latent",
        ),
        (
            deepseek_v3_tiny(moe_shared_expert_ffn_hidden_size=24),
            "moe_shared_expert_ffn_hidden_size=24.*multiple",
        ),
        (
            deepseek_v3_tiny(hf_family="qwen2_moe"),
            "model.kv_lora_rank=16, but model.hf_family='qwen2_moe' always has 0",
        ),
        (
            deepseek_v3_tiny(hf_family="qwen3_moe"),
            "model.kv_lora_rank=16, but model.hf_family='qwen3_moe' always has 0",
        ),
    ]
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            hfc.write_hf_checkpoint(tmp_path / "x", weights, cfg)
    assert not (tmp_path / "x").exists()


@pytest.mark.unit
def test_mtp_layers_are_skipped_with_one_line(tmp_path: Path, caplog) -> None:
    cfg = deepseek_v3_tiny()
    ours, weights = _export(tmp_path, cfg)
    from safetensors.torch import save_file

    mtp = {
        "model.layers.4.eh_proj.weight": torch.ones(64, 128),
        "model.layers.4.enorm.weight": torch.ones(64),
    }
    save_file(mtp, str(ours / "mtp.safetensors"))
    index = json.loads((ours / hfc.INDEX).read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (ours / hfc.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.4.eh_proj.weight'"):
        hfc.read_hf_weights(ours, cfg)  # the config says there is no MTP layer
    hf = json.loads((ours / hfc.CONFIG).read_text())
    assert hf["num_nextn_predict_layers"] == 0  # what an export says
    hf["num_nextn_predict_layers"] = 1
    (ours / hfc.CONFIG).write_text(json.dumps(hf))
    with caplog.at_level(logging.WARNING, logger="moe_rl.weights.hf"):
        got = hfc.read_hf_weights(ours, cfg)
    assert all(torch.equal(got[k], weights[k]) for k in weights) and got.keys() == weights.keys()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "skipping 2 MTP tensors of layers [4] (num_nextn_predict_layers=1)" in lines[0]
    assert hfc.mtp_layers(ours) == 1


# ------------------------------------------------------------------ the model: section from config.json


@pytest.mark.unit
@pytest.mark.parametrize("family", FAMILIES)
def test_model_section_comes_from_config_json(tmp_path: Path, family: str) -> None:
    cfg = HF_FAMILY_TINY[family]()
    ours, _ = _export(tmp_path, cfg)
    run = load_config(None, [f"init_weights=hf:{ours}", "task.tokenizer=builtin:char"])
    assert run.model == dataclasses.replace(cfg, max_seq_len=ModelConfig.max_seq_len)
    # an override that agrees is accepted; one that contradicts is refused naming both values
    same = load_config(None, [f"init_weights=hf:{ours}", f"model.num_experts={cfg.num_experts}"])
    assert same.model == run.model
    bad = f"model.num_experts={cfg.num_experts + 6}"
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"init_weights=hf:{ours}", bad])
    assert str(e.value) == (
        f"override {bad!r}: config key 'model.num_experts': {cfg.num_experts + 6} contradicts "
        f"{ours / hfc.CONFIG}, which gives {cfg.num_experts} (init_weights=hf:{ours}: the architecture "
        f"comes from config.json; drop 'model.num_experts')"
    )


@pytest.mark.unit
def test_model_section_from_config_json_qwen3_and_yaml(
    tmp_path: Path, hf_dir: Path, cfg: ModelConfig
) -> None:
    """Qwen3-MoE (buildable today, no variant lifted): a YAML model: key that contradicts is named
    with the file; the derived fields replace the defaults."""
    run = load_config(None, [f"init_weights=hf:{hf_dir}"])
    assert run.model == dataclasses.replace(cfg, max_seq_len=ModelConfig.max_seq_len)
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  head_dim: 8\n  max_seq_len: 48\n")
    with pytest.raises(ConfigError) as e:
        load_config(yaml, [f"init_weights=hf:{hf_dir}"])
    assert str(e.value).startswith(
        f"{yaml}: config key 'model.head_dim': 8 contradicts {hf_dir / hfc.CONFIG}, which gives 16"
    )
    yaml.write_text("model:\n  max_seq_len: 48\n")
    assert load_config(yaml, [f"init_weights=hf:{hf_dir}"]).model.max_seq_len == 48


@pytest.mark.bad_input
def test_config_json_the_learner_cannot_build_names_the_file_and_field(tmp_path: Path) -> None:
    hf = hfc.hf_config_dict(hf_tiny())
    hf["num_experts_per_tok"] = 9
    d = _write(tmp_path / "m", hf)
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"init_weights=hf:{d}"])
    assert str(e.value) == (
        f"{d / hfc.CONFIG} (init_weights=hf:{d}): config key 'model.moe_router_topk': "
        "top-k 9 > model.num_experts 8"
    )
    hf = hfc.hf_config_dict(hf_tiny())
    hf["model_type"] = "llama"
    _write(d, hf)
    with pytest.raises(
        CheckpointError, match=r"config.json: key 'model_type' = 'llama': supported: .*'kimi_k2'"
    ):
        load_config(None, [f"init_weights=hf:{d}"])
