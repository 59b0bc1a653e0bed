"""e2e: every rollout-correction preset (configs/corrections/*.yaml) trains, each loaded by the
real config loader and run by the real training loop (``moe_rl.trainer.train``: megatron-core on 2
gloo ranks, the built-in engine, metrics.jsonl) for 2 steps, with a bf16 engine and router noise so
that the corrections meet a real rollout/learner mismatch.

One spawn of 2 ranks trains every preset in turn, in one process group (the CLI's launch, the same
for every preset, is covered by tests/e2e/test_train_cli.py): 13 CLI launches cost 13 imports of
torch and megatron-core and 13 process-group starts, about 2.5 min of CI (docs/testing.md 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_harness import run_ranks
from tests.e2e.helpers import metrics

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted((CONFIGS / "corrections").glob("*.yaml"))
SAMPLING = sorted((CONFIGS / "sampling").glob("*.yaml"))  # dynamic sampling (docs/sampling.md)
ARGS = [
    "steps=2",
    "checkpoint_every=0",
    "rollout.router_noise=0.05",  # bf16 engine + router noise: a real mismatch for the corrections
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "log.progress_bar=false",
    "log.wandb_mode=disabled",
]


def _train_each(rank: int, runs: dict[str, str]) -> None:
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from moe_rl import dist, trainer
    from moe_rl.config import load_config

    dims = None
    for preset, run_dir in runs.items():
        cfg = load_config(preset, [*ARGS, f"run_dir={run_dir}"])
        if dims is None:  # every preset has the default layout: one process group for all
            dims = dist.init_distributed(cfg.parallel, cfg.seed)
        torch.manual_seed(cfg.seed)  # each run starts from the seeds a fresh launch sets
        model_parallel_cuda_manual_seed(cfg.seed)
        trainer.train(cfg, dims)
    dist.shutdown(clean=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    out = {str(p): root / p.stem for p in [*PRESETS, *SAMPLING]}
    run_ranks(_train_each, 2, {k: str(v) for k, v in out.items()})
    return {Path(k).stem: v for k, v in out.items()}


@pytest.mark.e2e
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_correction_preset_trains(runs: dict[str, Path], preset: Path) -> None:
    rec = metrics(runs[preset.stem])[1]
    everything_rejected = rec.get("corr/rs_masked_fraction") == 1.0 or rec.get("corr/trm_accept_rate") == 0.0
    assert rec["corr/k3_kl"] > 0 and (rec["train/grad_norm"] > 0 or everything_rejected)
    text = preset.read_text()
    if "is_level" in text:
        assert rec["corr/is_mean"] > 0 and 0 < rec["corr/is_ess"] <= 1
    if "rejection:" in text:
        assert 0.0 <= rec["corr/rs_masked_fraction"] <= 1.0
    if "dvp_threshold" in text:
        assert rec["corr/dvp_outside_frac"] == 0.0  # the engine sampled inside the safe set
        assert 0.0 <= rec["corr/dvp_pruned_mass"] < 1.0 and rec["corr/dvp_safe_size"] >= 1.0
    if "trm:" in text:
        assert 0.0 <= rec["corr/trm_accept_rate"] <= 1.0
        assert rec["corr/trm_alarm"] == float(rec["corr/trm_accept_rate"] < 0.7)


@pytest.mark.e2e
@pytest.mark.parametrize("preset", SAMPLING, ids=lambda p: p.stem)
def test_sampling_preset_trains_only_groups_with_signal(runs: dict[str, Path], preset: Path) -> None:
    """Every trained group's accuracies differ (so no minibatch is all-zero advantages and none is
    skipped) unless the rounds' cap was reached, which the step then says."""
    for rec in metrics(runs[preset.stem]).values():
        rounds, dropped = rec["sampling/rounds"], rec["sampling/groups_dropped_all_equal"]
        assert rec["sampling/groups_generated"] == 8 * rounds and 1 <= rounds <= 4  # max_rounds
        assert rec["sampling/useful_frac"] == pytest.approx((8 * rounds - dropped) / (8 * rounds))
        assert rec["rollout/num_seqs"] == 32  # the configured 8 groups x 4 samples, whatever the rounds
        if rec["sampling/cap_reached"] == 0:
            assert (rec["sampling/groups_kept"], rec["train/skipped_minibatches"]) == (8, 0)
        assert rec["reward/overlong_frac"] >= 0  # the shaping ran; the filter read the accuracy
