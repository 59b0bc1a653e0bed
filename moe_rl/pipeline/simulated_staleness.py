"""``rollout.staleness=k``: the engine generates with the policy of k steps ago, as an
asynchronous pipeline does, so off-policy correction meets a real source of mismatch.

The learner keeps the last k + 1 exported weight sets (W_0 is the start, W_{t+1} the weights
after step t's update) and syncs the engine with the oldest one, so step t's rollout comes from
W_{max(0, t-k)}: the first k steps use the initial weights. The rollout's log-probs are the
engine's, i.e. the stale policy's, and the corrections compare them with the current learner's
old-log-prob pass (decoupled PPO: rollout -> old by IS/RS/TRM, old -> theta by the clip).

With k = 0 nothing is copied: ``push`` hands back the export it was given, today's sync exactly.
With k > 0 each set is a detached copy on the export's device (k + 1 full canonical weight sets
per rank: sized for small models). The sets are part of the resume state (``state_dict``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

import torch

from moe_rl.errors import CheckpointError
from moe_rl.maths.versions import weight_version
from moe_rl.types import RolloutBatch, with_version

Named = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)


class SimulatedStaleness:
    def __init__(self, staleness: int, remote: bool = False) -> None:
        if staleness < 0:
            raise ValueError(f"rollout.staleness must be >= 0, got {staleness}")
        self.k = staleness
        # parallel.rollout_ranks: the rollout ranks stamp each batch with the version of the weights
        # they generated it with (moe_rl/pipeline/remote_engine.py); k is 0 there
        self.remote = remote
        self.sets: deque[Named] = deque(maxlen=staleness + 1)  # oldest first; the newest is the learner's

    def push(self, named: Named) -> Named:
        """Record the learner's newest export (W_0 on the first call); return the weight set the
        engine must hold now. The learner updates its weights in place: the kept sets are copies."""
        if self.k == 0:
            return named
        if not self.sets:  # the cost, said once: k + 1 full copies of the weights on this rank
            size = sum(t.numel() * t.element_size() for t in named.values()) / 2**30
            logger.info(
                "rollout.staleness=%d keeps %d weight sets of %.2f GiB on this rank (%.2f GiB)",
                self.k,
                self.k + 1,
                size,
                (self.k + 1) * size,
            )
        self.sets.append({n: t.detach().clone() for n, t in named.items()})
        return self.sets[0]

    def resume_push(self, named: Named) -> Named:
        """After ``load_state_dict``: the engine's weight set at the resumed step (the saved sets
        already end with the learner's own weights, so ``named`` only checks they agree)."""
        if self.k == 0:
            return named
        newest = self.sets[-1]
        if sorted(newest) != sorted(named) or any(
            not torch.equal(newest[n], named[n].to(newest[n].device)) for n in named
        ):
            raise CheckpointError(
                "the saved stale weight sets (checkpoints/stale_weights_step_N.pt) do not end "
                "with the checkpoint's weights: they belong to another checkpoint"
            )
        return self.sets[0]

    def engine_version(self, step: int) -> int:
        """The version of the weights the engine holds during step ``step``'s rollout: that of
        W_max(0, t-k) (``weight_version``: W_u is version u + 1; the learner holds W_t)."""
        return weight_version(max(0, step - self.k))

    def versioned(self, batch: RolloutBatch, step: int) -> tuple[RolloutBatch, dict]:
        """Step ``step``'s rollout with the version of the weights it was sampled with on every
        generated token, and ``metrics``. The colocated engine holds one weight set for the whole
        call, the one this queue synced; an engine's own version (the built-in's counts its loads:
        it restarts on resume and goes up when a stale set is loaded again) is replaced."""
        if self.remote:
            return batch, self.metrics()
        return with_version(
            dataclasses.replace(batch, version_BS=None), self.engine_version(step)
        ), self.metrics()

    def metrics(self) -> dict:
        """Before the step's update: how many updates the engine's weights are behind the
        learner's (min(t, k)); a plain number, the same on every rank."""
        return {"rollout/policy_lag": float(len(self.sets) - 1)} if self.k else {}

    def state_dict(self) -> dict:
        return {
            "staleness": self.k,
            "sets": [{n: t.cpu() for n, t in s.items()} for s in self.sets] if self.k else [],
        }

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        if int(state["staleness"]) != self.k:
            raise CheckpointError(
                f"the checkpoint's stale weight sets are for rollout.staleness={state['staleness']}, "
                f"this run has rollout.staleness={self.k}"
            )
        self.sets.clear()
        for s in state["sets"]:
            self.sets.append({n: t.to(device) for n, t in s.items()})
