"""Where each role runs: colocated (every rank runs the learner and an engine) or split
(``parallel.rollout_ranks=N``: the last N ranks of the torchrun world run only rollout engines, the
first nproc - N the megatron learner). docs/design.md 15.

A split world starts three kinds of process group from torchrun's one rendezvous store, each under
its own store prefix, so no group needs a collective over ranks that are not in it:

- the **role's default group** (``torch.distributed``'s world, as every library sees it): learner
  ranks 0..M-1 or rollout ranks 0..N-1. Megatron-core's parallel state is built over the learner
  world unchanged (every TP x EP x PP layout), and vLLM's ``external_launcher`` over the rollout
  world.
- the **bridge** (gloo, host tensors): every rank of the torchrun world, for point-to-point batches
  (rollout -> learner).
- the **sync group**: learner rank 0 and every rollout rank, for the weight broadcast.

The bridge and the sync group are torch's ProcessGroupGloo (ProcessGroupNCCL on CUDA: untested on
GPU) built directly on the store, not through ``new_group`` (which registers a group of the default
world only); ``Group`` wraps one with the few operations the split loop uses, ranks numbered within it.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LEARNER, ROLLOUT = "learner", "rollout"


@dataclass(frozen=True)
class Split:
    """The ranks of each role in the torchrun world: learners first, rollouts last."""

    nproc: int
    rollout_ranks: int

    @property
    def learners(self) -> tuple[int, ...]:
        return tuple(range(self.nproc - self.rollout_ranks))

    @property
    def rollouts(self) -> tuple[int, ...]:
        return tuple(range(self.nproc - self.rollout_ranks, self.nproc))

    def role(self, rank: int) -> str:
        return ROLLOUT if rank in self.rollouts else LEARNER

    def role_rank(self, rank: int) -> int:
        """The rank within its role's world."""
        return rank - (self.nproc - self.rollout_ranks) if self.role(rank) == ROLLOUT else rank

    def engines(self, engine_tp: int = 1) -> int:
        """Rollout engines: each spans ``engine_tp`` consecutive rollout ranks."""
        return self.rollout_ranks // engine_tp

    def server(self, dp_rank: int, engine_tp: int = 1) -> int:
        """The world rank that sends learner data-parallel rank ``dp_rank`` its batches: the first
        rank of engine ``dp_rank % engines`` (so each engine serves whole dp ranks)."""
        return self.rollouts[(dp_rank % self.engines(engine_tp)) * engine_tp]

    @property
    def sync_members(self) -> tuple[int, ...]:
        """The weight broadcast's group: learner rank 0 (its root, rank 0 in the group), then the
        rollout ranks in order."""
        return (0, *self.rollouts)


class Group:
    """A process group built on the store (not registered with the default world): collectives
    and point-to-point take ranks within the group. Every call waits for its work unless it
    returns the work (``isend``)."""

    def __init__(self, pg: Any, members: tuple[int, ...], rank: int) -> None:
        self.pg, self.members, self.rank = pg, members, members.index(rank)

    @property
    def size(self) -> int:
        return len(self.members)

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        self.pg.broadcast([t], opts).wait()
        return t

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0):
        return self.pg.send([t], dst, tag)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(t, dst, tag).wait()

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self.pg.recv([t], src, tag).wait()
        return t

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every member's equally shaped ``t``, in group-rank order."""
        out = [torch.empty_like(t) for _ in self.members]
        self.pg.allgather([out], [t]).wait()
        return out

    # Python objects (a step's batch and its metadata): pickled into a uint8 tensor, length first
    def send_object(self, obj: Any, dst: int, tag: int = 0) -> list:
        """Start sending ``obj``; returns the works (wait on them before reusing the slot)."""
        data = torch.frombuffer(
            bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
        )
        size = torch.tensor([data.numel()], dtype=torch.int64)
        return [self.isend(size, dst, tag), self.isend(data, dst, tag)]

    def recv_object(self, src: int, tag: int = 0) -> Any:
        size = self.recv(torch.empty(1, dtype=torch.int64), src, tag)
        data = self.recv(torch.empty(int(size.item()), dtype=torch.uint8), src, tag)
        return pickle.loads(data.numpy().tobytes())


@dataclass(frozen=True)
class Placement:
    """This rank's role and the groups that link the roles (None when colocated)."""

    split: Split
    rank: int  # in the torchrun world
    bridge: Group | None = None
    sync: Group | None = None  # None on learner ranks other than 0

    @property
    def role(self) -> str:
        return self.split.role(self.rank)

    @property
    def colocated(self) -> bool:
        return self.split.rollout_ranks == 0

    @property
    def is_learner(self) -> bool:
        return self.role == LEARNER

    @property
    def is_rollout(self) -> bool:
        return self.role == ROLLOUT


def exchange_dp_ranks(bridge: Group, dp_rank: int) -> list[int]:
    """Every world rank's learner data-parallel rank (-1 on rollout ranks), over the bridge: a
    rollout rank learns which learner ranks a dp rank's batch goes to without megatron's rank order.
    Collective over the whole world, once at start."""
    return [int(t) for t in bridge.all_gather(torch.tensor([dp_rank], dtype=torch.int64))]


def _new_group(backend: str, store, prefix: str, members: tuple[int, ...], rank: int, timeout) -> Group:
    sub = dist.PrefixStore(prefix, store)
    r = members.index(rank)
    if backend == "nccl":  # untested on GPU
        pg = dist.ProcessGroupNCCL(sub, r, len(members))
    else:
        pg = dist.ProcessGroupGloo(sub, r, len(members), timeout)
    return Group(pg, members, rank)


def init_placement(nproc: int, rollout_ranks: int, backend: str, timeout: datetime.timedelta) -> Placement:
    """Start this rank's default group (its role's world) and, when split, the bridge and sync
    groups, from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``)."""
    split = Split(nproc, rollout_ranks)
    if not rollout_ranks:
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout)
        return Placement(split, dist.get_rank())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    role = split.role(rank)
    members = split.learners if role == LEARNER else split.rollouts
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(role, store),
        rank=split.role_rank(rank),
        world_size=len(members),
        timeout=timeout,
    )
    bridge = _new_group("gloo", store, "bridge", tuple(range(world)), rank, timeout)
    sync = None
    if rank in split.sync_members:
        sync = _new_group(backend, store, "sync", split.sync_members, rank, timeout)
    return Placement(split, rank, bridge, sync)
