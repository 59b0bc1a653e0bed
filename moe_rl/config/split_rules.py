"""What the split loop (``parallel.rollout_ranks`` > 0, docs/design.md 15) cannot run, as rules on
a config, each refused naming its key (pure: called by ``RunConfig``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.checks import check

if TYPE_CHECKING:
    from moe_rl.config import RunConfig


def check_split(cfg: RunConfig) -> None:
    """parallel.rollout_ranks > 0 (docs/design.md 15): what the split loop cannot run, each refused
    naming its key."""
    p, r, c = cfg.parallel, cfg.rollout, cfg.correction
    tp = r.vllm.tensor_parallel if r.engine == "vllm" else 1
    engines, dp = p.rollout_ranks // tp, cfg.data_parallel
    if not (r.engine == "vllm" and p.rollout_ranks % tp):  # else the vLLM rule names it
        check(
            dp % engines == 0,
            "parallel.rollout_ranks",
            f"{engines} rollout engine(s) do not split the {dp} learner data-parallel ranks: each engine "
            f"serves whole dp ranks (dp rank d: engine d % {engines}), so the engines must divide the "
            f"learner's data-parallel size",
        )
    check(
        not p.offload_during_rollout,
        "parallel.offload_during_rollout",
        "frees the device for a colocated engine; with parallel.rollout_ranks the learner ranks host none",
    )
    check(
        cfg.log.val_every == 0,
        "log.val_every",
        "validation runs on a colocated engine; with parallel.rollout_ranks set log.val_every=0",
    )
    check(
        r.mode == "sync" or not (c.mode == "bypass" and c.bypass_loss == "reinforce"),
        "correction.bypass_loss",
        f"reinforce has no ratio: it assumes samples from the current policy, and rollout.mode={r.mode} "
        f"samples from an older one; use correction.bypass_loss=ppo_clip or correction.mode=decoupled",
    )
