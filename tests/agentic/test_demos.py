"""unit tier, issue 44 point 2: the expert transcripts the agent warm start is supervised on are
the loop's own token sequences of a right solver (each call runs, the answer scores 1), and
``init_weights=builtin:warmstart`` means the agent warm start exactly when ``agent.env`` is set."""

from __future__ import annotations

import random

import pytest

from moe_rl.agentic.demos import demo_sequence, demo_turns
from moe_rl.agentic.envs import Calculator, Lookup
from moe_rl.agentic.formats import CompactFormat
from moe_rl.agentic.tools import ToolRunner
from moe_rl.config import load_config
from moe_rl.tasks.task import build_task
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.weights.warmstart import builtin_path, info

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("env", [Calculator(), Lookup()], ids=["calculator", "lookup"])
def test_a_demonstration_is_the_loops_sequence_of_a_right_solver(env):
    tok = CharTokenizer()
    fmt = CompactFormat(tok)
    rng = random.Random(5)
    for _ in range(20):
        task = env.generate(rng)
        turns = demo_turns(env, task)
        ids, mask = demo_sequence(env, task, fmt)
        # played through the environment as the loop plays a model's turns: 2 calls, no error, reward 1
        run = ToolRunner(env.tools(task), 1.0, 32, fmt.count_tokens)
        expect = fmt.prompt_ids(env.reset(task), env.tools(task))
        for i, (turn, reply) in enumerate(turns):
            step = env.step(task, fmt.parse(turn, env.tools(task)), run)
            expect += tok.encode(turn) + [tok.eos_id]
            if i == len(turns) - 1:
                assert step.done and step.reward == 1.0
            else:
                assert not step.done and [(r.content, r.error) for r in step.replies] == [(reply, "")]
                expect += fmt.reply_ids(step.replies)
        assert len(turns) == 3 and ids == expect and len(mask) == len(ids)
        # the mask covers exactly the assistant turns and their eos
        said = [t for t, m in zip(ids, mask) if m]
        assert said == [t for turn, _ in turns for t in tok.encode(turn) + [tok.eos_id]]


def test_calculator_demonstration_by_its_text():
    env = Calculator()
    task = env.generate(random.Random(3))  # 30+47-80 (tests/agentic/test_environments.py)
    ids, mask = demo_sequence(env, task, CompactFormat(CharTokenizer()))
    tok = CharTokenizer()
    text = "".join(tok.decode([t]) if t != tok.eos_id else "|" for t in ids[1:])
    assert text == "30+47-80:calc:30+47|>77?calc:77-80|>-3?=-3|"
    assert sum(mask) == len("calc:30+47|calc:77-80|=-3|")


def test_builtin_warmstart_means_the_agent_one_with_agent_env():
    def init(*overrides: str) -> str:
        return build_task(load_config(None, list(overrides)), start_pool=False)[0].init_weights

    assert init() == "builtin:warmstart"
    assert init("agent.env=calculator") == "builtin:warmstart_agent"
    assert init("agent.env=lookup", "init_weights=builtin:warmstart") == "builtin:warmstart_agent"
    path = str(builtin_path())
    assert init("agent.env=calculator", f"init_weights={path}") == path  # a path is kept as given
    assert init("agent.env=calculator", "init_weights=") == ""
    # the shipped agent warm start records the recipe's stopping numbers (docs/agentic.md 7)
    made = info(builtin_path("builtin:warmstart_agent"))
    assert made["calculator_tool_success"] >= 0.9 and made["lookup_tool_success"] >= 0.9
    assert 0.3 <= made["calculator_reward"] < 0.6
