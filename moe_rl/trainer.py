"""THE training loop: rollout -> reward -> old log-probs -> corrections and advantages -> reference
log-probs -> update -> weight sync -> metrics -> checkpoint. Features live inside the called
components (the step's in ``moe_rl/step``, resolved once into a ``StepPlan``; the timeline's in
``moe_rl/pipeline``: the ``Schedule``, the offload timeline and the weight sync), not as branches here."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from moe_rl.checkpointing import CheckpointManager
from moe_rl.config import SAVED_CONFIG, RunConfig, Schedule, to_dict, to_yaml
from moe_rl.dist import ParallelDims
from moe_rl.fsutil import write_atomic
from moe_rl.health import HealthMonitor
from moe_rl.learner.learner import Learner
from moe_rl.maths.lr import LengthLRScheduler
from moe_rl.maths.versions import weight_version
from moe_rl.metrics import MetricsWriter
from moe_rl.pipeline.engines import build_rank_engine
from moe_rl.pipeline.offload_timeline import OffloadTimeline
from moe_rl.pipeline.rollout_ranks import serve_rollouts
from moe_rl.pipeline.weight_sync import WeightSync
from moe_rl.preflight import check_gpus, check_launch
from moe_rl.preflight import check_run_dir as check_run_directory
from moe_rl.seeding import GENERATE, step_seed
from moe_rl.step.finalize import finalize
from moe_rl.step.mismatch_split import split_step
from moe_rl.step.oversample import (
    OverSamplingPlan,
    Pending,
    RoundOut,
    collect_over,
    drop_stale,
    remote_round,
    round_count,
)
from moe_rl.step.plan import StepPlan
from moe_rl.step.prepare import old_logprobs, prepare_batch, reference_logprobs, rollout_metrics
from moe_rl.step.sampling import Collected, collect
from moe_rl.step.update import learning_rate, update_policy
from moe_rl.step.validation import validation_rewards
from moe_rl.stop import Stopped, agreed
from moe_rl.tasks.task import Task, build_task, step_scores
from moe_rl.timing import MemoryTimeline, StepTimer, memory_metrics
from moe_rl.types import with_version
from moe_rl.weights.warmstart import open_init_weights

log = logging.getLogger(__name__)

MEMORY_TIMELINE = "memory_timeline.jsonl"  # each phase's peak RSS, per rank (docs/design.md 2.2)


@dataclass
class Prepared:
    """What preflight built: the resolved config and its task (tokenizer, prompt sources, reward
    pool not yet started). ``train`` in the same process reuses it rather than building it again."""

    cfg: RunConfig
    task: Task
    memory: MemoryTimeline  # the "preflight" phase's peak RSS (of the launcher, or of this rank)


def prepare(cfg: RunConfig, check_run_dir: bool = True) -> Prepared:
    """Everything that can fail on bad input, checked before any rank starts.

    Under an external torchrun every rank runs this (and passes the result on to ``train``); only
    rank 0 checks the run directory, which another rank could otherwise see half-written by rank 0.
    The init weights are checked from their file headers alone (no tensor data is read), and not
    at all on a resume, whose checkpoint holds every weight, unless the reference model (algo.kl_coef
    > 0), which no checkpoint holds, is built from them (``needs_init_weights``)."""
    memory = MemoryTimeline(
        int(os.environ["RANK"]) if "RANK" in os.environ else "launcher"
    )  # under torchrun: this rank
    with memory.span("preflight"):
        check_gpus(cfg)  # first: a GPU recipe on a CPU machine says what it needs before any path
        cfg, task = build_task(cfg, start_pool=False)  # tokenizer, datasets (read in full), reward names
        check_launch(cfg)  # CUDA / Transformer Engine / vLLM where the config asks for them
        if check_run_dir:
            check_run_directory(cfg)  # a directory or absent; not taken; on resume: same model, layout, steps
        if needs_init_weights(cfg):
            open_init_weights(cfg.init_weights, cfg.model, task.tokenizer)  # names, shapes, dtypes, arch
    return Prepared(cfg, task, memory)


def preflight(cfg: RunConfig, check_run_dir: bool = True) -> RunConfig:
    """``prepare``'s checks; the resolved config (e.g. model.vocab_size from the tokenizer)."""
    return prepare(cfg, check_run_dir).cfg


