"""Generated verifiable tasks: a registry of (prompt text, answer text) generators.

Every prompt is one uppercase task tag, the task's digits, and a closing ``:``; the answer is a
digit string (the model must emit eos after it; the answer text excludes eos). Formats, with n
digits where n is drawn uniformly from [min_len, max_len]:

    reverse  "R3142:"   -> "2413"   the digits reversed
    sort     "S3142:"   -> "1234"   the digits sorted ascending
    copy     "C3142:"   -> "3142"   the digits unchanged
    add      "A42+315:" -> "357"    sum of two operands of n1, n2 digits (no leading zeros)

reverse, sort and copy are the default mix: short answers that RL moves within minutes on the tiny
CPU model (see docs/design.md 10). add is opt-in; on the
tiny model it barely learns.

Each generator takes ``(rng, min_len, max_len)`` where rng is a ``random.Random`` or a
``torch.Generator``; the output depends only on the rng state, never on global RNG state.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from moe_rl.registry import Registry

Rng = random.Random | torch.Generator
TaskFn = Callable[[Rng, int, int], tuple[str, str]]

TASKS: Registry[TaskFn] = Registry("task")
register_task = TASKS.register


def randint(rng: Rng, low: int, high: int) -> int:
    """Uniform integer in [low, high] (both inclusive) from either kind of rng."""
    if isinstance(rng, torch.Generator):
        return int(torch.randint(low, high + 1, (1,), generator=rng))
    return rng.randint(low, high)


def check_lengths(min_len: int, max_len: int) -> None:
    """Raise ValueError unless 1 <= min_len <= max_len."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len})")


def random_digits(rng: Rng, min_len: int, max_len: int) -> str:
    """A digit string of uniform length in [min_len, max_len], leading zeros allowed."""
    check_lengths(min_len, max_len)
    n = randint(rng, min_len, max_len)
    return "".join(str(randint(rng, 0, 9)) for _ in range(n))


def random_number(rng: Rng, min_len: int, max_len: int) -> str:
    """A decimal number of uniform digit count in [min_len, max_len], no leading zero."""
    check_lengths(min_len, max_len)
    n = randint(rng, min_len, max_len)
    first = randint(rng, 0 if n == 1 else 1, 9)
    return str(first) + "".join(str(randint(rng, 0, 9)) for _ in range(n - 1))


@register_task("reverse")
def reverse_digits(rng: Rng, min_len: int, max_len: int) -> tuple[str, str]:
    """ "R" + digits + ":" -> the digits reversed."""
    digits = random_digits(rng, min_len, max_len)
    return f"R{digits}:", digits[::-1]


@register_task("sort")
def sort_digits(rng: Rng, min_len: int, max_len: int) -> tuple[str, str]:
    """ "S" + digits + ":" -> the digits sorted ascending."""
    digits = random_digits(rng, min_len, max_len)
    return f"S{digits}:", "".join(sorted(digits))


@register_task("copy")
def copy_digits(rng: Rng, min_len: int, max_len: int) -> tuple[str, str]:
    """ "C" + digits + ":" -> the same digits."""
    digits = random_digits(rng, min_len, max_len)
    return f"C{digits}:", digits


@register_task("add")
def add_numbers(rng: Rng, min_len: int, max_len: int) -> tuple[str, str]:
    """ "A" + a + "+" + b + ":" -> str(a + b); a and b have min_len..max_len digits each."""
    a = random_number(rng, min_len, max_len)
    b = random_number(rng, min_len, max_len)
    return f"A{a}+{b}:", str(int(a) + int(b))
