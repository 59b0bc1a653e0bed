"""THE rollout ranks' loop (``parallel.rollout_ranks``, docs/design.md 15): receive the weights,
generate each served data-parallel rank's batch exactly as a colocated engine would (the same
prompts and seed), send it to every learner rank of that dp rank, repeat.

Rollout rank j serves the learner dp ranks d with d % engines == j (``Split.server``). The loop
follows the run's ``Schedule`` (``moe_rl/config/schedule.py``); the weights come through
``RolloutRankWeights`` (``weight_sync.py``):

- sync: batch t is generated with W_t, after the learner's sync of W_t;
- one_step_off: batch t + 1 is generated with W_t while the learner trains step t (batch 0 with
  W_0), so every batch after the first is one update stale. The batch is sent (``isend``) before
  the rank joins the next weight broadcast, and the send is waited on only after the learner has
  taken it: a gloo send completes when its peer receives. The rank always runs one batch ahead,
  also past the last step: the learner takes that batch into its last checkpoint, so a resumed run
  (with more steps) starts from it, exactly as the uninterrupted run would have.

- async: request after request with in-flight weight updates, a bounded number unreceived per dp
  rank (request_buffer.py; docs/design.md 15.3).

- with algo.dynamic_sampling or algo.over_sampling (sync and one_step_off,
  ``Schedule.rounds_on_request``): the learner asks for each generation round by its data index and
  says when the weight sync comes (``RoundRequest``, remote_engine.py); the rank generates what it is
  asked with the weights it holds; over-sampled, it starts the round's groups and aborts the rest once
  the dp rank has the groups it asked for (``generate_round``, moe_rl/step/oversample.py); with
  on_abort=partial the request carries the dp rank's pending groups (the learner keeps and
  checkpoints them), resumed first in the round.

The step a run starts at is the version of the first weight sync (a resume's checkpoint step); the
run ends at the update the learner tells with each sync (``tell_last``: ``steps``, or sooner after a
stop request, moe_rl/stop.py), where the rank ends as at the run's end: its checkpoint takes what a
one-step-off or async rank has in flight."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path

from moe_rl.config import RunConfig, Schedule
from moe_rl.dist import ParallelDims
from moe_rl.maths.versions import weight_version
from moe_rl.pipeline.offload_timeline import OffloadTimeline
from moe_rl.pipeline.placement import exchange_dp_ranks
from moe_rl.pipeline.remote_engine import BATCH_TAG, ROUND_TAG, RolloutMessage, RoundRequest
from moe_rl.pipeline.request_buffer import CHOICE_TAG, RESUME_TAG, Fence, buffer_bound, checkpoint_due
from moe_rl.pipeline.weight_sync import BackgroundWeights, RolloutRankWeights
from moe_rl.rollout.factory import build_engine, engine_tp
from moe_rl.seeding import GENERATE, step_seed
from moe_rl.step.oversample import OverSamplingPlan, Pending, generate_round
from moe_rl.step.plan import StepPlan
from moe_rl.tasks.task import Task, build_task, step_scores
from moe_rl.types import RolloutBatch, with_version

log = logging.getLogger(__name__)


class _Server:
    """One rollout rank: its engine, the dp ranks it serves and where their batches go."""

    def __init__(self, cfg: RunConfig, dims: ParallelDims, task: Task) -> None:
        p, tp = dims.placement, engine_tp(cfg)
        self.cfg, self.task, self.bridge = cfg, task, p.bridge
        self.schedule = Schedule.from_config(cfg)
        dp_of = exchange_dp_ranks(self.bridge, -1)  # every world rank's learner dp rank
        me, engines, self.dp = p.split.role_rank(p.rank), p.split.engines(tp), cfg.data_parallel
        self.sends = me % tp == 0  # an engine's first rank sends; its TP peers only generate
        self.peers = [p.rank + i for i in range(1, tp)] if self.sends else []  # world ranks
        self.first = p.rank - me % tp  # the world rank of this engine's first rank
        self.served = [d for d in range(self.dp) if d % engines == me // tp]
        self.dests = {d: [r for r, x in enumerate(dp_of) if x == d] for d in self.served}
        self.sampling = StepPlan.from_config(cfg, task.tokenizer.eos_ids).sampling
        self.engine = build_engine(cfg, task.tokenizer.pad_id, dims.device)
        # what the sync sends this rank: the whole model, or (vLLM TP > 1) its engine shard's slices
        self.weights = RolloutRankWeights.from_config(cfg, self.schedule, dims, self.engine)
        self.timeline = OffloadTimeline(self.engine)  # no learner here: the engine sleeps between calls
        # algo.over_sampling: the rounds' plan (the learner asks for each round, RoundRequest.want)
        self.over = (
            OverSamplingPlan.from_config(cfg, self.dp, task.tokenizer.pad_id)
            if cfg.algo.over_sampling.on
            else None
        )

    @property
    def version(self) -> int:
        """The learner update the engine holds (the step a run starts at, after the first sync)."""
        return self.weights.version

    def load(self) -> float:
        """Join the next weight sync and apply it (never while sampling); seconds waited + applied."""
        return self.weights.receive()

    def generate(
        self, step: int, waited_s: float, reqs: dict[int, RoundRequest] | None = None
    ) -> list[RolloutMessage]:
        """Step ``step``'s batch of every served dp rank, with the weights loaded now; ``reqs``
        (algo.over_sampling): each dp rank's request (the groups still wanted, the pending ones)."""
        waits = {"time/rollout_wait_weights_s": waited_s}
        if reqs is not None and self.over is not None:
            return [self.over_round(d, step, reqs[d], waits) for d in self.served]
        return [self.request(d, step, waits) for d in self.served]

    def over_round(self, d: int, index: int, req: RoundRequest, waits: dict[str, float]) -> RolloutMessage:
        """Data index ``index``'s over-sampled round of dp rank ``d``, aborted once ``req.want`` groups
        are complete: the colocated round's code (``generate_round``) on this rank's engine, with the
        partial rollouts the learner sent (``req.pending``; on_abort=partial), its tokens stamped with
        this rank's weight version (a resumed row's earlier tokens keep theirs); the learner decides
        on it as on its own (``remote_round``)."""
        r, t0, plan = self.cfg.rollout, time.perf_counter(), self.over
        seed = step_seed(self.cfg.seed, index, d, GENERATE)
        version = weight_version(self.version)

        def flat(ids: list, at: int, abort) -> RolloutBatch:  # one row per sample, as the trainer's
            got = self.engine.generate(ids, 1, self.sampling, seed=seed, abort=abort)
            return with_version(dataclasses.replace(got, version_BS=None), version)

        def draw(at: int, count: int) -> list:
            return self.task.source.sample_step(at, count, d, self.dp, self.cfg.seed)

        def score(prompts: list, batch: RolloutBatch):  # the abort's peek (dynamic sampling)
            return step_scores(self.cfg, self.task, prompts, batch)

        pending = Pending.from_state_dict(req.pending or {"prompts": []})
        got = generate_round(plan, flat, draw, score, index, req.want, pending)
        self.timeline.after_generate()
        waits = {**waits, "time/rollout_generate_s": time.perf_counter() - t0}
        prompts = [p.prompt_ids for p in got.prompts]
        batch = dataclasses.replace(
            got.batch, engine_metrics={**got.batch.engine_metrics, **self.weights.probe}
        )
        n = r.samples_per_prompt
        return RolloutMessage(index, d, seed, prompts, n, self.version, batch, waits, versioned=True)

    def request(self, d: int, step: int, waits: dict[str, float], updates=None) -> RolloutMessage:
        """Step ``step``'s batch of dp rank ``d`` (its prompts and seed); async: with in-flight
        updates from ``updates``, stamped with the update count its prefill ran with."""
        r, t0 = self.cfg.rollout, time.perf_counter()
        rows = self.task.source.sample_step(step, r.prompts_per_step // self.dp, d, self.dp, self.cfg.seed)
        prompts = [p.prompt_ids for p in rows]
        seed = step_seed(self.cfg.seed, step, d, GENERATE)
        version = self.version
        agent, n = self.task.agent, r.samples_per_prompt
        if agent is not None:  # agent.env: the conversations run here, turn by turn
            batch = agent.rollout(self.engine, rows, n, self.sampling, seed, step, updates=updates)
        elif updates is None:
            batch = self.engine.generate(prompts, n, self.sampling, seed=seed)
        else:
            batch = self.engine.generate(prompts, n, self.sampling, seed=seed, updates=updates)
        if updates is not None:
            # every sequence's first token comes from the prefill: the oldest version of the request
            version = int(batch.version_BS[batch.response_mask_BS].min()) - 1
            self.weights.version = updates.applied
            if (probed := updates.take_probe()) is not None:  # rollout.sync_check, the engine idle
                self.weights.score(*probed)
        self.timeline.after_generate()
        if self.weights.probe:  # rollout.sync_check: the last probe's k3 (sync_check.py)
            batch = dataclasses.replace(batch, engine_metrics={**batch.engine_metrics, **self.weights.probe})
        waits = {**waits, "time/rollout_generate_s": time.perf_counter() - t0}
        return RolloutMessage(step, d, seed, prompts, r.samples_per_prompt, version, batch, waits)

    def round_request(self) -> tuple[RoundRequest, dict[int, RoundRequest]]:
        """The learner's next ``RoundRequest`` and each served dp rank's: one request from every
        learner rank of every served dp rank, the same round (their rounds are agreed), the same
        ``want`` within a dp rank (and the same pending groups: a dp rank's learner ranks hold the
        same); an engine's TP peers get them from its first rank."""
        if not self.sends:
            return self.bridge.recv_object(self.first, CHOICE_TAG)
        got = {d: {self.bridge.recv_object(dst, ROUND_TAG) for dst in self.dests[d]} for d in self.served}
        rounds = {(q.index, q.then_sync) for reqs in got.values() for q in reqs}
        if len(rounds) != 1 or any(len(reqs) != 1 for reqs in got.values()):
            raise RuntimeError(
                f"the learner ranks served by one rollout rank ask for different rounds: {got}"
            )
        out = (next(iter(got[self.served[0]])), {d: next(iter(reqs)) for d, reqs in got.items()})
        for peer in self.peers:
            _wait(self.bridge.send_object(out, peer, CHOICE_TAG))
        return out

    def send(self, msgs: list[RolloutMessage]) -> list:
        """Start sending each message to every learner rank of its dp rank; the works to wait on."""
        return [w for m in msgs for w in self.send_to(m.dp_rank, m)]

    def send_to(self, d: int, obj) -> list:
        """Start sending ``obj`` to every learner rank of dp rank ``d``; the works to wait on."""
        if not self.sends:
            return []
        return [w for dst in self.dests[d] for w in self.bridge.send_object(obj, dst, BATCH_TAG)]


def _wait(works: list) -> float:
    t0 = time.perf_counter()
    for w in works:
        w.wait()
    return time.perf_counter() - t0


class _Outbox:
    """One served dp rank's sends (async): started by the main thread, waited in order by a thread
    of their own (a gloo send completes when its peer receives, and can only be waited on), which
    counts the requests not yet received."""

    def __init__(self) -> None:
        self.works: queue.Queue = queue.Queue()
        self.unreceived, self.error = 0, None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="rollout-send", daemon=True)
        self.thread.start()

    def put(self, works: list, request: bool) -> None:
        with self.lock:
            self.unreceived += request
        self.works.put((works, request))

    def _run(self) -> None:
        while (item := self.works.get()) is not None:
            works, request = item
            try:
                _wait(works)
            except BaseException as e:  # raised in the main thread at its next look
                self.error = e
                return
            with self.lock:
                self.unreceived -= request

    def room(self, bound: int) -> bool:
        if self.error is not None:
            raise self.error
        return self.unreceived < bound

    def close(self) -> None:
        """Wait until the learner received everything sent."""
        self.works.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def _room(
    out: dict[int, _Outbox], bound: int, order: list[int], updates: BackgroundWeights
) -> tuple[int, float]:
    """The first served dp rank in ``order`` with fewer than ``bound`` unreceived requests (waiting,
    and keeping the background weight receive going, until one has room); seconds waited."""
    t0 = time.perf_counter()
    while True:
        for d in order:
            if out[d].room(bound):
                return d, time.perf_counter() - t0
        updates.tick()
        time.sleep(0.002)


