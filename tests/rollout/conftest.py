"""Shared fixtures of the rollout tests: a tiny Qwen3-MoE config, seeded random weights, engines,
and a no-cache reference scorer (one unpadded sequence at a time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from moe_rl.config import ModelConfig
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.builtin_model import BuiltinMoEModel, ForwardOut
from moe_rl.weights.canonical import random_canonical_weights
from tests.models import hf_tiny

PAD_ID = 0


def tiny_config(**overrides: object) -> ModelConfig:
    """vocab 40, hidden 64, 3 layers (layer 0 dense), 4 heads / 2 kv groups, 8 experts top-2."""
    return hf_tiny(**overrides)


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads are pure overhead, and on a busy 2-core machine OpenMP
    spinning made this folder 4x slower (19 s vs 4.4 s). Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def make_cfg() -> Callable[..., ModelConfig]:
    """tiny_config as a fixture, so test modules need not import conftest."""
    return tiny_config


@pytest.fixture(scope="session")
def cfg() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return random_canonical_weights(cfg, seed=1234)


@pytest.fixture(scope="session")
def fp32_engine(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> BuiltinEngine:
    engine = BuiltinEngine(cfg, dtype="fp32", pad_id=PAD_ID)
    engine.load_weights(weights)
    return engine


@pytest.fixture(scope="session")
def bf16_engine(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> BuiltinEngine:
    engine = BuiltinEngine(cfg, dtype="bf16", pad_id=PAD_ID)
    engine.load_weights(weights)
    return engine


@pytest.fixture(scope="session")
def fp32_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> BuiltinMoEModel:
    model = BuiltinMoEModel(cfg, torch.float32)
    model.load_canonical(weights)
    return model


@pytest.fixture(scope="session")
def score(fp32_model: BuiltinMoEModel) -> Callable[[torch.Tensor], ForwardOut]:
    """Reference: fp32 no-cache forward of one unpadded sequence tokens_T.

    Returns ForwardOut(logits [T, V], expert_ids [T, L, K]) with the batch dim dropped.
    """

    def _score(tokens_T: torch.Tensor) -> ForwardOut:
        T = tokens_T.shape[0]
        out = fp32_model.forward(tokens_T[None], torch.arange(T)[None], torch.ones((1, T), dtype=torch.bool))
        return ForwardOut(out.logits[0], out.expert_ids_BTLK[0])

    return _score
