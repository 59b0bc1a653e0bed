"""The built-in environments and the prompt source that draws their tasks (docs/agentic.md 3).

Both write questions, tool arguments and replies in lowercase letters, digits and ``+-``, so they
run under the embedded char tokenizer as well as an HF one.

- ``calculator``: evaluate ``a + b - c ...`` (``num_ops`` operations, default 2) with the tool
  ``calc``, which takes at most ``max_ops_per_call`` operations (default 1): a task of 2 operations
  needs 2 calls. The tool parses with ``ast`` (``moe_rl.agentic.tools.calculate``), never ``eval``.
- ``lookup``: a two-hop question over a small generated corpus ("country of kiro": the person's
  city, then the city's country), with the tool ``lookup`` (an exact key, else the first entry
  containing the word): 2 calls.
"""

from __future__ import annotations

import random

from moe_rl.agentic.environment import ENVIRONMENTS, Environment, TaskRow, Tool
from moe_rl.agentic.formats import ToolFormat
from moe_rl.agentic.tools import calculate
from moe_rl.seeding import PROMPTS, step_seed
from moe_rl.types import Prompt

ENV_REWARD = "env"  # Prompt.reward of an environment's prompts: the environment scores them


@ENVIRONMENTS.register("calculator")
class Calculator(Environment):
    name = "calculator"
    system = "Compute the expression with the calc tool, one operation per call; answer with the number."

    def __init__(self, num_ops: int = 2, max_operand: int = 99, max_ops_per_call: int = 1) -> None:
        if num_ops < 1 or max_operand < 1 or max_ops_per_call < 0:
            raise TypeError("num_ops and max_operand must be >= 1, max_ops_per_call >= 0")
        self.num_ops, self.max_operand, self.max_ops_per_call = num_ops, max_operand, max_ops_per_call

    def generate(self, rng: random.Random) -> TaskRow:
        expr = str(rng.randint(0, self.max_operand))
        for _ in range(self.num_ops):
            expr += rng.choice("+-") + str(rng.randint(0, self.max_operand))
        return TaskRow(expr, str(calculate(expr)))

    def tools(self, task: TaskRow) -> tuple[Tool, ...]:
        def calc(expression: str) -> str:
            return str(calculate(expression, self.max_ops_per_call))

        return (Tool("calc", "Evaluate an integer expression (+ - * // %).", "expression", calc),)


_SYLLABLES = ("ka", "ri", "to", "mu", "ve", "lo", "sa", "ni", "pe", "zu", "da", "fi")


@ENVIRONMENTS.register("lookup")
class Lookup(Environment):
    name = "lookup"
    system = "Answer with the lookup tool: find the person's city, then the city's country."

    def __init__(self, people: int = 40, cities: int = 12, countries: int = 4, corpus_seed: int = 0) -> None:
        if min(people, cities, countries) < 1:
            raise TypeError("people, cities and countries must be >= 1")
        rng = random.Random(corpus_seed)
        names: list[str] = []
        while len(names) < people + cities + countries:  # distinct three-syllable words
            word = "".join(rng.choice(_SYLLABLES) for _ in range(3))
            if word not in names:
                names.append(word)
        self.people = names[:people]
        self.cities = names[people : people + cities]
        countries_ = names[people + cities :]
        self.city_of = {p: rng.choice(self.cities) for p in self.people}
        self.country_of = {c: rng.choice(countries_) for c in self.cities}
        self.corpus = {p: f"{p} lives in {c}" for p, c in self.city_of.items()}
        self.corpus |= {c: f"{c} is in {k}" for c, k in self.country_of.items()}

    def search(self, query: str) -> str:
        """The entry of ``query``, else the first entry containing it as a word, else a miss."""
        q = query.strip()
        if q in self.corpus:
            return self.corpus[q]
        hits = [text for text in self.corpus.values() if q in text.split()]
        return hits[0] if hits else f"no entry for {q}"

    def generate(self, rng: random.Random) -> TaskRow:
        person = rng.choice(self.people)
        return TaskRow(f"country of {person}", self.country_of[self.city_of[person]], {"person": person})

    def tools(self, task: TaskRow) -> tuple[Tool, ...]:
        return (Tool("lookup", "Look a word up in the corpus.", "query", self.search),)


class EnvPromptSource:
    """A ``PromptSource`` of an environment's tasks: per step and data-parallel rank, ``num`` tasks
    from ``random.Random(step_seed(run_seed, step, dp_rank, PROMPTS))``, rendered by the format.
    The task rides in ``Prompt.extra["env_task"]`` for the loop."""

    def __init__(self, env: Environment, fmt: ToolFormat) -> None:
        self.env, self.fmt = env, fmt
        self.task_names = (env.name,)

    def sample_step(self, step: int, num: int, dp_rank: int, dp_size: int, run_seed: int) -> list[Prompt]:
        rng = random.Random(step_seed(run_seed, step, dp_rank, PROMPTS))
        out = []
        for _ in range(num):
            task = self.env.generate(rng)
            ids = self.fmt.prompt_ids(self.env.reset(task), self.env.tools(task))
            out.append(Prompt(ids, task.answer, ENV_REWARD, self.env.name, task.question, {"env_task": task}))
        return out
