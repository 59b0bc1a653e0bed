"""Verifiable tasks: tokenizer, prompt sources and rewards.

``build_prompt_source`` turns the ``task`` config values into a ``PromptSource``; ``score`` turns
a step's responses into rewards. Importing this package has no side effects beyond filling the
task and reward registries.
"""

from __future__ import annotations

import logging
from pathlib import Path

from moe_rl.errors import ConfigError
from moe_rl.tasks.dataset import (
    DatasetError,
    GeneratedTasks,
    JsonlDataset,
    Prompt,
    PromptSource,
    check_task_names,
)
from moe_rl.tasks.generators import TASKS, register_task
from moe_rl.tasks.rewards import (
    REWARDS,
    char_accuracy,
    check_reward_name,
    exact_match,
    register_reward,
    score,
)
from moe_rl.tasks.tokenizer import CharTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "REWARDS",
    "TASKS",
    "CharTokenizer",
    "DatasetError",
    "GeneratedTasks",
    "JsonlDataset",
    "Prompt",
    "PromptSource",
    "build_prompt_source",
    "char_accuracy",
    "check_reward_name",
    "check_task_names",
    "exact_match",
    "register_reward",
    "register_task",
    "score",
]


def build_prompt_source(tasks: list[str], min_len: int, max_len: int, dataset_path: str | Path,
                        reward: str, tokenizer: CharTokenizer, max_prompt_tokens: int | None = None,
                        overlong: str = "error", why: str = "") -> PromptSource:
    """The prompt source for a run: the JSONL file if ``dataset_path`` is set, else the tasks.

    Args:
        tasks: generated task names (mixed uniformly); ignored when a dataset is given.
        min_len, max_len: digit counts of generated prompts; ignored when a dataset is given.
        dataset_path: JSONL prompt file, or "" for generated tasks.
        reward: reward name (the default for dataset lines that name none).
        tokenizer: encodes the prompts.
        max_prompt_tokens: the longest prompt (bos included) the run can take (None: no limit);
            ``why`` names the config keys that set it.
        overlong: a longer dataset prompt is an "error" (DataError naming file:line) or dropped
            ("drop", with a warning giving the count); generated tasks that can draw a longer
            prompt are a ConfigError.
    Raises:
        ConfigError: unknown task or reward name, bad lengths, too long; DataError for a bad file.
    """
    if dataset_path:
        logger.info("prompts from %s; task.tasks/min_len/max_len are not used", dataset_path)
        try:
            data = JsonlDataset(dataset_path, tokenizer, default_reward=reward)
        except DatasetError:
            raise
        except ValueError as e:
            raise ConfigError(f"config key 'task.reward': {e}") from None
        if max_prompt_tokens is not None:
            dropped = data.fit(max_prompt_tokens, why, drop=overlong == "drop")
            if dropped:
                logger.warning("%s: dropped %d of %d prompts longer than %d tokens (%s; task.overlong=drop)",
                               dataset_path, dropped, dropped + len(data), max_prompt_tokens, why)
        return data
    try:
        gen = GeneratedTasks(list(tasks), min_len, max_len, tokenizer, reward=reward)
    except ValueError as e:
        raise ConfigError(f"config key 'task': {e}") from None
    if max_prompt_tokens is not None and gen.longest_prompt_tokens() > max_prompt_tokens:
        raise ConfigError(f"config key 'task.max_len': {max_len} digits give prompts of up to "
                          f"{gen.longest_prompt_tokens()} tokens, more than {max_prompt_tokens} ({why}); "
                          f"lower task.max_len or raise model.max_seq_len")
    return gen
