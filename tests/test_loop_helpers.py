"""unit tier: the training loop's helpers (checkpoint schedule, step timer and its phases, seeds)."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from moe_rl.checkpointing import CheckpointManager
from moe_rl.config import load_config
from moe_rl.maths.lr import LengthLRScheduler
from moe_rl.memory import COLOCATED_ORDER, summarize_run
from moe_rl.pipeline.offload_timeline import OffloadTimeline
from moe_rl.seeding import GENERATE, PROMPTS, step_seed
from moe_rl.timing import StepTimer


@pytest.mark.unit
def test_checkpoint_schedule_every_n_steps_and_after_the_last():
    cfg = load_config(None, ["steps=7", "checkpoint_every=3"])
    ckpt = CheckpointManager(cfg, learner=None, lr_sched=LengthLRScheduler(cfg.optim.length_lr))
    assert [s for s in range(7) if ckpt.due(s)] == [2, 5, 6]  # after steps 3, 6 and the last (7)
    never = CheckpointManager(load_config(None, ["steps=4", "checkpoint_every=0"]), None, None)
    assert [s for s in range(4) if never.due(s)] == [3]  # the last step is always kept
    assert CheckpointManager(load_config(None), None, None).resume() == 0  # resume=false starts at 0


@pytest.mark.unit
def test_step_timer_adds_phases_and_the_whole_step():
    timer = StepTimer()
    for _ in range(2):
        with timer.phase("update"):
            time.sleep(0.01)
    m = timer.metrics()
    assert set(m) == {"time/update_s", "time/step_s"}
    assert 0.02 <= m["time/update_s"] <= m["time/step_s"]


@pytest.mark.unit
def test_the_loop_times_each_stage_apart_and_the_learner_time_counts_its_passes():
    tree = ast.parse((Path(__file__).resolve().parents[1] / "moe_rl" / "trainer.py").read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    train = funcs["train"]

    def phases(fn):
        calls = (n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute))
        return [c.args[0].value for c in sorted(calls, key=lambda n: n.lineno) if c.func.attr == "phase"]

    # a step's rounds (one unless algo.dynamic_sampling: docs/sampling.md) each generate, then score;
    # then the rollout's weight versions (rollout.staleness); algo.over_sampling's flat generate call
    # (docs/sampling.md 6) is rollout time too, and so is a split run's over-sampled round (asked
    # for and received from the rollout rank)
    assert phases(funcs["rollout_step"]) == ["rollout", "score", "rollout", "rollout", "rollout"]
    # old_logprob is the old pass alone (scripts and memory.summarize_run read time/<phase>_s)
    assert phases(train) == [
        "old_logprob",
        "prepare",
        "reference",
        "update",
    ]
    # the mismatch split's extra forward is timed apart, on the steps it runs (docs/math.md 7.4)
    (split,) = [n for n in ast.walk(train) if isinstance(n, ast.Call) and ast.unparse(n.func) == "split_step"]
    (old_pass,) = [
        n
        for n in ast.walk(train)
        if isinstance(n, ast.Call) and ast.unparse(n) == "timer.phase('old_logprob')"
    ]
    assert ast.unparse(split.args[-1]) == "timer.phase" and split.lineno > old_pass.lineno
    # the sync's phases are timed by the offload timeline (WeightSync.sync runs it in ``syncing``)
    syncs = [
        n
        for n in ast.walk(train)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "sync"
    ]
    # one sync per step, timed by the step's timer; its second argument: the last step (a stop, issue 42)
    assert [ast.unparse(n.args[0]) for n in syncs] == ["timer.phase"] and len(syncs[0].args) == 2
    timer = StepTimer()  # offload off: the sync phase alone, as before
    with OffloadTimeline(None).syncing(timer.phase):
        pass
    assert set(timer.metrics()) == {"time/sync_s", "time/step_s"}
    # offload on (tests/learner/test_offload_dist.py records them): the estimate's phase names,
    # in its order (moe_rl/memory/phases.py), so the memory timeline and the estimate line up
    on = ["offload", "sync", "learner_out"]
    assert [p for p in COLOCATED_ORDER if p in on] == on
    cfg = load_config(
        None,
        [
            "model.vocab_size=50",
            "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=2",
            "algo.num_minibatches=1",
        ],
    )
    rows = [
        {
            "time/step_s": 9.0,
            "time/old_logprob_s": 1.0,
            "time/reference_s": 0.5,
            "time/update_s": 2.0,
            "rollout/response_len_mean": 5.0,
        }
    ] * 2
    assert summarize_run(rows, cfg, prompt_tokens=5.0)["learner_s"] == 3.5  # old + reference + update


@pytest.mark.unit
def test_step_seeds_differ_per_step_rank_and_stream():
    seeds = {
        step_seed(1234, step, rank, stream)
        for step in range(50)
        for rank in range(8)
        for stream in (PROMPTS, GENERATE)
    }
    assert len(seeds) == 50 * 8 * 2
    assert (
        step_seed(1234, 3, 1, PROMPTS) == ((1234 * 1_000_003 + 3) * 1_009 + 1) * 8
    )  # resume redraws the same
