"""A user environment for the tests, named by ``agent.env=tests.agentic.retry_env:Retry``: a wrong
final answer gets a reply ("wrong, try again") instead of ending the trajectory, so even a model
that never writes a tool call has several turns."""

from __future__ import annotations

import random

from moe_rl.agentic.environment import Environment, EnvStep, TaskRow, Tool, ToolResult


class Retry(Environment):
    name = "retry"

    def __init__(self, answer: str = "7") -> None:
        self.answer = answer

    def generate(self, rng: random.Random) -> TaskRow:
        return TaskRow(f"say {self.answer} after {rng.randint(0, 9)}", self.answer)

    def tools(self, task: TaskRow) -> tuple[Tool, ...]:
        return (Tool("noop", "Does nothing.", "text", lambda text: text),)

    def step(self, task, message, run) -> EnvStep:
        if message.answer and message.content.strip() != task.answer:
            return EnvStep((ToolResult("grader", "wrong, try again"),))
        return super().step(task, message, run)
