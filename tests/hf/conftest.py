"""Fixtures of the HF checkpoint tests: a tiny random Qwen3MoeForCausalLM and a tiny random
MixtralForCausalLM built by transformers, each saved with save_pretrained in several safetensors shards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_rl.config import ModelConfig
from moe_rl.weights.canonical import random_canonical_weights
from tests.hf_reference import canonical_to_hf_memory, hf_config
from tests.models import hf_tiny

transformers = pytest.importorskip("transformers")

# vocab 40, hidden 64, 4 layers (layer 0 dense; 4 so that PP=2 splits them), 4 heads / 2 kv groups,
# 8 experts top-2
CFG = hf_tiny(num_layers=4)
# Mixtral: every layer MoE, no q/k norm, head_dim not in the HF config (hidden / heads = 16)
MIXTRAL_CFG = ModelConfig(
    vocab_size=40,
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    moe_ffn_hidden_size=32,
    num_experts=8,
    moe_router_topk=2,
    first_k_dense=0,
    qk_layernorm=False,
    rope_theta=1e6,
    norm_eps=1e-5,
    max_seq_len=64,
    hf_family="mixtral",
)
SHARD_SIZE = "100KB"  # the model is ~0.9 MB in fp32: about 10 shards


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cfg() -> ModelConfig:
    return CFG


@pytest.fixture(scope="session")
def weights() -> dict[str, torch.Tensor]:
    """Our random init (norm weights != 1, so a misplaced norm shows), loaded into the HF model."""
    return random_canonical_weights(CFG, seed=1234)


@pytest.fixture(scope="session")
def hf_model(weights: dict[str, torch.Tensor]) -> object:
    model = transformers.Qwen3MoeForCausalLM(hf_config(CFG)).eval()
    model.load_state_dict(canonical_to_hf_memory(weights, CFG), strict=True)
    return model


@pytest.fixture(scope="session")
def hf_dir(hf_model: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "qwen3_moe_tiny"
    hf_model.save_pretrained(path, max_shard_size=SHARD_SIZE)
    assert len(list(path.glob("model-*.safetensors"))) >= 2
    return path


def mixtral_hf_config(cfg: ModelConfig) -> object:
    hf_cfg = transformers.MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        sliding_window=None,
    )
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    return hf_cfg


@pytest.fixture(scope="session")
def mixtral_weights() -> dict[str, torch.Tensor]:
    return random_canonical_weights(MIXTRAL_CFG, seed=4321)


@pytest.fixture(scope="session")
def mixtral_model(mixtral_weights: dict[str, torch.Tensor]) -> object:
    """In memory transformers 5 holds Mixtral like Qwen3-MoE (``mlp.gate``, fused ``mlp.experts``)."""
    model = transformers.MixtralForCausalLM(mixtral_hf_config(MIXTRAL_CFG)).eval()
    model.load_state_dict(canonical_to_hf_memory(mixtral_weights, MIXTRAL_CFG), strict=True)
    return model


@pytest.fixture(scope="session")
def mixtral_dir(mixtral_model: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "mixtral_tiny"
    mixtral_model.save_pretrained(path, max_shard_size=SHARD_SIZE)
    assert len(list(path.glob("model-*.safetensors"))) >= 2
    return path
