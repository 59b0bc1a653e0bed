"""Expert transcripts of the built-in environments: what the agent warm start is supervised on
(``scripts/make_warmstart.py --agent``, docs/agentic.md 7).

A demonstration is the token sequence the multi-turn loop would build for a solver that always
calls right: the format's prompt, then each assistant turn (its text and the eos that stops it)
and the tool reply the environment's own tool gives, appended as the loop appends it, up to the
``=answer`` turn. The mask is true on the assistant tokens (and their eos), as the loop's loss mask.

- ``calculator``: one call per operation, left to right (``calc:12+34``, ``>46?``,
  ``calc:46-5``, ``>41?``, ``=41``); the environment's ``max_ops_per_call`` must be 1.
- ``lookup``: the person's entry, then the city's (``lookup:kiro``, ``>kiro lives in tosa?``,
  ``lookup:tosa``, ``>tosa is in mu?``, ``=mu``).
"""

from __future__ import annotations

import re

from moe_rl.agentic.environment import Environment, TaskRow, ToolResult
from moe_rl.agentic.envs import Calculator, Lookup
from moe_rl.agentic.formats import CompactFormat


def _call(env: Environment, task: TaskRow, name: str, arg: str) -> str:
    tool = {t.name: t for t in env.tools(task)}[name]
    return str(tool.fn(**{tool.parameter: arg}))


def demo_turns(env: Environment, task: TaskRow) -> list[tuple[str, str]]:
    """(assistant turn, tool reply) in order; the last turn is ``=answer`` with reply ""."""
    if isinstance(env, Calculator):
        if env.max_ops_per_call != 1:
            raise ValueError("calculator demonstrations make one call per operation (max_ops_per_call=1)")
        first, *rest = re.findall(r"[+-]|\d+", task.question)
        acc, turns = first, []
        for op, num in zip(rest[::2], rest[1::2], strict=True):
            turn = f"calc:{acc}{op}{num}"
            acc = _call(env, task, "calc", turn[5:])
            turns.append((turn, acc))
    elif isinstance(env, Lookup):
        person = task.data["person"]
        city = env.city_of[person]
        turns = [
            (f"lookup:{person}", _call(env, task, "lookup", person)),
            (f"lookup:{city}", _call(env, task, "lookup", city)),
        ]
        acc = env.country_of[city]
    else:
        raise ValueError(f"no demonstrations for the environment {env.name!r}")
    return [*turns, (f"={acc}", "")]


def demo_sequence(env: Environment, task: TaskRow, fmt: CompactFormat) -> tuple[list[int], list[bool]]:
    """The whole demonstration's token ids and its loss mask (true on assistant tokens)."""
    tools = env.tools(task)
    ids = fmt.prompt_ids(env.reset(task), tools)
    mask = [False] * len(ids)
    for turn, reply in demo_turns(env, task):
        said = fmt.tok.encode(turn) + [fmt.tok.eos_id]
        ids += said
        mask += [True] * len(said)
        if not turn.startswith("="):
            back = fmt.reply_ids((ToolResult(turn.partition(":")[0], reply),))
            ids += back
            mask += [False] * len(back)
    return ids, mask
