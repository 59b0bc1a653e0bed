"""dist tier: the learner's state off the device while the engine generates
(``parallel.offload_during_rollout``, moe_rl/learner/offload.py), over gloo on 2 ranks with the
distributed optimizer: EP=2 (DP=2; fp32, and bf16 with fp32 main params) and TP=2 (sequence
parallel, DP=1); and EP=2 without it (fp32: each parameter its own storage), one spawn.

Checked: 3 optimizer steps with the learner offloaded and reloaded before each are bitwise equal
(weights and Adam state) to 3 steps without; across a checkpoint saved by the offloaded learner
after step 2 and loaded into a fresh one, its step 3 is bitwise equal too. While offloaded every
moved storage holds 0 bytes, and the bytes moved per kind equal numel x element size counted from
megatron's DDP buffers and the optimizer's state directly (and the model's parameters are views of
those buffers, padded as megatron pads). The offload runs in the loop's phases
(moe_rl/pipeline/offload_timeline.py's ``OffloadTimeline``): the optimizer state, main params and
grads leave first and the weights the sync reads meanwhile are exactly the learner's, with only the
weights' bytes on the device; then the weights leave; the memory timeline records offload, sync,
learner_out and reload, in the estimate's order (``COLOCATED_ORDER``, moe_rl/memory/phases.py).
The checkpoint is saved between the sync and the rollout (``resident``: weights and Adam state
back, grads not), and everything is parked again after it. The process RSS before and while
offloaded is printed (``pytest -s``), not asserted: the allocator decides when freed pages return."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from moe_rl.types import TrainBatch
from tests.dist_harness import run_ranks
from tests.learner.parallel_cases import EVEN_LENS, LR, batch_data, nll_entropy_loss
from tests.models import TINY_MOE_L3 as MODEL

STEPS = 3
STATE = ("exp_avg", "exp_avg_sq")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def _adam_states(learner) -> list[torch.Tensor]:
    return [
        v
        for o in learner.optimizer.chained_optimizers
        for st in o.optimizer.state.values()
        for k, v in st.items()
        if k in STATE
    ]


def _buffers(learner) -> list:
    return [*learner.ddp.buffers, *learner.ddp.expert_parallel_buffers]


def _distributed(learner) -> bool:
    return learner.par.distributed_optimizer  # megatron's DDP has param buffers only then


def _main_params(learner) -> list[torch.Tensor]:
    """The optimizer's fp32 main params that are not the model's parameters or views of a DDP
    param buffer (bf16 models; the shards of fp32 parameters, e.g. the routers', are views and move
    as ``params``)."""
    ptrs = {p.untyped_storage().data_ptr() for p in learner.ddp.parameters()}
    return [
        p
        for o in learner.optimizer.chained_optimizers
        for group in o.optimizer.param_groups
        for p in group["params"]
        if p.untyped_storage().data_ptr() not in ptrs
    ]


def _counted(learner) -> dict[str, int]:
    """What must move, from megatron's buffers and the optimizer's state: numel x element size."""
    bufs, params = _buffers(learner), list(learner.ddp.parameters())
    return {
        "params": sum(b.param_data.numel() * b.param_data.element_size() for b in bufs)
        if _distributed(learner)
        else sum(p.numel() * p.element_size() for p in params),
        "main_params": sum(p.numel() * p.element_size() for p in _main_params(learner)),
        "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in bufs),
        "optimizer": sum(v.numel() * v.element_size() for v in _adam_states(learner)),
    }


def _resident(learner) -> dict[str, int]:
    """The bytes those storages hold right now."""
    bufs, params = _buffers(learner), list(learner.ddp.parameters())
    return {
        "params": sum(b.param_data.untyped_storage().nbytes() for b in bufs)
        if _distributed(learner)
        else sum(p.untyped_storage().nbytes() for p in params),
        "grads": sum(b.grad_data.untyped_storage().nbytes() for b in bufs),
        "optimizer": sum(v.untyped_storage().nbytes() for v in _adam_states(learner)),
        "main_params": sum(p.untyped_storage().nbytes() for p in _main_params(learner)),
    }


def _layout_facts(learner) -> dict:
    """Every parameter is a view of a DDP param buffer; the buffers' padding, and its bound:
    megatron starts each parameter on a 64-element boundary and pads each buffer to a multiple
    of 128 x DP elements (DP <= 2 here)."""
    params = list(learner.ddp.parameters())
    if not _distributed(learner):  # each parameter is its own storage, counted once
        return {"own_storage": all(p.untyped_storage().nbytes() == p.numel() * 4 for p in params)}
    ptrs = {b.param_data.untyped_storage().data_ptr() for b in _buffers(learner)}
    return {
        "params_in_buffers": all(p.untyped_storage().data_ptr() in ptrs for p in params),
        "padding_elements": sum(b.param_data.numel() for b in _buffers(learner))
        - sum(p.numel() for p in params),
        "padding_bound": 64 * len(params) + 2 * 128 * len(_buffers(learner)),
        "param_elements": sum(b.param_data.numel() for b in _buffers(learner)),
    }


def _step(learner, batch, offload: bool, seen: list) -> None:
    """The loop's offload phases (a sync, then a rollout; offloaded or not) then one update."""
    from moe_rl.pipeline.offload_timeline import OffloadTimeline
    from moe_rl.timing import MemoryTimeline, StepTimer

    if offload:
        counted, before, rss0 = _counted(learner), _resident(learner), _rss_mib()
        want, mem = learner.export_canonical(), MemoryTimeline()
        timeline, sync = OffloadTimeline(None, learner, True, mem), {}

        def fake_sync() -> dict:  # what the engine would take: the weights, while the rest is off
            got = learner.export_canonical()
            sync["equal"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
            sync["resident"] = _resident(learner)
            return {}

        with timeline.syncing(StepTimer(mem).phase):
            fake_sync()
        with timeline.generating() as moved:
            seen.append(
                {
                    "moved": moved,
                    "counted": counted,
                    "before": before,
                    "during": _resident(learner),
                    "during_sync": sync,
                    "rss_mib": (rss0, _rss_mib()),
                }
            )
        seen[-1]["phases"] = [r["phase"] for r in mem.records]
        seen[-1]["after"] = _resident(learner)
    learner.update(batch, nll_entropy_loss, 0.8, 4, lr=LR)


def _same(a, b) -> bool:
    wa, wb = a.export_canonical(), b.export_canonical()
    sa, sb = _adam_states(a), _adam_states(b)
    return (
        sorted(wa) == sorted(wb)
        and all(torch.equal(wa[k], wb[k]) for k in wa)
        and len(sa) == len(sb) > 0
        and all(torch.equal(x, y) for x, y in zip(sa, sb))
    )


class _StartingEngine:
    """vLLM's start as the trainer sees it: it records what the learner holds while it starts."""

    def __init__(self, learner) -> None:
        self.learner, self.seen = learner, None

    def starts_from_dir(self) -> bool:
        return False  # the learner's weights are handed over, as without an hf: init

    def start(self, named) -> None:
        self.seen = {"resident": sum(_resident(self.learner).values()), "named": named}


def _engine_start(learner) -> dict:
    """OffloadTimeline.start_engine with offload: the engine starts while every offloaded storage
    holds 0 bytes, gets the learner's weights as host copies, and the learner is whole again after."""
    from moe_rl.pipeline.offload_timeline import OffloadTimeline

    engine, want = _StartingEngine(learner), learner.export_canonical()
    before = sum(_resident(learner).values())
    OffloadTimeline(engine, learner, True).start_engine()
    named = engine.seen["named"]
    return {
        "resident_during": engine.seen["resident"],
        "resident_before_after": (before, sum(_resident(learner).values())),
        "weights_equal": sorted(named) == sorted(want) and all(torch.equal(named[k], want[k]) for k in want),
    }


def _save_between_sync_and_rollout(learner, ckpt_dir: str):
    """The loop's checkpoint: after the sync's offloads, inside ``resident`` (weights and Adam
    state back, grads not); what is resident during the save and after, and the checkpoint."""
    from moe_rl.learner import checkpoint
    from moe_rl.pipeline.offload_timeline import OffloadTimeline

    timeline = OffloadTimeline(None, learner, True)
    with timeline.syncing():
        pass
    with timeline.resident():
        during = _resident(learner)
        path = checkpoint.save(learner, ckpt_dir, STEPS - 1, {"seed": 0})
    after = _resident(learner)
    timeline.finish()
    return {"during": during, "after": after, "back": _resident(learner)}, path


def _layout(model, par: ParallelConfig, ctx, weights, ckpt_dir: str | None) -> dict:
    from moe_rl.learner import checkpoint
    from moe_rl.learner.learner import Learner

    tokens_BS, lens_B, mask_BS = batch_data(model.vocab_size, EVEN_LENS)
    batch = TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)
    optim = OptimConfig(lr=LR, adam_eps=1e-4)
    plain = Learner(model, par, optim, ctx, weights, monitor=False)
    off = Learner(model, par, optim, ctx, weights, monitor=False)
    seen: list = []
    for _ in range(STEPS - 1):
        _step(plain, batch, False, seen)
        _step(off, batch, True, seen)
    out = {"seen": seen, **_layout_facts(off)}
    if ckpt_dir is not None:
        out["engine_start"] = _engine_start(off)
        out["resident_in_save"], path = _save_between_sync_and_rollout(off, ckpt_dir)
        resumed = Learner(model, par, optim, ctx, weights, monitor=False)
        checkpoint.load(resumed, path)
        _step(resumed, batch, True, seen)
    _step(plain, batch, False, seen)
    _step(off, batch, True, seen)
    out["offload_equal"] = _same(plain, off)
    out["resume_equal"] = _same(plain, resumed) if ckpt_dir is not None else None
    out["plain_moved"] = not torch.equal(
        plain.export_canonical()["model.embed_tokens.weight"], weights["model.embed_tokens.weight"]
    )
    return out


