"""The learner -> engine weight sync, one owner per side (issue 41; docs/design.md 14.3, 15.2).

``WeightSync`` (learner ranks) decides what is sent and how, for every schedule: colocated, the
engine in this process loads the learner's canonical stream (one layer gathered at a time;
``moe_rl/weights/stream.py``), or with ``rollout.staleness=k`` the kept weight set of k updates
ago (``SimulatedStaleness``: whole exports, the sets are copies); split, learner rank 0 broadcasts
the stream to the rollout ranks (``weight_broadcast.py``) while the other learner ranks feed its
gathers, and the ``RemoteEngine`` is told the version it synced.

Where the engines' ranks hold slices (vLLM TP > 1) the split sync sends each rollout rank only
its engine shard's slices, point to point (``split_slices``: a ``Sliced`` layout from
``moe_rl/weights/engine_shard.py``), so rollout rank i receives ``sync_receive_bytes(cfg, i)``
bytes, not the model. Colocated with such engines (``colocated_slices``), each learner rank
gathers only its own engine rank's slices of each piece, from the learner ranks that hold them
(``moe_rl/weights/slice_stream.py``), and hands them to its engine ``placed``; the bytes handed
are the sync's ``weight_sync/bytes``. Where the engine rank holds everything whole (built-in
engine, vLLM TP 1) it loads the whole stream, as before.

``RolloutRankWeights`` (rollout ranks) receives them: between generate calls (sync,
one_step_off), or (async) in a background thread whose syncs the engine takes between decode
steps (``BackgroundWeights``, the engine's ``UpdateSource``); a sliced sync is handed to the
engine with each slice inside a tensor of its full shape (``placed``), as vLLM's loaders read it.

With every split sync learner rank 0 first tells the rollout ranks the update the run ends at
(``tell_last``: ``steps``, or the step after which a stop request ends it, moe_rl/stop.py), so they
stop with the learner: after that update they generate nothing more the learner would not take.

The phases are methods (``first_sync``, ``sync``), each run inside the offload timeline's
``syncing`` (``offload_timeline.py``: what leaves the device before and after), so the step's
order is changed there, not here.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from moe_rl.config import ModelConfig, RunConfig, Schedule
from moe_rl.maths.versions import weight_version
from moe_rl.metrics import Max
from moe_rl.pipeline.offload_timeline import OffloadTimeline, Phase
from moe_rl.pipeline.placement import Group
from moe_rl.pipeline.simulated_staleness import SimulatedStaleness
from moe_rl.pipeline.sync_check import (
    SyncCheck,
    check_received,
    probe_engine,
    receive_sums,
    send_checksums,
    shard_words,
    verify_held,
)
from moe_rl.pipeline.weight_broadcast import (
    SYNC_METRICS,
    PendingWeights,
    Sliced,
    broadcast_weights,
    receive_weights,
    wire_device,
)
from moe_rl.rollout.base import ENGINE_DTYPES, Weights, weight_chunks
from moe_rl.rollout.factory import engine_tp
from moe_rl.rollout.fp8 import quantized_names
from moe_rl.rollout.vllm.sync_sums import layout_for
from moe_rl.weights.canonical import canonical_param_shapes
from moe_rl.weights.engine_shard import EngineShard, engine_shard, placed
from moe_rl.weights.slice_stream import ShardOf

# tests only: seconds the learner sleeps before each weight sync but the first (async: lets the
# rollout ranks run ahead deterministically enough that batches arrive stale)
DELAY_ENV = "MOE_RL_TEST_LEARNER_DELAY_S"
# tests only: seconds each in-flight poll of an async rollout rank sleeps (one per decode step), so a
# long response outlasts the learner's update whatever the machine's load
POLL_DELAY_ENV = "MOE_RL_TEST_POLL_DELAY_S"


def split_slices(cfg: RunConfig, rollout_ranks: int) -> Sliced | None:
    """The split sync's per-rollout-rank slices when the engines' ranks hold slices (vLLM TP > 1);
    None when every rank holds every tensor whole (a broadcast)."""
    shards = tuple(engine_shard(cfg, i) for i in range(rollout_ranks))
    return None if all(s.whole for s in shards) else Sliced(shards, cfg.model)


def colocated_slices(cfg: RunConfig) -> ShardOf | None:
    """Colocated: world rank -> the engine shard it hosts, when engine ranks hold slices (vLLM
    TP > 1); None when every rank holds every tensor whole (the whole stream)."""
    if engine_shard(cfg, 0).whole:
        return None
    return lambda rank: engine_shard(cfg, rank)


def tell_last(group: Group, last: int | None = None) -> int:
    """Before each sync, over the sync group: the update the run ends at (``last``, from the root,
    sync-group rank 0); what the root told, on every member."""
    t = torch.tensor([-1 if last is None else last], dtype=torch.int64, device=wire_device(group))
    return int(group.broadcast(t)[0])


def send_sync(
    group: Group,
    last: int | None,
    chunks,
    version: int,
    engine: torch.dtype | None = None,
    sliced: Sliced | None = None,
) -> dict[str, float]:
    """The root's whole split sync: ``tell_last``, then ``broadcast_weights``. The told update is
    the sync's first message, so its broadcast is where the root waits for every rollout rank to
    join (in one_step_off, for the batch it is generating): that time is the sync's
    ``time/weight_broadcast_wait_s`` and is in its ``time/weight_broadcast_s``."""
    t0 = time.perf_counter()
    tell_last(group, last)
    joined = time.perf_counter() - t0
    m = broadcast_weights(chunks, group, version, engine=engine, sliced=sliced)
    m["time/weight_broadcast_wait_s"] += joined
    m["time/weight_broadcast_s"] += joined
    return m


def fp8_names(cfg: RunConfig) -> frozenset[str]:
    """The names the engine holds in FP8, as the sync check recomputes them: the rule's set for
    ``rollout.quantize``'s scope (experts: the routed experts only), empty without FP8."""
    if cfg.rollout.quantization != "fp8":
        return frozenset()
    return quantized_names(canonical_param_shapes(cfg.model), cfg.rollout.quantize)


