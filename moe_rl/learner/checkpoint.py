"""Resumable checkpoints with megatron-core dist checkpointing, written atomically.

Layout under ``RUN_DIR/checkpoints/``:
    step_000040/            megatron dist checkpoint (model + optimizer) + trainer_state.json
    latest                  text file naming the last complete checkpoint directory

A checkpoint is written into ``step_N.tmp``, made durable, then renamed; ``latest`` is replaced
with os.replace. A crash at any point leaves the previous checkpoint and ``latest`` intact.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_rl.dist import barrier
from moe_rl.errors import CheckpointError, DiskFullError, disk_full_named
from moe_rl.fsutil import fsync_path
from moe_rl.fsutil import write_atomic as _write_atomic  # a test replaces it (a full disk)
from moe_rl.learner.build import LEGACY_OPTIM_CKPT_METADATA, OPTIM_CKPT_METADATA

log = logging.getLogger(__name__)
KEEP_LAST = 2
# a save that fails with less than this free under the checkpoint root ran out of space: megatron's
# writer loses the errno (a full disk surfaces as torch's "unexpected pos" RuntimeError)
FULL_DISK_FREE_BYTES = 16 * 2**20


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

    for opt, sd in _optimizer_state_dicts(opt_sd, optimizer):
        if isinstance(opt, DistributedOptimizer) or getattr(opt, "optimizer", None) is None:
            continue
        inner = sd["optimizer"] if "fp32_from_fp16_params" in sd else sd
        steps = {float(s["step"]) for s in opt.optimizer.state.values() if "step" in s}
        if steps == {0.0} and "common_step" not in inner["state"]:
            inner["state"]["common_step"] = torch.tensor(0.0, dtype=torch.float32)


def _optimizer_state_dicts(opt_sd: Any, optimizer) -> list[tuple[Any, Any]]:
    """(optimizer, its part of ``opt_sd``) for each optimizer of a (chained) megatron optimizer."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return list(zip(opts, [opt_sd] if len(opts) == 1 else [opt_sd[i] for i in range(len(opts))]))


def _drop_unsaved_param_state(opt_sd: Any, optimizer) -> None:
    """Remove a DistributedOptimizer's ``param_state`` where it is None.

    With the memory-efficient ``fully_reshardable`` format (``LEGACY_OPTIM_CKPT_METADATA``) megatron
    gathers the optimizer state on data-parallel rank 0, and the other ranks of the group get
    ``param_state = None`` (distrib_optimizer.py, sharded_param_state_fully_reshardable). That None
    stays in their common state dict, which rank 0 alone writes, so it carries nothing; but
    megatron's save compares every rank's common dict with rank 0's and logs "Rank 1 common state
    dict differs ... Keys only on 1: [('optimizer', 0, 'param_state')]" at each checkpoint, which
    reads like corruption. Loading builds the key on every rank (is_loading) and is unaffected."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt, sd in _optimizer_state_dicts(opt_sd, optimizer):
        if isinstance(opt, DistributedOptimizer) and "param_state" in sd and sd["param_state"] is None:
            del sd["param_state"]


def _sharded_state(
    learner, is_loading: bool, metadata: dict[str, Any] = OPTIM_CKPT_METADATA
) -> dict[str, Any]:
    """The model's and optimizer's sharded state; ``metadata``: the optimizer format (the one a
    checkpoint was saved in, when loading)."""
    if not is_loading:
        init_unstepped_state(learner.optimizer)
    model_sd = learner.gpt.sharded_state_dict(prefix="")
    opt_sd = learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    if not is_loading:
        _keep_zero_step(opt_sd, learner.optimizer)
        _drop_unsaved_param_state(opt_sd, learner.optimizer)
        _zero_padding(opt_sd)
    return {"model": model_sd, "optimizer": opt_sd}


def _zero_padding(sd: Any) -> int:
    """Zero the padding pieces of a dp_reshardable optimizer state (returns how many).

    Megatron writes each bucket whole, with the gaps between parameters as padding pieces it
    allocates with ``torch.empty`` (distrib_optimizer.py ``sharded_param_state_dp_reshardable``),
    so the checkpoint's bytes there are whatever memory held: two saves of the same state differ,
    and a resumed run's checkpoint cannot be compared with the uninterrupted run's. The padding is
    never loaded into a parameter."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(sd, list | tuple):
        return sum(_zero_padding(v) for v in sd)
    if not isinstance(sd, dict):
        return 0
    pad = sd.get("padding")
    if isinstance(pad, LocalNonpersistentObject) and pad.unwrap() is True:
        pieces = [v for v in sd.values() if isinstance(v, ShardedTensor)]
        for v in pieces:
            v.data.zero_()
        return len(pieces)
    return sum(_zero_padding(v) for v in sd.values())


