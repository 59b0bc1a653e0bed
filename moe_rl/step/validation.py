"""The validation pass: an engine pass over the run's fixed validation prompts, scored like a
step's rollouts, every ``log.val_every`` steps."""

from __future__ import annotations

import dataclasses
import time

from moe_rl.config import RunConfig
from moe_rl.corrections.correction_specs import DvpSpec
from moe_rl.seeding import VALIDATE, step_seed
from moe_rl.step.plan import sampling_params
from moe_rl.tasks.rewards import score
from moe_rl.tasks.task import Task


def validation_rewards(cfg: RunConfig, task: Task, engine, step: int, dp_rank: int, dp_size: int) -> dict:
    """Validation reward on the fixed validation prompts (this rank's share: every dp_size-th),
    one greedy (top-k 1) and one sampled response each: ``val/reward/mean[/<source>]`` and
    ``val/reward_sampled/mean[/<source>]``. Empty unless ``log.val_every`` divides ``step``."""
    every = cfg.log.val_every
    if task.val_source is None or not every or step % every:
        return {}
    t0 = time.perf_counter()
    rows = task.val_source.prompts[: cfg.task.val_max_prompts or None]
    prompts = rows[dp_rank::dp_size]
    sampled = sampling_params(cfg, task.tokenizer.eos_ids)
    greedy = dataclasses.replace(sampled, top_k=1, return_dist=False, dvp=DvpSpec())  # DVP off
    out = {}
    for prefix, params in (("val/reward", greedy), ("val/reward_sampled", sampled)):
        batch = engine.generate(
            [p.prompt_ids for p in prompts], 1, params, seed=step_seed(cfg.seed, step, dp_rank, VALIDATE)
        )
        _, m = score(
            prompts,
            batch.response_ids(task.tokenizer.pad_id),
            task.tokenizer,
            1,
            task_names=task.val_source.task_names,
            pool=task.pool,
        )
        out.update({prefix + k[len("reward") :]: v for k, v in m.items() if k.startswith("reward/mean")})
    return {**out, "time/validate_s": time.perf_counter() - t0}