def sync_check_for(cfg: RunConfig, split: bool, rank: int) -> SyncCheck:
    """World rank ``rank``'s side of the checked sync (``rollout.sync_check``; off: a no-op). vLLM
    TP > 1 (engine ranks hold shards): split, the root sums every TP rank's shard (one row each);
    colocated, each rank sums the shard its own engine worker holds, from the slices it hands it."""
    layout = layout_for(cfg) if cfg.rollout.engine == "vllm" else None  # vLLM's own layout
    sharded = not engine_shard(cfg, 0).whole
    tp = engine_tp(cfg) if sharded else 1
    own = engine_shard(cfg, rank).tp_rank if sharded and not split else None
    dtype, names = ENGINE_DTYPES[cfg.rollout.dtype], fp8_names(cfg)
    return SyncCheck(dtype, names, cfg.rollout.sync_check, cfg.model.vocab_size, layout, tp, own)


class WeightSync:
    """A learner rank's side of the sync (see the module docstring). ``engine``: the rank's
    engine, or its ``RemoteEngine`` when split; ``learner``: anything with
    ``iter_canonical_layers()`` and ``export_canonical()``."""

    def __init__(
        self,
        schedule: Schedule,
        engine,
        learner,
        stale: SimulatedStaleness,
        group: Group | None = None,
        engine_dtype: torch.dtype | None = None,
        timeline: OffloadTimeline | None = None,
        sliced: Sliced | None = None,
        engines: ShardOf | None = None,
        model: ModelConfig | None = None,
        steps: int | None = None,
        check: SyncCheck | None = None,
        micro_batch_size: int = 1,
    ) -> None:
        self.schedule, self.engine, self.learner, self.stale = schedule, engine, learner, stale
        # rollout.sync_check (sync_check.py): the learner's checksums of each sync, the engine's
        # verified against them, the probe batch scored (split: the k3 on the rollout ranks);
        # None or off: unchecked
        self.check = check or SyncCheck(torch.float32, frozenset(), False, 1)
        self.micro_batch_size, self.syncs = micro_batch_size, 0
        self.steps = steps  # split: the run's last update, told to the rollout ranks (``tell_last``)
        self.timeline = timeline or OffloadTimeline(engine)  # what leaves and wakes around the sync
        self.group = group  # split: the sync group (learner rank 0 only; None on the others)
        self.engine_dtype = engine_dtype  # split: the rollout engines' (rollout.dtype), the wire's
        self.sliced = sliced  # split: each rollout rank sent only its shard's slices (vLLM TP > 1)
        self.engines, self.model = engines, model  # colocated: each rank's engine shard (colocated_slices)
        self.delay_s = float(os.environ.get(DELAY_ENV, "0")) if schedule.split else 0.0

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        schedule: Schedule,
        engine,
        learner,
        dims,
        timeline: OffloadTimeline | None = None,
    ) -> WeightSync:
        stale = SimulatedStaleness(schedule.simulated_staleness, remote=schedule.split)
        group = dims.placement.sync if schedule.split else None
        sliced = split_slices(cfg, dims.placement.split.rollout_ranks) if schedule.split else None
        dtype = ENGINE_DTYPES[cfg.rollout.dtype]
        engines = None if schedule.split else colocated_slices(cfg)
        check = sync_check_for(cfg, schedule.split, dist.get_rank() if dist.is_initialized() else 0)
        return cls(
            schedule,
            engine,
            learner,
            stale,
            group,
            dtype,
            timeline,
            sliced,
            engines,
            cfg.model,
            cfg.steps,
            check,
            cfg.algo.micro_batch_size,
        )

    def first_sync(self, resumed: bool) -> dict:
        """Before the first rollout: the engine gets the start's (or the resumed step's) weights."""
        return self.sync(resumed=resumed)

    def sync(self, phase: Phase | None = None, last: int | None = None, resumed: bool = False) -> dict:
        """After the update: the engine gets the weights of the next rollout, inside the offload
        timeline's sync phases (``phase``: the step's recorder, ``StepTimer.phase``; ``last``: the
        update the run ends at, ``steps`` unless a stop request ends it sooner). Returns the sync's
        metrics: a split run's broadcast (maxima over the dp ranks), none from an engine in this
        process."""
        with self.timeline.syncing(phase):
            self.syncs += 1
            if self.engines is not None and not self.stale.k and not self.schedule.split:
                m = self.load_slices()  # vLLM TP > 1 colocated: checked per shard (docs/vllm.md 11)
            else:
                weights = self.weights(resumed)
                if self.schedule.split:
                    return self.broadcast(weights, self.steps if last is None else last)
                m = self.engine.load_weights(self.check.wrap(weights)) or {}
            self.check.verify(self.engine, self.syncs)
            return {**m, **self.check.probe(self.engine, self.learner, self.micro_batch_size)}

    def weights(self, resumed: bool = False) -> Weights:
        """On policy the learner's stream; with rollout.staleness=k the kept set of k updates ago
        (the full export: the sets are copies)."""
        if not self.stale.k:
            return self.learner.iter_canonical_layers()
        exported = self.learner.export_canonical()
        return self.stale.resume_push(exported) if resumed else self.stale.push(exported)

    def load_slices(self) -> dict[str, Max]:
        """Colocated, engine ranks holding slices: the engine loads only its shard's slices of the
        learner's stream, each inside a tensor of its full shape (``placed``), as vLLM's loaders
        read it. ``weight_sync/bytes``: the slices' bytes (``sync_receive_bytes`` in the
        learner's dtype), as maxima over the data-parallel ranks. ``rollout.sync_check``: summed as
        they pass, in the layout of the shard this rank's worker holds (``sync_check_for``)."""
        shard, counted = self.engines(dist.get_rank()), [0]

        def handed():
            for piece in self.learner.iter_canonical_layers(engines=self.engines):
                counted[0] += sum(t.numel() * t.element_size() for t in piece.values())
                yield placed(piece, shard, self.model)

        self.engine.load_weights(self.check.wrap(handed()))
        return {"weight_sync/bytes": Max(torch.tensor(float(counted[0]), dtype=torch.float64))}

    def broadcast(self, weights: Weights, last: int | None = None) -> dict[str, Max]:
        """Split: the weight broadcast (learner rank 0 its root); metrics (docs/design.md 15.2)
        as maxima over the data-parallel ranks: the root's values, zeros on the other learner
        ranks, which only feed the stream's gathers."""
        remote = self.engine
        chunks = weight_chunks(weights)
        if self.delay_s and remote.next_version > 0:
            time.sleep(self.delay_s)
        check = self.check
        if self.group is not None:  # learner rank 0: the broadcast's root
            chunks = check.wrap(chunks)
            m = send_sync(self.group, last, chunks, remote.next_version, self.engine_dtype, self.sliced)
        else:
            for _ in chunks:  # the gather is collective over the learner ranks
                pass
            m = dict.fromkeys(SYNC_METRICS, 0.0)
            check.seconds = 0.0
        out = {k: Max(torch.tensor(float(m[k]), dtype=torch.float64)) for k in SYNC_METRICS}
        if check.on:
            # the probe batch under the weights just sent (every learner rank: the forward is
            # collective); each rollout rank checks its engine against the sums, scores the probe
            # after its load and sends the k3 back with its batches (sync_check.py)
            t0 = time.perf_counter()
            logp = check.learner_logp(self.learner, self.micro_batch_size)
            out["time/sync_probe_s"] = Max(torch.tensor(time.perf_counter() - t0, dtype=torch.float64))
            if self.group is not None:
                send_checksums(self.group, [check.sent_ints(r) for r in range(len(check.rows))], logp)
            out["time/sync_check_s"] = Max(torch.tensor(check.seconds, dtype=torch.float64))
        remote.synced()
        return out