def save(learner, ckpt_root: Path, step: int, trainer_state: dict[str, Any]) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory. A full disk is a
    DiskFullError naming the path; the previous checkpoint stays ``latest``."""
    ckpt_root = Path(ckpt_root)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f"step_{step:06d}.tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir()
    barrier()
    _save_state(learner, tmp)
    barrier()
    if rank0:
        try:
            with disk_full_named(tmp):
                _write_atomic(
                    tmp / "trainer_state.json", json.dumps({"step": step, **trainer_state}, indent=1)
                )
                for p in tmp.rglob("*"):
                    if p.is_file():
                        with open(p, "rb") as f:
                            os.fsync(f.fileno())
        except DiskFullError:
            shutil.rmtree(tmp, ignore_errors=True)  # `latest` still names the last good checkpoint
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(ckpt_root)
        with disk_full_named(ckpt_root / "latest"):  # the old pointer stays if its replacement fails
            _write_atomic(ckpt_root / "latest", final.name + "\n")
        _prune(ckpt_root, keep=final.name)
        log.info("checkpoint written: %s", final)
    barrier()
    return final


def _save_state(learner, tmp: Path) -> None:
    """megatron's save into ``tmp``; DiskFullError naming ``tmp`` when it fails on a full disk."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with disk_full_named(tmp):
            dist_checkpointing.save(
                _sharded_state(learner, is_loading=False),
                str(tmp),
                sharded_strategy=uncloned_save_strategy(),
                content_metadata=OPTIM_CKPT_METADATA,
            )
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        if isinstance(e, DiskFullError) or disk_is_full(tmp.parent):
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space; `latest` is untouched
            raise DiskFullError(f"no space left on device: {tmp}") from None
        raise


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its storage is exactly its bytes; else (a contiguous CPU view into a
    larger storage) a tensor over the same memory whose storage is only its slice: no copy.

    Why: megatron's writer (``FileSystemWriterAsync.prepare_write_data``, its ``_clone_if_needed``,
    megatron-core 0.16.1 to 0.19.2) clones every CPU tensor whose storage is larger than the tensor,
    all of them before it writes the first byte (torch.save of a view would write the whole storage).
    The model's weights are views into DDP's parameter buffer and the distributed optimizer's fp32
    main params views into them, so the save held a second copy of both (docs/measurements.md 8).
    The bytes written are the same; the slice keeps the storage it is cut from alive."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == nbytes:
        return t
    start = t.storage_offset() * t.element_size()
    with torch.no_grad():
        # device= too: under a default device of meta (tests/device) a bare empty() is a meta tensor
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage()[start : start + nbytes], 0, t.shape
        )


@functools.cache
def _uncloned_strategy_class() -> type:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy

    class UnclonedSave(SaveShardedStrategy):
        """megatron's default save strategy, handed each ShardedTensor's data as ``exact_storage``
        (after megatron has built the factories' tensors, which are views too)."""

        def __init__(self) -> None:
            self.inner = get_default_save_sharded_strategy()
            super().__init__(self.inner.backend, self.inner.version)

        @property
        def can_handle_sharded_objects(self) -> bool:
            return self.inner.can_handle_sharded_objects

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

            def uncloned(x):
                if isinstance(x, ShardedTensor) and x.data is not None:
                    x.data = exact_storage(x.data)
                return x

            dict_list_map_inplace(uncloned, sharded_state_dict)
            self.inner.save(sharded_state_dict, checkpoint_dir)

    return UnclonedSave


