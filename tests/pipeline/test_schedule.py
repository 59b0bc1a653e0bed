"""The step's schedule (moe_rl/config/schedule.py, issue 41): one typed object per run, built once
from the config, answering every question the pipeline asks about it."""

from __future__ import annotations

import pytest

from moe_rl.config import ConfigError, Schedule, ScheduleKind, load_config

SPLIT = ["parallel.nproc=3", "parallel.rollout_ranks=1"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "kind", "answers"),
    [
        ([], ScheduleKind.COLOCATED_SYNC, (False, False, False, False, False)),
        (SPLIT, ScheduleKind.SPLIT_SYNC, (True, False, False, False, False)),
        ([*SPLIT, "rollout.mode=one_step_off"], ScheduleKind.ONE_STEP_OFF, (True, True, False, True, False)),
        ([*SPLIT, "rollout.mode=async"], ScheduleKind.ASYNC, (True, False, True, True, True)),
    ],
)
def test_schedule_answers_from_the_config(overrides, kind, answers):
    s = Schedule.from_config(load_config(None, overrides))
    assert s.kind is kind
    got = (s.split, s.runs_ahead, s.buffers_requests, s.keeps_in_flight, s.updates_in_flight)
    assert got == answers
    # async alone: the engine stamps per-token versions and a step trains on the buffer's request
    assert s.engine_stamps_versions == s.picks_requests == (kind is ScheduleKind.ASYNC)
    assert s.mode == load_config(None, overrides).rollout.mode


@pytest.mark.unit
def test_schedule_carries_the_staleness_knobs_it_uses():
    assert Schedule.from_config(load_config(None, ["rollout.staleness=2"])).simulated_staleness == 2
    a = Schedule.from_config(load_config(None, [*SPLIT, "rollout.mode=async", "rollout.max_staleness=3"]))
    assert a.max_staleness == 3
    # the default bound (1) is no filter outside async; a value set with another mode is refused
    assert Schedule.from_config(load_config(None, SPLIT)).max_staleness == 0
    with pytest.raises(ConfigError, match="'rollout.max_staleness': 3 acts only with rollout.mode=async"):
        load_config(None, [*SPLIT, "rollout.max_staleness=3"])


@pytest.mark.unit
def test_split_sync_and_one_step_off_ask_for_dynamic_sampling_rounds():
    """algo.dynamic_sampling (docs/sampling.md 3): the learner asks the rollout ranks for each round
    under split sync and one_step_off; colocated has its own engine, async takes buffered requests."""
    on = "algo.dynamic_sampling.enabled=true"
    asks = {
        mode: Schedule.from_config(load_config(None, [*SPLIT, f"rollout.mode={mode}", on])).rounds_on_request
        for mode in ("sync", "one_step_off", "async")
    }
    assert asks == {"sync": True, "one_step_off": True, "async": False}
    assert not Schedule.from_config(load_config(None, [on])).rounds_on_request
    assert not Schedule.from_config(load_config(None, SPLIT)).rounds_on_request  # off: never asked
