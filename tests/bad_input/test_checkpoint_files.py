"""bad_input tier: a damaged or unwritable checkpoint names its file (moe_rl/learner/checkpoint.py).

One rank (gloo, CPU) saves a real megatron dist checkpoint, then: a save on a full disk is one
``no space left on device: PATH`` error that leaves the last good checkpoint ``latest`` and no
partial ``step_N.tmp``; a truncated ``.distcp`` file, a missing one and a truncated ``.metadata``
are named on load (resume and ``export-hf`` both load through ``checkpoint.load_sharded``), and
``moe-rl export-hf`` names a truncated file in-process, before any rank starts.

On a real full disk (a 64 KiB tmpfs, checked by hand) megatron's writer fails with torch's
``CheckpointException`` around ``RuntimeError('Worker failure: [enforce fail at
inline_container.cc:672] . unexpected pos 704 vs 598')``: the errno is lost, so the save reads
the free space; here the writer raises that same exception and the free-space bound is lifted.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from moe_rl.config import load_config, to_yaml
from tests.cli_helpers import fails_with
from tests.dist_harness import run_ranks
from tests.hf_assets import model_overrides
from tests.models import TINY_MOE_L2_ALL_MOE as MODEL


def _error(fn) -> str:
    from moe_rl.errors import UserError

    try:
        fn()
    except UserError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _full_disk_save(learner, root: Path, checkpoint) -> dict:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    real_save = dist_checkpointing.save

    def full(state, path):
        (Path(path) / "__0_0.distcp").write_bytes(b"partial")
        cause = RuntimeError(
            "Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
        )
        raise CheckpointException("write", {0: (cause, [])})

    def enospc(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = {}
    dist_checkpointing.save, checkpoint.FULL_DISK_FREE_BYTES = full, 2**62
    out["megatron"] = _error(lambda: checkpoint.save(learner, root, 2, {}))
    dist_checkpointing.save, checkpoint.FULL_DISK_FREE_BYTES = real_save, 16 * 2**20
    real_write, checkpoint._write_atomic = checkpoint._write_atomic, enospc
    out["state"] = _error(lambda: checkpoint.save(learner, root, 3, {}))
    checkpoint._write_atomic = real_write
    out["after"] = (sorted(p.name for p in root.iterdir()), (root / "latest").read_text())
    return out


def _worker(rank: int, root: str) -> dict:
    from moe_rl import dist
    from moe_rl.config import OptimConfig, ParallelConfig
    from moe_rl.learner import checkpoint
    from moe_rl.learner.learner import Learner
    from moe_rl.weights.canonical import random_canonical_weights

    par = ParallelConfig(nproc=1, expert_parallel=1)
    ctx = dist.init_distributed(par, seed=7)
    learner = Learner(MODEL, par, OptimConfig(), ctx, random_canonical_weights(MODEL, seed=0))
    root_p = Path(root)
    path = checkpoint.save(learner, root_p, 1, {})
    out = _full_disk_save(learner, root_p, checkpoint)
    out["good"] = checkpoint.load(learner, path)
    shutil.copytree(path, root_p / "run" / "checkpoints" / path.name)  # for export-hf in the parent
    (root_p / "run" / "checkpoints" / "latest").write_text(path.name + "\n")
    out["sizes"] = {p.name: p.stat().st_size for p in path.glob("*.distcp")}
    shard = min(path.glob("*.distcp"))
    blob = shard.read_bytes()
    out["size"] = len(blob)
    shard.write_bytes(blob[:1000])
    out["truncated"] = _error(lambda: checkpoint.load(learner, path))
    shard.write_bytes(b"\0" * len(blob))  # full length, but not torch's format
    out["zeroed"] = _error(lambda: checkpoint.load(learner, path))
    shard.unlink()
    out["missing"] = _error(lambda: checkpoint.load(learner, path))
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    out["metadata"] = _error(lambda: checkpoint.load(learner, path))
    dist.shutdown()
    return out


@pytest.mark.bad_input
@pytest.mark.dist
def test_checkpoint_disk_full_and_damaged_files_are_named(tmp_path):
    out = run_ranks(_worker, 1, str(tmp_path))[0]
    step1 = tmp_path / "step_000001"
    assert out["megatron"] == f"DiskFullError: no space left on device: {tmp_path / 'step_000002.tmp'}"
    assert out["state"] == f"DiskFullError: no space left on device: {tmp_path / 'step_000003.tmp'}"
    assert out["after"] == (["latest", "step_000001"], "step_000001\n")  # the last good one stays latest
    assert out["good"] == {"step": 1}
    shard = step1 / "__0_0.distcp"
    assert out["truncated"] == (
        f"CheckpointError: {shard} has 1000 bytes, its metadata needs {out['size']}: the "
        f"checkpoint in {step1} is truncated or corrupt; resume from another step (point "
        f"{tmp_path / 'latest'} at it)"
    )
    assert out["zeroed"] == (
        f"CheckpointError: {step1}: a file of the checkpoint is truncated or corrupt "
        f"(UnpicklingError); resume from another step"
    )
    assert out["missing"] == (
        f"CheckpointError: {shard} is missing: the checkpoint in {step1} is truncated or "
        f"corrupt; resume from another step (point {tmp_path / 'latest'} at it)"
    )
    assert out["metadata"] == (
        f"CheckpointError: {step1 / '.metadata'}: unreadable checkpoint metadata "
        f"(UnpicklingError); the checkpoint in {step1} is truncated or corrupt: resume "
        f"from another step"
    )

    # export-hf names a truncated file before any rank starts (the run's own checkpoint, in-process)
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"run_dir={run}",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
            *model_overrides(MODEL),
        ],
    )
    (run / "config.yaml").write_text(to_yaml(cfg))
    shard = run / "checkpoints" / "step_000001" / "__0_1.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    fails_with(
        tmp_path,
        f"{shard} has {out['sizes'][shard.name] - 1} bytes, its metadata needs {out['sizes'][shard.name]}: "
        f"the checkpoint in "
        f"{shard.parent} is truncated or corrupt; resume from another step (point "
        f"{run / 'checkpoints' / 'latest'} at it)",
        "export-hf",
        str(run),
        str(tmp_path / "hf"),
    )
