"""e2e of issue 25 point 8: a user brings a checkpoint directory of another family and a dataset,
nothing else. A tiny random DeepSeek-V3 / GLM-4.5 / Qwen2-MoE saved by transformers
(``save_pretrained``, bf16) beside a trained tokenizer; the arguments of ``moe-rl train
init_weights=hf:DIR`` with no ``model.*`` key but the sequence budget, 2 ranks EP=2, R3 and a user
reward, through the loader the CLI uses and the real training loop (every family in one 2-rank
spawn; the CLI's own launch of an HF directory is test_hf_math_run.py's); a checkpoint, an exact
resume (metrics and optimizer state), ``moe-rl export-hf`` and transformers loading the export.

The reward is the response's length in characters (a user ``python:`` reward): a random model
rarely solves a math prompt, so with the math reward every group could score 0, no optimizer
step would run and the resume would never cover the optimizer state. Samples of one prompt
almost never decode to the same length, so every step learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_ranks
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


def _args(model_dir: str, data: str, reward: str) -> list[str]:
    return [
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


def _train_and_resume_each(rank: int, jobs: list[tuple[list[str], str, str]]) -> None:
    """Per family: the 2-step run, then (rank 0 copies it as stopped after step 1) its resume, each
    through the loader ``moe-rl train`` uses and the real training loop, in one process group."""
    import torch.distributed as tdist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from moe_rl import dist, trainer
    from moe_rl.config.loader import load_run_config

    dims = None
    for args, full, part in jobs:
        for overrides in (
            [f"run_dir={full}", "steps=2", *args],
            [f"run_dir={part}", "steps=2", "resume=true", *args],
        ):
            cfg = load_run_config(None, overrides)
            if dims is None:  # every family runs EP=2 on the 2 ranks: one process group for all
                dims = dist.init_distributed(cfg.parallel, cfg.seed)
            torch.manual_seed(cfg.seed)  # each run starts from the seeds a fresh launch sets
            model_parallel_cuda_manual_seed(cfg.seed)
            trainer.train(cfg, dims)
            if not cfg.resume:
                if rank == 0:  # as a run stopped after its step-1 checkpoint leaves it
                    stopped_copy(Path(full), Path(part), step=1)
                tdist.barrier()
    dist.shutdown(clean=True)


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict, Path, Path]]:
    """family -> (its HF checkpoint dir, transformers' state dict of it, the full run, the resumed
    copy). One spawn of 2 ranks trains and resumes every family (a `moe-rl train` launch each cost
    about 15 s more, docs/testing.md 6; the CLI's HF start is test_hf_math_run.py's)."""
    root = tmp_path_factory.mktemp("families")
    data = root / "train.jsonl"
    moe_rl("data", "make-math", str(data), "--num", "24", "--seed", "1")
    reward = root / "length_reward.py"
    reward.write_text(REWARD)
    out, jobs = {}, []
    for family in sorted(HF_FAMILY_TINY):
        model_dir, before = family_checkpoint(root / family, family)
        full, part = root / family / "full", root / family / "part"
        out[family] = (model_dir, before, full, part)
        jobs.append((_args(str(model_dir), str(data), str(reward)), str(full), str(part)))
    run_ranks(_train_and_resume_each, 2, jobs)
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("family", sorted(HF_FAMILY_TINY))
def test_family_checkpoint_trains_with_r3_resumes_and_exports(
    tmp_path: Path, family: str, family_runs: dict
) -> None:
    model_dir, before, full, part = family_runs[family]
    moe_layers = HF_FAMILY_TINY[family]().moe_layers
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
