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

import torch
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


def init_unstepped_state(optimizer) -> int:
    """Give every parameter of an optimizer that has never stepped the state its first step would
    create (Adam: ``step`` 0, zero moments), without stepping; returns how many parameters got one.

    Why: with ``optim.skip_zero_grad`` a run whose minibatches all had zero gradient reaches its
    first checkpoint with an empty Adam state, and megatron's ``DistributedOptimizer.state_dict``
    asserts exactly one ``step`` over it (distrib_optimizer.py:642, 0.16.1 to 0.19.2). Stepping
    on a zero gradient (megatron's ``_init_optimizer_states_with_dummy_values``) would apply weight
    decay; these values are the ones torch's Adam sets itself, so the next real step is the same
    bit for bit, and a resumed run starts from the same state.
    """
    made = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or getattr(opt, "init_state_fn", None) is None:
            continue
        params = [p for g in inner.param_groups for p in g["params"] if len(inner.state[p]) == 0]
        if not params:
            continue
        opt.init_state_fn(inner, opt.config)  # megatron's own: zero exp_avg / exp_avg_sq
        for p in params:
            if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))
        made += len(params)
    return made


def _keep_zero_step(opt_sd: Any, optimizer) -> None:
    """Write Adam's shared ``step`` into a non-distributed optimizer's state dict when it is 0.

    megatron's FP32 / Float16 optimizers save the shared step only ``if step:`` (optimizer.py,
    0.16.1 to 0.19.2), so a step of 0 is dropped and the load fails on torch Adam's missing
    ``step`` (KeyError). The DistributedOptimizer keeps it in its param groups and needs nothing.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    sds = [opt_sd] if len(opts) == 1 else [opt_sd[i] for i in range(len(opts))]
    for opt, sd in zip(opts, sds):
        if isinstance(opt, DistributedOptimizer) or getattr(opt, "optimizer", None) is None:
            continue
        inner = sd["optimizer"] if "fp32_from_fp16_params" in sd else sd
        steps = {float(s["step"]) for s in opt.optimizer.state.values() if "step" in s}
        if steps == {0.0} and "common_step" not in inner["state"]:
            inner["state"]["common_step"] = torch.tensor(0.0, dtype=torch.float32)


def _sharded_state(learner, is_loading: bool) -> dict[str, Any]:
    if not is_loading:
        init_unstepped_state(learner.optimizer)
    model_sd = learner.gpt.sharded_state_dict(prefix="")
    opt_sd = learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                  metadata=OPTIM_CKPT_METADATA)
    if not is_loading:
        _keep_zero_step(opt_sd, learner.optimizer)
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
