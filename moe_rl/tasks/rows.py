"""Prompt datasets of rows: JSONL or Parquet files, read with pyarrow (never parsed by hand).

One typed spec (``RowSpec``, from the ``task`` config) meets the peers' conventions:

- verl: Parquet rows with a chat-format ``prompt`` (a list of ``{"role", "content"}`` messages),
  ``reward_model.ground_truth`` and ``data_source``: ``answer_key=reward_model.ground_truth``
  (keys are dotted paths into nested rows);
- slime: JSONL with ``--input-key`` / ``--label-key`` / ``--apply-chat-template``: ``prompt_key``,
  ``answer_key``, ``apply_chat_template``;
- the built-in format: ``{"prompt": "R123:", "answer": "321", "reward": "exact_match", "task": ...}``.

A prompt is a string (fed as is after bos, or as one user message through the chat template) or a
list of chat messages. ``apply_chat_template``: ``auto`` (the default) renders a message list with
the tokenizer's chat template and feeds a string as is; ``true`` renders both; ``false`` refuses
messages. Messages without a template are refused naming the tokenizer. The ground truth is a
string or a number. A row's ``reward`` field, when it is a string, names its reward (default
``task.reward``); its data source (per-source metrics) is ``source_key``, else a string ``task``
field, else "dataset"; every field other than the prompt and the answer is handed to ``python:``
rewards as ``extra``. Prompts longer than ``max_prompt_tokens`` are dropped at load and counted
(``num_dropped``); a dataset left empty is an error. Errors name the file, the row (counted from 1)
and the key.

Sampling (``RowDataset.sample_step``) is epoch-based without replacement: epoch e visits the rows
in a permutation drawn from (run seed, e); RL step k, data-parallel rank r takes the global
positions [k * P + r * n, k * P + (r + 1) * n) of that endless sequence (P = n * dp_size prompts per
step). It is a pure function of (seed, step, rank), so a resumed run sees exactly the same prompts.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_rl.errors import DataError
from moe_rl.types import Prompt

logger = logging.getLogger(__name__)
_MISSING = object()
# the prompt files read_rows reads (.json: one object per line, as .jsonl); make-math writes only these
PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class RowSpec:
    """How rows become prompts (the ``task`` config keys of the same names)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    source_key: str = "data_source"
    default_reward: str = "exact_match"
    apply_chat_template: bool | str = "auto"  # auto | true | false (bools too)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_prompt_tokens: int = 0  # 0 = no limit
    overlong: str = "drop"  # a longer prompt: drop (counted) | error (names file and row)
    limit_why: str = ""  # which config keys set the limit (for the error)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file, as dicts.

    JSONL is read as one table; when pyarrow cannot (rows whose types differ, a malformed line, bytes
    that are not UTF-8), it is read again line by line, so the error names the line, or a row of the
    wrong type reaches the key checks (which name row and key). pyarrow reads invalid UTF-8 into a
    string column and only fails when the rows are made, so that failure is caught too."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory; task.dataset names a JSONL or Parquet file")
    if not path.is_file():
        raise DataError(f"{path}: prompt file does not exist")
    import pyarrow as pa

    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return _table_rows(pq.read_table(str(path)), path)
        if path.suffix not in PROMPT_SUFFIXES:
            raise DataError(f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl or .parquet")
        import pyarrow.json as pj

        try:
            return pj.read_json(str(path)).to_pylist()
        except (pa.ArrowInvalid, UnicodeDecodeError):
            return _read_jsonl_lines(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read prompt rows ({e})") from None


def _read_jsonl_lines(path: Path) -> list[dict[str, Any]]:
    """One pyarrow read per non-blank line (rows may differ in type); DataError names the line."""
    import io

    import pyarrow as pa
    import pyarrow.json as pj

    rows = []
    for lineno, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}: line {lineno}: not valid UTF-8 ({e.reason} at byte {e.start})"
            ) from None
        try:
            table = pj.read_json(io.BytesIO(line))
        except pa.ArrowInvalid as e:
            raise DataError(
                f"{path}: line {lineno}: not a JSON object ({str(e).split(' in row')[0]})"
            ) from None
        rows.extend(table.to_pylist())
    return rows


def _table_rows(table, path: Path) -> list[dict[str, Any]]:
    """A Parquet table's rows; a string that is not UTF-8 is named by its row (counted from 1)."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        pass
    rows = []
    for i in range(table.num_rows):  # again row by row, only to find the bad one
        try:
            rows.extend(table.slice(i, 1).to_pylist())
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: row {i + 1}: not valid UTF-8 ({e.reason})") from None
    return rows


def lookup(row: dict[str, Any], dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; ``_MISSING`` when any part is absent."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return _MISSING
        value = value[part]
    return value


def _messages(prompt: Any, key: str) -> list[dict[str, Any]] | None:
    """A chat prompt's messages, None for a string prompt; ValueError for anything else."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"key {key!r} is an empty string")
        return None
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        return prompt
    raise ValueError(
        f"key {key!r} must be a string or a non-empty list of {{'role': str, 'content': str}} "
        f"messages, got {type(prompt).__name__} {str(prompt)[:60]!r}"
    )


def _encode(tok, text: str, key: str, bos: bool = False) -> list[int]:
    try:
        return tok.encode(text, bos=bos)
    except ValueError as e:
        raise ValueError(f"key {key!r}: {e}") from None


def _tokenizer_name(tok) -> str:
    """How the config names a tokenizer: hf:DIR or builtin:char."""
    directory = getattr(tok, "directory", None)
    return f"hf:{directory}" if directory is not None else "builtin:char"


