"""The task side built from the config: vocabulary resolution, the reward pool, the export dtype."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moe_rl.config import RunConfig, load_config
from moe_rl.export import export_dtype, tokenizer_files
from moe_rl.tasks.dataset import GeneratedTasks
from moe_rl.tasks.hf_tokenizer import HFTokenizer, TokenizerError
from moe_rl.tasks.task import build_task, resolve_vocab, row_spec
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.weights.hf_config import hf_config_dict
from tests.models import hf_tiny


@pytest.mark.unit
def test_vocab_from_checkpoint_tokenizer_or_config(hf_tok_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config_dict(hf_tiny(vocab_size=512))))
    cfg = load_config(None, [f"init_weights=hf:{model_dir}"])  # the model: section from config.json
    assert cfg.model.vocab_size == 512
    assert resolve_vocab(cfg, HFTokenizer(hf_tok_dir)).model.vocab_size == 512  # padded, from config.json
    unresolved = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=0))
    assert resolve_vocab(unresolved, HFTokenizer(hf_tok_dir)).model.vocab_size == 512  # read again
    assert resolve_vocab(RunConfig(), CharTokenizer()).model.vocab_size == 50
    with pytest.raises(
        TokenizerError, match=r"has 460 tokens but the model's vocabulary \(model.vocab_size\) has only 64"
    ):
        resolve_vocab(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=64)),
            HFTokenizer(hf_tok_dir),
        )


@pytest.mark.unit
def test_default_task_is_the_builtin_one() -> None:
    cfg, task = build_task(RunConfig(), start_pool=False)
    assert isinstance(task.tokenizer, CharTokenizer) and isinstance(task.source, GeneratedTasks)
    assert task.val_source is None and not task.text_metrics and task.pool.workers == 0
    assert cfg.model.vocab_size == 50
    assert row_spec(cfg).max_prompt_tokens == 64 - 12  # model.max_seq_len - rollout.max_new_tokens
    math_cfg = load_config(None, ["task.reward=math"])
    _, task = build_task(math_cfg, start_pool=False)
    assert task.text_metrics and task.pool.workers == 2


@pytest.mark.unit
def test_export_dtype_and_tokenizer_files(hf_tok_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"a": torch.zeros(2, dtype=torch.bfloat16)}, str(ckpt / "model.safetensors"))
    assert export_dtype("auto", f"hf:{ckpt}") == torch.bfloat16
    assert export_dtype("auto", "builtin:warmstart") == torch.float32
    assert export_dtype("fp16", f"hf:{ckpt}") == torch.float16
    cfg = load_config(None, [f"task.tokenizer=hf:{hf_tok_dir}"])
    assert sorted(tokenizer_files(cfg)) == [
        "chat_template.jinja",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert tokenizer_files(RunConfig()) == {}


@pytest.mark.unit
def test_chat_template_auto_is_the_default_from_the_config(hf_tok_dir: Path, tmp_path: Path) -> None:
    """task.apply_chat_template: auto by default; true/false as overrides or YAML booleans still work;
    a verl file of chat prompts goes through the template with no flag set."""
    from moe_rl.tasks.make_data import make_rows, write_math_dataset

    assert load_config(None).task.apply_chat_template == "auto"
    (tmp_path / "c.yaml").write_text("task:\n  apply_chat_template: true\n")
    assert load_config(tmp_path / "c.yaml").task.apply_chat_template == "true"
    assert [
        load_config(None, [f"task.apply_chat_template={v}"]).task.apply_chat_template
        for v in ("false", "True", "auto")
    ] == ["false", "true", "auto"]
    data = write_math_dataset(tmp_path / "train.parquet", 4, seed=5)
    cfg = load_config(
        None,
        [
            f"task.tokenizer=hf:{hf_tok_dir}",
            f"task.dataset={data}",
            "task.reward=math",
            "task.answer_key=reward_model.ground_truth",
            "model.max_seq_len=512",
            "task.chat_template_kwargs.enable_thinking=false",
        ],
    )
    _, task = build_task(cfg, start_pool=False)
    question = make_rows(4, 5, "verl")[0]["prompt"][0]["content"]
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert task.source.prompts[0].text == text
    assert task.source.prompts[0].prompt_ids == task.tokenizer.encode(text)
