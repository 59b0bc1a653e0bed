"""dist tier: each rank reads only its shard of a bf16 HF checkpoint (issue 32 point 4,
docs/design.md 2.2). On 2 gloo ranks with EP=2, then TP=2 (experts split by expert TP), the
learner built from the checkpoint's files (``open_hf_checkpoint``: tensors and TP slices read on
demand, in bf16) holds bitwise the weights of the learner built the old way (the whole model read
and converted to fp32, then sliced), and the elements it read are exactly its parameters' (no
tensor of another rank, no whole tensor where a slice serves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.weights.canonical import random_canonical_weights
from moe_rl.weights.hf import write_hf_checkpoint
from tests.dist_harness import run_ranks
from tests.hf.conftest import CFG


def _weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in learner._named_weights().items()}


def _compare(par: ParallelConfig, dims, ckpt: str) -> dict:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl.learner.learner import Learner
    from moe_rl.weights.hf import load_hf_checkpoint, open_hf_checkpoint
    from moe_rl.weights.stored import StoredWeights

    old = _weights(Learner(CFG, par, OptimConfig(), dims, load_hf_checkpoint(ckpt, CFG), monitor=False))
    RouterReplay.clear_global_router_replay_instances()
    reads: list[tuple[str, torch.dtype, int]] = []
    real_read = StoredWeights.read

    def counted(self, name, *args):
        t = real_read(self, name, *args)
        reads.append((name, t.dtype, t.numel()))
        return t

    StoredWeights.read = counted
    try:
        new = _weights(Learner(CFG, par, OptimConfig(), dims, open_hf_checkpoint(ckpt, CFG), monitor=False))
    finally:
        StoredWeights.read = real_read
    RouterReplay.clear_global_router_replay_instances()
    return {
        "names": sorted(new) == sorted(old),
        "bitwise": all(torch.equal(new[k], old[k]) for k in old),
        "param_elems": sum(t.numel() for t in new.values()),
        "read_elems": sum(n for _, _, n in reads),
        "read_dtypes": sorted({str(d) for _, d, _ in reads}),
        "experts_read": sorted({int(k.split(".")[5]) for k, _, _ in reads if ".mlp.experts." in k}),
    }


def _worker(rank: int, ckpt: str) -> dict:
    from megatron.core import parallel_state as ps

    from moe_rl import dist

    ep2 = ParallelConfig(nproc=2, expert_parallel=2)
    out = {"ep2": _compare(ep2, dist.init_distributed(ep2, seed=7), ckpt)}
    ps.destroy_model_parallel()
    tp2 = ParallelConfig(nproc=2, tensor_parallel=2, expert_parallel=1)
    out["tp2"] = _compare(tp2, dist.init_distributed(tp2, seed=7), ckpt)
    dist.shutdown()
    return out


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CFG's random weights as a bf16 HF checkpoint in several shard files (with an index)."""
    out = tmp_path_factory.mktemp("bf16") / "ckpt"
    weights = random_canonical_weights(CFG, seed=11)
    return write_hf_checkpoint(out, weights, CFG, max_shard_bytes=60_000, dtype=torch.bfloat16)


@pytest.mark.dist
def test_each_rank_reads_only_its_shard_bitwise(bf16_ckpt: Path) -> None:
    assert (bf16_ckpt / "model.safetensors.index.json").is_file()
    ranks = run_ranks(_worker, 2, str(bf16_ckpt))
    E = CFG.num_experts
    for rank, r in enumerate(ranks):
        for layout in ("ep2", "tp2"):
            got = r[layout]
            assert got["names"] and got["bitwise"], (rank, layout)
            # every element read went into a parameter, once: no other rank's tensors, no whole
            # tensor where a TP slice serves; all in the stored dtype
            assert got["read_elems"] == got["param_elems"], (rank, layout, got)
            assert got["read_dtypes"] == ["torch.bfloat16"], (rank, layout)
        assert r["ep2"]["experts_read"] == list(range(rank * E // 2, (rank + 1) * E // 2))
        assert r["tp2"]["experts_read"] == list(range(E))  # TP=2: every expert, half of each
        assert r["tp2"]["param_elems"] < r["ep2"]["param_elems"]
