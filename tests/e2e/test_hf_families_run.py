"""e2e of issue 25 point 8: a user brings a checkpoint directory of another family and a dataset,
nothing else. A tiny random DeepSeek-V3 / GLM-4.5 / Qwen2-MoE saved by transformers
(``save_pretrained``, bf16) beside a trained tokenizer; ``moe-rl train init_weights=hf:DIR`` with
no ``model.*`` key but the sequence budget, 2 ranks EP=2, R3 and a user reward; a checkpoint, an
exact resume (metrics and optimizer state), ``export-hf`` and transformers loading the export.

The reward is the response's length in characters (a user ``python:`` reward): a random model
rarely solves a math prompt, so with the math reward every group could score 0, no optimizer
step would run and the resume would never cover the optimizer state. Samples of one prompt
almost never decode to the same length, so every step learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.helpers import VOCAB, deterministic, family_checkpoint, metrics, moe_rl, stopped_copy
from tests.models import HF_FAMILY_TINY

transformers = pytest.importorskip("transformers")
# the tiny tied GLM-4.5 checkpoint's policy is collapsed (train/entropy ~1e-5 nats: its tied
# embedding makes one token dominate), so its samples never differ and it cannot step; its
# resume check covers the unstepped optimizer state (step 0, zero moments) instead
COLLAPSED = {"glm4_moe"}
REWARD = """def score(prompt, response, ground_truth, extra):
    return min(len(response), 40) / 40
"""


def _optimizer_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """A megatron dist checkpoint's optimizer state, read with torch's own DCP reader and
    ``torch.load`` (not the learner's loader): every tensor under an ``optimizer`` key (Adam's
    exp_avg, exp_avg_sq and fp32 params, by flattened key) and each param group's Adam ``step``, as
    ``steps/N``, wherever the format keeps the param groups (``common.pt`` in fully_reshardable, a
    sharded object per optimizer in dp_reshardable, the format written now)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    flat: dict[str, torch.Tensor] = {}
    groups: list[dict] = []

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            groups.extend(v.get("param_groups", []))
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, list | tuple):
            for x in v:
                if isinstance(x, dict):
                    walk(prefix, x)
        elif isinstance(v, torch.Tensor) and "optimizer" in prefix:
            flat[prefix] = v

    walk("", torch.load(out, weights_only=False))
    out.unlink()
    walk("", {"common": torch.load(step_dir / "common.pt", weights_only=False)})
    flat.update({f"steps/{i}": torch.tensor(float(g["step"])) for i, g in enumerate(groups)})
    return flat


@pytest.mark.e2e
@pytest.mark.parametrize("family", sorted(HF_FAMILY_TINY))
def test_family_checkpoint_trains_with_r3_resumes_and_exports(tmp_path: Path, family: str) -> None:
    model_dir, before = family_checkpoint(tmp_path, family)
    moe_layers = HF_FAMILY_TINY[family]().moe_layers
    data = tmp_path / "train.jsonl"
    moe_rl("data", "make-math", str(data), "--num", "24", "--seed", "1")
    reward = tmp_path / "length_reward.py"
    reward.write_text(REWARD)
    args = [
        f"init_weights=hf:{model_dir}",
        "model.max_seq_len=128",  # the run's sequence budget, not an architecture field
        f"task.dataset={data}",
        "task.answer_key=reward_model.ground_truth",
        "task.apply_chat_template=true",
        "task.chat_template_kwargs.enable_thinking=false",
        f"task.reward=python:{reward}:score",
        "task.max_prompt_tokens=64",
        "parallel.nproc=2",
        "parallel.expert_parallel=2",
        "routing.replay=r3",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "algo.num_minibatches=2",
        "checkpoint_every=1",
        "log.progress_bar=false",
        "log.wandb_mode=disabled",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    moe_rl("train", f"run_dir={full}", "steps=2", *args)
    stopped_copy(full, part, step=1)  # as a run stopped after its step-1 checkpoint leaves it
    moe_rl("train", f"run_dir={part}", "steps=2", "resume=true", *args)
    a, b = metrics(full), metrics(part)
    assert sorted(a) == sorted(b) == [0, 1]
    for step in (0, 1):
        same = deterministic(a[step]) == deterministic(b[step])
        assert same, f"{family}: step {step} differs after resume"
        # R3: every response token's route present, one per MoE layer (dense layers carry none)
        assert a[step]["routing/missing_frac"] == 0.0
        per_layer = [k for k in a[step] if k.startswith("routing/flip_router_frac/layer")]
        assert len(per_layer) == len(moe_layers), (family, per_layer)
    cfg_text = (full / "config.yaml").read_text()
    assert f"hf_family: {family}" in cfg_text and f"vocab_size: {VOCAB}" in cfg_text

    out = tmp_path / "exported"
    moe_rl("export-hf", str(full), str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == family and model.config.vocab_size == VOCAB
    after = model.state_dict()
    assert sorted(after) == sorted(before), f"{family}: exported tensor names differ from transformers' own"
    assert next(model.parameters()).dtype == torch.bfloat16  # the checkpoint's own dtype
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    stepped = sum(2 - a[step]["train/skipped_minibatches"] for step in (0, 1))  # 2 minibatches a step
    if family in COLLAPSED:  # every sample of a prompt is the same text: no reward can differ
        assert all(a[s]["train/entropy"] < 1e-3 and a[s]["reward/std"] == 0.0 for s in (0, 1)), family
        assert stepped == 0 and moved == [], f"{family}: no optimizer step, yet {moved[:3]} changed"
    else:
        assert stepped > 0 and a[1]["train/grad_norm"] > 0, f"{family}: no optimizer step to resume"
        assert moved, f"{family}: {stepped} optimizer steps changed no weight"
    # the resumed run's optimizer state (Adam step, exp_avg, exp_avg_sq) is the uninterrupted one's
    ours, theirs = (_optimizer_state(r / "checkpoints" / "step_000002") for r in (full, part))
    assert sorted(ours) == sorted(theirs), (sorted(ours)[:5], sorted(theirs)[:5])
    differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert differ == [], f"{family}: resumed optimizer state differs in {differ[:3]}"
    # Adam's first moments, by key: optimizer.state.exp_avg.<param> (fully_reshardable) or
    # optimizer.distributed.<bucket>.exp_avg (dp_reshardable, the format now written)
    moments = [
        v for k, v in ours.items() if k.startswith("optimizer.state.exp_avg.") or k.endswith(".exp_avg")
    ]
    assert moments and any(bool(v.any()) for v in moments) == (stepped > 0), family
    assert {float(v) for k, v in ours.items() if k.startswith("steps/")} == {float(stepped)}
    ids = torch.tensor([[5, 17, 42, 99, 230]])
    with torch.no_grad():
        logits = model.float()(ids).logits
    assert logits.shape == (1, 5, VOCAB) and bool(torch.isfinite(logits).all())
