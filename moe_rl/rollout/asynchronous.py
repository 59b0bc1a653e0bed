"""``rollout.mode=async`` (docs/design.md 15.3): the pieces both roles share.

Rollout ranks generate request after request (a request: one data-parallel rank's prompts and seed
of one step index, numbered per dp rank from 0) with ``BackgroundWeights`` as the engine's
``UpdateSource``: the learner's syncs are received in a background thread and applied between
decode steps, so the tokens after a sync carry its version. Each finished request is sent to its
learner ranks at once; at most ``buffer_bound`` sends per dp rank are unreceived (the buffer).

The learner takes its dp rank's next request each step (``take_fresh``) and keeps it only if the
staleness filter keeps all of it; a request with any stale group is dropped whole and the next one
taken. With the built-in engine every sequence of a request starts at the same prefill, so a
request's oldest token version is shared by all of its sequences and the filter keeps or drops it
whole anyway; dropping whole requests keeps every dp rank at a full step's worth of groups, so
``algo.num_minibatches`` splits every step's batch as the config check guarantees and the ranks run
the same number of optimizer steps.

Checkpoints: when a rollout rank applies the sync that precedes a checkpoint it sends a ``Fence``
to every learner rank it serves; the learner receives up to the fence and saves those finished
requests beside the checkpoint. The request being generated at that moment is not saved: a resumed
run generates it again (with other weights: async is not bit-for-bit deterministic).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.maths.versions import staleness_filter, weight_version
from moe_rl.metrics import Mean, Sum
from moe_rl.placement import Group
from moe_rl.weights.broadcast import PendingWeights

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


class BackgroundWeights:
    """A rollout rank's ``UpdateSource`` (async): a thread of its own receives sync after sync over
    the sync group into ``PendingWeights`` until update ``last`` (the run's final weights), so the
    learner's next broadcast finds a receiver whatever this rank's main thread is doing (generating,
    waiting for buffer room, or for its engine's first rank). ``poll`` (the engine's, between decode
    steps) hands over the newest complete one as (weight version, named tensors); ``tick`` moves a
    completed receive into ``staged`` and raises the thread's error.

    ``group``: the ranks of one tensor-parallel engine (vLLM TP > 1), each with its own receive.
    Each shard must take an update at the same engine step, so their polls (made at the same steps:
    the ranks run one schedule) hand an update over only when every rank of the group has the same
    newest one staged (``_all_hold``); until then each keeps what it has staged. A rank can be at
    most one sync ahead (a broadcast ends only once every receiver has taken the one before), so
    they meet at a later poll."""

    def __init__(self, sync: Group, applied: int, last: int, group=None) -> None:
        self.sync, self.applied, self.last = sync, applied, last  # applied: updates the engine holds
        self.group = group
        self.pending = PendingWeights()
        self.staged: tuple[int, dict] | None = None
        self.error: BaseException | None = None
        self.thread = None
        if applied < last:
            self.thread = threading.Thread(target=self._receive, name="weight-receive", daemon=True)
            self.thread.start()

    def _receive(self) -> None:
        try:
            while self.pending.receive(self.sync) < self.last:
                pass
        except BaseException as e:  # raised in the main thread at its next tick
            self.error = e

    def tick(self) -> None:
        if self.error is not None:
            raise self.error
        staged = self.pending.take()
        if staged is not None:
            self.staged = staged  # newest wins: an engine may skip a version, never go back

    def poll(self) -> tuple[int, dict] | None:
        self.tick()
        newest = self.staged[0] if self.staged is not None else self.applied
        if self.group is not None and not _all_hold(self.group, newest):
            return None
        if self.staged is None:
            return None
        (updates, named), self.staged = self.staged, None
        if updates <= self.applied:
            raise RuntimeError(f"weight sync of update {updates} after update {self.applied}: out of order")
        self.applied = updates
        return weight_version(updates), named

    @property
    def final(self) -> bool:
        """The engine holds the run's final weights (the learner trains no more)."""
        return self.applied >= self.last


def _all_hold(group, newest: int) -> bool:
    """Every rank of ``group`` has ``newest`` as its newest update (min == max over the group)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    both = torch.tensor([newest, -newest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return int(both[0]) == -int(both[1])
