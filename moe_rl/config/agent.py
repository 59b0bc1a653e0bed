"""``agent``: multi-turn tool environments (moe_rl/agentic/, docs/agentic.md). Empty
``agent.env`` (the default) is the single-turn prompt -> answer run; a name or ``module:Class``
turns every rollout into a conversation of assistant turns and tool replies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_rl.checks import check, check_finite, one_of

TOOL_FORMATS = ("auto", "qwen3", "compact")  # agent.tool_format


@dataclass(frozen=True)
class AgentConfig:
    # the environment: a built-in name (calculator | lookup) or module:Class; "" = single-turn tasks
    env: str = ""
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # handed to the environment's constructor
    # how tool calls are written: qwen3 (<tool_call>{json}</tool_call>, HF chat template with
    # tools) | compact (name:argument, for the 50-token char tokenizer) | auto (by the tokenizer)
    tool_format: str = "auto"
    max_turns: int = 4  # assistant turns per trajectory; a tool call in the last one ends it (max_turns)
    max_turn_tokens: int = 0  # new tokens per assistant turn; 0 = rollout.max_new_tokens
    max_total_tokens: int = 0  # prompt + every turn + tool replies; 0 = model.max_seq_len
    max_tool_tokens: int = 32  # tokens of one tool reply; longer: the model gets an error reply instead
    max_tool_tokens_total: int = 0  # tool-reply tokens per trajectory; 0 = no limit but max_total_tokens
    tool_timeout_s: float = 2.0  # wall time of one tool call; past it the model gets an error reply

    def __post_init__(self) -> None:
        check_finite(self, "agent")
        one_of(self.tool_format, "agent.tool_format", TOOL_FORMATS)
        check(self.max_turns >= 1, "agent.max_turns", f"must be >= 1 (got {self.max_turns})")
        for name in ("max_turn_tokens", "max_total_tokens", "max_tool_tokens_total"):
            check(getattr(self, name) >= 0, f"agent.{name}", f"must be >= 0 (got {getattr(self, name)})")
        check(
            self.max_tool_tokens >= 1, "agent.max_tool_tokens", f"must be >= 1 (got {self.max_tool_tokens})"
        )
        check(self.tool_timeout_s > 0, "agent.tool_timeout_s", f"must be > 0 (got {self.tool_timeout_s})")
        check(bool(self.env) or not self.env_kwargs, "agent.env_kwargs", "is set but agent.env is empty")


def check_agent(cfg: Any) -> None:
    """A run with ``agent.env`` set (``cfg``: the RunConfig): what the multi-turn loop does not run
    yet is refused by key (docs/agentic.md 5), and its token limits fit the model."""
    a, r, m = cfg.agent, cfg.rollout, cfg.model
    check(
        r.staleness == 0,
        "rollout.staleness",
        f"the simulated staleness does not take the multi-turn loop (agent.env={a.env}); "
        "parallel.rollout_ranks with rollout.mode=one_step_off or async give real staleness",
    )
    check(
        a.max_total_tokens <= m.max_seq_len,
        "agent.max_total_tokens",
        f"{a.max_total_tokens} is more than model.max_seq_len={m.max_seq_len}",
    )
    check(
        cfg.task.dataset == "" and cfg.log.val_every == 0,
        "task.dataset" if cfg.task.dataset else "log.val_every",
        f"the environment makes the prompts (agent.env={a.env}); task datasets and validation are "
        "single-turn only for now",
    )
