"""Run a function on N local ranks (torch.multiprocessing spawn, gloo on 127.0.0.1, CPU).

Each rank applies the megatron CPU patches, sets the torchrun-style environment and calls
``fn(rank, *args)``; the return values come back ordered by rank. A failure in any rank raises
in the caller with that rank's traceback.

The ranks always run on the CPU over gloo, also on a machine with GPUs: they start with CUDA
hidden (``CUDA_VISIBLE_DEVICES=""``), so ``init_distributed`` picks gloo, the CPU patches apply,
and no rank asks for ``cuda:<local rank>`` (on a 1-GPU machine rank 1 failed with
``invalid device ordinal``). Tests of the CUDA path are in tests/gpu.

On a machine without CUDA the ranks are forked from the rank server (``moe_rl/rank_server.py``),
as ``moe-rl train`` forks its ranks: it imported torch, megatron-core and moe-rl once for the
session, where each spawned rank imported them again (about 5 s of CPU a rank, a minute of CI per
dozen 4-rank tests). A rank first applies the environment the test set since the server started.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _cuda_hidden() -> Iterator[None]:
    """Spawned children inherit os.environ as it is when they start: hide CUDA for them only."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _entry(rank: int, fn, world: int, port: int, queue, args: tuple, env: tuple) -> None:
    from moe_rl import rank_server

    rank_server.apply_env_changes(*env)  # forked from the server: the test's environment now
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    if torch.cuda.is_available():  # CUDA was initialised before the environment hid it
        raise RuntimeError("dist_harness ranks must run on the CPU, but CUDA is visible in the rank")
    torch.set_num_threads(1)
    import megatron_patches

    megatron_patches.apply_all()
    queue.put((rank, fn(rank, *args)))


def run_ranks(fn, world: int, *args):
    from moe_rl import rank_server

    method = "forkserver" if rank_server.start() else "spawn"  # start: False where CUDA is
    ctx = mp.get_context(method)
    queue = ctx.SimpleQueue()
    with _cuda_hidden():
        env = rank_server.env_changes() if method == "forkserver" else ({}, [])
        mp.start_processes(
            _entry,
            args=(fn, world, free_port(), queue, args, env),
            nprocs=world,
            join=True,
            start_method=method,
        )
    results = dict(queue.get() for _ in range(world))
    return [results[r] for r in range(world)]
