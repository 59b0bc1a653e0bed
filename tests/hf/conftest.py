"""Fixtures of the HF checkpoint tests: a tiny random Qwen3MoeForCausalLM built by transformers,
saved with save_pretrained in several safetensors shards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_rl.config import ModelConfig
from moe_rl.rollout.builtin_model import random_canonical_weights
from tests.hf_reference import canonical_to_hf_memory, hf_config

transformers = pytest.importorskip("transformers")

# vocab 40, hidden 64, 4 layers (layer 0 dense; 4 so that PP=2 splits them), 4 heads / 2 kv groups, 8 experts top-2
CFG = ModelConfig(vocab_size=40, hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                  head_dim=16, ffn_hidden_size=96, moe_ffn_hidden_size=32, num_experts=8, moe_router_topk=2,
                  first_k_dense=1, rope_theta=10000.0, norm_eps=1e-6, max_seq_len=64)
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
