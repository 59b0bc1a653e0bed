"""The learner side of ``parallel.rollout_ranks`` (docs/design.md 15): ``RemoteEngine`` stands in
for the engine on learner ranks, so the training loop runs unchanged. ``generate`` receives this
data-parallel rank's batch from the rollout rank that serves it (over the bridge), checks it
answers this step's prompts and seed, and hands it on. The weight broadcast to the rollout ranks
is the sync owner's (``moe_rl/pipeline/weight_sync.py``), which tells this engine each version it
synced (``synced``). The rollout ranks' loop is ``moe_rl/pipeline/rollout_ranks.py``. What the
schedule asks (one batch ahead, a request buffer, per-token versions) is the ``Schedule``'s.

One-step-off: the batch of step t + 1 is generated while the learner trains step t, so it is in
flight at a checkpoint; ``take_in_flight`` receives it so the checkpoint can hold it, and
``resume`` hands the saved one back as the first step's batch (it was generated with weights the
checkpoint no longer has).

Async (``moe_rl/pipeline/request_buffer.py``): ``request_for`` takes the dp rank's next request the
staleness filter keeps (the step trains on that request's prompts and seed), ``generate`` hands it
on with the engine's per-token versions; ``take_buffered`` receives, at a checkpoint, every
finished request up to the rollout rank's fence, and ``resume`` queues the saved ones first and
tells the rollout rank which request index to generate next.

Dynamic sampling (``algo.dynamic_sampling``, split sync / one_step_off: ``Schedule.rounds_on_request``):
the learner asks the rollout rank for each generation round of a step by its data index
(``request_for`` sends a ``RoundRequest``) and, once the step has its rounds, tells it the weight
sync comes next (``end_rounds``); one_step_off asks in that same message for the next step's first
round (the next data index), which the rollout rank generates with the weights it holds while the
learner trains. The step's later rounds are generated with the weights the learner holds (lag 0).
So a step's rounds take consecutive data indices in both schedules, as a colocated run's do.
With algo.over_sampling the rounds are asked for the same way, each with the groups the dp rank
still lacks (``RoundRequest.want``) and (on_abort=partial) its pending groups (``RoundRequest.pending``:
the learner keeps and checkpoints them): the rollout rank resumes those, starts the round's new
groups and aborts the rest, and the learner decides on the whole round (moe_rl/step/oversample.py).
One_step_off's next-step round carries the groups pending after this step (those the next step would
not drop as stale): they resume with W_t, ahead, as the round's new groups start."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from moe_rl.config import Schedule
from moe_rl.maths.versions import weight_version
from moe_rl.metrics import Max, Mean, Min, Std, Sum
from moe_rl.pipeline.placement import exchange_dp_ranks
from moe_rl.pipeline.request_buffer import RESUME_TAG, Fence, drop_limit, take_fresh
from moe_rl.routing.provenance import Provenance
from moe_rl.types import RolloutBatch, SamplingParams, with_version

BATCH_TAG = 1  # the bridge's tag for batches (rollout -> learner)
ROUND_TAG = 4  # the bridge's tag for round requests (learner -> rollout, ``RoundRequest``)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutMessage:
    """One data-parallel rank's batch of one step, as a rollout rank sends it."""

    step: int
    dp_rank: int
    seed: int
    prompts: list[list[int]]
    n: int
    version: int  # the weight version it was generated with (updates behind it)
    batch: RolloutBatch
    # the rollout rank's seconds: waiting for the weights of this batch, generating it, and
    # waiting for the learner to take its previous batch
    waits: dict[str, float]
    # the batch's tokens carry their weight versions (an over-sampled round: a resumed row's earlier
    # tokens are older than the round's), kept by the learner; else stamped there with ``version``
    versioned: bool = False

    def state_dict(self) -> dict:
        """Tensors, lists and numbers only (``torch.load(weights_only=True)`` reads it back)."""
        b = {f.name: getattr(self.batch, f.name) for f in dataclasses.fields(self.batch)}
        if b["route_prov"] is not None:  # the route rows' provenance as plain tensors
            b["route_prov"] = [p.tensors() for p in b["route_prov"]]
        # the rollout rank's metrics (agent.env: Sum/Mean/Max of the agent counts) as (kind, fields)
        b["engine_metrics"] = {k: _plain_metric(v) for k, v in b["engine_metrics"].items()}
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "batch": b}

    @classmethod
    def from_state_dict(cls, state: dict) -> RolloutMessage:
        b = dict(state["batch"])
        if b.get("route_prov") is not None:
            b["route_prov"] = [Provenance.from_tensors(t) for t in b["route_prov"]]
        b["engine_metrics"] = {k: _metric_of(v) for k, v in b.get("engine_metrics", {}).items()}
        return cls(**{**state, "batch": RolloutBatch(**b)})