def _use_template(spec: RowSpec, messages: list | None, tok) -> bool:
    """Whether this row goes through the chat template (``spec.apply_chat_template``: auto, true or
    false; YAML and Python booleans too); ValueError when it must and the tokenizer has none."""
    mode = str(spec.apply_chat_template).lower()
    if mode == "false":
        if messages is not None:
            raise ValueError(
                f"key {spec.prompt_key!r} holds chat messages but task.apply_chat_template=false: "
                f"set it to auto or true"
            )
        return False
    if mode == "auto" and messages is None:
        return False  # a plain string prompt is tokenized as is
    if not tok.has_chat_template:
        why = (
            "task.apply_chat_template=true but"
            if mode == "true"
            else f"key {spec.prompt_key!r} holds chat messages but"
        )
        raise ValueError(
            f"{why} the tokenizer {_tokenizer_name(tok)} has no chat template; use an HF tokenizer "
            f"with one (task.tokenizer=hf:DIR) or plain string prompts"
        )
    return True


def row_to_prompt(row: dict[str, Any], spec: RowSpec, tok) -> Prompt:
    """One row -> Prompt; ValueError naming the key for a missing or mistyped field."""
    from moe_rl.tasks.rewards import check_reward_name

    prompt, answer = lookup(row, spec.prompt_key), lookup(row, spec.answer_key)
    for key, value in ((spec.prompt_key, prompt), (spec.answer_key, answer)):
        if value is _MISSING:
            raise ValueError(
                f"missing key {key!r} (row keys: {sorted(k for k, v in row.items() if v is not None)})"
            )
    messages = _messages(prompt, spec.prompt_key)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"key {spec.answer_key!r} must be a string or a number, got {type(answer).__name__}")
    reward = row.get("reward") if isinstance(row.get("reward"), str) else spec.default_reward
    check_reward_name(reward)
    source = lookup(row, spec.source_key)
    source = (
        row.get("task") if source is _MISSING and isinstance(row.get("task"), str) else source
    )  # built-in format
    source = str(source) if source not in (_MISSING, None, "") else "dataset"
    if _use_template(spec, messages, tok):
        messages = messages or [{"role": "user", "content": prompt}]
        text = tok.chat_text(messages, spec.add_generation_prompt, dict(spec.chat_template_kwargs))
        ids = tok.encode(text)
    else:
        ids, text = _encode(tok, prompt, spec.prompt_key, bos=True), prompt
    if not hasattr(tok, "hf"):  # the character tokenizer's token rewards encode the answer
        _encode(tok, str(answer), spec.answer_key)
    top = spec.prompt_key.split(".")[0], spec.answer_key.split(".")[0]
    extra = {
        k: v for k, v in row.items() if k not in top and v is not None
    }  # pyarrow fills absent keys with None
    return Prompt(ids, str(answer), reward, source, text=text, extra=extra)


def load_prompts(path: str | Path, spec: RowSpec, tok) -> tuple[list[Prompt], int]:
    """Every row of ``path`` as a prompt, and the number dropped for length; DataError names
    file, row and key."""
    prompts, dropped = [], 0
    for i, row in enumerate(read_rows(path), start=1):
        try:
            p = row_to_prompt(row, spec, tok)
        except ValueError as e:
            raise DataError(f"{path}: row {i}: {e}") from None
        if spec.max_prompt_tokens and len(p.prompt_ids) > spec.max_prompt_tokens:
            if spec.overlong == "error":
                raise DataError(
                    f"{path}: row {i}: prompt has {len(p.prompt_ids)} tokens (bos included), more "
                    f"than {spec.max_prompt_tokens} ({spec.limit_why}); shorten it, raise "
                    f"model.max_seq_len, or set task.overlong=drop"
                )
            dropped += 1
            continue
        prompts.append(p)
    if dropped:
        logger.warning(
            "%s: dropped %d of %d prompts longer than %d tokens (%s)",
            path,
            dropped,
            dropped + len(prompts),
            spec.max_prompt_tokens,
            spec.limit_why,
        )
    if not prompts:
        limit = f" (all {dropped} are longer than {spec.max_prompt_tokens} tokens)" if dropped else ""
        raise DataError(f"{path}: no prompts left after filtering{limit}")
    return prompts, dropped


class RowDataset:
    """Prompts from a JSONL / Parquet file, sampled epoch by epoch without replacement."""

    def __init__(self, path: str | Path, spec: RowSpec, tok) -> None:
        self.path = Path(path)
        self.prompts, self.num_dropped = load_prompts(self.path, spec, tok)
        self.task_names = tuple(dict.fromkeys(p.task for p in self.prompts))
        self._perm: tuple[int, int, list[int]] | None = None  # (seed, epoch, order) cache

    def __len__(self) -> int:
        return len(self.prompts)

    def _order(self, seed: int, epoch: int) -> list[int]:
        if self._perm is None or self._perm[:2] != (seed, epoch):
            order = list(range(len(self.prompts)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            self._perm = (seed, epoch, order)
        return self._perm[2]

    def sample_step(self, step: int, num: int, dp_rank: int, dp_size: int, run_seed: int) -> list[Prompt]:
        """The ``num`` prompts of (step, rank): global positions [step * P + rank * num, + num)."""
        n, first = len(self.prompts), (step * dp_size + dp_rank) * num
        out = []
        for g in range(first, first + num):
            out.append(self.prompts[self._order(run_seed, g // n)[g % n]])
        return out

    def __repr__(self) -> str:
        return f"RowDataset(path={str(self.path)!r}, num_prompts={len(self)}, dropped={self.num_dropped})"
