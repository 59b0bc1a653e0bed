"""Which routes each pass of a step uses, decided once from ``routing.replay`` (never inferred
from what a batch happens to carry).

| routing.replay | old-log-prob pass       | update passes              | reference pass            |
|----------------|-------------------------|----------------------------|---------------------------|
| off            | observe the rollout's   | native (observe old routes | native                    |
|                |                         | when the monitor is on)    |                           |
| r2             | record native routes    | replay the recorded ones   | replay them (if replay_reference) |
| r3             | replay the rollout's    | replay the rollout's       | replay them (if replay_reference) |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ReplayMode(str, Enum):
    """``routing.replay``."""

    OFF = "off"
    R2 = "r2"  # the learner's own old-policy routes
    R3 = "r3"  # the rollout engine's routes


class PassMode(str, Enum):
    """What the replay controller does in one pass over micro-batches."""

    OBSERVE = "observe"  # route natively; compare with the given routes (agreement metrics)
    RECORD = "record"  # route natively and keep the routes
    REPLAY = "replay"  # force the given routes


@dataclass(frozen=True)
class PassPlan:
    """One pass's routing. ``keep_native`` keeps the native routes in any mode (the monitor's
    update-induced flips compare the update passes with the old pass's); metrics are filed
    under ``prefix``. ``num_lags`` > 0 also splits the flips against the given routes by the
    version lag of each row (``{prefix}flip_frac_lag<k>``, k < num_lags; the batch carries
    ``route_lag_BS``). ``margins``: the flips against the given routes are also counted by the
    learner's Top-K margin (``{prefix}flip_frac_margin_<bucket>``, routing/topk_overlap.py).
    ``num_turns`` > 0 (agent runs): by the turn whose engine call computed each row
    (``agent/flip_frac/turn<k>``, k = 1..num_turns; the batch carries ``route_turn_BS``)."""

    mode: PassMode
    keep_native: bool = False
    prefix: str = "routing/"
    num_lags: int = 0
    margins: bool = False
    num_turns: int = 0

    @property
    def records(self) -> bool:
        return self.keep_native or self.mode is PassMode.RECORD


@dataclass(frozen=True)
class ReplayPlan:
    """The step's passes, from ``routing.replay``, ``routing.replay_reference`` and whether the
    router monitor runs."""

    mode: ReplayMode
    replay_reference: bool = True
    monitor: bool = False

    @classmethod
    def from_config(cls, replay: str, replay_reference: bool, monitor: bool) -> ReplayPlan:
        return cls(ReplayMode(replay), replay_reference, monitor)

    @property
    def old_pass(self) -> PassPlan:
        mode = {
            ReplayMode.OFF: PassMode.OBSERVE,
            ReplayMode.R2: PassMode.RECORD,
            ReplayMode.R3: PassMode.REPLAY,
        }[self.mode]
        return PassPlan(mode, keep_native=self.monitor, margins=True)

    @property
    def needs_old_routes(self) -> bool:
        """The old pass's native routes are kept: R2 replays them, the monitor compares with them."""
        return self.old_pass.records

    def update_routes(self, rollout, recorded):
        """The routes the update (and reference) passes replay: R2 the old pass's, R3 the rollout's."""
        return {ReplayMode.OFF: None, ReplayMode.R2: recorded, ReplayMode.R3: rollout}[self.mode]

    @property
    def update_pass(self) -> PassPlan | None:
        """Replay under R2/R3; without replay, observe only to compare with the old pass (monitor)."""
        if self.mode is not ReplayMode.OFF:
            return PassPlan(PassMode.REPLAY, prefix="routing/update_")
        return PassPlan(PassMode.OBSERVE, prefix="routing/update_") if self.monitor else None

    @property
    def reference_pass(self) -> PassPlan | None:
        if self.mode is ReplayMode.OFF or not self.replay_reference:
            return None
        return PassPlan(PassMode.REPLAY)
