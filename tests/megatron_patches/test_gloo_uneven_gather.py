"""dist tier: the gloo_uneven_gather shim against what upstream does on gloo (2 ranks).

Rank r holds 3 + 2r rows (uneven, as the alltoall dispatcher's expert-TP gather sees them). The
gather must return every rank's rows in rank order, where upstream (the unwrapped function)
raises on gloo; the uneven reduce-scatter of the way back (a [8, 2] input split (3, 5): this
rank's split of the sum over ranks) works upstream and stays unpatched."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_ranks


def _worker(rank: int):
    from megatron.core.tensor_parallel import mappings

    import megatron_patches

    torch.distributed.init_process_group("gloo")
    group = torch.distributed.new_group([0, 1])
    splits = [3, 5]
    mine = torch.arange(splits[rank] * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    gathered = mappings._gather_along_first_dim(mine, group, splits)
    full = torch.arange(16, dtype=torch.float32).view(8, 2) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, splits)
    even = mappings._gather_along_first_dim(torch.full((2, 2), float(rank)), group)  # upstream path
    try:
        mappings._gather_along_first_dim.__wrapped__(mine, group, splits)
        upstream_errors = None
    except RuntimeError as e:
        upstream_errors = str(e)
    applied = megatron_patches.get_patch("gloo_uneven_gather").is_applied()
    torch.distributed.destroy_process_group()
    return (
        gathered.tolist(),
        scattered.tolist(),
        even.tolist(),
        upstream_errors,
        applied,
    )  # plain lists: no shared memory


@pytest.mark.dist
def test_uneven_gather_and_reduce_scatter_on_gloo():
    results = run_ranks(_worker, 2)
    rows = [torch.arange(n * 2, dtype=torch.float32).view(-1, 2) + 100 * r for r, n in enumerate([3, 5])]
    total = torch.arange(16, dtype=torch.float32).view(8, 2) * 3  # (1 + 2) x the same input
    for rank, (gathered, scattered, even, upstream_errors, applied) in enumerate(results):
        assert applied
        assert gathered == torch.cat(rows).tolist(), rank
        assert scattered == (total[:3] if rank == 0 else total[3:]).tolist(), rank
        assert even == [[0.0, 0.0]] * 2 + [[1.0, 1.0]] * 2, rank
        assert "invalid tensor size" in upstream_errors, upstream_errors  # still broken upstream
