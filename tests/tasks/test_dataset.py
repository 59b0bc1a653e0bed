"""Prompt sources: determinism by seed, task mixing, the factory (row files: test_rows.py)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from moe_rl.tasks.dataset import GeneratedTasks, PromptSource
from moe_rl.tasks.rows import RowDataset
from moe_rl.tasks.task import build_prompt_source
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.types import Prompt

TOK = CharTokenizer()


def _write(tmp_path: Path, lines: list[str], name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"prompt": "R12:", "answer": "21"})


# ---------------------------------------------------------------- generated tasks


@pytest.mark.unit
def test_generated_sample_is_deterministic_and_seed_dependent() -> None:
    src = GeneratedTasks(["reverse", "sort", "copy"], 2, 5, TOK)
    random.seed(0)
    torch.manual_seed(0)
    a = src.sample(64, seed=7)
    random.seed(99)
    torch.manual_seed(99)
    _ = random.random(), torch.rand(3)
    b = GeneratedTasks(["reverse", "sort", "copy"], 2, 5, TOK).sample(64, seed=7)
    assert a == b
    c = src.sample(64, seed=8)
    assert a != c
    assert sum(x != y for x, y in zip(a, c)) > 50
    assert src.sample(10, seed=7) == a[:10]  # a prefix: same stream for the same seed
    assert src.sample(0, seed=7) == []
    with pytest.raises(ValueError, match="num must be >= 0"):
        src.sample(-1, seed=7)


@pytest.mark.unit
def test_generated_prompts_are_consistent() -> None:
    src = GeneratedTasks(["reverse", "sort", "copy"], 2, 5, TOK, reward="char_accuracy")
    assert isinstance(src, PromptSource)
    prompts = src.sample(600, seed=1)
    counts = Counter(p.task for p in prompts)
    assert set(counts) == {"reverse", "sort", "copy"}
    assert all(150 <= n <= 250 for n in counts.values()), counts  # uniform mix
    for p in prompts:
        assert isinstance(p, Prompt)
        assert p.prompt_ids[0] == TOK.bos_id and TOK.bos_id not in p.prompt_ids[1:]
        text = TOK.decode(p.prompt_ids)
        digits = text[1:-1]
        assert text[0] == {"reverse": "R", "sort": "S", "copy": "C"}[p.task]
        assert text[-1] == ":" and digits.isdigit() and 2 <= len(digits) <= 5
        expected = {"reverse": digits[::-1], "sort": "".join(sorted(digits)), "copy": digits}
        assert p.answer == expected[p.task]
        assert p.reward == "char_accuracy"


@pytest.mark.unit
def test_generated_single_task_and_validation() -> None:
    prompts = GeneratedTasks(["sort"], 3, 3, TOK).sample(20, seed=0)
    assert GeneratedTasks(["sort", "copy", "sort"], 2, 5, TOK).task_names == ("sort", "copy")
    assert {p.task for p in prompts} == {"sort"}
    assert all(len(p.prompt_ids) == 1 + 1 + 3 + 1 for p in prompts)
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['revers'\]; known tasks: \[.*'reverse'"):
        GeneratedTasks(["revers"], 2, 5, TOK)
    with pytest.raises(ValueError, match="no tasks given"):
        GeneratedTasks([], 2, 5, TOK)
    with pytest.raises(ValueError, match=r"min_len \(3\) <= max_len \(2\)"):
        GeneratedTasks(["copy"], 3, 2, TOK)
    with pytest.raises(ValueError, match=r"unknown reward 'bleu'; known: \['char_accuracy'"):
        GeneratedTasks(["copy"], 2, 3, TOK, reward="bleu")


# ---------------------------------------------------------------- factory


@pytest.mark.unit
def test_build_prompt_source(tmp_path: Path) -> None:
    gen = build_prompt_source(["reverse", "copy"], 2, 4, "", "char_accuracy", TOK)
    assert isinstance(gen, GeneratedTasks)
    assert gen.tasks == ["reverse", "copy"] and (gen.min_len, gen.max_len) == (2, 4)
    assert {p.reward for p in gen.sample(8, 0)} == {"char_accuracy"}
    path = _write(tmp_path, [GOOD])
    ds = build_prompt_source(["reverse"], 2, 4, str(path), "char_accuracy", TOK)
    assert isinstance(ds, RowDataset)
    assert (
        ds.sample_step(0, 2, 0, 1, 0)
        == [Prompt(TOK.encode("R12:", bos=True), "21", "char_accuracy", "dataset", text="R12:")] * 2
    )
    with pytest.raises(ValueError, match="unknown task"):
        build_prompt_source(["nope"], 2, 4, "", "exact_match", TOK)
