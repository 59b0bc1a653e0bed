"""e2e, as a new user would do it (issue 13): a local HF model directory (a byte-level BPE tokenizer
trained here with a chat template and generation_config.json, next to a tiny random bf16 Qwen3-MoE
checkpoint with a padded vocabulary), math word problems written by `moe-rl data make-math`
(Parquet for training, JSONL for validation), `moe-rl train` with the math reward and validation,
an exact resume, and `moe-rl export-hf` that transformers loads with its tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moe_rl.tasks.hf_tokenizer import HFTokenizer
from moe_rl.tasks.rows import RowDataset, RowSpec
from tests.e2e.helpers import assert_run_end, deterministic, metrics, moe_rl, stopped_copy
from tests.hf_assets import make_checkpoint, make_tokenizer, model_overrides, tiny_model

transformers = pytest.importorskip("transformers")
MODEL = tiny_model(vocab_size=512)  # the tokenizer has 460 tokens: padded embeddings
MAX_PROMPT = 52


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    make_checkpoint(path, MODEL)  # bf16, as hub checkpoints are
    make_tokenizer(path)  # tokenizer files and generation_config.json beside the weights
    return path


def _args(model_dir: Path, data: Path, val: Path) -> list[str]:
    return [
        f"init_weights=hf:{model_dir}",
        *model_overrides(MODEL),
        "model.first_k_dense=0",
        f"task.dataset={data}",
        f"task.val_dataset={val}",
        "task.answer_key=reward_model.ground_truth",
        "task.apply_chat_template=true",
        "task.chat_template_kwargs.enable_thinking=false",
        "task.reward=math",
        f"task.max_prompt_tokens={MAX_PROMPT}",
        "task.overlong_buffer=4",
        "log.val_every=2",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=12",
        "algo.num_minibatches=2",
        "checkpoint_every=2",
        "log.progress_bar=false",
        "log.wandb_mode=offline",
    ]


@pytest.mark.e2e
def test_train_resume_export_hf_math(tmp_path: Path, model_dir: Path) -> None:
    data, val = tmp_path / "train.parquet", tmp_path / "val.jsonl"
    assert "wrote" in moe_rl("data", "make-math", str(data), "--num", "40", "--seed", "1").stdout
    moe_rl("data", "make-math", str(val), "--num", "6", "--seed", "2")
    # what the run should drop: prompts over MAX_PROMPT tokens after the chat template
    spec = RowSpec(
        answer_key="reward_model.ground_truth",
        apply_chat_template=True,
        chat_template_kwargs={"enable_thinking": False},
    )
    kept = RowDataset(data, dataclasses.replace(spec, max_prompt_tokens=MAX_PROMPT), HFTokenizer(model_dir))
    assert 0 < kept.num_dropped < 40

    full, part = tmp_path / "full", tmp_path / "part"
    args = _args(model_dir, data, val)
    moe_rl("train", f"run_dir={full}", "steps=4", *args)
    stopped_copy(full, part, step=2)  # as a run stopped after its step-2 checkpoint leaves it
    logged = (part / "metrics.jsonl").read_bytes()
    # one command: the saved config.yaml is the base, the architecture read from config.json with
    # it (model.vocab_size=512 there, not the tokenizer's 460); a changed layout is still refused
    resume = ["train", f"run_dir={part}", "steps=4", "resume=true"]
    changed = moe_rl(*resume, "parallel.expert_parallel=1", check=False)
    assert (changed.returncode, changed.stderr.strip().splitlines()[-1]) == (
        2,
        f"error: resume=true: parallel.expert_parallel=1 but the run in {part} was made with "
        f"parallel.expert_parallel=2 ({part}/config.yaml); a checkpoint cannot change it: use "
        f"parallel.expert_parallel=2 or a new run_dir=",
    )
    assert "Traceback" not in changed.stderr and (part / "metrics.jsonl").read_bytes() == logged  # untouched
    assert_run_end(moe_rl(*resume), part, resumed_from=2)
    a, b = metrics(full), metrics(part)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in range(4):
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    for step in range(4):
        rec = a[step]
        assert rec["rollout/prompts_dropped_too_long"] == kept.num_dropped
        assert rec["reward/error_frac"] == 0.0 and rec["reward/timeout_frac"] == 0.0
        assert rec["rollout/truncated_frac"] + rec["rollout/finished_frac"] == 1.0
        # one data source (make-math): its reward is the step's, the math score in [0, 1]
        assert rec["reward/mean/arith_words"] == rec["reward/mean"] and 0 <= rec["reward/mean"] <= 1
        # DAPO penalty over the last 4 of 12 tokens: -1 for a response that hit max_new_tokens,
        # in [-1, 0) inside the window, 0 before it
        pen, over = rec["reward/overlong_penalty_mean"], rec["reward/overlong_frac"]
        cut = rec["rollout/truncated_frac"]
        assert -over - 1e-9 <= pen <= -cut + 1e-9 and cut <= over <= 1
        # validation on steps 0 and 2 only, greedy and sampled, per data source
        has_val = {k for k in rec if k.startswith("val/")}
        assert has_val == (
            {
                "val/reward/mean",
                "val/reward/mean/arith_words",
                "val/reward_sampled/mean",
                "val/reward_sampled/mean/arith_words",
            }
            if step % 2 == 0
            else set()
        )
    assert a[0]["val/reward/mean"] == a[0]["val/reward/mean/arith_words"]
    cfg_text = (full / "config.yaml").read_text()
    assert "vocab_size: 512" in cfg_text and "enable_thinking: false" in cfg_text

    report = moe_rl("report", str(full)).stdout
    assert "report.html" in report
    md = (full / "report" / "report.md").read_text()
    assert "validation reward, greedy, first" in md and "truncated responses (mean)" in md

    out = tmp_path / "exported"
    moe_rl("export-hf", str(part), str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert next(model.parameters()).dtype.__repr__() == "torch.bfloat16"  # the checkpoint's own dtype
    assert model.config.vocab_size == 512 and len(tok) == 460
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    size_in = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    size_out = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert abs(size_out - size_in) < 0.01 * size_in  # bf16 in, bf16 out (not twice the size)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "override, needle",
    [
        ("task.tokenizer=hf:/nonexistent/tok", "tokenizer directory /nonexistent/tok does not exist"),
        ("task.reward=bleu", "unknown reward 'bleu'"),
        ("task.reward=python:/nonexistent/r.py:score", "/nonexistent/r.py does not exist"),
        ("task.answer_key=answer", "row 1: missing key 'answer'"),
        ("task.max_prompt_tokens=5", "no prompts left after filtering (all 10 are longer than 5 tokens)"),
        # the architecture comes from config.json (512 rows): a contradicting override names both
        ("model.vocab_size=400", "'model.vocab_size': 400 contradicts"),
    ],
)
def test_bad_input_fails_before_any_rank(tmp_path: Path, model_dir: Path, override: str, needle: str) -> None:
    data, val = tmp_path / "train.parquet", tmp_path / "val.jsonl"
    moe_rl("data", "make-math", str(data), "--num", "10")
    moe_rl("data", "make-math", str(val), "--num", "2")
    run = tmp_path / "r"
    proc = moe_rl("train", f"run_dir={run}", *_args(model_dir, data, val), override, check=False, timeout=120)
    assert proc.returncode != 0 and needle in proc.stderr, proc.stderr[-2000:]
    assert not run.exists() and "Traceback" not in proc.stderr
