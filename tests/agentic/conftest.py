"""Fixtures of the agentic tests: the locally trained HF tokenizer with a Qwen3-style tool template."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.tasks.hf_tokenizer import HFTokenizer
from tests.hf_assets import make_checkpoint, make_tokenizer, tiny_model

# Qwen3's template, cut to what matters here: tools in the system turn, tool replies as a user turn
QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m.content }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def hf_qwen3_tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    pytest.importorskip("transformers")
    d = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = HFTokenizer(d)
    tok.hf.chat_template = QWEN3_TEMPLATE
    tok.has_chat_template = True
    return tok


@pytest.fixture(scope="session")
def hf_qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE checkpoint with the tokenizer above (the Qwen3-style template)."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("qwen3")
    make_checkpoint(d, tiny_model(512))
    make_tokenizer(d)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = QWEN3_TEMPLATE
    tok.save_pretrained(str(d))
    return d
