"""Launch-time checks of the machine: what a config asks for that this machine cannot run.

Checked when a run starts (``moe_rl.trainer.preflight``, before any rank starts) rather than when a
config loads, so a recipe for a GPU cluster still loads and prints on a laptop. The checks live
with what they check (``learner/te_spec.py``, ``rollout/vllm_engine.py``); this module sits above
them and ``moe_rl.config``, which imports nothing from the package.
"""

from __future__ import annotations

from moe_rl.config import RunConfig


def check_launch(cfg: RunConfig) -> None:
    """What depends on the machine, checked when a run starts rather than when a config loads (so a
    recipe for a GPU cluster still loads and prints on a laptop): Transformer Engine and FP8 need
    CUDA and TE, the vLLM engine needs CUDA and vllm. Raises ConfigError naming the key and why."""
    from moe_rl.learner.te_spec import check_te_environment

    check_te_environment(cfg.model)
    if cfg.rollout.engine == "vllm":
        from moe_rl.rollout.vllm_engine import check_vllm_environment

        check_vllm_environment()
