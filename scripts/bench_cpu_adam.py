"""CPU Adam's throughput on this machine: torch.optim.AdamW(fused=True) over fp32 tensors on the
host, as megatron-core 0.16.1's HybridDeviceOptimizer steps CPU Adam (one AdamW per parameter,
fused=True), in elements a second; moe_rl/memory/host.py's CPU_ADAM_ELEMS_PER_S_PER_CORE is the
one-thread figure (docs/measurements.md 10).

    python scripts/bench_cpu_adam.py [--threads 1] [--elems 16777216] [--tensors 4] [--reps 7]

Each repetition steps every arm once, the arms interleaved (fused and foreach AdamW), after one
warm-up step each; it prints each arm's median elements/s and its spread (min-max) over the
repetitions."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _arm(fused: bool, elems: int, tensors: int):
    params = [torch.zeros(elems // tensors, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kind)
    opt.step()  # Adam's state exists from its first step
    return opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--elems", type=int, default=16 * 2**20, help="elements stepped per arm")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    arms = {"fused": _arm(True, a.elems, a.tensors), "foreach": _arm(False, a.elems, a.tensors)}
    rates: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(a.reps):
        for name, opt in arms.items():
            t0 = time.perf_counter()
            opt.step()
            rates[name].append(a.elems / (time.perf_counter() - t0))
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.elems:,} elements in {a.tensors} tensors")
    for name, r in rates.items():
        print(
            f"{name:8s} median {statistics.median(r) / 1e9:.3f} G elements/s "
            f"(min {min(r) / 1e9:.3f}, max {max(r) / 1e9:.3f}, {a.reps} reps)"
        )


if __name__ == "__main__":
    main()
