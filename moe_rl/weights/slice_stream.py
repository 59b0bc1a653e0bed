"""The colocated weight sync where engine ranks hold slices: each learner rank gathers only what its
own engine rank holds, from the learner ranks that hold it (docs/design.md 14.3).

Colocated, learner world rank r hosts engine rank r (``shard_of(r)``, ``engine_shard``). Where
that shard is a slice (vLLM TP > 1), ``stream_engine_slices`` yields, per piece of the canonical
stream (``stream.pieces``: the same pieces, in the same order), what the shard holds of it, as
``engine_slice`` of the whole piece would: its TP slice of each split tensor, the tensors it holds
whole, only the experts it holds. No rank builds a whole gathered piece.

Each tensor kind of a piece (a canonical tensor, or one projection of the piece's experts
stacked) is cut in boxes, a [lo, hi) range per dim of the full tensor. A rank of the owning stage
holds one box (``held_box``: its megatron TP piece; a stacked kind: its expert-TP piece of its EP
rank's experts); every rank needs one (``needed_box``: its engine shard's slice and experts).
``routes`` says which part of each needed box each rank sends (a rank's own part from itself,
each other part from its first holder), and one ``all_to_all_single`` over the group that holds
the kind between its stages moves them: TP x PP (megatron's model-parallel group) for a tensor,
expert-TP x EP x PP for a stacked projection. So one collective per tensor kind and piece, never
one per expert, and none where every rank holds what it needs (engine TP = learner TP, PP 1:
the TP slices are views of the rank's own tensors). The parts land in the result directly when
they are its consecutive slabs along dim 0 (column-parallel slices, experts), else through one
receive buffer.

Memory beyond the rank's shard, per kind: its slice, the parts it sends (each part of its held
box once per rank that needs it, packed in one buffer unless it is one contiguous part), and,
where the parts are not slabs along dim 0, one receive buffer (at most the slice). The stream
keeps a piece's slices until it yields the piece. Shape suffixes as in stream.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.config import ModelConfig
from moe_rl.dist import ParallelDims, comm_device
from moe_rl.weights.engine_shard import EngineShard, slice_bounds
from moe_rl.weights.engine_shard import held as holds
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
        i
        for i, e in enumerate(ids)
        if holds(kind.name.replace(EXPERT_SLOT, str(e)), shard, model.num_experts)
    ]
    if not rows:
        return None
    if rows != list(range(rows[0], rows[-1] + 1)):
        raise ValueError(f"engine slice: the experts of {kind.name!r} an engine rank holds are not one run")
    box = narrowed(box, 0, rows[0], rows[-1] + 1)
    b = slice_bounds(name, kind.shape[1:], shard, model)
    return box if b is None else narrowed(box, b[0] + 1, b[1], b[2])


@functools.lru_cache(maxsize=4096)
def routes(
    held: tuple[Box | None, ...], needed: tuple[Box | None, ...]
) -> tuple[tuple[Box | None, ...], ...]:
    """``routes[j][k]``: the part of rank k's needed box that rank j sends it (None: nothing).
    Held boxes are None (a rank of another stage), equal (a replicated tensor) or disjoint (TP,
    EP pieces): rank k takes what it holds itself from itself, each other box from its first
    holder in group order."""
    n = len(held)
    out: list[list[Box | None]] = [[None] * n for _ in range(n)]
    for k, want in enumerate(needed):
        if want is None:
            continue
        seen = {None}
        for j in [k, *range(n)]:
            if held[j] not in seen:
                seen.add(held[j])
                out[j][k] = intersect(held[j], want)
    return tuple(map(tuple, out))


@functools.lru_cache(maxsize=4096)
def _remote(route: tuple[tuple[Box | None, ...], ...]) -> bool:
    """Some rank needs a part another rank holds (else no collective)."""
    return any(b is not None for j, row in enumerate(route) for k, b in enumerate(row) if j != k)


def placed_parts(mine: Box, parts: list[tuple[Box, torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """The tensor of box ``mine`` from ``parts`` (box, tensor of that box's shape) that tile it."""
    out = like.new_empty(box_shape(mine))
    for box, t in parts:
        within(out, box, mine).copy_(t)
    return out


def _in_order(boxes: list[Box], mine: Box) -> bool:
    """The boxes, in this order, are consecutive slabs of ``mine`` along dim 0, each whole in the
    other dims: their flat concatenation is ``mine``'s memory, so they can land in it directly."""
    at = mine[0][0]
    for b in boxes:
        if b[1:] != mine[1:] or b[0][0] != at:
            return False
        at = b[0][1]
    return at == mine[0][1]


def exchange(
    local: torch.Tensor | None,
    held: list[Box | None],
    needed: list[Box | None],
    me: int,
    group,
    like: torch.Tensor,
) -> torch.Tensor | None:
    """This rank's needed box, from the group's held ones (group rank order; ``local`` holds
    ``held[me]``, None on a rank that holds nothing): one all_to_all_single of the parts each
    rank sends each other, none when every rank holds what it needs (then a view of ``local``).
    ``like``: dtype and device of a received tensor. Where the parts are slabs of the result in
    rank order, they land in it directly (the rank's own part through the collective too); a
    rank that needs only what it holds sends and keeps a view of ``local``."""
    mine, route, n = needed[me], routes(tuple(held), tuple(needed)), len(held)
    if not _remote(route):  # what this rank needs it holds
        if mine is None or not box_numel(mine):
            return None if mine is None else like.new_empty(box_shape(mine))
        return within(local, mine, held[me])
    boxes = [route[j][me] for j in range(n) if route[j][me] is not None]
    own_only = all(route[j][me] is None for j in range(n) if j != me)  # it only sends
    direct = mine is not None and not own_only and _in_order(boxes, mine)
    send_to = [route[me][k] if (k != me or direct) else None for k in range(n)]
    send = [within(local, b, held[me]).reshape(-1) for b in send_to if b is not None]
    recv_from = [route[j][me] if (j != me or direct) else None for j in range(n)]
    recv_sizes = [box_numel(b) if b is not None else 0 for b in recv_from]
    out = like.new_empty(box_shape(mine)) if direct else None
    recv = out.view(-1) if direct else like.new_empty(sum(recv_sizes))
    flat = send[0] if len(send) == 1 else torch.cat(send) if send else like.new_empty(0)
    send_sizes = [box_numel(b) if b is not None else 0 for b in send_to]
    dist.all_to_all_single(recv, flat, recv_sizes, send_sizes, group=group)
    del flat, send
    if direct:
        return out
    if mine is None or not box_numel(mine):
        return None if mine is None else like.new_empty(box_shape(mine))
    if own_only:
        return within(local, mine, held[me])
    parts, offset = [], 0
    for j, b in enumerate(recv_from):
        if b is not None:
            parts.append((b, recv[offset : offset + recv_sizes[j]].view(box_shape(b))))
        offset += recv_sizes[j]
    if route[me][me] is not None:
        parts.append((route[me][me], within(local, route[me][me], held[me])))
    return placed_parts(mine, parts, like)


@dataclass(frozen=True)
class Peers:
    """A group the slices are exchanged over (TP x PP for a chunk's tensors, expert-TP x EP x PP
    for its stacked experts), with each rank's engine shard and learner coordinates (group rank
    order): (TP rank, 0, PP rank), or (expert-TP rank, EP rank, PP rank)."""

    group: object
    me: int
    shards: tuple[EngineShard, ...]
    coords: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, group, mine: tuple[int, int, int], shard_of: ShardOf) -> Peers:
        """One all-gather of the ranks' coordinates (once per stream)."""
        if group is None or dist.get_world_size(group) == 1:
            return cls(None, 0, (shard_of(dist.get_rank()),), (mine,))
        size = dist.get_world_size(group)
        t = torch.tensor(mine, dtype=torch.int64, device=comm_device(group))
        every = t.new_empty(3 * size)
        dist.all_gather_into_tensor(every, t, group=group)
        coords = tuple(tuple(c) for c in every.view(size, 3).tolist())
        shards = tuple(shard_of(dist.get_global_rank(group, i)) for i in range(size))
        return cls(group, dist.get_rank(group), shards, coords)

    def slice(
        self,
        kind: Kind,
        local: torch.Tensor | None,
        owner: int,
        tp: int,
        ep: int,
        ids: list[int],
        cfg: ModelConfig,
    ) -> torch.Tensor | None:
        """This rank's slice of one kind of a piece of stage ``owner`` (``local``: what this
        rank holds of it, None off that stage); ``tp``: its TP (expert-TP) size, ``ep``: EP."""
        held = [held_box(kind, (t, tp), (e, ep)) if p == owner else None for t, e, p in self.coords]
        needed = [needed_box(kind, ids, s, cfg) for s in self.shards]
        like = torch.empty(0, dtype=kind.dtype, device=comm_device(self.group) if self.group else "cpu")
        return exchange(local, held, needed, self.me, self.group, like if local is None else local)


