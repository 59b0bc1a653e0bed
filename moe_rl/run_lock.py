"""One run, one writer (issue 26): ``RUN_DIR/.lock``, an advisory ``fcntl.flock`` lock that the
leader of ``moe-rl train`` (rank 0 under an external torchrun) takes before anything is written to
the run directory and holds until the job ends.

The file holds the owner (host, pid, start time) for the refusal a second start gets. The kernel
drops a flock when its holder dies (also on kill -9), so a lock file left by a dead job is simply
locked again: no stale-lock state to clean up. flock is per machine: a second job on another host
sharing the directory over NFS is not seen (NFS emulates flock with byte-range locks only on some
mounts).

A failed start leaves nothing that blocks the retry (``hold``): when a fresh run's job fails before
its first step is logged, the files it made (and the directory, if it made it) are removed again.
Imports only ``moe_rl.errors`` from the package.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_rl.errors import RunDirError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
# what a run writes into its directory (rank 0's files; checkpoints from every rank)
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "events.jsonl",
    "expert_load.jsonl",
    "memory_timeline.jsonl",  # every process's RSS per phase (docs/design.md 2.2)
    "wandb_id",
    "wandb",
    "checkpoints",
)


class RunDirInUseError(RunDirError):
    """Another live job holds the run directory's lock."""


def _in_use(run_dir: Path, fd: int) -> RunDirInUseError:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        who = f"pid {owner['pid']} on host {owner['host']} since {owner['since']}"
        stop = f"stop it (kill {owner['pid']} on {owner['host']})"
    except (ValueError, KeyError, TypeError):  # the owner is between its flock and its write
        who, stop = "another job", "stop it"
    return RunDirInUseError(
        f"run_dir {run_dir} is in use by {who}; wait for that job to end or {stop}, or pass another run_dir="
    )


def check_free(run_dir: str | Path) -> None:
    """RunDirInUseError when a live job holds ``run_dir``'s lock. Writes nothing (a missing lock
    file is no lock), so a refused start leaves the disk as it was."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # absent (no lock), or unreadable: then ``acquire`` says so
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(Path(run_dir), fd) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def acquire(run_dir: str | Path) -> int:
    """Create ``run_dir`` if needed and lock it for this process; the lock's fd (release: close
    it). RunDirInUseError when a live job holds it. A stale file of a dead job is re-locked."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the ranks
    except OSError as e:
        raise RunDirError(
            f"config key 'run_dir': cannot open its lock file {run_dir / LOCK_NAME} "
            f"({type(e).__name__}: {e.strerror})"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        err = _in_use(run_dir, fd)
        os.close(fd)
        raise err from None
    if os.fstat(fd).st_size:
        log.info("%s: taking over the lock file of a job that has ended", run_dir / LOCK_NAME)
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner, 0)
    return fd


def first_step_logged(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` got past its start: a logged step or a checkpoint."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        return True
    return (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*"))


def _undo_start(run_dir: Path, existed: bool, before: set[str]) -> None:
    """A fresh run that failed before its first step: remove what it made, so the same command
    can simply run again."""
    if not existed:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for p in run_dir.iterdir():  # the lock file too (when it is new): the lock is still held
        if p.name not in before:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


@contextmanager
def hold(run_dir: str | Path, fresh: bool) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the body (the job). ``fresh`` (not a resume): when the body
    raises before the run's first step is logged, what it wrote is removed again."""
    run_dir = Path(run_dir)
    existed = run_dir.is_dir()
    before = {p.name for p in run_dir.iterdir()} if existed else set()
    fd = acquire(run_dir)
    try:
        yield
    except BaseException:
        if fresh and not first_step_logged(run_dir):
            _undo_start(run_dir, existed, before)
        raise
    finally:
        os.close(fd)  # releases the flock
