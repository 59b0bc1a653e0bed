"""Start the training ranks: torch's elastic launch on one machine, or nothing under torchrun.

`moe-rl train` starts `parallel.nproc` local ranks with torch.distributed's elastic launcher (the
same machinery as `torchrun --standalone`). Under an external `torchrun`/Slurm launch the
environment already names the rank, and the worker runs directly.

Fail fast (issue 14): a rank that raises never waits for its peers (``dist.shutdown`` skips the
barrier after an exception). Under ``spawn_local`` it records its error (``_RankFailure``: rank,
time, the exception, its traceback) in the job's report directory and leaves at once
(``os._exit``); the elastic agent sees the exit within ``monitor_interval`` and stops the other
ranks, and the launcher re-raises the first failure once: a ``UserError`` as itself (the CLI prints
one line), anything else as ``RankFailedError`` carrying the rank's traceback.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_rl.config import RunConfig
from moe_rl.errors import UserError



class RankFailedError(RuntimeError):
    """A rank of a local job raised something that is not a user error (a bug): its traceback."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def run_worker(cfg: RunConfig) -> None:
    """One rank's whole life: patches, process groups, the training loop, teardown."""
    import megatron_patches
    from moe_rl import dist, trainer

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        # share the CPU cores between local ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.setup_logging(int(os.environ.get("RANK", "0")))
    megatron_patches.apply_all()
    dims = dist.init_distributed(cfg.parallel, cfg.seed)
    finished = False
    try:
        trainer.train(cfg, dims)
        finished = True
    finally:
        dist.shutdown(clean=finished)  # after an exception: no barrier, a peer may never arrive


@dataclass
class _RankFailure:
    rank: int
    time: float
    exc: BaseException | None  # None when it does not pickle
    kind: str
    message: str
    traceback: str

    def reraise(self) -> None:
        if isinstance(self.exc, UserError):
            raise type(self.exc)(f"rank {self.rank}: {self.exc}") from None
        raise RankFailedError(f"rank {self.rank} failed with {self.kind}: {self.message}\n"
                              f"--- rank {self.rank} traceback ---\n{self.traceback}") from None


def _guarded(fn, report_dir: str, *args):
    """A rank's ``fn(*args)``; on any exception: record it for the launcher, then exit at once
    (no teardown that could wait for a peer)."""
    try:
        return fn(*args)
    except SystemExit as e:
        if e.code in (0, None):
            raise  # a clean exit is not a failure
        _record_and_exit(report_dir, e)
    except BaseException as e:  # noqa: BLE001 - recorded and re-raised by the launcher
        _record_and_exit(report_dir, e)


def _record_and_exit(report_dir: str, e: BaseException) -> None:
    """Must run inside the ``except`` block (``traceback.format_exc``)."""
    when = time.time()
    rank = int(os.environ.get("RANK", "0"))
    try:
        exc = pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        exc = None
    failure = _RankFailure(rank, when, exc, type(e).__name__, str(e), traceback.format_exc())
    tmp = Path(report_dir) / f".rank{rank}.tmp"
    tmp.write_bytes(pickle.dumps(failure))
    tmp.rename(Path(report_dir) / f"rank{rank}.pkl")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _first_failure(report_dir: Path) -> _RankFailure | None:
    failures = [pickle.loads(p.read_bytes()) for p in sorted(report_dir.glob("rank*.pkl"))]
    return min(failures, key=lambda f: f.time) if failures else None


def spawn_local(fn, nproc: int, *args):
    """Run ``fn(*args)`` on ``nproc`` local ranks (torch's elastic launcher, as `torchrun
    --standalone`); returns {rank: return value}. Also used by the benchmarks in scripts/.

    When a rank raises, the others are stopped and the first rank's exception is re-raised here
    (a ``UserError`` as itself, else ``RankFailedError`` with the rank's traceback)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=str(uuid.uuid4()), rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
        max_restarts=0, start_method="spawn", monitor_interval=0.1,
    )
    report_dir = Path(tempfile.mkdtemp(prefix="moe_rl_ranks_"))
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    try:
        elastic_log.setLevel(logging.CRITICAL)  # its failure report would repeat ours, worse
        return elastic_launch(lc, _guarded)(fn, str(report_dir), *args)
    except ChildFailedError:
        failure = _first_failure(report_dir)
        if failure is None:
            raise  # a rank died without a Python exception (a signal, the OOM killer): torch's report
        failure.reraise()
    finally:
        elastic_log.setLevel(level)
        shutil.rmtree(report_dir, ignore_errors=True)


def launch(cfg: RunConfig) -> None:
    if under_torchrun():
        run_worker(cfg)
        return
    spawn_local(run_worker, cfg.parallel.nproc, cfg)
