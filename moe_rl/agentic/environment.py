"""The environment interface of the multi-turn loop (docs/agentic.md 2) and its registry.

An environment owns its tasks (a data generator), its tools and its reward. The loop
(``moe_rl.agentic.loop``) renders ``reset``'s messages into the prompt, samples an assistant turn,
parses its tool calls in the configured format and hands the parsed message to ``step``, which
answers with tool replies (run through the loop's ``ToolRunner``, so every limit is enforced in one
place) or ends the trajectory with a reward.

``agent.env`` names a built-in environment (``ENVIRONMENTS``) or ``module:Class`` (a subclass of
``Environment`` importable from the run's Python path); ``agent.env_kwargs`` go to its constructor.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moe_rl.registry import Registry


@dataclass(frozen=True)
class Tool:
    """One tool the model may call: ``fn(**arguments)`` must return a str (else the model gets an
    error reply). ``parameter`` names the argument the compact format's ``name:argument`` fills."""

    name: str
    description: str
    parameter: str
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema ``apply_chat_template(messages, tools=...)`` renders."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {self.parameter: {"type": "string"}},
                    "required": [self.parameter],
                },
            },
        }


@dataclass(frozen=True)
class TaskRow:
    """One generated task: the question the user asks, the reference answer, and whatever else the
    environment's tools or reward need (e.g. the facts of a lookup task)."""

    question: str
    answer: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class AssistantMessage:
    """One parsed assistant turn: its text without the tool calls, the calls, and the calls that
    did not parse (each gets an error reply, counted as ``malformed``). ``answer``: the turn is a
    final answer (no call, nothing malformed)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    malformed: tuple[str, ...] = ()

    @property
    def answer(self) -> bool:
        return not self.calls and not self.malformed


@dataclass(frozen=True)
class ToolResult:
    """A tool reply as the model sees it; ``error``: why the call failed ("" = it succeeded)."""

    name: str
    content: str
    error: str = ""


@dataclass(frozen=True)
class EnvStep:
    """What ``step`` returns: the tool replies of this turn, or done with a reward."""

    replies: tuple[ToolResult, ...] = ()
    done: bool = False
    reward: float = 0.0


class Environment:
    """Base class: override ``generate``, ``tools`` and ``score`` (and ``reset``/``step`` when a
    task needs more than "answer the question with these tools")."""

    name = "env"
    system = ""  # the system message (empty: none)

    def generate(self, rng: random.Random) -> TaskRow:
        """One task, drawn from ``rng`` only (the prompt source seeds it per step and rank)."""
        raise NotImplementedError

    def tools(self, task: TaskRow) -> tuple[Tool, ...]:
        raise NotImplementedError

    def score(self, task: TaskRow, answer: str) -> float:
        """The reward of a final answer (the trajectory's only reward)."""
        return float(answer.strip() == task.answer)

    def reset(self, task: TaskRow) -> list[dict[str, str]]:
        """The prompt's chat messages."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": task.question}]

    def step(
        self, task: TaskRow, message: AssistantMessage, run: Callable[[ToolCall], ToolResult]
    ) -> EnvStep:
        """A final answer ends the trajectory with its score; otherwise every call is run (``run``:
        the loop's ``ToolRunner`` on this task's tools) and each malformed call gets its error."""
        if message.answer:
            return EnvStep(done=True, reward=self.score(task, message.content))
        replies = [ToolResult("", f"error: {why}", "malformed") for why in message.malformed]
        return EnvStep(tuple(replies) + tuple(run(c) for c in message.calls))


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment")
