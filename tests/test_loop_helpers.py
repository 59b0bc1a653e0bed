"""unit tier: the training loop's helpers (checkpoint schedule, step timer, seeds)."""

from __future__ import annotations

import time

import pytest

from moe_rl.checkpointing import CheckpointManager
from moe_rl.config import load_config
from moe_rl.lr import LengthLRScheduler
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
def test_step_seeds_differ_per_step_rank_and_stream():
    seeds = {step_seed(1234, step, rank, stream) for step in range(50) for rank in range(8)
             for stream in (PROMPTS, GENERATE)}
    assert len(seeds) == 50 * 8 * 2
    assert step_seed(1234, 3, 1, PROMPTS) == ((1234 * 1_000_003 + 3) * 1_009 + 1) * 8  # resume redraws the same
