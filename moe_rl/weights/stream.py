"""The learner -> rollout engine weight sync as a stream: canonical weights one piece at a time.

A chunk is the embedding, one decoder layer (its attention, norms, router and every expert), or
the final norm with the output layer, in that order; the stream yields a chunk whole when its
gathered bytes fit ``bound_bytes`` (``parallel.sync_bucket_mib``), else in pieces (``pieces``):
its tensors but the experts, then its experts in groups, local experts [lo, hi) of every EP rank,
as many as keep the group's stacked projections, gathered, within the bound (at least one expert
a rank). For each piece the ranks of its owning
pipeline stage join its tensor-parallel pieces (experts over expert-TP) and gather its experts
over EP, then the owner broadcasts it over the pipeline group; a rank therefore holds at most one
gathered piece beyond its own shard, never a whole MoE layer (21-32 GiB for the largest recipes)
nor the full model (Qwen3-235B is ~470 GB in bf16). ``Learner.export_canonical`` is a dict over
the same stream. The stream knows megatron names of the local spec only (``megatron_shards.py``);
the learner renames a TE model's names first (``learner/te_spec.py``). Where colocated engine
ranks hold slices, ``slice_stream.py`` cuts the same pieces into each rank's slices instead.

Collectives: one per tensor kind and piece, never one per expert. A piece's experts travel
stacked per projection ([P, F, H] gate/up, [P, H, F] down): one all_gather over expert-TP, one
all_gather_into_tensor over EP, one broadcast over PP. Every rank walks the same chunk list
(``plan``: names, gathered shapes and dtypes, owner stage, exchanged once per stream over the
pipeline group) and cuts it into the same pieces, so ranks of other stages know what to receive
without holding the tensors, and each group sees the same collectives in the same order. The
iterator is collective: every rank must consume all of it.

Peak extra memory per rank (beyond its shard; measured on CPU by tests/learner/
test_weight_stream.py): the piece being built or received, plus while a stacked expert
projection is gathered over EP its per-rank input and, over gloo only, a flat receive buffer of
the gathered size (ProcessGroupGloo gathers into a temporary and copies out; NCCL writes the
output in place).

Shape suffixes: N local experts, E experts, P a piece's experts, T expert-TP ranks, X / Y a
projection's two dims.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.config import ModelConfig
from moe_rl.dist import ParallelDims, comm_device
from moe_rl.weights.megatron_shards import Shard, megatron_to_canonical, tp_split_dim

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\.\w+\.weight)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EXPERT_SLOT = "{}"  # a stacked kind's name: the canonical name with the expert id replaced by this
DEFAULT_BOUND_BYTES = 512 << 20  # parallel.sync_bucket_mib's default


@dataclass(frozen=True)
class Kind:
    """One tensor a chunk's collectives move: a canonical tensor, or one projection of every
    expert of a layer stacked by global expert id (``name`` then holds ``EXPERT_SLOT``)."""

    name: str
    shape: tuple[int, ...]  # gathered: full TP dims; stacked experts [E, ...]
    dtype: torch.dtype

    @property
    def stacked(self) -> bool:
        return EXPERT_SLOT in self.name

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Chunk:
    """``order``: (0,) embedding, (1, global layer) a decoder layer, (2,) final norm + lm_head."""

    order: tuple[int, ...]
    owner: int  # pipeline stage holding it
    kinds: tuple[Kind, ...]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.kinds)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _chunk_order(local_name: str, layer_offset: int) -> tuple[int, ...]:
    """The chunk of a megatron parameter (local-spec name; stage-local layer numbers)."""
    m = _LAYER.match(local_name)
    if m is not None:
        return (1, layer_offset + int(m.group(1)))
    return (0,) if local_name.startswith("embedding.") else (2,)


def split_by_chunk(tensors: dict[str, torch.Tensor], layer_offset: int) -> dict[tuple[int, ...], dict]:
    """This stage's megatron tensors (local-spec names) grouped by chunk, no copy."""
    out: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        out.setdefault(_chunk_order(name, layer_offset), {})[name] = t
    return out