class RolloutRankWeights:
    """A rollout rank's side of the sync: ``receive`` joins the next broadcast and loads it into
    ``engine`` (never while it samples); ``background`` starts the async receiver. ``shard``: what
    this rank's engine holds (``engine_shard``): one that is not whole (vLLM TP > 1) is sent its
    slices alone, point to point."""

    def __init__(
        self,
        schedule: Schedule,
        group: Group,
        engine,
        engine_group=None,
        shard: EngineShard | None = None,
        model: ModelConfig | None = None,
        check: bool = False,
        vocab_size: int = 0,
    ) -> None:
        self.schedule, self.group, self.engine, self.engine_group = schedule, group, engine, engine_group
        # rollout.sync_check: the root's checksums and probe log-probs follow each sync
        # (sync_check.py); ``probe``: the last probe's metrics, sent with every batch after it
        self.check, self.vocab_size, self.probe = check, vocab_size, {}
        self.shard = shard if shard is not None and not shard.whole else None
        self.model = model
        self.version = -1  # the learner update the engine holds (-1: none yet)
        self.last = -1  # the update the run ends at, as the learner told it with the last sync

    @classmethod
    def from_config(cls, cfg: RunConfig, schedule: Schedule, dims, engine) -> RolloutRankWeights:
        """This rollout rank's receiver: its engine's TP group (its ranks agree on updates) and
        its shard, from its index among the rollout ranks."""
        p = dims.placement
        engine_group = engine.group if engine_tp(cfg) > 1 else None
        shard = engine_shard(cfg, p.split.role_rank(p.rank))
        check, vocab = cfg.rollout.sync_check, cfg.model.vocab_size
        return cls(schedule, p.sync, engine, engine_group, shard, cfg.model, check, vocab)

    def receive(self) -> float:
        """Join the next weight sync and apply it; seconds waited + applied."""
        t0 = time.perf_counter()
        self.last = tell_last(self.group)
        version, chunks = receive_weights(self.group, sliced=self.shard is not None)
        if self.shard is not None:
            chunks = (placed(c, self.shard, self.model) for c in chunks)
        if self.version >= 0 and version != self.version + 1:
            raise RuntimeError(
                f"weight sync of version {version} after version {self.version}: one was missed"
            )
        if self.schedule.engine_stamps_versions:  # the engine stamps its tokens with it
            self.engine.load_weights(chunks, version=weight_version(version))
        else:
            self.engine.load_weights(chunks)
        self.version = version
        if self.check:
            tp_rank, tp = (self.shard.tp_rank, self.shard.tp_size) if self.shard is not None else (0, 1)
            check_s, learner_logp, agreed = check_received(self.group, self.engine, version, tp_rank, tp)
            self.score(version, learner_logp, agreed, check_s)
        return time.perf_counter() - t0

    def score(
        self, version: int, learner_logp: torch.Tensor, agreed: int = 0, check_s: float | None = None
    ) -> None:
        """rollout.sync_check: the probe batch on the engine, which holds update ``version`` (checked:
        ``agreed`` tensors, in ``check_s`` seconds), against the learner's log-probs of it; kept as
        the metrics the next batches carry (this rank's: with TP > 1 its own shard's)."""
        f64 = torch.float64
        t0 = time.perf_counter()
        k3 = probe_engine(self.engine, learner_logp, self.vocab_size)
        m = {"sync/check_tensors": Max(torch.tensor(float(agreed), dtype=f64))} if agreed else {}
        if check_s is not None:
            m["time/sync_rollout_check_s"] = Max(torch.tensor(check_s, dtype=f64))
        if k3 is not None:
            m["sync/probe_k3"] = Max(torch.tensor(k3, dtype=f64))
            m["sync/probe_version"] = Max(torch.tensor(float(version), dtype=f64))
            m["time/sync_rollout_probe_s"] = Max(torch.tensor(time.perf_counter() - t0, dtype=f64))
        if m:
            self.probe = m

    def background(self) -> BackgroundWeights:
        """Async: every sync after the one the engine holds, up to the run's last update (told with
        each sync), received in a thread of its own and handed to the engine between decode steps."""
        return BackgroundWeights(
            self.group,
            self.version,
            self.last,
            group=self.engine_group,
            shard=self.shard,
            model=self.model,
            told=True,
            checked=self.engine if self.check else None,
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
    they meet at a later poll. ``shard``: a sliced sync's (``RolloutRankWeights``), handed over
    ``placed``. ``told``: each sync is preceded by the run's last update (``tell_last``), which
    replaces ``last`` before that sync can be handed over (a stop request ends the run sooner)."""

    def __init__(
        self,
        sync: Group,
        applied: int,
        last: int,
        group=None,
        shard: EngineShard | None = None,
        model: ModelConfig | None = None,
        told: bool = False,
        checked=None,
    ) -> None:
        self.sync, self.applied, self.last = sync, applied, last  # applied: updates the engine holds
        # rollout.sync_check: the engine checked against the root's checksums of each update it
        # takes, at the first tick after its load (the root's sums and probe log-probs of update
        # u: sums[u]); ``probed``: (u, the learner's log-probs) once that check passed, for the
        # probe the rollout rank scores when the engine is next idle (``take_probe``)
        self.checked, self.sums, self.handed, self.probed = checked, {}, None, None
        self.told = told
        self.group = group
        self.poll_delay_s = float(os.environ.get(POLL_DELAY_ENV, "0"))
        self.shard, self.model = (shard, model) if shard is not None and not shard.whole else (None, None)
        self.tp_rank = self.shard.tp_rank if self.shard is not None else 0  # its row of the sums
        self.pending = PendingWeights()
        self.staged: tuple[int, dict] | None = None
        self.error: BaseException | None = None
        self.thread = None
        if applied < last:
            self.thread = threading.Thread(target=self._receive, name="weight-receive", daemon=True)
            self.thread.start()

    def _receive(self) -> None:
        try:
            while True:
                if self.told:
                    self.last = tell_last(self.sync)
                updates = self.pending.receive(self.sync, sliced=self.shard is not None)
                if self.checked is not None:  # newest wins, as staged
                    self.sums = {updates: receive_sums(self.sync, self.tp_rank)}
                if updates >= self.last:
                    break
        except BaseException as e:  # raised in the main thread at its next tick
            self.error = e

    def tick(self) -> None:
        if self.error is not None:
            raise self.error
        if self.handed is not None and self.checked.version == weight_version(self.handed[0]):
            updates, (sums, learner_logp) = self.handed
            where = shard_words(self.tp_rank, self.shard.tp_size if self.shard is not None else 1)
            agreed = verify_held(self.checked, sums, updates, where)  # the engine loaded it
            self.handed, self.probed = None, (updates, learner_logp, agreed)
        staged = self.pending.take()
        if staged is not None:
            self.staged = staged  # newest wins: an engine may skip a version, never go back

    def poll(self) -> tuple[int, dict] | None:
        if self.poll_delay_s:
            time.sleep(self.poll_delay_s)
        self.tick()
        newest = self.staged[0] if self.staged is not None else self.applied
        if self.group is not None and not _all_hold(self.group, newest):
            return None
        if self.staged is None:
            return None
        if self.checked is not None and self.staged[0] not in self.sums:
            return None  # its checksums follow the weights: handed over with them, at a later poll
        (updates, named), self.staged = self.staged, None
        if updates <= self.applied:
            raise RuntimeError(f"weight sync of update {updates} after update {self.applied}: out of order")
        self.applied = updates
        if self.checked is not None:
            self.handed = (updates, self.sums[updates])
        if self.shard is not None:
            named = placed(named, self.shard, self.model)
        return weight_version(updates), named

    def take_probe(self) -> tuple[int, torch.Tensor, int] | None:
        """rollout.sync_check: (the update the engine loaded last, the learner's probe log-probs of
        it, the tensors that agreed) once its checksums passed, handed out once; the engine still
        holds it until its next poll, so the rollout rank scores the probe between requests."""
        self.tick()  # the check of an update the engine's last poll loaded
        probed, self.probed = self.probed, None
        return probed

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
