"""``routing.verify``: the route verifier (moe_rl/routing/verify.py, docs/agentic.md 9). Every
``every`` steps, ``samples`` of each data-parallel rank's trajectories get one full no-cache prefill
in the rollout engine at the weights it holds, and its routes are compared row for row with the
stitched trace wherever the provenance says they should be equal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_rl.checks import check, check_finite

AUTO_EVERY = 10  # routing.verify.every=-1 on the built-in engine: measured in docs/agentic.md 9


@dataclass(frozen=True)
class VerifyConfig:
    # verify every N steps (the steps divisible by N); 0 = off; -1 = auto: every 10 on the built-in
    # engine with agent.env and no rollout.router_noise, else off (vLLM: not built yet)
    every: int = -1
    samples: int = 4  # trajectories verified per data-parallel rank (picked from the step's seed)
    # (row, layer) pairs whose Top-K margin in the verifying prefill is below this are not compared:
    # near ties, where another batch shape's rounding may pick the other expert (counted apart)
    margin: float = 1e-2
    # routing/verify_mismatch_frac above this raises a health alarm naming the worst layer and turn
    alarm_frac: float = 0.01

    def __post_init__(self) -> None:
        check_finite(self, "routing.verify")
        check(
            self.every >= -1, "routing.verify.every", f"must be >= 0 (0: off) or -1 (auto), got {self.every}"
        )
        check(self.samples >= 1, "routing.verify.samples", f"must be >= 1, got {self.samples}")
        check(self.margin >= 0, "routing.verify.margin", f"must be >= 0, got {self.margin}")
        check(
            0 <= self.alarm_frac <= 1,
            "routing.verify.alarm_frac",
            f"must be in [0, 1], got {self.alarm_frac}",
        )


def verify_every(cfg: Any) -> int:
    """The resolved interval (``cfg``: the RunConfig): ``every``, or auto's choice."""
    v, r = cfg.routing.verify, cfg.rollout
    if v.every >= 0:
        return v.every
    return AUTO_EVERY if cfg.agent.env and r.engine == "builtin" and r.router_noise == 0 else 0


def check_verify(cfg: Any) -> None:
    """What an explicit ``routing.verify.every`` > 0 cannot run with, refused naming the key."""
    every, r = cfg.routing.verify.every, cfg.rollout
    if every <= 0:
        return
    key = "routing.verify.every"
    check(bool(cfg.agent.env), key, f"{every}: the verifier checks multi-turn route traces: set agent.env")
    check(
        r.engine == "builtin",
        key,
        f"{every}: the verifier's full prefill is built for the built-in engine only; "
        f"rollout.engine={r.engine} is not yet (docs/agentic.md 9)",
    )
    check(
        r.router_noise == 0,
        key,
        f"{every}: rollout.router_noise={r.router_noise} draws new noise in every forward, so no "
        "prefill can reproduce the rollout's routes",
    )
