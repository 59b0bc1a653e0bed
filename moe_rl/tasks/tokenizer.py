"""The fixed character-level tokenizer shared by the tasks, the engines and the model.

One token per character over a small, fixed alphabet, so the tiny CPU model has a small embedding
table and every id means the same thing in every run. Checkpoints store ``fingerprint()`` and
refuse to load under a different vocabulary.

Layout (ids are positions in ``TOKENS``):
    0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, then the digits ``0-9``, lowercase ``a-z``, the
    punctuation ``" +-=:?>"`` (space included), then the task tags ``A C R S`` (one uppercase
    letter per generated task, see ``generators.py``). 50 tokens in all.

Shape suffixes: B sequences, S padded sequence length.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterable, Sequence

import torch

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS)
PUNCTUATION = " +-=:?>"
TASK_TAGS = "ACRS"  # add, copy, reverse, sort; adding a tag changes the vocabulary and fingerprint
ALPHABET: str = string.digits + string.ascii_lowercase + PUNCTUATION + TASK_TAGS
TOKENS: tuple[str, ...] = SPECIAL_TOKENS + tuple(ALPHABET)


class CharTokenizer:
    """Character-level tokenizer over the fixed vocabulary ``TOKENS``.

    ``encode`` maps text to ids (no bos/eos unless asked); ``decode`` maps ids back to text,
    stopping at the first eos and skipping pad and bos.
    """

    def __init__(self) -> None:
        self._tokens = TOKENS
        self._char_to_id = {ch: i for i, ch in enumerate(TOKENS) if i >= len(SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id generation stops on (one here)."""
        return (self.eos_id,)

    @property
    def has_chat_template(self) -> bool:
        return False

    @property
    def tokens(self) -> tuple[str, ...]:
        """Every token, indexed by id (specials first)."""
        return self._tokens

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Text -> ids, optionally framed by bos / eos.

        Raises:
            ValueError: a character is outside the vocabulary; names it and its 0-based position.
        """
        ids = [self.bos_id] if bos else []
        for pos, ch in enumerate(text):
            tok = self._char_to_id.get(ch)
            if tok is None:
                raise ValueError(
                    f"character {ch!r} at position {pos} of {text!r} is not in the vocabulary "
                    f"(allowed: {ALPHABET!r})"
                )
            ids.append(tok)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Ids -> text: stops at the first eos, skips pad and bos.

        Raises:
            ValueError: an id is outside [0, vocab_size).
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        chars = []
        for tok in ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"token id {tok} is outside [0, {self.vocab_size})")
            if tok == self.eos_id:
                break
            if tok in (self.pad_id, self.bos_id):
                continue
            chars.append(self._tokens[tok])
        return "".join(chars)

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """``encode`` for each text (jagged lists)."""
        return [self.encode(t, bos=bos, eos=eos) for t in texts]

    def pad(self, seqs: Sequence[Sequence[int]], length: int | None = None) -> torch.Tensor:
        """Jagged id lists -> int64 [B, S], right-padded with the pad id.

        Args:
            seqs: B id lists.
            length: S; default the longest list (0 when all are empty).
        Raises:
            ValueError: a list is longer than ``length``.
        """
        longest = max((len(s) for s in seqs), default=0)
        length = longest if length is None else length
        if longest > length:
            raise ValueError(f"a sequence of {longest} tokens does not fit in length {length}")
        out_BS = torch.full((len(seqs), length), self.pad_id, dtype=torch.long, device="cpu")  # host-side ids
        for b, s in enumerate(seqs):
            out_BS[b, : len(s)] = torch.as_tensor(list(s), dtype=torch.long, device="cpu")
        return out_BS

    def decode_batch(self, ids_BS: torch.Tensor) -> list[str]:
        """``decode`` for each row of an int [B, S] tensor."""
        return [self.decode(row) for row in ids_BS.tolist()]

    def fingerprint(self) -> str:
        """Short sha256 of the token list; equal iff the vocabularies are identical."""
        blob = "\x00".join(self._tokens).encode("utf-8")
        return "char-" + hashlib.sha256(blob).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint()!r})"
