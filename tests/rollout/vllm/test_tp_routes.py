"""moe_rl/rollout/vllm/tp_routes.py over gloo, without vLLM: 4 ranks in 2 TP groups of 2 (as
``VllmEngine`` makes them, ``dist.new_subgroups``); each group's first rank holds its group's
routes (as vLLM 0.31+ returns them) and every rank ends with exactly its own samples' routes,
bitwise, with the uneven sample and row counts a rollout has (a rank with no sample too)."""

from __future__ import annotations

import pytest
import torch

L, K, E = 3, 2, 8
# samples per rank of each group (group g holds ranks 2g, 2g+1), uneven on purpose
COUNTS = ([3, 1], [2, 0])


def group_routes(g: int) -> list[torch.Tensor]:
    """Group g's samples' routes, rank order: [T_b, L, K] uint8, T_b from 1 to 9 rows."""
    gen = torch.Generator().manual_seed(10 + g)
    rows = torch.randint(1, 10, (sum(COUNTS[g]),), generator=gen)
    return [torch.randint(0, E, (int(t), L, K), generator=gen, dtype=torch.uint8) for t in rows]


def _rank(rank: int, init: str, queue) -> None:
    import torch.distributed as dist

    from moe_rl.rollout.vllm.tp_routes import scatter_routes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    group, _ = dist.new_subgroups(group_size=2)
    g, first = divmod(rank, 2)
    routes = group_routes(g) if first == 0 else None
    got = scatter_routes(routes, COUNTS[g], group, (L, K), torch.uint8)
    dist.destroy_process_group()
    queue.put((rank, [t.numpy() for t in got]))  # numpy pickles by value (a tensor: shared memory)


@pytest.mark.unit
def test_each_tp_rank_gets_exactly_its_own_samples_routes(tmp_path):
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()  # plain gloo ranks: no megatron to import
    mp.start_processes(_rank, args=(f"file://{tmp_path / 'store'}", queue), nprocs=4, start_method="spawn")
    got = dict(queue.get() for _ in range(4))
    for rank, mine in sorted(got.items()):
        g, r = divmod(rank, 2)
        start = sum(COUNTS[g][:r])
        want = group_routes(g)[start : start + COUNTS[g][r]]
        assert len(mine) == len(want) == COUNTS[g][r], f"rank {rank}"
        for b, (x, y) in enumerate(zip(map(torch.from_numpy, mine), want)):
            assert x.dtype == torch.uint8 and x.shape == y.shape, f"rank {rank}, sample {b}: {x.shape}"
            assert torch.equal(x, y), f"rank {rank}, sample {b}"


@pytest.mark.unit
def test_split_by_rank_refuses_a_count_mismatch():
    from moe_rl.rollout.vllm.tp_routes import split_by_rank

    with pytest.raises(ValueError, match=r"4 route records for 5 samples \(\[3, 2\] per rank\)"):
        split_by_rank(group_routes(0), [3, 2])
