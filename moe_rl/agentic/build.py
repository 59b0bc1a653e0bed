"""A run's agent side from its config (``agent.*``): the environment, the tool format, the loop and
the prompt source; and the step's reward metrics from the environment's rewards. ``build_agent``
runs in preflight (``moe_rl.tasks.task.build_task``), so a bad ``agent.env`` is one ``error:`` line
before any rank starts."""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_rl.agentic.env import resolve_environment
from moe_rl.agentic.envs import EnvPromptSource
from moe_rl.agentic.formats import tool_format
from moe_rl.agentic.loop import AgentLoop
from moe_rl.config import RunConfig
from moe_rl.metrics import Mean, Std
from moe_rl.types import Prompt, RolloutBatch


class Agent(NamedTuple):
    loop: AgentLoop
    source: EnvPromptSource


def build_agent(cfg: RunConfig, tok) -> Agent:
    a = cfg.agent
    env = resolve_environment(a.env, dict(a.env_kwargs))
    fmt = tool_format(a.tool_format, tok, dict(cfg.task.chat_template_kwargs))
    loop = AgentLoop(env, fmt, a, cfg.rollout.max_new_tokens, cfg.model.max_seq_len)
    return Agent(loop, EnvPromptSource(env, fmt))


def env_rewards(batch: RolloutBatch, prompts: list[Prompt], n: int) -> tuple[torch.Tensor, dict]:
    """The environment's rewards and ``reward/mean``, ``reward/std``, ``reward/mean/<env>``."""
    r_B = batch.env_reward_B
    r64_B = r_B.to(torch.float64)
    count = float(r_B.numel())
    mean = Mean(r64_B.sum(), count)
    task = prompts[0].task if prompts else "env"
    return r_B, {
        "reward/mean": mean,
        "reward/std": Std(r64_B.sum(), (r64_B * r64_B).sum(), count),
        f"reward/mean/{task}": mean,
    }
