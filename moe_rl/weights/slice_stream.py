"""The colocated weight sync where engine ranks hold slices: each learner rank gathers only what its
own engine rank holds (docs/design.md 14.3).

Colocated, learner world rank r hosts engine rank r (``shard_of(r)``, ``engine_shard``). Where
that shard is a slice (vLLM TP > 1), ``stream_engine_slices`` yields per piece of
``stream.pieces`` what the shard holds of it (``engine_slice``'s names and shapes: its TP slice
of each split tensor, whole tensors for those it holds whole, only the experts it holds), and no
rank ever builds a whole gathered piece.

Per tensor kind and piece (a canonical tensor, or one projection of a piece's experts stacked),
every tensor is a box in the full (gathered) tensor: a [lo, hi) range per dim. A rank of the
owning stage holds one box (``held``: its megatron TP piece; a stacked kind also its EP rank's
experts and its expert-TP piece) and needs one (``needed``: its engine shard's slice, experts
included). One ``all_to_all_single`` over the owner's group (TP for a kind, expert-TP x EP for a
stacked one) sends each rank the intersections of the others' held boxes with its needed one
(its own part copied locally, no wire); where no rank needs a part it does not hold (engine TP
= learner TP, or a multiple of it) there is no collective and the slice is a view of the rank's
own tensor. The stage then broadcasts each rank's slice over the pipeline group, as the whole
stream does: one collective per tensor kind and piece and group, never one per expert.

The broadcast needs every rank of a pipeline group to host the same engine shard (engine TP
divides world / PP, always so where an engine fits in a stage's data-parallel block); otherwise
the stream falls back to the whole stream narrowed (``engine_slice`` of each gathered piece).

Memory beyond the rank's shard, per kind: its needed slice, the flat receive buffer of the parts
from its peers, and its send buffer (the parts of its held box others need: at most the engine
slice's size when the engine TP divides the group). Shape suffixes as in stream.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.config import ModelConfig
from moe_rl.dist import ParallelDims, comm_device
from moe_rl.weights.engine_shard import EngineShard, engine_slice, held, slice_bounds
from moe_rl.weights.megatron_shards import Shard, megatron_to_canonical, tp_split_dim
from moe_rl.weights.stream import (
    DEFAULT_BOUND_BYTES,
    EXPERT_SLOT,
    Kind,
    Piece,
    pieces,
    plan,
    split_by_chunk,
    stack_experts,
    stream_canonical,
)

Box = tuple[tuple[int, int], ...]  # [lo, hi) per dim of the full tensor
ShardOf = Callable[[int], EngineShard]  # world rank -> the engine shard it hosts


def narrowed(box: Box, dim: int, lo: int, hi: int) -> Box:
    """``box`` with dim ``dim`` limited to [lo, hi) of the full tensor."""
    return tuple((max(a, lo), min(b, hi)) if d == dim else (a, b) for d, (a, b) in enumerate(box))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes; None when empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_numel(box: Box | None) -> int:
    n = 1
    for d in box_shape(box) if box is not None else (0,):
        n *= d
    return n


def within(t: torch.Tensor, part: Box, of: Box) -> torch.Tensor:
    """The view of ``t`` (the contents of box ``of``) that holds box ``part`` (inside ``of``)."""
    for d, ((lo, hi), (base, _)) in enumerate(zip(part, of)):
        t = t.narrow(d, lo - base, hi - lo)
    return t


def held_box(kind: Kind, tp: tuple[int, int], ep: tuple[int, int] = (0, 1)) -> Box:
    """What a learner rank of the owning stage holds of ``kind`` (a piece's stacked shape):
    ``tp`` (rank, size) its TP piece (expert-TP for experts) along megatron's split dim; a
    stacked kind also only ``ep`` (rank, size)'s rows (the piece's rows are in EP-rank order)."""
    box = tuple((0, d) for d in kind.shape)
    stacked = int(kind.stacked)
    split = tp_split_dim(kind.name.replace(EXPERT_SLOT, "0"))
    rank, size = tp
    if split is not None and size > 1:
        step = kind.shape[split + stacked] // size
        box = narrowed(box, split + stacked, rank * step, (rank + 1) * step)
    if stacked:
        per = kind.shape[0] // ep[1]
        box = narrowed(box, 0, ep[0] * per, (ep[0] + 1) * per)
    return box


def needed_box(kind: Kind, ids: list[int], shard: EngineShard, model: ModelConfig) -> Box | None:
    """What engine ``shard`` holds of ``kind``: its slice (``slice_bounds``) and, for a stacked
    kind, the rows of the experts it holds (``ids``: the piece's global expert id per row);
    None: nothing."""
    box = tuple((0, d) for d in kind.shape)
    if not kind.stacked:
        b = slice_bounds(kind.name, kind.shape, shard, model)
        return box if b is None else narrowed(box, b[0], b[1], b[2])
    name = kind.name.replace(EXPERT_SLOT, str(ids[0]))
    rows = [
        i for i, e in enumerate(ids) if held(kind.name.replace(EXPERT_SLOT, str(e)), shard, model.num_experts)
    ]
    if not rows:
        return None
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ValueError(f"engine slice: the experts of {kind.name!r} an engine rank holds are not one run")
    box = narrowed(box, 0, rows[0], rows[-1] + 1)
    b = slice_bounds(name, kind.shape[1:], shard, model)
    return box if b is None else narrowed(box, b[0] + 1, b[1], b[2])


def routes(held: list[Box], needed: list[Box | None]) -> list[list[Box | None]]:
    """``routes[j][k]``: the part of rank k's needed box that rank j sends it (None: nothing).
    Held boxes are equal (a replicated tensor) or disjoint (TP, EP pieces): rank k takes what it
    holds itself from itself, and each other box from its first holder."""
    n = len(held)
    out: list[list[Box | None]] = [[None] * n for _ in range(n)]
    for k, want in enumerate(needed):
        if want is None:
            continue
        out[k][k] = intersect(held[k], want)
        seen = {held[k]}
        for j in range(n):
            if held[j] not in seen:
                seen.add(held[j])
                out[j][k] = intersect(held[j], want)
    return out


def placed_parts(mine: Box, parts: list[tuple[Box, torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """The tensor of box ``mine`` from ``parts`` (box, tensor of that box's shape) that tile it."""
    out = like.new_empty(box_shape(mine))
    for box, t in parts:
        within(out, box, mine).copy_(t)
    return out


def exchange(local: torch.Tensor, held: list[Box], needed: list[Box | None], me: int, group) -> torch.Tensor:
    """This rank's needed box from the group's held ones (group rank order; ``local`` holds
    ``held[me]``): one all_to_all_single of the parts others hold, none when every rank holds
    what it needs (then a view of ``local``)."""
    mine, route = needed[me], routes(held, needed)
    n = len(held)
    if not any(route[j][k] for j in range(n) for k in range(n) if j != k):
        return within(local, mine, held[me]) if mine is not None else local.new_empty(0)
    send = [within(local, route[me][k], held[me]).reshape(-1) for k in range(n) if k != me and route[me][k]]
    send_sizes = [box_numel(route[me][k]) if k != me else 0 for k in range(n)]
    recv_sizes = [box_numel(route[j][me]) if j != me else 0 for j in range(n)]
    recv = local.new_empty(sum(recv_sizes))
    flat = torch.cat(send) if send else local.new_empty(0)
    dist.all_to_all_single(recv, flat, recv_sizes, send_sizes, group=group)
    del flat, send
    if mine is None:
        return local.new_empty(0)
    parts, offset = [], 0
    for j in range(n):
        box = route[j][me]
        if box is not None:
            t = within(local, box, held[me]) if j == me else recv[offset : offset + recv_sizes[j]]
            parts.append((box, t.view(box_shape(box)) if j != me else t))
        offset += recv_sizes[j]
    return placed_parts(mine, parts, local)


def _members(group, size: int) -> list[int]:
    return [dist.get_global_rank(group, i) for i in range(size)] if group is not None else [dist.get_rank()]


def _expert_coords(dims: ParallelDims, group) -> list[tuple[int, int]]:
    """(expert-TP rank, EP rank) of every rank of the expert group, in group rank order."""
    if group is None or dist.get_world_size(group) == 1:
        if dims.ep_size * dims.etp_size > 1:
            raise ValueError("stream_engine_slices: expert parallelism needs the expert-TP x EP group")
        return [(dims.etp_rank, dims.ep_rank)]
    mine = torch.tensor([dims.etp_rank, dims.ep_rank], dtype=torch.int64, device=comm_device(group))
    out = mine.new_empty(2 * dist.get_world_size(group))
    dist.all_gather_into_tensor(out, mine, group=group)
    return [tuple(p) for p in out.view(-1, 2).tolist()]


def aligned(dims: ParallelDims, shard_of: ShardOf) -> bool:
    """Every rank of this rank's pipeline group hosts the same engine shard (see the module)."""
    if dims.pp_size == 1:
        return True
    return len({shard_of(r) for r in _members(dims.pp_group, dims.pp_size)}) == 1


def stream_engine_slices(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    dims: ParallelDims,
    shard: Shard,
    shard_of: ShardOf,
    expert_group=None,
    bound_bytes: int = DEFAULT_BOUND_BYTES,
) -> Iterator[dict[str, torch.Tensor]]:
    """Per piece of the canonical stream, what this rank's engine shard (``shard_of(rank)``)
    holds of it (see the module docstring). ``expert_group``: megatron's expert-TP x EP group.
    Collective: every learner rank must consume all of it."""
    mine_shard = shard_of(dims.rank)
    if not aligned(dims, shard_of):
        for piece in stream_canonical(tensors, cfg, dims, shard, bound_bytes):
            yield engine_slice(piece, mine_shard, cfg)
        return
    chunks = plan(tensors, cfg, dims, shard)
    local = split_by_chunk(tensors, shard.layer_offset)
    peers = Peers.of(dims, shard, shard_of, expert_group)
    if dims.pp_size > 1:
        pp_ranks, device = dist.get_process_group_ranks(dims.pp_group), comm_device(dims.pp_group)
    for chunk in chunks:
        owner = chunk.owner == dims.pp_rank
        if owner:
            canon = megatron_to_canonical(local.pop(chunk.order), cfg, dims.ep_rank, dims.ep_size, shard)
            stacked = stack_experts(canon)
        for piece in pieces(chunk, bound_bytes, dims.ep_size):
            out: dict[str, torch.Tensor] = {}
            ids = piece.expert_ids(cfg.num_experts, dims.ep_size)
            for kind in piece.kinds:
                box = needed_box(kind, ids, mine_shard, cfg)
                if owner:
                    t = peers.slice(kind, piece, canon, stacked, ids, cfg)
                elif box is not None:
                    t = torch.empty(box_shape(box), dtype=kind.dtype, device=device)
                if box is None:
                    continue
                if dims.pp_size > 1:
                    t = t.contiguous() if owner else t
                    dist.broadcast(t, src=pp_ranks[chunk.owner], group=dims.pp_group)
                out.update(_expand(kind, t, ids[box[0][0] : box[0][1]] if kind.stacked else ids))
                del t
            yield out
            del out
        if owner:
            del canon, stacked


@dataclass(frozen=True)
class Peers:
    """The owner-stage groups a rank exchanges in, and the engine shard and learner coordinates
    of each of their ranks (group rank order)."""

    shard: Shard
    tp_group: object
    tp: list[EngineShard]  # the engine shard of each TP rank
    expert_group: object  # megatron's expert-TP x EP group
    experts: list[EngineShard]
    coords: list[tuple[int, int]]  # (expert-TP rank, EP rank) of each of its ranks
    me: int  # this rank in expert_group
    ep_size: int

    @classmethod
    def of(cls, dims: ParallelDims, shard: Shard, shard_of: ShardOf, expert_group) -> Peers:
        coords = _expert_coords(dims, expert_group)
        group = expert_group if len(coords) > 1 else None
        me = dist.get_rank(group) if group is not None else 0
        tp = [shard_of(r) for r in _members(dims.tp_group, shard.tp_size)]
        experts = [shard_of(r) for r in _members(group, len(coords))]
        return cls(shard, dims.tp_group, tp, group, experts, coords, me, dims.ep_size)

    def slice(
        self, kind: Kind, piece: Piece, canon: dict, stacked: dict, ids: list[int], cfg: ModelConfig
    ) -> torch.Tensor:
        """This rank's slice of one kind of a piece its stage owns, exchanged over its TP group
        (a canonical kind) or its expert-TP x EP group (a stacked one)."""
        if not kind.stacked:
            tp = self.shard.tp_size
            held = [held_box(kind, (i, tp)) for i in range(tp)]
            needed = [needed_box(kind, ids, s, cfg) for s in self.tp]
            return exchange(canon[kind.name], held, needed, self.shard.tp_rank, self.tp_group)
        lo, hi = piece.local
        local_NXY = torch.stack([t for _, t in sorted(stacked[kind.name], key=lambda p: p[0])[lo:hi]])
        etp = self.shard.etp_size
        held = [held_box(kind, (r, etp), (ep, self.ep_size)) for r, ep in self.coords]
        needed = [needed_box(kind, ids, s, cfg) for s in self.experts]
        return exchange(local_NXY, held, needed, self.me, self.expert_group)


def _expand(kind: Kind, t: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    if not kind.stacked:
        return {kind.name: t}
    return {kind.name.format(e): t[i] for i, e in enumerate(ids)}
