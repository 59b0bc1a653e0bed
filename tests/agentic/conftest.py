"""Fixtures of the agentic tests: the locally trained HF tokenizer with a Qwen3-style tool template."""

from __future__ import annotations

import pytest

from moe_rl.tasks.hf_tokenizer import HFTokenizer
from tests.agentic.test_tools_and_formats import QWEN3_TEMPLATE
from tests.hf_assets import make_tokenizer


@pytest.fixture(scope="session")
def hf_qwen3_tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    pytest.importorskip("transformers")
    d = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = HFTokenizer(d)
    tok.hf.chat_template = QWEN3_TEMPLATE
    tok.has_chat_template = True
    return tok