def needs_init_weights(cfg: RunConfig) -> bool:
    """A new run starts from its init weights; a resume loads every learner weight from its
    checkpoint, so it reads them only for the reference model (algo.kl_coef > 0: a frozen copy of
    the initial weights, not checkpointed)."""
    return not cfg.resume or StepPlan.from_config(cfg).reference


def progress(cfg: RunConfig, start: int, dims: ParallelDims) -> tqdm:
    return tqdm(
        total=cfg.steps,
        initial=start,
        desc="rl",
        unit="step",
        dynamic_ncols=True,
        disable=not (dims.is_main and cfg.log.progress_bar),
    )


@dataclass
class RankPipeline:
    """A learner rank's side of the step's timeline (moe_rl/pipeline/): the schedule, the engine
    (or the rollout ranks' stand-in), what is on the device at each phase, and the weight sync."""

    schedule: Schedule
    engine: object
    offload: OffloadTimeline
    sync: WeightSync


def pipeline_of(cfg: RunConfig, dims: ParallelDims, learner: Learner, pad_id: int, mem: MemoryTimeline):
    """The learner rank's engine, started (vLLM: beside no learner state), and the owners of its
    offload timeline and weight sync; in a split world the engine is the stand-in for the rollout
    ranks' engines (moe_rl/pipeline/remote_engine.py)."""
    schedule = Schedule.from_config(cfg)  # the schedule's every choice, made once
    with mem.span("engine build"):
        engine = build_rank_engine(cfg, schedule, pad_id, learner.device, dims)
        offload = OffloadTimeline(engine, learner, cfg.parallel.offload_during_rollout, mem)
        offload.start_engine()
    sync = WeightSync.from_config(cfg, schedule, engine, learner, dims, offload)
    return RankPipeline(schedule, engine, offload, sync)


def build_learner(cfg: RunConfig, plan: StepPlan, dims: ParallelDims, tok, memory=None) -> Learner:
    """The megatron learner of ``cfg``: each rank reads only its shard of the warm start (checked
    in preflight), and none on a resume that needs no reference model."""
    init = open_init_weights(cfg.init_weights, cfg.model, tok) if needs_init_weights(cfg) else None
    return Learner(
        cfg.model,
        cfg.parallel,
        cfg.optim,
        dims,
        init,
        with_reference=plan.reference,
        monitor=cfg.log.router_monitor,
        monitor_margin_eps=cfg.log.router_margin_eps,
        max_tokens_per_micro_batch=cfg.algo.max_tokens_per_micro_batch,
        memory=memory,
    )


def open_run_dir(cfg: RunConfig, dims: ParallelDims, start: int, task: Task, cursor: int) -> MetricsWriter:
    """The resolved config (rank 0) and the metrics sink, continued on resume (the agent's
    trajectory log too: run_dir/agent/trajectories_rank<r>.jsonl, its lines by data index: a
    resume drops those from the data cursor on)."""
    run_dir = Path(cfg.run_dir)
    if task.agent is not None and not cfg.parallel.rollout_ranks:  # split: the rollout ranks log
        log = run_dir / "agent" / f"trajectories_rank{dims.rank}.jsonl"
        task.agent.log_to(log, resume_step=cursor if cfg.resume else None)
    if dims.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # a resume's base (moe_rl.config.load_run_config): never left half-written
        write_atomic(run_dir / SAVED_CONFIG, to_yaml(cfg))
    return MetricsWriter(
        run_dir,
        to_dict(cfg),
        cfg.log.wandb_mode,
        cfg.log.wandb_project,
        dims.rank,
        resume_step=start if cfg.resume else None,
    )


def rank_task(cfg: RunConfig, dims: ParallelDims, prepared: Prepared | None) -> Prepared:
    """The rank's config, task (reward pool started) and memory timeline: ``prepared`` when
    preflight ran in this process (an external torchrun), else built here (once per process)."""
    if prepared is None:
        mem = MemoryTimeline(dims.rank)  # run_dir/memory_timeline.jsonl (docs/design.md 2.2)
        with mem.span("task"):
            cfg, task = build_task(cfg, start_pool=False)
        prepared = Prepared(cfg, task, mem)
    prepared.task.pool.start()
    return prepared


