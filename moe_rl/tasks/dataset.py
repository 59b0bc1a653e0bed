"""Prompt sources: where each RL step's prompts come from.

A ``PromptSource`` returns prompts from ``sample(num, seed)``, a pure function of its arguments:
it builds its own ``random.Random(seed)`` and never touches global RNG state, so a resumed run
that passes the same per-step seed gets the same prompts.

Two sources:
    ``GeneratedTasks``  mixes the generators named in ``generators.TASKS`` uniformly.
    ``RowDataset``      JSONL / Parquet rows (``moe_rl/tasks/rows.py``), checked in full at load time.
"""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable

from moe_rl.tasks.generators import TASKS, check_lengths
from moe_rl.tasks.rewards import check_reward_name
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.types import Prompt


@runtime_checkable
class PromptSource(Protocol):
    """Anything that yields prompts deterministically from an integer seed.

    ``task_names`` lists every task label its prompts can carry (for per-task metrics).
    """

    task_names: tuple[str, ...]

    def sample_step(self, step: int, num: int, dp_rank: int, dp_size: int, run_seed: int) -> list[Prompt]:
        """This data-parallel rank's ``num`` prompts of RL step ``step``, a pure function of the
        arguments (so a resumed run sees exactly the prompts the uninterrupted one did)."""
        ...


def check_task_names(tasks: list[str]) -> None:
    """Raise ValueError listing the known tasks unless every name is in ``TASKS`` (and some are)."""
    if not tasks:
        raise ValueError(f"no tasks given; known tasks: {sorted(TASKS)}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known tasks: {sorted(TASKS)}")


class GeneratedTasks:
    """Prompts drawn from generated tasks, each prompt's task chosen uniformly from ``tasks``.

    A name repeated in ``tasks`` is drawn proportionally more often.
    """

    def __init__(
        self,
        tasks: list[str],
        min_len: int,
        max_len: int,
        tokenizer: CharTokenizer,
        reward: str = "exact_match",
    ) -> None:
        check_task_names(list(tasks))
        check_lengths(min_len, max_len)
        check_reward_name(reward)
        self.tasks = list(tasks)
        self.task_names = tuple(dict.fromkeys(self.tasks))
        self.min_len, self.max_len = min_len, max_len
        self.tokenizer = tokenizer
        self.reward = reward

    def longest_prompt_tokens(self) -> int:
        """Tokens of the longest prompt any task can draw (bos included): every length at max_len."""
        longest = _Longest()
        return max(
            len(self.tokenizer.encode(TASKS[t](longest, self.max_len, self.max_len)[0], bos=True))
            for t in self.task_names
        )

    def sample_step(self, step: int, num: int, dp_rank: int, dp_size: int, run_seed: int) -> list[Prompt]:
        """``sample`` with the per-step, per-rank seed ``step_seed(run_seed, step, dp_rank, PROMPTS)``."""
        from moe_rl.seeding import PROMPTS, step_seed

        return self.sample(num, step_seed(run_seed, step, dp_rank, PROMPTS))

    def sample(self, num: int, seed: int) -> list[Prompt]:
        """``num`` prompts from ``random.Random(seed)``: task, then its digits, per prompt."""
        _check_num(num)
        rng = random.Random(seed)
        prompts = []
        for _ in range(num):
            task = self.tasks[rng.randrange(len(self.tasks))]
            text, answer = TASKS[task](rng, self.min_len, self.max_len)
            prompts.append(Prompt(self.tokenizer.encode(text, bos=True), answer, self.reward, task))
        return prompts

    def __repr__(self) -> str:
        return (
            f"GeneratedTasks(tasks={self.tasks}, min_len={self.min_len}, "
            f"max_len={self.max_len}, reward={self.reward!r})"
        )


def _check_num(num: int) -> None:
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")


class _Longest(random.Random):
    """An rng whose every ``randint`` draw is the upper end (the longest prompt of a task)."""

    def randint(self, a: int, b: int) -> int:
        return b