def stream_engine_slices(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    dims: ParallelDims,
    shard: Shard,
    shard_of: ShardOf,
    bound_bytes: int = DEFAULT_BOUND_BYTES,
) -> Iterator[dict[str, torch.Tensor]]:
    """Per piece of the canonical stream, what this rank's engine shard (``shard_of(rank)``)
    holds of it (see the module docstring). Collective: every learner rank must consume all of
    it, in step."""
    if dims.ep_size * dims.etp_size * dims.pp_size > 1 and dims.expert_mp_group is None:
        raise ValueError("stream_engine_slices: needs the expert-TP x EP x PP group (ParallelDims)")
    chunks = plan(tensors, cfg, dims, shard)
    local = split_by_chunk(tensors, shard.layer_offset)
    mine_shard = shard_of(dims.rank)
    dense = Peers.of(dims.mp_group, (shard.tp_rank, 0, dims.pp_rank), shard_of)
    experts = Peers.of(dims.expert_mp_group, (shard.etp_rank, dims.ep_rank, dims.pp_rank), shard_of)
    for chunk in chunks:
        owner = chunk.owner == dims.pp_rank
        if owner:
            canon = megatron_to_canonical(local.pop(chunk.order), cfg, dims.ep_rank, dims.ep_size, shard)
            stacked = stack_experts(canon)
        for piece in pieces(chunk, bound_bytes, dims.ep_size):
            out: dict[str, torch.Tensor] = {}
            ids = piece.expert_ids(cfg.num_experts, dims.ep_size)
            for kind in piece.kinds:
                if not kind.stacked:
                    mine = canon[kind.name] if owner else None
                    t = dense.slice(kind, mine, chunk.owner, shard.tp_size, 1, ids, cfg)
                else:
                    mine = _local_experts(stacked[kind.name], piece) if owner else None
                    t = experts.slice(kind, mine, chunk.owner, shard.etp_size, dims.ep_size, ids, cfg)
                del mine
                if t is not None:
                    rows = needed_box(kind, ids, mine_shard, cfg)[0] if kind.stacked else None
                    out.update(_expand(kind, t, ids[rows[0] : rows[1]] if rows else ids))
                del t
            yield out
            del out
        if owner:
            del canon, stacked


def _local_experts(rows: list[tuple[int, torch.Tensor]], piece: Piece) -> torch.Tensor:
    """This rank's local experts [lo, hi) of a piece, stacked [P / EP, X, Y]."""
    lo, hi = piece.local
    return torch.stack([t for _, t in sorted(rows, key=lambda p: p[0])[lo:hi]])


def _expand(kind: Kind, t: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    if not kind.stacked:
        return {kind.name: t}
    return {kind.name.format(e): t[i] for i, e in enumerate(ids)}