def _serve_async(s: _Server, trajectories: Path) -> None:
    """rollout.mode=async (moe_rl/pipeline/request_buffer.py): request after request, round robin over
    the served dp ranks that have buffer room, weights applied between decode steps; a fence to
    every served dp rank after the sync that precedes a checkpoint; stop at the final weights."""
    cfg, start = s.cfg, s.version
    nxt = {d: 0 for d in s.served}
    if (
        start > 0 and s.sends
    ):  # a resume: each dp rank's learner says which request comes after its saved ones
        for d in s.served:
            got = {s.bridge.recv_object(dst, RESUME_TAG) for dst in s.dests[d]}
            if len(got) != 1:
                raise RuntimeError(
                    f"the learner ranks of data-parallel rank {d} resume at requests {sorted(got)}"
                )
            nxt[d] = got.pop()
    if s.task.agent is not None and s.sends:
        # a resume generates the requests after each dp rank's saved ones again (several served
        # dp ranks: their lines from the earliest on are dropped, a later one's buffered ones too)
        s.task.agent.log_to(trajectories, resume_step=min(nxt.values()) if start > 0 else None)
    updates = s.weights.background()
    bound, out = buffer_bound(cfg.rollout.max_staleness), {d: _Outbox() for d in s.served}
    turn = 0
    while True:
        if s.sends:  # the engine's first rank picks the request; its TP peers generate it with it
            order = s.served[turn:] + s.served[:turn]
            d, waited = _room(out, bound, order, updates)
            turn = (s.served.index(d) + 1) % len(s.served)
            for peer in s.peers:
                _wait(s.bridge.send_object((d, nxt[d]), peer, CHOICE_TAG))
        else:
            (d, nxt[d]), waited = s.bridge.recv_object(s.first, CHOICE_TAG), 0.0
        before = updates.applied
        msg = s.request(d, nxt[d], {"time/rollout_wait_send_s": waited}, updates)
        nxt[d] += 1
        for c in range(before, updates.applied):  # the syncs this request crossed
            if checkpoint_due(c, cfg.checkpoint_every, updates.last):  # last: a stop's too
                for e in s.served:
                    out[e].put(s.send_to(e, Fence(c)), request=False)
        if updates.final:  # the learner trains no more: it takes nothing after the last fence
            log.info(
                "rollout rank: final weights applied; request %d of dp rank %d (%d samples) dropped",
                msg.step,
                d,
                msg.batch.num_seqs,
            )
            break
        out[d].put(s.send_to(d, msg), request=True)
    for o in out.values():
        o.close()


