"""CharTokenizer: fixed ids, round trips, error messages, padding, fingerprint."""

from __future__ import annotations

import pytest
import torch

from moe_rl.tasks.generators import TASKS
from moe_rl.tasks.tokenizer import ALPHABET, CharTokenizer


@pytest.mark.unit
def test_fixed_layout() -> None:
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 50
    assert tok.tokens[:3] == ("<pad>", "<bos>", "<eos>")
    assert tok.encode("0") == [3]
    assert tok.encode("9") == [12]
    assert tok.encode("a") == [13]
    assert tok.encode("z") == [38]
    assert tok.encode(" +-=:?>") == list(range(39, 46))
    assert tok.encode("ACRS") == [46, 47, 48, 49]
    assert len(set(ALPHABET)) == len(ALPHABET) == tok.vocab_size - 3


@pytest.mark.unit
def test_round_trip_every_character() -> None:
    tok = CharTokenizer()
    text = ALPHABET + ALPHABET[::-1]
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


@pytest.mark.unit
def test_bos_eos_framing_and_decode_rules() -> None:
    tok = CharTokenizer()
    ids = tok.encode("R12:", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "R12:"
    # stops at the first eos, skips pad and bos anywhere before it
    one, two, three = tok.encode("123")
    assert tok.decode([tok.bos_id, one, tok.pad_id, two, tok.eos_id, three]) == "12"
    assert tok.decode([tok.eos_id, one]) == ""
    assert tok.decode([]) == ""


@pytest.mark.unit
def test_unknown_character_names_char_and_position() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"character 'X' at position 3 of 'R12X:'"):
        tok.encode("R12X:")
    with pytest.raises(ValueError, match=r"character '\\n' at position 0"):
        tok.encode("\n1")


@pytest.mark.unit
def test_decode_rejects_out_of_range_ids() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="token id 50 is outside"):
        tok.decode([3, 50])
    with pytest.raises(ValueError, match="token id -1 is outside"):
        tok.decode([-1])


@pytest.mark.unit
def test_pad_and_batches() -> None:
    tok = CharTokenizer()
    ids = tok.encode_batch(["12", "", "3"], eos=True)
    assert ids == [[4, 5, 2], [2], [6, 2]]
    padded_BS = tok.pad(ids)
    assert padded_BS.dtype == torch.long
    assert padded_BS.tolist() == [[4, 5, 2], [2, 0, 0], [6, 2, 0]]
    assert tok.pad(ids, length=5).shape == (3, 5)
    assert tok.pad([]).shape == (0, 0)
    assert tok.pad([[], []]).shape == (2, 0)
    with pytest.raises(ValueError, match="does not fit in length 2"):
        tok.pad(ids, length=2)
    assert tok.decode_batch(padded_BS) == ["12", "", "3"]


@pytest.mark.unit
def test_fingerprint_is_stable_and_content_based() -> None:
    a, b = CharTokenizer(), CharTokenizer()
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint().startswith("char-") and len(a.fingerprint()) == 21
    b._tokens = a.tokens[:-1] + ("T",)
    assert a.fingerprint() != b.fingerprint()


@pytest.mark.unit
def test_every_task_prompt_and_answer_encodes() -> None:
    import random

    tok = CharTokenizer()
    for name, fn in TASKS.items():
        for seed in range(50):
            prompt, answer = fn(random.Random(seed), 1, 6)
            assert tok.decode(tok.encode(prompt)) == prompt, name
            assert tok.decode(tok.encode(answer)) == answer, name
