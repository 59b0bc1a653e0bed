"""The HF tokenizer path: EOS / pad ids from the tokenizer and generation_config.json, decoding,
the task.tokenizer spec, and the errors for a bad directory or a vocabulary that does not fit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_rl.tasks.hf_tokenizer import (
    HFTokenizer,
    TokenizerError,
    check_vocab_fits,
    load_tokenizer,
    tokenizer_dir,
)
from moe_rl.tasks.tokenizer import CharTokenizer


@pytest.mark.unit
def test_ids_from_tokenizer_and_generation_config(hf_tok_dir: Path) -> None:
    tok = HFTokenizer(hf_tok_dir)
    end, im_end = tok.hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert (end, im_end) == (0, 2)
    assert (
        tok.eos_ids == (2, 0) and tok.eos_id == 2 and tok.pad_id == 0
    )  # eos_token, then generation_config's
    assert tok.vocab_size == len(tok.hf) == 460
    assert tok.has_chat_template
    ids = tok.encode("Ava has 3 coins.")
    assert tok.decode(ids) == "Ava has 3 coins."
    assert tok.decode([*ids, 0, *ids]) == "Ava has 3 coins."  # stops at <|endoftext|>
    assert tok.decode([*ids, 2, *ids]) == "Ava has 3 coins."  # and at <|im_end|>
    assert tok.decode([*ids, 459 + 10]) == "Ava has 3 coins."  # padded-embedding ids are skipped
    assert tok.pad([[5, 6], [7]]).tolist() == [[5, 6], [7, 0]]
    text = tok.chat_text([{"role": "user", "content": "hi"}], True, {"enable_thinking": False})
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.chat_text([{"role": "user", "content": "hi"}], False, {}) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.fingerprint() == HFTokenizer(hf_tok_dir).fingerprint() and tok.fingerprint().startswith("hf-")


@pytest.mark.unit
def test_spec_resolution(hf_tok_dir: Path) -> None:
    assert tokenizer_dir("auto", "builtin:warmstart") == ""
    assert tokenizer_dir("auto", "hf:/m") == "/m"
    assert tokenizer_dir("hf", "hf:/m") == "/m"
    assert tokenizer_dir("hf:/t", "hf:/m") == "/t"
    assert tokenizer_dir("builtin:char", "hf:/m") == ""
    assert isinstance(load_tokenizer("auto", ""), CharTokenizer)
    assert isinstance(load_tokenizer("auto", f"hf:{hf_tok_dir}"), HFTokenizer)
    with pytest.raises(
        TokenizerError, match=r"init_weights is 'builtin:warmstart'; give task.tokenizer=hf:DIR"
    ):
        tokenizer_dir("hf", "builtin:warmstart")


@pytest.mark.unit
def test_bad_directories(tmp_path: Path) -> None:
    with pytest.raises(
        TokenizerError, match=rf"^tokenizer directory {re.escape(str(tmp_path / 'nope'))} does not exist"
    ):
        HFTokenizer(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    with pytest.raises(
        TokenizerError, match=rf"^tokenizer directory {re.escape(str(tmp_path))} is not readable"
    ):
        HFTokenizer(tmp_path)


@pytest.mark.unit
def test_vocab_must_fit_the_model(hf_tok_dir: Path) -> None:
    tok = HFTokenizer(hf_tok_dir)
    check_vocab_fits(tok, 460)
    check_vocab_fits(tok, 512)  # padded embeddings (Qwen3: 151,936 rows for 151,669 tokens)
    with pytest.raises(
        TokenizerError,
        match=r"has 460 tokens but the model's vocabulary \(model.vocab_size\) "
        r"has only 459",
    ):
        check_vocab_fits(tok, 459)
