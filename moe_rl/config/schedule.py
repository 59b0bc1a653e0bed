"""The step's schedule (issue 41; docs/design.md 15): where the engines run and how their rollouts
overlap the learner's updates, chosen once from the config as a typed ``Schedule``.

Four kinds, from ``parallel.rollout_ranks`` and ``rollout.mode``:

- colocated sync: every rank holds a learner shard and an engine; rollouts wait for each sync;
- split sync: the engines run on their own ranks (``moe_rl/pipeline/placement.py``); batch t is
  generated with W_t, after the learner's sync of W_t;
- one_step_off: split, batch t + 1 is generated with W_t while the learner trains step t;
- async: split, request after request with in-flight weight updates and a bounded buffer.

Every question the code asks about the schedule is a property here, so no module outside
``moe_rl/config`` compares ``rollout.mode`` strings (tests/test_style.py). It lives in the config
package, not in ``moe_rl/pipeline``, because rooms below the pipeline ask it too (the vLLM engine's
arguments: no in-flight scheduling under async) and imports point down.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moe_rl.config.run import RunConfig


class ScheduleKind(enum.Enum):
    COLOCATED_SYNC = "colocated sync"
    SPLIT_SYNC = "split sync"
    ONE_STEP_OFF = "one_step_off"
    ASYNC = "async"


@dataclass(frozen=True)
class Schedule:
    """The step's schedule (see the module docstring); ``Schedule.from_config`` builds it."""

    kind: ScheduleKind
    max_staleness: int = 0  # async: the staleness filter's bound (rollout.max_staleness)
    simulated_staleness: int = 0  # colocated: rollout.staleness=k (moe_rl/pipeline/simulated_staleness.py)
    # algo.dynamic_sampling or algo.over_sampling with split sync / one_step_off: the learner asks
    # for each round
    dynamic_rounds: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Schedule:
        """The one place ``rollout.mode`` is read (the config refuses a mode other than sync
        without ``parallel.rollout_ranks``)."""
        r = cfg.rollout
        if not cfg.parallel.rollout_ranks:
            return cls(ScheduleKind.COLOCATED_SYNC, simulated_staleness=r.staleness)
        kinds = {"sync": ScheduleKind.SPLIT_SYNC, "one_step_off": ScheduleKind.ONE_STEP_OFF}
        kind = kinds.get(r.mode, ScheduleKind.ASYNC)
        by_round = cfg.algo.dynamic_sampling.enabled or cfg.algo.over_sampling.on
        rounds = by_round and kind is not ScheduleKind.ASYNC
        return cls(
            kind, max_staleness=r.max_staleness if kind is ScheduleKind.ASYNC else 0, dynamic_rounds=rounds
        )

    @property
    def mode(self) -> str:
        """``rollout.mode`` as configured (for messages only: decide with the properties below)."""
        return (
            "sync" if self.kind in (ScheduleKind.COLOCATED_SYNC, ScheduleKind.SPLIT_SYNC) else self.kind.value
        )

    @property
    def split(self) -> bool:
        """The engines run on rollout ranks of their own; the learner ranks hold a ``RemoteEngine``."""
        return self.kind is not ScheduleKind.COLOCATED_SYNC

    @property
    def runs_ahead(self) -> bool:
        """The rollout ranks generate step t + 1's batch while the learner trains step t
        (one_step_off), so one batch is in flight at every checkpoint."""
        return self.kind is ScheduleKind.ONE_STEP_OFF

    @property
    def buffers_requests(self) -> bool:
        """Finished requests queue per dp rank (async); a checkpoint saves the queue and the next
        request index, and each step trains on the buffer's next fresh request."""
        return self.kind is ScheduleKind.ASYNC

    @property
    def keeps_in_flight(self) -> bool:
        """Batches generated but not yet trained on exist at a checkpoint: resume state."""
        return self.runs_ahead or self.buffers_requests

    @property
    def updates_in_flight(self) -> bool:
        """Weight updates land between an engine's decode steps (async); the engine then stamps
        each token with the version of the weights that sampled it (``RolloutBatch.version_BS``)."""
        return self.kind is ScheduleKind.ASYNC

    @property
    def engine_stamps_versions(self) -> bool:
        """The batch's per-token versions are the engine's own; otherwise every token carries the
        version of the one weight set the batch was generated with, stamped by the learner side."""
        return self.updates_in_flight

    @property
    def picks_requests(self) -> bool:
        """A step trains on the request the buffer hands it (its own step index, prompts and seed:
        ``RemoteEngine.request_for``), not on the prompts of its own step."""
        return self.buffers_requests

    @property
    def rounds_on_request(self) -> bool:
        """Split sync / one_step_off with ``algo.dynamic_sampling`` or ``algo.over_sampling`` (whose
        rounds abort once the dp rank's step has the groups it asks for): the learner asks the rollout
        ranks for each generation round of a step by its data index (``RoundRequest``) and tells
        them when the step's rounds are done (one_step_off: with the next step's first round, to
        generate while it trains); async needs no asking: each round takes the buffer's next request."""
        return self.dynamic_rounds