def rollout_step(
    cfg: RunConfig,
    task: Task,
    pipe: RankPipeline,
    plan: StepPlan,
    step: int,
    dims: ParallelDims,
    cursor: int,
    timer: StepTimer,
    pending: Pending,
) -> tuple[Collected, Pending]:
    """The step's prompts, their batch and scores, in rounds from data-cursor index ``cursor`` on
    (more than one only with algo.dynamic_sampling; moe_rl/step/sampling.py): a round's prompts are
    those of its index, or (rollout.mode=async) of the request the rollout ranks' buffer hands this
    dp rank; split, the rollout ranks are asked for it (``RemoteEngine.request_for``, ``end_rounds``);
    with the version of the weights it was sampled with on each token (``SimulatedStaleness.versioned``).
    With algo.over_sampling, the rounds start more groups and abort the rest (moe_rl/step/oversample.py;
    split: on the rollout rank, asked for each round with the groups still wanted): ``pending``, the
    partial rollouts carried between steps (kept here; split, sent with each round's request)."""
    r, engine = cfg.rollout, pipe.engine

    def generate(index: int):
        with timer.phase("rollout"):  # async: the wait for the buffer's request counts here
            at = engine.request_for(step, index) if pipe.schedule.split else index
            prompts = task.source.sample_step(
                at, r.prompts_per_step // dims.dp_size, dims.dp_rank, dims.dp_size, cfg.seed
            )
            seed = step_seed(cfg.seed, at, dims.dp_rank, GENERATE)
            if task.agent is not None and not pipe.schedule.split:  # agent.env: conversations with
                # tool replies (moe_rl/agentic/loop.py); split, the rollout ranks run them
                agent = task.agent
                return prompts, agent.rollout(engine, prompts, r.samples_per_prompt, plan.sampling, seed, at)
            ids = [p.prompt_ids for p in prompts]
            return prompts, engine.generate(ids, r.samples_per_prompt, plan.sampling, seed=seed)

    def score(prompts, batch):
        with timer.phase("score"):
            return step_scores(cfg, task, prompts, batch)

    ds, pad, stale = cfg.algo.dynamic_sampling, task.tokenizer.pad_id, pipe.sync.stale
    if not cfg.algo.over_sampling.on:
        got = collect(ds, generate, score, cursor, pad, dims.dp_group)
        if pipe.schedule.split:  # the rollout ranks join the weight sync next (one_step_off: after a round)
            engine.end_rounds(cursor + got.rounds)
        with timer.phase("rollout"):  # version_BS: the weights it sampled with
            batch, m_stale = stale.versioned(got.batch, step)
        return got._replace(batch=batch, metrics={**got.metrics, **m_stale}), pending

    def draw(index: int, count: int) -> list:
        return task.source.sample_step(index, count, dims.dp_rank, dims.dp_size, cfg.seed)

    def flat(ids: list, index: int, abort):  # one row per sample; tokens stamped as versioned() does
        with timer.phase("rollout"):
            seed = step_seed(cfg.seed, index, dims.dp_rank, GENERATE)
            got = engine.generate(ids, 1, plan.sampling, seed=seed, abort=abort)
            return with_version(dataclasses.replace(got, version_BS=None), stale.engine_version(step))

    os_plan = OverSamplingPlan.from_config(cfg, dims.dp_size, pad)

    def remote(index: int, want: int, pending: Pending) -> RoundOut:  # split: the rollout rank's round
        with timer.phase("rollout"):
            engine.request_for(step, index, want=want, pending=sent(pending))
            rows = [*pending.prompts, *draw(index, round_count(os_plan, want, pending))]
            seed = step_seed(cfg.seed, index, dims.dp_rank, GENERATE)
            got = engine.generate(
                [p.prompt_ids for p in rows], r.samples_per_prompt, plan.sampling, seed=seed
            )
            return remote_round(os_plan, got, rows, pending)

    def sent(pending: Pending) -> dict | None:  # on_abort=drop: never any
        return pending.state_dict() if pending.batch is not None else None

    split = pipe.schedule.split
    got, pending = collect_over(
        os_plan,
        flat,
        draw,
        score,
        cursor,
        pending,
        weight_version(step),
        dims.dp_group,
        remote if split else None,
    )
    if split:  # the rollout ranks join the weight sync next (one_step_off: after the next step's first
        # round, which resumes the groups pending now that the next step keeps: docs/sampling.md 6)
        ahead = drop_stale(os_plan, pending, weight_version(step + 1))[0]
        engine.end_rounds(cursor + got.rounds, want=os_plan.need, pending=sent(ahead))
    return got._replace(metrics={**got.metrics, **stale.metrics()}), pending