def _worker(rank: int, ckpt_dir: str) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl import dist
    from moe_rl.weights.canonical import random_canonical_weights

    weights = random_canonical_weights(MODEL, seed=0)
    ep2 = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=True)
    ctx = dist.init_distributed(ep2, seed=7)
    results = {"ep2": _layout(MODEL, ep2, ctx, weights, ckpt_dir)}
    # bf16 compute params: the fp32 main params are the optimizer's own storage
    results["ep2_bf16"] = _layout(dataclasses.replace(MODEL, precision="bf16"), ep2, ctx, weights, None)
    # without the distributed optimizer: each parameter its own storage, Adam's state unsharded
    ep2_ddp = dataclasses.replace(ep2, distributed_optimizer=False)
    results["ep2_ddp"] = _layout(MODEL, ep2_ddp, ctx, weights, None)
    ps.destroy_model_parallel()
    RouterReplay.clear_global_router_replay_instances()
    tp2 = ParallelConfig(nproc=2, tensor_parallel=2, expert_parallel=1, distributed_optimizer=True)
    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=1)
    results["tp2"] = _layout(MODEL, tp2, dist.ParallelDims.from_parallel_state(), weights, None)
    dist.shutdown()
    return results


@pytest.mark.dist
def test_offloaded_training_is_bitwise_equal_and_frees_every_counted_byte(tmp_path):
    results = run_ranks(_worker, 2, str(tmp_path / "ckpt"))
    for rank, by_layout in enumerate(results):
        for name, r in by_layout.items():
            assert r["offload_equal"], (rank, name)
            assert r["resume_equal"] in ((True,) if name == "ep2" else (None,)), (rank, name)
            assert r["plain_moved"], (rank, name)  # the steps did train
            if name == "ep2":
                saved = r["resident_in_save"]
                full = saved["back"]  # every storage, Adam state included (after 2 steps)
                assert full["optimizer"] > 0 and full["params"] > 0, (rank, full)
                assert saved["during"] == full | {"grads": 0}, (rank, saved)  # the checkpoint's state
                assert saved["after"] == dict.fromkeys(full, 0) and saved["back"] == full, (rank, saved)
                e = r["engine_start"]
                assert e["resident_during"] == 0 and e["weights_equal"], (rank, e)
                assert e["resident_before_after"][0] == e["resident_before_after"][1] > 0, (rank, e)
            if name == "ep2_ddp":
                assert r["own_storage"], rank
            else:
                assert r["params_in_buffers"] and 0 <= r["padding_elements"] < r["padding_bound"], (
                    rank,
                    name,
                )
            steps = r["seen"]
            assert len(steps) == STEPS + (name == "ep2"), (rank, name)
            for i, s in enumerate(steps):
                moved, counted = s["moved"], s["counted"]
                print(
                    f"rank {rank} {name} offload {i}: moved {moved} counted {counted}; "
                    f"RSS before {s['rss_mib'][0]:.0f} MiB, offloaded {s['rss_mib'][1]:.0f} MiB"
                )
                assert {k: getattr(moved, k) for k in counted} == counted, (rank, name, i)
                assert s["before"] == {k: counted[k] for k in s["before"]}, (rank, name, i)
                assert s["during"] == dict.fromkeys(s["before"], 0), (rank, name, i)
                assert s["after"] == s["before"], (rank, name, i)
                # the sync ran with the weights alone on the device, and read them exactly
                sync_resident = dict.fromkeys(s["before"], 0) | {"params": counted["params"]}
                assert s["during_sync"] == {"equal": True, "resident": sync_resident}, (rank, name, i)
                assert s["phases"] == ["offload", "sync", "learner_out", "reload"], (rank, name, i)
                # fp32 grads (grad_reduce_in_fp32) for every param element; fp32 main params of
                # their own only with bf16 params
                assert moved.params > 0 and moved.grads == 4 * r.get("param_elements", moved.params // 4)
                assert (moved.main_params > 0) == name.endswith("bf16"), (rank, name, i)
                # Adam's state exists from the first step on: 2 fp32 tensors per stepped element
                assert (moved.optimizer > 0) == (i > 0)
