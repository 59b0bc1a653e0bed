"""A run's agent side from its config (``agent.*``): the environment, the tool format, the loop and
the prompt source; and the step's reward metrics from the environment's rewards. ``build_agent``
runs in preflight (``moe_rl.tasks.task.build_task``), so a bad ``agent.env`` is one ``error:`` line
before any rank starts."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import torch

from moe_rl.agentic.environment import ENVIRONMENTS, Environment
from moe_rl.agentic.envs import EnvPromptSource
from moe_rl.agentic.formats import tool_format
from moe_rl.agentic.loop import AgentLoop
from moe_rl.config import RunConfig
from moe_rl.config.route_verify import verify_every
from moe_rl.errors import ConfigError
from moe_rl.metrics import Mean, Std
from moe_rl.routing.verify import VerifyPlan
from moe_rl.types import Prompt, RolloutBatch


class Agent(NamedTuple):
    loop: AgentLoop
    source: EnvPromptSource


def build_agent(cfg: RunConfig, tok) -> Agent:
    a = cfg.agent
    env = resolve_environment(a.env, dict(a.env_kwargs))
    fmt = tool_format(a.tool_format, tok, dict(cfg.task.chat_template_kwargs))
    loop = AgentLoop(env, fmt, a, cfg.rollout.max_new_tokens, cfg.model.max_seq_len)
    v = cfg.routing.verify
    every = verify_every(cfg)
    if every:
        layers = tuple(cfg.model.moe_layers)
        loop.verify = VerifyPlan(every, v.samples, v.margin, layers, a.max_turns)
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


def resolve_environment(spec: str, kwargs: dict[str, Any]) -> Environment:
    """``agent.env`` -> the environment. A built-in name, or ``module:Class``; anything that does
    not import, is no ``Environment`` subclass or whose constructor refuses ``kwargs`` is a
    ConfigError naming ``agent.env`` (one ``error:`` line, before any rank starts)."""
    if ":" not in spec:
        if spec not in ENVIRONMENTS:
            raise ConfigError(
                f"config key 'agent.env': unknown environment {spec!r}; known: {sorted(ENVIRONMENTS)} "
                "or module:Class"
            )
        cls = ENVIRONMENTS[spec]
    else:
        module, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (Exception, SystemExit) as e:  # whatever the user's module raises on import: named
            why = str(e).splitlines()[0] if str(e) else ""
            raise ConfigError(
                f"config key 'agent.env': {spec} does not import: {type(e).__name__}: {why}"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ConfigError(
                f"config key 'agent.env': {spec} is a {type(cls).__name__}, not a subclass of "
                "moe_rl.agentic.environment.Environment"
            )
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"config key 'agent.env_kwargs': {spec} refuses {sorted(kwargs)}: {e}") from None
