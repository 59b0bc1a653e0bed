"""``algo.dynamic_sampling``: DAPO's dynamic sampling (docs/sampling.md). Groups whose filter
values are all equal carry no signal (GRPO / RLOO / OTB advantages all 0) and are dropped before
the update; the step generates more rounds of prompts until it has ``rollout.prompts_per_step``
groups with signal, or ``max_rounds`` rounds were generated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_rl.checks import check, one_of

# the per-sample values a group can be filtered on (moe_rl.tasks.task.StepScores):
# accuracy     the verifier's score: task.reward's (or the environment's), before any shaping
# exact_match  1 iff the response is exactly the answer (the character tokenizer's tasks only)
# reward       the shaped reward the advantages use (accuracy + the overlong penalty): DAPO's
#              trap when shaping is on (a group of equal accuracy but unequal lengths is kept)
FILTER_KEYS = ("accuracy", "exact_match", "reward")


@dataclass(frozen=True)
class DynamicSamplingConfig:
    enabled: bool = False  # drop the groups without signal; generate more until the step is full
    filter: str = "accuracy"  # accuracy | exact_match | reward: the value whose equality drops a group
    # generation rounds per step at most (round 1: the step's own prompts; each further round draws
    # the next rollout.prompts_per_step prompts); then the step trains on what it has
    max_rounds: int = 4

    def __post_init__(self) -> None:
        one_of(self.filter, "algo.dynamic_sampling.filter", FILTER_KEYS)
        check(
            self.max_rounds >= 1,
            "algo.dynamic_sampling.max_rounds",
            f"{self.max_rounds} is below one round: each step generates its own prompts at least once",
        )


def check_dynamic_sampling(cfg: Any) -> None:
    """What dynamic sampling cannot run with, refused naming the key (``RunConfig`` calls it)."""
    ds, r = cfg.algo.dynamic_sampling, cfg.rollout
    if not ds.enabled:
        return
    # every schedule takes it (docs/sampling.md 3): colocated and async draw their rounds as
    # they draw a step's batch; split sync and one_step_off ask the rollout ranks for each round
    check(
        r.top_k != 1,
        "algo.dynamic_sampling.enabled",
        "no group can carry signal with rollout.top_k=1: greedy samples of one prompt are all equal",
    )
