"""Sizing arithmetic (moe_rl/memory.py): parameter counts against canonical shapes, FLOPs/MFU by
hand, and the smoke-test summary on a synthetic metrics.jsonl."""

from __future__ import annotations

import math

import pytest

from moe_rl.config import ModelConfig, load_config
from moe_rl.memory import (
    forward_flops_per_token,
    mfu,
    param_counts,
    summarize_run,
    train_flops_per_token,
)
from moe_rl.rollout.builtin_model import canonical_param_shapes

CFG = ModelConfig(vocab_size=50, num_layers=3, first_k_dense=1, num_experts=4, moe_router_topk=2)


@pytest.mark.unit
def test_param_counts_match_the_canonical_shapes():
    shapes = canonical_param_shapes(CFG)
    c = param_counts(CFG)
    assert c["total"] == sum(math.prod(s) for s in shapes.values())
    assert c["expert"] == sum(math.prod(s) for k, s in shapes.items() if ".experts." in k)
    one_expert = 3 * CFG.hidden_size * CFG.moe_ffn_hidden_size
    assert c["active"] == c["dense"] + 2 * 2 * one_expert  # 2 MoE layers x top-2
    assert c["matmul_active"] == c["active"] - 50 * CFG.hidden_size


@pytest.mark.unit
def test_mfu_by_hand():
    n = param_counts(CFG)["matmul_active"]
    assert train_flops_per_token(CFG) == 6 * n and forward_flops_per_token(CFG) == 2 * n
    got = mfu(CFG, trained_tokens=1000, forward_tokens=2000, seconds=2.0, num_gpus=4, peak_tflops=1.0)
    assert got == pytest.approx((6 * n * 1000 + 2 * n * 2000) / (2.0 * 4 * 1e12))


@pytest.mark.unit
def test_summarize_run_skips_warmup_and_reports_agreement():
    cfg = load_config(None, ["model.vocab_size=50", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                             "algo.num_minibatches=1"])
    rows = [{"time/step_s": 100.0, "rollout/response_len_mean": 1.0},
            {"time/step_s": 2.0, "rollout/response_len_mean": 4.0, "routing/flip_router_frac": 0.1},
            {"time/step_s": 4.0, "rollout/response_len_mean": 6.0, "routing/flip_router_frac": 0.3}]
    s = summarize_run(rows, cfg, prompt_tokens=5.0)
    assert s["steps"] == 2 and s["step_s"] == 3.0
    assert s["tokens_per_step"] == 8 * (5.0 + 5.0) and s["tokens_per_s"] == pytest.approx(80 / 3)
    assert s["routing_agreement"] == pytest.approx(0.8)
    n = param_counts(cfg.model)["matmul_active"]
    assert s["mfu"] == pytest.approx((6 * n * 80 + 2 * 2 * n * 80) / (3.0 * 989e12))
    assert "learner_mfu" not in s and "peak_gib" not in s


@pytest.mark.unit
def test_summarize_run_learner_mfu_peak_memory_and_reward_trend():
    cfg = load_config(None, ["model.vocab_size=50", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
                             "algo.num_minibatches=1"])
    rows = [{"time/step_s": 9.0, "time/old_logprob_s": 1.0, "time/update_s": 2.0, "rollout/response_len_mean": 5.0,
             "reward/mean": 0.1 * i, "mem/peak_gib": 3.0 + i % 3} for i in range(8)]
    s = summarize_run(rows, cfg, prompt_tokens=5.0)
    n = param_counts(cfg.model)["matmul_active"]
    tokens = 8 * 10.0
    assert s["learner_s"] == 3.0
    # the learner trains every token once (6N) and runs one forward-only pass (old log-probs, 2N)
    assert s["learner_mfu"] == pytest.approx((6 * n * tokens + 2 * n * tokens) / (3.0 * 989e12))
    assert s["peak_gib"] == 5.0
    assert (s["reward_first"], s["reward_last"]) == (pytest.approx(0.05), pytest.approx(0.65))
