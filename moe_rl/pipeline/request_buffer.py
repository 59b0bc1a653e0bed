"""The async request buffer and its staleness filter (``rollout.mode=async``, docs/design.md 15.3):
the pieces both roles share.

Rollout ranks generate request after request (a request: one data-parallel rank's prompts and seed
of one step index, numbered per dp rank from 0) with ``BackgroundWeights`` (``weight_sync.py``) as
the engine's
``UpdateSource``: the learner's syncs are received in a background thread and applied between
decode steps, so the tokens after a sync carry its version. Each finished request is sent to its
learner ranks at once; at most ``buffer_bound`` sends per dp rank are unreceived (the buffer).

The learner takes its dp rank's next request each step (``take_fresh``) and keeps it only if the
staleness filter keeps all of it; a request with any stale group is dropped whole and the next one
taken. With the built-in engine every sequence of a request starts at the same prefill, so a
request's oldest token version is shared by all of its sequences and the filter keeps or drops it
whole anyway; dropping whole requests keeps every dp rank at a full step's worth of groups, so
``algo.num_minibatches`` splits every step's batch as the config check guarantees and the ranks run
the same number of optimizer steps. The filter (``staleness_filter``) is built on the pure
version maths of ``moe_rl/maths/versions.py``.

Checkpoints: when a rollout rank applies the sync that precedes a checkpoint it sends a ``Fence``
to every learner rank it serves; the learner receives up to the fence and saves those finished
requests beside the checkpoint. The request being generated at that moment is not saved: a resumed
run generates it again (with other weights: async is not bit-for-bit deterministic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_rl.maths.versions import lag_BS
from moe_rl.metrics import Mean, MetricValue, Sum

RESUME_TAG = 2  # the bridge's tag for a resumed learner's next request index (learner -> rollout)
CHOICE_TAG = (
    3  # the bridge's tag for the next request (dp rank, index): an engine's first rank -> its TP peers
)


def buffer_bound(max_staleness: int) -> int:
    """Unreceived requests per dp rank a rollout rank may have sent: ``max(max_staleness, 1)``. A
    rollout rank faster than the learner keeps its buffer full, starting a request each time the
    learner takes one (after the sync of that step's weights), so the request the learner takes
    from a full buffer of b waited b steps: lag b. A deeper buffer than ``max_staleness`` would only
    hold requests the filter drops (with ``max_staleness + 1``, one in three of the collapse lab's
    async requests were, docs/collapse_lab.md); at 0 no buffer keeps a request fresh, and one is
    the least that lets the engine run at all."""
    return max(max_staleness, 1)


def drop_limit(max_staleness: int, queued: int = 0) -> int:
    """Requests a learner step may drop before it fails: the buffer, the request being generated
    and the one waiting to be sent (all may predate the learner's last sync), plus ``queued``
    restored from a checkpoint. After those the rollout rank generates with the learner's weights."""
    return buffer_bound(max_staleness) + 2 + queued


def checkpoint_due(step: int, every: int, steps: int) -> bool:
    """A checkpoint follows learner step ``step`` (0-based): every ``every`` steps, and after the last."""
    done = step + 1
    return bool(every and done % every == 0) or done == steps


@dataclass(frozen=True)
class Fence:
    """In a dp rank's request stream: the requests before it were finished when the rollout rank
    applied the sync that precedes the checkpoint after learner step ``step``."""

    step: int


def staleness_filter(
    version_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    learner_version: int,
    max_staleness: int,
    group_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, MetricValue]]:
    """Which samples a learner at ``learner_version`` may train on (``rollout.max_staleness``).

    A sample with ANY generated token more than ``max_staleness`` versions old is stale. With
    ``group_B`` (GRPO / RLOO / OTB groups) a group with a stale member is dropped whole: the
    advantage estimators normalise over complete groups (``moe_rl.maths.advantages``), and a
    group cut down to its fresh members would get another baseline than the one it was sampled for
    (a group of one gets advantage 0).

    Returns:
        keep_B: bool [B]. metrics: ``rollout/dropped_stale`` (Sum, samples dropped, group-mates
        included) and ``rollout/dropped_stale_frac`` (Mean over samples).
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    stale_B = (lag_BS(version_BS, response_mask_BS, learner_version) > max_staleness).any(1)
    if group_B is not None:
        _, index_B = torch.unique(group_B, return_inverse=True)
        stale_G = torch.zeros(int(index_B.max()) + 1 if index_B.numel() else 0, device=stale_B.device)
        stale_B = stale_G.index_add_(0, index_B, stale_B.float())[index_B] > 0
    dropped = stale_B.double().sum()
    n = torch.tensor(float(stale_B.shape[0]), dtype=torch.float64, device=stale_B.device)
    return ~stale_B, {"rollout/dropped_stale": Sum(dropped), "rollout/dropped_stale_frac": Mean(dropped, n)}


class StaleRequests(RuntimeError):
    """More consecutive stale requests than ``drop_limit`` allows."""


def take_fresh(
    receive: Callable[[], object],
    learner_version: int,
    max_staleness: int,
    limit: int,
    dp_rank: int = 0,
) -> tuple[object, dict]:
    """The first request from ``receive()`` that the staleness filter keeps whole (its groups by
    ``group_B``) against ``learner_version``; requests with a stale group are dropped. ``receive``
    returns objects with ``.batch`` (a RolloutBatch with ``version_BS``). Metrics:
    ``rollout/dropped_stale`` (samples dropped), ``rollout/dropped_stale_batches`` and
    ``rollout/dropped_stale_frac`` (of the samples received this step)."""
    dropped_batches = dropped = 0
    for _ in range(limit + 1):
        msg = receive()
        b = msg.batch
        keep_B, _ = staleness_filter(
            b.version_BS, b.response_mask_BS, learner_version, max_staleness, b.group_B
        )
        if bool(keep_B.all()):
            f64 = torch.float64
            total = torch.tensor(float(dropped + b.num_seqs), dtype=f64)
            return msg, {
                "rollout/dropped_stale": Sum(torch.tensor(float(dropped), dtype=f64)),
                "rollout/dropped_stale_batches": Sum(torch.tensor(float(dropped_batches), dtype=f64)),
                "rollout/dropped_stale_frac": Mean(torch.tensor(float(dropped), dtype=f64), total),
            }
        dropped_batches, dropped = dropped_batches + 1, dropped + b.num_seqs
    raise StaleRequests(
        f"rollout.max_staleness={max_staleness}: data-parallel rank {dp_rank} dropped {limit + 1} stale "
        f"requests in a row at learner version {learner_version} (at most {limit} can predate its last sync)"
    )
