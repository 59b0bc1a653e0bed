"""A run's task side, built from the config: tokenizer, prompt sources, reward pool; and the
step's scoring (rewards, the overlong penalty, the dataset's dropped-prompt count). The validation
pass, an engine pass over the validation prompts, is the step's: ``moe_rl/step/validation.py``.

``build_task`` is what ``trainer.preflight`` runs before any rank starts (every bad input of the
task side fails there, naming file, row and key) and what every rank runs to train.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_rl.agentic.loop import AgentLoop
from moe_rl.agentic.setup import build_agent, env_rewards
from moe_rl.config import RunConfig
from moe_rl.config.hf_json import CONFIG as HF_CONFIG
from moe_rl.config.hf_json import hf_keys
from moe_rl.errors import ConfigError, DataError
from moe_rl.tasks.dataset import GeneratedTasks, PromptSource
from moe_rl.tasks.hf_tokenizer import HFTokenizer, TokenizerError, check_vocab_fits, load_tokenizer
from moe_rl.tasks.rewards import overlong_penalty, score, uses_token_reward
from moe_rl.tasks.rows import RowDataset, RowSpec
from moe_rl.tasks.text_rewards import RewardPool
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.weights.warmstart import agent_warmstart

log = logging.getLogger(__name__)


@dataclass
class Task:
    """What the loop needs from the task side."""

    tokenizer: CharTokenizer | HFTokenizer
    source: PromptSource
    val_source: RowDataset | None
    pool: RewardPool
    text_metrics: bool  # the run scores text rewards: log reward/error_frac and reward/timeout_frac
    agent: AgentLoop | None = None  # agent.env: the multi-turn loop that rolls out (moe_rl/agentic)


def row_spec(cfg: RunConfig) -> RowSpec:
    """A configured ``task.max_prompt_tokens`` drops longer prompts; without one, the room
    ``model.max_seq_len`` leaves for ``rollout.max_new_tokens`` is the limit and ``task.overlong``
    says whether a longer prompt is an error or dropped."""
    t, m, r = cfg.task, cfg.model.max_seq_len, cfg.rollout.max_new_tokens
    if t.max_prompt_tokens:
        limit, overlong, why = t.max_prompt_tokens, "drop", f"task.max_prompt_tokens={t.max_prompt_tokens}"
    else:
        limit, overlong, why = m - r, t.overlong, f"model.max_seq_len={m} minus rollout.max_new_tokens={r}"
        if overlong == "drop":
            why += "; task.overlong=drop"
    return RowSpec(
        t.prompt_key,
        t.answer_key,
        t.source_key,
        t.reward,
        t.apply_chat_template,
        t.add_generation_prompt,
        dict(t.chat_template_kwargs),
        max(limit, 1),
        overlong,
        why,
    )


def build_prompt_source(
    tasks: list[str],
    min_len: int,
    max_len: int,
    dataset_path: str | Path,
    reward: str,
    tokenizer: CharTokenizer | HFTokenizer,
    spec: RowSpec | None = None,
) -> PromptSource:
    """The prompt source for a run: the rows of ``dataset_path`` if set, else the tasks.

    Args:
        tasks: generated task names (mixed uniformly); ignored when a dataset is given.
        min_len, max_len: digit counts of generated prompts; ignored when a dataset is given.
        dataset_path: JSONL / Parquet prompt rows, or "" for generated tasks.
        reward: reward name (the default for rows that name none).
        tokenizer: encodes the prompts.
        spec: how rows become prompts (keys, chat template, length limit); default keys otherwise.
    Raises:
        ConfigError: unknown task or reward name, bad lengths, too long; DataError for a bad file.
    """
    if dataset_path:
        log.info("prompts from %s; task.tasks/min_len/max_len are not used", dataset_path)
        spec = dataclasses.replace(spec or RowSpec(), default_reward=reward)
        return RowDataset(dataset_path, spec, tokenizer)
    try:
        gen = GeneratedTasks(list(tasks), min_len, max_len, tokenizer, reward=reward)
    except ValueError as e:
        raise ConfigError(f"config key 'task': {e}") from None
    limit = spec.max_prompt_tokens if spec is not None else 0
    if limit and gen.longest_prompt_tokens() > limit:
        raise ConfigError(
            f"config key 'task.max_len': {max_len} digits give prompts of up to "
            f"{gen.longest_prompt_tokens()} tokens, more than {limit} ({spec.limit_why}); "
            f"lower task.max_len or raise model.max_seq_len"
        )
    return gen


def resolve_vocab(cfg: RunConfig, tok: CharTokenizer | HFTokenizer) -> RunConfig:
    """model.vocab_size: as configured, else the HF checkpoint's (padded embeddings), else the
    tokenizer's; it must hold every token id."""
    vocab = cfg.model.vocab_size
    if vocab == 0 and cfg.init_weights.startswith("hf:"):
        ckpt_dir = Path(cfg.init_weights[3:])
        if (ckpt_dir / HF_CONFIG).is_file():
            vocab = hf_keys(ckpt_dir).get("vocab_size", int, 0)  # errors name the file and the key
    vocab = vocab or tok.vocab_size
    check_vocab_fits(tok, vocab)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def build_task(cfg: RunConfig, start_pool: bool = True) -> tuple[RunConfig, Task]:
    """The tokenizer, the prompt sources (files read and checked in full) and the reward pool."""
    t = cfg.task
    tok = load_tokenizer(t.tokenizer, cfg.init_weights)
    cfg = agent_warmstart(resolve_vocab(cfg, tok))  # agent.env: the warm start that calls tools
    spec = row_spec(cfg)
    agent = build_agent(cfg, tok) if cfg.agent.env else None  # its prompts come from the environment
    source = (
        agent.source
        if agent
        else build_prompt_source(t.tasks, t.min_len, t.max_len, t.dataset, t.reward, tok, spec)
    )
    val = (
        RowDataset(t.val_dataset, dataclasses.replace(spec, default_reward=t.reward), tok)
        if t.val_dataset
        else None
    )
    if val is not None and len(val.prompts[: t.val_max_prompts or None]) < cfg.data_parallel:
        raise DataError(
            f"{t.val_dataset}: {len(val)} validation prompts for {cfg.data_parallel} "
            "data-parallel ranks; each rank needs at least one"
        )
    text = not uses_token_reward(t.reward, tok) or isinstance(tok, HFTokenizer)
    pool = RewardPool(t.reward_workers if text else 0, t.reward_timeout_s)
    return cfg, Task(
        tok, source, val, pool.start() if start_pool else pool, text, agent.loop if agent else None
    )


def score_step(cfg: RunConfig, task: Task, prompts: list, batch) -> tuple[torch.Tensor, dict]:
    """Rewards of a rollout (plus the overlong penalty when on) and the reward metrics."""
    t = cfg.task
    if batch.env_reward_B is not None:  # multi-turn: the environment scored each trajectory
        return env_rewards(batch, prompts, cfg.rollout.samples_per_prompt)
    rewards_B, metrics = score(
        prompts,
        batch.response_ids(task.tokenizer.pad_id),
        task.tokenizer,
        cfg.rollout.samples_per_prompt,
        task_names=task.source.task_names,
        pool=task.pool,
        text_metrics=task.text_metrics,
    )
    if t.overlong_buffer > 0:
        penalty_B, m_pen = overlong_penalty(
            batch.response_lens_B, cfg.rollout.max_new_tokens, t.overlong_buffer, t.overlong_penalty
        )
        rewards_B = rewards_B + penalty_B.to(rewards_B.device)
        metrics.update(m_pen)
    if isinstance(task.source, RowDataset):
        metrics["rollout/prompts_dropped_too_long"] = task.source.num_dropped
    return rewards_B, metrics


__all__ = ["Task", "TokenizerError", "build_task", "resolve_vocab", "row_spec", "score_step"]
