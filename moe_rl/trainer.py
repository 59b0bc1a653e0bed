"""THE training loop: rollout -> reward -> old log-probs -> advantages -> update -> weight sync ->
metrics -> checkpoint. Features live inside the called components, not as branches here."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from moe_rl import rl
from moe_rl.config import RunConfig, to_dict, to_yaml
from moe_rl.dist import DistContext
from moe_rl.learner import checkpoint
from moe_rl.learner.learner import Learner
from moe_rl.lr import LengthLRScheduler
from moe_rl.metrics import MetricsWriter, reduce_metrics
from moe_rl.preflight import check_launch
from moe_rl.tasks import CharTokenizer, build_prompt_source, score
from moe_rl.warmstart import load_init_weights

log = logging.getLogger(__name__)


def resolve(cfg: RunConfig, tok: CharTokenizer) -> RunConfig:
    """Fill values derived from other parts (the vocabulary size from the tokenizer)."""
    if cfg.model.vocab_size not in (0, tok.vocab_size):
        raise ValueError(f"config key 'model.vocab_size' is {cfg.model.vocab_size} but the "
                         f"tokenizer has {tok.vocab_size} tokens")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tok.vocab_size))


def preflight(cfg: RunConfig, check_run_dir: bool = True) -> RunConfig:
    """Everything that can fail on bad input, checked before any rank starts.

    Under an external torchrun every rank runs this; only rank 0 checks the run directory, which
    another rank could otherwise see half-written by rank 0."""
    tok = CharTokenizer()
    cfg = resolve(cfg, tok)
    check_launch(cfg)  # CUDA / Transformer Engine / vLLM where the config asks for them
    t = cfg.task
    build_prompt_source(t.tasks, t.min_len, t.max_len, t.dataset, t.reward, tok)  # reads the dataset
    load_init_weights(cfg.init_weights, cfg.model, tok)  # checks names, shapes, architecture
    run_dir = Path(cfg.run_dir)
    if not check_run_dir:
        return cfg
    if cfg.resume:
        if checkpoint.latest(run_dir / "checkpoints") is None:
            raise FileNotFoundError(f"resume=true but {run_dir}/checkpoints has no checkpoint")
    elif (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"{run_dir} already holds a run; pass resume=true or another run_dir=")
    return cfg


def train(cfg: RunConfig, ctx: DistContext) -> None:
    tok = CharTokenizer()
    cfg = resolve(cfg, tok)
    run_dir, t, r = Path(cfg.run_dir), cfg.task, cfg.rollout
    source = build_prompt_source(t.tasks, t.min_len, t.max_len, t.dataset, t.reward, tok)
    init = load_init_weights(cfg.init_weights, cfg.model, tok)
    learner = Learner(cfg.model, cfg.parallel, cfg.optim, ctx, init, with_reference=cfg.algo.kl_coef > 0,
                      monitor=cfg.log.router_monitor, monitor_margin_eps=cfg.log.router_margin_eps)
    engine, lr_sched = rl.build_engine(cfg, tok), LengthLRScheduler(cfg.optim.length_lr)
    start = rl.maybe_resume(cfg, learner, run_dir, lr_sched)
    engine.load_weights(learner.export_canonical())
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    writer = MetricsWriter(run_dir, to_dict(cfg), cfg.log.wandb_mode, cfg.log.wandb_project,
                           ctx.rank, resume_step=start if cfg.resume else None)
    bar = rl.progress(cfg, start, ctx)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        prompts = source.sample(r.prompts_per_step // ctx.dp_size, seed=rl.step_seed(cfg.seed, step, ctx.dp_rank, 0))
        batch = engine.generate([p.prompt_ids for p in prompts], r.samples_per_prompt, rl.sampling(cfg, tok),
                                seed=rl.step_seed(cfg.seed, step, ctx.dp_rank, 1))
        t_roll = time.perf_counter()
        rewards_B, m_reward = score(prompts, rl.response_ids(batch, tok.pad_id), tok, r.samples_per_prompt,
                                    task_names=source.task_names)
        train_batch, m_old = rl.prepare(cfg, learner, batch, rewards_B)
        lr, m_lr, events = rl.learning_rate(cfg, lr_sched, step, batch, learner.dp_group)
        t_old = time.perf_counter()
        m_update = rl.update(cfg, learner, train_batch, lr)
        t_upd = time.perf_counter()
        engine.load_weights(learner.export_canonical())  # weight sync learner -> engine
        t_end = time.perf_counter()
        times = {"time/rollout_s": t_roll - t0, "time/old_logprob_s": t_old - t_roll,
                 "time/update_s": t_upd - t_old, "time/sync_s": t_end - t_upd, "time/step_s": t_end - t0}
        # over data-parallel ranks: tensor-parallel peers hold the same batch and the same metrics
        metrics = rl.finalize(reduce_metrics({**m_reward, **m_old, **m_update, **m_lr, **rl.rollout_metrics(batch),
                                              **times}, group=learner.dp_group))
        writer.log(step, metrics)
        writer.log_events(events)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step_s']:.2f}")
        if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or step + 1 == cfg.steps:
            checkpoint.save(learner, run_dir / "checkpoints", step + 1,
                            {"seed": cfg.seed, "length_lr": lr_sched.state_dict()})
    bar.close()
    writer.close()
