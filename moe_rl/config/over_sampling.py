"""``algo.over_sampling``: over-sampling with early abort (APRIL, slime's
``--over-sampling-batch-size``, Megatron-LM's ``--rl-partial-rollouts``; docs/sampling.md 6). A round
starts ``factor`` times the prompt groups a step needs and aborts the rest once enough groups are
complete (with signal, under ``algo.dynamic_sampling``); the aborted responses are dropped, or kept as
partial rollouts and resumed at the next step under the new weights (``on_abort=partial``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_rl.checks import check, one_of

ON_ABORT = ("drop", "partial")


@dataclass(frozen=True)
class OverSamplingConfig:
    # prompt groups a generation round starts, as a multiple of those the step needs (rounded up per
    # data-parallel rank); 1 = off: a round generates exactly the step's prompts, to the end
    factor: float = 1.0
    # what becomes of the groups still generating when enough are complete: drop (counted, with the
    # length bias: sampling/dropped_len_mean vs sampling/kept_len_mean) | partial (kept, resumed at the
    # next step under the new weights; dropped once older than rollout.max_staleness versions)
    on_abort: str = "drop"
    check_every: int = (
        4  # decode steps (vLLM: engine steps) between the engine's checks for enough complete groups
    )

    def __post_init__(self) -> None:
        check(
            self.factor >= 1,
            "algo.over_sampling.factor",
            f"{self.factor} is below 1: a round starts at least the prompts the step needs",
        )
        one_of(self.on_abort, "algo.over_sampling.on_abort", ON_ABORT)
        check(
            self.check_every >= 1, "algo.over_sampling.check_every", f"must be >= 1 (got {self.check_every})"
        )

    @property
    def on(self) -> bool:
        return self.factor > 1

    @property
    def partial(self) -> bool:
        return self.on and self.on_abort == "partial"


def check_over_sampling(cfg: Any) -> None:
    """What over-sampling cannot run with, and the staleness bound it uses, refused naming the key
    (``RunConfig`` calls it)."""
    os_, r = cfg.algo.over_sampling, cfg.rollout
    check(
        r.mode == "async" or os_.partial or r.max_staleness == type(r).max_staleness,
        "rollout.max_staleness",
        f"{r.max_staleness} acts only with rollout.mode=async (the staleness filter) or "
        f"algo.over_sampling.on_abort=partial (the partial rollouts' bound), and rollout.mode={r.mode} "
        f"has none: drop the key, or use rollout.mode=async",
    )
    if not os_.on:
        for key, default in (("on_abort", "drop"), ("check_every", 4)):
            check(
                getattr(os_, key) == default,
                f"algo.over_sampling.{key}",
                "acts only with algo.over_sampling.factor > 1 (nothing is aborted at 1): set the "
                "factor, or drop the key",
            )
        return
    key = "algo.over_sampling.factor"
    split = cfg.parallel.rollout_ranks > 0
    check(
        not split or r.mode != "async",
        key,
        "is not built for rollout.mode=async: each round is the buffer's next request, generated to "
        "the end (docs/sampling.md 6); use rollout.mode=sync or one_step_off",
    )
    check(
        r.engine == "builtin" or r.vllm.tensor_parallel == 1,
        key,
        f"aborts vLLM's requests on engines of rollout.vllm.tensor_parallel=1 only (got "
        f"{r.vllm.tensor_parallel}): the aborted requests' route rows are read on the rank that runs "
        f"them (docs/sampling.md 6)",
    )
    check(not cfg.agent.env, key, "is not built for the multi-turn loop (agent.env) yet (docs/sampling.md 6)")
    check(
        not os_.partial or r.max_staleness >= 1,
        "rollout.max_staleness",
        "0 drops every partial rollout: a resumed response's earlier tokens are 1 version old when it "
        "trains; use rollout.max_staleness >= 1, or algo.over_sampling.on_abort=drop",
    )
    check(
        not os_.partial or r.max_staleness > r.staleness,
        "rollout.max_staleness",
        f"{r.max_staleness} drops every partial rollout with rollout.staleness={r.staleness}: a resumed "
        f"response's earlier tokens lag {r.staleness + 1} versions when it trains; use rollout.max_staleness "
        f">= {r.staleness + 1}",
    )
    # one_step_off: a step's first round is generated ahead with W_t-1, so what it leaves pending lags
    # 2 versions when the next step trains it (docs/sampling.md 6)
    check(
        not os_.partial or r.mode != "one_step_off" or r.max_staleness >= 2,
        "rollout.max_staleness",
        f"{r.max_staleness} drops every partial rollout of a step's first round with rollout.mode="
        "one_step_off: that round is generated ahead with the weights one update behind, so a response "
        "it leaves pending lags 2 versions when the next step trains it; use rollout.max_staleness >= 2",
    )
