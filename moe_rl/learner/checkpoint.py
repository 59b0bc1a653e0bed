"""Resumable checkpoints with megatron-core dist checkpointing, written atomically.

Layout under ``RUN_DIR/checkpoints/``:
    step_000040/            megatron dist checkpoint (model + optimizer) + trainer_state.json
    latest                  text file naming the last complete checkpoint directory

A checkpoint is written into ``step_N.tmp``, made durable, then renamed; ``latest`` is replaced
with os.replace. A crash at any point leaves the previous checkpoint and ``latest`` intact.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moe_rl.dist import barrier
from moe_rl.errors import CheckpointError
from moe_rl.fsutil import fsync_path
from moe_rl.learner.setup import OPTIM_CKPT_METADATA

log = logging.getLogger(__name__)
KEEP_LAST = 2


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sharded_state(learner, is_loading: bool) -> dict[str, Any]:
    model_sd = learner.gpt.sharded_state_dict(prefix="")
    opt_sd = learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                  metadata=OPTIM_CKPT_METADATA)
    return {"model": model_sd, "optimizer": opt_sd}


def save(learner, ckpt_root: Path, step: int, trainer_state: dict[str, Any]) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    from megatron.core import dist_checkpointing

    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir()
    barrier()
    dist_checkpointing.save(_sharded_state(learner, is_loading=False), str(tmp))
    barrier()
    if rank0:
        _write_atomic(tmp / "trainer_state.json", json.dumps({"step": step, **trainer_state}, indent=1))
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(ckpt_root)
        _write_atomic(ckpt_root / "latest", final.name + "\n")
        _prune(ckpt_root, keep=final.name)
        log.info("checkpoint written: %s", final)
    barrier()
    return final


def _prune(ckpt_root: Path, keep: str) -> None:
    done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for p in done[:-KEEP_LAST]:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)


def latest(ckpt_root: Path) -> Path | None:
    """The last complete checkpoint, or None. A dangling pointer is an error, not a silent restart."""
    ptr = Path(ckpt_root) / "latest"
    if not ptr.is_file():
        return None
    path = Path(ckpt_root) / ptr.read_text().strip()
    if not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"{ptr} names {path.name}, which is not a complete checkpoint; point it at "
                              f"a complete step_N directory")
    return path


def load(learner, path: Path) -> dict[str, Any]:
    """Collective: load model + optimizer state in place; returns trainer_state.json."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded_state(learner, is_loading=True), str(path))
    learner.gpt.load_state_dict(state["model"], strict=True)
    learner.optimizer.load_state_dict(state["optimizer"])
    return json.loads((Path(path) / "trainer_state.json").read_text())
