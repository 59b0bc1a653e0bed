"""The weight sync (learner -> colocated built-in engine), measured against a plain copy of the same
bytes, on the tiny model and a larger CPU model, in one run (EP=2 over 2 local gloo ranks); then
the weight broadcast learner -> rollout rank (3 local gloo ranks: 2 learner ranks with EP=2 and
``parallel.rollout_ranks=1``) against the same copy.

    python scripts/bench_sync.py [--reps 8] [--hidden 256] [--layers 6] [--experts 32]
                                 [--only colocated|broadcast] [--bucket-mb 64]

Each rank, for each model: ``moe_rl.pipeline.weight_sync.WeightSync.sync`` (the learner's stream of canonical
layers, EP all-gathers and all, into the engine's weights: docs/design.md 14.3) and a plain
``Tensor.copy_`` of as many bytes as the engine receives (the physical limit on this machine: one
memory-to-memory copy), interleaved (sync/copy, copy/sync, ...) with a barrier around each, the
first round a warm-up. Prints per model the bytes, the median seconds of each, and the median of
the per-repetition ratios sync / copy with its 95% interval (scripts/bench_stats.py), then the
machine's load. Numbers and the command: docs/measurements.md 6.

The broadcast (``moe_rl.pipeline.weight_broadcast``, docs/design.md 15.2), timed the same way with a barrier
over every rank: learner rank 0 streams its canonical layers (EP all-gathers with learner rank 1)
into ``broadcast_weights``; the rollout rank receives the whole sync into host buffers
(``PendingWeights.receive``) and applies it to its built-in engine (``apply``). Two wires, each
repetition running both and the copy in a rotating order: the engine's dtype (what a run sends:
bf16, the router fp32) and the learner's fp32 as it is (what runs sent before). Also timed on the
rollout rank alone: the ``apply``, the only part an engine has to pause for. Numbers:
docs/measurements.md 6.1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from bench_stats import MachineLoad, paired_ratios, ratio_line


def _overrides(args, split: bool = False) -> dict[str, list[str]]:
    par = ["parallel.nproc=2", "parallel.expert_parallel=2"]
    if split:
        par = ["parallel.nproc=3", "parallel.rollout_ranks=1", "parallel.expert_parallel=2"]
    larger = [
        "init_weights=",  # random init: the sync moves bytes, whatever they hold
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"model.num_experts={args.experts}",
        f"model.moe_ffn_hidden_size={args.hidden}",
        f"model.ffn_hidden_size={4 * args.hidden}",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        f"model.head_dim={args.hidden // 4}",
    ]
    return {"tiny": par, "larger": par + larger}


def _measure(args) -> list[dict]:
    import torch

    import megatron_patches
    from moe_rl import dist
    from moe_rl.config import Schedule, load_config
    from moe_rl.learner.learner import Learner
    from moe_rl.pipeline.simulated_staleness import SimulatedStaleness
    from moe_rl.pipeline.weight_sync import WeightSync
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.tasks.task import resolve_vocab
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.weights.canonical import canonical_param_shapes
    from moe_rl.weights.warmstart import load_init_weights

    torch.set_num_threads(1)
    megatron_patches.apply_all()
    tok = CharTokenizer()
    ctx, res = None, {}
    for name, overrides in _overrides(args).items():
        cfg = resolve_vocab(load_config(None, overrides), tok)
        if ctx is None:
            ctx = dist.init_distributed(cfg.parallel, seed=0)
        init = load_init_weights(cfg.init_weights, cfg.model, tok)
        learner = Learner(cfg.model, cfg.parallel, cfg.optim, ctx, init)
        engine = BuiltinEngine(cfg.model, dtype=cfg.rollout.dtype, pad_id=tok.pad_id)
        sync = WeightSync(Schedule.from_config(cfg), engine, learner, SimulatedStaleness(0))
        sync.sync()  # the engine's weights exist from here on
        per_value = 2 if cfg.rollout.dtype == "bf16" else 4  # the engine's weights, canonical shapes
        nbytes = per_value * sum(math.prod(s) for s in canonical_param_shapes(cfg.model).values())
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        times: dict[str, list[float]] = {"sync": [], "copy": []}
        for rep in range(args.reps + 1):
            for what in ("sync", "copy") if rep % 2 == 0 else ("copy", "sync"):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if what == "sync":
                    sync.sync()
                else:
                    dst.copy_(src)
                torch.distributed.barrier()
                if rep:  # the first round warms up
                    times[what].append(time.perf_counter() - t0)
        res[name] = {"bytes": nbytes, **times}
        del learner, engine, src, dst
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, res)
    dist.shutdown()
    return gathered


def _broadcast_once(learner, engine, pending, place, version: int, bucket_bytes: int, wire=None) -> float:
    """One sync on this rank of the split world, sent in the engine dtype ``wire`` (None: the
    learner's fp32); on the rollout rank, returns the apply's seconds."""
    from moe_rl.pipeline.weight_broadcast import broadcast_weights

    if learner is None:
        pending.receive(place.sync, expect=version)
        t0 = time.perf_counter()
        pending.apply(engine)
        return time.perf_counter() - t0
    chunks = learner.iter_canonical_layers()
    if place.sync is not None:
        broadcast_weights(chunks, place.sync, version, bucket_bytes, engine=wire)
    else:  # the other learner rank takes part in the stream's gathers
        for _ in chunks:
            pass
    return 0.0


def _measure_broadcast(args) -> dict:
    """One rank of the split world: its times per model (the rollout rank's also ``apply``)."""
    import torch

    import megatron_patches
    from moe_rl import dist
    from moe_rl.config import load_config
    from moe_rl.learner.learner import Learner
    from moe_rl.pipeline.weight_broadcast import PendingWeights
    from moe_rl.rollout.base import ENGINE_DTYPES, engine_dtype
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.tasks.task import resolve_vocab
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.weights.canonical import canonical_param_shapes
    from moe_rl.weights.warmstart import load_init_weights

    torch.set_num_threads(1)
    megatron_patches.apply_all()
    tok = CharTokenizer()
    dims, res = None, {}
    for name, overrides in _overrides(args, split=True).items():
        cfg = resolve_vocab(load_config(None, overrides), tok)
        if dims is None:
            dims = dist.init_distributed(cfg.parallel, seed=0)
        place = dims.placement
        learner = engine = pending = None
        if dims.is_rollout:
            engine, pending = (
                BuiltinEngine(cfg.model, dtype=cfg.rollout.dtype, pad_id=tok.pad_id),
                PendingWeights(),
            )
        else:
            learner = Learner(
                cfg.model, cfg.parallel, cfg.optim, dims, load_init_weights(cfg.init_weights, cfg.model, tok)
            )
        version = 0

        bucket_bytes = args.bucket_mb << 20
        _broadcast_once(learner, engine, pending, place, version, bucket_bytes)  # the engine's weights exist
        # the bytes on each wire: the learner's fp32 canonical weights, or each in the engine's dtype
        assert cfg.model.precision == "fp32", cfg.model.precision
        held = ENGINE_DTYPES[cfg.rollout.dtype]
        shapes = canonical_param_shapes(cfg.model)
        nbytes = {
            "sync": sum(engine_dtype(n, held).itemsize * math.prod(s) for n, s in shapes.items()),
            "sync_fp32": 4 * sum(math.prod(s) for s in shapes.values()),
        }
        src, dst = (torch.ones(nbytes["sync"], dtype=torch.uint8) for _ in range(2))
        times: dict[str, list[float]] = {k: [] for k in ("sync", "sync_fp32", "copy", "apply", "apply_fp32")}
        arms = ("sync", "sync_fp32", "copy")
        for rep in range(args.reps + 1):
            for what in arms[rep % 3 :] + arms[: rep % 3]:
                place.bridge.barrier()
                t0 = time.perf_counter()
                if what != "copy":
                    version += 1
                    wire = held if what == "sync" else None
                    apply_s = _broadcast_once(learner, engine, pending, place, version, bucket_bytes, wire)
                else:
                    dst.copy_(src)
                place.bridge.barrier()
                if rep:  # the first round warms up
                    times[what].append(time.perf_counter() - t0)
                    if what != "copy":
                        times[what.replace("sync", "apply")].append(apply_s)
        res[name] = {"bytes": nbytes, "rollout": dims.is_rollout, **times}
        del learner, engine, src, dst
    place.bridge.barrier()
    return res


def _report_broadcast(ranks: list[dict]) -> None:
    rollout = next(r for r in ranks if next(iter(r.values()))["rollout"])
    for name in ranks[0]:
        sync = [statistics.fmean(ts) for ts in zip(*(r[name]["sync"] for r in ranks))]
        copy = [statistics.fmean(ts) for ts in zip(*(r[name]["copy"] for r in ranks))]
        fp32 = [statistics.fmean(ts) for ts in zip(*(r[name]["sync_fp32"] for r in ranks))]
        apply, nbytes = rollout[name]["apply"], ranks[0][name]["bytes"]
        copy_s = statistics.median(copy)
        for wire, ts, key in (("engine dtype", sync, "apply"), ("fp32", fp32, "apply_fp32")):
            n = nbytes["sync" if wire == "engine dtype" else "sync_fp32"]
            print(
                f"{name}, {wire} wire: {n / 1e6:.1f} MB broadcast to the rollout rank's engine; "
                f"broadcast {statistics.median(ts) * 1e3:.1f} ms "
                f"(of which the engine's apply {statistics.median(rollout[name][key]) * 1e3:.1f} ms)"
            )
        print(
            f"    plain copy of the engine-dtype bytes {copy_s * 1e3:.2f} ms "
            f"({nbytes['sync'] / copy_s / 1e9:.1f} GB/s)"
        )
        print(f"    {ratio_line('ratio broadcast engine dtype/fp32', paired_ratios(sync, fp32))}")
        print(f"    {ratio_line('ratio broadcast/copy', paired_ratios(sync, copy))}")
        print(f"    {ratio_line('ratio apply/copy', paired_ratios(apply, rollout[name]['copy']))}")


def _report(ranks: list[dict]) -> None:
    for name in ranks[0]:

        def per_rep(what: str, name: str = name) -> list[float]:
            return [statistics.fmean(ts) for ts in zip(*(r[name][what] for r in ranks))]

        sync, copy = per_rep("sync"), per_rep("copy")
        nbytes, sync_s, copy_s = ranks[0][name]["bytes"], statistics.median(sync), statistics.median(copy)
        print(
            f"{name}: {nbytes / 1e6:.1f} MB into each rank's engine; sync {sync_s * 1e3:.1f} ms, "
            f"plain copy {copy_s * 1e3:.2f} ms ({nbytes / copy_s / 1e9:.1f} GB/s)"
        )
        print(f"    {ratio_line('ratio sync/copy', paired_ratios(sync, copy))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--only", choices=("colocated", "broadcast"), default=None)
    p.add_argument("--bucket-mb", type=int, default=64, help="the broadcast's bucket size (MiB)")
    args = p.parse_args()
    from moe_rl.launch import spawn_local

    if args.only != "broadcast":
        load = MachineLoad()
        _report(spawn_local(_measure, 2, args)[0])
        print(load.line(2))
    if args.only != "colocated":
        load = MachineLoad()
        ranks = spawn_local(_measure_broadcast, 3, args)
        _report_broadcast([ranks[r] for r in sorted(ranks)])
        print(load.line(3))


if __name__ == "__main__":
    main()
