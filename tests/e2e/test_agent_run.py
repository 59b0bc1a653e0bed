"""e2e tier, issue 44 point 1: one `moe-rl train` of the embedded default (2 CPU ranks,
megatron-core over gloo) on the calculator environment, through the real CLI: the learner trains
exactly the assistant tokens, and the turn and end-reason metrics match the trajectory records."""

from __future__ import annotations

import json

import pytest

from moe_rl.agentic.loop import END_REASONS
from tests.e2e.helpers import TINY, metrics, moe_rl


@pytest.mark.e2e
def test_calculator_run_trains_assistant_tokens_only(tmp_path):
    run = tmp_path / "run"
    moe_rl(
        "train",
        f"run_dir={run}",
        "steps=2",
        "checkpoint_every=0",
        "agent.env=calculator",
        "agent.max_turns=2",
        # the prefix cache and the strictest stale-row policy ride along: colocated, no weight update
        # lands inside a rollout, so no row is stale and nothing is dropped
        "rollout.prefix_cache_blocks=256",
        "rollout.prefix_block_tokens=4",
        "routing.stale_rows=drop_sample",
        *TINY,
    )
    recs = [
        json.loads(line) for r in (0, 1) for line in (run / "agent" / f"trajectories_rank{r}.jsonl").open()
    ]
    m = metrics(run)
    assert sorted(m) == [0, 1] and len(recs) == 64  # 2 steps x 8 prompts x 4 samples, over 2 ranks
    for step, rec in m.items():
        mine = [r for r in recs if r["step"] == step]
        assistant = sum(r["assistant_tokens"] for r in mine)
        tools = sum(r["tool_tokens"] for r in mine)
        # the loss mask is the assistant's tokens; the tool replies ride in the forward only
        assert rec["train/loss_tokens"] == rec["agent/assistant_tokens"] == assistant > 0
        assert rec["routing/version_mismatch_rows"] == 0 and rec["routing/stale_samples_dropped"] == 0
        assert rec["agent/tool_tokens"] == tools > 0
        assert rec["rollout/num_response_tokens"] == assistant + tools
        assert rec["agent/turns_mean"] == pytest.approx(sum(r["turns"] for r in mine) / 32)
        assert rec["agent/turns_max"] == 2.0  # a turn after a tool reply happened
        for reason in END_REASONS:
            assert rec[f"agent/end/{reason}"] == sum(r["end"] == reason for r in mine)
        assert rec["agent/end/answer"] + rec["agent/end/max_turns"] + rec["agent/end/truncated"] == 32
        calls = sum(r["tool_calls"] for r in mine)
        failed = sum(sum(r["tool_errors"].values()) for r in mine)
        assert rec["agent/tool_calls"] == calls and rec["agent/tool_success_rate"] == pytest.approx(
            (calls - failed) / calls
        )
        assert rec["reward/mean"] == pytest.approx(sum(r["reward"] for r in mine) / 32)
        # a trajectory ends at turn 2 with a call (max_turns) or earlier/later with an answer or a cut turn
        assert all(r["turns"] == 2 for r in mine if r["end"] == "max_turns")