@dataclass(frozen=True)
class RoundRequest:
    """Learner -> rollout rank (``Schedule.rounds_on_request``): generate data index ``index``
    (None: nothing) with the weights held now and send it; ``then_sync``: the step's rounds are
    done, the learner's weight sync comes next; ``want``: with algo.over_sampling, the groups the
    dp rank's step still lacks (the round's early abort waits for that many; 0 otherwise);
    ``pending``: with on_abort=partial, the dp rank's pending groups the round resumes first
    (``Pending.state_dict``; the learner keeps them, the rollout rank only continues them)."""

    index: int | None
    then_sync: bool = False
    want: int = 0
    pending: dict | None = field(default=None, compare=False)  # a dp rank's learner ranks send the same


_METRIC_KINDS = {c.__name__: c for c in (Mean, Std, Sum, Max, Min)}


def _plain_metric(v):
    """A metric value as ``torch.load(weights_only=True)`` reads it: a number or tensor as it is,
    a reduction kind as (its name, its fields)."""
    if type(v).__name__ in _METRIC_KINDS and dataclasses.is_dataclass(v):
        return (type(v).__name__, [getattr(v, f.name) for f in dataclasses.fields(v)])
    return v


def _metric_of(v):
    if isinstance(v, tuple) and len(v) == 2 and v[0] in _METRIC_KINDS:
        return _METRIC_KINDS[v[0]](*v[1])
    return v


