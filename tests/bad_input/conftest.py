"""Fixtures of the bad_input tier."""

from __future__ import annotations

import pytest

from moe_rl.config import load_config
from moe_rl.tasks.task import resolve_vocab
from moe_rl.tasks.tokenizer import CharTokenizer


@pytest.fixture()
def hf_dir(tmp_path):
    """A real sharded HF checkpoint of the default model (index + 3 shards)."""
    from moe_rl.weights.hf import write_hf_checkpoint
    from moe_rl.weights.warmstart import load_init_weights

    cfg = resolve_vocab(load_config(None), CharTokenizer())
    weights = load_init_weights("builtin:warmstart", cfg.model, CharTokenizer())
    out = tmp_path / "hf"
    write_hf_checkpoint(out, weights, cfg.model, 400_000)
    return out
