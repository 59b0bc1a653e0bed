"""Prompt sources: where each RL step's prompts come from.

A ``PromptSource`` returns prompts from ``sample(num, seed)``, a pure function of its arguments:
it builds its own ``random.Random(seed)`` and never touches global RNG state, so a resumed run
that passes the same per-step seed gets the same prompts.

Two sources:
    ``GeneratedTasks``  mixes the generators named in ``generators.TASKS`` uniformly.
    ``JsonlDataset``    reads a JSONL file, one prompt per line, checked in full at load time.

JSONL line format (UTF-8; blank lines are skipped)::

    {"prompt": "R3142:", "answer": "2413", "reward": "exact_match", "task": "reverse"}

``prompt`` (non-empty) and ``answer`` are required strings over the tokenizer's vocabulary;
``reward`` (a name in ``rewards.REWARDS``, default: the dataset's default reward) and ``task`` (a
label for per-task metrics, default ``"dataset"``) are optional strings. Any other key is an error.
The prompt text is fed as is after bos; the model must answer with the answer text, then eos.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from moe_rl.errors import DataError
from moe_rl.tasks.generators import TASKS, check_lengths
from moe_rl.tasks.rewards import REWARDS, check_reward_name
from moe_rl.tasks.tokenizer import CharTokenizer

_REQUIRED_KEYS = ("prompt", "answer")
_OPTIONAL_KEYS = ("reward", "task")


DatasetError = DataError  # the old name

@dataclass(frozen=True)
class Prompt:
    """One prompt to roll out.

    prompt_ids: token ids, bos first, then the prompt text.
    answer: the reference answer text (no eos).
    reward: name of the reward function in ``rewards.REWARDS``.
    task: label for per-task metrics (the generator name, or a dataset's task label).
    """

    prompt_ids: list[int]
    answer: str
    reward: str
    task: str


@runtime_checkable
class PromptSource(Protocol):
    """Anything that yields prompts deterministically from an integer seed.

    ``task_names`` lists every task label its prompts can carry (for per-task metrics).
    """

    task_names: tuple[str, ...]

    def sample(self, num: int, seed: int) -> list[Prompt]:
        """``num`` prompts, a pure function of (num, seed)."""
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

    def __init__(self, tasks: list[str], min_len: int, max_len: int, tokenizer: CharTokenizer,
                 reward: str = "exact_match") -> None:
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
        return max(len(self.tokenizer.encode(TASKS[t](longest, self.max_len, self.max_len)[0], bos=True))
                   for t in self.task_names)

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
        return (f"GeneratedTasks(tasks={self.tasks}, min_len={self.min_len}, "
                f"max_len={self.max_len}, reward={self.reward!r})")


class JsonlDataset:
    """Prompts read from a JSONL file (format in the module docstring), validated on load.

    ``sample(num, seed)`` walks seeded permutations of the records: with num <= len(self) the
    prompts are distinct; beyond that a fresh permutation (epoch) follows.
    """

    def __init__(self, path: str | Path, tokenizer: CharTokenizer,
                 default_reward: str = "exact_match") -> None:
        check_reward_name(default_reward)
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.default_reward = default_reward
        self.prompts, self.lines = _load_jsonl(self.path, tokenizer, default_reward)
        self.task_names = tuple(dict.fromkeys(p.task for p in self.prompts))

    def fit(self, max_prompt_tokens: int, why: str, drop: bool) -> int:
        """Keep prompts of at most ``max_prompt_tokens`` tokens (bos included). ``drop``: remove the
        longer ones and return how many; else DataError naming the first one's line (``why`` says
        which config keys set the limit)."""
        keep = [i for i, p in enumerate(self.prompts) if len(p.prompt_ids) <= max_prompt_tokens]
        if len(keep) == len(self.prompts):
            return 0
        first = next(i for i, p in enumerate(self.prompts) if len(p.prompt_ids) > max_prompt_tokens)
        n_first = len(self.prompts[first].prompt_ids)
        if not drop:
            raise DataError(f"{self.path}:{self.lines[first]}: prompt has {n_first} tokens (bos included), "
                            f"more than {max_prompt_tokens} ({why}); shorten it, raise model.max_seq_len, "
                            f"or set task.overlong=drop")
        if not keep:
            raise DataError(f"{self.path}: every prompt is longer than {max_prompt_tokens} tokens ({why})")
        dropped = len(self.prompts) - len(keep)
        self.prompts = [self.prompts[i] for i in keep]
        self.lines = [self.lines[i] for i in keep]
        self.task_names = tuple(dict.fromkeys(p.task for p in self.prompts))
        return dropped

    def __len__(self) -> int:
        return len(self.prompts)

    def sample(self, num: int, seed: int) -> list[Prompt]:
        """``num`` prompts from seeded permutations of the records."""
        _check_num(num)
        rng = random.Random(seed)
        order: list[int] = []
        while len(order) < num:
            epoch = list(range(len(self.prompts)))
            rng.shuffle(epoch)
            order.extend(epoch)
        return [self.prompts[i] for i in order[:num]]

    def __repr__(self) -> str:
        return f"JsonlDataset(path={str(self.path)!r}, num_prompts={len(self)})"


class _Longest(random.Random):
    """An rng whose every ``randint`` draw is the upper end (the longest prompt of a task)."""

    def randint(self, a: int, b: int) -> int:
        return b


def _check_num(num: int) -> None:
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")


def _load_jsonl(path: Path, tokenizer: CharTokenizer, default_reward: str) -> tuple[list[Prompt], list[int]]:
    """Parse and check every line; the first problem raises DatasetError naming path:line.
    Returns the prompts and their 1-based line numbers."""
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory; task.dataset names a JSONL file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read prompt file ({e.strerror or e})") from e
    prompts, lines = [], []
    for lineno, line_bytes in enumerate(raw.split(b"\n"), start=1):
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: not valid UTF-8 ({e.reason})") from e
        if not line.strip():
            continue
        try:
            prompts.append(_parse_line(line, tokenizer, default_reward))
        except ValueError as e:
            raise DatasetError(f"{path}:{lineno}: {e}") from e
        lines.append(lineno)
    if not prompts:
        raise DatasetError(f"{path}: no prompts (the file is empty or blank)")
    return prompts, lines


def _parse_line(line: str, tokenizer: CharTokenizer, default_reward: str) -> Prompt:
    """One JSONL line -> Prompt; raises ValueError describing the problem."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: "
                         f"{list(_REQUIRED_KEYS + _OPTIONAL_KEYS)}")
    for key in _REQUIRED_KEYS:
        if key not in record:
            raise ValueError(f"missing key {key!r}")
    for key in record:
        if not isinstance(record[key], str):
            raise ValueError(f"key {key!r} must be a string, got {type(record[key]).__name__}")
    if not record["prompt"]:
        raise ValueError("key 'prompt' is empty")
    reward = record.get("reward", default_reward)
    REWARDS.check(reward)
    task = record.get("task", "dataset")
    if not task:
        raise ValueError("key 'task' is empty")
    ids = {}
    for key in _REQUIRED_KEYS:
        try:
            ids[key] = tokenizer.encode(record[key], bos=(key == "prompt"))
        except ValueError as e:
            raise ValueError(f"key {key!r}: {e}") from e
    return Prompt(ids["prompt"], record["answer"], reward, task)
