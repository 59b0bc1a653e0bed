"""Prompt sources: determinism by seed, task mixing, JSONL loading and its error messages."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from moe_rl.tasks import (
    DatasetError,
    GeneratedTasks,
    JsonlDataset,
    Prompt,
    PromptSource,
    build_prompt_source,
)
from moe_rl.tasks.tokenizer import CharTokenizer

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
    with pytest.raises(ValueError,
                       match=r"unknown task\(s\) \['revers'\]; known tasks: \[.*'reverse'"):
        GeneratedTasks(["revers"], 2, 5, TOK)
    with pytest.raises(ValueError, match="no tasks given"):
        GeneratedTasks([], 2, 5, TOK)
    with pytest.raises(ValueError, match=r"min_len \(3\) <= max_len \(2\)"):
        GeneratedTasks(["copy"], 3, 2, TOK)
    with pytest.raises(ValueError,
                       match=r"unknown reward 'bleu'; known: \['char_accuracy'"):
        GeneratedTasks(["copy"], 2, 3, TOK, reward="bleu")


# ---------------------------------------------------------------- JSONL

@pytest.mark.unit
def test_jsonl_loads_with_defaults_and_blank_lines(tmp_path: Path) -> None:
    lines = [
        GOOD,
        "",
        "   ",
        json.dumps({"prompt": "what is 2+2?", "answer": "4", "reward": "char_accuracy",
                    "task": "arith"}),
        json.dumps({"prompt": "S31:", "answer": ""}),
    ]
    ds = JsonlDataset(_write(tmp_path, lines), TOK, default_reward="exact_match")
    assert len(ds) == 3
    assert ds.task_names == ("dataset", "arith")
    p0, p1, p2 = ds.prompts
    assert p0 == Prompt(TOK.encode("R12:", bos=True), "21", "exact_match", "dataset")
    assert p1 == Prompt(TOK.encode("what is 2+2?", bos=True), "4", "char_accuracy", "arith")
    assert p2.answer == "" and p2.prompt_ids == [TOK.bos_id] + TOK.encode("S31:")


@pytest.mark.unit
def test_jsonl_sample_deterministic_and_covers_epochs(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"C{i}:", "answer": str(i)}) for i in range(10)]
    ds = JsonlDataset(_write(tmp_path, lines), TOK, "exact_match")
    a = ds.sample(10, seed=3)
    assert sorted(p.answer for p in a) == [str(i) for i in range(10)]  # one full permutation
    assert a == JsonlDataset(_write(tmp_path, lines), TOK, "exact_match").sample(10, seed=3)
    assert [p.answer for p in a] != [p.answer for p in ds.sample(10, seed=4)]
    many = ds.sample(25, seed=5)
    counts = Counter(p.answer for p in many)
    assert len(many) == 25 and all(2 <= n <= 3 for n in counts.values())  # epochs, no starving
    assert len({tuple(p.answer for p in ds.sample(3, seed=s)) for s in range(20)}) > 10


def _assert_line_error(tmp_path: Path, bad: str, line_no: int, match: str) -> None:
    lines = [GOOD] * (line_no - 1) + [bad, GOOD]
    path = _write(tmp_path, lines)
    with pytest.raises(DatasetError) as err:
        JsonlDataset(path, TOK, "exact_match")
    msg = str(err.value)
    assert msg.startswith(f"{path}:{line_no}: "), msg
    assert re.search(match, msg), msg
    assert isinstance(err.value, ValueError)


@pytest.mark.unit
@pytest.mark.parametrize("bad,match", [
    ('{"prompt": "R12:", "answer": "21"', r"invalid JSON"),
    ("not json", r"invalid JSON"),
    ('["R12:", "21"]', r"expected a JSON object, got list"),
    ('{"answer": "21"}', r"missing key 'prompt'"),
    ('{"prompt": "R12:"}', r"missing key 'answer'"),
    ('{"prompt": 12, "answer": "21"}', r"key 'prompt' must be a string, got int"),
    ('{"prompt": "R12:", "answer": 21}', r"key 'answer' must be a string, got int"),
    ('{"prompt": "R12:", "answer": null}', r"key 'answer' must be a string, got NoneType"),
    ('{"prompt": "R12:", "answer": "21", "reward": 1}', r"key 'reward' must be a string"),
    ('{"prompt": "R12:", "answer": "21", "reward": "bleu"}',
     r"unknown reward 'bleu'; known: \['char_accuracy', 'exact_match'"),
    ('{"prompt": "R12:", "answer": "21", "extra": "x"}', r"unknown key\(s\) \['extra'\]"),
    ('{"prompt": "", "answer": "21"}', r"key 'prompt' is empty"),
    ('{"prompt": "R12:", "answer": "21", "task": ""}', r"key 'task' is empty"),
    ('{"prompt": "R1X:", "answer": "21"}',
     r"key 'prompt': character 'X' at position 2 of 'R1X:' is not in the vocabulary"),
    ('{"prompt": "R12:", "answer": "2\\u00e91"}',
     r"key 'answer': character '\u00e9' at position 1"),
])
@pytest.mark.parametrize("line_no", [1, 4])
def test_jsonl_malformed_line_names_file_and_line(tmp_path: Path, bad: str, match: str,
                                                  line_no: int) -> None:
    _assert_line_error(tmp_path, bad, line_no, match)


@pytest.mark.unit
def test_jsonl_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, [GOOD, "", "", '{"prompt": "R12:"}'])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:4: missing key 'answer'$"):
        JsonlDataset(path, TOK, "exact_match")


@pytest.mark.unit
def test_jsonl_bad_utf8_missing_and_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}:2: not valid UTF-8"):
        JsonlDataset(path, TOK, "exact_match")
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(missing))}: cannot read prompt file"):
        JsonlDataset(missing, TOK, "exact_match")
    empty = _write(tmp_path, ["", "  "], name="empty.jsonl")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(empty))}: no prompts"):
        JsonlDataset(empty, TOK, "exact_match")


@pytest.mark.unit
def test_jsonl_unknown_default_reward(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown reward 'bleu'"):
        JsonlDataset(_write(tmp_path, [GOOD]), TOK, default_reward="bleu")


# ---------------------------------------------------------------- factory

@pytest.mark.unit
def test_build_prompt_source(tmp_path: Path) -> None:
    gen = build_prompt_source(["reverse", "copy"], 2, 4, "", "char_accuracy", TOK)
    assert isinstance(gen, GeneratedTasks)
    assert gen.tasks == ["reverse", "copy"] and (gen.min_len, gen.max_len) == (2, 4)
    assert {p.reward for p in gen.sample(8, 0)} == {"char_accuracy"}
    path = _write(tmp_path, [GOOD])
    ds = build_prompt_source(["reverse"], 2, 4, str(path), "char_accuracy", TOK)
    assert isinstance(ds, JsonlDataset)
    assert ds.sample(2, 0) == [Prompt(TOK.encode("R12:", bos=True), "21", "char_accuracy",
                                      "dataset")] * 2
    with pytest.raises(ValueError, match="unknown task"):
        build_prompt_source(["nope"], 2, 4, "", "exact_match", TOK)
