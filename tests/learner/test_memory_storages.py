"""dist tier: moe_rl/memory/'s per-rank bytes held against the real megatron learner on 2 gloo
ranks (distributed optimizer), for EP=2, TP=2 (bf16) and PP=2.

Measured on each rank, never from the estimator's own code: the parameters' bytes (every
``gpt.parameters()`` tensor), the gradient buffers' bytes (megatron DDP's ``grad_data`` of every
buffer, dense and expert), and after one optimizer step the optimizer's state tensors (Adam's
exp_avg / exp_avg_sq of every shard) plus the fp32 main-param shards (bf16). Held against
``stage_memory`` of the rank's stage:

- weights: equal; with bf16 the learner keeps its norm weights in fp32 here, so those count 4 B
  (the check counts them from the learner and asserts they are all norms);
- grads: equal up to megatron's bucket padding (at most 1 KiB a buffer here);
- optimizer: the ranks' mean equals the estimate (the distributed optimizer's shards differ by the
  padding only), less 4 B per fp32 norm weight with bf16 (no separate main copy);
- offloaded (``parallel.offload_during_rollout``, what moe_rl/learner/offload.py frees): the
  ranks' mean within 1% of the estimate (megatron's buffer and shard padding);
- the colocated step's phases (moe_rl/memory/phases.py): the storages offload moves before the
  engine wakes (Adam's state and the fp32 main params: the optimizer's bytes, as above; the grad
  buffers: the grads, up to padding), the weights it keeps until the sync is done (every parameter
  storage), the built-in engine's weights (equal to ``engine_weight_bytes`` in the rollout dtype,
  plus 2 B per router weight the engine keeps in fp32 with bf16), and the sync phase: those
  weights + the engine's + two ``parallel.sync_bucket_mib`` units, equal to ``phase_bytes``'
  ``sync`` up to the fp32 norms and routers counted from the learner and the engine and
  megatron's param-buffer padding (at most 2 KiB);
- activations: the peak of live CPU bytes during one forward + backward of a micro-batch
  (torch.profiler's memory events) is within a factor of 4 either way (measured 1.1-2.7) of the estimate's
  activations + logits for those tokens (the estimate counts what the backward keeps; the
  profiler also sees temporaries, and the tiny widths make fixed costs weigh more).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist_harness import run_ranks
from tests.models import DEFAULT_WIDTH_L3
from tests.profiled_memory import profiled_peak

MODEL = dataclasses.replace(DEFAULT_WIDTH_L3, num_layers=4)
B, S = 6, 14  # the micro-batch: tests/learner/parallel_cases.py's batch
LAYOUTS = {"ep2": (1, 1, 2, "fp32"), "tp2_bf16": (2, 1, 1, "bf16"), "pp2": (1, 2, 1, "fp32")}


def _worker(rank: int, tmp: str, tp: int, pp: int, ep: int, precision: str) -> dict:
    from moe_rl import dist
    from moe_rl.config import OptimConfig, ParallelConfig
    from moe_rl.learner.learner import Learner
    from moe_rl.types import TrainBatch
    from moe_rl.weights.canonical import random_canonical_weights
    from tests.learner.parallel_cases import batch_data, nll_entropy_loss

    model = dataclasses.replace(MODEL, precision=precision)
    par = ParallelConfig(nproc=2, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
    ctx = dist.init_distributed(par, seed=0)
    learner = Learner(model, par, OptimConfig(), ctx, random_canonical_weights(model, seed=0))
    params = list(learner.gpt.named_parameters())
    fp32_names = [n for n, p in params if precision == "bf16" and p.dtype == torch.float32]
    out = {
        "stage": ctx.pp_rank,
        "params": sum(p.numel() * p.element_size() for _, p in params),
        "fp32_names": fp32_names,
        "fp32_numel": sum(p.numel() for n, p in params if n in fp32_names),
        "grads": sum(
            b.grad_data.numel() * b.grad_data.element_size()
            for b in [*learner.ddp.buffers, *learner.ddp.expert_parallel_buffers]
        ),
    }
    tokens_BS, lens_B, mask_BS = batch_data(model.vocab_size)
    full = torch.full_like(lens_B, S)  # every position real: the estimate's micro_batch x max_seq_len
    batch = TrainBatch(tokens_BS, full, loss_mask_BS=torch.ones_like(mask_BS))
    out["activations"], _ = profiled_peak(
        lambda: learner.forward_backward(batch, nll_entropy_loss, 1.0, B, None), f"{tmp}/trace{rank}.json"
    )
    learner.ddp.zero_grad_buffer()
    learner.optimizer.zero_grad()
    learner.optimizer.step()  # Adam's state exists from its first step
    optimizers = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    state = sum(
        t.numel() * t.element_size()
        for o in optimizers
        for s in o.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    mains = sum(
        t.numel() * t.element_size()
        for o in optimizers
        for group in getattr(o, "shard_fp32_from_float16_groups", [])
        for t in group
    )
    out["optimizer"] = state + mains
    from moe_rl.learner.offload import offloaded

    with offloaded(learner, True) as moved:  # what parallel.offload_during_rollout frees
        out["offloaded"] = moved.total
        out["moved"] = {k: getattr(moved, k) for k in ("params", "main_params", "grads", "optimizer")}
    # the engine's weights (the built-in engine, in the rollout dtype; routers kept fp32)
    from moe_rl.rollout.builtin import BuiltinEngine

    engine = BuiltinEngine(model, dtype=precision, pad_id=0)
    engine.load_weights(random_canonical_weights(model, seed=0))
    out["engine"] = sum(t.numel() * t.element_size() for t in engine.model.w.values())
    out["engine_fp32_numel"] = sum(
        t.numel() for n, t in engine.model.w.items() if precision == "bf16" and t.dtype == torch.float32
    )
    out["engine_fp32_names"] = [
        n for n, t in engine.model.w.items() if out["engine_fp32_numel"] and t.dtype == torch.float32
    ]
    dist.shutdown()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_estimate_equals_the_learners_storages(tmp_path, name):
    from moe_rl.config import AlgoConfig, RolloutConfig, RunConfig
    from moe_rl.memory import Layout, engine_weight_bytes, phase_bytes, stage_memory

    tp, pp, ep, precision = LAYOUTS[name]
    ranks = run_ranks(_worker, 2, str(tmp_path), tp, pp, ep, precision)
    model = dataclasses.replace(MODEL, precision=precision, max_seq_len=S)
    par = dataclasses.replace(RunConfig().parallel, offload_during_rollout=True)
    cfg = dataclasses.replace(
        RunConfig(),
        model=model,
        parallel=par,
        algo=AlgoConfig(micro_batch_size=B),
        rollout=RolloutConfig(dtype=precision),
    )
    lay = Layout(world=2, tp=tp, pp=pp, ep=ep)
    for r in ranks:
        est = stage_memory(cfg, lay, r["stage"])
        n32 = r["fp32_numel"]
        assert all("layernorm" in n for n in r["fp32_names"]), r["fp32_names"]
        assert r["params"] == est["weights"] + 2 * n32, (name, r, est)
        assert 0 <= r["grads"] - est["grads"] <= 1024 * 2, (name, r, est)
        # the colocated step's phases (moe_rl/memory/phases.py), storage by storage: what offload
        # moves before the engine wakes (optimizer state, fp32 main params, grads) and what it
        # keeps until the sync is done (the weights), the engine's weights, the sync's two units
        moved = r["moved"]
        # the param buffers hold every parameter, up to megatron's bucket padding (1 KiB here)
        assert 0 <= moved["params"] - r["params"] <= 1024 * 2, (name, moved, r["params"])
        assert 0 <= moved["grads"] - est["grads"] <= 1024 * 2, (name, moved, est)
        e32 = r["engine_fp32_numel"]  # bf16: the engine keeps its routers in fp32 (2 B more each)
        assert all(".mlp.gate." in n for n in r["engine_fp32_names"]), r["engine_fp32_names"]
        assert r["engine"] == engine_weight_bytes(cfg) + 2 * e32, (
            name,
            r["engine"],
            engine_weight_bytes(cfg),
        )
        ph = phase_bytes(cfg, est, 0.0)
        sync = moved["params"] + r["engine"] + 2 * cfg.parallel.sync_bucket_mib * 2**20
        assert 0 <= sync - (ph["sync"] + 2 * n32 + 2 * e32) <= 1024 * 2, (name, sync, ph["sync"])
        assert ph["generate"] == ph["learner_out"] == engine_weight_bytes(cfg)  # the learner all gone
        measured = r["activations"] / (est["activations"] + est["logits"])
        print(name, r["stage"], "activations measured / estimated", round(measured, 2))
        assert 1 / 4 <= measured <= 4, (name, r["activations"], est["activations"], est["logits"])
    for stage in range(pp):
        same = [r for r in ranks if r["stage"] == stage]  # the ranks sharing the stage's shards
        est = stage_memory(cfg, lay, stage)
        mean = sum(r["optimizer"] for r in same) / len(same)
        assert mean == est["optimizer"] - 4 * same[0]["fp32_numel"], (name, same, est)
        # what leaves before the engine wakes (the optimizer and main-param storages offload moves)
        left = sum(r["moved"]["optimizer"] + r["moved"]["main_params"] for r in same) / len(same)
        assert left == est["optimizer"] - 4 * same[0]["fp32_numel"], (name, same, est)
        # the bytes offload frees while the engine generates: the estimate's, up to megatron's
        # padding of its param / grad buffers and shards (under 1% at these widths)
        moved = sum(r["offloaded"] for r in same) / len(same)
        print(name, stage, "offloaded measured / estimated", moved, est["offloaded"])
        assert abs(moved / est["offloaded"] - 1) < 0.01, (name, stage, moved, est["offloaded"])