# the run, to cfg.steps, or (``Stopped``) to the checkpoint a stop request ended it with
def train(cfg: RunConfig, dims: ParallelDims, prepared: Prepared | None = None) -> Stopped | None:
    if dims.is_rollout:  # parallel.rollout_ranks: this rank only generates (docs/design.md 15)
        return serve_rollouts(cfg, dims, prepared.task if prepared else None)
    ready = rank_task(cfg, dims, prepared)
    cfg, task, mem, tok = ready.cfg, ready.task, ready.memory, ready.task.tokenizer
    plan = StepPlan.from_config(cfg, tok.eos_ids)  # the step's every choice, made once
    learner = build_learner(cfg, plan, dims, tok, mem)
    pipe = pipeline_of(cfg, dims, learner, tok.pad_id, mem)  # engine, offload timeline, weight sync
    lr_sched = LengthLRScheduler(cfg.optim.length_lr)
    stale = pipe.sync.stale  # rollout.staleness=k: the engine's weights k updates behind
    ckpt = CheckpointManager(cfg, learner, lr_sched, stale, pipe.engine)
    with mem.span("resume"):
        start = ckpt.resume()
    with mem.span("first sync"):
        pipe.sync.first_sync(resumed=start > 0)
    writer, bar = open_run_dir(cfg, dims, start, task, ckpt.data_cursor), progress(cfg, start, dims)
    mem.attach(Path(cfg.run_dir) / MEMORY_TIMELINE)
    health = HealthMonitor(cfg.log.health, cfg.model.vocab_size, dims.is_main, cfg.routing.verify.alarm_frac)
    stop = 0  # the signal of a stop request, once the learner ranks agreed on one
    cursor = ckpt.data_cursor  # the data's next index: the step's, unless dynamic sampling took more
    pending = Pending.from_state_dict(ckpt.partials)  # algo.over_sampling's partial rollouts
    for step in range(start, cfg.steps):
        # none of the learner's state is on the device while the engine generates (the sync left it off)
        with pipe.offload.generating(step) as moved:
            m_val = validation_rewards(cfg, task, pipe.engine, step, dims.dp_rank, dims.dp_size)  # val_every
            timer = StepTimer(mem, step)  # each phase's peak RSS: run_dir/memory_timeline.jsonl
            got, pending = rollout_step(cfg, task, pipe, plan, step, dims, cursor, timer, pending)
            cursor, batch = cursor + got.rounds, got.batch  # version_BS: the weights it sampled with
        with timer.phase("old_logprob"):
            old = old_logprobs(plan, learner, batch, learner_version=weight_version(step))
        m_split = split_step(plan, learner, old, step, timer.phase)  # log.mismatch_split_every
        with timer.phase("prepare"):  # corrections, advantages, this step's LR
            train_batch, m_prep = prepare_batch(plan, learner, old, got.scores.rewards_B)
            lr, m_lr, events = learning_rate(plan, lr_sched, step, batch, dims.dp_group)
        with timer.phase("reference"):  # a no-op unless algo.kl_coef > 0
            train_batch = reference_logprobs(plan, learner, train_batch)
        with timer.phase("update"):
            m_update = update_policy(plan, learner, train_batch, lr)
        stop = agreed() if step + 1 < cfg.steps else 0  # a stop signal on any learner rank: the last step
        m_sync = pipe.sync.sync(timer.phase, step + 1 if stop else cfg.steps)  # learner -> engine (14.2)
        local = {**m_val, **got.metrics, **m_prep, **m_split, **m_update, **m_lr, **m_sync}
        local |= rollout_metrics(batch)
        m_mem = {**memory_metrics(learner.device), **moved.metrics()}
        metrics = finalize({**local, **timer.metrics(), **m_mem}, dims.dp_group)
        writer.log(step, metrics)
        writer.log_expert_load(step, learner.expert_load())  # run_dir/expert_load.jsonl
        writer.log_events(events + health.observe(step, metrics))  # LR decays, health alarms
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step_s']:.2f}")
        if ckpt.due(step) or stop:
            with mem.span("checkpoint", step), pipe.offload.resident():  # weights, Adam state back
                ckpt.save(step, cursor, pending)
        if stop:
            break
    pipe.offload.finish()
    bar.close()
    writer.close()
    task.pool.close()
    return Stopped(step + 1, stop) if stop else None
