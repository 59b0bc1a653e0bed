"""Run a function on N local ranks (torch.multiprocessing spawn, gloo on 127.0.0.1).

Each rank applies the megatron CPU patches, sets the torchrun-style environment and calls
``fn(rank, *args)``; the return values come back ordered by rank. A failure in any rank raises
in the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, queue, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import megatron_patches

    megatron_patches.apply_all()
    queue.put((rank, fn(rank, *args)))


def run_ranks(fn, world: int, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(fn, world, free_port(), queue, args), nprocs=world, join=True,
                       start_method="spawn")
    results = dict(queue.get() for _ in range(world))
    return [results[r] for r in range(world)]
