"""Fixtures of the task tests: a locally trained HF tokenizer directory (tests/hf_assets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_assets import make_tokenizer


@pytest.fixture(scope="session")
def hf_tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return make_tokenizer(tmp_path_factory.mktemp("tok"))
