"""unit tier, issue 44 point 1: the built-in environments' tasks need two tool calls (one call
cannot solve them; two scripted calls and the answer earn reward 1), played through the compact
format and the loop's tool runner exactly as a model's turns would be; and the qwen3 format runs
the loop on the built-in engine with an HF tokenizer and checkpoint."""

from __future__ import annotations

import random

import pytest

from moe_rl.agentic.environment import ToolResult
from moe_rl.agentic.envs import Calculator, Lookup
from moe_rl.agentic.formats import CompactFormat
from moe_rl.agentic.tools import ToolRunner
from moe_rl.tasks.tokenizer import CharTokenizer

pytestmark = pytest.mark.unit


def _play(env, task, turns: list[str]) -> tuple[list[str], float, bool]:
    """The replies the model would read and the reward, for scripted assistant turns."""
    fmt = CompactFormat(CharTokenizer())
    run = ToolRunner(env.tools(task), 1.0, 32, fmt.count_tokens)
    replies = []
    for text in turns:
        step = env.step(task, fmt.parse(text, env.tools(task)), run)
        if step.done:
            return replies, step.reward, True
        replies.append(CharTokenizer().decode(fmt.reply_ids(step.replies)))
    return replies, 0.0, False


def test_calculator_tasks_need_two_calls():
    env = Calculator()
    task = env.generate(random.Random(3))
    assert (task.question, task.answer) == ("30+47-80", "-3")
    assert _play(env, task, ["calc:30+47-80"]) == ([">error raised?"], 0.0, False)  # 2 operations refused
    assert _play(env, task, ["calc:30+47", "calc:77-80", "=-3"]) == ([">77?", ">-3?"], 1.0, True)
    assert _play(env, task, ["=3"])[1:] == (0.0, True)
    assert _play(env, task, ["calc:__import__"]) == ([">error raised?"], 0.0, False)


def test_lookup_tasks_need_two_calls():
    env = Lookup()
    task = env.generate(random.Random(3))
    person = task.data["person"]
    city, country = env.city_of[person], env.country_of[env.city_of[person]]
    assert task.question == f"country of {person}" and task.answer == country
    replies, reward, done = _play(env, task, [f"lookup:{person}", f"lookup:{city}", f"={country}"])
    assert (replies, reward, done) == (
        [f">{person} lives in {city}?", f">{city} is in {country}?"],
        1.0,
        True,
    )
    assert _play(env, task, ["lookup:zzz"])[0] == [">no entry for zzz?"]
    assert _play(env, task, ["search:x"])[0] == [">error unknown tool?"]
    assert len(env.corpus) == 40 + 12 and all(len(w) == 6 for w in env.people)


def test_qwen3_format_runs_the_loop_with_an_hf_tokenizer(hf_qwen3_checkpoint):
    """A user environment by module:Class that replies to wrong answers: with every token a stop
    token each turn is one sampled token, so every trajectory is exactly prompt, (token, reply) x 2,
    token, the replies appended as the chat template writes them, on the built-in engine."""
    import dataclasses

    from moe_rl.config import load_config
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.step.plan import sampling_params
    from moe_rl.tasks.task import build_task
    from moe_rl.weights.warmstart import load_init_weights

    cfg = load_config(
        None,
        [
            "agent.env=tests.agentic.retry_env:Retry",
            f"init_weights=hf:{hf_qwen3_checkpoint}",
            "model.max_seq_len=512",
            "rollout.max_new_tokens=6",
            "agent.max_turns=3",
        ],
    )
    cfg, task = build_task(cfg, start_pool=False)
    loop, tok = task.agent, task.tokenizer
    engine = BuiltinEngine(cfg.model, pad_id=tok.pad_id)
    engine.load_weights(load_init_weights(cfg.init_weights, cfg.model, tok))
    prompts = task.source.sample_step(0, 2, 0, 1, 7)
    sampling = dataclasses.replace(sampling_params(cfg), stop_token_ids=tuple(range(cfg.model.vocab_size)))
    b = loop.rollout(engine, prompts, 2, sampling, 5)
    m = b.engine_metrics
    reply = tok.encode(loop.fmt.reply_text((ToolResult("grader", "wrong, try again"),)))
    assert m["agent/end/max_turns"].value == 4 and m["agent/turns_mean"].sum == 12  # no sampled "7"
    assert m["agent/assistant_tokens"].value == 12 and m["agent/tool_tokens"].value == 8 * len(reply)
    for i in range(4):
        P = len(prompts[i // 2].prompt_ids)
        T = int(b.prompt_lens_B[i] + b.response_lens_B[i])
        assert T == P + 3 + 2 * len(reply) and b.tokens_BS[i, :P].tolist() == prompts[i // 2].prompt_ids
        ids = b.tokens_BS[i, :T].tolist()
        r0, r1 = P + 1, P + 2 + len(reply)
        assert ids[r0 : r0 + len(reply)] == reply and ids[r1 : r1 + len(reply)] == reply
        assert b.response_mask_BS[i, :T].nonzero().flatten().tolist() == [P, r0 + len(reply), T - 1]
        assert b.turn_BS[i, :T].tolist() == [0] * P + [1] * (1 + len(reply)) + [2] * (1 + len(reply)) + [3]
        assert b.routes[i].shape[0] == T - 1