def uncloned_save_strategy():
    """The save strategy ``save`` uses: megatron's default, without its copy of every view."""
    return _uncloned_strategy_class()()


def disk_is_full(path: Path) -> bool:
    """Less than ``FULL_DISK_FREE_BYTES`` free at ``path`` (torch's writers lose ENOSPC's errno)."""
    try:
        return shutil.disk_usage(path).free < FULL_DISK_FREE_BYTES
    except OSError:  # not visible from this rank: say nothing about the disk
        return False


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
        raise CheckpointError(
            f"{ptr} names {path.name}, which is not a complete checkpoint; point it at "
            f"a complete step_N directory"
        )
    return path


def stale_weights_file(step_dir: Path) -> Path:
    """Beside checkpoint ``step_dir``: the engine's stale weight sets (``moe_rl/checkpointing.py``)."""
    return step_dir.parent / f"stale_weights_{step_dir.name}.pt"


def in_flight_file(step_dir: Path, dp_rank: int) -> Path:
    """Beside checkpoint ``step_dir``: data-parallel rank ``dp_rank``'s batches in flight."""
    return step_dir.parent / f"in_flight_{step_dir.name}_dp{dp_rank}.pt"


def check_files(path: Path) -> None:
    """Every ``.distcp`` file the checkpoint's metadata names exists and is long enough for its
    items; CheckpointError naming the file otherwise (megatron's own error is deep and unnamed)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = Path(path) / ".metadata"
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"{meta}: unreadable checkpoint metadata ({type(e).__name__}); the checkpoint in "
            f"{path} is truncated or corrupt: resume from another step"
        ) from None
    need: dict[str, int] = {}
    for item in storage.values():
        need[item.relative_path] = max(need.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(need.items()):
        f = Path(path) / name
        have = f.stat().st_size if f.is_file() else -1
        if have < size:
            what = "is missing" if have < 0 else f"has {have} bytes, its metadata needs {size}"
            raise CheckpointError(
                f"{f} {what}: the checkpoint in {path} is truncated or corrupt; resume from "
                f"another step (point {Path(path).parent / 'latest'} at it)"
            )


def load_sharded(sharded_state: dict[str, Any], path: Path) -> dict[str, Any]:
    """Collective: megatron's load after ``check_files``; a load that still fails on a damaged file
    (EOF, unpickling) is a CheckpointError naming the checkpoint directory."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    check_files(path)
    try:
        return dist_checkpointing.load(sharded_state, str(path))
    except CheckpointException as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        if not any(isinstance(c, EOFError | OSError | pickle.UnpicklingError) for c in causes):
            raise
        kinds = sorted({type(c).__name__ for c in causes})  # their text is torch's advice on weights_only
        raise CheckpointError(
            f"{path}: a file of the checkpoint is truncated or corrupt ({', '.join(kinds)}); "
            f"resume from another step"
        ) from None


def saved_format(path: Path) -> dict[str, Any]:
    """The optimizer format a checkpoint was saved in: its content metadata, or (none: written
    before the format was recorded) the format of that time."""
    from megatron.core import dist_checkpointing

    check_files(path)
    return dist_checkpointing.load_content_metadata(str(path)) or LEGACY_OPTIM_CKPT_METADATA


def load(learner, path: Path) -> dict[str, Any]:
    """Collective: load model + optimizer state in place; returns trainer_state.json."""
    state = load_sharded(_sharded_state(learner, is_loading=True, metadata=saved_format(path)), path)
    learner.gpt.load_state_dict(state["model"], strict=True)
    # no_grad: megatron-core's dp_reshardable loader (unlike its other formats' loaders) copies into
    # the fp32 main params without it, and where those are views of the model's parameters (fp32
    # models; the routers of bf16 ones) torch refuses the in-place copy into a leaf that requires grad
    with torch.no_grad():
        learner.optimizer.load_state_dict(state["optimizer"])
    return json.loads((Path(path) / "trainer_state.json").read_text())
