"""Verifiable tasks: tokenizer, prompt sources and rewards.

``build_prompt_source`` turns the ``task`` config values into a ``PromptSource``; ``score`` turns
a step's responses into rewards. Importing this package has no side effects beyond filling the
task and reward registries.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from moe_rl.errors import ConfigError
from moe_rl.tasks.dataset import (
    DatasetError,
    GeneratedTasks,
    Prompt,
    PromptSource,
    check_task_names,
)
from moe_rl.tasks.hf_tokenizer import HFTokenizer, TokenizerError, check_vocab_fits, load_tokenizer
from moe_rl.tasks.generators import TASKS, register_task
from moe_rl.tasks.rewards import (
    REWARDS,
    char_accuracy,
    check_reward_name,
    exact_match,
    overlong_penalty,
    register_reward,
    score,
)
from moe_rl.tasks.rows import RowDataset, RowSpec
from moe_rl.tasks.tokenizer import CharTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "REWARDS",
    "TASKS",
    "CharTokenizer",
    "DatasetError",
    "GeneratedTasks",
    "HFTokenizer",
    "RowDataset",
    "RowSpec",
    "TokenizerError",
    "Prompt",
    "PromptSource",
    "build_prompt_source",
    "char_accuracy",
    "check_reward_name",
    "check_task_names",
    "check_vocab_fits",
    "load_tokenizer",
    "overlong_penalty",
    "exact_match",
    "register_reward",
    "register_task",
    "score",
]


def build_prompt_source(tasks: list[str], min_len: int, max_len: int, dataset_path: str | Path,
                        reward: str, tokenizer: CharTokenizer | HFTokenizer,
                        spec: RowSpec | None = None) -> PromptSource:
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
        logger.info("prompts from %s; task.tasks/min_len/max_len are not used", dataset_path)
        spec = dataclasses.replace(spec or RowSpec(), default_reward=reward)
        return RowDataset(dataset_path, spec, tokenizer)
    try:
        gen = GeneratedTasks(list(tasks), min_len, max_len, tokenizer, reward=reward)
    except ValueError as e:
        raise ConfigError(f"config key 'task': {e}") from None
    limit = spec.max_prompt_tokens if spec is not None else 0
    if limit and gen.longest_prompt_tokens() > limit:
        raise ConfigError(f"config key 'task.max_len': {max_len} digits give prompts of up to "
                          f"{gen.longest_prompt_tokens()} tokens, more than {limit} ({spec.limit_why}); "
                          f"lower task.max_len or raise model.max_seq_len")
    return gen
