"""Prompt rows from JSONL and Parquet (verl, slime and the built-in conventions), the errors naming
file, row and key, length filtering, and epoch sampling without replacement."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.errors import DataError
from moe_rl.tasks.hf_tokenizer import HFTokenizer
from moe_rl.tasks.make_data import make_rows, write_math_dataset
from moe_rl.tasks.rows import RowDataset, RowSpec
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.types import Prompt

CHAR = CharTokenizer()
VERL = RowSpec(
    answer_key="reward_model.ground_truth",
    default_reward="math",
    apply_chat_template=True,
    chat_template_kwargs={"enable_thinking": False},
)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.unit
def test_verl_parquet_with_chat_template(tmp_path: Path, hf_tok_dir: Path) -> None:
    tok = HFTokenizer(hf_tok_dir)
    path = write_math_dataset(tmp_path / "train.parquet", 5, seed=3)
    rows = pq.read_table(str(path)).to_pylist()
    ds = RowDataset(path, VERL, tok)
    assert len(ds) == 5 and ds.num_dropped == 0 and ds.task_names == ("arith_words",)
    p = ds.prompts[0]
    question = rows[0]["prompt"][0]["content"]
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert p == Prompt(
        tok.encode(text),
        rows[0]["reward_model"]["ground_truth"],
        "math",
        "arith_words",
        text=text,
        extra={"data_source": "arith_words", "extra_info": {"index": 0}},
    )


@pytest.mark.unit
def test_slime_jsonl_string_prompt_through_the_template(tmp_path: Path, hf_tok_dir: Path) -> None:
    tok = HFTokenizer(hf_tok_dir)
    path = write_math_dataset(tmp_path / "train.jsonl", 4, seed=3, style="slime")
    spec = RowSpec(
        prompt_key="input", answer_key="label", apply_chat_template=True, add_generation_prompt=False
    )
    ds = RowDataset(path, spec, tok)
    first = make_rows(4, 3, "slime")[0]
    assert ds.prompts[0].text == f"<|im_start|>user\n{first['input']}<|im_end|>\n"
    assert ds.prompts[0].answer == first["label"] and ds.prompts[0].reward == "exact_match"
    raw = RowDataset(
        path, RowSpec(prompt_key="input", answer_key="label"), tok
    )  # no template: the text as is
    assert raw.prompts[0].prompt_ids == tok.encode(first["input"]) and raw.prompts[0].text == first["input"]


@pytest.mark.unit
def test_builtin_format_numbers_and_per_row_reward(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "R12:", "answer": "21", "task": "rev"},
            {"prompt": "C7:", "answer": 7, "reward": "char_accuracy"},
            "",
        ],
    )
    ds = RowDataset(path, RowSpec(source_key="task"), CHAR)
    assert ds.prompts == [
        Prompt(CHAR.encode("R12:", bos=True), "21", "exact_match", "rev", text="R12:", extra={"task": "rev"}),
        Prompt(
            CHAR.encode("C7:", bos=True),
            "7",
            "char_accuracy",
            "dataset",
            text="C7:",
            extra={"reward": "char_accuracy"},
        ),
    ]
    assert ds.task_names == ("rev", "dataset")


def _error(tmp_path: Path, bad, spec: RowSpec = RowSpec(), tok=CHAR, name: str = "p.jsonl") -> str:
    path = _jsonl(tmp_path / name, [{"prompt": "R1:", "answer": "1"}, bad])
    with pytest.raises(DataError) as err:
        RowDataset(path, spec, tok)
    assert str(err.value).startswith(f"{path}: ")
    return str(err.value)[len(str(path)) + 2 :]


@pytest.mark.unit
def test_bad_rows_name_file_row_and_key(tmp_path: Path, hf_tok_dir: Path) -> None:
    assert _error(tmp_path, {"answer": "1"}) == "row 2: missing key 'prompt' (row keys: ['answer'])"
    assert (
        _error(tmp_path, {"prompt": "R1:", "answer": None})
        == "row 2: missing key 'answer' (row keys: ['prompt'])"
    )
    assert _error(tmp_path, {"prompt": 12, "answer": "1"}) == (
        "row 2: key 'prompt' must be a string or a non-empty list of {'role': str, 'content': str} messages, "
        "got int '12'"
    )
    assert _error(tmp_path, {"prompt": [{"role": "user"}], "answer": "1"}).startswith(
        "row 2: key 'prompt' must be a string or a non-empty list"
    )
    assert _error(tmp_path, {"prompt": "R1:", "answer": ["1"]}) == (
        "row 2: key 'answer' must be a string or a number, got list"
    )
    assert _error(tmp_path, {"prompt": [{"role": "user", "content": "x"}], "answer": "1"}) == (
        "row 2: key 'prompt' holds chat messages but the tokenizer builtin:char has no chat template; "
        "use an HF "
        "tokenizer with one (task.tokenizer=hf:DIR) or plain string prompts"
    )
    assert _error(
        tmp_path,
        {"prompt": [{"role": "user", "content": "x"}], "answer": "1"},
        RowSpec(apply_chat_template=False),
    ) == (
        "row 2: key 'prompt' holds chat messages but task.apply_chat_template=false: set it to auto or true"
    )
    assert _error(tmp_path, {"prompt": "R1X:", "answer": "1"}).startswith(
        "row 2: key 'prompt': character 'X' at position 2 of 'R1X:' is not in the vocabulary"
    )
    assert _error(tmp_path, {"prompt": "R1:", "answer": "1", "reward": "bleu"}).startswith(
        "row 2: unknown reward 'bleu'; known: ['char_accuracy', 'exact_match', 'math']"
    )
    assert _error(tmp_path, {"prompt": "R1:", "answer": "1"}, RowSpec(apply_chat_template=True)) == (
        "row 1: task.apply_chat_template=true but the tokenizer builtin:char has no chat template; use an HF "
        "tokenizer with one (task.tokenizer=hf:DIR) or plain string prompts"
    )
    assert _error(tmp_path, '{"prompt": "R1:", "answer": "1"') == (
        "line 2: not a JSON object (JSON parse error: Missing a comma or '}' after an object member.)"
    )
    verl = RowSpec(answer_key="reward_model.ground_truth")
    assert _error(tmp_path, {"prompt": "R1:", "reward_model": {"style": "rule"}}, verl).startswith(
        "row 1: missing key 'reward_model.ground_truth'"
    )


@pytest.mark.unit
def test_files_missing_unknown_and_empty(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.jsonl: prompt file does not exist$"):
        RowDataset(tmp_path / "nope.jsonl", RowSpec(), CHAR)
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(
        DataError, match=r"p\.csv: unknown prompt file type '\.csv'; use \.jsonl or \.parquet$"
    ):
        RowDataset(tmp_path / "p.csv", RowSpec(), CHAR)
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "R1234:", "answer": "4321"}] * 3), str(tmp_path / "long.parquet")
    )
    with pytest.raises(
        DataError,
        match=r"long\.parquet: no prompts left after filtering "
        r"\(all 3 are longer than 5 tokens\)$",
    ):
        RowDataset(tmp_path / "long.parquet", RowSpec(max_prompt_tokens=5), CHAR)


@pytest.mark.unit
def test_long_prompts_are_dropped_and_counted(tmp_path: Path) -> None:
    rows = [
        {"prompt": "R" + "1" * n + ":", "answer": "1"} for n in (1, 5, 2, 6)
    ]  # 4, 8, 5, 9 tokens with bos
    ds = RowDataset(_jsonl(tmp_path / "p.jsonl", rows), RowSpec(max_prompt_tokens=5), CHAR)
    assert [p.text for p in ds.prompts] == ["R1:", "R11:"] and ds.num_dropped == 2


@pytest.mark.unit
def test_epoch_sampling_without_replacement(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"C{i}:", "answer": str(i)} for i in range(10)])
    ds = RowDataset(path, RowSpec(), CHAR)
    # 2 ranks x 3 prompts per step: steps 0..9 cover 60 positions = 6 epochs of the 10 rows
    seen = [p.answer for step in range(10) for rank in range(2) for p in ds.sample_step(step, 3, rank, 2, 7)]
    epochs = [seen[e * 10 : (e + 1) * 10] for e in range(6)]
    assert all(sorted(e) == [str(i) for i in range(10)] for e in epochs)  # each epoch: every row once
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    fresh = RowDataset(path, RowSpec(), CHAR)  # a resumed run: same prompts at step 7, whatever came before
    assert fresh.sample_step(7, 3, 1, 2, 7) == ds.sample_step(7, 3, 1, 2, 7)
    assert [p.answer for p in fresh.sample_step(7, 3, 1, 2, 7)] == seen[45:48]
    assert ds.sample_step(0, 10, 0, 1, 8) != ds.sample_step(0, 10, 0, 1, 7)  # the run seed shuffles
    assert Counter(p.answer for p in ds.sample_step(0, 25, 0, 1, 7)).most_common(1)[0][1] == 3
    assert [p.answer for p in ds.sample_step(0, 10, 0, 1, 7)] == epochs[0]
    assert re.fullmatch(r"RowDataset\(path='.*p\.jsonl', num_prompts=10, dropped=0\)", repr(ds))


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["auto", "true", True])
def test_chat_messages_go_through_the_template_by_default(tmp_path: Path, hf_tok_dir: Path, mode) -> None:
    """auto (the default) and true render a message list with the template; auto feeds a string
    prompt as is, true wraps it as one user message; messages and strings may share a file."""
    tok = HFTokenizer(hf_tok_dir)
    path = _jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"},
            {"prompt": "What is 1+1?", "answer": "2"},
        ],
    )
    spec = RowSpec() if mode == "auto" else RowSpec(apply_chat_template=mode)
    assert RowSpec().apply_chat_template == "auto"
    chat, plain = RowDataset(path, spec, tok).prompts
    text = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert (chat.text, chat.prompt_ids) == (text, tok.encode(text))
    if mode == "auto":
        assert (plain.text, plain.prompt_ids) == ("What is 1+1?", tok.encode("What is 1+1?", bos=True))
    else:
        wrapped = "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
        assert (plain.text, plain.prompt_ids) == (wrapped, tok.encode(wrapped))


@pytest.mark.unit
def test_messages_without_a_template_name_the_tokenizer_and_row(tmp_path: Path, hf_tok_dir: Path) -> None:
    import shutil

    no_template = tmp_path / "tok"
    shutil.copytree(hf_tok_dir, no_template)
    cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(cfg))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    tok = HFTokenizer(no_template)
    assert not tok.has_chat_template
    assert _error(tmp_path, {"prompt": [{"role": "user", "content": "x"}], "answer": "1"}, tok=tok) == (
        f"row 2: key 'prompt' holds chat messages but the tokenizer hf:{no_template} "
        f"has no chat template; use an "
        f"HF tokenizer with one (task.tokenizer=hf:DIR) or plain string prompts"
    )
    plain = RowDataset(_jsonl(tmp_path / "s.jsonl", [{"prompt": "x y", "answer": "1"}]), RowSpec(), tok)
    assert plain.prompts[0].prompt_ids == tok.encode("x y", bos=True)  # auto: a string needs no template


@pytest.mark.unit
def test_invalid_utf8_names_file_and_line_or_row(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "R1:", "answer": "1"}\n\n{"prompt": "R\xff:", "answer": "1"}\n')
    with pytest.raises(DataError) as err:
        RowDataset(path, RowSpec(), CHAR)
    assert str(err.value) == f"{path}: line 3: not valid UTF-8 (invalid start byte at byte 13)"
    strings = pa.array([b"R1:", b"R2:", b"R\xfe:"], pa.binary()).view(pa.string())  # pyarrow does not check
    pq.write_table(pa.table({"prompt": strings, "answer": ["1", "2", "3"]}), str(tmp_path / "p.parquet"))
    with pytest.raises(DataError) as err:
        RowDataset(tmp_path / "p.parquet", RowSpec(), CHAR)
    assert str(err.value) == f"{tmp_path / 'p.parquet'}: row 3: not valid UTF-8 (invalid start byte)"
