"""Pipeline parallelism (PP > 1): the last stage's outputs on every stage of a data-parallel rank,
so everything a learner pass returns is identical on its stages (``learner/learner.py``)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moe_rl.dist import ParallelDims, comm_device


def last_stage_rank(dims: ParallelDims) -> int:
    """The global rank of this pipeline's last stage."""
    return dist.get_process_group_ranks(dims.pp_group)[-1]


def broadcast_stats(stats: dict[str, torch.Tensor] | None, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """PP: the last stage's [B, S] statistics on every stage (keys and dtypes, then one tensor)."""
    meta = [sorted((k, v.dtype, tuple(v.shape)) for k, v in stats.items()) if stats is not None else None]
    dist.broadcast_object_list(meta, src=last_stage_rank(dims), group=dims.pp_group)
    keys = [k for k, _, _ in meta[0]]
    dtype, shape = meta[0][0][1], meta[0][0][2]
    device = comm_device(dims.pp_group)
    if stats is not None:
        packed = torch.stack([stats[k].to(device, dtype) for k in keys])
    else:
        packed = torch.empty((len(keys), *shape), dtype=dtype, device=device)
    dist.broadcast(packed, src=last_stage_rank(dims), group=dims.pp_group)
    return {k: (stats[k] if stats is not None else packed[i].to(meta[0][i][1])) for i, k in enumerate(keys)}


def broadcast_metrics(metrics: list, dims: ParallelDims) -> list:
    """PP: the last stage's per-micro-batch loss metrics on every stage (values moved to the CPU)."""

    def cpu(v):
        if isinstance(v, torch.Tensor):
            return v.detach().cpu()
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return dataclasses.replace(v, **{f.name: cpu(getattr(v, f.name)) for f in dataclasses.fields(v)})
        return v

    box = [[{k: cpu(v) for k, v in m.items()} for m in metrics] if dims.is_last_stage else None]
    dist.broadcast_object_list(box, src=last_stage_rank(dims), group=dims.pp_group)
    return metrics if dims.is_last_stage else box[0]
