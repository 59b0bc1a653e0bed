"""What the rank server (moe_rl/rank_server.py) imports before it forks ranks: run in that server
process only, by multiprocessing's forkserver. Importing it anywhere else does the imports and no
more (the parent-death signal is set only in a process whose parent is the launcher that named
itself in ``PARENT_ENV``)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from moe_rl.rank_server import PARENT_ENV


def _serve_the_launcher() -> None:
    """In the server: die with the launcher, and keep each rank's exit status (``exit_status``)."""
    launcher = os.environ.get(PARENT_ENV)
    if not sys.platform.startswith("linux") or launcher != str(os.getppid()):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != launcher:  # it died before the prctl
        os._exit(1)
    EXITS.mkdir(exist_ok=True)
    real = os.waitpid

    def waitpid(pid: int, options: int):
        # multiprocessing's server reaps a rank the moment it dies (os.waitpid(-1, WNOHANG)); a
        # peer that fails because of that death would find nothing in /proc: its status is
        # written first, while the rank is still a zombie (WNOWAIT reaps nothing)
        if pid != -1:
            return real(pid, options)
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
        if info is None:
            return real(pid, options)
        status = info.si_status << 8 if info.si_code == os.CLD_EXITED else info.si_status
        tmp = EXITS / f".{info.si_pid}"
        try:
            tmp.write_text(str(status))
            tmp.rename(EXITS / str(info.si_pid))
        except OSError:  # the launcher is exiting and has removed the directory
            pass
        return real(info.si_pid, options)  # the one just written: a child that was waitable

    os.waitpid = waitpid
    os.register_at_fork(after_in_child=lambda: setattr(os, "waitpid", real))  # a rank: its own


EXITS = Path(tempfile.gettempdir()) / f"moe_rl_rank_exits_{os.getpid()}"  # the server's pid


def exit_status(pid: int) -> int | None:
    """A rank's exit status as waitpid gives it, once the server has reaped it; in a rank forked
    from the server (``EXITS`` names the server's directory there too)."""
    try:
        return int((EXITS / str(pid)).read_text())
    except (FileNotFoundError, ValueError):
        return None


_serve_the_launcher()

from moe_rl.lazy_imports import defer_megatron_compile, defer_wandb  # noqa: E402
from moe_rl.quiet import silence_known_noise  # noqa: E402

silence_known_noise()  # before megatron is imported, as run_worker does
defer_wandb()
defer_megatron_compile()

import megatron.core  # noqa: E402, F401
import torch  # noqa: E402

import megatron_patches  # noqa: E402, F401
from moe_rl import dist, trainer  # noqa: E402, F401

# torch.optim imports torch._dynamo at an optimizer's first param group (about 1 s of CPU): a
# throwaway optimizer here imports it once for every rank. One tiny tensor, no thread pool started.
torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
