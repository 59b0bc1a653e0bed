"""Local CPU ranks forked from a server that has already imported what a rank imports.

A rank that ``spawn`` starts imports torch, megatron-core and moe-rl itself: about 10 s of CPU a
rank on the 2-core CI machine, most of a short run's cost, paid again by every rank of every
launch. Python's forkserver imports them once (``moe_rl.rank_server_preload``), while the launcher
reads its config and runs preflight (the CLI starts it first: ``start``); each rank is then forked
from it with those modules in memory. Only without CUDA: a process forked from one that has touched
CUDA cannot use it, and importing megatron with Transformer Engine may; a CUDA machine spawns its
ranks as before.

What changes for a rank (moe_rl/launch.py handles each; docs/reliability.md 5):
- its parent is the server, not the launcher. The server dies with the launcher (its parent-death
  signal, SIGKILL, set by the preload module), and a rank's own parent-death signal then fires as
  when the launcher was its parent (``launch.end_with_launcher``);
- the server's environment is the launcher's when it started: a rank first applies what the
  launcher changed since (``env_changes``);
- the server reaps a dead rank at once, so a rank that fails after a peer was killed cannot read
  the peer's exit status from /proc as a zombie's: the server writes each status first, while the
  rank is still a zombie, and the peer reads it there (``reaped_exit_code``; ``launch._peers_dead``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
from pathlib import Path

PRELOAD = "moe_rl.rank_server_preload"
PARENT_ENV = "MOE_RL_RANK_SERVER_PARENT"  # the launcher's pid: the preload module's parent-death check

_server_env: dict[str, str] | None = None  # the environment the running server started with
_started_pid: int | None = None  # that server's pid


def wanted() -> bool:
    """Whether local ranks are forked from the server: on a machine without CUDA."""
    import torch

    return not torch.cuda.is_available()


def start() -> bool:
    """Start the server (it imports in the background); True when ranks will be forked from it.
    Idempotent; a server that died is started again (multiprocessing's ``ensure_running`` checks,
    and reaps it). Call from the launcher's main thread: the server's parent-death signal fires
    when the thread that started it ends."""
    global _server_env, _started_pid
    if not wanted():
        return False
    os.environ[PARENT_ENV] = str(os.getpid())
    multiprocessing.set_forkserver_preload([PRELOAD])
    multiprocessing.forkserver._forkserver.ensure_running()
    if server_pid() != _started_pid:  # a new server: its environment is this process's now
        _started_pid, _server_env = server_pid(), dict(os.environ)
        # the server keeps the ranks' exit statuses there (rank_server_preload.EXITS); it dies with
        # this process, SIGKILLed, and removes nothing
        exits = Path(tempfile.gettempdir()) / f"moe_rl_rank_exits_{_started_pid}"
        atexit.register(shutil.rmtree, exits, ignore_errors=True)
    return True


def reaped_exit_code(pid: int) -> int | None:
    """In a rank forked from the server: a dead peer's exit code as multiprocessing gives it (-N:
    signal N), once the server has reaped it; None elsewhere or when not kept."""
    preload = sys.modules.get(PRELOAD)
    status = preload.exit_status(pid) if preload is not None else None
    if status is None:
        return None
    return -(status & 0x7F) if status & 0x7F else status >> 8


def server_pid() -> int | None:
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def env_changes() -> tuple[dict[str, str], list[str]]:
    """(set, unset): what the launcher's environment changed since the server started."""
    if _server_env is None:
        return {}, []
    now = dict(os.environ)
    changed = {k: v for k, v in now.items() if _server_env.get(k) != v}
    return changed, sorted(k for k in _server_env if k not in now)


def apply_env_changes(changed: dict[str, str], unset: list[str]) -> None:
    """In a rank, first thing: the launcher's environment as it is now."""
    for k in unset:
        os.environ.pop(k, None)
    os.environ.update(changed)
