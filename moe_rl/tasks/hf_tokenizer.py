"""Tokenizers a run can use: ``task.tokenizer`` = ``builtin:char`` (``CharTokenizer``, the embedded
tasks) or ``hf:DIR`` (``HFTokenizer``: transformers' ``AutoTokenizer`` from a local directory, the
tokenizer an imported Hugging Face checkpoint was trained with).

Both give what the tasks, the engines and the rewards need (``Tokenizer`` below): encode/decode,
right-padding, the stop (EOS) ids, the pad id, the vocabulary size and a fingerprint. An HF
tokenizer's EOS ids are its ``eos_token_id`` plus every ``eos_token_id`` of the directory's
``generation_config.json`` (Qwen3 stops on both ``<|im_end|>`` and ``<|endoftext|>``); its pad id
is ``pad_token_id`` (tokenizer, else generation config, else the first EOS id). Decoding stops at
the first EOS id and skips special tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from moe_rl.errors import ConfigError
from moe_rl.tasks.tokenizer import CharTokenizer

BUILTIN_CHAR = "builtin:char"
HF_PREFIX = "hf:"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class TokenizerError(ConfigError):
    """A tokenizer directory is missing, unreadable or does not fit the model; names the directory."""


class Tokenizer(Protocol):
    """What the tasks, rewards and engines need from a tokenizer."""

    vocab_size: int
    pad_id: int
    eos_id: int
    eos_ids: tuple[int, ...]
    has_chat_template: bool

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str: ...

    def pad(self, seqs: Sequence[Sequence[int]], length: int | None = None) -> torch.Tensor: ...

    def fingerprint(self) -> str: ...


class HFTokenizer:
    """transformers' ``AutoTokenizer`` from a local directory, with the ``Tokenizer`` interface."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise TokenizerError(f"tokenizer directory {self.directory} does not exist (task.tokenizer)")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, JSON errors ... for a bad directory
            raise TokenizerError(
                f"tokenizer directory {self.directory} is not readable by transformers' "
                f"AutoTokenizer: {type(e).__name__}: {e}"
            ) from None
        gen = _generation_config(self.directory)
        eos = [self.hf.eos_token_id] if self.hf.eos_token_id is not None else []
        eos += _as_list(gen.get("eos_token_id"))
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos))
        if not self.eos_ids:
            raise TokenizerError(
                f"tokenizer directory {self.directory}: no eos_token_id in the tokenizer or in "
                "generation_config.json; generation could never stop"
            )
        pad = self.hf.pad_token_id if self.hf.pad_token_id is not None else gen.get("pad_token_id")
        self.pad_id = int(_as_list(pad)[0]) if pad is not None else self.eos_ids[0]
        self.eos_id = self.eos_ids[0]
        self.bos_id = self.hf.bos_token_id
        self.vocab_size = len(self.hf)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Text -> ids (no special tokens added), optionally framed by bos (if the tokenizer has
        one) and the first eos."""
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if bos and self.bos_id is not None:
            ids = [int(self.bos_id), *ids]
        return ids + [self.eos_id] if eos else ids

    def chat_text(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        """Chat messages -> the prompt text the model was trained to continue (the template writes
        the special tokens itself, so encode it without bos)."""
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Ids -> text, stopping at the first EOS id, special tokens and ids past the tokenizer's
        vocabulary (a padded embedding's rows) skipped."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        stops = [k for k, t in enumerate(ids) if t in self.eos_ids]
        ids = [t for t in (ids[: stops[0]] if stops else ids) if 0 <= t < self.vocab_size]
        return self.hf.decode(ids, skip_special_tokens=True)

    def decode_batch(self, ids_BS: torch.Tensor) -> list[str]:
        return [self.decode(row) for row in ids_BS.tolist()]

    pad = CharTokenizer.pad

    def fingerprint(self) -> str:
        """Short sha256 of the vocabulary (token -> id); equal iff the vocabularies are identical."""
        blob = json.dumps(sorted(self.hf.get_vocab().items()), ensure_ascii=False).encode("utf-8")
        return "hf-" + hashlib.sha256(blob).hexdigest()[:16]

    def save(self, out_dir: str | Path) -> list[str]:
        """Copy the tokenizer's files (and generation_config.json) into ``out_dir``; their names."""
        copied = []
        for name in TOKENIZER_FILES:
            src = self.directory / name
            if src.is_file():
                (Path(out_dir) / name).write_bytes(src.read_bytes())
                copied.append(name)
        return copied

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.directory)!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids})"


def _as_list(v: Any) -> list:
    return [] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]


def _generation_config(directory: Path) -> dict[str, Any]:
    """generation_config.json's eos/pad ids through transformers' GenerationConfig ({} if absent)."""
    if not (directory / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:
        raise TokenizerError(f"{directory / 'generation_config.json'} is not readable: {e}") from None
    return {"eos_token_id": gen.eos_token_id, "pad_token_id": gen.pad_token_id}


def tokenizer_dir(spec: str, init_weights: str) -> str:
    """``task.tokenizer`` -> "" (built-in) or the HF directory: ``auto`` is the ``init_weights=hf:DIR``
    directory when there is one, else the built-in; ``hf`` / ``hf:`` alone is that directory."""
    init_dir = init_weights[len(HF_PREFIX) :] if init_weights.startswith(HF_PREFIX) else ""
    if spec == BUILTIN_CHAR or (spec == "auto" and not init_dir):
        return ""
    if spec in ("auto", "hf", HF_PREFIX):
        if not init_dir:
            raise TokenizerError(
                f"task.tokenizer={spec!r} names the init_weights=hf:DIR directory, but "
                f"init_weights is {init_weights!r}; give task.tokenizer=hf:DIR"
            )
        return init_dir
    return spec[len(HF_PREFIX) :]


def load_tokenizer(spec: str, init_weights: str) -> CharTokenizer | HFTokenizer:
    """The run's tokenizer from ``task.tokenizer`` (and ``init_weights`` for the default directory)."""
    directory = tokenizer_dir(spec, init_weights)
    if directory and init_weights == HF_PREFIX + directory and not Path(directory).is_dir():
        # the checkpoint's own directory: name the key the user set
        raise ConfigError(f"config key 'init_weights': {directory} is not a directory")
    return HFTokenizer(directory) if directory else CharTokenizer()


def check_vocab_fits(tok: CharTokenizer | HFTokenizer, model_vocab: int) -> None:
    """The model's embedding must hold every token id (it may be larger: padded embeddings)."""
    if model_vocab < tok.vocab_size:
        where = getattr(tok, "directory", "builtin:char")
        raise TokenizerError(
            f"the tokenizer ({where}) has {tok.vocab_size} tokens but the model's vocabulary "
            f"(model.vocab_size) has only {model_vocab}: every token id needs an embedding row"
        )