def _serve_rounds(s: _Server, trajectories: Path, waited: float) -> None:
    """Rounds on request (``Schedule.rounds_on_request``): generate each data index the learner asks
    for with the weights held now, join the weight sync when told, stop at the run's last update.
    A batch's send is waited on at the next request: the learner asks again only after it took
    every batch it asked for (one_step_off's next-step round: at the start of that step)."""
    agent, resumed = (s.task.agent if s.sends else None), s.version > 0
    if agent is not None and not resumed:
        agent.log_to(trajectories)
    works: list = []
    while True:
        req, reqs = s.round_request()
        _wait(works)  # a gloo work is waited on once
        works = []
        if req.index is not None:
            if agent is not None and resumed:  # a resume generates from the first index it is asked for
                agent.log_to(trajectories, resume_step=req.index)
                resumed = False
            works, waited = s.send(s.generate(req.index, waited, reqs)), 0.0
        if req.then_sync:
            waited = s.load()
            if s.version >= s.weights.last:
                break
    _wait(works)  # one_step_off: the batch past the last step, the learner's last checkpoint takes it


def serve_rollouts(cfg: RunConfig, dims: ParallelDims, task: Task | None = None) -> None:
    """A rollout rank's whole run (see the module docstring); ``task``: preflight's, when it ran in
    this process (an external torchrun)."""
    if task is None:
        cfg, task = build_task(cfg, start_pool=False)  # the same prompts as the learner ranks
    s = _Server(cfg, dims, task)
    try:
        _serve(s, dims)
    finally:  # over-sampling's abort scores its peeks here (dynamic sampling): its reward workers
        task.pool.close()


