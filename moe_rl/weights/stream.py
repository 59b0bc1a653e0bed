"""The learner -> rollout engine weight sync as a stream: canonical weights one chunk at a time.

A chunk is the embedding, one decoder layer (its attention, norms, router and every expert), or
the final norm with the output layer, in that order. For each chunk the ranks of its owning
pipeline stage join the chunk's tensor-parallel pieces (experts over expert-TP) and gather its
experts over EP, then the owner broadcasts it over the pipeline group; a rank therefore holds at
most one gathered chunk beyond its own shard, never the full model (Qwen3-235B is ~470 GB in
bf16). ``Learner.export_canonical`` is a dict over the same stream. The stream knows megatron
names of the local spec only (``megatron_shards.py``); the learner renames a TE model's names
first (``learner/te_spec.py``).

Collectives: one per tensor kind and chunk, never one per expert. A MoE layer's experts travel
stacked per projection ([E, F, H] gate/up, [E, H, F] down): one all_gather over expert-TP, one
all_gather_into_tensor over EP, one broadcast over PP. Every rank walks the same chunk list
(``plan``: names, gathered shapes and dtypes, owner stage, exchanged once per stream over the
pipeline group), so ranks of other stages know what to receive without holding the tensors, and
each group sees the same collectives in the same order. The iterator is collective: every rank
must consume all of it.

Peak extra memory per rank (beyond its shard; measured on CPU by tests/learner/
test_weight_stream.py): the chunk being built or received, plus while a stacked expert
projection is gathered over EP its per-rank input and, over gloo only, a flat receive buffer of
the gathered size (ProcessGroupGloo gathers into a temporary and copies out; NCCL writes the
output in place).

Shape suffixes: N local experts, E experts, T expert-TP ranks, X / Y a projection's two dims.
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
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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


def _gather_kind(
    kind: Kind, canon: dict[str, torch.Tensor], stacked: dict, dims: ParallelDims, shard: Shard
) -> torch.Tensor:
    """The owner stage's full tensor of one kind: TP pieces joined, then experts over EP."""
    if not kind.stacked:
        t = canon[kind.name]
        split = tp_split_dim(kind.name)
        if split is None or shard.tp_size == 1:
            return t
        return _gather_dim(t, split, dims.tp_group, shard.tp_size)
    pieces = sorted(stacked[kind.name], key=lambda p: p[0])
    local_NXY = torch.stack([t for _, t in pieces])
    del pieces
    split = tp_split_dim(kind.name.replace(EXPERT_SLOT, "0"))
    if split is not None and shard.etp_size > 1:
        local_NXY = _gather_dim(local_NXY, split + 1, dims.etp_group, shard.etp_size)
    if dims.ep_size == 1:
        return local_NXY
    full_EXY = local_NXY.new_empty(kind.shape)
    dist.all_gather_into_tensor(full_EXY, local_NXY, group=dims.ep_group)
    return full_EXY


def _expand(kind: Kind, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if not kind.stacked:
        return {kind.name: t}
    return {kind.name.format(e): t[e] for e in range(t.shape[0])}


def stream_canonical(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, dims: ParallelDims, shard: Shard
) -> Iterator[dict[str, torch.Tensor]]:
    """Canonical weights chunk by chunk from this rank's megatron tensors (by local-spec parameter
    name: the learner renames TE names first), identical on every rank; see the module docstring.
    A yielded chunk may alias ``tensors`` (a tensor nothing had to gather); its stacked experts are
    views of one tensor per projection."""
    chunks = plan(tensors, cfg, dims, shard)
    local = split_by_chunk(tensors, shard.layer_offset)
    if dims.pp_size > 1:
        pp_ranks, device = dist.get_process_group_ranks(dims.pp_group), comm_device(dims.pp_group)
    for chunk in chunks:
        out: dict[str, torch.Tensor] = {}
        mine = chunk.owner == dims.pp_rank
        if mine:
            canon = megatron_to_canonical(local.pop(chunk.order), cfg, dims.ep_rank, dims.ep_size, shard)
            stacked = stack_experts(canon)
        for kind in chunk.kinds:
            if mine:
                t = _gather_kind(kind, canon, stacked, dims, shard)
                stacked.pop(kind.name, None)  # drop the per-expert pieces once stacked
                canon.pop(kind.name, None)
            else:
                t = torch.empty(kind.shape, dtype=kind.dtype, device=device)
            if dims.pp_size > 1:
                t = t.contiguous() if mine else t
                dist.broadcast(t, src=pp_ranks[chunk.owner], group=dims.pp_group)
            out.update(_expand(kind, t))
            del t
        if mine:
            del canon, stacked
        yield out
        del out  # the consumer holds the chunk now; nothing of it stays alive here