def stack_experts(canon: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Expert tensors of a canonical dict by stacked-kind name: [(global id, tensor)] per kind."""
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in canon.items():
        m = _EXPERT.match(name)
        if m is not None:
            out.setdefault(m.group(1) + EXPERT_SLOT + m.group(3), []).append((int(m.group(2)), t))
    return out


def _gathered_shape(
    name: str, shape: tuple[int, ...], stacked: bool, shard: Shard, num_experts: int
) -> tuple[int, ...]:
    """The full shape of a kind from this rank's piece: TP dims joined, experts all present."""
    dims = list(shape)
    split = tp_split_dim(name.replace(EXPERT_SLOT, "0"))
    size = shard.etp_size if ".mlp.experts." in name else shard.tp_size
    if split is not None:
        dims[split + stacked] *= size
    if stacked:
        dims[0] = num_experts
    return tuple(dims)


def stage_chunks(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, ep_rank: int, ep_size: int, shard: Shard, stage: int
) -> list[Chunk]:
    """The chunks this stage owns, with gathered shapes, computed on meta copies (no memory)."""
    meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}
    out = []
    for order, local in sorted(split_by_chunk(meta, shard.layer_offset).items()):
        canon = megatron_to_canonical(local, cfg, ep_rank, ep_size, shard)
        stacked = stack_experts(canon)
        kinds = [
            Kind(n, _gathered_shape(n, tuple(t.shape), False, shard, cfg.num_experts), t.dtype)
            for n, t in canon.items()
            if _EXPERT.match(n) is None
        ]
        kinds += [
            Kind(
                n,
                _gathered_shape(n, (len(ts), *ts[0][1].shape), True, shard, cfg.num_experts),
                ts[0][1].dtype,
            )
            for n, ts in stacked.items()
        ]
        out.append(Chunk(order, stage, tuple(sorted(kinds, key=lambda k: k.name))))
    return out


def plan(tensors: dict[str, torch.Tensor], cfg: ModelConfig, dims: ParallelDims, shard: Shard) -> list[Chunk]:
    """Every chunk of the model in stream order, the same on every rank (one object all-gather
    over the pipeline group; the chunks' tensors themselves stay where they are)."""
    mine = stage_chunks(tensors, cfg, dims.ep_rank, dims.ep_size, shard, dims.pp_rank)
    if dims.pp_size == 1:
        return mine
    stages: list = [None] * dims.pp_size
    dist.all_gather_object(stages, mine, group=dims.pp_group)
    return sorted((c for s in stages for c in s), key=lambda c: c.order)


