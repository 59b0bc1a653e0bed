"""Launch-time checks of the machine: what a config asks for that this machine cannot run.

Checked when a run starts (``moe_rl.trainer.preflight``, before any rank starts) rather than when a
config loads, so a recipe for a GPU cluster still loads and prints on a laptop. The checks live
with what they check (``learner/te_spec.py``, ``rollout/vllm_engine.py``); this module sits above
them and ``moe_rl.config``, which imports nothing from the package.
"""

from __future__ import annotations

import os

import torch

from moe_rl.config import ConfigError, RunConfig


def check_launch(cfg: RunConfig) -> None:
    """What depends on the machine, checked when a run starts rather than when a config loads (so a
    recipe for a GPU cluster still loads and prints on a laptop): Transformer Engine and FP8 need
    CUDA and TE, the vLLM engine needs CUDA and vllm. Raises ConfigError naming the key and why."""
    from moe_rl.learner.te_spec import check_te_environment

    check_te_environment(cfg.model)
    check_devices(cfg, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if cfg.rollout.engine == "vllm":
        from moe_rl.rollout.vllm_engine import check_vllm_environment

        check_vllm_environment()
        if cfg.rollout.vllm.tensor_parallel > 1:
            # vllm 0.33 under external_launcher: only the first rank of a TP group owns the
            # routed-experts output (distributed/aux_output_connector/worker.py); the other ranks'
            # schedulers assert on the missing rows (connector.py take_output)
            raise ConfigError(f"config key 'rollout.vllm.tensor_parallel': {cfg.rollout.vllm.tensor_parallel} > 1 "
                              "is not supported: vLLM returns routed experts only on the first rank of each "
                              "tensor-parallel group, and every rank needs its samples' routes; use 1")


def check_devices(cfg: RunConfig, num_gpus: int) -> None:
    """The ranks this machine starts fit its GPUs (one each), and NCCL has CUDA. ``num_gpus`` is
    what this machine has (0 without CUDA); under torchrun/Slurm each node starts LOCAL_WORLD_SIZE
    ranks, otherwise ``parallel.nproc`` local ranks."""
    p = cfg.parallel
    if p.backend == "nccl" and num_gpus == 0:
        raise ConfigError("config key 'parallel.backend': nccl needs CUDA, and this machine has no GPU; "
                          "use parallel.backend=gloo (or auto)")
    if num_gpus == 0 or p.backend == "gloo":
        return
    external = "LOCAL_WORLD_SIZE" in os.environ  # torchrun/Slurm: this node's share of the ranks
    if not external and p.expert_parallel > num_gpus:
        raise ConfigError(f"config key 'parallel.expert_parallel': {p.expert_parallel} is larger than the "
                          f"{num_gpus} GPU(s) of this machine (a local run spans one machine)")
    local = int(os.environ["LOCAL_WORLD_SIZE"]) if external else p.nproc
    if local > num_gpus:
        what = f"the launcher starts {local} ranks on this node" if external else f"{local} local ranks"
        raise ConfigError(f"config key 'parallel.nproc': {what} but this machine has {num_gpus} GPU(s): "
                          "one rank per GPU")
