"""unit tier, issue 44 point 1: the multi-turn loop on the real built-in engine (the embedded
default's warm start, the calculator, the compact format): one token sequence per trajectory,
sampled tokens only in the mask, earlier turns' tokens and route rows never replaced, every end
counted by reason."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_rl.agentic.loop import _TURN_SEED, END_REASONS
from moe_rl.config import load_config
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.step.plan import sampling_params
from moe_rl.tasks.task import build_task
from moe_rl.weights.warmstart import load_init_weights

pytestmark = pytest.mark.unit


def _run(*overrides: str):
    # 12 new tokens: a call of the agent warm start (the default init_weights here) is up to 11 and eos
    cfg = load_config(None, ["agent.env=calculator", "rollout.max_new_tokens=12", *overrides])
    cfg, task = build_task(cfg, start_pool=False)
    engine = BuiltinEngine(cfg.model, pad_id=task.tokenizer.pad_id)
    engine.load_weights(load_init_weights(cfg.init_weights, cfg.model, task.tokenizer))
    prompts = task.source.sample_step(0, 2, 0, 1, 7)
    sampling = sampling_params(cfg, task.tokenizer.eos_ids)
    return cfg, task, engine, prompts, sampling, task.agent.rollout(engine, prompts, 3, sampling, 11)


def test_trajectories_are_one_append_only_sequence_with_assistant_only_mask():
    cfg, task, engine, prompts, sampling, b = _run("agent.max_turns=3")
    m = b.engine_metrics
    mask_BS, turn_BS = b.response_mask_BS, b.turn_BS.long()
    T_B = b.prompt_lens_B + b.response_lens_B
    # the loss mask is the sampled tokens: counted the same way by the metrics
    assert int(mask_BS.sum()) == m["agent/assistant_tokens"].value > 0
    injected_BS = (turn_BS >= 1) & ~mask_BS & (torch.arange(b.tokens_BS.shape[1])[None] < T_B[:, None])
    assert int(injected_BS.sum()) == m["agent/tool_tokens"].value > 0
    assert bool((b.logprobs_BS[~mask_BS] == 0).all()) and bool((b.version_BS[~mask_BS] == 0).all())
    # turns: the last turn of each row is its turn count
    turns_B = turn_BS.max(1).values.float()
    assert m["agent/turns_mean"].sum == float(turns_B.sum()) and m["agent/turns_mean"].count == 6.0
    assert sum(m[f"agent/end/{r}"].value for r in END_REASONS) == 6.0
    # one route row per token but the last, all computed by the engine (no MISSING on this engine)
    assert [r.shape[0] for r in b.routes] == (T_B - 1).tolist()
    assert all(int(r.max()) < cfg.model.num_experts for r in b.routes)
    # turn 1 is exactly what one generate call gives; later turns never replaced its tokens or rows
    turn1 = engine.generate(
        [p.prompt_ids for p in prompts for _ in range(3)],
        1,
        dataclasses.replace(sampling, max_new_tokens=12),
        seed=(11 + _TURN_SEED) % 2**63,
    )
    for i in range(6):
        end1 = int(turn1.prompt_lens_B[i] + turn1.response_lens_B[i])
        assert torch.equal(b.tokens_BS[i, :end1], turn1.tokens_BS[i, :end1])
        assert torch.equal(b.routes[i][: end1 - 1], turn1.routes[i][: end1 - 1])
        assert torch.equal(b.logprobs_BS[i, :end1], turn1.logprobs_BS[i, :end1])
    # a later turn appended after a tool reply (else this test shows nothing about turns)
    assert int(turns_B.max()) >= 2


def test_limits_end_trajectories_with_their_reason():
    *_, b = _run("agent.max_turns=1")
    m = b.engine_metrics
    calls_or_bad = m["agent/end/max_turns"].value
    assert m["agent/end/answer"].value + m["agent/end/truncated"].value + calls_or_bad == 6.0
    assert m["agent/tool_tokens"].value == 0 and int(b.turn_BS.max()) == 1
    *_, b = _run("agent.max_turns=3", "agent.max_tool_tokens_total=1")  # every reply is longer
    m = b.engine_metrics
    assert (
        m["agent/end/tool_budget"].value == 6.0 - m["agent/end/answer"].value - m["agent/end/truncated"].value
    )
    assert m["agent/tool_tokens"].value == 0
    *_, b = _run("agent.max_total_tokens=24")  # prompt (~9) + a turn (12) fit once, then no more
    assert b.engine_metrics["agent/end/context"].value > 0
    assert int((b.prompt_lens_B + b.response_lens_B).max()) <= 24


def test_a_resumed_run_logs_each_step_once(tmp_path):
    # the steps after the checkpoint ran before the stop and run again after the resume: their
    # first records are dropped; a new run in the same directory starts an empty log
    cfg, task, engine, prompts, sampling, _ = _run()
    log = tmp_path / "agent" / "trajectories_rank0.jsonl"
    task.agent.log_to(log)
    for step in range(3):
        task.agent.rollout(engine, prompts, 1, sampling, 11, step=step)
    steps = [json.loads(line)["step"] for line in log.open()]
    assert steps == [0, 0, 1, 1, 2, 2]  # 2 prompts x 1 sample per step
    task.agent.log_to(log, resume_step=1)  # resumed from the checkpoint of step 1
    task.agent.rollout(engine, prompts, 1, sampling, 11, step=1)
    assert [json.loads(line)["step"] for line in log.open()] == [0, 0, 1, 1]
    task.agent.log_to(log)
    assert log.read_text() == ""