def _serve(s: _Server, dims: ParallelDims) -> None:
    cfg, task = s.cfg, s.task
    waited = s.load()
    start = s.version
    trajectories = Path(cfg.run_dir) / "agent" / f"trajectories_rank{dims.placement.rank}.jsonl"
    if s.schedule.buffers_requests:
        return _serve_async(s, trajectories)
    if s.schedule.rounds_on_request:
        return _serve_rounds(s, trajectories, waited)
    if task.agent is not None and s.sends:  # the conversations are logged where they run
        # a resume regenerates from `start` (one_step_off: from start + 1, batch `start` is in
        # the learner's checkpoint)
        redo = start + 1 if s.schedule.runs_ahead else start
        task.agent.log_to(trajectories, resume_step=redo if start > 0 else None)
    if not s.schedule.runs_ahead:
        while (step := s.version) < s.weights.last:  # the engine holds W_step
            works = s.send(s.generate(step, waited))
            waited = s.load()  # the learner broadcasts W_{step+1} after it took the batch and updated
            _wait(works)
        return
    # one_step_off: batch `start` is W_0's (a new run) or in the learner's checkpoint (a resume)
    works = s.send(s.generate(start, waited)) if start == 0 else []
    while (step := s.version) < s.weights.last:
        msgs = s.generate(step + 1, waited)  # with W_step, while the learner trains step `step`
        _wait(works)  # batch `step`: the learner took it at the start of its step
        works = s.send(msgs)
        waited = s.load()  # W_{step+1}, broadcast after the learner's update
    _wait(works)  # the batch past the last step: the learner's last checkpoint takes it
