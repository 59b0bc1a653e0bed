"""``moe-rl data make-math OUT``: a file of generated arithmetic word problems with ground-truth
answers, in the peers' row formats, so a new user can try the HF path without downloading a data set.

- ``--style verl`` (default): ``{"data_source": "arith_words", "prompt": [{"role": "user", "content":
  ...}], "reward_model": {"style": "rule", "ground_truth": "16"}, "extra_info": {"index": i}}``;
  train with ``task.answer_key=reward_model.ground_truth`` (the chat prompts go through the template:
  ``task.apply_chat_template=auto``, the default).
- ``--style slime``: ``{"input": ..., "label": "16", "data_source": "arith_words"}``; train with
  ``task.prompt_key=input task.answer_key=label``.

``OUT`` ending in ``.parquet`` is written with pyarrow's Parquet writer, ``.jsonl`` / ``.json`` as
JSONL; any other suffix is refused (``task.dataset`` would not read it). Problems are
one to three operations on small integers (answers may be negative), each asking for the answer in
``\\boxed{}``; the output is a pure function of (num, seed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from moe_rl.errors import DataError, DiskFullError, disk_full_named
from moe_rl.tasks.rows import PROMPT_SUFFIXES

SOURCE = "arith_words"
NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "shells")
INSTRUCTION = "Put the final answer in \\boxed{}."


def word_problem(rng: random.Random) -> tuple[str, int]:
    """One problem text and its integer answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(2, 20)
    text = f"{name} has {total} {item}."
    for _ in range(rng.randint(1, 3)):
        op, n = rng.choice(("buys", "gives away", "doubles")), rng.randint(1, 12)
        if op == "buys":
            text, total = text + f" Then {name} buys {n} more.", total + n
        elif op == "gives away":
            text, total = text + f" Then {name} gives away {n}.", total - n
        else:
            text, total = text + f" Then {name} doubles them.", total * 2
    return f"{text} How many {item} does {name} have now? {INSTRUCTION}", total


def make_rows(num: int, seed: int, style: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        question, answer = word_problem(rng)
        if style == "verl":
            rows.append(
                {
                    "data_source": SOURCE,
                    "prompt": [{"role": "user", "content": question}],
                    "reward_model": {"style": "rule", "ground_truth": str(answer)},
                    "extra_info": {"index": i},
                }
            )
        elif style == "slime":
            rows.append({"input": question, "label": str(answer), "data_source": SOURCE})
        else:
            raise ValueError(f"unknown style {style!r}; use verl or slime")
    return rows


def write_math_dataset(out: str | Path, num: int, seed: int = 0, style: str = "verl") -> Path:
    """Write ``num`` problems to ``out`` (.parquet, else JSONL); refuses to overwrite."""
    out = Path(out)
    if out.suffix not in PROMPT_SUFFIXES:  # train would refuse the file: say so before writing it
        raise DataError(
            f"{out}: unknown prompt file type {out.suffix!r}; make-math writes what task.dataset "
            f"reads: {', '.join(PROMPT_SUFFIXES)}"
        )
    if out.exists():
        raise DataError(f"{out} already exists; make-math never overwrites")
    if num < 1:
        raise DataError(f"--num must be >= 1, got {num}")
    rows = make_rows(num, seed, style)
    try:
        with disk_full_named(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.suffix == ".parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist(rows), str(out))
            else:
                out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    except DiskFullError:
        out.unlink(missing_ok=True)  # no half-written data set left behind
        raise
    return out
