"""Local stand-ins for what users bring, built in tests (nothing is downloaded): a byte-level BPE
tokenizer trained on generated text and saved by transformers with a Qwen-style chat template and
generation_config.json, and a tiny random Qwen3-MoE HF checkpoint whose (padded) vocabulary fits it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from moe_rl.config import ModelConfig
from tests.models import hf_tiny

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
TOKENIZER_VOCAB = 600


def training_text(num: int = 400, seed: int = 0) -> list[str]:
    """Text the tokenizer learns its merges from: the generated word problems and boxed answers."""
    from moe_rl.tasks.make_data import word_problem

    rng = random.Random(seed)
    out = []
    for _ in range(num):
        q, a = word_problem(rng)
        out += [q, f"The answer is \\boxed{{{a}}}.", "<think>\n\n</think>\n\n", "user assistant"]
    return out


def make_tokenizer(out_dir: Path, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """Train a byte-level BPE with the `tokenizers` library; save it with transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    ids = [tok.token_to_id(s) for s in SPECIALS]
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids[2], ids[0]], "pad_token_id": ids[0], "do_sample": True})
    )
    return out_dir


def tiny_model(vocab_size: int) -> ModelConfig:
    """The HF-parity widths (tests/models.py ``hf_tiny``) at 2 layers, all MoE, 4 experts."""
    return hf_tiny(vocab_size=vocab_size, num_layers=2, first_k_dense=0, num_experts=4, max_seq_len=128)


def model_overrides(cfg: ModelConfig) -> list[str]:
    """``model.*`` overrides matching ``cfg`` (what a user writes in the model: section)."""
    keys = (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_query_groups",
        "head_dim",
        "ffn_hidden_size",
        "moe_ffn_hidden_size",
        "num_experts",
        "moe_router_topk",
        "max_seq_len",
    )
    return [f"model.{k}={getattr(cfg, k)}" for k in keys]


def make_checkpoint(out_dir: Path, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random Qwen3MoeForCausalLM of ``cfg`` saved by transformers (save_pretrained) in ``dtype``."""
    import transformers

    from moe_rl.weights.canonical import random_canonical_weights
    from tests.hf_reference import canonical_to_hf_memory, hf_config

    model = transformers.Qwen3MoeForCausalLM(hf_config(cfg)).eval()
    model.load_state_dict(canonical_to_hf_memory(random_canonical_weights(cfg, seed=7), cfg), strict=True)
    model.to(dtype).save_pretrained(str(out_dir))
    return out_dir