def _gather_dim(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Concatenate the group's equally shaped pieces along ``dim`` (rank order): one all-gather
    into a [size, ...] buffer; a copy only when ``dim`` is not the leading one."""
    full = t.new_empty((size * t.shape[0], *t.shape[1:]))  # gloo takes the concatenated form only
    dist.all_gather_into_tensor(full, t.contiguous(), group=group)
    if dim == 0:
        return full
    return (
        full.view(size, *t.shape)
        .movedim(0, dim)
        .reshape(*t.shape[:dim], size * t.shape[dim], *t.shape[dim + 1 :])
    )


@dataclass(frozen=True)
class Piece:
    """One yield of the stream: a chunk's unstacked kinds (``local`` None), or its stacked expert
    kinds for the local experts [lo, hi) of every EP rank (``kinds``' shapes are the piece's:
    [EP x (hi - lo), ...], experts in EP-rank order)."""

    chunk: Chunk
    kinds: tuple[Kind, ...]
    local: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.kinds)

    def expert_ids(self, num_experts: int, ep_size: int) -> list[int]:
        """The global expert id of each row of the piece's stacked kinds."""
        if self.local is None:
            return []
        lo, hi = self.local
        per = num_experts // ep_size
        return [r * per + j for r in range(ep_size) for j in range(lo, hi)]


def experts_per_piece(chunk: Chunk, bound_bytes: int, ep_size: int) -> int:
    """Local experts per EP rank in one piece: the most whose stacked projections, gathered over
    EP, fit ``bound_bytes`` (at least one: a single expert larger than the bound travels alone)."""
    stacked = [k for k in chunk.kinds if k.stacked]
    if not stacked:
        return 0
    per_expert = sum(k.nbytes // k.shape[0] for k in stacked)  # one expert, every projection
    num_local = stacked[0].shape[0] // ep_size
    return max(1, min(num_local, bound_bytes // (per_expert * ep_size)))


def pieces(chunk: Chunk, bound_bytes: int, ep_size: int) -> list[Piece]:
    """A chunk as the stream yields it: whole when it fits ``bound_bytes`` (or has no experts);
    else its unstacked kinds in one piece, then its experts in pieces of ``experts_per_piece``
    local experts per EP rank (the last may hold fewer)."""
    stacked = [k for k in chunk.kinds if k.stacked]
    num_local = stacked[0].shape[0] // ep_size if stacked else 0
    if not stacked or chunk.nbytes <= bound_bytes:
        return [Piece(chunk, chunk.kinds, (0, num_local) if stacked else None)]
    plain = tuple(k for k in chunk.kinds if not k.stacked)
    out = [Piece(chunk, plain)] if plain else []
    n = experts_per_piece(chunk, bound_bytes, ep_size)
    for lo in range(0, num_local, n):
        hi = min(lo + n, num_local)
        kinds = tuple(Kind(k.name, (ep_size * (hi - lo), *k.shape[1:]), k.dtype) for k in stacked)
        out.append(Piece(chunk, kinds, (lo, hi)))
    return out


def _gather_kind(
    kind: Kind,
    canon: dict[str, torch.Tensor],
    stacked: dict,
    dims: ParallelDims,
    shard: Shard,
    local: tuple[int, int] | None,
) -> torch.Tensor:
    """The owner stage's full tensor of one kind: TP pieces joined, then (a stacked kind: the
    local experts [lo, hi) of ``local``) experts over EP."""
    if not kind.stacked:
        t = canon[kind.name]
        split = tp_split_dim(kind.name)
        if split is None or shard.tp_size == 1:
            return t
        return _gather_dim(t, split, dims.tp_group, shard.tp_size)
    lo, hi = local
    rows = sorted(stacked[kind.name], key=lambda p: p[0])[lo:hi]
    local_NXY = torch.stack([t for _, t in rows])
    del rows
    split = tp_split_dim(kind.name.replace(EXPERT_SLOT, "0"))
    if split is not None and shard.etp_size > 1:
        local_NXY = _gather_dim(local_NXY, split + 1, dims.etp_group, shard.etp_size)
    if dims.ep_size == 1:
        return local_NXY
    full_EXY = local_NXY.new_empty(kind.shape)
    dist.all_gather_into_tensor(full_EXY, local_NXY, group=dims.ep_group)
    return full_EXY


def _expand(kind: Kind, t: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    if not kind.stacked:
        return {kind.name: t}
    return {kind.name.format(e): t[i] for i, e in enumerate(ids)}


def stream_canonical(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    dims: ParallelDims,
    shard: Shard,
    bound_bytes: int = DEFAULT_BOUND_BYTES,
) -> Iterator[dict[str, torch.Tensor]]:
    """Canonical weights piece by piece from this rank's megatron tensors (by local-spec parameter
    name: the learner renames TE names first), identical on every rank; see the module docstring.
    ``bound_bytes``: the expert pieces' bound (``parallel.sync_bucket_mib``). A yielded piece may
    alias ``tensors`` (a tensor nothing had to gather); its stacked experts are views of one
    tensor per projection."""
    chunks = plan(tensors, cfg, dims, shard)
    local = split_by_chunk(tensors, shard.layer_offset)
    if dims.pp_size > 1:
        pp_ranks, device = dist.get_process_group_ranks(dims.pp_group), comm_device(dims.pp_group)
    for chunk in chunks:
        mine = chunk.owner == dims.pp_rank
        if mine:
            canon = megatron_to_canonical(local.pop(chunk.order), cfg, dims.ep_rank, dims.ep_size, shard)
            stacked = stack_experts(canon)
        for piece in pieces(chunk, bound_bytes, dims.ep_size):
            out: dict[str, torch.Tensor] = {}
            ids = piece.expert_ids(cfg.num_experts, dims.ep_size)
            for kind in piece.kinds:
                if mine:
                    t = _gather_kind(kind, canon, stacked, dims, shard, piece.local)
                else:
                    t = torch.empty(kind.shape, dtype=kind.dtype, device=device)
                if dims.pp_size > 1:
                    t = t.contiguous() if mine else t
                    dist.broadcast(t, src=pp_ranks[chunk.owner], group=dims.pp_group)
                out.update(_expand(kind, t, ids))
                del t
            yield out
            del out  # the consumer holds the piece now; nothing of it stays alive here
        if mine:
            del canon, stacked