class RemoteEngine:
    """``generate`` on a learner rank of a split world (see the module docstring); its weights
    are ``WeightSync``'s to send."""

    def __init__(self, dims, schedule: Schedule, engine_tp: int = 1) -> None:
        p = dims.placement
        self.schedule, self.max_staleness = schedule, schedule.max_staleness
        self.bridge, self.dp_rank = p.bridge, dims.dp_rank
        exchange_dp_ranks(self.bridge, dims.dp_rank)  # the rollout ranks learn where batches go
        self.src = self.bridge.members.index(p.split.server(dims.dp_rank, engine_tp))
        self.version = -1  # the weight version last synced (= the step the learner is at)
        self.next_version = 0  # the next sync's
        self.pending: RolloutMessage | None = None  # received ahead of its step (a checkpoint)
        # async: finished requests received at a checkpoint (or restored), taken before new ones;
        # the index of the next request the rollout rank sends; the request this step trains on
        self.buffered: list[RolloutMessage] = []
        self.next_request = 0
        self.taken: tuple[RolloutMessage, dict, float] | None = None
        self.restored: dict = {}
        self.resume_works: list = []
        # rounds on request: the data index asked last; the one asked ahead (one_step_off: the next
        # step's first round, or a resume's in-flight batch); whether the step's rounds have begun
        self.asked: int | None = None
        self.ahead: int | None = None
        self.in_step = False

    def resume(self, start: int, in_flight: RolloutMessage | None, buffered: dict | None = None) -> None:
        """Continue at step ``start`` (its weights are synced next), with the batch a one-step-off
        run had in flight when it saved (None: the rollout ranks generate step ``start``'s), or
        (async) the saved ``{"buffered": [...], "next_request": n}``."""
        self.next_version, self.pending = start, in_flight
        if buffered is not None:
            self.buffered = [RolloutMessage.from_state_dict(m) for m in buffered["buffered"]]
            self.next_request = int(buffered["next_request"])
            n = sum(m.batch.num_seqs for m in self.buffered)
            log.info(
                "data-parallel rank %d: restored %d buffered requests (%d samples); the rollout rank "
                "generates from request %d (what it was generating at the checkpoint is generated again)",
                self.dp_rank,
                len(self.buffered),
                n,
                self.next_request,
            )
            f64 = torch.float64
            self.restored = {
                "rollout/restored_batches": Sum(torch.tensor(float(len(self.buffered)), dtype=f64)),
                "rollout/restored_samples": Sum(torch.tensor(float(n), dtype=f64)),
            }
            # the rollout rank's first request index; it receives it after the first sync (the
            # works are kept: a gloo send whose work is dropped never arrives)
            self.resume_works = self.bridge.send_object(self.next_request, self.src, RESUME_TAG)

    def synced(self) -> None:
        """The sync owner broadcast the next version (``moe_rl/pipeline/weight_sync.py``)."""
        self.version, self.next_version = self.next_version, self.next_version + 1

    @property
    def _plain(self) -> bool:
        """One batch a step, from one weight version: ``rollout/version_lag`` is a plain number."""
        return not (self.schedule.buffers_requests or self.schedule.rounds_on_request)

    def _receive(self) -> RolloutMessage:
        return self.bridge.recv_object(self.src, BATCH_TAG)

    def take_in_flight(self) -> RolloutMessage | None:
        """The next step's batch, received now (one-step-off: the rollout rank has sent it); None
        when nothing is in flight (sync)."""
        if self.schedule.runs_ahead and self.pending is None:
            self.pending = self._receive()
        return self.pending

    def take_buffered(self) -> dict:
        """Async, at the checkpoint after the step just trained: every finished request the
        rollout rank sent before its fence (they stay queued for the next steps), and the index of
        the request after them; tensors, lists and numbers only."""
        while True:
            msg = self._receive()
            if isinstance(msg, Fence):
                break
            self.buffered.append(msg)
            self.next_request = msg.step + 1
        if msg.step != self.version - 1:
            raise RuntimeError(
                f"data-parallel rank {self.dp_rank}: the rollout rank's checkpoint fence is for step "
                f"{msg.step}, the learner saves after step {self.version - 1}"
            )
        return {"buffered": [m.state_dict() for m in self.buffered], "next_request": self.next_request}

    def _next_request(self) -> RolloutMessage:
        if self.buffered:
            return self.buffered.pop(0)
        msg = self._receive()
        if isinstance(msg, Fence):
            raise RuntimeError(
                f"data-parallel rank {self.dp_rank}: a checkpoint fence (step {msg.step}) outside a "
                "checkpoint"
            )
        self.next_request = msg.step + 1
        return msg

    def request_for(self, step: int, index: int | None = None, want: int = 0, pending=None) -> int:
        """The data index whose prompts and seed a generation round of step ``step`` trains on:
        ``step``; (async) that of the dp rank's next request the staleness filter keeps (stale ones
        are dropped); (rounds on request) ``index``, asked of the rollout rank unless it is the
        step's first round and one_step_off generated it ahead (``want``, ``pending``: ``RoundRequest``'s)."""
        if self.schedule.rounds_on_request:
            ahead = not self.in_step and (self.ahead is not None or self.pending is not None)
            if not ahead:
                self._ask(RoundRequest(index, want=want, pending=pending))
            self.asked, self.ahead, self.in_step = index, None, True
            return index
        if not self.schedule.picks_requests:
            return step
        t0 = time.perf_counter()
        for w in self.resume_works:  # the rollout rank took it after the first sync
            w.wait()
        self.resume_works = []
        limit = drop_limit(self.max_staleness, len(self.buffered))
        msg, metrics = take_fresh(
            self._next_request, weight_version(self.version), self.max_staleness, limit, self.dp_rank
        )
        self.taken = (msg, metrics, time.perf_counter() - t0)
        return msg.step

    def end_rounds(self, cursor: int, want: int = 0, pending=None) -> None:
        """Rounds on request: the step has its rounds (the data cursor is at ``cursor``); the rollout
        rank joins the weight sync next, one_step_off after generating data index ``cursor`` (the
        next step's first round, ``want`` groups wanted: a whole step's, ``pending`` resumed in it)
        with the weights it holds. A no-op otherwise."""
        if self.schedule.rounds_on_request:
            ahead = self.schedule.runs_ahead
            self.ahead = cursor if ahead else None
            req = RoundRequest(
                self.ahead, then_sync=True, want=want if ahead else 0, pending=pending if ahead else None
            )
            self._ask(req)
            self.in_step = False

    def _ask(self, req: RoundRequest) -> None:
        # the rollout rank waits for it: the send completes at once (its works must be kept anyway)
        for w in self.bridge.send_object(req, self.src, ROUND_TAG):
            w.wait()

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, seed: int) -> RolloutBatch:
        t0 = time.perf_counter()
        extra: dict = {}
        buffered = self.schedule.buffers_requests
        if buffered:
            (msg, extra, waited), self.taken = self.taken, None
            extra, self.restored = {**extra, **self.restored}, {}
        else:
            msg, self.pending = self.pending or self._receive(), None
            waited = time.perf_counter() - t0
        expected = msg.step if buffered else self.asked if self.schedule.rounds_on_request else self.version
        got = (msg.step, msg.dp_rank, msg.seed, msg.n, msg.prompts)
        if got != (expected, self.dp_rank, seed, n, prompts):
            raise RuntimeError(
                f"rollout batch mismatch on data-parallel rank {self.dp_rank}: got step {msg.step}, "
                f"dp rank {msg.dp_rank}, seed {msg.seed}, n {msg.n}; expected step {expected}, "
                f"seed {seed}, n {n}" + ("" if msg.prompts == prompts else " (other prompts)")
            )
        lag = self.version - msg.version
        metrics = {
            **msg.batch.engine_metrics,  # the rollout rank's own (agent.env: the agent/* counts)
            # async: the lag of the request's prefill, the most over the dp ranks (they differ); rounds
            # on request: the most over the step's rounds (one_step_off: the first is 1, later ones 0)
            "rollout/version_lag": float(lag) if self._plain else Max(torch.tensor(float(lag))),
            "time/wait_batch_s": Max(torch.tensor(waited)),
            **{k: Max(torch.tensor(v)) for k, v in msg.waits.items()},
            **extra,
        }
        if self.schedule.engine_stamps_versions or msg.versioned:  # in-flight updates, resumed rows
            return dataclasses.replace(msg.batch, engine_metrics=metrics)
        # version_BS: the weights the batch was generated with (W_u is version u + 1, docs/math.md 2.7)
        batch = with_version(dataclasses.replace(msg.batch, version_BS=None), weight_version(msg.version))
        return dataclasses.replace(batch, engine_metrics=metrics)
