"""Fixtures of the HF checkpoint tests: a tiny random Qwen3MoeForCausalLM and a tiny random
MixtralForCausalLM built by transformers, each saved with save_pretrained in several safetensors shards."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl.config import ModelConfig
from moe_rl.weights import hf as hfc
from moe_rl.weights.canonical import random_canonical_weights
from tests.hf_reference import canonical_to_hf_memory, hf_config
from tests.models import hf_tiny

transformers = pytest.importorskip("transformers")

# vocab 40, hidden 64, 4 layers (layer 0 dense; 4 so that PP=2 splits them), 4 heads / 2 kv groups,
# 8 experts top-2
CFG = hf_tiny(num_layers=4)
# Mixtral: every layer MoE, no q/k norm, head_dim not in the HF config (hidden / heads = 16)
MIXTRAL_CFG = hf_tiny(
    num_layers=4,
    first_k_dense=0,
    ffn_hidden_size=ModelConfig.ffn_hidden_size,  # no dense layer reads it: ModelConfig's default
    qk_layernorm=False,
    rope_theta=1e6,
    norm_eps=1e-5,
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


def _loaded(model_cls: type, hf_cfg: object, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> object:
    model = model_cls(hf_cfg).eval()
    model.load_state_dict(canonical_to_hf_memory(weights, cfg), strict=True)
    return model


def _saved(model: object, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    path = tmp_path_factory.mktemp("hf") / name
    model.save_pretrained(path, max_shard_size=SHARD_SIZE)
    assert len(list(path.glob("model-*.safetensors"))) >= 2
    return path


def assert_config_refused(src_dir: Path, tmp_path: Path, key: str, value: object, match: str) -> None:
    """``src_dir``'s config.json with ``key`` set to ``value``: the loader refuses it naming the key
    (a rope type as ``rope_parameters.rope_type``) and saying why (``match``)."""
    hf = json.loads((src_dir / hfc.CONFIG).read_text())
    hf[key] = value
    (tmp_path / hfc.CONFIG).write_text(json.dumps(hf))
    key_shown = "rope_parameters.rope_type" if key == "rope_parameters" else key
    with pytest.raises(hfc.CheckpointError, match=rf"config.json: key '{key_shown}'.*{match}"):
        hfc.load_hf_config(tmp_path)


def assert_missing_tensor_named(src_dir: Path, ckpt: Path, name: str, cfg: ModelConfig) -> None:
    """A copy of ``src_dir`` at ``ckpt`` whose shard lacks tensor ``name``: the reader names the
    shard while the index lists it, and the index once it does not."""
    shutil.copytree(src_dir, ckpt)
    shard = ckpt / json.loads((ckpt / hfc.INDEX).read_text())["weight_map"][name]
    save_file({k: v for k, v in load_file(str(shard)).items() if k != name}, str(shard))
    with pytest.raises(hfc.CheckpointError, match=rf"{shard.name}: missing tensor '{name}'"):
        hfc.read_hf_weights(ckpt, cfg)
    index = json.loads((ckpt / hfc.INDEX).read_text())
    del index["weight_map"][name]
    (ckpt / hfc.INDEX).write_text(json.dumps(index))
    with pytest.raises(hfc.CheckpointError, match=rf"{hfc.INDEX}: missing tensor '{name}'"):
        hfc.read_hf_weights(ckpt, cfg)


@pytest.fixture(scope="session")
def hf_model(weights: dict[str, torch.Tensor]) -> object:
    return _loaded(transformers.Qwen3MoeForCausalLM, hf_config(CFG), weights, CFG)


@pytest.fixture(scope="session")
def hf_dir(hf_model: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(hf_model, tmp_path_factory, "qwen3_moe_tiny")


@pytest.fixture(scope="session")
def mixtral_weights() -> dict[str, torch.Tensor]:
    return random_canonical_weights(MIXTRAL_CFG, seed=4321)


@pytest.fixture(scope="session")
def mixtral_model(mixtral_weights: dict[str, torch.Tensor]) -> object:
    """In memory transformers 5 holds Mixtral like Qwen3-MoE (``mlp.gate``, fused ``mlp.experts``)."""
    return _loaded(transformers.MixtralForCausalLM, hf_config(MIXTRAL_CFG), mixtral_weights, MIXTRAL_CFG)


@pytest.fixture(scope="session")
def mixtral_dir(mixtral_model: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(mixtral_model, tmp_path_factory, "mixtral_tiny")
