"""``moe-rl export-hf``: a run's megatron dist checkpoint -> a Hugging Face checkpoint, on the run's
own parallel layout.

The run's ranks (started as for training, ``moe_rl/launch.py``) build the learner, load the model
part of the checkpoint, gather the canonical weights and write them from rank 0 with
``moe_rl.weights.hf.write_hf_checkpoint`` (the file format lives there; this module is an entry
point beside ``cli.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from moe_rl.errors import CheckpointError, ConfigError, DiskFullError, disk_full_named
from moe_rl.weights.hf import write_hf_checkpoint

log = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, step: int | None) -> Path:
    from moe_rl.learner import checkpoint

    root = Path(run_dir) / "checkpoints"
    if step is None:
        path = checkpoint.latest(root)
        if path is None:
            raise CheckpointError(f"{root} has no complete checkpoint")
        return path
    path = root / f"step_{step:06d}"
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint")
    return path


def export_from_checkpoint(
    learner,
    ckpt: Path,
    out_dir: Path,
    max_shard_bytes: int,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> None:
    """Collective: load the model part of a dist checkpoint into ``learner`` and write it as an HF
    checkpoint from rank 0 (every rank gathers the experts), in ``dtype`` (default: as trained),
    with ``extra_files`` (the tokenizer's) beside it."""
    import torch.distributed as dist

    from moe_rl.learner import checkpoint

    state = checkpoint.load_sharded(
        {"model": learner.gpt.sharded_state_dict(prefix="")}, ckpt
    )  # names bad files
    learner.gpt.load_state_dict(state["model"], strict=True)
    canonical = learner.export_canonical()
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            with disk_full_named(out_dir):
                write_hf_checkpoint(
                    out_dir, canonical, learner.model_cfg, max_shard_bytes, dtype, extra_files
                )
        except DiskFullError:
            shutil.rmtree(
                Path(out_dir).with_name(Path(out_dir).name + ".tmp"), ignore_errors=True
            )  # frees it
            raise
        log.info("HF checkpoint written: %s (from %s)", out_dir, ckpt)
    if dist.is_initialized():
        dist.barrier()


def _export_worker(
    cfg,
    ckpt: Path,
    out_dir: Path,
    max_shard_bytes: int,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> None:
    import megatron_patches
    from moe_rl import dist
    from moe_rl.learner.learner import Learner

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.setup_logging(int(os.environ.get("RANK", "0")))
    megatron_patches.apply_all()
    ctx = dist.init_distributed(cfg.parallel, cfg.seed)
    finished = False
    try:
        learner = Learner(cfg.model, cfg.parallel, cfg.optim, ctx, monitor=False)
        export_from_checkpoint(learner, ckpt, out_dir, max_shard_bytes, dtype, extra_files)
        finished = True
    finally:
        dist.shutdown(clean=finished)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_dtype(name: str, init_weights: str) -> torch.dtype:
    """``--dtype``: bf16 | fp16 | fp32, or auto: the dtype of the run's ``init_weights=hf:DIR``
    checkpoint (a bf16 checkpoint comes back bf16, not twice the size), else fp32."""
    if name != "auto":
        return DTYPES[name]
    if init_weights.startswith("hf:") and Path(init_weights[3:]).is_dir():
        from moe_rl.weights.hf import checkpoint_dtype

        return checkpoint_dtype(init_weights[3:])
    return torch.float32


def tokenizer_files(cfg) -> dict[str, bytes]:
    """The run's HF tokenizer files (and generation_config.json), {} for the built-in tokenizer."""
    from moe_rl.tasks.hf_tokenizer import TOKENIZER_FILES, tokenizer_dir

    directory = tokenizer_dir(cfg.task.tokenizer, cfg.init_weights)
    if not directory:
        return {}
    return {n: (Path(directory) / n).read_bytes() for n in TOKENIZER_FILES if (Path(directory) / n).is_file()}


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str = "auto",
) -> None:
    """`moe-rl export-hf`: the run's ranks (its parallel layout) load a checkpoint and write HF, with
    the run's tokenizer files, in ``dtype`` (``export_dtype``)."""
    from moe_rl.config import load_config
    from moe_rl.launch import spawn_local, under_torchrun

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg = load_config(run_dir / "config.yaml")
    if cfg.model.vocab_size <= 0:
        raise ConfigError(f"{run_dir / 'config.yaml'}: model.vocab_size is not resolved")
    ckpt = checkpoint_dir(run_dir, step)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} already exists; an HF export never overwrites")
    from moe_rl.learner import checkpoint

    checkpoint.check_files(ckpt)  # a truncated file is named here, before any rank starts
    args = (cfg, ckpt, out_dir, max_shard_bytes, export_dtype(dtype, cfg.init_weights), tokenizer_files(cfg))
    if under_torchrun():
        _export_worker(*args)
        return
    spawn_local(_export_worker, cfg.parallel.nproc, *args)
