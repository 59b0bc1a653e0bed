"""Shared pieces of the over-sampling tests (tests/step/test_oversample.py): a tiny built-in engine
whose responses have a long tail, a deterministic score, and the step's callables over them."""

from __future__ import annotations

import dataclasses

import torch

from moe_rl.config.dynamic_sampling import DynamicSamplingConfig
from moe_rl.config.over_sampling import OverSamplingConfig
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.step.oversample import OverSamplingPlan
from moe_rl.tasks.task import StepScores
from moe_rl.types import Prompt, SamplingParams, with_version
from moe_rl.weights.canonical import random_canonical_weights
from tests.models import hf_tiny

PAD_ID = 0
N = 2  # samples per prompt
MAX_NEW = 12
# 8 of the 40 ids stop a response: most end within a few tokens, a few run long (the long tail)
SAMPLING = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=tuple(range(1, 9)))
CFG = hf_tiny()


def weights(version: int) -> dict[str, torch.Tensor]:
    """Unrelated random weights per version, so a token sampled under the wrong one shows."""
    return random_canonical_weights(CFG, seed=100 + 7 * version)


def make_engine(version: int = 1) -> BuiltinEngine:
    e = BuiltinEngine(CFG, dtype="fp32", pad_id=PAD_ID)
    e.load_weights(weights(version), version=version)
    return e


def draw(index: int, count: int) -> list[Prompt]:
    """``count`` prompts of data-cursor index ``index`` (a pure function of both)."""
    return [Prompt([10 + (index * 7 + k) % 25, 11, 12 + k % 5], "x", "r", "t") for k in range(count)]


def generator(engine: BuiltinEngine):
    """The step's flat generate call, as the trainer's: n = 1, seeded by the index, versions stamped."""

    def generate(ids, index, abort):
        got = engine.generate(ids, 1, SAMPLING, seed=1000 + index, abort=abort)
        return with_version(dataclasses.replace(got, version_BS=None), engine.version)

    return generate


def score(prompts, batch) -> StepScores:
    """Accuracy 1 iff the response has an odd length: groups with and without signal both occur."""
    acc_B = (batch.response_lens_B % 2).float()
    return StepScores(acc_B, acc_B, None, {})


def plan(
    factor: float = 2.0, on_abort: str = "partial", need: int = 4, dynamic: bool = False, staleness: int = 1
):
    return OverSamplingPlan(
        OverSamplingConfig(factor, on_abort, check_every=2),
        DynamicSamplingConfig(enabled=dynamic, max_rounds=3),
        need,
        N,
        MAX_NEW,
        staleness,
        PAD_ID,
    )
